"""Start prefix_node and suffix_node as managed (lifecycle) nodes and bring both to active.

    ros2 launch hybrid_vla_ros hybrid_vla.launch.py model_path:=/path/to/checkpoint split_layer:=16 \
        cpu_affinity:='[6, 7]' output_trajectory:=/planning/hybrid_vla/trajectory

Parameters come from the two parameter files (``prefix_param_file``, ``suffix_param_file``, by
default the package's ``config/*.param.yaml``); a launch argument given on the command line
overrides the file's value, one left empty keeps it. Each node is configured when it starts and
activated when that configure succeeds (the event pattern of launch_ros' lifecycle examples), so no
separate lifecycle manager is needed; ``autostart:=false`` leaves both unconfigured for your own
manager. Camera inputs ``~/input/image<i>`` are remapped onto Autoware's
``/sensing/camera/camera<i>/<camera_topic_suffix>`` (``.../compressed`` with
``camera_transport:=compressed``), odometry, trajectory and candidate trajectories (published with
``publish_candidate_trajectories:=true``) onto the topics given. The prefix takes
odometry and acceleration too (used when the checkpoint has ``ego_state_input``); the suffix takes a
navigation command name (``std_msgs/String``) on ``input_navigation_command``, its initial value from
``navigation_command`` (default: the parameter file's, LANE_FOLLOW as shipped).

CPU cores: ``cpu_affinity`` pins the suffix, ``prefix_cpu_affinity`` the prefix. Left empty (and with
no ``cpu_affinity`` in the prefix's parameter file), the prefix gets every core of this machine that
the suffix does not get (the suffix's from ``cpu_affinity`` or its parameter file), so its OpenCV and
torch threads stay off the suffix's cores; ``prefix_cpu_affinity:='[]'`` leaves the prefix parameter file's
value (unpinned as shipped).
"""
import os

import yaml
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.substitutions import FindPackageShare
from lifecycle_msgs.msg import Transition

from launch import LaunchDescription

PACKAGE = "hybrid_vla_ros"
N_CAMERAS = 6

# (name, default, description); "" as default = keep the parameter file's value
ARGUMENTS = [
    ("model_path", "", "checkpoint directory (config.json + model.safetensors)"),
    ("split_layer", "", "split layer K in [0, L]: decoder blocks [0, K) on the GPU, [K, L) on the CPU"),
    ("cpu_affinity", "", "cores for the whole suffix process, e.g. '[6, 7]'"),
    ("prefix_cpu_affinity", "", "cores for the whole prefix process, e.g. '[0, 1, 2, 3, 4, 5]'; empty: every core of "
     "this machine the suffix does not get (unless the prefix parameter file sets cpu_affinity); '[]': the prefix file's value (unpinned as shipped)"),
    ("device", "", "prefix device: auto | cpu | cuda | cuda:N"),
    ("dtype", "", "fp32 | bf16 | fp16 (both nodes)"),
    ("camera_transport", "raw", "raw (sensor_msgs/Image) | compressed (sensor_msgs/CompressedImage)"),
    ("camera_topic_suffix", "image_rect_color", "camera i is /sensing/camera/camera<i>/<this>"),
    ("input_kinematic_state", "/localization/kinematic_state", "nav_msgs/Odometry of the ego vehicle (both nodes)"),
    ("input_acceleration", "/localization/acceleration",
     "geometry_msgs/AccelWithCovarianceStamped of the ego vehicle (prefix, checkpoints with ego_state_input)"),
    ("input_navigation_command", "/planning/hybrid_vla/navigation_command",
     "std_msgs/String navigation command name for the suffix (LEFT, RIGHT, STRAIGHT, LANE_FOLLOW, ...)"),
    ("navigation_command", "", "initial navigation command of the suffix, e.g. LANE_FOLLOW"),
    ("output_trajectory", "/planning/hybrid_vla/trajectory", "topic of the published Trajectory"),
    ("output_candidate_trajectories", "/planning/hybrid_vla/candidate_trajectories",
     "topic of the CandidateTrajectories (every planner mode), published with publish_candidate_trajectories"),
    ("publish_candidate_trajectories", "",
     "true: the suffix also publishes every planner mode as CandidateTrajectories (empty: the parameter file's)"),
    ("namespace", "hybrid_vla", "namespace of both nodes (it also scopes the shared-memory ring)"),
    ("prefix_param_file", "", "parameter file of prefix_node (default: the package's config/prefix_node.param.yaml)"),
    ("suffix_param_file", "", "parameter file of suffix_node (default: the package's config/suffix_node.param.yaml)"),
    ("autostart", "true", "configure and activate both nodes when they start"),
    ("use_sim_time", "", "true: both nodes take their clock from /clock (a bag played with `ros2 bag play --clock` "
     "or `hybrid-vla replay --attach`), so the output guard judges recorded stamps by the bag's time"),
]
# launch arguments that override a node parameter of the same name when given
PREFIX_OVERRIDES = ("model_path", "split_layer", "device", "dtype", "use_sim_time")
SUFFIX_OVERRIDES = ("model_path", "split_layer", "cpu_affinity", "dtype", "navigation_command",
                    "publish_candidate_trajectories", "use_sim_time")


