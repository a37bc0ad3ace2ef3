"""One frame's planner output -> the trajectories a suffix may publish, each through the output guard.

ROS-free; called by ``ros/suffix_outputs.py``. A trajectory that cannot be converted or fails the guard is never
published: it comes back as one drop (cause, message) naming its first violation.
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

    ``selected`` is None when it could not be converted (nothing else is built); ``violations``: the guard's
    findings on it (empty: publishable); ``candidates``: every mode that converts and passes, in mode order;
    ``drops``: ``(cause, message)`` per trajectory left out, ``bad_waypoints`` / ``guard_<cause>`` or with a
    ``candidate_`` prefix.
    """

    selected: TrajectoryArrays | None
    violations: list[Violation] = field(default_factory=list)
    candidates: list[TrajectoryArrays] = field(default_factory=list)
    drops: list[tuple[str, str]] = field(default_factory=list)
    #: the planner mode index of each entry of ``candidates``
    candidate_modes: list[int] = field(default_factory=list)


def guarded_outputs(waypoints: np.ndarray, modes: np.ndarray | None, mode: int, dt_s: float, ego: EgoState,
                    wheelbase_m: float, limits: GuardLimits, stamp_ns: int, now_ns: int, *,
                    candidates: bool = False, mode_names: tuple[str, ...] = (),
                    to_base_link: Callable[[np.ndarray], np.ndarray] | None = None) -> GuardedOutputs:
    """The frame's waypoints (with ``candidates``, every mode) as map-frame trajectories, each judged by
    :func:`~.guard.find_violations`. Raises nothing for bad waypoints: those are drops.

    ``waypoints``: ``(N, 2)`` m, the selected mode, ego frame at the camera stamp ``stamp_ns``; ``modes``:
    ``(M, N, 2)`` or None for a one-mode planner (then ``mode`` is ignored); ``now_ns``: the node clock;
    ``mode_names`` name modes in drop messages (index where missing); ``to_base_link`` (e.g.
    :func:`~.trajectory.model_track_to_base_link`) is applied first, its ValueError that mode's drop.
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
        out.candidate_modes.append(i)
    return out
