"""rosbag2 folders read with rosbags (no ROS install needed): every message as raw CDR bytes, in time order.

Camera topics follow the naming of the embedded bag and of Autoware's sensing launch
(``/sensing/camera/camera<i>/image_raw[/compressed]``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CAMERA_TOPIC = re.compile(r"^/sensing/camera/camera(\d+)/image_raw(/compressed)?$")


@dataclass
class BagMessage:
    """One message of the bag: topic, type name (pkg/msg/Name), receive time (ns) and CDR bytes."""

    topic: str
    msgtype: str
    t_ns: int
    raw: bytes


def read_bag(path: str | Path) -> list[BagMessage]:
    """All messages of a rosbag2 folder in time order. Raises FileNotFoundError / rosbags errors."""
    from rosbags.highlevel import AnyReader

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no bag at {path}")
    with AnyReader([path]) as reader:
        return [BagMessage(c.topic, c.msgtype, t, bytes(raw)) for c, t, raw in reader.messages()]


def camera_topics(messages: list[BagMessage], transport: str) -> list[str]:
    """Base image topics (without /compressed) of /sensing/camera/camera<i>/image_raw[/compressed],
    in camera-index order, for the transport asked. Raises ValueError when there are none."""
    found = {}
    for m in messages:
        match = CAMERA_TOPIC.match(m.topic)
        if match and bool(match.group(2)) == (transport == "compressed"):
            found[int(match.group(1))] = m.topic.removesuffix("/compressed")
    if not found:
        raise ValueError(f"the bag has no {transport} camera topics like /sensing/camera/camera0/image_raw")
    return [found[i] for i in sorted(found)]
