"""Inputs besides images, through real node processes: the ego state (speed, acceleration, yaw rate)
fed to the prefix of a checkpoint with ``ego_state_input``, and the navigation command of the suffix.

The test process is lifecycle manager and sensor driver (as in test_nodes.py): it publishes real frames
and odometry of the embedded bag (LoopingFramePlayer), acceleration messages and command names.
"""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

rclpy = pytest.importorskip("rclpy")

from test_nodes import Graph, _set_param, _try_set_param  # noqa: E402

from hybrid_vla_ros.model.config import NAV_COMMANDS, VLAConfig  # noqa: E402
from hybrid_vla_ros.ros.graph import wait_for_subscribers  # noqa: E402
from hybrid_vla_ros.ros.lifecycle_client import LifecycleClient  # noqa: E402
from hybrid_vla_ros.ros.params import parameter_specs  # noqa: E402
from hybrid_vla_ros.tools.frame_player import LoopingFramePlayer  # noqa: E402
from hybrid_vla_ros.tools.replay import launch_node, stop_processes  # noqa: E402
from hybrid_vla_ros.transport.ring import segment_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# The guard is not under test here: random-init modes may turn sharply, so its limits are wide.
WIDE_GUARD = {"guard.check_age": False, "guard.max_speed_mps": 100.0, "guard.max_acceleration_mps2": 100.0,
              "guard.min_acceleration_mps2": -100.0, "guard.max_lateral_acceleration_mps2": 100.0,
              "guard.max_curvature_per_m": 100.0, "guard.max_steering_rad": 3.0}


@pytest.fixture(scope="module")
def ego_checkpoint(tmp_path_factory) -> Path:
    """A random-init 'tiny' checkpoint (6 planner modes) that takes the ego state."""
    from hybrid_vla_ros.model.checkpoint import init_model

    path = tmp_path_factory.mktemp("models") / "tiny_ego"
    cfg = init_model("tiny", path, overrides={"ego_state_input": True})
    assert cfg.ego_state_input and cfg.n_modes == len(NAV_COMMANDS)
    return path


@pytest.fixture
def ego_nodes(tmp_path, ego_checkpoint):
    ns = f"/eg_{uuid.uuid4().hex[:8]}"
    common = {"model_path": str(ego_checkpoint), "dtype": "fp32", "split_layer": 2}
    params = {
        f"{ns}/prefix_node": {"ros__parameters": {**common, "camera_transports": ["compressed"], "device": "cpu",
                                                  "camera_topics": [f"{ns}/cam{i}" for i in range(6)]}},
        f"{ns}/suffix_node": {"ros__parameters": {**common, **WIDE_GUARD}},
    }
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    procs = [launch_node("prefix_node", ns, params_file, ["-r", f"~/input/kinematic_state:={ns}/odom",
                                                          "-r", f"~/input/acceleration:={ns}/accel"],
                         tmp_path / "prefix.log"),
             launch_node("suffix_node", ns, params_file, ["-r", f"~/input/kinematic_state:={ns}/odom",
                                                          "-r", f"~/input/navigation_command:={ns}/command"],
                         tmp_path / "suffix.log")]
    graph = Graph(ns)
    prefix = LifecycleClient(graph.node, f"{ns}/prefix_node")
    suffix = LifecycleClient(graph.node, f"{ns}/suffix_node")
    try:
        assert prefix.wait_for_services(60, procs) and suffix.wait_for_services(60, procs), _logs(tmp_path)
        for client in (prefix, suffix):
            assert client.change_state("configure", 60)[0], _logs(tmp_path)
            assert client.change_state("activate", 10)[0], _logs(tmp_path)
        yield ns, graph, tmp_path
    finally:
        graph.close()
        codes = stop_processes(procs)
        assert codes == [0, 0], _logs(tmp_path)
        assert not Path("/dev/shm", segment_name("prefix_states", ns)).exists()


def _logs(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.glob("*.log")))


