"""Ego-frame waypoints -> map-frame trajectory arrays (the content of an Autoware Trajectory), no ROS imports.

Frames: ``base_link`` x forward, y left, z up, yaw counter-clockwise about +z (REP 103); ``map`` world-fixed
(REP 105), ego poses from ``nav_msgs/Odometry`` on ``/localization/kinematic_state``, whose twist is in the
child frame (Odometry.msg), so the longitudinal speed is ``twist.twist.linear.x``.
Units: m, s, m/s, m/s^2, rad, rad/s; stamps in integer ns.
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
    """Quaternion ``(x, y, z, w)`` of a rotation by ``yaw`` (rad) about +z. Raises ValueError for a non-finite yaw."""
    yaw = float(yaw)
    if not math.isfinite(yaw):
        raise ValueError(f"yaw must be finite, got {yaw}")
    half = 0.5 * yaw
    return 0.0, 0.0, math.sin(half), math.cos(half)


def quaternion_to_yaw(x: float, y: float, z: float, w: float) -> float:
    """Yaw (rad, in [-pi, pi]) of the Z-Y-X decomposition, as tf2's ``getRPY``; the quaternion need not be unit.

    Raises ValueError for a non-finite component or a (near-)zero quaternion (norm < 1e-9).
    """
    x, y, z, w = float(x), float(y), float(z), float(w)
    if not all(math.isfinite(c) for c in (x, y, z, w)):
        raise ValueError(f"quaternion has non-finite components: {(x, y, z, w)}")
    if x * x + y * y + z * z + w * w < 1e-18:
        raise ValueError("zero quaternion has no orientation")
    return math.atan2(2.0 * (w * z + x * y), w * w + x * x - y * y - z * z)


@dataclass
class EgoState:
    """``base_link`` pose in the map frame (m, rad), signed speed along its +x (m/s, < 0 reversing), stamp (ns)."""

    x: float
    y: float
    z: float
    yaw: float
    speed: float
    stamp_ns: int


def ego_state_from_odometry(msg) -> EgoState:
    """An :class:`EgoState` from a ``nav_msgs/msg/Odometry`` (or any object with its fields); roll and pitch ignored.

    A publisher that puts a map-frame velocity in the twist produces a wrong speed; this cannot tell.
    Raises ValueError for a non-finite position, orientation or speed, a zero quaternion, or a bad stamp;
    AttributeError when ``msg`` lacks a field.
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

    Fields map to ``autoware_planning_msgs/msg/TrajectoryPoint``: t -> time_from_start, x/y/z and qx..qw -> pose
    (yaw only; ``yaw`` itself is not in the message), v -> longitudinal_velocity_mps (signed), lat_v, acc,
    heading_rate, front_wheel_angle, rear_wheel_angle -> the fields of those names with their unit suffix.
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


#: Default of ``heading_min_segment_m``: the output guard's ``guard.min_segment_m`` default (1 m).
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
    """Model waypoints (ego frame at ``t_0``) -> a map-frame trajectory of P = N + 1 points, ``t = k * dt_s``.

    Waypoint ``k`` (1-based, ``(N, 2)`` m) is the planned ``base_link`` position at ``k * dt_s``; point 0 is the
    ego pose. Per point:

    * ``yaw``: ``ego.yaw`` at point 0, then :func:`pose_headings` over chords >= ``heading_min_segment_m``
      (a standstill trajectory keeps the ego heading).
    * ``v``: ``ego.speed`` at point 0, then ``+-L_{k-1} / dt`` (the speed with which point k is reached), negative
      for a segment more than 90 deg from the previous heading (:func:`segment_headings`; segments shorter than
      ``min_segment_m`` keep the previous heading), as Autoware infers driving direction from pose yaw.
    * ``acc[k] = (|v[k+1]| - |v[k]|) / dt`` (speed magnitude, TrajectoryPoint.msg), the last repeated.
    * ``kappa``: :func:`chord_curvatures` with ``heading_min_segment_m`` (the suffix node passes the guard's
      ``guard.min_segment_m``, so every published value is one the guard judges); ``heading_rate = kappa * v``;
      ``front_wheel_angle = atan(wheelbase_m * kappa)`` (kinematic bicycle); ``lat_v = rear_wheel_angle = 0``.

    Raises ValueError for waypoints not finite ``(N, 2)`` with N >= 1, ``dt_s`` or ``wheelbase_m`` not finite
    and > 0, ``min_segment_m`` or ``heading_min_segment_m`` negative or not finite, or non-finite ego fields.
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
    """``waypoints_ego`` as a finite ``(N, 2)`` float64 array, N >= 1, or ValueError."""
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
    """(heading, forward) of ``(dx, dy)`` driven from ``previous`` (rad); > 90 deg off is reverse (direction + pi)."""
    forward = dx * math.cos(previous) + dy * math.sin(previous) >= 0.0
    heading = math.atan2(dy, dx)
    return (heading if forward else wrap_angle(heading + math.pi)), forward


def segment_headings(dx: np.ndarray, dy: np.ndarray, min_segment_m: float) -> tuple[np.ndarray, np.ndarray]:
    """Heading (rad, 0 = ego heading) and direction (+1/-1) of each segment (m); shorter than ``min_segment_m``
    keeps the previous heading."""
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
    """Pose yaw (rad, 0 = ego heading) of each point (m, ego frame, point 0 the ego at the origin, yaw 0).

    Point k >= 1 takes the direction of the chord to the first later point at least ``min_chord_m`` (and > 0)
    away (reversed past 90 deg), else the previous yaw: centimetres of standstill jitter would point anywhere.
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


