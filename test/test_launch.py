"""launch/hybrid_vla.launch.py with the real tools, as a user deploys it beside Autoware.

The package is built with ``colcon build`` into an install space (conftest ``ros_install``, once per session);
every command runs with the environment of that install's ``setup.bash``. One ``ros2 launch hybrid_vla_ros
hybrid_vla.launch.py`` with docs/deployment.md's arguments (a ``cpu_affinity`` list included) is shared by the
tests of this module, in order: both nodes reach active (``ros2 lifecycle get``), frames of the embedded bag
restamped to now come out as Trajectories and CandidateTrajectories (also read with ``ros2 topic echo``),
``ros2 param set`` moves the split layer on both running nodes and refuses a bad value with the schema's
message, and SIGINT stops everything: no process left, no ring segment in /dev/shm. Separate launches and
``ros2 run`` check that parameter values the nodes cannot read are clear errors naming the parameter.

No stand-ins: what the old stand-in test checked (the launch description's arguments, remappings,
parameter overrides and autostart events) is what these real runs exercise. The prefix's default cores
for combinations of arguments and parameter files are checked by evaluating the launch file with the real
``launch`` / ``launch_ros`` (the parameter files launch_ros writes for each node, read back), without starting
the processes for each combination.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import ros_tools
import yaml

from hybrid_vla_ros.util.bags import read_bag

REPO = Path(__file__).resolve().parent.parent
NS = f"hvla_deploy_{uuid.uuid4().hex[:6]}"  # a ring lives in /dev/shm per user and namespace: one per run
_USABLE = sorted(os.sched_getaffinity(0))
CORES = _USABLE[-2:] if len(_USABLE) >= 4 else _USABLE[-1:]  # the suffix's cores (as Autoware leaves spare ones)
OUTPUT = "/planning/hybrid_vla/trajectory"
CANDIDATES = "/planning/hybrid_vla/candidate_trajectories"
ACTIVE_TIMEOUT = 300  # model load on a loaded 2-core machine, both lifecycle transitions included


def deployment_arguments(model: Path, namespace: str) -> list[str]:
    """docs/deployment.md's launch arguments (the embedded bag's cameras are image_raw/compressed)."""
    return [f"model_path:={model}", "split_layer:=2", f"cpu_affinity:={CORES}", "camera_transport:=compressed",
            "camera_topic_suffix:=image_raw", "input_kinematic_state:=/localization/kinematic_state",
            f"output_trajectory:={OUTPUT}", "publish_candidate_trajectories:=true",
            f"output_candidate_trajectories:={CANDIDATES}", f"namespace:={namespace}"]


@pytest.fixture(scope="module")
def deployment(ros_env, tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("launch") / "launch.log"
    launched = ros_tools.Launched(deployment_arguments(tiny_checkpoint, NS), ros_env, log)
    try:
        yield launched
    finally:
        if launched.alive():
            launched.stop()
        if launched.survivors():
            launched.kill()
        for name in ros_tools.ring_segments(f"/{NS}"):  # after a failure only: the last test asserts none
            Path("/dev/shm", name).unlink(missing_ok=True)


def _active(deployment, env) -> None:
    for node in ("prefix_node", "suffix_node"):
        state = ros_tools.wait_lifecycle_state(env, f"/{NS}/{node}", "active", ACTIVE_TIMEOUT, deployment.alive)
        assert state == "active", f"{node} is {state!r}\n{deployment.log()[-6000:]}"
    deployment.record_tree()


def test_both_nodes_reach_active(deployment, ros_env):
    _active(deployment, ros_env)
    print(f"\nboth nodes active {time.monotonic() - deployment.t_start:.1f} s after ros2 launch started")
    log = deployment.log()
    assert "Traceback" not in log
    # launch_ros wrote cpu_affinity as !!python/tuple; the suffix read it before torch and rclpy started
    assert f"(pinned early: {CORES})" in log, log
    pids = deployment.node_pids()
    suffix_pid = pids["suffix_node-2"]
    threads = os.listdir(f"/proc/{suffix_pid}/task")
    assert len(threads) > 1
    assert all(os.sched_getaffinity(int(t)) == set(CORES) for t in threads), "every suffix thread on the cores"
    prefix_pid = pids["prefix_node-1"]
    prefix_cores = set(_USABLE) - set(CORES)  # the launch file gives the prefix every core the suffix does not get
    assert all(os.sched_getaffinity(int(t)) == prefix_cores for t in os.listdir(f"/proc/{prefix_pid}/task")), \
        "every prefix thread off the suffix's cores"
    listed = lambda out: f"/{NS}/prefix_node" in out.stdout and f"/{NS}/suffix_node" in out.stdout  # noqa: E731
    out = ros_tools.ros2(ros_env, "node", "list")
    if not listed(out):  # a long-serving ros2 daemon can miss nodes that are up (see ros_tools.ros2)
        out = ros_tools.ros2(ros_env, "node", "list", "--no-daemon", "--spin-time", "2")
    assert listed(out), out.stdout + out.stderr


class Driver(ros_tools.SpunNode):
    """An rclpy node in the test process that plays the embedded bag's compressed cameras and odometry,
    restamped so that the newest frame is stamped now (the output guard's age check is on, as shipped),
    and records the Trajectories and CandidateTrajectories that come out."""

    def __init__(self, bag: Path):
        from autoware_internal_planning_msgs.msg import CandidateTrajectories
        from autoware_planning_msgs.msg import Trajectory
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        from hybrid_vla_ros.tools.replay import message_class
        from hybrid_vla_ros.util.bags import read_bag

        self.messages = [m for m in read_bag(bag)
                         if m.topic.endswith("/image_raw/compressed") or m.topic == "/localization/kinematic_state"]
        super().__init__("driver")
        self.trajectories, self.candidates, self.camera_stamps = [], [], set()
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.node.create_subscription(Trajectory, OUTPUT, lambda m: self.keep(self.trajectories, m), reliable)
        self.node.create_subscription(CandidateTrajectories, CANDIDATES, lambda m: self.keep(self.candidates, m),
                                      reliable)
        self.classes = {m.topic: message_class(m.msgtype) for m in self.messages}
        self.pubs = {t: self.node.create_publisher(c, t, 10) for t, c in self.classes.items()}

    def play_once(self) -> None:
        """Publish every camera and odometry message once, the newest camera frame stamped now."""
        from rclpy.serialization import deserialize_message

        last = max(m.t_ns for m in self.messages if m.topic.endswith("/compressed"))
        shift = time.time_ns() - last
        for m in self.messages:
            msg = deserialize_message(m.raw, self.classes[m.topic])
            stamp = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec + shift
            msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp, 10**9)
            self.pubs[m.topic].publish(msg)
            if m.topic.endswith("/compressed"):
                with self.lock:
                    self.camera_stamps.add(stamp)

    def play_until(self, predicate, timeout: float) -> bool:
        """Play the bag once a second until ``predicate()`` (under the lock) holds; False after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.play_once()
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                with self.lock:
                    if predicate():
                        return True
                time.sleep(0.05)
        return False


@pytest.fixture
def driver(embedded_bag):
    d = Driver(embedded_bag)
    yield d
    d.close()


def _stamp(header) -> int:
    return header.stamp.sec * 10**9 + header.stamp.nanosec


def test_played_frames_come_out_as_trajectories_and_candidates(deployment, ros_env, driver):
    from hybrid_vla_ros.model.config import NAV_COMMANDS
    from hybrid_vla_ros.ros.msg_conv import generator_uuid

    _active(deployment, ros_env)
    # what a user runs to look at the output: ros2 topic echo, in parallel with the frames
    echo = subprocess.Popen([ros2_exe(), "topic", "echo", "--once", "--field", "header.frame_id", OUTPUT,
                             "autoware_planning_msgs/msg/Trajectory"], env=ros_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def done():
            stamps = {_stamp(c.candidate_trajectories[0].header) for c in driver.candidates
                      if c.candidate_trajectories}
            return (echo.poll() is not None and any(_stamp(t.header) in stamps for t in driver.trajectories))
        assert driver.play_until(done, 180), deployment.log()[-6000:]
    finally:
        if echo.poll() is None:
            echo.kill()
        echoed = echo.communicate()[0]
    assert echo.returncode == 0 and echoed.splitlines()[0] == "map", echoed
    with driver.lock:
        trajectories, candidates = list(driver.trajectories), list(driver.candidates)
        camera_stamps = set(driver.camera_stamps)
    traj = next(t for t in trajectories if _stamp(t.header) in {_stamp(c.candidate_trajectories[0].header)
                                                                 for c in candidates if c.candidate_trajectories})
    assert _stamp(traj.header) in camera_stamps and traj.header.frame_id == "map" and len(traj.points) == 7
    msg = next(c for c in candidates if c.candidate_trajectories
               and _stamp(c.candidate_trajectories[0].header) == _stamp(traj.header))
    # 6 planner modes, less any the shipped output guard leaves out; the selected one is the Trajectory
    assert 1 <= len(msg.candidate_trajectories) <= len(NAV_COMMANDS)
    assert traj.points in [c.points for c in msg.candidate_trajectories]
    assert list(msg.generator_info[0].generator_id.uuid) == list(generator_uuid(f"/{NS}/suffix_node").bytes)
    out = ros_tools.ros2(ros_env, "topic", "info", CANDIDATES)
    print(f"\n$ ros2 topic info {CANDIDATES}\n{out.stdout}")
    assert "autoware_internal_planning_msgs/msg/CandidateTrajectories" in out.stdout and "Publisher count: 1" in \
        out.stdout, out.stdout + out.stderr


def ros2_exe() -> str:
    return ros_tools.executable("ros2")


def test_split_layer_set_live_with_ros2_param(deployment, ros_env, driver):
    _active(deployment, ros_env)
    for node in ("suffix_node", "prefix_node"):  # suffix first: it loads ahead of the prefix's move
        out = ros_tools.ros2(ros_env, "param", "set", f"/{NS}/{node}", "split_layer", "3")
        assert out.returncode == 0 and out.stdout.strip() == "Set parameter successful", out.stdout + out.stderr
    assert deployment.wait_log(r"\[prefix_node-1\].*re-split K 2 -> 3", 60), deployment.log()[-4000:]
    out = ros_tools.ros2(ros_env, "param", "get", f"/{NS}/prefix_node", "split_layer")
    assert out.stdout.strip() == "Integer value is: 3", out.stdout + out.stderr
    # a bad value is refused with the schema's words, the node keeps its value
    for node, value, reason in (("suffix_node", "-5", "split_layer: must be >= 0, got -5"),
                                ("prefix_node", "9", "split_layer: 9 out of range [0, 4] for this model"),
                                ("suffix_node", "fast", "split_layer: must match ^auto$, got 'fast'")):
        out = ros_tools.ros2(ros_env, "param", "set", f"/{NS}/{node}", "split_layer", value)
        assert (out.stdout + out.stderr).strip() == f"Setting parameter failed: {reason}", out.stdout + out.stderr
    out = ros_tools.ros2(ros_env, "param", "get", f"/{NS}/suffix_node", "split_layer")
    assert out.stdout.strip() == "Integer value is: 3", out.stdout + out.stderr
    # frames at the new K still come out; the suffix freed the block it no longer needs
    with driver.lock:
        driver.trajectories.clear()
    assert driver.play_until(lambda: driver.trajectories, 120), deployment.log()[-4000:]
    assert deployment.wait_log(r"\[suffix_node-2\].*re-split: now holding blocks \[3, 4\) for frame seq \d+ at K=3",
                               30), deployment.log()[-4000:]


def test_autostart_activates_once_then_leaves_transitions_to_the_manager(deployment, ros_env):
    """Issue 19.3: the launch activated each node once, after its first configure; a later reconfigure (as a
    lifecycle manager or `ros2 lifecycle set` does it, e.g. at another split layer) stays inactive until it is
    activated: the launch does not activate it behind the manager's back (before: it did, after every configure)."""
    _active(deployment, ros_env)
    node = f"/{NS}/suffix_node"
    for transition, state in (("deactivate", "inactive"), ("cleanup", "unconfigured"), ("configure", "inactive")):
        out = ros_tools.ros2(ros_env, "lifecycle", "set", node, transition)
        assert out.returncode == 0 and "Transitioning successful" in out.stdout, out.stdout + out.stderr
        assert ros_tools.wait_lifecycle_state(ros_env, node, state, 60) == state
    time.sleep(5.0)  # the old handler activated within a second of the configure
    assert ros_tools.lifecycle_state(ros_env, node) == "inactive", deployment.log()[-3000:]
    out = ros_tools.ros2(ros_env, "lifecycle", "set", node, "activate")
    assert out.returncode == 0 and "Transitioning successful" in out.stdout, out.stdout + out.stderr
    assert ros_tools.wait_lifecycle_state(ros_env, node, "active", 60) == "active"


def test_a_second_launch_into_a_running_namespace_is_refused_in_one_line(deployment, ros_env, tiny_checkpoint):
    """Issue 19.4: `ros2 launch` into the namespace of a running pair exits at once with one line naming what runs
    (the ring's owner and consumer, and the graph), and starts no node (before: a second, unconfigured prefix stayed
    on the graph)."""
    _active(deployment, ros_env)
    pids = deployment.node_pids()
    out = subprocess.run([ros2_exe(), "launch", "hybrid_vla_ros", "hybrid_vla.launch.py",
                          f"model_path:={tiny_checkpoint}", "split_layer:=2", f"namespace:={NS}"],
                         env=ros_env, capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    errors = [line for line in text.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "already running in ROS domain" in errors[0], text
    assert f"/{NS}/prefix_node (pid {pids['prefix_node-1']}, owner of the ring" in errors[0], text
    assert f"/{NS}/suffix_node (pid " in errors[0], text
    assert "process started" not in text, text
    deadline = time.monotonic() + 60
    while True:  # a 2 s discovery may list part of the graph: ask until both nodes are in the answer
        nodes = ros_tools.ros2(ros_env, "node", "list", "--no-daemon", "--spin-time", "2").stdout.split()
        if {f"/{NS}/prefix_node", f"/{NS}/suffix_node"} <= set(nodes) or time.monotonic() > deadline:
            break
    assert nodes.count(f"/{NS}/prefix_node") == 1 and nodes.count(f"/{NS}/suffix_node") == 1, nodes
    print(f"\nrefused: {errors[0]}")


def test_sigint_stops_both_nodes_cleanly(deployment, ros_env):
    _active(deployment, ros_env)
    tree = deployment.record_tree()
    assert len(tree) >= 2, "launch's node processes"
    rc = deployment.stop()
    log = deployment.log()
    assert rc == 0, log[-4000:]
    assert not deployment.survivors(), f"orphaned: {[p.pid for p in deployment.survivors()]}"
    assert re.search(r"\[INFO\] \[prefix_node-1\]: process has finished cleanly", log), log[-4000:]
    assert re.search(r"\[INFO\] \[suffix_node-2\]: process has finished cleanly", log), log[-4000:]
    assert "cleaned up: ring removed" in log and "cleaned up: detached from the ring" in log
    assert "Failed to publish log message to rosout" not in log, "the clean-up logs while the context is valid"
    assert "Traceback" not in log
    assert ros_tools.ring_segments(f"/{NS}") == []


# ---------------------------------------------------------------------------- unreadable parameters
def _shipped(node: str) -> dict:
    return yaml.safe_load((REPO / "config" / f"{node}.param.yaml").read_text())


def _params_file(path: Path, node: str, **changes) -> Path:
    data = _shipped(node)
    data["/**"]["ros__parameters"].update(changes)
    path.write_text(yaml.safe_dump(data))
    return path


def test_unreadable_parameter_values_are_clear_errors_at_start(ros_env, tiny_checkpoint, tmp_path):
    """A value of the wrong type in the parameter files given to ros2 launch: each node exits with 2 and
    one line naming the parameter, no traceback. Also ros2 run with a list rcl cannot read (mixed types), for
    both nodes, and an empty list launch argument, which launch_ros cannot write."""
    ns = f"hvla_badparams_{uuid.uuid4().hex[:6]}"
    prefix_file = _params_file(tmp_path / "prefix.yaml", "prefix_node", ring_slots="four", split_layr=3)
    suffix_file = _params_file(tmp_path / "suffix.yaml", "suffix_node", wheelbase_m=3)
    launched = ros_tools.Launched([f"model_path:={tiny_checkpoint}", "split_layer:=2", f"namespace:={ns}",
                                   f"prefix_param_file:={prefix_file}", f"suffix_param_file:={suffix_file}"],
                                  ros_env, tmp_path / "launch.log")
    try:
        for name in ("prefix_node-1", "suffix_node-2"):
            assert launched.wait_log(rf"\[ERROR\] \[{name}\]: process has died \[pid \d+, exit code 2", 180), \
                launched.log()
    finally:
        launched.stop()
    log = launched.log()
    assert "[prefix_node-1] prefix_node: invalid parameters: ring_slots: must be of type int, got string 'four'" \
        in log, log
    assert ("[suffix_node-2] suffix_node: invalid parameters: wheelbase_m: must be of type double, got int 3 "
            "(write 3.0)") in log, log
    assert "ignored: split_layr (not parameters of prefix_node" in log, "a misspelt name is not silently lost"
    assert "Traceback" not in log and not launched.survivors()

    prefix_file = _params_file(tmp_path / "prefix_mixed.yaml", "prefix_node", camera_transports=["raw", 1])
    suffix_file = _params_file(tmp_path / "suffix_mixed.yaml", "suffix_node", navigation_command=["LEFT", 1])
    for node, path, needle in (
            ("prefix_node", prefix_file, "prefix_node: cannot read the parameters: camera_transports: a list must "
             "hold items of one type, got integer and string in ['raw', 1]"),
            ("suffix_node", suffix_file, "suffix_node: cannot read the parameters: navigation_command: a list must "
             "hold items of one type, got integer and string in ['LEFT', 1]")):
        out = ros_tools.ros2(ros_env, "run", "hybrid_vla_ros", node, "--ros-args", "-r", f"__ns:=/{ns}",
                             "--params-file", str(path), timeout=180)
        text = out.stdout + out.stderr
        assert out.returncode != 0 and needle in text and f"(parameter file {path}" in text, text
        assert "Traceback" not in text
    # the early cpu_affinity read of the suffix (before rclpy) names the parameter too
    suffix_file = _params_file(tmp_path / "suffix_cores.yaml", "suffix_node", cpu_affinity=["a"])
    out = ros_tools.ros2(ros_env, "run", "hybrid_vla_ros", "suffix_node", "--ros-args", "--params-file",
                         str(suffix_file), timeout=180)
    assert out.returncode != 0 and "suffix_node: cpu_affinity: " in out.stderr and "Traceback" not in out.stderr, \
        out.stderr
    # an empty list launch argument: refused by the launch file with the reason, before any node starts
    out = subprocess.run([ros2_exe(), "launch", "hybrid_vla_ros", "hybrid_vla.launch.py", "cpu_affinity:=[]",
                          f"namespace:={ns}"], env=ros_env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0 and "cpu_affinity:='[]': an empty list cannot override" in out.stdout + out.stderr, \
        out.stdout + out.stderr


def _prefix_cores_given(ros_env, monkeypatch, **given) -> list[int] | None:
    """The ``cpu_affinity`` the launch file hands the prefix node for launch arguments ``given``."""
    return _parameters_given(ros_env, monkeypatch, "prefix_node", ("cpu_affinity",), **given)["cpu_affinity"]


def _launch_actions(ros_env, monkeypatch, **given) -> tuple[list, object]:
    """The actions the real launch file's OpaqueFunction returns for launch arguments ``given`` (the others at their
    defaults), evaluated by the real launch / launch_ros against the colcon install space, and the LaunchContext."""
    from launch import LaunchContext
    from launch.actions import DeclareLaunchArgument, OpaqueFunction
    from launch.launch_description_sources import get_launch_description_from_python_launch_file

    monkeypatch.setenv("AMENT_PREFIX_PATH", ros_env["AMENT_PREFIX_PATH"])  # FindPackageShare: the install space
    description = get_launch_description_from_python_launch_file(str(REPO / "launch" / "hybrid_vla.launch.py"))
    context = LaunchContext()
    for entity in description.entities:
        if isinstance(entity, DeclareLaunchArgument):
            default = "".join(s.perform(context) for s in entity.default_value)
            context.launch_configurations[entity.name] = given.get(entity.name, default)
    setup = next(e for e in description.entities if isinstance(e, OpaqueFunction))
    return setup.execute(context), context


def _parameters_given(ros_env, monkeypatch, node: str, names, **given) -> dict:
    """The parameters ``names`` the launch file hands ``node`` for launch arguments ``given`` (None: not set): the
    real launch file evaluated by the real launch / launch_ros (its OpaqueFunction run in a LaunchContext, each
    node's parameter files written as launch_ros writes them), read back with the nodes' own loader."""
    from launch_ros.actions import LifecycleNode

    from hybrid_vla_ros.ros.params_file import parameter_from_files

    actions, context = _launch_actions(ros_env, monkeypatch, **given)
    nodes = [a for a in actions if isinstance(a, LifecycleNode)]
    action = next(n for n in nodes if n.node_executable == node)
    action._perform_substitutions(context)
    files = [arg for arg, is_file in action._Node__expanded_parameter_arguments if is_file]
    namespace = f"/{given.get('namespace', 'hybrid_vla')}"
    return {name: parameter_from_files(files, namespace, node, name) for name in names}


def test_launch_arguments_override_the_node_parameters_of_their_names(ros_env, monkeypatch, tmp_path):
    """A launch argument named as a parameter in a node's schema overrides it (typed by the schema: a string as
    given, anything else as YAML), cpu_affinity the suffix's only, use_sim_time (a ROS parameter) and
    navigation_command (the query heads read it in the prefix) both nodes'."""
    core = sorted(os.sched_getaffinity(0))[-1]
    given = dict(model_path=str(tmp_path), split_layer="3", device="cuda:1", dtype="bf16", cpu_affinity=f"[{core}]",
                 prefix_cpu_affinity="[0]", navigation_command="LEFT", publish_candidate_trajectories="true",
                 use_sim_time="true")
    names = ("model_path", "split_layer", "device", "dtype", "cpu_affinity", "navigation_command",
             "publish_candidate_trajectories", "use_sim_time")
    prefix = _parameters_given(ros_env, monkeypatch, "prefix_node", names, **given)
    suffix = _parameters_given(ros_env, monkeypatch, "suffix_node", names, **given)
    assert prefix == {"model_path": str(tmp_path), "split_layer": 3, "device": "cuda:1", "dtype": "bf16",
                      "cpu_affinity": [0], "navigation_command": "LEFT", "publish_candidate_trajectories": None,
                      "use_sim_time": True}, prefix
    assert suffix == {"model_path": str(tmp_path), "split_layer": 3, "device": None, "dtype": "bf16",
                      "cpu_affinity": [core], "navigation_command": "LEFT", "publish_candidate_trajectories": True,
                      "use_sim_time": True}, suffix
    assert _parameters_given(ros_env, monkeypatch, "suffix_node", ("split_layer",), split_layer="auto") == \
        {"split_layer": "auto"}
    # whole numbers for a double[] (YAML reads ints) reach both nodes as doubles, which they accept
    for node in ("prefix_node", "suffix_node"):
        origin = _parameters_given(ros_env, monkeypatch, node, ("model_frame_origin",),
                                   model_frame_origin="[1, 0, 2]")["model_frame_origin"]
        assert origin == [1.0, 0.0, 2.0] and all(type(v) is float for v in origin), (node, origin)


def test_rviz_true_starts_rviz2_with_the_installed_configuration_of_the_nodes_topics(ros_env, monkeypatch):
    """Issue 43: ``rviz:=true`` adds rviz2 with ``-d <share>/rviz/hybrid_vla.rviz``, a file colcon installed; its
    displays read the topics the launch file's defaults give (the suffix's markers and reasoning text, the
    trajectory, the front camera, the odometry), in the fixed frame map. rviz2 itself is not installed here: the
    action is checked, not run. ``rviz:=false`` (the default) adds none; a bad value is a clear error."""
    from launch_ros.actions import Node

    def actions(**given):
        found, context = _launch_actions(ros_env, monkeypatch, **given)
        return [a for a in found if type(a) is Node], context

    assert actions()[0] == []
    (rviz,), _ = actions(rviz="true")
    assert rviz.node_package == "rviz2" and rviz.node_executable == "rviz2"
    args = list(rviz._Node__arguments)  # as given (plain strings): launch_ros expands them only when it runs
    config = Path(args[args.index("-d") + 1])
    assert config.is_file() and config.name == "hybrid_vla.rviz" and "install" in config.parts
    manager = yaml.safe_load(config.read_text())["Visualization Manager"]
    topics = {d["Class"]: d["Topic"]["Value"] for d in manager["Displays"] if "Topic" in d}
    assert topics == {"rviz_default_plugins/MarkerArray": "/hybrid_vla/suffix_node/debug/trajectory_markers",
                      "rviz_default_plugins/Marker": "/hybrid_vla/suffix_node/debug/reasoning_text",
                      "rviz_plugins/Trajectory": "/planning/hybrid_vla/trajectory",
                      "rviz_default_plugins/Image": "/sensing/camera/camera0/image_rect_color",
                      "rviz_default_plugins/Odometry": "/localization/kinematic_state"}
    assert manager["Global Options"]["Fixed Frame"] == "map"
    with pytest.raises(ValueError, match="rviz must be true or false"):
        actions(rviz="maybe")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split between the nodes")
def test_prefix_cores_are_disjoint_from_the_suffix_cores(ros_env, monkeypatch, tmp_path):
    """prefix_cpu_affinity: empty = every usable core but the suffix's (from cpu_affinity, or else from the
    suffix's parameter file); an explicit value or the prefix file's own value wins; '[]' = not pinned."""
    usable = sorted(os.sched_getaffinity(0))
    suffix_core = usable[-1]

    def prefix_cores(**given):
        return _prefix_cores_given(ros_env, monkeypatch, **given)

    assert prefix_cores(cpu_affinity=f"[{suffix_core}]") == usable[:-1]
    suffix_file = tmp_path / "suffix.yaml"
    suffix_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"cpu_affinity": [suffix_core]}}}))
    assert prefix_cores(suffix_param_file=str(suffix_file)) == usable[:-1]
    assert prefix_cores(cpu_affinity=f"[{suffix_core}]", prefix_cpu_affinity="[0]") == [0]
    assert prefix_cores(cpu_affinity=f"[{suffix_core}]", prefix_cpu_affinity="[]") in ([], None)  # not pinned
    prefix_file = tmp_path / "prefix.yaml"
    prefix_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"cpu_affinity": [0]}}}))
    assert prefix_cores(cpu_affinity=f"[{suffix_core}]", prefix_param_file=str(prefix_file)) == [0]  # the file's
    unpinned = tmp_path / "suffix_unpinned.yaml"
    unpinned.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"cpu_affinity": []}}}))
    assert prefix_cores(suffix_param_file=str(unpinned)) in ([], None), \
        "an unpinned suffix leaves nothing to keep clear of"


