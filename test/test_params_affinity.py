"""Parameter validation, early CPU pinning from ROS arguments, the odometry buffer."""
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from hybrid_vla_ros.ros.params import ParameterError, validate
from hybrid_vla_ros.ros.params_file import (
    ParamsFileError,
    cpu_affinity_from_ros_args,
    parameter_from_files,
    unreadable_parameters,
)
from hybrid_vla_ros.vehicle.odometry import OdometryBuffer


def test_prefix_params_expand_and_validate(tiny_checkpoint):
    p = validate("prefix_node", {"model_path": str(tiny_checkpoint), "split_layer": 2,
                                 "camera_transports": ["compressed"]}, n_cameras=6, num_layers=4)
    assert p.camera_topics == tuple(f"~/input/image{i}" for i in range(6))  # lists are tuples in the settings
    assert p.camera_transports == ("compressed",) * 6
    assert p.ring_slots == 4 and p.sync_tolerance_ms == 50.0  # schema defaults fill what is not given


@pytest.mark.parametrize("field,value,needle", [
    ("split_layer", 5, "split_layer: 5 out of range [0, 4]"),
    ("split_layer", -1, "split_layer"),
    ("camera_topics", ["/a", "/b"], "camera_topics: 2 topics given, the model takes 6"),
    ("camera_transports", ["jpeg"], "camera_transports"),
    ("sync_tolerance_ms", 0.0, "sync_tolerance_ms"),
    ("device", "tpu", "device"),
    ("dtype", "int8", "dtype"),
    ("ring_name", "../etc/passwd", "ring_name"),
    ("ring_slots", 2, "ring_slots"),
    ("model_path", "/nonexistent/model", "model_path"),
])
def test_prefix_params_reject(tiny_checkpoint, field, value, needle):
    values = {"model_path": str(tiny_checkpoint), "split_layer": 2, field: value}
    with pytest.raises(ParameterError) as e:
        validate("prefix_node", values, n_cameras=6, num_layers=4)
    assert needle in str(e.value)


def test_suffix_params_reject_every_problem_at_once(tiny_checkpoint):
    values = {"model_path": str(tiny_checkpoint), "split_layer": 9, "cpu_affinity": [4096], "wheelbase_m": 0.0,
              "output_frame": ""}
    with pytest.raises(ParameterError) as e:
        validate("suffix_node", values, num_layers=4)
    for needle in ("split_layer", "cpu_affinity", "wheelbase_m", "output_frame"):
        assert needle in str(e.value)


def test_affinity_from_command_line_and_params_file(tmp_path):
    def early(*args):
        return cpu_affinity_from_ros_args(["prog", "--ros-args", *args], "suffix_node")

    assert cpu_affinity_from_ros_args(["prog"], "suffix_node") is None
    assert early("-p", "cpu_affinity:=[1, 3]") == [1, 3]
    assert early("-p", "suffix_node:cpu_affinity:=2") == [2]
    assert early("-p", "prefix_node:cpu_affinity:=2") is None
    assert early("-p", "cpu_affinity:=[]") == []
    f = tmp_path / "p.yaml"
    f.write_text(textwrap.dedent("""
        /ns/prefix_node:
          ros__parameters: {cpu_affinity: [0]}
        /ns/suffix_node:
          ros__parameters: {cpu_affinity: [1], threads: 1}
    """))
    assert early("-r", "__ns:=/ns", "--params-file", str(f)) == [1]
    # the key names the node in /ns: a suffix_node in the root namespace is not it (rcl's rule)
    assert early("--params-file", str(f)) is None
    # a later -p wins over an earlier params file, as in rcl
    assert early("-r", "__ns:=/ns", "--params-file", str(f), "-p", "cpu_affinity:=[0]") == [0]
    with pytest.raises(ParamsFileError, match="cpu_affinity"):
        early("-p", "cpu_affinity:=[a]")
    bad = tmp_path / "bad.yaml"
    bad.write_text("/**:\n  ros__parameters: {cpu_affinity: [1\n")
    with pytest.raises(ParamsFileError, match="bad.yaml"):
        early("--params-file", str(bad))