#: Shortest chord (m) that gives a heading in :func:`model_track_to_base_link`.
TRACK_MIN_CHORD_M = 0.2


def _track_headings(x: np.ndarray, y: np.ndarray, min_chord_m: float) -> np.ndarray:
    """Tangent heading (rad, 0 at point 0) of each track point: the chord between its neighbours (the last point:
    its incoming chord turned on as much again, exact on a circle); short and reverse chords as in
    :func:`pose_headings`."""
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
    """Signed curvature (1/m, left +) of the circle through each point and its neighbours (the last: the last
    three); 0 at point 0, the previous point's where a chord is shorter than ``min_chord_m``."""
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
    """``base_link``'s planned positions ``(N, 2)`` float64 from a plan of another point of the vehicle.

    The published models (Orion, MindDrive) plan the track of their model frame's origin ``o = origin_xy`` (m in
    base_link; MindDrive's ``get_ego_trajs``: the lidar's future poses in the current lidar frame), so
    ``b_k = o + w_k - R(yaw_k) o``. The rear axle moves along its heading, so a point ``o_x`` ahead on a turn of
    curvature kappa_w moves at ``asin(o_x kappa_w)`` left of it: ``yaw_k`` = track tangent minus that angle
    (``o_y`` left out). Exact on a circle with even spacing; within 6 cm on test_trajectory's uneven spacings
    (0.3 to 1 m without it). Raises ValueError for another shape or a non-finite value.
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
    """(v, acc) per point: ``v = [ego_speed, seg_v...]``, ``acc`` as in :func:`waypoints_to_trajectory`."""
    v = np.concatenate(([ego_speed], seg_v))
    acc = np.empty(v.size)
    acc[:-1] = np.diff(np.abs(v)) / dt
    acc[-1] = acc[-2]
    return v, acc


def chord_curvatures(x, y, yaw0: float, min_chord_m: float) -> np.ndarray:
    """Heading curvature (1/m, float64 shaped like ``x``) of a path (m; point 0 the vehicle, heading ``yaw0``),
    over chords >= ``min_chord_m``: the one definition the trajectory fields and the output guard share.

    * Kept points: point 0, then each point at least ``min_chord_m`` (and > 0) from the last kept one, as
      Autoware's planning_validator resamples to 1 m; a chord > 90 deg off the heading before it is reverse.
    * Point 0: the arc tangent to ``yaw0`` through the first kept point, ``2 sin(alpha) / chord``.
    * Inner kept points: Menger curvature of the circle through the kept neighbours (at a cusp the chord out is
      mirrored); the last kept point takes its predecessor's value.
    * Other points: linear in arc length between kept points, so none exceeds a judged kept point.

    Positive turns left driving forward; per signed arc length, so ``heading_rate = kappa * v`` and
    ``atan(wheelbase * kappa)`` hold in reverse. All zeros at standstill. Raises ValueError for mismatched shapes.
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