# ------------------------------------------------------------------- respawn, plain cameras, namespaced output
NS2 = f"hvla_respawn_{uuid.uuid4().hex[:6]}"
PLAIN_TOPIC = "/sensing/camera/camera{}/" + f"plain_{NS2}"  # this module's own raw camera topics


@pytest.fixture(scope="module")
def respawning(ros_env, tiny_checkpoint, tmp_path_factory):
    """``ros2 launch`` with raw cameras, ``respawn:=true respawn_delay:=1.0`` and no output topic given (so they
    default to /planning/<namespace>/...); everything else (DDS, QoS, the output guard) as shipped."""
    tmp = tmp_path_factory.mktemp("respawn")
    launched = ros_tools.Launched(
        [f"model_path:={tiny_checkpoint}", "split_layer:=2", f"cpu_affinity:={CORES}", f"namespace:={NS2}",
         "camera_transport:=raw", f"camera_topic_suffix:=plain_{NS2}", f"input_kinematic_state:=/{NS2}/odom",
         "respawn:=true", "respawn_delay:=1.0"], ros_env, tmp / "launch.log")
    try:
        yield launched
    finally:
        if launched.alive():
            launched.stop()
        if launched.survivors():
            launched.kill()
        for name in ros_tools.ring_segments(f"/{NS2}"):
            Path("/dev/shm", name).unlink(missing_ok=True)