def _overrides(values: dict, names) -> dict:
    """Typed parameter values (YAML scalars / lists) of the non-empty launch arguments in ``names``.

    Raises ValueError for an empty list (e.g. ``cpu_affinity:='[]'``): launch_ros cannot write one into its
    parameter file, and rcl ignores an empty list that follows a value from an earlier file, so it could
    not override the parameter file's value; the message says to set it in the parameter file instead.
    """
    typed = {}
    for n in names:
        if values[n] == "":
            continue
        v = values[n] if n == "model_path" else yaml.safe_load(values[n])
        if isinstance(v, list) and not v:
            raise ValueError(f"{n}:='[]': an empty list cannot override the parameter file's value (ROS ignores "
                             f"empty lists over earlier values); set `{n}: []` in your own parameter file and "
                             "pass it as prefix_param_file / suffix_param_file")
        typed[n] = v
    return typed


def _file_value(path: str, namespace: str, node: str, name: str):
    """Parameter ``name`` of ``node`` in parameter file ``path``; None when unset or the file is unreadable
    (the node itself reports a file it cannot read)."""
    from hybrid_vla_ros.ros.params_file import ParamsFileError, parameter_from_files

    try:
        return parameter_from_files([path], namespace, node, name)
    except ParamsFileError:
        return None


def _prefix_cores(values: dict, prefix_file: str, suffix_file: str):
    """The prefix's ``cpu_affinity`` override: ``prefix_cpu_affinity`` when given (``'[]'``: no override, the
    prefix file's value, unpinned as shipped: launch_ros cannot write an empty list and rcl would ignore it
    over the file's value); else, unless the prefix's file pins it, every usable core but the suffix's; None
    to keep the file's value."""
    from hybrid_vla_ros.util.cores import parse_core_list

    if values["prefix_cpu_affinity"] != "":
        given = yaml.safe_load(values["prefix_cpu_affinity"])
        return given if given != [] else None
    namespace = "/" + values["namespace"].strip("/")
    if _file_value(prefix_file, namespace, "prefix_node", "cpu_affinity"):
        return None
    suffix = (yaml.safe_load(values["cpu_affinity"]) if values["cpu_affinity"] != ""
              else _file_value(suffix_file, namespace, "suffix_node", "cpu_affinity"))
    if not suffix:
        return None  # the suffix is not pinned: no cores to keep clear
    rest = sorted(os.sched_getaffinity(0) - set(parse_core_list(suffix)))
    return rest or None  # a machine with no core left over: the prefix stays unpinned


def _autostart(node) -> list:
    """Configure ``node`` now; activate it when a configure has brought it to inactive."""
    configure = EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                            transition_id=Transition.TRANSITION_CONFIGURE))
    activate = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node, start_state="configuring", goal_state="inactive",
        entities=[EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                              transition_id=Transition.TRANSITION_ACTIVATE))]))
    return [activate, configure]


def launch_setup(context, *args, **kwargs) -> list:
    """Build both nodes from the launch arguments' values (called by OpaqueFunction)."""
    values = {name: LaunchConfiguration(name).perform(context) for name, _, _ in ARGUMENTS}
    share = FindPackageShare(PACKAGE).perform(context)
    prefix_file = values["prefix_param_file"] or f"{share}/config/prefix_node.param.yaml"
    suffix_file = values["suffix_param_file"] or f"{share}/config/suffix_node.param.yaml"
    transport = values["camera_transport"]
    if transport not in ("raw", "compressed"):
        raise ValueError(f"camera_transport must be raw or compressed, got {transport!r}")

    inputs = [f"~/input/image{i}" for i in range(N_CAMERAS)]
    remaps = []
    for i, name in enumerate(inputs):
        target = f"/sensing/camera/camera{i}/{values['camera_topic_suffix']}"
        remaps.append((f"{name}/compressed" if transport == "compressed" else name,
                       f"{target}/compressed" if transport == "compressed" else target))
    prefix_overrides = _overrides(values, PREFIX_OVERRIDES)
    prefix_cores = _prefix_cores(values, prefix_file, suffix_file)
    if prefix_cores is not None:
        prefix_overrides["cpu_affinity"] = prefix_cores
    prefix = LifecycleNode(
        package=PACKAGE, executable="prefix_node", name="prefix_node", namespace=values["namespace"],
        output="screen",
        parameters=[prefix_file, {"camera_topics": inputs, "camera_transports": [transport], **prefix_overrides}],
        remappings=remaps + [("~/input/kinematic_state", values["input_kinematic_state"]),
                             ("~/input/acceleration", values["input_acceleration"])])
    suffix = LifecycleNode(
        package=PACKAGE, executable="suffix_node", name="suffix_node", namespace=values["namespace"],
        output="screen",
        parameters=[suffix_file, _overrides(values, SUFFIX_OVERRIDES)],
        remappings=[("~/input/kinematic_state", values["input_kinematic_state"]),
                    ("~/input/navigation_command", values["input_navigation_command"]),
                    ("~/output/trajectory", values["output_trajectory"]),
                    ("~/output/candidate_trajectories", values["output_candidate_trajectories"])])
    actions = [prefix, suffix]
    if values["autostart"].lower() in ("true", "1", "yes"):
        actions += _autostart(prefix) + _autostart(suffix)
    return actions


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=launch_setup)])
