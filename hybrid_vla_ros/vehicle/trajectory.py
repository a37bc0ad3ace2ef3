"""Ego-frame waypoints -> map-frame trajectory arrays (the content of an Autoware Trajectory), no ROS imports.

Frames and units
----------------
* ``base_link`` (ego) frame: x forward, y left, z up; yaw counter-clockwise about +z (REP 103).
* ``map`` frame: world-fixed (REP 105); ego poses come from ``nav_msgs/Odometry`` on
  ``/localization/kinematic_state`` (header.frame_id ``map``, child_frame_id ``base_link``).
* Odometry twist is expressed in the child frame (``nav_msgs/msg/Odometry.msg``: "The twist in this
  message should be specified in the coordinate frame given by the child_frame_id"; REP 105 and
  Autoware follow it), so the longitudinal speed is ``twist.twist.linear.x``.
* Output fields mirror ``autoware_planning_msgs/msg/TrajectoryPoint.msg``: ``time_from_start``,
  ``pose``, ``longitudinal_velocity_mps``, ``lateral_velocity_mps``, ``acceleration_mps2``,
  ``heading_rate_rps``, ``front_wheel_angle_rad``, ``rear_wheel_angle_rad``.

Units: metres, seconds, m/s, m/s^2, radians, rad/s; stamps in integer nanoseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from ..util.stamps import header_stamp_ns

__all__ = [
    "EgoState",
    "TrajectoryArrays",
    "ego_state_from_odometry",
    "quaternion_to_yaw",
    "yaw_to_quaternion",
    "wrap_angle",
    "pose_headings",
    "segment_headings",
    "chord_curvatures",
    "waypoints_to_trajectory",
    "model_track_to_base_link",
]


def wrap_angle(angle):
    """Wrap an angle (rad) to [-pi, pi): a ``float`` for a scalar, a ``float64`` ndarray for an ndarray."""
    if isinstance(angle, np.ndarray):
        return (angle.astype(np.float64, copy=False) + np.pi) % (2.0 * np.pi) - np.pi
    return (float(angle) + math.pi) % (2.0 * math.pi) - math.pi


def yaw_to_quaternion(yaw: float) -> tuple[float, float, float, float]:
    """Quaternion ``(x, y, z, w)`` of a pure rotation by ``yaw`` (rad) about +z (REP 103, counter-clockwise).

    Returns ``(0, 0, sin(yaw / 2), cos(yaw / 2))`` (unit norm, ``w >= 0`` for yaw in [-pi, pi]), the
    order of ``geometry_msgs/msg/Quaternion``. Raises ``ValueError`` for a non-finite yaw.
    """
    yaw = float(yaw)
    if not math.isfinite(yaw):
        raise ValueError(f"yaw must be finite, got {yaw}")
    half = 0.5 * yaw
    return 0.0, 0.0, math.sin(half), math.cos(half)


def quaternion_to_yaw(x: float, y: float, z: float, w: float) -> float:
    """Yaw (rad, in [-pi, pi]) of a quaternion ``(x, y, z, w)``: rotation about +z of the Z-Y-X (yaw-pitch-roll)
    decomposition.

    Same convention as tf2's ``getRPY`` / REP 103. Uses ``atan2(2 (w z + x y), w^2 + x^2 - y^2 - z^2)``,
    which does not require a unit quaternion (``q`` and ``-q`` give the same yaw).

    Raises:
        ValueError: a non-finite component or a (near-)zero quaternion (norm < 1e-9).
    """
    x, y, z, w = float(x), float(y), float(z), float(w)
    if not all(math.isfinite(c) for c in (x, y, z, w)):
        raise ValueError(f"quaternion has non-finite components: {(x, y, z, w)}")
    if x * x + y * y + z * z + w * w < 1e-18:
        raise ValueError("zero quaternion has no orientation")
    return math.atan2(2.0 * (w * z + x * y), w * w + x * x - y * y - z * z)


@dataclass
class EgoState:
    """Ego pose and speed at one instant.

    Attributes:
        x, y, z: position of ``base_link`` in the map frame (m).
        yaw: heading of ``base_link`` in the map frame (rad, counter-clockwise from map +x; REP 103).
        speed: signed longitudinal speed along ``base_link`` +x (m/s; negative when reversing).
        stamp_ns: time of the state (ns since the epoch of the ROS clock in use).
    """

    x: float
    y: float
    z: float
    yaw: float
    speed: float
    stamp_ns: int


def ego_state_from_odometry(msg) -> EgoState:
    """Build an :class:`EgoState` from a ``nav_msgs/msg/Odometry`` (or any object with its fields).

    Reads ``header.stamp`` (``sec``, ``nanosec``), ``pose.pose.position``, ``pose.pose.orientation``
    (yaw via :func:`quaternion_to_yaw`; roll and pitch are ignored) and ``twist.twist.linear.x`` as the
    longitudinal speed: the Odometry twist is in ``child_frame_id`` (``base_link``) per Odometry.msg /
    REP 105, as Autoware's ``/localization/kinematic_state`` publishes it. A publisher that puts a
    map-frame velocity there produces a wrong speed; this function cannot tell.

    Raises:
        ValueError: any non-finite position, orientation or speed, a zero quaternion, or a negative
            stamp / nanosec outside [0, 1e9).
        AttributeError: ``msg`` lacks one of the fields.
    """
    stamp_ns = header_stamp_ns(msg, "odometry stamp")
    p = msg.pose.pose.position
    q = msg.pose.pose.orientation
    x, y, z = float(p.x), float(p.y), float(p.z)
    speed = float(msg.twist.twist.linear.x)
    if not all(math.isfinite(v) for v in (x, y, z, speed)):
        raise ValueError(f"odometry has non-finite position/speed: position=({x}, {y}, {z}) speed={speed}")
    yaw = quaternion_to_yaw(q.x, q.y, q.z, q.w)
    return EgoState(x=x, y=y, z=z, yaw=yaw, speed=speed, stamp_ns=stamp_ns)


@dataclass
class TrajectoryArrays:
    """A trajectory of P points as parallel ``float64`` arrays of shape ``(P,)`` (map frame).

    Field -> ``autoware_planning_msgs/msg/TrajectoryPoint`` field:
        t -> time_from_start (s); x, y, z -> pose.position (m); qx, qy, qz, qw -> pose.orientation
        (yaw only, about +z); yaw (rad, not in the message: the source of the quaternion);
        v -> longitudinal_velocity_mps (m/s, signed); lat_v -> lateral_velocity_mps (m/s);
        acc -> acceleration_mps2 (m/s^2); heading_rate -> heading_rate_rps (rad/s);
        front_wheel_angle -> front_wheel_angle_rad (rad); rear_wheel_angle -> rear_wheel_angle_rad (rad).
    """

    t: np.ndarray
    x: np.ndarray
    y: np.ndarray
    z: np.ndarray
    yaw: np.ndarray
    qx: np.ndarray
    qy: np.ndarray
    qz: np.ndarray
    qw: np.ndarray
    v: np.ndarray
    lat_v: np.ndarray
    acc: np.ndarray
    heading_rate: np.ndarray
    front_wheel_angle: np.ndarray
    rear_wheel_angle: np.ndarray

    def __post_init__(self) -> None:
        lengths = {f.name: np.shape(getattr(self, f.name)) for f in fields(self)}
        if len(set(lengths.values())) != 1 or len(next(iter(lengths.values()))) != 1:
            raise ValueError(f"TrajectoryArrays fields must be 1-D and of equal length, got {lengths}")

    def __len__(self) -> int:
        return int(self.t.shape[0])


def _finite(value, name: str) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


#: Default of ``heading_min_segment_m``: the output guard's ``guard.min_segment_m`` default (1 m, after
#: Autoware's planning_validator, which resamples to 1 m before judging headings and curvature).
HEADING_MIN_SEGMENT_M = 1.0


def waypoints_to_trajectory(
    waypoints_ego,
    dt_s: float,
    ego: EgoState,
    wheelbase_m: float,
    *,
    min_segment_m: float = 0.01,
    heading_min_segment_m: float = HEADING_MIN_SEGMENT_M,
) -> TrajectoryArrays:
    """Turn model waypoints in the ego frame into a map-frame trajectory of P = N + 1 points.

    Waypoint ``k`` (1-based) is the planned ``base_link`` position at ``t_k = k * dt_s`` in the ego
    frame at ``t_0`` (x forward, y left, REP 103). Point 0 is the ego pose itself at ``t = 0``. Points are
    moved into the map frame with the ego pose: ``p_map = R(ego.yaw) p_ego + (ego.x, ego.y)``,
    ``z = ego.z``. Segment ``k`` runs from point ``k`` to point ``k + 1`` (length ``L_k``, k = 0..N-1).

    Definitions (per point ``k``):
        * pose yaw (``yaw[k]``, the orientation quaternion): ``yaw[0]`` = ``ego.yaw``, the odometry heading
          (point 0 is the ego pose). For k >= 1 the direction of the chord from point ``k`` to the first
          later point at least ``heading_min_segment_m`` away from it; where no later point is that far
          (a car at standstill, whose waypoints jitter by centimetres, or the end of a slow trajectory)
          the point keeps the previous point's yaw, so a standstill trajectory carries the ego heading
          throughout instead of the direction of centimetre-long segments (:func:`pose_headings`).
        * segment heading (k < N): direction of travel of segment ``k``. A segment shorter than
          ``min_segment_m`` keeps the previous heading (the ego yaw before segment 0). A segment whose
          direction is more than 90 deg from the previous heading is driven in reverse: heading =
          direction + pi and the segment speed is negative (so stop-and-jitter waypoints do not spin the
          heading by 180 deg; Autoware infers the driving direction the same way, from pose yaw versus
          point-to-point azimuth). The pose yaw follows the same reverse rule.
        * ``v[k]``: signed longitudinal speed (m/s). ``v[0]`` = ``ego.speed`` (measured);
          ``v[k] = +-L_{k-1} / dt`` for k >= 1: the mean speed over ``(t_{k-1}, t_k]``, i.e. the speed
          with which point ``k`` is reached.
        * ``acc[k]`` (k < N) = ``(|v[k+1]| - |v[k]|) / dt``: change of speed magnitude over
          ``[t_k, t_{k+1}]`` (TrajectoryPoint.msg: acceleration "does not consider vehicle direction");
          ``acc[N] = acc[N-1]``. ``acc[0]`` is therefore the acceleration from the measured speed.
        * curvature ``kappa[k]`` (1/m, :func:`chord_curvatures` with ``heading_min_segment_m``): the
          heading curvature of the path measured over chords of at least ``heading_min_segment_m``, the
          very chords the output guard judges, so every published kinematic value is one the guard has
          judged; 0 at standstill (no chord that long).
        * ``heading_rate[k] = kappa[k] * v[k]`` (rad/s): the yaw rate at that point's speed (point 0: the
          measured ego speed), so ``heading_rate / v`` is the judged curvature.
        * ``front_wheel_angle[k] = atan(wheelbase_m * kappa[k])`` (kinematic bicycle model, rad, left
          positive); ``lat_v = 0``; ``rear_wheel_angle = 0`` (front-steered vehicle).

    Args:
        waypoints_ego: ``(N, 2)`` float array-like, metres, ego frame, N >= 1.
        dt_s: time between waypoints (s), > 0.
        ego: ego state at ``t = 0`` (map frame).
        wheelbase_m: front-to-rear axle distance (m), > 0.
        min_segment_m: segments shorter than this (m) count as "not moving" for the driving direction
            (forward or reverse) of their speed; >= 0.
        heading_min_segment_m: shortest chord (m) a pose yaw and the curvature are measured over; >= 0.
            The suffix node passes the output guard's ``guard.min_segment_m``, the length below which the
            guard does not judge headings either.

    Returns:
        :class:`TrajectoryArrays` with P = N + 1 points, ``t = [0, dt, ..., N dt]``.

    Raises:
        ValueError: waypoints not of shape (N, 2) with N >= 1 or not finite; ``dt_s`` or
            ``wheelbase_m`` not finite and > 0; ``min_segment_m`` or ``heading_min_segment_m`` negative
            or not finite; non-finite ego fields.
    """
    wp = _checked_waypoints(waypoints_ego)
    dt = _positive(dt_s, "dt_s")
    wheelbase = _positive(wheelbase_m, "wheelbase_m")
    min_seg = _non_negative(min_segment_m, "min_segment_m")
    heading_seg = _non_negative(heading_min_segment_m, "heading_min_segment_m")
    ex, ey, ez = _finite(ego.x, "ego.x"), _finite(ego.y, "ego.y"), _finite(ego.z, "ego.z")
    eyaw, espeed = _finite(ego.yaw, "ego.yaw"), _finite(ego.speed, "ego.speed")

    # Kinematics in the ego frame (heading 0 at t = 0); only yaw and position are rotated to map.
    lx = np.concatenate(([0.0], wp[:, 0]))
    ly = np.concatenate(([0.0], wp[:, 1]))
    dx, dy = np.diff(lx), np.diff(ly)
    seg_len = np.hypot(dx, dy)
    _seg_heading, seg_sign = segment_headings(dx, dy, min_seg)
    v, acc = _speeds(seg_sign * seg_len / dt, espeed, dt)
    kappa = chord_curvatures(lx, ly, 0.0, heading_seg)
    heading_rate = kappa * v
    front_wheel_angle = np.arctan(wheelbase * kappa)
    yaw = wrap_angle(pose_headings(lx, ly, heading_seg) + eyaw)

    c, s = math.cos(eyaw), math.sin(eyaw)
    p = lx.size
    half = 0.5 * yaw
    zeros = np.zeros(p)
    return TrajectoryArrays(
        t=np.arange(p, dtype=np.float64) * dt,
        x=ex + c * lx - s * ly,
        y=ey + s * lx + c * ly,
        z=np.full(p, ez),
        yaw=yaw,
        qx=zeros.copy(),
        qy=zeros.copy(),
        qz=np.sin(half),
        qw=np.cos(half),
        v=v,
        lat_v=zeros.copy(),
        acc=acc,
        heading_rate=heading_rate,
        front_wheel_angle=front_wheel_angle,
        rear_wheel_angle=zeros,
    )


def _checked_waypoints(waypoints_ego) -> np.ndarray:
    """``waypoints_ego`` as a finite ``(N, 2)`` float64 array, N >= 1. Raises ValueError naming the problem."""
    try:
        wp = np.asarray(waypoints_ego, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"waypoints must be a numeric (N, 2) array: {exc}") from None
    if wp.ndim != 2 or wp.shape[1] != 2 or wp.shape[0] < 1:
        raise ValueError(f"waypoints must have shape (N, 2) with N >= 1, got {wp.shape}")
    if not np.all(np.isfinite(wp)):
        bad = np.argwhere(~np.isfinite(wp))[0]
        raise ValueError(f"waypoints contain non-finite values (first at row {bad[0]}, column {bad[1]})")
    return wp


def _positive(value, name: str) -> float:
    value = _finite(value, name)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _non_negative(value, name: str) -> float:
    value = _finite(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _travel_heading(dx: float, dy: float, previous: float) -> tuple[float, bool]:
    """(heading, forward) of a displacement ``(dx, dy)`` driven from heading ``previous`` (rad, ego frame):
    more than 90 deg from ``previous`` it is driven in reverse, heading = direction + pi."""
    forward = dx * math.cos(previous) + dy * math.sin(previous) >= 0.0
    heading = math.atan2(dy, dx)
    return (heading if forward else wrap_angle(heading + math.pi)), forward


def segment_headings(dx: np.ndarray, dy: np.ndarray, min_segment_m: float) -> tuple[np.ndarray, np.ndarray]:
    """Heading (rad, ego frame: 0 = the ego heading) and driving direction (+1 forward, -1 reverse) of each
    segment ``(dx[k], dy[k])`` (m). A segment shorter than ``min_segment_m`` keeps the previous heading
    (0 before the first); see :func:`waypoints_to_trajectory`."""
    n = dx.size
    heading, sign = np.empty(n), np.empty(n)
    prev = 0.0
    for k in range(n):
        new, forward = _travel_heading(dx[k], dy[k], prev)
        sign[k] = 1.0 if forward else -1.0
        if math.hypot(dx[k], dy[k]) >= min_segment_m:
            prev = new
        heading[k] = prev
    return heading, sign


def pose_headings(lx: np.ndarray, ly: np.ndarray, min_chord_m: float) -> np.ndarray:
    """Pose yaw of each point ``(lx[k], ly[k])`` (m, ego frame, point 0 = the ego at the origin), rad in the
    ego frame (0 = the ego heading).

    Point 0 has yaw 0 (the odometry heading). Point k >= 1 takes the direction of the chord to the first
    later point at least ``min_chord_m`` (and more than 0) away, driven in reverse when that chord points more
    than 90 deg away from the previous yaw; with no such point it keeps the previous yaw. Chords shorter
    than the output guard's ``guard.min_segment_m`` (Autoware's planning_validator thins to 1 m for the
    same reason) carry no heading: centimetres of jitter at standstill would point anywhere.
    """
    p = lx.size
    yaw = np.zeros(p)
    for k in range(1, p):
        yaw[k] = yaw[k - 1]
        dist = np.hypot(lx[k + 1:] - lx[k], ly[k + 1:] - ly[k])
        far = np.flatnonzero((dist >= min_chord_m) & (dist > 0.0))
        if far.size:
            j = k + 1 + int(far[0])
            yaw[k], _ = _travel_heading(lx[j] - lx[k], ly[j] - ly[k], yaw[k - 1])
    return yaw


#: Shortest chord (m) that gives a heading in :func:`model_track_to_base_link` (shorter ones, e.g. centimetres of
#: jitter at standstill, keep the heading before them).
TRACK_MIN_CHORD_M = 0.2


def _track_headings(x: np.ndarray, y: np.ndarray, min_chord_m: float) -> np.ndarray:
    """Tangent heading (rad, 0 at point 0) at each point of a track ``(x[k], y[k])`` whose point 0 is the start,
    heading 0: point k's from the chord between its neighbours (parallel to the tangent on a circle through
    them), the last point's from its incoming chord turned on as much again past the previous point's heading
    (on a circle, exact for even spacing); a chord shorter than ``min_chord_m`` keeps the previous heading and one
    more than 90 deg from it is driven in reverse (its direction + pi), as :func:`pose_headings`."""
    n = x.size
    yaw = np.zeros(n)
    for k in range(1, n):
        j, i = (k + 1, k - 1) if k + 1 < n else (k, k - 1)
        dx, dy = x[j] - x[i], y[j] - y[i]
        yaw[k] = yaw[k - 1]
        if math.hypot(dx, dy) < min_chord_m:
            continue
        heading, _ = _travel_heading(dx, dy, yaw[k - 1])
        if k + 1 == n:  # the incoming chord's heading is the tangent half a step back
            heading = heading + wrap_angle(heading - yaw[k - 1])
        yaw[k] = heading
    return yaw


def _track_curvatures(x: np.ndarray, y: np.ndarray, min_chord_m: float) -> np.ndarray:
    """Signed curvature (1/m, left positive) at each point of a track: 1 / the radius of the circle through the
    point and its neighbours (the last point: through the last three), 0 at point 0; where a chord is shorter than
    ``min_chord_m`` the previous point's."""
    n = x.size
    kappa = np.zeros(n)
    for k in range(1, n):
        a, b, c = (k - 1, k, k + 1) if k + 1 < n else (k - 2, k - 1, k)
        if a < 0:
            continue
        ux, uy, vx, vy = x[b] - x[a], y[b] - y[a], x[c] - x[b], y[c] - y[b]
        l1, l2, l3 = math.hypot(ux, uy), math.hypot(vx, vy), math.hypot(x[c] - x[a], y[c] - y[a])
        kappa[k] = kappa[k - 1] if min(l1, l2) < min_chord_m else 2.0 * (ux * vy - uy * vx) / (l1 * l2 * l3)
    return kappa