class Output(ros_tools.SpunNode):
    """Records the Trajectories on one topic (reliable), with their header stamps."""

    def __init__(self, topic: str):
        from autoware_planning_msgs.msg import Trajectory
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        super().__init__("output")
        self.stamps: list[int] = []
        self.node.create_subscription(Trajectory, topic, lambda m: self.keep(self.stamps, _stamp(m.header)),
                                      QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))


def _active2(launched, env) -> None:
    for node in ("prefix_node", "suffix_node"):
        state = ros_tools.wait_lifecycle_state(env, f"/{NS2}/{node}", "active", ACTIVE_TIMEOUT, launched.alive)
        assert state == "active", f"{node} is {state!r}\n{launched.log()[-6000:]}"


def _plain_publisher(ros_env, embedded_bag, frames: int, log: Path, profile: Path | None = None,
                     period_s: float = 1.0) -> subprocess.Popen:
    """test/plain_camera_publisher.py in a process of its own: Fast DDS's defaults, or the Fast DDS profile
    ``profile`` (FASTDDS_DEFAULT_PROFILES_FILE) as docs/deployment.md tells camera drivers to use."""
    env = {k: v for k, v in ros_env.items() if k != "FASTDDS_DEFAULT_PROFILES_FILE"}
    if profile is not None:
        env["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return ros_tools.spawn([sys.executable, str(REPO / "test" / "plain_camera_publisher.py"), "--bag",
                            str(embedded_bag), "--image-topic", PLAIN_TOPIC, "--odom-topic", f"/{NS2}/odom",
                            "--frames", str(frames), "--period", str(period_s)], env, log)