def test_params_file_written_by_real_launch_ros_is_read(tmp_path, ros_tools_available):
    """launch_ros writes a node's dict parameters with yaml.dump, lists as !!python/tuple (the crash of the
    README's own `ros2 launch ... cpu_affinity:='[6, 7]'`): the early read takes them as lists."""
    import launch_ros.actions as launch_ros
    from launch import LaunchContext

    node = launch_ros.Node(package="hybrid_vla_ros", executable="suffix_node", name="suffix_node",
                           namespace="hybrid_vla", parameters=[{"cpu_affinity": [6, 7], "split_layer": 2}])
    node._perform_substitutions(LaunchContext())  # what launch does before it starts the process
    files = [arg for arg, is_file in node._Node__expanded_parameter_arguments if is_file]
    assert files and "!!python/tuple" in Path(files[0]).read_text()  # the real tool's output, as it is
    argv = ["suffix_node", "--ros-args", "-r", "__node:=suffix_node", "-r", "__ns:=/hybrid_vla",
            "--params-file", files[0]]
    assert cpu_affinity_from_ros_args(argv, "suffix_node") == [6, 7]
    assert parameter_from_files(files, "/hybrid_vla", "suffix_node", "split_layer") == 2


def test_empty_list_does_not_override_like_rcl(tmp_path):
    """rcl reads an empty YAML list as 'not set', so it never replaces an earlier value (measured with rclpy:
    a file with [1] then one with [] gives [1]); the early read agrees, and [] alone is the empty list."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("/**:\n  ros__parameters: {cpu_affinity: [1]}\n")
    second.write_text("/**:\n  ros__parameters: {cpu_affinity: []}\n")
    argv = ["prog", "--ros-args", "--params-file", str(first), "--params-file", str(second)]
    assert cpu_affinity_from_ros_args(argv, "suffix_node") == [1]
    assert cpu_affinity_from_ros_args(argv + ["-p", "cpu_affinity:=[]"], "suffix_node") == [1]
    assert cpu_affinity_from_ros_args(["prog", "--ros-args", "--params-file", str(second)], "suffix_node") == []


def test_unreadable_parameters_are_named(tmp_path):
    """What rcl cannot parse (its own error names the file and a line only) is found and named: lists that
    mix types, in any node's section, nested names dotted, and in -p; a file that is not YAML."""
    f = tmp_path / "p.yaml"
    f.write_text(textwrap.dedent("""
        /ns/prefix_node:
          ros__parameters:
            camera_transports: [raw, 1]
            ring_slots: 4
        /**:
          ros__parameters:
            guard: {max_speed_mps: [1, 2.0]}
            cpu_affinity: !!python/tuple [0, 1]
    """))
    problems = unreadable_parameters(["prog", "--ros-args", "--params-file", str(f), "-p", "flags:=[true, 1]",
                                      "-p", "fine:=[1, 2]"])
    assert problems == [
        f"camera_transports: a list must hold items of one type, got integer and string in ['raw', 1] "
        f"(parameter file {f}, node key /ns/prefix_node)",
        f"guard.max_speed_mps: a list must hold items of one type, got double and integer in [1, 2.0] (write every "
        f"item as a double, e.g. 2.0) (parameter file {f}, node key /**)",
        "flags: a list must hold items of one type, got bool and integer in [True, 1] (-p flags:=[true, 1])",
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("/**:\n  ros__parameters: {ring_slots: [1\n")
    assert [p.split(" is not valid YAML")[0] for p in unreadable_parameters(["x", "--ros-args", "--params-file",
                                                                              str(bad)])] == [f"parameter file {bad}"]
    assert unreadable_parameters(["x", "--ros-args", "-p", "ring_slots:=4"]) == []


def _env_without_thread_counts() -> dict[str, str]:
    """This process's environment for a child, without the thread-count variables the start-up sets."""
    from hybrid_vla_ros.util.cores import THREAD_COUNT_VARS

    env = {k: v for k, v in os.environ.items() if k not in THREAD_COUNT_VARS}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    return env


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell pinned from unpinned")
def test_pinning_before_torch_covers_every_thread():
    """A process started the nodes' way (pin_then_import) has every thread, torch's pool included, on the
    core, and torch sized its pool to it."""
    core = max(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os
        from hybrid_vla_ros.ros.params_file import cpu_affinity_from_ros_args
        from hybrid_vla_ros.util.cores import pin_then_import, thread_affinities
        argv = ["x", "--ros-args", "-p", "cpu_affinity:=[{core}]"]
        cores, torch = pin_then_import(lambda: cpu_affinity_from_ros_args(argv, "suffix_node"), "torch")
        assert cores == [{core}] and os.environ["OMP_NUM_THREADS"] == "1", os.environ.get("OMP_NUM_THREADS")
        assert torch.get_num_threads() == 1, torch.get_num_threads()  # sized to the pinned core at import
        torch.set_num_threads(2)
        torch.ones(256, 256) @ torch.ones(256, 256)  # start the intra-op pool
        aff = thread_affinities()
        assert len(aff) > 1, aff
        assert all(s == {{{core}}} for s in aff.values()), aff
        print(len(aff))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=_env_without_thread_counts())
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 1


#: Run in a child before a node's start-up: records the first pin (os.sched_setaffinity) and which thread-pool
#: modules were loaded then, and at the first import of one of them (before it loads) prints what it saw as
#: JSON and ends the process: the order is all the test needs, so nothing heavy is loaded or started.
_TRIPWIRE = """
import importlib.abc, json, os, sys
from hybrid_vla_ros.util.cores import POOL_MODULES, THREAD_COUNT_VARS
seen = {"pinned_to": None, "loaded_at_pin": None}
real_setaffinity = os.sched_setaffinity
def spy(pid, mask):
    if seen["pinned_to"] is None:
        seen["pinned_to"] = sorted(mask)
        seen["loaded_at_pin"] = sorted(m for m in POOL_MODULES if m in sys.modules)
    return real_setaffinity(pid, mask)
os.sched_setaffinity = spy
class Tripwire(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in POOL_MODULES:
            seen.update(first_pool_import=name, env={v: os.environ.get(v) for v in THREAD_COUNT_VARS})
            print(json.dumps(seen), flush=True)
            os._exit(0)
        return None
sys.meta_path.insert(0, Tripwire())
"""


def _setup_entry_points() -> dict[str, str]:
    """The nodes' console scripts in setup.py (what ``ros2 run`` / ``ros2 launch`` start): executable ->
    ``module:function``."""
    import re

    text = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    return dict(re.findall(r'"(prefix_node|suffix_node) = ([\w.]+:\w+)"', text))


def _start_up(how: str, target: str, core: int) -> dict:
    """Start a node the way ``how`` says (``script``: the console script's ``module:function``; ``-m``: ``python -m
    module``, as ``hybrid-vla replay`` does; ``import``: a bare import of ``target``) under the tripwire with
    ``cpu_affinity:=[core]``; what the tripwire saw."""
    argv = ["node", "--ros-args", "-p", f"cpu_affinity:=[{core}]"]
    if how == "script":
        module, func = target.split(":")
        start = f"import sys\nsys.argv = {argv!r}\nfrom {module} import {func}\nsys.exit({func}())\n"
    elif how == "-m":
        start = (f"import runpy, sys\nsys.argv = {argv!r}\n"
                 f"runpy.run_module({target!r}, run_name='__main__', alter_sys=True)\n")
    else:
        start = f"import {target}\n"
    out = subprocess.run([sys.executable, "-c", _TRIPWIRE + start], capture_output=True, text=True, timeout=120,
                         env=_env_without_thread_counts())
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines, (f"no thread-pool module was imported ({out.returncode}): "
                                           f"{out.stderr[-2000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("node,how", [("prefix_node", "script"), ("suffix_node", "script"),
                                      ("prefix_node", "-m"), ("suffix_node", "-m")])