def _diag(graph, ns, node) -> dict:
    """The node's latest /diagnostics values. No lock: Graph.wait calls predicates holding graph.lock, and
    the callback replaces a node's dict as a whole."""
    return graph.diag.get(f"{ns}/{node}: pipeline", {})


def _player(graph, ns, embedded_bag) -> LoopingFramePlayer:
    player = LoopingFramePlayer(graph.node, ns, embedded_bag)
    assert player.wait_for_subscribers()
    assert wait_for_subscribers([player.odom_pub], 20, minimum=2)  # prefix and suffix
    assert player.odom_pub.get_subscription_count() == 2
    return player


def _frame(graph, player, logs) -> np.ndarray:
    """Publish the player's next frame, wait for its trajectory; its (x, y) points (m, map frame)."""
    n = len(graph.trajectories)
    stamp = player.publish()
    assert graph.wait(lambda: len(graph.trajectories) > n), _logs(logs)
    traj = graph.trajectories[-1]
    assert traj.header.stamp.sec * 10**9 + traj.header.stamp.nanosec == stamp
    return np.array([[p.pose.position.x, p.pose.position.y] for p in traj.points])


def test_schemas_name_the_checkpoint_commands():
    assert parameter_specs("suffix_node")["navigation_command"]["enum"] == list(NAV_COMMANDS)
    assert parameter_specs("suffix_node")["navigation_command"]["default"] == "LANE_FOLLOW"


def test_prefix_feeds_the_ego_state_and_drops_frames_without_it(ego_nodes, embedded_bag):
    from geometry_msgs.msg import AccelWithCovarianceStamped

    ns, graph, logs = ego_nodes
    player = _player(graph, ns, embedded_bag)
    # cameras without any odometry: the prefix waits ego_state_wait_s, then drops the frame, counted
    player.odom_window_ns = -1
    player.publish()
    assert graph.wait(lambda: int(_diag(graph, ns, "prefix_node").get("drop_no_ego_state", 0)) == 1), _logs(logs)
    assert "dropped (no_ego_state, 1 so far)" in (logs / "prefix.log").read_text()
    assert graph.trajectories == []
    # with the bag's odometry (1 Hz, one message on each side of every frame) the frames come out; the
    # bag has no acceleration, so it is the difference of the speeds
    player.odom_window_ns = 950_000_000
    for _ in range(3):
        _frame(graph, player, logs)
    assert graph.wait(lambda: int(_diag(graph, ns, "prefix_node").get("ego_accel_speed_difference", 0)) == 3)
    values = _diag(graph, ns, "prefix_node")
    assert values["ego_state_input"] == "True" and values["ego_accel_measured"] == "0"
    assert int(values["frames_out"]) == 3 and int(values["drop_no_ego_state"]) == 1
    # an acceleration message at the next camera stamp is used as measured
    accel_pub = graph.node.create_publisher(AccelWithCovarianceStamped, f"{ns}/accel", 10)
    wait_for_subscribers([accel_pub], 10)
    loop, i = divmod(player.count, len(player.image_stamps))
    msg = AccelWithCovarianceStamped()
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(player.image_stamps[i] + loop * player.loop_ns, 10**9)
    msg.accel.accel.linear.x = 0.5
    accel_pub.publish(msg)
    time.sleep(0.5)  # delivered before the frame's images (another topic: no ordering between the two)
    _frame(graph, player, logs)
    assert graph.wait(lambda: int(_diag(graph, ns, "prefix_node").get("ego_accel_measured", 0)) == 1), _logs(logs)
    # a non-finite odometry message is refused and counted, not buffered
    odom = player.odom[0]
    odom.twist.twist.linear.x = float("nan")
    player.odom_pub.publish(odom)
    assert graph.wait(lambda: int(_diag(graph, ns, "prefix_node").get("drop_bad_kinematic_state", 0)) == 1)