class NodeReports(ros_tools.SpunNode):
    """A node's /diagnostics reports (key/values, with the level as ``_level`` and message as ``_message``)."""

    def __init__(self, ns: str, node: str = "prefix_node"):
        from diagnostic_msgs.msg import DiagnosticArray

        super().__init__(f"{node}_reports")
        self.name, self.reports = f"/{ns}/{node}: pipeline", []
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on, 50)

    def _on(self, msg):
        for s in msg.status:
            if s.name == self.name:
                values = {kv.key: kv.value for kv in s.values}
                values.update(_level=s.level[0] if isinstance(s.level, bytes) else int(s.level), _message=s.message)
                self.keep(self.reports, values)

    def drops(self) -> dict[str, int]:
        """The newest report's drop counts by cause (``drop_<cause>`` keys), {} before the first report."""
        with self.lock:
            last = self.reports[-1] if self.reports else {}
        return {k[5:]: int(v) for k, v in last.items() if k.startswith("drop_")}

    def counter(self, key: str) -> int:
        """The newest report's integer ``key`` (e.g. ``frames_in``), 0 before the first report."""
        with self.lock:
            last = self.reports[-1] if self.reports else {}
        return int(last.get(key, 0))


def _sent_stamps(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("frame ")]


def test_namespace_scopes_the_default_output_topics(respawning, ros_env):
    """Issue 19.7: with no output topic given, the trajectory goes to /planning/<namespace>/trajectory (before: the
    fixed /planning/hybrid_vla/trajectory, where two instances collided)."""
    _active2(respawning, ros_env)
    out = ros_tools.ros2(ros_env, "topic", "info", f"/planning/{NS2}/trajectory")
    assert "autoware_planning_msgs/msg/Trajectory" in out.stdout and "Publisher count: 1" in out.stdout, \
        out.stdout + out.stderr


