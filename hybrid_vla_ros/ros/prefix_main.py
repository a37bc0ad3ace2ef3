"""prefix_node's entry point: pin the process first, then import the node (OpenCV, torch, rclpy).

The ``prefix_node`` executable (setup.py's console script, what ``ros2 run`` / ``ros2 launch`` start) and
``python -m hybrid_vla_ros.ros.prefix_node`` both run :func:`main` here. This module imports only the
standard library, PyYAML and the ROS-free helpers below, so nothing has started a thread pool when
:func:`~hybrid_vla_ros.util.cores.pin_then_import` pins the process to the node's ``cpu_affinity`` and sets
the thread-count variables; :mod:`.prefix_node` (cv2, and torch through the prefix runner) is imported after
it, as the suffix's node module is (:mod:`.suffix_node`).
"""
from __future__ import annotations

import sys

from .entry import run_pinned

__all__ = ["main"]

#: The module holding the node class, imported once the process is pinned.
NODE_MODULE = "hybrid_vla_ros.ros.prefix_node"


def main(args: list[str] | None = None) -> int:
    """Console entry point: ``ros2 run hybrid_vla_ros prefix_node --ros-args -p cpu_affinity:=[0,1] ...``
    (:func:`~.entry.run_pinned`: exit code 0 after a clean shutdown, 2 when ``cpu_affinity`` or the other
    parameters given cannot be read or the cores cannot be used)."""
    return run_pinned("prefix_node", NODE_MODULE, "PrefixNode", args)


if __name__ == "__main__":
    sys.exit(main())
