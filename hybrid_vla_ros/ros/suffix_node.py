"""suffix_node: shared-memory ring -> decoder blocks [K, L), norm, planning head -> Autoware Trajectory.

The process pins itself to ``cpu_affinity`` and sets the thread-count variables (``OMP_NUM_THREADS`` ...)
before torch or rclpy is imported (``main``, through ``util.cores.pin_then_import``, as the prefix's
``prefix_main``), so every thread it ever starts (OpenMP pool, DDS, executor) runs on the spare cores and
torch's pool is sized to them from the start.

Lifecycle:
  on_configure  validate parameters, pin again (every thread), load the suffix on the CPU;
  on_activate   subscribe to odometry and the navigation command, start the worker (it attaches to
                the prefix's ring, waiting for it if the prefix is not configured yet);
  on_deactivate stop the worker;  on_cleanup / on_shutdown  detach from the ring, free the model.
Output: ``~/output/trajectory`` (autoware_planning_msgs/Trajectory, frame ``output_frame``,
header.stamp = the camera stamp of the frame; only trajectories that pass the output guard,
``vehicle/guard.py`` with the ``guard.*`` parameters: the others are dropped as ``guard_<cause>``),
``~/output/candidate_trajectories`` with ``publish_candidate_trajectories`` (autoware_internal_planning_msgs/
CandidateTrajectories: every planner mode that passes the same conversion and guard, one generator_id fixed
per node name, see ``msg_conv.generator_uuid``), ``~/debug/frame_timing`` (DiagnosticArray, one per frame,
same stamp, per-stage milliseconds) and ``/diagnostics`` (1 Hz).
Navigation command: the ``navigation_command`` parameter (read at configure, applied at once when set
while running) or a name on ``~/input/navigation_command`` (std_msgs/String), the latest of the two,
selects the planner mode of the next frame; ``/diagnostics`` shows the command in use.
The node class is ``_suffix_impl.SuffixNode`` (imported once the process is pinned); its parts are
``suffix_inputs`` (odometry, navigation command), ``suffix_worker`` (the ring side) and ``suffix_outputs``
(the guarded trajectory, candidates and frame timing).
"""
from __future__ import annotations

import sys

from .entry import run_pinned

#: The module holding the node class, imported once the process is pinned.
NODE_MODULE = "hybrid_vla_ros.ros._suffix_impl"


def main(args: list[str] | None = None) -> int:
    """Console entry point: ``ros2 run hybrid_vla_ros suffix_node --ros-args -p cpu_affinity:=[2,3] ...``
    (:func:`~.entry.run_pinned`, the one start-up both nodes share: exit code 0 after a clean shutdown, 2 when
    ``cpu_affinity`` or the other parameters given cannot be read or the cores cannot be used)."""
    return run_pinned("suffix_node", NODE_MODULE, "SuffixNode", args)


if __name__ == "__main__":
    sys.exit(main())