def test_a_plain_publisher_of_raw_1600x900_cameras_gets_its_frames_through(respawning, ros_env, embedded_bag,
                                                                           tmp_path):
    """Issue 19.6: six raw rgb8 1600 x 900 cameras from a plain rclpy publisher (reliable, keep last 10) on Fast
    DDS's defaults, into the launch's defaults: the prefix matches the publishers' reliability (camera_reliability
    auto), so DDS repairs the fragments it loses and every frame reaches the prefix and is synchronized (with the
    sensor-data subscription alone, before, none of 22 frames did). Fast DDS's default transport repairs them late
    (its 512 KiB shared-memory segments; measured 1-3 s for 26 MB frames, docs/deployment.md), so the prefix names
    the delay in /diagnostics; the frames that are then too old are dropped by the output guard, counted."""
    _active2(respawning, ros_env)
    reports = NodeReports(NS2)
    frames = 8
    try:
        assert reports.wait(lambda: reports.reports, 30)
        with reports.lock:
            before = int(reports.reports[-1]["frames_synchronized"])
        log = tmp_path / "publisher.log"
        pub = _plain_publisher(ros_env, embedded_bag, frames, log)
        assert pub.wait(240) == 0, log.read_text()
        assert len(_sent_stamps(log)) == frames
        assert reports.wait(lambda: int(reports.reports[-1]["frames_synchronized"]) - before >= frames, 60), \
            (reports.reports[-1:], respawning.log()[-6000:])
        with reports.lock:
            delays = [float(r["camera_delay_p50_ms"]) for r in reports.reports if r.get("camera_delay_p50_ms")]
            late = [r["_message"] for r in reports.reports if "arrive" in r["_message"]]
            # a report whose median delay is over the prefix's LATE_ARRIVAL_S names it, unless an ERROR outranks
            # the WARN in its one message (a camera named silent while its late images are on the way)
            unnamed = [(r["camera_delay_p50_ms"], r["_level"], r["_message"]) for r in reports.reports
                       if float(r.get("camera_delay_p50_ms") or 0) > 500 and "arrive" not in r["_message"]
                       and r["_level"] != 2]
    finally:
        reports.close()
    assert re.search(r"camera 0 \(/sensing/camera/camera0/plain_\w+\): subscribed reliable to match its 1 "
                     r"publisher\(s\) \(reliable\)", respawning.log()), respawning.log()[-4000:]
    print(f"\nplain raw publisher, Fast DDS defaults: {frames} of {frames} frames synchronized, arrival delay p50 "
          f"up to {max(delays):.0f} ms" + (f"; prefix WARN: {late[-1]}" if late else ""))
    assert not unnamed, unnamed
    if max(delays) > 1000 * 0.5:  # late frames are named: logged once as a WARN when it starts
        assert "camera images arrive late" in respawning.log(), delays


