"""The one start-up of both node executables: pin the process, then import the node module and run the node.

Light on purpose: it imports only the standard library and the ROS-free helpers below (PyYAML through
``params_file``), so nothing has started a thread pool when :func:`~hybrid_vla_ros.util.cores.pin_then_import`
pins the process to the node's ``cpu_affinity`` and sets the thread-count variables; the node module (torch,
OpenCV, rclpy) is imported after that.
"""
from __future__ import annotations

import faulthandler
import sys

from ..util.cores import pin_then_import
from ..util.process import exit_with_parent
from .params_file import cpu_affinity_from_ros_args

__all__ = ["run_pinned"]


def run_pinned(node_name: str, node_module: str, node_class: str, args: list[str] | None = None) -> int:
    """Run node ``node_class`` of module ``node_module`` as process ``node_name`` ('prefix_node' or
    'suffix_node') with the command line ``args`` (default ``sys.argv``).

    Ends with the parent process when started by ``hybrid-vla replay`` (``util.process.exit_with_parent``),
    pins the process to ``cpu_affinity`` from the command line or a params file (``-p`` or ``--params-file``,
    launch_ros' files included; every thread and the thread-count variables), then imports the node module and
    runs the node (``node_base.run_node``, which does not return after a spin). A fatal signal (SIGSEGV, SIGBUS,
    SIGABRT, SIGFPE, SIGILL) prints the Python stack of every thread to stderr (``faulthandler``), so a native
    crash leaves in the node's log where each thread was. Returns 2, with one line
    '<node_name>: <why>' on stderr, when ``cpu_affinity`` or the other parameters cannot be read or the cores
    cannot be used (the ValueError of ``pin_then_import``); else the node's exit code (0 after a clean
    SIGINT / SIGTERM shutdown)."""
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
