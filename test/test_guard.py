"""The output guard (core/guard.py) on trajectories built the way the suffix node builds them:
ego-frame waypoints -> vehicle.trajectory.waypoints_to_trajectory -> check."""
import math
from dataclasses import fields, replace

import numpy as np
import pytest

from hybrid_vla_ros.ros import params
from hybrid_vla_ros.vehicle.guard import CAUSES, GuardLimits, check_trajectory, find_violations
from hybrid_vla_ros.vehicle.trajectory import EgoState, TrajectoryArrays, chord_curvatures, waypoints_to_trajectory

DT = 0.5  # s between waypoints (the tiny preset's waypoint_dt_s)
N = 6
WHEELBASE = 2.79
NOW = 1_700_000_000 * 10**9  # the node clock (ns)
DEFAULTS = GuardLimits()


def _ego(speed=0.0):
    # somewhere in a map, heading north-east: the checks must not depend on the ego pose
    return EgoState(x=3_712.5, y=-1_204.0, z=12.0, yaw=0.8, speed=speed, stamp_ns=NOW - 200_000_000)


def _trajectory(waypoints, speed=0.0) -> TrajectoryArrays:
    return waypoints_to_trajectory(np.asarray(waypoints, dtype=float), DT, _ego(speed), WHEELBASE)


def _straight(v, n=N):
    return [(v * DT * k, 0.0) for k in range(1, n + 1)]


def _arc(radius, v, n=N, left=True):
    """Waypoints along a circle of ``radius`` (m) tangent to the ego heading, driven at ``v`` (m/s)."""
    out = []
    for k in range(1, n + 1):
        theta = v * DT * k / radius
        y = radius * (1.0 - math.cos(theta))
        out.append((radius * math.sin(theta), y if left else -y))
    return out


def _check(arrays, limits=DEFAULTS, age_s=0.3):
    return check_trajectory(arrays, NOW - int(age_s * 1e9), NOW, limits)


# ------------------------------------------------------------------------------------------ valid
@pytest.mark.parametrize("name,waypoints,speed", [
    ("straight at 10 m/s", _straight(10.0), 10.0),
    ("urban left turn, r = 12 m at 5 m/s", _arc(12.0, 5.0), 5.0),
    ("highway bend, r = 400 m at 11 m/s", _arc(400.0, 11.0, left=False), 11.0),
    ("pulling away from a stop at 2 m/s^2", [(0.5 * 2.0 * (DT * k) ** 2, 0.0) for k in range(1, N + 1)], 0.0),
    ("comfortable stop from 8 m/s", [(8.0 * DT * k - 0.5 * 1.5 * (DT * k) ** 2, 0.0) for k in range(1, N + 1)], 8.0),
    ("reversing slowly", [(-1.0 * DT * k, 0.0) for k in range(1, N + 1)], -1.0),
])
def test_realistic_trajectories_pass(name, waypoints, speed):
    assert _check(_trajectory(waypoints, speed)) == [], name


def test_jitter_at_standstill_passes_though_its_heading_is_noise():
    """Centimetre jitter around a stopped car: its heading changes are noise, its 'curvature' over those
    centimetres huge; over chords of min_segment_m there is nothing to measure, so the published heading rates
    and wheel angles are 0 and the trajectory ("stay here") goes out."""
    rng = np.random.default_rng(7)
    arrays = _trajectory(rng.uniform(-0.03, 0.03, size=(N, 2)))
    assert not arrays.front_wheel_angle.any() and not arrays.heading_rate.any()
    assert _check(arrays) == []
    # judged over every segment (min_segment_m = 0) the same noise would be a violation
    assert {"curvature_too_high", "steering_too_high"} & set(_check(arrays, replace(DEFAULTS, min_segment_m=0.0)))


