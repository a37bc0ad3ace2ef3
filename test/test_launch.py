"""launch/hybrid_vla.launch.py, checked without `launch` / `launch_ros` (not installable here).

The launch file only builds a description: its imports are replaced by recording stand-ins, then
its arguments, the nodes' parameters and remappings, and the lifecycle autostart events are
checked. On a ROS 2 machine, test/test_launch_testing.py starts it for real.
"""
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import yaml

from hybrid_vla_ros.ros.params_file import cpu_affinity_from_ros_args

LAUNCH_FILE = Path(__file__).resolve().parent.parent / "launch" / "hybrid_vla.launch.py"
SHARE = "/opt/ws/install/hybrid_vla_ros/share/hybrid_vla_ros"


class Recorded:
    """Stand-in for a launch entity: keeps its positional and keyword arguments."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


class FakeContext:
    def __init__(self, values):
        self.values = values


class LaunchConfiguration(Recorded):
    def perform(self, context):
        return context.values[self.args[0]]


class FindPackageShare(Recorded):
    def perform(self, context):
        return SHARE


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def launch_file(monkeypatch):
    classes = {n: type(n, (Recorded,), {}) for n in (
        "LaunchDescription", "DeclareLaunchArgument", "EmitEvent", "OpaqueFunction", "RegisterEventHandler",
        "LifecycleNode", "OnStateTransition", "ChangeState")}
    fakes = {
        "launch": _module("launch", LaunchDescription=classes["LaunchDescription"]),
        "launch.actions": _module("launch.actions", **{n: classes[n] for n in (
            "DeclareLaunchArgument", "EmitEvent", "OpaqueFunction", "RegisterEventHandler")}),
        "launch.events": _module("launch.events", matches_action=lambda action: ("matches", action)),
        "launch.substitutions": _module("launch.substitutions", LaunchConfiguration=LaunchConfiguration),
        "launch_ros": _module("launch_ros"),
        "launch_ros.actions": _module("launch_ros.actions", LifecycleNode=classes["LifecycleNode"]),
        "launch_ros.event_handlers": _module("launch_ros.event_handlers", OnStateTransition=classes["OnStateTransition"]),
        "launch_ros.events": _module("launch_ros.events"),
        "launch_ros.events.lifecycle": _module("launch_ros.events.lifecycle", ChangeState=classes["ChangeState"]),
        "launch_ros.substitutions": _module("launch_ros.substitutions", FindPackageShare=FindPackageShare),
    }
    for name, mod in fakes.items():
        monkeypatch.setitem(sys.modules, name, mod)
    spec = importlib.util.spec_from_file_location("hybrid_vla_launch", LAUNCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, classes


def _setup(module, classes, **given):
    """Run the OpaqueFunction with the declared defaults overridden by ``given``."""
    description = module.generate_launch_description()
    entities = description.args[0]
    declared = {e.args[0]: e.kwargs["default_value"] for e in entities if isinstance(e, classes["DeclareLaunchArgument"])}
    unknown = set(given) - set(declared)
    assert not unknown, f"not launch arguments: {unknown}"
    opaque = [e for e in entities if isinstance(e, classes["OpaqueFunction"])]
    assert len(opaque) == 1
    actions = opaque[0].kwargs["function"](FakeContext({**declared, **given}))
    nodes = {a.kwargs["name"]: a for a in actions if isinstance(a, classes["LifecycleNode"])}
    return declared, actions, nodes


def test_arguments_cover_deployment_needs(launch_file):
    module, classes = launch_file
    declared, _, _ = _setup(module, classes)
    for name in ("model_path", "split_layer", "cpu_affinity", "camera_transport", "camera_topic_suffix",
                 "input_kinematic_state", "input_acceleration", "input_navigation_command", "navigation_command",
                 "output_trajectory", "namespace", "autostart"):
        assert name in declared
    for e in module.generate_launch_description().args[0]:
        if isinstance(e, classes["DeclareLaunchArgument"]):
            assert e.kwargs["description"], f"{e.args[0]} has no description"


def test_nodes_remaps_and_parameter_overrides(launch_file):
    module, classes = launch_file
    _, actions, nodes = _setup(module, classes, model_path="/models/orion", split_layer="16",
                               cpu_affinity="[6, 7]", camera_transport="compressed",
                               output_trajectory="/planning/scenario_planning/trajectory",
                               input_navigation_command="/mission/command", navigation_command="LEFT")
    prefix, suffix = nodes["prefix_node"].kwargs, nodes["suffix_node"].kwargs
    assert prefix["executable"] == "prefix_node" and suffix["executable"] == "suffix_node"
    assert prefix["namespace"] == suffix["namespace"] == "hybrid_vla", "one namespace: the ring is scoped by it"
    assert prefix["parameters"][0] == f"{SHARE}/config/prefix_node.param.yaml"
    assert suffix["parameters"][0] == f"{SHARE}/config/suffix_node.param.yaml"
    p_over, s_over = prefix["parameters"][1], suffix["parameters"][1]
    assert p_over["split_layer"] == 16 and s_over["split_layer"] == 16
    assert p_over["model_path"] == s_over["model_path"] == "/models/orion"
    assert s_over["cpu_affinity"] == [6, 7]
    # the prefix gets every other core of this machine (it used to be left unpinned, its threads on the suffix's)
    assert p_over["cpu_affinity"] == sorted(os.sched_getaffinity(0) - {6, 7})
    assert s_over["navigation_command"] == "LEFT" and "navigation_command" not in p_over
    assert p_over["camera_transports"] == ["compressed"]
    assert p_over["camera_topics"] == [f"~/input/image{i}" for i in range(6)]
    assert dict(prefix["remappings"]) == {
        **{f"~/input/image{i}/compressed": f"/sensing/camera/camera{i}/image_rect_color/compressed" for i in range(6)},
        "~/input/kinematic_state": "/localization/kinematic_state",  # ego state input (checkpoints that take it)
        "~/input/acceleration": "/localization/acceleration"}
    assert dict(suffix["remappings"]) == {"~/input/kinematic_state": "/localization/kinematic_state",
                                          "~/input/navigation_command": "/mission/command",
                                          "~/output/trajectory": "/planning/scenario_planning/trajectory"}


def test_empty_arguments_keep_the_parameter_files(launch_file):
    module, classes = launch_file
    _, _, nodes = _setup(module, classes)
    assert "split_layer" not in nodes["prefix_node"].kwargs["parameters"][1]
    assert nodes["suffix_node"].kwargs["parameters"][1] == {}
    assert dict(nodes["suffix_node"].kwargs["remappings"])["~/input/navigation_command"] == \
        "/planning/hybrid_vla/navigation_command"
    assert dict(nodes["prefix_node"].kwargs["remappings"])["~/input/image3"] == "/sensing/camera/camera3/image_rect_color"


def test_autostart_configures_then_activates_each_node(launch_file):
    module, classes = launch_file
    _, actions, nodes = _setup(module, classes)
    handlers = [a for a in actions if isinstance(a, classes["RegisterEventHandler"])]
    configures = [a for a in actions if isinstance(a, classes["EmitEvent"])]
    assert len(handlers) == 2 and len(configures) == 2
    for node in nodes.values():
        handler = next(h.args[0] for h in handlers if h.args[0].kwargs["target_lifecycle_node"] is node)
        assert handler.kwargs["start_state"] == "configuring" and handler.kwargs["goal_state"] == "inactive"
        activate = handler.kwargs["entities"][0].kwargs["event"].kwargs
        assert activate["transition_id"] == 3  # lifecycle_msgs/Transition.TRANSITION_ACTIVATE
        assert activate["lifecycle_node_matcher"] == ("matches", node)
    assert {c.kwargs["event"].kwargs["transition_id"] for c in configures} == {1}  # TRANSITION_CONFIGURE
    _, actions, _ = _setup(module, classes, autostart="false")
    assert not [a for a in actions if isinstance(a, (classes["RegisterEventHandler"], classes["EmitEvent"]))]


def test_bad_transport_is_refused(launch_file):
    module, classes = launch_file
    with pytest.raises(ValueError, match="camera_transport"):
        _setup(module, classes, camera_transport="h264")


def test_cpu_affinity_reaches_the_suffix_early_pinning(launch_file, tmp_path):
    """launch_ros hands the parameter dicts to the node as --params-file files; the suffix node must
    find cpu_affinity there before torch and rclpy start (hybrid_vla_ros.ros.params_file)."""
    module, classes = launch_file
    _, _, nodes = _setup(module, classes, cpu_affinity="[1]")
    shipped = Path(__file__).resolve().parent.parent / "config" / "suffix_node.param.yaml"
    override = tmp_path / "launch_params.yaml"
    override.write_text(yaml.safe_dump({"/**": {"ros__parameters": nodes["suffix_node"].kwargs["parameters"][1]}}))
    argv = ["suffix_node", "--ros-args", "--params-file", str(shipped), "--params-file", str(override)]
    assert cpu_affinity_from_ros_args(argv, "suffix_node") == [1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to split between the nodes")
def test_prefix_cores_are_disjoint_from_the_suffix_cores(launch_file, tmp_path):
    """prefix_cpu_affinity: empty = every usable core but the suffix's (from cpu_affinity, or else from the
    suffix's parameter file); an explicit value or the prefix file's own value wins; '[]' = not pinned."""
    module, classes = launch_file
    usable = sorted(os.sched_getaffinity(0))
    suffix_core = usable[-1]

    def prefix_cores(**given):
        _, _, nodes = _setup(module, classes, **given)
        return nodes["prefix_node"].kwargs["parameters"][1].get("cpu_affinity")

    assert prefix_cores(cpu_affinity=f"[{suffix_core}]") == usable[:-1]
    suffix_file = tmp_path / "suffix.yaml"
    suffix_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"cpu_affinity": [suffix_core]}}}))
    assert prefix_cores(suffix_param_file=str(suffix_file)) == usable[:-1]
    assert prefix_cores(cpu_affinity=f"[{suffix_core}]", prefix_cpu_affinity="[0]") == [0]
    assert prefix_cores(cpu_affinity=f"[{suffix_core}]", prefix_cpu_affinity="[]") == []
    prefix_file = tmp_path / "prefix.yaml"
    prefix_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"cpu_affinity": [0]}}}))
    assert prefix_cores(cpu_affinity=f"[{suffix_core}]", prefix_param_file=str(prefix_file)) is None  # the file's
    assert prefix_cores() is None, "an unpinned suffix leaves nothing to keep clear of"
