"""One frame's planner output -> the trajectories a suffix may publish, each through the output guard.

ROS-free: the suffix node (``ros/suffix_outputs.py``) calls :func:`guarded_outputs` with the frame's waypoints
and the ego pose at its camera stamp, then publishes what it returns and counts what it drops. A
trajectory that cannot be converted or that fails the guard is never published: it comes back as a drop
(cause, message), one per trajectory, naming its first guard violation.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .guard import GuardLimits, Violation, find_violations
from .trajectory import EgoState, TrajectoryArrays, waypoints_to_trajectory


@dataclass
class GuardedOutputs:
    """What one frame may publish.

    Attributes:
        selected: the selected mode's trajectory, ``None`` when it could not be converted (then nothing
            else is built: the frame is dropped as ``bad_waypoints``).
        violations: the output guard's findings on ``selected`` (empty: it may be published).
        candidates: with candidates asked for, every mode that converts and passes the guard, in mode
            order (the selected mode's entry is ``selected`` itself).
        drops: ``(cause, message)`` per trajectory left out: ``bad_waypoints`` or ``guard_<cause>`` for the
            selected mode, ``candidate_bad_waypoints`` or ``candidate_guard_<cause>`` for other candidates.
    """

    selected: TrajectoryArrays | None
    violations: list[Violation] = field(default_factory=list)
    candidates: list[TrajectoryArrays] = field(default_factory=list)
    drops: list[tuple[str, str]] = field(default_factory=list)


def guarded_outputs(waypoints: np.ndarray, modes: np.ndarray | None, mode: int, dt_s: float, ego: EgoState,
                    wheelbase_m: float, limits: GuardLimits, stamp_ns: int, now_ns: int, *,
                    candidates: bool = False, mode_names: tuple[str, ...] = (),
                    to_base_link: Callable[[np.ndarray], np.ndarray] | None = None) -> GuardedOutputs:
    """Convert a frame's waypoints (and with ``candidates`` every planner mode) into map-frame trajectories
    (:func:`~.trajectory.waypoints_to_trajectory`) and judge each with the output guard
    (:func:`~.guard.find_violations`, the age checks against ``now_ns``).

    Args:
        waypoints: ``(N, 2)`` float, the selected mode's waypoints in the ego frame at the camera stamp (m).
        modes: ``(M, N, 2)`` float, every mode's waypoints, or ``None`` for a one-mode planner.
        mode: index of the selected mode in ``modes`` (ignored when ``modes`` is ``None``).
        dt_s: time between waypoints (s). ego: the ego pose and speed at the camera stamp (map frame).
        wheelbase_m: for ``front_wheel_angle_rad`` (m). limits: the output guard's limits.
        stamp_ns: the frame's camera stamp; now_ns: the node clock now (ns).
        candidates: also build the candidate list. mode_names: a name per mode for the drop messages
            (its index where missing).
        to_base_link: applied to each mode's waypoints first when they are not base_link's (the published
            planners' model-frame track: :func:`~.trajectory.model_track_to_base_link`); its ValueError is that
            mode's ``bad_waypoints`` / ``candidate_bad_waypoints`` drop, the other modes unaffected.
    Returns:
        :class:`GuardedOutputs`. Raises nothing for bad waypoints: those are drops.
    """
    def convert(w) -> TrajectoryArrays:
        if to_base_link is not None:
            w = to_base_link(w)
        return waypoints_to_trajectory(w, dt_s, ego, wheelbase_m, heading_min_segment_m=limits.min_segment_m)

    def judge(arrays) -> list[Violation]:
        return find_violations(arrays, stamp_ns, now_ns, limits, ego_yaw=ego.yaw)

    try:
        selected = convert(waypoints)
    except ValueError as e:
        return GuardedOutputs(None, drops=[("bad_waypoints", str(e))])
    out = GuardedOutputs(selected, judge(selected))
    if out.violations:
        out.drops.append((f"guard_{out.violations[0].cause}",
                          "trajectory not published: " + "; ".join(map(str, out.violations))))
    if not candidates:
        return out
    all_modes = modes if modes is not None else np.asarray(waypoints)[None]
    chosen = mode if modes is not None else 0
    for i, w in enumerate(all_modes):
        name = mode_names[i] if i < len(mode_names) else str(i)
        if i == chosen:
            arrays, violations = selected, out.violations
        else:
            try:
                arrays = convert(w)
            except ValueError as e:
                out.drops.append(("candidate_bad_waypoints", f"candidate {name} left out: {e}"))
                continue
            violations = judge(arrays)
        if violations:
            out.drops.append((f"candidate_guard_{violations[0].cause}",
                              f"candidate {name} left out: " + "; ".join(map(str, violations))))
            continue
        out.candidates.append(arrays)
    return out
