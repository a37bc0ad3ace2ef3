"""rosbag2 folders read with rosbags (no ROS install needed): every message as raw CDR bytes, in time order.

Camera topics follow Autoware's sensing launch (``/sensing/camera/camera<i>/<suffix>[/compressed]``; suffix
``image_raw`` in the embedded bag, ``image_rect_color`` in Autoware's launch files), or are named one by one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: The message type of each camera transport a replay plays.
TRANSPORT_TYPES = {"compressed": "sensor_msgs/msg/CompressedImage", "raw": "sensor_msgs/msg/Image"}


def played_topic(base: str, transport: str) -> str:
    """``<base>/compressed`` for "compressed", ``<base>`` for "raw" (image_transport's naming)."""
    return f"{base}/compressed" if transport == "compressed" else base


def camera_topic_pattern(suffix: str = "image_raw") -> re.Pattern:
    """``/sensing/camera/camera<i>/<suffix>[/compressed]``: group 1 the camera index, group 2 ``/compressed``."""
    return re.compile(rf"^/sensing/camera/camera(\d+)/{re.escape(suffix.strip('/'))}(/compressed)?$")


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


def camera_topics(messages: list[BagMessage], transport: str, suffix: str = "image_raw",
                  topics: list[str] | None = None) -> list[str]:
    """The cameras' base image topics (without ``/compressed``) in model camera order, for ``transport``
    (:data:`TRANSPORT_TYPES`): ``topics`` if given (each in the bag with the transport's type), else
    ``/sensing/camera/camera<i>/<suffix>`` in index order. Raises ValueError, listing the bag's image topics, when
    a named topic is missing or of another type, or none is found."""
    wanted = TRANSPORT_TYPES[transport]
    typed = {m.topic: m.msgtype for m in messages}
    images = sorted(t for t, kind in typed.items() if kind == wanted)
    have = f"the bag's {transport} image topics: {', '.join(images) or 'none'}"
    if topics:
        bases = [t.rstrip("/").removesuffix("/compressed") for t in topics]
        bad = [played_topic(b, transport) for b in bases if typed.get(played_topic(b, transport)) != wanted]
        if bad:
            raise ValueError(f"{', '.join(bad)}: not in the bag as {wanted} ({have})")
        if len(set(bases)) != len(bases):
            raise ValueError(f"a camera topic is named twice: {', '.join(bases)}")
        return bases
    pattern = camera_topic_pattern(suffix)
    found = {}
    for topic, kind in typed.items():
        match = pattern.match(topic)
        if match and bool(match.group(2)) == (transport == "compressed") and kind == wanted:
            found[int(match.group(1))] = topic.removesuffix("/compressed")
    if not found:
        like = played_topic(f"/sensing/camera/camera0/{suffix}", transport)
        raise ValueError(f"the bag has no {transport} camera topics like {like} ({have})")
    return [found[i] for i in sorted(found)]