def model_track_to_base_link(waypoints, origin_xy, min_chord_m: float = TRACK_MIN_CHORD_M) -> np.ndarray:
    """``base_link``'s planned positions from a plan of another point of the vehicle.

    The published models (Orion, MindDrive) plan the track of their model frame's origin (their training lidar,
    ``origin_xy`` = (x, y) m in base_link: ``model_frame_origin``): waypoint k is that point's position at t_k
    in the frame it had at t_0, with base_link's axes (MindDrive's ``get_ego_trajs``: the lidar's future poses
    in the current lidar frame). A point rigidly ``o`` ahead of base_link is at ``b_k + R(yaw_k) o`` when
    base_link is at ``b_k`` with heading ``yaw_k``, so ``b_k = o + w_k - R(yaw_k) o`` (b_0 = 0).

    ``yaw_k``, base_link's heading: base_link (the rear axle) moves along its heading, so a point d = o_x ahead
    on a turn of its track's curvature kappa_w moves at asin(d kappa_w) to the left of the heading (rigid body on
    a circle: the point's radius is sqrt(R^2 + d^2)); ``yaw_k`` = the track's tangent (:func:`_track_headings`)
    minus that angle, kappa_w from the circle through each point and its neighbours (:func:`_track_curvatures`;
    ``o_y`` is left out of that angle). Exact on a circle with evenly spaced waypoints; on a straight track
    ``b_k = w_k``; within 6 cm for the uneven spacings of test_trajectory, where leaving the track as it is
    would be 0.3 to 1 m off. Chords shorter than ``min_chord_m`` (standstill jitter) give no heading.

    ``waypoints``: (N, 2) float (m); returns (N, 2) float64. Raises ValueError for another shape or a
    non-finite value.
    """
    w = np.asarray(waypoints, dtype=np.float64)
    o = np.asarray(origin_xy, dtype=np.float64)
    if w.ndim != 2 or w.shape[1] != 2 or o.shape != (2,):
        raise ValueError(f"waypoints must be (N, 2) and the origin (2,), got {w.shape} and {o.shape}")
    if not (np.isfinite(w).all() and np.isfinite(o).all()):
        raise ValueError("waypoints and the model frame's origin must be finite")
    x, y = np.concatenate(([0.0], w[:, 0])), np.concatenate(([0.0], w[:, 1]))
    kappa = _track_curvatures(x, y, min_chord_m)
    yaw = (_track_headings(x, y, min_chord_m) - np.arcsin(np.clip(o[0] * kappa, -1.0, 1.0)))[1:]
    c, s = np.cos(yaw), np.sin(yaw)
    return o + w - np.stack([c * o[0] - s * o[1], s * o[0] + c * o[1]], axis=1)


