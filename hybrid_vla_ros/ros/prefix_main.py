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

from ..util.cores import pin_then_import
from ..util.process import exit_with_parent
from .params_file import cpu_affinity_from_ros_args

__all__ = ["main"]

#: The module holding the node class, imported once the process is pinned.
NODE_MODULE = "hybrid_vla_ros.ros.prefix_node"


def main(args: list[str] | None = None) -> int:
    """Console entry point: ``ros2 run hybrid_vla_ros prefix_node --ros-args -p cpu_affinity:=[0,1] ...``.

    Pins the process to ``cpu_affinity`` from the command line or a params file (every thread, and the
    thread-count variables, :func:`~hybrid_vla_ros.util.cores.pin_then_import`), then imports the node and
    runs it (``node_base.run_node``). Exit code 0 after a clean shutdown (SIGINT / SIGTERM), 2 when
    ``cpu_affinity`` or the other parameters given cannot be read or the cores cannot be used.
    """
    argv = args if args is not None else sys.argv
    exit_with_parent()  # started by `hybrid-vla replay`: end with it
    try:
        early, node_module = pin_then_import(lambda: cpu_affinity_from_ros_args(argv, "prefix_node"), NODE_MODULE)
    except ValueError as e:
        print(f"prefix_node: {e}", file=sys.stderr)
        return 2
    from . import node_base

    return node_base.run_node("prefix_node", lambda: node_module.PrefixNode(early_affinity=early), argv)


if __name__ == "__main__":
    sys.exit(main())
