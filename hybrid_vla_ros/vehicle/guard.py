"""Output guard: is a trajectory fit to publish? (ROS-free; the suffix node runs it right before publishing.)

:func:`find_violations` checks one :class:`~hybrid_vla_ros.vehicle.trajectory.TrajectoryArrays` against
:class:`GuardLimits`; the node drops a trajectory with any violation and publishes nothing for that frame (the
controller keeps its previous trajectory). Units: m, s, m/s, m/s^2, 1/m, rad; stamps in integer ns.

Checks, in the order of :data:`CAUSES`, each reported once at its worst point:

* ``non_finite`` (NaN/inf in any field), ``too_few_points`` (< 2): the other checks are then skipped.
* ``time_not_increasing``: ``time_from_start`` not strictly increasing.
* ``no_clock``: the clock reads 0 (``use_sim_time`` before the first ``/clock``), reported instead of
  ``future_stamp``; ``too_old``: ``now - stamp > max_age_s``; ``future_stamp``: ``stamp - now > max_future_s``
  (a camera/computer clock problem). These three only when ``check_age`` is set.
* ``yaw_deviation``: the first point (the ego pose at the stamp) faces more than ``max_yaw_deviation_rad``
  away from ``ego_yaw`` (odometry); only when ``ego_yaw`` is given.
* ``too_fast``: ``|longitudinal_velocity_mps| > max_speed_mps`` (point 0 carries the measured ego speed).
* ``accel_too_high`` / ``decel_too_high``: ``acceleration_mps2`` outside ``[min_acceleration_mps2,
  max_acceleration_mps2]``. That field is the change of speed *magnitude* (TrajectoryPoint.msg), so a
  forward <-> reverse switch also counts as a deceleration of ``(|v_k| + |v_k+1|) / dt``.
* ``lateral_accel_too_high``: ``v^2 |kappa|``, ``v`` the faster of the point and the next one.
* ``curvature_too_high``: ``|kappa|``, or the curvature ``|heading_rate / v|`` of a published heading rate.
* ``steering_too_high``: ``|front_wheel_angle_rad|``.

Curvature is :func:`~hybrid_vla_ros.vehicle.trajectory.chord_curvatures` over chords >= ``min_segment_m``, the
measure the published heading rates and steering come from, so guard and message agree by construction. At
standstill waypoints jitter by centimetres (hundreds of 1/m over 1 cm): with the default 1 m they get curvature
0 and pass, while real turns are measured in full.

Defaults follow Autoware Universe ``autoware_planning_validator`` (``config/planning_validator.param.yaml``,
``validity_checks``; ``planning_validator.cpp``):

* acceleration max 9.8 / min -9.8 / lateral 9.8: ``acceleration.longitudinal_max_th`` / ``longitudinal_min_th``
  / ``lateral_th``; ``max_curvature_per_m`` 1.0: ``curvature.threshold``; ``max_steering_rad`` 1.414:
  ``steering.threshold``;
* ``max_yaw_deviation_rad`` 1.5708: ``deviation.yaw_th`` (in the later plugin layout
  ``autoware_planning_validator_trajectory_checker``'s ``trajectory_checker.yaw_deviation.threshold``);
* ``max_age_s`` 1.0: ``latency.threshold``; ``check_age``: ``latency.enable``;
* ``min_segment_m`` 1.0: the validator resamples with ``min_interval = 1.0`` m before its curvature, lateral
  acceleration and steering checks, and measures curvature over ``curvature_distance = 1.0`` m;
* ``max_speed_mps`` 11.1 (40 km/h): the validator has no speed bound; this is ``max_vel`` of autoware_launch's
  ``config/planning/scenario_planning/common/common.param.yaml``. Raise it to your operating domain's.
* ``max_future_s`` 0.1: no Autoware counterpart (synchronized clocks differ by well under 1 ms).

A NaN limit rejects everything (every comparison is written as "not within the limit").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from .trajectory import TrajectoryArrays, chord_curvatures

__all__ = ["CAUSES", "GuardLimits", "Violation", "check_trajectory", "find_violations"]

CAUSES = (
    "non_finite", "too_few_points", "time_not_increasing", "no_clock", "too_old", "future_stamp", "yaw_deviation",
    "too_fast", "accel_too_high", "decel_too_high", "lateral_accel_too_high", "curvature_too_high",
    "steering_too_high",
)
"""Every violation cause, most important first (the node drops a frame as ``guard_<first cause>``)."""

PARAMETER_PREFIX = "guard."
"""The node parameter of field ``f`` is ``guard.<f>`` (schema/suffix_node.schema.json)."""


@dataclass(frozen=True)
class GuardLimits:
    """Limits of :func:`find_violations`; the module docstring gives each field's check and source."""

    max_speed_mps: float = 11.1
    max_acceleration_mps2: float = 9.8
    min_acceleration_mps2: float = -9.8
    max_lateral_acceleration_mps2: float = 9.8
    max_curvature_per_m: float = 1.0
    max_steering_rad: float = 1.414
    max_yaw_deviation_rad: float = 1.5708
    min_segment_m: float = 1.0
    check_age: bool = True
    max_age_s: float = 1.0
    max_future_s: float = 0.1

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> "GuardLimits":
        """The limits from validated node parameters ``guard.<field>``; a missing one keeps its default."""
        return cls(**{f.name: values[PARAMETER_PREFIX + f.name] for f in fields(cls)
                      if PARAMETER_PREFIX + f.name in values})


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``cause`` (one of :data:`CAUSES`) and what was found, in words."""

    cause: str
    detail: str

    def __str__(self) -> str:
        return f"{self.cause}: {self.detail}"


def check_trajectory(arrays: TrajectoryArrays, stamp_ns: int, now_ns: int, limits: GuardLimits, *,
                     ego_yaw: float | None = None) -> list[str]:
    """The causes of :func:`find_violations` (same arguments); ``[]`` when the trajectory is valid."""
    return [v.cause for v in find_violations(arrays, stamp_ns, now_ns, limits, ego_yaw=ego_yaw)]


def find_violations(arrays: TrajectoryArrays, stamp_ns: int, now_ns: int,
                    limits: GuardLimits, *, ego_yaw: float | None = None) -> list[Violation]:
    """Every violation, in the order of :data:`CAUSES`; ``[]`` when the trajectory is valid.

    ``stamp_ns``: ``header.stamp``; ``now_ns``: the clock (ns, 0 = not started); ``ego_yaw``: odometry heading
    (rad, map frame) at the stamp, None skips ``yaw_deviation``; a non-finite one is a violation."""
    found: list[Violation] = []
    bad = [f.name for f in fields(arrays) if not np.all(np.isfinite(getattr(arrays, f.name)))]
    if bad:
        k = int(np.flatnonzero(~np.isfinite(getattr(arrays, bad[0])))[0])
        return [Violation("non_finite", f"{', '.join(bad)} not finite (first: {bad[0]} at point {k})")]
    n = len(arrays)
    if n < 2:
        return [Violation("too_few_points", f"{n} point{'s' if n != 1 else ''}, at least 2 needed")]

    dt = np.diff(arrays.t)
    if not np.all(dt > 0):
        k = int(np.flatnonzero(~(dt > 0))[0])
        found.append(Violation("time_not_increasing", f"time_from_start {arrays.t[k]:.3f} s at point {k} "
                                                      f"then {arrays.t[k + 1]:.3f} s"))
    if limits.check_age:
        found += _age_violations(int(stamp_ns), int(now_ns), limits)
    if ego_yaw is not None:
        deviation = abs(math.remainder(float(arrays.yaw[0]) - float(ego_yaw), 2.0 * math.pi))
        if not deviation <= limits.max_yaw_deviation_rad:
            found.append(Violation("yaw_deviation", f"first point faces {deviation:.3f} rad away from the ego "
                                                    f"heading {float(ego_yaw):.3f} rad > "
                                                    f"{limits.max_yaw_deviation_rad} rad"))

    speed = np.abs(arrays.v)
    _worst_above(found, "too_fast", speed, limits.max_speed_mps, "|v| {:.2f} m/s at point {} > {} m/s")
    _worst_above(found, "accel_too_high", arrays.acc, limits.max_acceleration_mps2,
                 "acceleration {:.2f} m/s^2 at point {} > {} m/s^2")
    # deceleration: the acceleration field, and the stop implied by a forward <-> reverse switch
    decel = -arrays.acc.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        flip = (np.sign(arrays.v[:-1]) * np.sign(arrays.v[1:]) < 0) & (dt > 0)
        reversal = np.where(flip, (speed[:-1] + speed[1:]) / np.where(dt > 0, dt, 1.0), 0.0)
    decel[:-1] = np.maximum(decel[:-1], reversal)
    _worst_above(found, "decel_too_high", decel, -limits.min_acceleration_mps2,
                 "deceleration {:.2f} m/s^2 at point {} > {} m/s^2")

    kappa = np.abs(chord_curvatures(arrays.x, arrays.y, float(arrays.yaw[0]), limits.min_segment_m))
    vmax = np.maximum(speed, np.append(speed[1:], speed[-1]))  # the faster of the point and the next one
    _worst_above(found, "lateral_accel_too_high", vmax ** 2 * kappa, limits.max_lateral_acceleration_mps2,
                 "lateral acceleration {:.2f} m/s^2 at point {} > {} m/s^2")
    with np.errstate(divide="ignore", invalid="ignore"):  # the message's own heading rate, where it moves
        field = np.where(speed > 0.0, np.abs(arrays.heading_rate) / speed, 0.0)
    _worst_above(found, "curvature_too_high", np.maximum(kappa, field), limits.max_curvature_per_m,
                 "curvature {:.3f} 1/m at point {} > {} 1/m")
    _worst_above(found, "steering_too_high", np.abs(arrays.front_wheel_angle), limits.max_steering_rad,
                 "|front wheel angle| {:.3f} rad at point {} > {} rad")
    return found


def _age_violations(stamp_ns: int, now_ns: int, limits: GuardLimits) -> list[Violation]:
    """``no_clock``, or ``too_old`` / ``future_stamp``."""
    if now_ns <= 0:
        return [Violation("no_clock", f"the clock reads {now_ns} ns (not started: with use_sim_time it stays 0 "
                                      "until the first /clock message), so the stamp's age cannot be judged")]
    found = []
    age_s = (now_ns - stamp_ns) * 1e-9
    if not age_s <= limits.max_age_s:
        found.append(Violation("too_old", f"stamp is {age_s:.3f} s old > {limits.max_age_s} s"))
    if not -age_s <= limits.max_future_s:
        found.append(Violation("future_stamp", f"stamp is {-age_s:.3f} s ahead of the clock "
                                               f"> {limits.max_future_s} s"))
    return found


def _worst_above(found: list[Violation], cause: str, values, limit: float, text: str, *, index=None) -> None:
    """Append ``cause`` at the largest value not <= ``limit`` (``index``: positions to point indices)."""
    values = np.asarray(values, dtype=np.float64)
    over = ~(values <= limit)
    if np.any(over):
        k = int(np.argmax(np.where(over, values, -np.inf)))
        point = int(index[k]) if index is not None else k
        found.append(Violation(cause, text.format(values[k], point, limit)))
