"""hybrid_vla_ros.vehicle.ego_input: the ego-state model input (speed, acceleration, yaw rate) at a camera stamp.

Real data: the embedded bag's three /localization/kinematic_state messages (1 Hz, ~91 ms after each
frame's cameras) and its camera stamps; the bag has no /localization/acceleration, so the acceleration
comes from the speeds.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from hybrid_vla_ros.model.config import EGO_FEATURES
from hybrid_vla_ros.vehicle.ego_input import (
    ACCEL_SOURCES,
    LOOKUP_CAUSES,
    EgoInputBuffer,
    acceleration_sample_from_msg,
    kinematic_sample_from_odometry,
)

S = 1_000_000_000  # ns per s
T0 = 1_700_000_000 * S


def _cause(buf, stamp, max_age):
    with pytest.raises(LookupError) as e:
        buf.ego_state_at(stamp, max_age)
    assert e.value.args[0] in LOOKUP_CAUSES
    return e.value.args[0]


def test_interpolates_between_the_bracketing_samples():
    buf = EgoInputBuffer()
    buf.add_kinematic(T0, 2.0, 0.1)
    buf.add_kinematic(T0 + S // 10, 3.0, 0.3)
    buf.add_acceleration(T0, 1.0)
    buf.add_acceleration(T0 + S // 10, 2.0)
    ego, source = buf.ego_state_at(T0 + S // 40, S)  # a quarter of the way
    assert ego.dtype == np.float32 and ego.shape == (len(EGO_FEATURES),)
    assert source == "measured" and source in ACCEL_SOURCES
    np.testing.assert_allclose(ego, [2.25, 1.25, 0.15], rtol=1e-6)
    # a stamp equal to a sample gives that sample
    np.testing.assert_allclose(buf.ego_state_at(T0 + S // 10, S)[0], [3.0, 2.0, 0.3], rtol=1e-6)


def test_nearest_sample_within_max_age_when_not_bracketed():
    buf = EgoInputBuffer()
    buf.add_kinematic(T0, 2.0, 0.1)
    buf.add_kinematic(T0 + S // 10, 3.0, 0.3)
    buf.add_acceleration(T0, 0.5)
    buf.add_acceleration(T0 + S // 10, -0.5)
    # after the newest sample: its values are held (no extrapolation)
    ego, source = buf.ego_state_at(T0 + S // 5, S)
    np.testing.assert_allclose(ego, [3.0, -0.5, 0.3], rtol=1e-6)
    assert source == "measured"
    # bracketed, but one side farther than max_age: the nearest within it
    ego, _ = buf.ego_state_at(T0 + 9 * S // 100, 20_000_000)
    np.testing.assert_allclose(ego[[0, 2]], [3.0, 0.3], rtol=1e-6)
    ego, _ = buf.ego_state_at(T0 + S // 100, 20_000_000)
    np.testing.assert_allclose(ego, [2.0, 0.5, 0.1], rtol=1e-6)


def test_acceleration_falls_back_to_the_speed_difference():
    buf = EgoInputBuffer()
    for k, v in enumerate([1.0, 1.5, 2.5]):  # 20 ms apart: +25 then +50 m/s^2
        buf.add_kinematic(T0 + k * 20_000_000, v, 0.0)
    ego, source = buf.ego_state_at(T0 + 10_000_000, S)  # central: the two samples around the stamp
    assert source == "speed_difference"
    assert ego[1] == pytest.approx(25.0)
    assert buf.ego_state_at(T0 + 30_000_000, S)[0][1] == pytest.approx(50.0)
    # after the newest: the two latest (backward difference, as twist2accel)
    assert buf.ego_state_at(T0 + 50_000_000, S)[0][1] == pytest.approx(50.0)
    # before the oldest: the two earliest
    assert buf.ego_state_at(T0 - 10_000_000, S)[0][1] == pytest.approx(25.0)
    # on a sample: central around it when both neighbours are near enough, else one-sided
    assert buf.ego_state_at(T0 + 20_000_000, S)[0][1] == pytest.approx(37.5)
    assert buf.ego_state_at(T0 + 40_000_000, S)[0][1] == pytest.approx(50.0)
    # a stale acceleration sample is not used; one within max_age is
    buf.add_acceleration(T0 - 5 * S, 9.0)
    assert buf.ego_state_at(T0 + 10_000_000, S)[1] == "speed_difference"
    buf.add_acceleration(T0 + 10_000_000, -1.0)
    ego, source = buf.ego_state_at(T0 + 10_000_000, S)
    assert source == "measured" and ego[1] == pytest.approx(-1.0)


def test_finite_difference_step_has_twist2accels_1_ms_floor():
    buf = EgoInputBuffer()
    buf.add_kinematic(T0, 1.0, 0.0)
    buf.add_kinematic(T0 + 1000, 1.001, 0.0)  # 1 us apart: 1e-3 m/s over 1 ms, not over 1 us
    assert buf.ego_state_at(T0 + 500, S)[0][1] == pytest.approx(1.0, rel=1e-3)


def test_nothing_usable_raises_with_a_cause():
    buf = EgoInputBuffer()
    assert _cause(buf, T0, S) == "no_ego_state"
    buf.add_acceleration(T0, 1.0)  # an acceleration alone is no ego state
    assert _cause(buf, T0, S) == "no_ego_state"
    buf.add_kinematic(T0, 2.0, 0.0)
    assert _cause(buf, T0 + 2 * S, S) == "stale_ego_state"
    assert _cause(buf, T0 - 2 * S, S) == "stale_ego_state"
    # speed known, acceleration neither measured near the stamp nor derivable from one speed sample
    buf.clear()
    buf.add_kinematic(T0, 2.0, 0.0)
    assert _cause(buf, T0, S) == "no_acceleration"
    buf.add_kinematic(T0 + 3 * S, 2.0, 0.0)  # a second speed, but not within max_age of the stamp
    assert _cause(buf, T0, S) == "no_acceleration"
    with pytest.raises(ValueError):
        buf.ego_state_at(T0, -1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_samples_are_rejected(bad):
    buf = EgoInputBuffer()
    for call in (lambda: buf.add_kinematic(T0, bad, 0.0), lambda: buf.add_kinematic(T0, 1.0, bad),
                 lambda: buf.add_acceleration(T0, bad)):
        with pytest.raises(ValueError, match="non-finite"):
            call()
    assert _cause(buf, T0, S) == "no_ego_state", "nothing was stored"


@pytest.mark.parametrize("stamp", [-1, 1.5, True, "1"])
def test_bad_stamps_are_rejected(stamp):
    buf = EgoInputBuffer()
    with pytest.raises(ValueError, match="stamp"):
        buf.add_kinematic(stamp, 1.0, 0.0)
    with pytest.raises(ValueError, match="stamp"):
        buf.add_acceleration(stamp, 1.0)


def test_clock_jump_back_clears_both_streams():
    buf = EgoInputBuffer()
    buf.add_kinematic(T0 + 10 * S, 5.0, 0.0)
    buf.add_kinematic(T0 + 10 * S + S // 50, 5.0, 0.0)
    buf.add_acceleration(T0 + 10 * S, 1.0)
    buf.add_kinematic(T0 + 10 * S - S // 2, 4.0, 0.0)  # 0.5 s back: late, not a jump
    assert buf.time_jumps == 0
    buf.add_kinematic(T0, 1.0, 0.0)  # 10 s back: the bag restarted
    assert buf.time_jumps == 1
    assert _cause(buf, T0 + 10 * S, S) == "stale_ego_state", "the old samples are gone"
    assert _cause(buf, T0, S) == "no_acceleration", "the old acceleration went too"
    buf.add_acceleration(T0 + 10 * S - 3 * S, 0.0)  # the acceleration stream was emptied: no second jump
    assert buf.time_jumps == 1


def test_history_is_bounded():
    buf = EgoInputBuffer(maxlen=4)
    for k in range(10):
        buf.add_kinematic(T0 + k * S // 10, float(k), 0.0)
    assert _cause(buf, T0, S // 10) == "stale_ego_state"  # sample 0 was pushed out
    assert buf.ego_state_at(T0 + 6 * S // 10, S // 10)[0][0] == pytest.approx(6.0)
    with pytest.raises(ValueError):
        EgoInputBuffer(maxlen=1)


def test_equal_stamp_replaces():
    buf = EgoInputBuffer()
    buf.add_kinematic(T0, 1.0, 0.0)
    buf.add_kinematic(T0, 2.0, 0.5)
    buf.add_acceleration(T0, 3.0)
    np.testing.assert_allclose(buf.ego_state_at(T0, 0)[0], [2.0, 3.0, 0.5])


def test_wait_for_returns_when_the_sample_after_the_stamp_arrives():
    buf = EgoInputBuffer()
    buf.add_kinematic(T0, 1.0, 0.0)
    t = time.monotonic()
    assert not buf.wait_for(T0 + S, 0.05)
    assert time.monotonic() - t >= 0.04
    assert buf.wait_for(T0, 0.0), "a sample at the stamp counts"
    timer = threading.Timer(0.05, buf.add_kinematic, (T0 + S + 1, 1.0, 0.0))
    timer.start()
    t = time.monotonic()
    assert buf.wait_for(T0 + S, 5.0)
    assert time.monotonic() - t < 2.0
    timer.join()
    buf.add_acceleration(T0 + 5 * S, 0.0)
    assert not buf.wait_for(T0 + 5 * S, 0.01), "only the kinematic stream is waited for"


def test_message_readers():
    def odom(sec, nanosec, vx, wz):
        return SimpleNamespace(header=SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=nanosec)),
                               twist=SimpleNamespace(twist=SimpleNamespace(linear=SimpleNamespace(x=vx, y=9.0),
                                                                           angular=SimpleNamespace(z=wz))))

    def accel(sec, nanosec, ax):
        return SimpleNamespace(header=SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=nanosec)),
                               accel=SimpleNamespace(accel=SimpleNamespace(linear=SimpleNamespace(x=ax, y=7.0))))

    assert kinematic_sample_from_odometry(odom(3, 5, 1.5, -0.2)) == (3 * S + 5, 1.5, -0.2)
    assert acceleration_sample_from_msg(accel(3, 5, -0.7)) == (3 * S + 5, -0.7)
    for bad in (odom(1, S, 1.0, 0.0), odom(-1, 0, 1.0, 0.0), odom(1, 0, float("nan"), 0.0),
                odom(1, 0, 1.0, float("inf"))):
        with pytest.raises(ValueError):
            kinematic_sample_from_odometry(bad)
    for bad in (accel(1, -1, 0.0), accel(1, 0, float("nan"))):
        with pytest.raises(ValueError):
            acceleration_sample_from_msg(bad)


def test_embedded_bag_frames(embedded_bag):
    """The bag's odometry (1 Hz, ~91 ms after the cameras, no acceleration topic) at its camera stamps."""
    from rosbags.highlevel import AnyReader

    odometry, camera_stamps = [], set()
    with AnyReader([embedded_bag]) as reader:
        assert "/localization/acceleration" not in {c.topic for c in reader.connections}
        for conn, _, raw in reader.messages():
            if conn.topic == "/localization/kinematic_state":
                odometry.append(reader.deserialize(raw, conn.msgtype))
            elif conn.topic.endswith("/image_raw/compressed"):
                msg = reader.deserialize(raw, conn.msgtype)
                camera_stamps.add(msg.header.stamp.sec * S + msg.header.stamp.nanosec)
    samples = [kinematic_sample_from_odometry(m) for m in odometry]
    first, second, third = sorted(camera_stamps)
    buf = EgoInputBuffer()
    buf.add_kinematic(*samples[0])
    # frame 0 as a live prefix sees it: one odometry message, 91 ms after the cameras
    assert buf.wait_for(first, 0.0)
    assert _cause(buf, first, S) == "no_acceleration"
    for s in samples[1:]:
        buf.add_kinematic(*s)
    for stamp in (second, third):
        ego, source = buf.ego_state_at(stamp, S)
        assert source == "speed_difference"
        (t_a, v_a, w_a), (t_b, v_b, w_b) = [s for s in zip(samples, samples[1:]) if s[0][0] <= stamp <= s[1][0]][0]
        w = (stamp - t_a) / (t_b - t_a)
        np.testing.assert_allclose(ego, [v_a + w * (v_b - v_a), (v_b - v_a) * S / (t_b - t_a), w_a + w * (w_b - w_a)],
                                   rtol=1e-5, atol=1e-7)
    # with a tighter age only one 1 Hz odometry message is near a camera stamp: no acceleration
    assert _cause(buf, second, S // 5) == "no_acceleration"
