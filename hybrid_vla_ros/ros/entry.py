"""The one start-up of both node executables: pin the process, then import the node module and run the node.

It imports only the standard library and ROS-free helpers (PyYAML), so no thread pool exists yet when
:func:`~hybrid_vla_ros.util.cores.pin_then_import` pins the process; torch, OpenCV and rclpy come after.
"""
from __future__ import annotations

import faulthandler
import sys

from ..util.cores import pin_then_import
from ..util.process import exit_with_parent
from .params_file import cpu_affinity_from_ros_args

__all__ = ["run_pinned"]


def run_pinned(node_name: str, node_module: str, node_class: str, args: list[str] | None = None) -> int:
    """Run ``node_module.node_class`` as process ``node_name`` with ``args`` (default ``sys.argv``).

    Ends with a ``hybrid-vla replay`` parent, pins to ``cpu_affinity`` (``-p`` or a params file), then runs the
    node; a fatal signal dumps every thread's Python stack to stderr (``faulthandler``). Returns 2 with one line
    '<node_name>: <why>' on stderr when the parameters cannot be read or the cores used, else the node's exit
    code (0 after a clean SIGINT / SIGTERM)."""
    argv = args if args is not None else sys.argv
    faulthandler.enable(all_threads=True)
    exit_with_parent()
    try:
        early, module = pin_then_import(lambda: cpu_affinity_from_ros_args(argv, node_name), node_module)
    except ValueError as e:
        print(f"{node_name}: {e}", file=sys.stderr)
        return 2
    from . import node_base

    node_type = getattr(module, node_class)
    return node_base.run_node(node_name, lambda: node_type(early_affinity=early), argv)
