"""Issue 43: open-loop figures of published trajectories against the logged drive (vehicle/open_loop.py and
``hybrid-vla evaluate``): hand-computed values on a synthetic path, a real 60 s drive (comma2k19) and the
embedded bag's odometry, the trajectories built by the suffix node's own conversion and message code."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hybrid_vla_ros.tools.evaluate import logged_path, replay_open_loop
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.util.paths import embedded_bag
from hybrid_vla_ros.vehicle.open_loop import LoggedPath, PlannedPath, frame_errors, summarize
from hybrid_vla_ros.vehicle.trajectory import EgoState, waypoints_to_trajectory

COMMA = Path(__file__).resolve().parents[2] / "shared" / "data" / "comma2k19_example1_pose" / "global_pose"
S = 1_000_000_000


def straight_path(heading: float = 0.0, speed: float = 10.0, seconds: float = 10.0, hz: float = 10.0) -> LoggedPath:
    """A drive at ``speed`` m/s along ``heading`` from (5, -3), sampled at ``hz`` from t = 1 s."""
    t = np.arange(0.0, seconds + 1e-9, 1.0 / hz)
    xy = np.stack([5 + speed * t * math.cos(heading), -3 + speed * t * math.sin(heading)], axis=1)
    return LoggedPath((S + np.rint(t * S)).astype(np.int64), xy, np.full(t.size, heading))


def offset_plan(path: LoggedPath, stamp_ns: int, dt: float, n: int, lateral, yaw_error: float = 0.0,
                longitudinal=None) -> PlannedPath:
    """The logged future at ``stamp_ns + i * dt`` (i < n), moved by ``lateral[i]`` to the left and
    ``longitudinal[i]`` forward of the logged pose, its yaw off by ``yaw_error``."""
    t = np.arange(n) * dt
    xy, yaw, covered = path.poses_at(stamp_ns + np.rint(t * S).astype(np.int64))
    assert covered.all()
    lon = np.zeros(n) if longitudinal is None else np.asarray(longitudinal, float)
    lat = np.asarray(lateral, float)
    c, s = np.cos(yaw), np.sin(yaw)
    moved = np.stack([xy[:, 0] + c * lon - s * lat, xy[:, 1] + s * lon + c * lat], axis=1)
    return PlannedPath(stamp_ns, path.frame_id, t, moved, yaw + yaw_error)


@pytest.mark.parametrize("heading", [0.0, math.radians(30), math.radians(-170)])
def test_hand_computed_errors_per_horizon(heading):
    """Point i of a 9-point trajectory (0.5 s apart) lies 0.1 * i m left of the logged pose, 0.05 rad off:
    ADE(H) is the mean of 0.1 * i over the points up to H, FDE the last; the 8 s horizon is beyond it."""
    path = straight_path(heading)
    plan = offset_plan(path, 2 * S, 0.5, 9, 0.1 * np.arange(9), yaw_error=0.05)
    f = frame_errors(plan, path)
    expect = {"1s": (0.1, 0.2, 3), "2s": (0.2, 0.4, 5), "3s": (0.3, 0.6, 7), "4s": (0.4, 0.8, 9),
              "full": (0.4, 0.8, 9)}
    assert set(f.horizons) == set(expect) and f.left_out == {"8s": "beyond the trajectory"}
    for name, (ade, fde, points) in expect.items():
        h = f.horizons[name]
        assert h.points == points
        assert h.ade_m == pytest.approx(ade, abs=1e-9) and h.fde_m == pytest.approx(fde, abs=1e-9)
        assert h.lateral_mean_m == pytest.approx(ade, abs=1e-9) and h.lateral_max_m == pytest.approx(fde, abs=1e-9)
        assert h.longitudinal_max_m == pytest.approx(0.0, abs=1e-9)
        assert h.ahe_rad == pytest.approx(0.05, abs=1e-12) and h.fhe_rad == pytest.approx(0.05, abs=1e-12)
    assert f.lateral_m == pytest.approx(0.1 * np.arange(9), abs=1e-9)  # signed: left is +


def test_longitudinal_sign_and_the_horizon_tolerance():
    """Points 1 m behind the logged pose are longitudinal -1 (lateral 0); with points 0.3 s apart the 1 s horizon
    takes t = 0.9 (within 0.1 s), with 0.4 s apart it is left out (0.8 is 0.2 s short), for that reason, not as
    beyond the trajectory."""
    path = straight_path(math.radians(75))
    behind = offset_plan(path, 3 * S, 0.3, 8, np.zeros(8), longitudinal=-np.ones(8))
    f = frame_errors(behind, path)
    assert f.horizons["1s"].points == 4 and f.longitudinal_m == pytest.approx(-np.ones(8))
    assert f.left_out["2s"] == "no point within 0.1 s below it"  # 1.8 s is the last point below 2 s, 2.1 s the end
    assert f.horizons["full"].longitudinal_mean_m == pytest.approx(1.0) and f.horizons["full"].lateral_max_m < 1e-9
    coarse = frame_errors(offset_plan(path, 3 * S, 0.4, 8, np.zeros(8)), path)
    assert coarse.left_out["1s"] == "no point within 0.1 s below it" and coarse.horizons["2s"].points == 6


def test_a_horizon_the_log_does_not_cover_is_left_out_and_counted():
    """A trajectory stamped 1.5 s before the log ends reaching 1.5 s: 1 s is compared, 2 s is absent; one
    reaching past the log's end has no horizon there (absent, never zero); the summary counts them by reason; a
    gap in the odometry longer than max_gap_s is not interpolated."""
    path = straight_path(seconds=4.0)
    end = int(path.stamps_ns[-1])
    late = frame_errors(offset_plan(path, end - int(1.5 * S), 0.5, 4, np.full(4, 0.3)), path, (1.0, 2.0))
    early = frame_errors(offset_plan(path, 2 * S, 0.5, 5, np.full(5, 0.1)), path, (1.0, 2.0))
    assert set(late.horizons) == {"1s", "full"} and late.left_out == {"2s": "beyond the trajectory"}
    plan_past_end = PlannedPath(end - S, "map", np.array([0.0, 1.0, 2.0]), np.zeros((3, 2)), np.zeros(3))
    assert frame_errors(plan_past_end, path, (2.0,)).left_out == {"2s": "beyond the logged path",
                                                                  "full": "beyond the logged path"}
    s = summarize([late, early], {"frame 'odom'": 1}, (1.0, 2.0))
    assert s.horizons["1s"].frames == 2 and s.horizons["1s"].mean.ade_m == pytest.approx(0.2)
    assert s.horizons["1s"].mean.points == 6 and s.horizons["2s"].mean.ade_m == pytest.approx(0.1)
    assert s.horizons["2s"].frames == 1 and s.horizons["2s"].left_out == {"beyond the trajectory": 1}
    assert s.not_compared == {"frame 'odom'": 1} and s.frames == 2
    # a ground truth already reaches past its log: evaluated with no reach of its own after its last pose
    truth = LoggedPath(path.stamps_ns, path.xy, path.yaw, reach_after_s=0.0)
    assert list(truth.poses_at(np.array([end, end + S // 20]))[2]) == [True, False]
    assert list(path.poses_at(np.array([end + S // 20, end + S // 5]))[2]) == [True, False]
    gappy = LoggedPath(np.array([0, S, 4 * S, 5 * S]), np.array([[0, 0], [1, 0], [4, 0], [5, 0.0]]), np.zeros(4))
    xy, _, covered = gappy.poses_at(np.array([S // 2, 2 * S, 4 * S + S // 2]))
    assert covered.tolist() == [True, False, True] and np.isnan(xy[1]).all() and xy[2, 0] == pytest.approx(4.5)


def test_base_link_trajectories_and_unknown_frames():
    """A base_link trajectory is carried into the map by the logged pose at its stamp; another frame is refused."""
    path = straight_path(math.radians(120))
    plan = offset_plan(path, 2 * S, 0.5, 5, np.full(5, 0.2))
    xy0, yaw0, _ = path.poses_at(np.array([2 * S]))
    c, s = math.cos(yaw0[0]), math.sin(yaw0[0])
    d = plan.xy - xy0[0]
    local = np.stack([c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1]], axis=1)
    base = PlannedPath(plan.stamp_ns, "base_link", plan.t_s, local, plan.yaw - yaw0[0])
    assert frame_errors(base, path).horizons["2s"].ade_m == pytest.approx(0.2)
    with pytest.raises(ValueError, match="frame 'odom'"):
        frame_errors(PlannedPath(plan.stamp_ns, "odom", plan.t_s, plan.xy, plan.yaw), path)
    frames, not_compared = replay_open_loop({plan.stamp_ns: PlannedPath(plan.stamp_ns, "odom", plan.t_s, plan.xy,
                                                                        plan.yaw)}, path, 0, 1, 0)
    assert frames == [] and list(not_compared.values()) == [1] and "odom" in next(iter(not_compared))


def comma_path() -> tuple[LoggedPath, np.ndarray]:
    """comma2k19's 60 s drive at 20 Hz in a local east-north frame (m) from its ECEF positions, heading from the
    ECEF velocity; returns the path and the speeds (m/s)."""
    t = np.load(COMMA / "frame_times")
    pos = np.load(COMMA / "frame_positions")
    vel = np.load(COMMA / "frame_velocities")
    x, y, z = pos[0]
    lon, lat = math.atan2(y, x), math.atan2(z, math.hypot(x, y))  # geocentric latitude is enough for a local frame
    east = np.array([-math.sin(lon), math.cos(lon), 0.0])
    north = np.array([-math.sin(lat) * math.cos(lon), -math.sin(lat) * math.sin(lon), math.cos(lat)])
    d = pos - pos[0]
    xy = np.stack([d @ east, d @ north], axis=1)
    heading = np.arctan2(vel @ north, vel @ east)
    stamps = (1_600_000_000 * S + np.rint((t - t[0]) * S)).astype(np.int64)
    return LoggedPath(stamps, xy, heading), np.linalg.norm(vel, axis=1)


@pytest.mark.skipif(not COMMA.is_dir(), reason="../shared/data/comma2k19_example1_pose is not beside the repository")
def test_a_real_drive_scores_its_own_future_zero_and_a_late_plan_by_its_speed():
    """On a real 60 s highway drive: trajectories sampled from the logged future score ~0 at every horizon; a
    plan that is the drive 0.5 s late is off by the distance covered in 0.5 s (computed here with np.interp)."""
    path, speed = comma_path()
    t_rel = (path.stamps_ns - path.stamps_ns[0]) / S
    frames = []
    for t0 in (5.0, 20.0, 40.0):
        stamp = int(path.stamps_ns[0] + t0 * S)
        exact = frame_errors(offset_plan(path, stamp, 0.5, 17, np.zeros(17)), path)
        assert set(exact.horizons) == {"1s", "2s", "3s", "4s", "8s", "full"}
        assert max(h.ade_m + h.fde_m + h.ahe_rad for h in exact.horizons.values()) < 1e-6
        late_t = t0 + np.arange(9) * 0.5 - 0.5
        late_xy = np.stack([np.interp(late_t, t_rel, path.xy[:, 0]), np.interp(late_t, t_rel, path.xy[:, 1])], 1)
        late = PlannedPath(stamp, "map", np.arange(9) * 0.5, late_xy, np.interp(late_t, t_rel, path.yaw))
        f = frame_errors(late, path)
        truth_xy = np.stack([np.interp(late_t + 0.5, t_rel, path.xy[:, 0]),
                             np.interp(late_t + 0.5, t_rel, path.xy[:, 1])], 1)
        expect = np.hypot(*(truth_xy - late_xy).T)
        assert f.horizons["4s"].ade_m == pytest.approx(expect.mean(), rel=1e-9)
        assert f.horizons["2s"].fde_m == pytest.approx(expect[4], rel=1e-9)
        assert np.interp(t0, t_rel, speed) > 10  # a highway: the error is mostly along the road
        assert f.horizons["1s"].longitudinal_max_m == pytest.approx(expect[:3].max(), rel=0.01)
        assert f.horizons["1s"].lateral_max_m < 0.1 * f.horizons["1s"].longitudinal_max_m
        frames.append(f)
    assert summarize(frames).horizons["4s"].frames == 3


def test_loops_of_a_replay_compare_with_their_own_loop():
    """A replay shifts loop n's stamps by n * loop_ns: the same plan in loop 2 scores as in loop 0, and one whose
    loop the log cannot reach (stamps not shifted) is beyond the logged path."""
    path = straight_path(seconds=4.0)
    loop_ns = 5 * S
    plan = offset_plan(path, 2 * S, 0.5, 5, np.full(5, 0.25))
    moved = PlannedPath(plan.stamp_ns + 2 * loop_ns, "map", plan.t_s, plan.xy, plan.yaw)
    frames, not_compared = replay_open_loop({moved.stamp_ns: moved, plan.stamp_ns: plan}, path, loop_ns, 3,
                                            int(path.stamps_ns[0]))
    assert not_compared == {} and [f.horizons["2s"].ade_m for f in frames] == pytest.approx([0.25, 0.25])
    (f,), _ = replay_open_loop({moved.stamp_ns: moved}, path, 0, 1, 0)
    assert f.horizons == {} and set(f.left_out.values()) == {"beyond the logged path", "beyond the trajectory"}


def test_the_embedded_bags_odometry_and_bad_messages():
    """The embedded bag's 3 odometry samples (2.1 s, map frame) make the path; a message with a NaN position, one
    in another frame and a repeated stamp are dropped and named, not fatal."""
    messages = read_bag(embedded_bag())
    path, dropped = logged_path(messages)
    assert dropped == [] and path.frame_id == "map" and len(path.stamps_ns) == 3
    assert (path.stamps_ns[-1] - path.stamps_ns[0]) / S == pytest.approx(2.0, abs=0.1)
    from hybrid_vla_ros.tools.output_bag import typestore

    store = typestore()
    odom = [store.deserialize_cdr(m.raw, m.msgtype) for m in messages if m.topic == "/localization/kinematic_state"]
    nan = store.deserialize_cdr(next(m.raw for m in messages if m.topic == "/localization/kinematic_state"),
                                "nav_msgs/msg/Odometry")
    nan.pose.pose.position.x = float("nan")
    other = store.deserialize_cdr(messages[[m.topic for m in messages].index("/localization/kinematic_state")].raw,
                                  "nav_msgs/msg/Odometry")
    other.header.frame_id = "odom"
    again, bad = LoggedPath.from_odometry(odom + [nan, other, odom[1]])
    assert np.array_equal(again.stamps_ns, path.stamps_ns) and len(bad) == 3
    assert "non-finite" in bad[0] and "frame 'odom'" in bad[1] and "repeated stamp" in bad[2]
    assert LoggedPath.from_odometry(odom[:1])[0] is None
    # the bag's pose topic instead (geometry_msgs/PoseStamped: no twist, the pose directly under `pose`)
    PoseStamped = store.types["geometry_msgs/msg/PoseStamped"]
    poses = [PoseStamped(header=o.header, pose=o.pose.pose) for o in odom]
    from_poses, bad = LoggedPath.from_odometry(poses)
    assert bad == [] and np.array_equal(from_poses.xy, path.xy) and np.array_equal(from_poses.yaw, path.yaw)


def test_evaluate_on_a_bag_of_trajectories_built_by_the_nodes_conversion(tmp_path, capsys):
    """``hybrid-vla evaluate``: trajectories made by the suffix node's own conversion (waypoints_to_trajectory, then
    trajectory_to_msg) from the embedded bag's logged future, written with the replay's OutputBag: ADE and FDE
    ~0 at 1 and 2 s (3 s beyond the 2.1 s log); the odometry from --odometry-bag; a bag without trajectories
    and a missing bag are clear errors."""
    pytest.importorskip("rclpy")
    from rclpy.serialization import serialize_message

    from hybrid_vla_ros.ros.msg_conv import trajectory_to_msg
    from hybrid_vla_ros.tools.cli import main
    from hybrid_vla_ros.tools.output_bag import OutputBag

    path, _ = logged_path(read_bag(embedded_bag()))
    bag = OutputBag(tmp_path / "trajectories")
    conn = bag.add_topic("/planning/hybrid_vla/trajectory", "autoware_planning_msgs/msg/Trajectory")
    for stamp in path.stamps_ns[:2]:
        xy, yaw, _ = path.poses_at(np.array([stamp]))
        ego = EgoState(x=xy[0, 0], y=xy[0, 1], z=0.0, yaw=yaw[0], speed=1.2, stamp_ns=int(stamp))
        future, _, covered = path.poses_at(stamp + np.arange(1, 9) * S // 4)
        future = future[covered]
        c, s = math.cos(yaw[0]), math.sin(yaw[0])
        d = future - xy[0]
        waypoints = np.stack([c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1]], axis=1)
        arrays = waypoints_to_trajectory(waypoints, 0.25, ego, 2.7)
        bag.write(conn, int(stamp), serialize_message(trajectory_to_msg(arrays, int(stamp), "map")))
    bag.close()
    report = tmp_path / "open_loop.json"
    assert main(["evaluate", str(bag.path), "--odometry-bag", str(embedded_bag()), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    import json

    r = json.loads(report.read_text())
    assert r["frames_compared"] == 2 and r["horizons"]["1s"]["frames"] == 2 and r["horizons"]["2s"]["frames"] == 1
    assert r["horizons"]["1s"]["ade_m"] < 1e-6 and r["horizons"]["2s"]["fde_m"] < 1e-6
    assert r["horizons"]["3s"]["frames"] == 0 and r["horizons"]["3s"]["ade_m"] is None
    assert "1s: ADE 0.000 m" in out and "3s: none (2 beyond the trajectory)" in out
    assert main(["evaluate", str(embedded_bag())]) == 2
    assert "no message on /planning/hybrid_vla/trajectory in" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path / "nowhere")]) == 2
    assert main(["evaluate", str(bag.path)]) == 2  # no odometry in that bag: said, nothing computed
    assert "no message on /localization/kinematic_state in" in capsys.readouterr().err
    # bad options and inputs: one line each, exit 2, never a traceback
    (tmp_path / "not_a_bag").mkdir()
    (tmp_path / "x.txt").write_text("no bag")
    for argv, needle in (([str(tmp_path / "not_a_bag")], "cannot read the bag"),
                         ([str(tmp_path / "x.txt")], "cannot read the bag"),
                         ([str(bag.path), "--json", str(tmp_path / "no" / "x.json")], "--json: the folder"),
                         ([str(bag.path), "--json", str(tmp_path)], "--json: "),
                         ([str(bag.path), "--horizons", "nan"], "--horizons must be > 0 s"),
                         ([str(bag.path), "--trajectory-topic", "/nope"], "no message on /nope"),
                         ([str(bag.path), "--odometry-bag", str(embedded_bag()), "--odometry-topic",
                           "/sensing/camera/camera0/image_raw/compressed"], "not an odometry or pose topic")):
        assert main(["evaluate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
    assert main(["evaluate", str(embedded_bag()), "--trajectory-topic", "/localization/kinematic_state"]) == 2
    assert "is nav_msgs/msg/Odometry, not a trajectory" in capsys.readouterr().err


def test_the_suffix_oracle_reads_its_bag_and_refuses_one_without_a_drive(tmp_path):
    """``oracle_bag`` (suffix_outputs.load_oracle): the embedded bag gives its 3-sample drive; a missing folder and a
    bag without odometry are one clear error each (the node's configure fails with it, as for any bad parameter).
    The oracle's waypoints put back with the same pose are the logged positions; past the log's end there are none."""
    pytest.importorskip("rclpy")
    from hybrid_vla_ros.ros.suffix_outputs import load_oracle
    from hybrid_vla_ros.tools.output_bag import OutputBag
    from hybrid_vla_ros.vehicle.open_loop import oracle_waypoints

    path = load_oracle(str(embedded_bag()))
    assert len(path.stamps_ns) == 3 and path.frame_id == "map"
    with pytest.raises(ValueError, match="cannot be read"):
        load_oracle(str(tmp_path / "nowhere"))
    empty = OutputBag(tmp_path / "no_odometry")
    empty.add_topic("/planning/hybrid_vla/trajectory", "autoware_planning_msgs/msg/Trajectory")
    empty.close()
    with pytest.raises(ValueError, match="has 0 odometry message"):
        load_oracle(str(empty.path))
    stamp = int(path.stamps_ns[0])
    xy, yaw, _ = path.poses_at(np.array([stamp]))
    ego = EgoState(x=xy[0, 0], y=xy[0, 1], z=0.0, yaw=yaw[0], speed=1.0, stamp_ns=stamp)
    wp = oracle_waypoints(path, ego, 6, 0.5)
    assert wp.shape == (4, 2)  # 0.5 .. 2.0 s: 2.1 s logged after the first sample (its end + 0.1 s reach)
    back = waypoints_to_trajectory(wp, 0.5, ego, 2.79)
    truth, _, _ = path.poses_at(stamp + np.arange(1, 5) * S // 2)
    assert np.abs(np.stack([back.x[1:], back.y[1:]], 1) - truth).max() < 1e-9
    with pytest.raises(ValueError, match="does not cover"):
        oracle_waypoints(path, EgoState(0.0, 0.0, 0.0, 0.0, 0.0, int(path.stamps_ns[-1]) + S), 6, 0.5)