def test_navigation_command_topic_and_parameter_select_the_mode(ego_nodes, embedded_bag):
    from std_msgs.msg import String

    ns, graph, logs = ego_nodes
    player = _player(graph, ns, embedded_bag)
    command_pub = graph.node.create_publisher(String, f"{ns}/command", 10)
    wait_for_subscribers([command_pub], 10)
    assert graph.wait(lambda: _diag(graph, ns, "suffix_node").get("navigation_command") == "LANE_FOLLOW")

    def command_in_use(name):
        return graph.wait(lambda: _diag(graph, ns, "suffix_node").get("navigation_command") == name)

    # loop k of the player repeats the bag's 3 frames with the same images, relative odometry and poses,
    # so a loop's trajectories equal the first loop's unless the command changed
    lane_follow = [_frame(graph, player, logs) for _ in range(3)]
    command_pub.publish(String(data="LEFT"))
    assert command_in_use("LEFT"), _logs(logs)
    left = [_frame(graph, player, logs) for _ in range(3)]
    for a, b in zip(lane_follow, left):
        assert a.shape == b.shape and np.abs(a - b).max() > 1e-3, "another mode, another trajectory"
        assert np.array_equal(a[0], b[0]), "both start at the ego pose"
    assert "navigation command LANE_FOLLOW -> LEFT (from topic" in (logs / "suffix.log").read_text()
    # a bad name is counted and the previous command stays
    command_pub.publish(String(data="FORWARD"))
    assert graph.wait(lambda: int(_diag(graph, ns, "suffix_node").get("drop_bad_navigation_command", 0)) == 1)
    assert _diag(graph, ns, "suffix_node")["navigation_command"] == "LEFT"
    assert np.abs(_frame(graph, player, logs) - left[0]).max() < 1e-5
    # the parameter: checked against the command names when set, applied from the next frame on
    result = _try_set_param(graph, f"{ns}/suffix_node", "navigation_command", "FORWARD")
    assert not result.successful and result.reason.startswith("navigation_command: must be one of LEFT, RIGHT")
    _set_param(graph, f"{ns}/suffix_node", "navigation_command", "LANE_FOLLOW")
    assert command_in_use("LANE_FOLLOW")
    again = [_frame(graph, player, logs) for _ in range(2)]  # bag frames 1 and 2
    for a, b in zip(lane_follow[1:], again):
        assert np.abs(a - b).max() < 1e-5, "the same inputs and command give the same trajectory"
    assert "navigation command LEFT -> LANE_FOLLOW (from parameter" in (logs / "suffix.log").read_text()


def test_replay_of_the_embedded_bag_with_an_ego_checkpoint(tmp_path, ego_checkpoint, embedded_bag):
    """`hybrid-vla replay` feeds the bag's odometry to the prefix too. The bag's odometry runs at 1 Hz,
    ~91 ms after the cameras: the default wait (0.2 s) and age (1 s) cover it. The first frame has a
    single odometry message near it and no acceleration topic: it is dropped as no_acceleration."""
    assert VLAConfig.load(ego_checkpoint).ego_state_input
    ns = f"/er_{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "hybrid_vla_ros.tools.cli", "replay", "--model-path", str(ego_checkpoint),
           "--bag", str(embedded_bag), "--loops", "2", "--namespace", ns, "--output", str(tmp_path), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{_logs(tmp_path)}"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["frames_published"] == 6
    assert report["trajectories_out"] == 5
    drops = report["drops"]
    if "prefix.unsynced" in drops:
        # On a loaded machine the first frame's images (best-effort sensor QoS) can be incomplete at the
        # prefix: that frame is then lost as unsynced, and the next one, with two speeds around it, has its
        # acceleration. Either way exactly one frame is lost, and to a named cause.
        assert set(drops) == {"prefix.unsynced"} and report["frames_synchronized"] == 5, report
    else:
        assert drops == {"prefix.no_acceleration": 1}
    log = (tmp_path / "prefix_node.log").read_text()
    assert "ego state from /localization/kinematic_state, /localization/acceleration" in log
