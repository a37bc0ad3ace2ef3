"""suffix_node: shared-memory ring -> decoder blocks [K, L), norm, planning head -> Autoware Trajectory.

The process is pinned to ``cpu_affinity`` before torch or rclpy is imported (:mod:`.entry`), so every thread
runs on the spare cores.

Lifecycle: configure validates parameters, pins again and loads the suffix on the CPU; activate subscribes and
starts the worker (it attaches to the prefix's ring, waiting for it); deactivate stops it; cleanup / shutdown
detach and free the model.
Outputs: ``~/output/trajectory`` (frame ``output_frame``, stamped with the camera stamp, only what passes the
output guard), ``~/output/candidate_trajectories`` (with ``publish_candidate_trajectories``),
``~/output/reasoning`` (a model that decodes), ``~/debug/frame_timing`` (DiagnosticArray per frame, ms),
``~/debug/trajectory_markers`` and ``~/debug/reasoning_text`` (RViz, while subscribed) and ``/diagnostics`` (1 Hz).
The node class is ``_suffix_impl.SuffixNode``; its parts are :mod:`.suffix_inputs`, :mod:`.suffix_worker` and
:mod:`.suffix_outputs`.
"""
from __future__ import annotations

import sys

from .entry import run_pinned

#: The module holding the node class, imported once the process is pinned.
NODE_MODULE = "hybrid_vla_ros.ros._suffix_impl"


def main(args: list[str] | None = None) -> int:
    """Console entry point (``ros2 run hybrid_vla_ros suffix_node``); exit codes of :func:`~.entry.run_pinned`."""
    return run_pinned("suffix_node", NODE_MODULE, "SuffixNode", args)


if __name__ == "__main__":
    sys.exit(main())