def test_each_node_is_pinned_before_torch_opencv_numpy_or_rclpy_is_imported(node, how):
    """The nodes' entry points (setup.py's console scripts, and ``python -m`` of the node modules, which
    ``hybrid-vla replay`` runs) pin the process and set the thread-count variables before the first import of
    torch, cv2, numpy or rclpy: their pools and the DDS threads start on the node's cores, sized to them."""
    entry = _setup_entry_points()
    assert set(entry) == {"prefix_node", "suffix_node"}, entry
    core = max(os.sched_getaffinity(0))
    seen = _start_up(how, entry[node] if how == "script" else f"hybrid_vla_ros.ros.{node}", core)
    assert seen["pinned_to"] == [core], f"{node} ({how}) imported {seen['first_pool_import']} before pinning"
    assert seen["loaded_at_pin"] == [], seen
    assert all(v == "1" for v in seen["env"].values()), seen["env"]  # one thread per pinned core


def test_the_tripwire_catches_an_import_before_the_pin():
    """The check above can fail: importing the prefix's node module (OpenCV and torch at its top) trips the wire
    before anything is pinned."""
    seen = _start_up("import", "hybrid_vla_ros.ros.prefix_node", max(os.sched_getaffinity(0)))
    assert seen["pinned_to"] is None and seen["first_pool_import"].partition(".")[0] in ("cv2", "rclpy", "torch",
                                                                                         "numpy")


