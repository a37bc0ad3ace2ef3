"""Output guard: is a trajectory fit to publish? (ROS-free; the suffix node runs it right before publishing.)

A model can emit anything: NaN, a point behind the previous one in time, 200 km/h, a hairpin at speed.
:func:`find_violations` checks one :class:`~hybrid_vla_ros.vehicle.trajectory.TrajectoryArrays` against
:class:`GuardLimits` and names every violation; the node drops a trajectory that has any and publishes
nothing for that frame (the controller keeps its previous trajectory, as with any other dropped frame).

Units: metres (m), seconds (s), m/s, m/s^2, curvature in 1/m, angles in rad, stamps in integer ns.

Checks, most important first (the order of :data:`CAUSES`; a trajectory is reported once per cause, at
its worst point):

* ``non_finite``: a NaN or infinity in any field (the other checks are then skipped).
* ``too_few_points``: fewer than 2 points (the other checks are then skipped).
* ``time_not_increasing``: ``time_from_start`` not strictly increasing.
* ``no_clock``: the clock reads 0 (not started: a node with ``use_sim_time`` before its first ``/clock``
  message), so no age can be judged; reported instead of ``future_stamp``, which any real stamp
  would be then. Only when ``check_age`` is set.
* ``too_old``: ``now - header.stamp > max_age_s``, with ``now`` the node clock; ``future_stamp``: the
  stamp lies more than ``max_future_s`` ahead of ``now`` (a clock problem between camera and computer).
  Both only when ``check_age`` is set.
* ``yaw_deviation``: the first point (the ego pose at the camera stamp, the point nearest the ego)
  faces more than ``max_yaw_deviation_rad`` away from the ego heading ``ego_yaw`` (odometry). Only
  when the caller passes ``ego_yaw``.
* ``too_fast``: ``|longitudinal_velocity_mps| > max_speed_mps`` at any point (point 0 carries the
  measured ego speed).
* ``accel_too_high`` / ``decel_too_high``: ``acceleration_mps2`` outside ``[min_acceleration_mps2,
  max_acceleration_mps2]``. That field is the change of speed *magnitude* (TrajectoryPoint.msg: it
  "does not consider vehicle direction"), so a switch between forward and reverse between two points is
  also checked: it needs at least ``(|v_k| + |v_k+1|) / dt`` of deceleration.
* ``lateral_accel_too_high``: ``v^2 |kappa| > max_lateral_acceleration_mps2`` at any point (``v`` the faster
  of the point's speed and the next one's).
* ``curvature_too_high``: ``|kappa| > max_curvature_per_m`` at any point, or a published ``heading_rate_rps``
  whose curvature ``|heading_rate / v|`` exceeds it.
* ``steering_too_high``: ``|front_wheel_angle_rad| > max_steering_rad`` at any point.

Every published value is judged. Curvature is measured on the path itself, the way
:func:`~hybrid_vla_ros.vehicle.trajectory.waypoints_to_trajectory` derives the published heading rates and
steering angles from it: :func:`~hybrid_vla_ros.vehicle.trajectory.chord_curvatures` with ``min_segment_m``
(the path thinned so that consecutive kept points are at least ``min_segment_m`` apart; the arc from the first
point's heading to the first kept point; the circle through each inner kept point and its kept neighbours;
linear in between). So the guard and the message agree by construction, and the message's own heading-rate
and steering fields are judged as well, at every point: a trajectory that breaks a limit anywhere in what is
published is never published.

Why ``min_segment_m``: curvature is a heading change divided by a length. At (near) standstill the
model's waypoints jitter by centimetres around the ego position, and the direction between two points
1 cm apart is noise; divided by 1 cm it becomes a curvature of hundreds of 1/m and a steering angle
near 90 deg that nobody plans. Those trajectories are still valid (they say "stay here") and pass:
with the default 1 m, waypoints within half a metre of the ego (what the random-init ``tiny`` demo
model produces) leave no chord to measure (curvature, heading rate and steering are 0), while any real
turn, whose points are metres apart, is measured in full. Their speeds and accelerations are small and are
checked as usual.

Defaults and their sources (Autoware Universe ``autoware_planning_validator``,
``config/planning_validator.param.yaml``, ``validity_checks``; and ``planning_validator.cpp``):

* ``max_acceleration_mps2`` 9.8, ``min_acceleration_mps2`` -9.8, ``max_lateral_acceleration_mps2`` 9.8:
  ``acceleration.longitudinal_max_th``, ``longitudinal_min_th``, ``lateral_th``;
* ``max_curvature_per_m`` 1.0: ``curvature.threshold``;
* ``max_steering_rad`` 1.414: ``steering.threshold``;
* ``max_yaw_deviation_rad`` 1.5708 (90 deg): the yaw deviation between the ego and the nearest
  trajectory point, ``validity_checks.deviation.yaw_th`` of ``config/planning_validator.param.yaml``
  (README: "max valid yaw deviation between ego and nearest trajectory point"); in the later plugin
  layout ``trajectory_checker.yaw_deviation.threshold`` of
  ``autoware_planning_validator_trajectory_checker/config/trajectory_checker.param.yaml``, also 1.5708;
* ``max_age_s`` 1.0: ``latency.threshold`` (``now - trajectory.header.stamp``, as here); ``check_age``
  mirrors ``latency.enable``;
* ``min_segment_m`` 1.0: the validator resamples the trajectory with ``min_interval = 1.0`` m ("the
  following metrics can not be evaluated for closed points") before its curvature, lateral
  acceleration and steering checks, and measures curvature over ``curvature_distance = 1.0`` m;
* ``max_speed_mps`` 11.1: the planning validator has no speed bound; this is ``max_vel`` of
  autoware_launch's ``config/planning/scenario_planning/common/common.param.yaml`` (40 km/h), the
  speed limit of Autoware's reference planning configuration. Raise it to your operating domain's.
* ``max_future_s`` 0.1: no Autoware counterpart; a camera stamp 0.1 s ahead of the node clock means
  the two clocks disagree (synchronized clocks differ by well under a millisecond).

A limit that is NaN rejects everything (every comparison is written as "not within the limit").
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
    """Limits of :func:`find_violations` (see the module docstring for each check and its source).

    Attributes:
        max_speed_mps: largest ``|longitudinal_velocity_mps|`` (m/s).
        max_acceleration_mps2: largest ``acceleration_mps2`` (m/s^2).
        min_acceleration_mps2: smallest ``acceleration_mps2`` (m/s^2, negative: braking).
        max_lateral_acceleration_mps2: largest ``v^2 |kappa|`` (m/s^2).
        max_curvature_per_m: largest path curvature ``|kappa|`` (1/m).
        max_steering_rad: largest ``|front_wheel_angle_rad|`` (rad).
        max_yaw_deviation_rad: largest ``|wrap(yaw of the first point - ego yaw)|`` (rad).
        min_segment_m: shortest segment over which curvature and steering are judged (m).
        check_age: compare ``header.stamp`` with the clock (``too_old``, ``future_stamp``).
        max_age_s: largest ``now - header.stamp`` (s).
        max_future_s: largest ``header.stamp - now`` (s).
    """

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
        """The limits from node parameters named ``guard.<field>`` (validated ones, e.g. the suffix node's settings
        read by name, whose ``guard`` group is these limits); a field without its parameter keeps its default."""
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
    """Causes of every violation of ``limits`` (most important first); ``[]`` when the trajectory is
    valid. ``stamp_ns`` is its ``header.stamp``, ``now_ns`` the clock it is judged against (ns),
    ``ego_yaw`` the odometry heading (rad, map frame) at the stamp, None to skip the yaw check."""
    return [v.cause for v in find_violations(arrays, stamp_ns, now_ns, limits, ego_yaw=ego_yaw)]


def find_violations(arrays: TrajectoryArrays, stamp_ns: int, now_ns: int,
                    limits: GuardLimits, *, ego_yaw: float | None = None) -> list[Violation]:
    """Every violation of ``limits``, one per cause at its worst point, most important first (the
    order of :data:`CAUSES`); ``[]`` when the trajectory is valid. See the module docstring.

    ``stamp_ns``: the trajectory's ``header.stamp`` (ns); ``now_ns``: the clock it is judged against (ns,
    0 = a clock that has not started); ``ego_yaw``: the ego heading (rad, map frame, the odometry's) at
    the stamp, for ``yaw_deviation``; None skips that check. A non-finite ``ego_yaw`` is a violation."""
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
    """``no_clock``, or ``too_old`` / ``future_stamp``, of a stamp judged against the clock ``now_ns`` (ns)."""
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
    """Append ``cause`` when some value is not <= ``limit``, described at the largest such value
    (``index`` maps positions in ``values`` to point indices)."""
    values = np.asarray(values, dtype=np.float64)
    over = ~(values <= limit)
    if np.any(over):
        k = int(np.argmax(np.where(over, values, -np.inf)))
        point = int(index[k]) if index is not None else k
        found.append(Violation(cause, text.format(values[k], point, limit)))
