"""MCAP rosbag2 writer for the replay's outputs (rosbags, with message definitions embedded)."""
from __future__ import annotations

import functools
import shutil
import threading
from pathlib import Path

from ..util.paths import share_directory


#: Autoware packages -> the message types the replay's output bag may hold, read from their installed .msg files.
AUTOWARE_TYPES = {"autoware_planning_msgs": ("TrajectoryPoint", "Trajectory"),
                  "autoware_internal_debug_msgs": ("StringStamped",)}


@functools.cache
def typestore():
    """rosbags Kilted typestore plus :data:`AUTOWARE_TYPES` read from the installed .msg files (made once).
    Raises FileNotFoundError when an Autoware message package is not installed."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for package, names in AUTOWARE_TYPES.items():
        share = share_directory(package) / "msg"
        for name in names:
            types.update(get_types_from_msg((share / f"{name}.msg").read_text(), f"{package}/msg/{name}"))
    store.register(types)
    return store


class OutputBag:
    """Thread-safe MCAP bag at ``path`` (a rosbag2 folder).

    If ``path`` exists: with ``overwrite`` a previous rosbag2 folder there (one holding metadata.yaml)
    is replaced; otherwise, or when it is not a bag folder, a number is appended to the name.
    """

    def __init__(self, path: str | Path, overwrite: bool = False):
        from rosbags.rosbag2 import StoragePlugin, Writer

        path = Path(path)
        if overwrite and path.is_dir() and (path / "metadata.yaml").is_file():
            shutil.rmtree(path)
        candidate, i = path, 1
        while candidate.exists():
            candidate, i = path.with_name(f"{path.name}_{i}"), i + 1
        self.path = candidate
        self._store = typestore()
        self._writer = Writer(self.path, version=8, storage_plugin=StoragePlugin.MCAP)
        self._writer.open()
        self._lock = threading.Lock()
        self._closed = False

    def add_topic(self, topic: str, msgtype: str):
        """Register a topic; returns the connection to pass to ``write``."""
        with self._lock:
            return self._writer.add_connection(topic, msgtype, typestore=self._store)

    def write(self, connection, t_ns: int, raw: bytes) -> None:
        """Append CDR bytes (from rclpy.serialization.serialize_message) at time ``t_ns``."""
        with self._lock:
            if not self._closed:
                self._writer.write(connection, t_ns, raw)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._writer.close()
