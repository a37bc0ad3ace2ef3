"""prefix_node's entry point (the console script and ``python -m hybrid_vla_ros.ros.prefix_node``): pin the
process first (:mod:`.entry`), then import :mod:`.prefix_node`.
"""
from __future__ import annotations

import sys

from .entry import run_pinned

__all__ = ["main"]

#: The module holding the node class, imported once the process is pinned.
NODE_MODULE = "hybrid_vla_ros.ros.prefix_node"


def main(args: list[str] | None = None) -> int:
    """Console entry point (``ros2 run hybrid_vla_ros prefix_node``); exit codes of :func:`~.entry.run_pinned`."""
    return run_pinned("prefix_node", NODE_MODULE, "PrefixNode", args)


if __name__ == "__main__":
    sys.exit(main())
