"""Tests for hybrid_vla_ros.vehicle.trajectory and hybrid_vla_ros.ros.msg_conv.

Real data: the three /localization/kinematic_state Odometry messages of data/dgp_scene02_6cam_mcap
(DGP LiDAR poses in frame ``map``, child ``base_link``; the vehicle drives ~1.26 m/s towards map -y,
yaw ~ -1.587 rad, with small roll/pitch; the twist in base_link).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rosbags.highlevel import AnyReader

from hybrid_vla_ros.vehicle.trajectory import (
    EgoState,
    TrajectoryArrays,
    ego_state_from_odometry,
    quaternion_to_yaw,
    waypoints_to_trajectory,
    wrap_angle,
    yaw_to_quaternion,
)

BAG = Path(__file__).resolve().parents[1] / "data" / "dgp_scene02_6cam_mcap"
WHEELBASE = 2.79  # m


@pytest.fixture(scope="module")
def odometry():
    """[(rosbags Odometry, CDR bytes)] in bag order."""
    out = []
    with AnyReader([BAG]) as reader:
        conns = [c for c in reader.connections if c.topic == "/localization/kinematic_state"]
        for conn, _, data in reader.messages(connections=conns):
            out.append((reader.deserialize(data, conn.msgtype), bytes(data)))
    assert len(out) == 3
    return out


def _rotation_matrix(x, y, z, w):
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


# ------------------------------------------------------------------------------- ego state
def test_ego_state_from_real_odometry(odometry):
    for msg, _ in odometry:
        ego = ego_state_from_odometry(msg)
        assert msg.header.frame_id == "map" and msg.child_frame_id == "base_link"
        assert ego.stamp_ns == msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
        p = msg.pose.pose.position
        assert (ego.x, ego.y, ego.z) == (p.x, p.y, p.z)
        assert ego.speed == msg.twist.twist.linear.x  # REP 105: child-frame (base_link) forward speed
        # Yaw = heading of base_link's x axis projected on the map plane (roll/pitch are not zero here).
        q = msg.pose.pose.orientation
        axis = _rotation_matrix(q.x, q.y, q.z, q.w)[:, 0]
        assert ego.yaw == pytest.approx(math.atan2(axis[1], axis[0]), abs=1e-9)
        assert ego.yaw == pytest.approx(-1.587, abs=0.01)
    assert [ego_state_from_odometry(m).stamp_ns for m, _ in odometry] == [
        1700000000091370000, 1700000001081828000, 1700000002092298000]


def test_bag_odometry_twist_is_in_base_link_and_matches_the_motion(odometry):
    """The embedded bag as REP 105 / Odometry.msg define it: the twist in child_frame_id (base_link), so its
    linear.x is the forward speed the poses show (about 1.26 m/s along the pose yaw) and linear.y is about 0. (The
    bag once carried DGP's map-frame velocity there, read as -0.02 m/s; data/.../SOURCE.txt says how it was
    rotated.)"""
    egos = [ego_state_from_odometry(m) for m, _ in odometry]
    for (m0, _), a, b in zip(odometry, egos, egos[1:]):
        dt = (b.stamp_ns - a.stamp_ns) * 1e-9
        dx, dy = b.x - a.x, b.y - a.y
        assert math.atan2(dy, dx) == pytest.approx(a.yaw, abs=0.01)  # moves along +x of base_link
        speed = math.hypot(dx, dy) / dt
        assert speed == pytest.approx(1.26, abs=0.03)
        lin = m0.twist.twist.linear
        assert lin.x == pytest.approx(speed, abs=0.03) and abs(lin.y) < 0.01
        assert a.speed == pytest.approx(speed, abs=0.03)  # what a REP 105 consumer reads as the forward speed


def test_ego_state_from_rclpy_odometry_matches(odometry):
    from nav_msgs.msg import Odometry
    from rclpy.serialization import deserialize_message

    for msg, cdr in odometry:
        assert ego_state_from_odometry(deserialize_message(cdr, Odometry)) == ego_state_from_odometry(msg)


def _odom(x=1.0, y=2.0, z=0.5, q=(0.0, 0.0, 0.0, 1.0), vx=3.0, sec=10, nanosec=5):
    return SimpleNamespace(
        header=SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=nanosec)),
        pose=SimpleNamespace(pose=SimpleNamespace(
            position=SimpleNamespace(x=x, y=y, z=z),
            orientation=SimpleNamespace(x=q[0], y=q[1], z=q[2], w=q[3]))),
        twist=SimpleNamespace(twist=SimpleNamespace(linear=SimpleNamespace(x=vx, y=0.0, z=0.0))),
    )


def test_ego_state_rejects_non_finite():
    assert ego_state_from_odometry(_odom()) == EgoState(1.0, 2.0, 0.5, 0.0, 3.0, 10_000_000_005)
    for bad in (_odom(x=math.nan), _odom(z=math.inf), _odom(vx=math.nan), _odom(q=(0, 0, math.nan, 1)),
                _odom(q=(0, 0, 0, 0)), _odom(nanosec=10**9), _odom(sec=-1)):
        with pytest.raises(ValueError):
            ego_state_from_odometry(bad)


# ------------------------------------------------------------------------------ quaternions
def test_quaternion_round_trip_and_conventions():
    for yaw in np.linspace(-math.pi, math.pi, 73):
        q = yaw_to_quaternion(yaw)
        assert q[0] == 0.0 and q[1] == 0.0 and math.isclose(math.hypot(*q), 1.0)
        back = quaternion_to_yaw(*q)
        assert abs(wrap_angle(back - yaw)) < 1e-12
        # Same rotation as the matrix: x axis goes to (cos yaw, sin yaw) (REP 103 counter-clockwise).
        axis = _rotation_matrix(*q)[:, 0]
        assert axis[:2] == pytest.approx([math.cos(yaw), math.sin(yaw)], abs=1e-12)
        # q and -q, and a scaled q, are the same yaw.
        assert abs(wrap_angle(quaternion_to_yaw(*(-c for c in q)) - yaw)) < 1e-12
        assert abs(wrap_angle(quaternion_to_yaw(*(3 * c for c in q)) - yaw)) < 1e-12
    assert yaw_to_quaternion(math.pi / 2) == pytest.approx((0, 0, math.sqrt(0.5), math.sqrt(0.5)))
    for bad in ((0, 0, 0, 0), (math.nan, 0, 0, 1)):
        with pytest.raises(ValueError):
            quaternion_to_yaw(*bad)
    with pytest.raises(ValueError):
        yaw_to_quaternion(math.inf)


# ------------------------------------------------------------------------ ego -> map transform
def test_waypoints_land_in_map_with_real_poses(odometry):
    egos = [ego_state_from_odometry(m) for m, _ in odometry]
    for ego in egos:
        arr = waypoints_to_trajectory(np.array([[1.0, 0.0], [2.0, 0.0], [2.0, 1.0]]), 0.5, ego, WHEELBASE)
        fwd = np.array([math.cos(ego.yaw), math.sin(ego.yaw)])
        left = np.array([-math.sin(ego.yaw), math.cos(ego.yaw)])
        pos = np.stack([arr.x, arr.y], 1)
        np.testing.assert_allclose(pos[0], [ego.x, ego.y], atol=1e-9)
        np.testing.assert_allclose(pos[1], [ego.x, ego.y] + fwd, atol=1e-9)  # 1 m ahead along the yaw
        np.testing.assert_allclose(pos[3], [ego.x, ego.y] + 2 * fwd + left, atol=1e-9)  # +y is left
        np.testing.assert_allclose(arr.z, ego.z)
        assert arr.yaw[0] == pytest.approx(ego.yaw, abs=1e-12)
        assert wrap_angle(arr.yaw[2] - ego.yaw) == pytest.approx(math.pi / 2)  # the left step
    # The next real pose, expressed in the ego frame and transformed back, lands on itself.
    for a, b in zip(egos, egos[1:]):
        c, s = math.cos(a.yaw), math.sin(a.yaw)
        dx, dy = b.x - a.x, b.y - a.y
        local = np.array([[c * dx + s * dy, -s * dx + c * dy]])
        assert local[0, 0] == pytest.approx(1.26, abs=0.03) and abs(local[0, 1]) < 0.03
        arr = waypoints_to_trajectory(local, (b.stamp_ns - a.stamp_ns) * 1e-9, a, WHEELBASE)
        assert (arr.x[1], arr.y[1]) == (pytest.approx(b.x, abs=1e-9), pytest.approx(b.y, abs=1e-9))
        assert arr.v[1] == pytest.approx(1.26, abs=0.03)


# --------------------------------------------------------------------------- kinematics
def test_straight_line_constant_speed():
    ego = EgoState(x=5.0, y=-3.0, z=1.0, yaw=0.7, speed=4.0, stamp_ns=0)
    dt, n = 0.5, 6
    wp = np.stack([4.0 * dt * np.arange(1, n + 1), np.zeros(n)], 1)
    arr = waypoints_to_trajectory(wp, dt, ego, WHEELBASE)
    assert len(arr) == n + 1
    np.testing.assert_allclose(arr.t, dt * np.arange(n + 1))
    np.testing.assert_allclose(arr.v, 4.0)
    np.testing.assert_allclose(arr.yaw, 0.7)
    np.testing.assert_allclose([arr.qx, arr.qy], 0.0)
    np.testing.assert_allclose(arr.qz, math.sin(0.35))
    np.testing.assert_allclose(arr.qw, math.cos(0.35))
    for field in ("acc", "heading_rate", "front_wheel_angle", "lat_v", "rear_wheel_angle"):
        np.testing.assert_allclose(getattr(arr, field), 0.0, atol=1e-12, err_msg=field)
    np.testing.assert_allclose(arr.x[-1], 5.0 + 12.0 * math.cos(0.7))


def test_constant_acceleration_speed_definition():
    v0, a, dt, n = 2.0, 1.5, 0.5, 6
    t = dt * np.arange(1, n + 1)
    wp = np.stack([v0 * t + 0.5 * a * t**2, np.zeros(n)], 1)
    arr = waypoints_to_trajectory(wp, dt, EgoState(0, 0, 0, 0, v0, 0), WHEELBASE)
    # v[k] = mean speed over (t_{k-1}, t_k] = v0 + a (t_k - dt / 2); v[0] = measured ego speed.
    np.testing.assert_allclose(arr.v, [v0] + [v0 + a * (tk - dt / 2) for tk in t])
    # acc[k] = (|v[k+1]| - |v[k]|) / dt: a/2 from the measured speed to the first half step, then a.
    np.testing.assert_allclose(arr.acc, [a / 2] + [a] * n)


@pytest.mark.parametrize("direction", [1.0, -1.0])
def test_constant_turn(direction):
    radius, speed, dt, n = 20.0, 5.0, 0.5, 8
    omega = direction * speed / radius  # rad/s, + = left (REP 103)
    yaw0 = 2.5
    ego = EgoState(x=100.0, y=50.0, z=0.0, yaw=yaw0, speed=speed, stamp_ns=0)
    theta = omega * dt * np.arange(1, n + 1)
    wp = np.stack([radius * np.sin(np.abs(theta)), direction * radius * (1 - np.cos(theta))], 1)
    arr = waypoints_to_trajectory(wp, dt, ego, WHEELBASE)
    delta = omega * dt
    chord_speed = 2 * radius * math.sin(abs(delta) / 2) / dt
    # point 0 is the ego pose: the odometry heading; point k >= 1 faces along the chord to point k + 1
    # (segments are 2.5 m, longer than the 1 m the pose yaw is measured over)
    expected_yaw = [yaw0] + [yaw0 + (k + 0.5) * delta for k in range(1, n)] + [yaw0 + (n - 0.5) * delta]
    np.testing.assert_allclose(wrap_angle(arr.yaw - np.array(expected_yaw)), 0.0, atol=1e-12)
    np.testing.assert_allclose(arr.v[1:], chord_speed)
    assert arr.v[0] == speed
    # the path's curvature is the circle's at every point (the chords' circle is the circle), the heading rate
    # that curvature at each point's speed: the measured speed at point 0, the chord speed after it
    curvature = np.tan(arr.front_wheel_angle) / WHEELBASE
    np.testing.assert_allclose(curvature, direction / radius, rtol=1e-9)
    np.testing.assert_allclose(arr.front_wheel_angle, direction * math.atan(WHEELBASE / radius), rtol=1e-9)
    np.testing.assert_allclose(arr.heading_rate, curvature * arr.v, rtol=1e-12)
    assert arr.heading_rate[0] == pytest.approx(omega, rel=1e-12)
    np.testing.assert_allclose(arr.heading_rate, omega, rtol=1e-3)  # chord vs arc speed
    # Map positions lie on the circle around the turn centre.
    centre = np.array([100.0, 50.0]) + direction * radius * np.array([-math.sin(yaw0), math.cos(yaw0)])
    np.testing.assert_allclose(np.hypot(arr.x - centre[0], arr.y - centre[1]), radius, atol=1e-9)


def test_turn_across_the_pi_boundary_has_no_wrap_jump():
    ego = EgoState(0, 0, 0, math.pi - 0.2, 5.0, 0)
    theta = 0.125 * np.arange(1, 7)
    wp = np.stack([20 * np.sin(theta), 20 * (1 - np.cos(theta))], 1)
    arr = waypoints_to_trajectory(wp, 0.5, ego, WHEELBASE)
    assert arr.yaw.min() < -2.5 and arr.yaw.max() > 2.5  # crosses +-pi
    np.testing.assert_allclose(np.tan(arr.front_wheel_angle) / WHEELBASE, 1 / 20, rtol=1e-9)
    np.testing.assert_allclose(arr.heading_rate, 0.25, rtol=1e-3)
    assert np.all(np.abs(arr.yaw) <= math.pi)


def test_stopped_with_jitter_keeps_heading():
    rng = np.random.default_rng(3)
    wp = rng.uniform(-0.004, 0.004, (6, 2))  # below min_segment_m: "not moving"
    ego = EgoState(0, 0, 0, -1.0, 0.0, 0)
    arr = waypoints_to_trajectory(wp, 0.5, ego, WHEELBASE)
    np.testing.assert_allclose(arr.yaw, -1.0)
    np.testing.assert_allclose(arr.heading_rate, 0.0)
    np.testing.assert_allclose(arr.front_wheel_angle, 0.0)
    assert np.all(np.abs(arr.v) < 0.03)


def test_standstill_jitter_keeps_the_ego_heading_in_every_pose():
    """Waypoints within half a metre of the ego (a car at standstill, the random-init demo model): no chord
    reaches the guard's 1 m, so every point keeps the odometry heading instead of pointing along
    centimetre-long segments (which put point yaws up to 180 deg off with the old per-segment rule)."""
    rng = np.random.default_rng(7)
    wp = rng.uniform(-0.25, 0.25, (6, 2))
    ego = EgoState(3.0, -2.0, 0.0, 2.9, 0.05, 0)
    arr = waypoints_to_trajectory(wp, 0.5, ego, WHEELBASE)
    np.testing.assert_allclose(wrap_angle(arr.yaw - 2.9), 0.0, atol=1e-12)
    segment_dirs = np.arctan2(np.diff(np.r_[0.0, wp[:, 1]]), np.diff(np.r_[0.0, wp[:, 0]]))
    assert np.abs(wrap_angle(segment_dirs)).max() > math.pi / 2, "the segments point anywhere"
    # with a 0 m chord the yaw follows every segment again (the old rule), except point 0 (the ego pose)
    loose = waypoints_to_trajectory(wp, 0.5, ego, WHEELBASE, heading_min_segment_m=0.0)
    assert loose.yaw[0] == pytest.approx(2.9) and np.abs(wrap_angle(loose.yaw - 2.9)).max() > 0.5


def test_slow_turn_yaw_follows_chords_of_a_metre():
    """At 1.26 m/s with 0.5 s steps the segments are 0.63 m: each point faces along the chord to the first
    point a metre or more ahead (two segments), so a slow turn keeps its headings; the tail, with no
    point that far ahead, keeps the last one."""
    radius, speed, dt, n = 6.0, 1.26, 0.5, 6
    delta = speed * dt / radius  # turn per step (rad)
    theta = delta * np.arange(1, n + 1)
    wp = np.stack([radius * np.sin(theta), radius * (1 - np.cos(theta))], 1)
    arr = waypoints_to_trajectory(wp, dt, EgoState(0, 0, 0, 0.0, speed, 0), WHEELBASE)
    # chord from point k to point k + 2 on the circle: direction (k + 1) * delta
    np.testing.assert_allclose(arr.yaw[:n - 1], [0.0] + [(k + 1) * delta for k in range(1, n - 1)], atol=1e-12)
    np.testing.assert_allclose(arr.yaw[n - 1:], (n - 1) * delta, atol=1e-12)  # nothing a metre ahead


def test_reverse_segments_keep_vehicle_heading_and_negative_speed():
    ego = EgoState(0, 0, 0, 0.4, -1.0, 0)
    wp = np.array([[-0.5, 0.0], [-1.0, 0.0], [-1.5, 0.0]])
    arr = waypoints_to_trajectory(wp, 0.5, ego, WHEELBASE)
    np.testing.assert_allclose(arr.yaw, 0.4)  # the car backs up, it does not turn around
    np.testing.assert_allclose(arr.v, -1.0)
    np.testing.assert_allclose(arr.acc, 0.0)
    np.testing.assert_allclose(arr.front_wheel_angle, 0.0, atol=1e-12)
    # Slowing down in reverse is a negative acceleration (TrajectoryPoint.msg: direction-independent).
    arr = waypoints_to_trajectory(np.array([[-0.5, 0.0], [-0.75, 0.0]]), 0.5, ego, WHEELBASE)
    np.testing.assert_allclose(arr.v, [-1.0, -1.0, -0.5])
    assert arr.acc[1] == pytest.approx(-1.0)


def test_single_waypoint():
    arr = waypoints_to_trajectory([[2.0, 0.0]], 0.5, EgoState(0, 0, 0, 0, 4.0, 0), WHEELBASE)
    assert len(arr) == 2
    np.testing.assert_allclose(arr.v, 4.0)
    np.testing.assert_allclose(arr.heading_rate, 0.0)


def test_waypoints_rejects_bad_input():
    ego = EgoState(0, 0, 0, 0, 1.0, 0)
    good = np.ones((3, 2))
    bad_waypoints = [np.array([[1.0, math.nan]]), np.array([[math.inf, 0.0]]), np.zeros((0, 2)),
                     np.zeros((3, 3)), np.zeros(4), [["a", "b"]]]
    for wp in bad_waypoints:
        with pytest.raises(ValueError):
            waypoints_to_trajectory(wp, 0.5, ego, WHEELBASE)
    for dt in (0.0, -0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="dt_s"):
            waypoints_to_trajectory(good, dt, ego, WHEELBASE)
    for wb in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="wheelbase"):
            waypoints_to_trajectory(good, 0.5, ego, wb)
    for bad in (-0.1, math.nan):
        with pytest.raises(ValueError, match="heading_min_segment_m"):
            waypoints_to_trajectory(good, 0.5, ego, WHEELBASE, heading_min_segment_m=bad)
    with pytest.raises(ValueError, match="ego.yaw"):
        waypoints_to_trajectory(good, 0.5, EgoState(0, 0, 0, math.nan, 1.0, 0), WHEELBASE)
    with pytest.raises(ValueError, match="equal length"):
        TrajectoryArrays(*([np.zeros(3)] * 14 + [np.zeros(2)]))


# =============================================================== ROS messages (msg_conv)
from autoware_planning_msgs.msg import Trajectory  # noqa: E402
from builtin_interfaces.msg import Time  # noqa: E402
from rclpy.serialization import deserialize_message, serialize_message  # noqa: E402

from hybrid_vla_ros.ros.msg_conv import ns_to_stamp, trajectory_to_msg  # noqa: E402
from hybrid_vla_ros.util.stamps import stamp_to_ns  # noqa: E402

_FLOAT32_FIELDS = {
    "longitudinal_velocity_mps": "v", "lateral_velocity_mps": "lat_v", "acceleration_mps2": "acc",
    "heading_rate_rps": "heading_rate", "front_wheel_angle_rad": "front_wheel_angle",
    "rear_wheel_angle_rad": "rear_wheel_angle",
}


def _check_msg(msg, arr, stamp_ns, frame_id):
    assert isinstance(msg, Trajectory)
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == divmod(stamp_ns, 10**9)
    assert msg.header.frame_id == frame_id
    assert len(msg.points) == len(arr)
    for k, pt in enumerate(msg.points):
        ns = round(arr.t[k] * 1e9)
        assert (pt.time_from_start.sec, pt.time_from_start.nanosec) == divmod(ns, 10**9)
        pos, ori = pt.pose.position, pt.pose.orientation
        assert (pos.x, pos.y, pos.z) == (arr.x[k], arr.y[k], arr.z[k])
        assert (ori.x, ori.y, ori.z, ori.w) == (arr.qx[k], arr.qy[k], arr.qz[k], arr.qw[k])
        for field, attr in _FLOAT32_FIELDS.items():
            assert getattr(pt, field) == pytest.approx(getattr(arr, attr)[k], rel=1e-6, abs=1e-6), field


def test_trajectory_msg_from_real_odometry(odometry):
    msg0, _ = odometry[0]
    ego = ego_state_from_odometry(msg0)
    radius, dt = 15.0, 0.5
    theta = (1.26 / radius) * dt * np.arange(1, 7)
    wp = np.stack([radius * np.sin(theta), radius * (1 - np.cos(theta))], 1)
    arr = waypoints_to_trajectory(wp, dt, ego, WHEELBASE)
    msg = trajectory_to_msg(arr, ego.stamp_ns, "map")
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (1700000000, 91370000)
    _check_msg(msg, arr, ego.stamp_ns, "map")
    assert [p.time_from_start.nanosec for p in msg.points[:3]] == [0, 500_000_000, 0]
    assert [p.time_from_start.sec for p in msg.points] == [0, 0, 1, 1, 2, 2, 3]
    assert msg.points[3].front_wheel_angle_rad == pytest.approx(math.atan(WHEELBASE / radius), abs=1e-3)
    # It serializes and comes back unchanged except for float32 rounding.
    back = deserialize_message(serialize_message(msg), Trajectory)
    _check_msg(back, arr, ego.stamp_ns, "map")


def test_time_from_start_rounding_and_stamp_conversions(odometry):
    arr = waypoints_to_trajectory(np.cumsum(np.full((7, 2), 0.1), 0), 0.1, EgoState(0, 0, 0, 0, 1.0, 0), WHEELBASE)
    msg = trajectory_to_msg(arr, 0, "map")
    # 0.30000000000000004 s -> 300 ms
    assert [p.time_from_start.nanosec for p in msg.points] == [k * 100_000_000 for k in range(8)]
    for ns in (0, 1, 999_999_999, 1_000_000_000, 1700000000091370000, (2**31 - 1) * 10**9 + 999_999_999):
        stamp = ns_to_stamp(ns)
        assert isinstance(stamp, Time) and stamp_to_ns(stamp) == ns
    for m, _ in odometry:  # rosbags' Time objects work too (duck-typed)
        assert ns_to_stamp(stamp_to_ns(m.header.stamp)).nanosec == m.header.stamp.nanosec
    assert ns_to_stamp(np.int64(5)).nanosec == 5
    for bad in (-1, 2**31 * 10**9):
        with pytest.raises(ValueError):
            ns_to_stamp(bad)
    with pytest.raises(TypeError):
        ns_to_stamp(1.5)
    with pytest.raises(ValueError):
        stamp_to_ns(SimpleNamespace(sec=1, nanosec=10**9))


def _rigid_turn(radius_m: float, arc_m: np.ndarray, ahead_m: float) -> tuple[np.ndarray, np.ndarray]:
    """A rigid vehicle whose rear axle drives a circle of ``radius_m`` (left positive) from the origin, heading
    +x: (its rear axle's positions, the track of the point ``ahead_m`` in front of it, moved so it starts at 0)
    after the arc lengths ``arc_m``."""
    yaw = arc_m / radius_m
    rear = np.stack([radius_m * np.sin(yaw), radius_m * (1 - np.cos(yaw))], axis=1)
    front = rear + ahead_m * np.stack([np.cos(yaw), np.sin(yaw)], axis=1)
    return rear, front - [ahead_m, 0.0]


@pytest.mark.parametrize("radius_m, arc_m, within_m", [
    (20.0, np.arange(1, 11) * 0.6, 1e-9),     # evenly spaced: exact
    (-8.0, np.arange(1, 11) * 0.5, 1e-9),     # a right turn
    (5.0, np.arange(1, 7) * 0.4, 1e-9),       # tight
    (20.0, np.linspace(1.5, 30, 10), 0.06),   # uneven: the first step shorter than the others
    (-10.0, np.linspace(1, 12, 6), 0.07),
])
def test_the_model_frame_track_becomes_the_rear_axles_track(radius_m, arc_m, within_m):
    """The published models plan their lidar's track (1.01 m ahead of base_link here); base_link's track follows
    from the geometry of a rigid vehicle whose rear axle moves along its heading."""
    from hybrid_vla_ros.vehicle.trajectory import model_track_to_base_link

    rear, planned = _rigid_turn(radius_m, arc_m, 1.01)
    got = model_track_to_base_link(planned, (1.01, 0.0))
    assert np.abs(got - rear).max() <= within_m
    assert np.abs(planned - rear).max() > 0.25  # taken as it is, the plan would put base_link that far off


def test_a_straight_or_standing_plan_is_base_links_own_and_bad_input_is_refused():
    from hybrid_vla_ros.vehicle.trajectory import model_track_to_base_link

    straight = np.stack([np.linspace(1, 10, 8), np.zeros(8)], axis=1)
    assert np.abs(model_track_to_base_link(straight, (1.01, 0.0)) - straight).max() < 1e-12
    jitter = np.random.default_rng(0).normal(0.0, 0.01, (6, 2))  # centimetres at standstill: no heading in it
    assert np.abs(model_track_to_base_link(jitter, (1.01, 0.0)) - jitter).max() < 1e-12
    with pytest.raises(ValueError, match="finite"):
        model_track_to_base_link([[0.0, float("nan")]], (1.01, 0.0))
    with pytest.raises(ValueError, match=r"\(N, 2\)"):
        model_track_to_base_link(np.zeros((3, 3)), (1.01, 0.0))