def test_a_plain_publisher_on_the_large_data_profile_gets_every_frame_answered_in_time(respawning, ros_env,
                                                                                       embedded_bag, tmp_path):
    """Issue 19.6, the remedy docs/deployment.md gives: the same plain publisher with the package's Fast DDS profile
    (config/fastdds_shm_large.xml: 32 MiB shared-memory segments; the setting that matters is the publisher's) gets
    its frames answered with a trajectory within the shipped output guard's 1 s.

    What is deterministic (issue 37): every frame from the first one answered on is answered, and at most the
    first frame is lost. That one is the publisher's first large sample: Fast DDS can deliver some of its six images
    over a second late (traced on CI: cameras 4 and 5 silent, then ``guard_too_old``, "stamp is 1.104 s old";
    docs/performance.md). A frame lost so is counted by a cause on one of the nodes, never lost silently, unless
    none of its six images reached the prefix at all (seen once on CI: the prefix's ``frames_in``, the camera messages
    it took, then counts exactly the answered frames' images); a node cannot count what it never received."""
    _active2(respawning, ros_env)
    output = Output(f"/planning/{NS2}/trajectory")
    reports = {role: NodeReports(NS2, f"{role}_node") for role in ("prefix", "suffix")}
    frames = 8
    cameras = len({m.topic for m in read_bag(embedded_bag) if m.topic.endswith("/image_raw/compressed")})
    try:
        assert all(r.wait(lambda r=r: r.reports, 30) for r in reports.values())
        before = {role: r.drops() for role, r in reports.items()}
        images_before = reports["prefix"].counter("frames_in")
        log = tmp_path / "publisher.log"
        pub = _plain_publisher(ros_env, embedded_bag, frames, log, profile=REPO / "config" / "fastdds_shm_large.xml")
        assert pub.wait(240) == 0, log.read_text()
        sent = _sent_stamps(log)
        assert len(sent) == frames
        assert output.wait(lambda: set(sent[1:]) <= set(output.stamps), 60), \
            (f"answered {len(set(sent) & set(output.stamps))} of {frames}\n" + respawning.log()[-6000:])
        lost = [s for s in sent if s not in set(output.stamps)]
        assert lost in ([], sent[:1]), lost

        def counted() -> int:  # frames dropped with a cause since the publisher started, on either node
            return sum(n - before[role].get(cause, 0) for role, r in reports.items() for cause, n in r.drops().items())
        def never_received() -> bool:  # the prefix took exactly the answered frames' images: none of the lost one
            return reports["prefix"].counter("frames_in") - images_before == cameras * (frames - len(lost))
        if lost:
            assert reports["prefix"].wait(lambda: counted() >= len(lost) or never_received(), 30), \
                ({role: r.drops() for role, r in reports.items()}, before,
                 reports["prefix"].counter("frames_in") - images_before)
    finally:
        output.close()
        for r in reports.values():
            r.close()
    print(f"\nplain raw publisher on the large-data profile: {frames - len(lost)} of {frames} frames answered"
          + (f" (the first lost, counted: {[r.drops() for r in reports.values()]})" if lost else ""))