def test_demo_like_waypoints_within_half_a_metre_pass():
    """The random-init tiny model's waypoints stay within ~0.5 m of the ego and jump around: speeds of
    ~1 m/s, accelerations of ~2 m/s^2, no chord of a metre (so no heading rate, no wheel angle). They must
    still go out."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        arrays = _trajectory(rng.uniform(-0.45, 0.45, size=(N, 2)), speed=-0.02)
        assert _check(arrays) == []


# ---------------------------------------------------------------------------------- each violation
def test_too_fast():
    arrays = _trajectory(_straight(15.0), 15.0)
    assert _check(arrays) == ["too_fast"]
    (v,) = find_violations(arrays, NOW, NOW, DEFAULTS)
    assert "15.00 m/s" in v.detail and "11.1" in v.detail
    assert _check(arrays, replace(DEFAULTS, max_speed_mps=20.0)) == []


def test_hard_braking_and_hard_acceleration():
    # 10 m/s, then 1 m/s half a second later: -18 m/s^2
    braking = _trajectory([(5.0, 0.0), (10.0, 0.0), (10.5, 0.0), (11.0, 0.0), (11.5, 0.0), (12.0, 0.0)], 10.0)
    assert _check(braking) == ["decel_too_high"]
    # from standstill to 8 m/s in half a second: 16 m/s^2
    launch = _trajectory(_straight(8.0), 0.0)
    assert _check(launch) == ["accel_too_high"]
    assert _check(launch, replace(DEFAULTS, max_acceleration_mps2=20.0)) == []


def test_switching_between_forward_and_reverse_at_speed_is_braking():
    """The acceleration field only sees speed magnitude (3 m/s forward, then 3 m/s reverse: 0 m/s^2);
    the switch itself needs (3 + 3) / 0.5 = 12 m/s^2 of braking."""
    wp = [(1.5, 0.0), (3.0, 0.0), (1.5, 0.0), (0.0, 0.0), (-1.5, 0.0), (-3.0, 0.0)]
    arrays = _trajectory(wp, 3.0)
    assert np.all(np.abs(arrays.acc[1:]) < 1e-9)
    assert _check(arrays) == ["decel_too_high"]
    slow = _trajectory([(x / 6.0, y) for x, y in wp], 0.5)  # the same at 0.5 m/s: 2 m/s^2
    assert "decel_too_high" not in _check(slow, replace(DEFAULTS, min_segment_m=0.1))


def test_turn_too_fast_for_its_radius():
    """r = 10 m at 11 m/s: 12.1 m/s^2 sideways (curvature 0.1 1/m itself is fine)."""
    assert _check(_trajectory(_arc(10.0, 11.0), 11.0)) == ["lateral_accel_too_high"]
    assert _check(_trajectory(_arc(10.0, 7.0), 7.0)) == []  # 4.9 m/s^2


def test_curvature_too_high():
    """r = 0.9 m (1.11 1/m) at 2.4 m/s: 1.2 m of arc per step, 1.11 m chords, so it is measured."""
    assert _check(_trajectory(_arc(0.9, 2.4, n=4, left=False), 2.4)) == ["curvature_too_high"]


def test_steering_too_high():
    """r = 4 m needs atan(2.79 / 4) = 0.61 rad of steering: fine by default, not with a 0.5 rad limit."""
    arrays = _trajectory(_arc(4.0, 4.0), 4.0)
    assert _check(arrays) == []
    assert _check(arrays, replace(DEFAULTS, max_steering_rad=0.5)) == ["steering_too_high"]


def test_non_finite_value_stops_the_checks():
    arrays = _trajectory(_straight(15.0), 15.0)  # also too fast, but NaN is all that is reported
    arrays.v[3] = np.nan
    violations = find_violations(arrays, NOW, NOW, DEFAULTS)
    assert [v.cause for v in violations] == ["non_finite"]
    assert "v" in violations[0].detail and "point 3" in violations[0].detail
    arrays = _trajectory(_straight(5.0), 5.0)
    arrays.x[-1] = np.inf
    assert _check(arrays) == ["non_finite"]


def test_one_point_is_too_few():
    full = _trajectory(_straight(5.0), 5.0)
    one = TrajectoryArrays(**{f.name: getattr(full, f.name)[:1] for f in fields(full)})
    assert _check(one) == ["too_few_points"]
    empty = TrajectoryArrays(**{f.name: getattr(full, f.name)[:0] for f in fields(full)})
    assert _check(empty) == ["too_few_points"]


def test_time_not_increasing():
    arrays = _trajectory(_straight(5.0), 5.0)
    arrays.t[3] = arrays.t[2]
    assert _check(arrays) == ["time_not_increasing"]
    arrays.t[3] = arrays.t[2] - 0.1
    assert "time_not_increasing" in _check(arrays)


def test_too_old_and_future_stamp():
    arrays = _trajectory(_straight(5.0), 5.0)
    assert _check(arrays, age_s=0.99) == []
    assert _check(arrays, age_s=1.5) == ["too_old"]
    assert _check(arrays, age_s=-0.05) == []  # within the tolerance for clock differences
    assert _check(arrays, age_s=-0.5) == ["future_stamp"]
    # a replay of a recorded bag: years old, and the check switched off
    ten_years = 10 * 365 * 86400.0
    assert _check(arrays, age_s=ten_years) == ["too_old"]
    assert _check(arrays, replace(DEFAULTS, check_age=False), age_s=ten_years) == []
    assert _check(arrays, replace(DEFAULTS, check_age=False), age_s=-ten_years) == []


def test_a_clock_at_zero_is_named_not_taken_for_a_future_stamp():
    """A node with use_sim_time before its first /clock message reads 0: every real stamp would be
    'decades ahead'; the guard says the clock has not started instead."""
    arrays = _trajectory(_straight(5.0), 5.0)
    (v,) = find_violations(arrays, NOW, 0, DEFAULTS)
    assert v.cause == "no_clock" and "use_sim_time" in v.detail and "/clock" in v.detail
    assert check_trajectory(arrays, NOW, 0, replace(DEFAULTS, check_age=False)) == []


def test_first_point_facing_away_from_the_ego_heading():
    """The first point is the ego pose: its yaw must be the odometry heading within
    max_yaw_deviation_rad (Autoware planning_validator deviation.yaw_th, 90 deg)."""
    arrays = _trajectory(_straight(5.0), 5.0)
    ego_yaw = _ego().yaw
    assert arrays.yaw[0] == pytest.approx(ego_yaw)
    assert check_trajectory(arrays, NOW, NOW, DEFAULTS, ego_yaw=ego_yaw) == []
    assert check_trajectory(arrays, NOW, NOW, DEFAULTS, ego_yaw=ego_yaw + 1.5) == []  # 86 deg: within
    (v,) = find_violations(arrays, NOW, NOW, DEFAULTS, ego_yaw=ego_yaw + 2.0)
    assert v.cause == "yaw_deviation" and "2.000 rad" in v.detail and "1.5708" in v.detail
    # across +-pi the deviation is the short way round; a NaN heading is a violation, not a pass (at standstill,
    # where the first point's yaw starts no measured arc)
    arrays = _trajectory(np.random.default_rng(2).uniform(-0.3, 0.3, size=(N, 2)))
    arrays.yaw[0] = math.pi - 0.1
    assert check_trajectory(arrays, NOW, NOW, DEFAULTS, ego_yaw=-math.pi + 0.1) == []
    assert check_trajectory(arrays, NOW, NOW, DEFAULTS, ego_yaw=float("nan")) == ["yaw_deviation"]
    # the standstill jitter of the demo model: the first point keeps the ego heading
    rng = np.random.default_rng(1)
    jitter = _trajectory(rng.uniform(-0.45, 0.45, size=(N, 2)))
    assert check_trajectory(jitter, NOW, NOW, DEFAULTS, ego_yaw=ego_yaw) == []
    np.testing.assert_allclose(jitter.yaw, ego_yaw)


def test_violations_come_most_important_first_with_all_details():
    arrays = _trajectory(_straight(15.0), 0.0)  # too fast, and 30 m/s^2 from standstill
    violations = find_violations(arrays, NOW - 3 * 10**9, NOW, DEFAULTS)
    assert [v.cause for v in violations] == ["too_old", "too_fast", "accel_too_high"]
    assert [v.cause for v in violations] == sorted((v.cause for v in violations), key=CAUSES.index)
    assert str(violations[0]) == "too_old: stamp is 3.000 s old > 1.0 s"


def test_a_nan_limit_rejects_rather_than_passes():
    arrays = _trajectory(_straight(5.0), 5.0)
    assert "too_fast" in _check(arrays, replace(DEFAULTS, max_speed_mps=float("nan")))


def test_chord_curvatures_of_a_circle_a_thinned_path_and_a_standstill():
    """Against the analytic circle: 1/r at every point of an arc tangent to the start heading (the start arc and
    the Menger circles are the same circle), for both directions of turn and in reverse; chords under
    min_chord_m are skipped, not measured; a standstill has no chord and no curvature."""
    for radius in (3.0, 25.0):
        angles = np.linspace(0.0, 1.5, 12)
        for left in (1.0, -1.0):
            kappa = chord_curvatures(radius * np.sin(angles), left * radius * (1 - np.cos(angles)), 0.0, 1.0)
            np.testing.assert_allclose(kappa, left / radius, rtol=1e-9)
    # reversing from heading 0 along a circle to the left (+y): the heading turns clockwise while the car backs
    # up, which is steering left in reverse (yaw rate = v tan(delta) / L < 0 with v < 0, delta > 0)
    angles = np.linspace(0.0, 1.0, 8)
    kappa = chord_curvatures(-5.0 * np.sin(angles), 5.0 * (1 - np.cos(angles)), 0.0, 1.0)
    np.testing.assert_allclose(kappa, 1.0 / 5.0, rtol=1e-9)
    # rotated into another frame, with the start heading: the same values
    yaw = 2.2
    x, y = 7.0 * np.sin(angles), 7.0 * (1 - np.cos(angles))
    xr, yr = 10.0 + math.cos(yaw) * x - math.sin(yaw) * y, -4.0 + math.sin(yaw) * x + math.cos(yaw) * y
    np.testing.assert_allclose(chord_curvatures(xr, yr, yaw, 1.0), 1.0 / 7.0, rtol=1e-9)
    # 0.3 and 0.31 m from the start are under 1 m: skipped; a straight 1.2 m chord from the heading: 0
    kappa = chord_curvatures([0.0, 0.3, 0.31, 1.2, 2.4], [0.0, 0.2, -0.1, 0.0, 0.0], 0.0, 1.0)
    np.testing.assert_allclose(kappa, 0.0, atol=1e-12)
    # a standstill (centimetres of jitter) leaves nothing to measure
    rng = np.random.default_rng(3)
    assert not chord_curvatures(rng.uniform(-0.3, 0.3, 7), rng.uniform(-0.3, 0.3, 7), 0.4, 1.0).any()
    # the start arc: tangent to the start heading through the first kept point (2 sin(a) / chord)
    kappa = chord_curvatures([0.0, 2.0 * math.cos(0.3)], [0.0, 2.0 * math.sin(0.3)], 0.0, 1.0)
    np.testing.assert_allclose(kappa, 2.0 * math.sin(0.3) / 2.0)


def test_every_published_value_is_judged_where_the_segments_are_short():
    """Walking pace, 0.45 m per step: no segment is a min_segment_m long, yet the chords over two steps turn
    hard. The published heading rate and steering come from the same 1 m chords the guard judges, and a
    message whose own heading-rate or steering field breaks a limit at any point is rejected (before: fields
    from the individual segments, judged only where both segments were >= 1 m: 1.52 rad steering published)."""
    zigzag = [(0.45 * k, 0.3 * (k % 2)) for k in range(1, N + 1)]
    arrays = _trajectory(zigzag, 0.9)
    assert np.all(np.hypot(np.diff(arrays.x), np.diff(arrays.y)) < DEFAULTS.min_segment_m)
    causes = _check(arrays)
    kappa = chord_curvatures(arrays.x, arrays.y, arrays.yaw[0], DEFAULTS.min_segment_m)
    np.testing.assert_allclose(arrays.heading_rate, kappa * arrays.v)
    np.testing.assert_allclose(arrays.front_wheel_angle, np.arctan(WHEELBASE * kappa))
    fine = np.abs(kappa).max() <= DEFAULTS.max_curvature_per_m
    assert ("curvature_too_high" not in causes) == fine
    gentle = _trajectory(_arc(30.0, 0.9), 0.9)  # 0.45 m per step along a 30 m circle: fine
    assert _check(gentle) == []
    for field, value, cause in (("front_wheel_angle", 1.52, "steering_too_high"),
                                ("heading_rate", 3.4 * 0.9, "curvature_too_high")):
        doctored = _trajectory(_arc(30.0, 0.9), 0.9)
        getattr(doctored, field)[3] = value
        assert _check(doctored) == [cause], field


# ---------------------------------------------------------------------------- node parameters
def test_limits_are_the_guard_parameters_of_the_suffix_schema():
    specs = params.parameter_specs("suffix_node")
    guard_params = [name for name in specs if name.startswith("guard.")]
    assert guard_params == [f"guard.{f.name}" for f in fields(GuardLimits)]
    assert GuardLimits.from_params(params.defaults("suffix_node")) == GuardLimits(), \
        "schema defaults and dataclass defaults agree"
    validated = params.validate("suffix_node", {"model_path": "/", "split_layer": 1, "guard.max_speed_mps": 30})
    limits = GuardLimits.from_params(validated)
    assert limits.max_speed_mps == 30.0 and isinstance(limits.max_speed_mps, float)
