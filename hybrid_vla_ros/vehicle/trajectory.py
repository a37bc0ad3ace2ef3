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
    "waypoints_to_trajectory",
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
    """Yaw (rad, in [-pi, pi]) of a quaternion ``(x, y, z, w)``: rotation about +z of the Z-Y-X (yaw-pitch-roll) decomposition.

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


def waypoints_to_trajectory(
    waypoints_ego,
    dt_s: float,
    ego: EgoState,
    wheelbase_m: float,
    *,
    min_segment_m: float = 0.01,
) -> TrajectoryArrays:
    """Turn model waypoints in the ego frame into a map-frame trajectory of P = N + 1 points.

    Waypoint ``k`` (1-based) is the planned ``base_link`` position at ``t_k = k * dt_s`` in the ego
    frame at ``t_0`` (x forward, y left, REP 103). Point 0 is the ego pose itself at ``t = 0``. Points are
    moved into the map frame with the ego pose: ``p_map = R(ego.yaw) p_ego + (ego.x, ego.y)``,
    ``z = ego.z``. Segment ``k`` runs from point ``k`` to point ``k + 1`` (length ``L_k``, k = 0..N-1).

    Definitions (per point ``k``):
        * ``yaw[k]`` (k < N): heading while driving segment ``k``: its direction of travel. A segment
          shorter than ``min_segment_m`` keeps the previous heading (``yaw[-1]`` = ego yaw). A segment
          whose direction is more than 90 deg from the previous heading is driven in reverse: heading
          = direction + pi and the segment speed is negative (so stop-and-jitter waypoints do not spin
          the heading by 180 deg; Autoware infers the driving direction the same way, from pose yaw
          versus point-to-point azimuth). ``yaw[N] = yaw[N-1]``.
        * ``v[k]``: signed longitudinal speed (m/s). ``v[0]`` = ``ego.speed`` (measured);
          ``v[k] = +-L_{k-1} / dt`` for k >= 1: the mean speed over ``(t_{k-1}, t_k]``, i.e. the speed
          with which point ``k`` is reached.
        * ``acc[k]`` (k < N) = ``(|v[k+1]| - |v[k]|) / dt``: change of speed magnitude over
          ``[t_k, t_{k+1}]`` (TrajectoryPoint.msg: acceleration "does not consider vehicle direction");
          ``acc[N] = acc[N-1]``. ``acc[0]`` is therefore the acceleration from the measured speed.
        * ``heading_rate[k]`` (rad/s): for 1 <= k < N the wrapped turn at vertex ``k``,
          ``wrap(yaw[k] - yaw[k-1]) / dt``; ``heading_rate[0] = 2 * wrap(yaw[0] - ego.yaw) / dt`` (the
          circular arc tangent to the ego heading through waypoint 1 turns by twice the chord angle);
          ``heading_rate[N] = heading_rate[N-1]``. All exact for a constant-rate turn.
        * curvature ``kappa[k] = heading_rate[k] / v_path[k]`` (1/m) with ``v_path[k] = v[k]`` for
          k >= 1 and the planned first-segment speed for k = 0 (curvature belongs to the path, not to
          the measured speed); 0 where ``|v_path| * dt < min_segment_m``.
        * ``front_wheel_angle[k] = atan(wheelbase_m * kappa[k])`` (kinematic bicycle model, rad, left
          positive); ``lat_v = 0``; ``rear_wheel_angle = 0`` (front-steered vehicle).

    Args:
        waypoints_ego: ``(N, 2)`` float array-like, metres, ego frame, N >= 1.
        dt_s: time between waypoints (s), > 0.
        ego: ego state at ``t = 0`` (map frame).
        wheelbase_m: front-to-rear axle distance (m), > 0.
        min_segment_m: segments shorter than this (m) count as "not moving" for heading and
            curvature; >= 0.

    Returns:
        :class:`TrajectoryArrays` with P = N + 1 points, ``t = [0, dt, ..., N dt]``.

    Raises:
        ValueError: waypoints not of shape (N, 2) with N >= 1 or not finite; ``dt_s`` or
            ``wheelbase_m`` not finite and > 0; ``min_segment_m`` negative; non-finite ego fields.
    """
    try:
        wp = np.asarray(waypoints_ego, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"waypoints must be a numeric (N, 2) array: {exc}") from None
    if wp.ndim != 2 or wp.shape[1] != 2 or wp.shape[0] < 1:
        raise ValueError(f"waypoints must have shape (N, 2) with N >= 1, got {wp.shape}")
    if not np.all(np.isfinite(wp)):
        bad = np.argwhere(~np.isfinite(wp))[0]
        raise ValueError(f"waypoints contain non-finite values (first at row {bad[0]}, column {bad[1]})")
    dt = _finite(dt_s, "dt_s")
    if dt <= 0:
        raise ValueError(f"dt_s must be > 0, got {dt}")
    wheelbase = _finite(wheelbase_m, "wheelbase_m")
    if wheelbase <= 0:
        raise ValueError(f"wheelbase_m must be > 0, got {wheelbase}")
    min_seg = _finite(min_segment_m, "min_segment_m")
    if min_seg < 0:
        raise ValueError(f"min_segment_m must be >= 0, got {min_seg}")
    ex, ey, ez = _finite(ego.x, "ego.x"), _finite(ego.y, "ego.y"), _finite(ego.z, "ego.z")
    eyaw, espeed = _finite(ego.yaw, "ego.yaw"), _finite(ego.speed, "ego.speed")

    n = wp.shape[0]
    p = n + 1
    # Kinematics in the ego frame (heading 0 at t = 0); only yaw and position are rotated to map.
    lx = np.empty(p)
    ly = np.empty(p)
    lx[0] = ly[0] = 0.0
    lx[1:] = wp[:, 0]
    ly[1:] = wp[:, 1]
    dx = np.diff(lx)
    dy = np.diff(ly)
    seg_len = np.hypot(dx, dy)

    yaw_local = np.empty(p)
    seg_sign = np.empty(n)
    prev = 0.0
    for k in range(n):
        forward = dx[k] * math.cos(prev) + dy[k] * math.sin(prev) >= 0.0
        seg_sign[k] = 1.0 if forward else -1.0
        if seg_len[k] < min_seg:
            heading = prev
        else:
            heading = math.atan2(dy[k], dx[k])
            if not forward:
                heading = wrap_angle(heading + math.pi)
        yaw_local[k] = heading
        prev = heading
    yaw_local[n] = yaw_local[n - 1]

    seg_v = seg_sign * seg_len / dt  # signed mean speed of each segment
    v = np.empty(p)
    v[0] = espeed
    v[1:] = seg_v

    speed_mag = np.abs(v)
    acc = np.empty(p)
    acc[:n] = np.diff(speed_mag) / dt
    acc[n] = acc[n - 1]

    heading_rate = np.empty(p)
    heading_rate[0] = 2.0 * wrap_angle(yaw_local[0]) / dt
    if n > 1:
        heading_rate[1:n] = wrap_angle(np.diff(yaw_local[:n])) / dt
    heading_rate[n] = heading_rate[n - 1]

    v_path = v.copy()
    v_path[0] = seg_v[0]
    moving = np.abs(v_path) * dt >= min_seg
    if min_seg == 0.0:
        moving &= v_path != 0.0
    curvature = np.zeros(p)
    curvature[moving] = heading_rate[moving] / v_path[moving]
    front_wheel_angle = np.arctan(wheelbase * curvature)

    c, s = math.cos(eyaw), math.sin(eyaw)
    x = ex + c * lx - s * ly
    y = ey + s * lx + c * ly
    yaw = wrap_angle(yaw_local + eyaw)
    half = 0.5 * yaw
    zeros = np.zeros(p)
    return TrajectoryArrays(
        t=np.arange(p, dtype=np.float64) * dt,
        x=x,
        y=y,
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