def test_respawn_restarts_a_killed_node_and_the_pair_works_again(respawning, ros_env, embedded_bag, tmp_path):
    """Issue 19.4: with respawn:=true a SIGKILLed node process is started again after respawn_delay, autostart
    configures and activates the new process, the survivor (which kept running) pairs with it, and frames come out
    again; the same for the other node. The time from the kill to the first trajectory is printed."""
    _active2(respawning, ros_env)
    output = Output(f"/planning/{NS2}/trajectory")
    figures = {}
    try:
        for role, label in (("suffix", "suffix_node-2"), ("prefix", "prefix_node-1")):
            old = respawning.node_pids()[label]
            t_kill = time.monotonic()
            os.kill(old, signal.SIGKILL)
            assert respawning.wait_log(rf"\[{label}\]: process has died \[pid {old}, exit code -9", 30), \
                respawning.log()[-4000:]
            assert respawning.wait_log(rf"\[{label}\]: process started with pid \[(?!{old}\])\d+\]", 60), \
                respawning.log()[-4000:]
            _active2(respawning, ros_env)
            assert respawning.node_pids()[label] != old
            with output.lock:
                seen = len(output.stamps)
            pub = _plain_publisher(ros_env, embedded_bag, 3, tmp_path / f"publisher_{role}.log",
                                   profile=REPO / "config" / "fastdds_shm_large.xml")
            assert output.wait(lambda: len(output.stamps) > seen, 240), respawning.log()[-6000:]
            figures[f"{role} killed: first trajectory after"] = time.monotonic() - t_kill
            pub.wait(240)
            assert respawning.alive(), "ros2 launch kept running"
    finally:
        output.close()
    print("\n" + "\n".join(f"{k}: {v:.1f} s (respawn_delay 1.0 s, model load and autostart included)"
                           for k, v in figures.items()))