def _speeds(seg_v: np.ndarray, ego_speed: float, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """(v, acc) per point from the signed segment speeds ``seg_v`` (m/s) and the measured ego speed:
    ``v = [ego_speed, seg_v...]``, ``acc[k] = (|v[k+1]| - |v[k]|) / dt`` with the last repeated."""
    v = np.concatenate(([ego_speed], seg_v))
    acc = np.empty(v.size)
    acc[:-1] = np.diff(np.abs(v)) / dt
    acc[-1] = acc[-2]
    return v, acc


def chord_curvatures(x, y, yaw0: float, min_chord_m: float) -> np.ndarray:
    """Heading curvature (1/m) at each point of the path ``(x[k], y[k])`` (m; point 0 is the vehicle, heading
    ``yaw0`` rad, any planar frame), measured over chords of at least ``min_chord_m``: the one definition the
    trajectory's kinematic fields and the output guard's curvature, lateral acceleration and steering checks
    share.

    * Thinning: point 0 is kept; each later point at least ``min_chord_m`` (and more than 0) from the last kept
      one is kept (no interpolation), as Autoware's planning_validator resamples to 1 m before these checks.
    * Driving direction: a chord pointing more than 90 deg away from the heading before it is driven in
      reverse; the vehicle's heading along it is the chord's direction + pi.
    * At point 0: the circular arc tangent to ``yaw0`` through the first kept point,
      ``2 sin(alpha) / chord`` with ``alpha`` the turn from ``yaw0`` to the chord's heading.
    * At each inner kept point: the circle through it and its kept neighbours (Menger curvature,
      ``2 sin(turn) / |a + b|``, the turn between the heading of the chord into it and of the chord out of it;
      at a switch of driving direction the chord out is mirrored, so a cusp counts by its change of heading).
      The last kept point takes its predecessor's value (point 0's when only one chord is kept).
    * Every other point: linear in arc length between the kept points around it (after the last kept point:
      its value), so no point's curvature exceeds that of a judged kept point.

    Sign: positive turns left when driving forward; it is the curvature of the heading per signed arc length,
    so that ``heading_rate = kappa * v`` with the signed speed and the bicycle model's steering
    ``atan(wheelbase * kappa)`` hold in reverse too. All zeros when no point is ``min_chord_m`` away (a car at
    standstill). Returns a float64 array shaped like ``x``. Raises ValueError for arrays of different shapes.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D arrays of one shape, got {x.shape} and {y.shape}")
    n = x.size
    kappa = np.zeros(n)
    kept = [0]
    for i in range(1, n):
        d = math.hypot(x[i] - x[kept[-1]], y[i] - y[kept[-1]])
        if d >= min_chord_m and d > 0.0:
            kept.append(i)
    if len(kept) < 2:
        return kappa
    px, py = x[kept], y[kept]
    cx, cy = np.diff(px), np.diff(py)
    heading, sign = float(yaw0), []
    headings = []
    for j in range(cx.size):
        heading, forward = _travel_heading(cx[j], cy[j], heading)
        headings.append(heading)
        sign.append(1.0 if forward else -1.0)
    values = np.empty(len(kept))
    alpha = wrap_angle(headings[0] - float(yaw0))
    values[0] = sign[0] * 2.0 * math.sin(alpha) / math.hypot(cx[0], cy[0])
    for j in range(1, len(kept) - 1):
        ax, ay, bx, by = cx[j - 1], cy[j - 1], cx[j], cy[j]
        if sign[j] != sign[j - 1]:  # a cusp: the chord out, mirrored, continues the chord in
            bx, by = -bx, -by
        cross = ax * by - ay * bx
        chord = math.hypot(ax + bx, ay + by)
        menger = 2.0 * cross / (math.hypot(ax, ay) * math.hypot(bx, by) * chord) if chord > 0.0 else 0.0
        values[j] = sign[j - 1] * menger
    values[-1] = values[-2]
    arc = np.concatenate(([0.0], np.cumsum(np.hypot(np.diff(x), np.diff(y)))))
    kappa[: kept[-1] + 1] = np.interp(arc[: kept[-1] + 1], arc[kept], values)
    kappa[kept[-1] + 1:] = values[-1]
    return kappa