def _ego(t_s, x, yaw=0.0, speed=0.0):
    from hybrid_vla_ros.vehicle.trajectory import EgoState

    return EgoState(x=x, y=0.0, z=0.0, yaw=yaw, speed=speed, stamp_ns=int(t_s * 1e9))


def test_odometry_pose_at_interpolates_propagates_and_rejects_stale():
    buf = OdometryBuffer()
    with pytest.raises(LookupError, match="no_odometry"):
        buf.pose_at(0, 10)
    buf.add(_ego(2.0, 20.0, yaw=3.1, speed=2.0))
    buf.add(_ego(1.0, 10.0, yaw=-3.1, speed=1.0))  # out of order on purpose: the buffer sorts by stamp
    ego, how = buf.pose_at(int(1.25e9), int(1e9))
    assert how == "interpolated"
    assert ego.x == pytest.approx(12.5) and ego.speed == pytest.approx(1.25)
    # shortest arc across +-pi: from -3.1 rad backwards towards 3.1 rad, never through 0
    assert ego.yaw == pytest.approx(-3.1 - 0.25 * (2 * math.pi - 6.2), abs=1e-9)
    ego, how = buf.pose_at(int(2.5e9), int(1e9))  # after the newest: constant-velocity propagation
    assert how == "propagated"
    assert ego.x == pytest.approx(20.0 + 2.0 * 0.5 * math.cos(3.1))
    with pytest.raises(LookupError, match="stale_odometry"):
        buf.pose_at(int(5e9), int(1e9))


def test_odometry_clock_jump_back_clears_the_buffer():
    buf = OdometryBuffer(jump_back_ns=int(1e9))
    buf.add(_ego(100.0, 5.0))
    buf.add(_ego(101.0, 6.0))
    buf.add(_ego(10.0, 0.0))  # clock restarted
    assert buf.time_jumps == 1
    ego, how = buf.pose_at(int(10.0e9), int(1e9))
    assert ego.x == 0.0
    buf.add(_ego(10.5, 0.5))  # a small step back is a late message, kept in order
    buf.add(_ego(10.2, 0.2))
    assert buf.time_jumps == 1 and buf.pose_at(int(10.2e9), int(1e9))[0].x == 0.2


def test_odometry_wait_for_newer_state():
    buf = OdometryBuffer()
    buf.add(_ego(1.0, 0.0))
    assert not buf.wait_for(int(2e9), 0.01)
    threading.Timer(0.05, lambda: buf.add(_ego(2.1, 1.0))).start()
    assert buf.wait_for(int(2e9), 5.0)


@pytest.mark.parametrize("node", ["prefix_node", "suffix_node"])
def test_shipped_parameter_files_are_valid(tiny_checkpoint, node):
    from pathlib import Path

    import yaml

    from hybrid_vla_ros.ros.params import parameter_specs

    path = Path(__file__).resolve().parent.parent / "config" / f"{node}.param.yaml"
    values = yaml.safe_load(path.read_text())["/**"]["ros__parameters"]
    values["model_path"] = str(tiny_checkpoint)
    if node == "prefix_node":
        validate(node, values, n_cameras=6, num_layers=4)
    else:
        values["cpu_affinity"] = [c for c in values["cpu_affinity"] if c in os.sched_getaffinity(0)]
        validate(node, values, num_layers=4)
    assert set(values) == set(parameter_specs(node)), "the file names every parameter, and only those"
