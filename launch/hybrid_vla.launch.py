"""Start prefix_node and suffix_node as managed (lifecycle) nodes and bring both to active.

    ros2 launch hybrid_vla_ros hybrid_vla.launch.py model_path:=/path/to/checkpoint split_layer:=16 \
        cpu_affinity:='[6, 7]' output_trajectory:=/planning/hybrid_vla/trajectory

Parameters come from the two parameter files (``prefix_param_file``, ``suffix_param_file``, by
default the package's ``config/*.param.yaml``); a launch argument given on the command line
overrides the file's value, one left empty keeps it.

Lifecycle: with ``autostart`` (the default) each node process is configured when it starts and
activated once, after its first successful configure (the event pattern of launch_ros' lifecycle
examples); every later transition is left to whoever manages the node (``ros2 lifecycle``, a
lifecycle manager): a reconfigure at another K stays inactive until it is activated. ``autostart:=false``
leaves both unconfigured for your own manager. ``respawn:=true`` restarts a node process that died
(after ``respawn_delay`` s), and autostart brings the new process up the same way; the survivor keeps
running meanwhile (the prefix reports ERROR "no suffix attached" and keeps computing frames, the suffix
reports ERROR "the ring's owner is dead") and picks the new peer up by itself. A launch into a namespace
where a prefix_node or suffix_node already runs (in this ROS domain) is refused in one line before any
node starts.

Topics: camera inputs ``~/input/image<i>`` are remapped onto Autoware's
``/sensing/camera/camera<i>/<camera_topic_suffix>`` (``.../compressed`` with
``camera_transport:=compressed``), odometry, trajectory and candidate trajectories (published with
``publish_candidate_trajectories:=true``) onto the topics given; the outputs and the navigation command
default to ``/planning/<namespace>/...``, so two instances in two namespaces publish apart. The prefix
takes odometry and acceleration too (used when the checkpoint has ``ego_state_input`` or the published query
heads); the suffix takes a navigation command name (``std_msgs/String``) on ``input_navigation_command``, its
initial value from ``navigation_command`` (default: the parameter file's, LANE_FOLLOW as shipped), and so does a
prefix with the query heads. The prefix's ``~/input/camera_info<i>`` is remapped onto
``/sensing/camera/camera<i>/camera_info`` (read by the query heads, with ``/tf_static``).

CPU cores: ``cpu_affinity`` pins the suffix, ``prefix_cpu_affinity`` the prefix. Left empty (and with
no ``cpu_affinity`` in the prefix's parameter file), the prefix gets every core of this machine that
the suffix does not get (the suffix's from ``cpu_affinity`` or its parameter file), so its OpenCV and
torch threads stay off the suffix's cores; ``prefix_cpu_affinity:='[]'`` leaves the prefix parameter file's
value (unpinned as shipped).
"""
import os
import threading

import launch.logging
import yaml
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.event_handlers import OnProcessStart
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode, Node
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.ros_adapters import get_ros_node
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
     "this machine the suffix does not get (unless the prefix parameter file sets cpu_affinity); '[]': the prefix "
     "file's value (unpinned as shipped)"),
    ("device", "", "prefix device: auto | cpu | cuda | cuda:N"),
    ("dtype", "", "fp32 | bf16 | fp16 (both nodes)"),
    ("camera_transport", "raw", "raw (sensor_msgs/Image) | compressed (sensor_msgs/CompressedImage)"),
    ("camera_topic_suffix", "image_rect_color", "camera i is /sensing/camera/camera<i>/<this>"),
    ("input_kinematic_state", "/localization/kinematic_state", "nav_msgs/Odometry of the ego vehicle (both nodes)"),
    ("input_acceleration", "/localization/acceleration",
     "geometry_msgs/AccelWithCovarianceStamped of the ego vehicle (prefix, checkpoints with ego_state_input or "
     "the query heads)"),
    ("input_navigation_command", "",
     "std_msgs/String navigation command name for the suffix (LEFT, RIGHT, STRAIGHT, LANE_FOLLOW, ...) (empty: "
     "/planning/<namespace>/navigation_command)"),
    ("navigation_command", "", "initial navigation command of the suffix (and of the prefix's query heads), e.g. "
     "LANE_FOLLOW"),
    ("base_frame", "", "prefix, query heads: the frame /tf_static connects to each camera's optical frame "
     "(empty: the parameter file's, base_link)"),
    ("model_frame_origin", "", "both nodes, query heads: the published models' lidar origin in base_frame, m, "
     "e.g. '[1.01, 0.0, 1.84]' (empty: the parameter files')"),
    ("output_trajectory", "", "topic of the published Trajectory (empty: /planning/<namespace>/trajectory)"),
    ("output_candidate_trajectories", "",
     "topic of the CandidateTrajectories (every planner mode), published with publish_candidate_trajectories "
     "(empty: /planning/<namespace>/candidate_trajectories)"),
    ("publish_candidate_trajectories", "",
     "true: the suffix also publishes every planner mode as CandidateTrajectories (empty: the parameter file's)"),
    ("namespace", "hybrid_vla", "namespace of both nodes (it also scopes the shared-memory ring)"),
    ("prefix_param_file", "", "parameter file of prefix_node (default: the package's config/prefix_node.param.yaml)"),
    ("suffix_param_file", "", "parameter file of suffix_node (default: the package's config/suffix_node.param.yaml)"),
    ("autostart", "true", "configure each node process when it starts and activate it once, after its first "
     "successful configure; later transitions are your lifecycle manager's"),
    ("respawn", "false", "true: restart a node process that died (autostart brings it up again)"),
    ("respawn_delay", "2.0", "seconds to wait before restarting a node process that died (with respawn)"),
    ("rviz", "false", "true: also start rviz2 with the package's rviz/hybrid_vla.rviz (cameras, trajectory markers, "
     "reasoning text)"),
    ("use_sim_time", "", "true: both nodes take their clock from /clock (a bag played with `ros2 bag play --clock` "
     "or `hybrid-vla replay --attach`), so the output guard judges recorded stamps by the bag's time"),
]
# A launch argument named as a parameter of a node's schema (schema/<node>.schema.json) overrides that parameter
# when given, except these: `cpu_affinity` pins the suffix (the prefix's cores are `prefix_cpu_affinity`).
NOT_OVERRIDES = {"prefix_node": ("cpu_affinity",), "suffix_node": ()}
# ROS parameters of every node, not in the schemas, that a launch argument of the same name overrides too
ROS_OVERRIDES = ("use_sim_time",)


def _override_specs(node: str) -> dict:
    """Launch argument name -> the schema entry of the ``node`` parameter it overrides (None for a ROS parameter
    such as ``use_sim_time``), in the order of ``ARGUMENTS``."""
    from hybrid_vla_ros.ros.params import parameter_specs

    specs = parameter_specs(node)
    names = [n for n, _, _ in ARGUMENTS if n in specs and n not in NOT_OVERRIDES[node]]
    return {**{n: specs[n] for n in names}, **{n: None for n in ROS_OVERRIDES}}


def _overrides(values: dict, node: str) -> dict:
    """Typed parameter values of the non-empty launch arguments that override a parameter of ``node``
    (:func:`_override_specs`): a string parameter's value as given, any other as YAML (scalars, lists); a
    whole number given for a ``number`` parameter or list item becomes a float (``'[1, 0, 2]'`` is a double[]).

    Raises ValueError for an empty list (e.g. ``cpu_affinity:='[]'``): launch_ros cannot write one into its
    parameter file, and rcl ignores an empty list that follows a value from an earlier file, so it could
    not override the parameter file's value; the message says to set it in the parameter file instead.
    """
    typed = {}
    for n, spec in _override_specs(node).items():
        if values[n] == "":
            continue
        v = values[n] if spec is not None and spec["type"] == "string" else yaml.safe_load(values[n])
        v = _as_numbers(v, spec)
        if isinstance(v, list) and not v:
            raise ValueError(f"{n}:='[]': an empty list cannot override the parameter file's value (ROS ignores "
                             f"empty lists over earlier values); set `{n}: []` in your own parameter file and "
                             "pass it as prefix_param_file / suffix_param_file")
        typed[n] = v
    return typed


def _as_numbers(value, spec):
    """``value`` with its whole numbers as floats where the schema ``spec`` says ``number`` (a double or a
    double[]): YAML reads ``1`` as an int, which the node refuses for a double."""
    if spec is None:
        return value
    if spec["type"] == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if spec["type"] == "array" and spec.get("items", {}).get("type") == "number" and isinstance(value, list):
        return [float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in value]
    return value


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


def _autostart(node) -> RegisterEventHandler:
    """Each time ``node``'s process starts (the first start and every respawn): configure it, and activate it once,
    after that process's first successful configure (configuring -> inactive).

    The configure is requested from a thread once the new process itself answers ``get_state``
    (``ros.lifecycle_client.configure_when_ready``: after a respawn, discovery still lists the dead process's
    services for a while, and a request sent at once can go to the dead server alone). The activation handler is
    registered once per process start and removes itself when it fires (``handle_once``), so a later configure (a
    reconfigure at another split layer by ``ros2 lifecycle``, a lifecycle manager) is never followed by an
    activation from here."""
    pending = {"activate": False}  # an activation handler registered and not yet fired

    def activated(context):
        pending["activate"] = False

    def on_start(event, context) -> list:
        from hybrid_vla_ros.ros.lifecycle_client import configure_when_ready

        ros_node = get_ros_node(context)
        target = node.node_name  # fully qualified once the action has run: /<namespace>/<name>
        logger = launch.logging.get_logger("hybrid_vla_ros.autostart")
        threading.Thread(target=configure_when_ready, args=(ros_node, target, event.pid),
                         kwargs={"log": logger.error}, name=f"autostart {target}", daemon=True).start()
        if pending["activate"]:
            return []
        pending["activate"] = True
        return [RegisterEventHandler(OnStateTransition(
            target_lifecycle_node=node, start_state="configuring", goal_state="inactive", handle_once=True,
            entities=[OpaqueFunction(function=activated),
                      EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                                  transition_id=Transition.TRANSITION_ACTIVATE))]))]

    return RegisterEventHandler(OnProcessStart(target_action=node, on_start=on_start))


def _refuse_if_running(context, namespace: str, prefix_file: str) -> None:
    """Raise RuntimeError (``ros2 launch`` prints it in one line and exits 1, before any node starts) when a
    prefix_node or suffix_node already runs in ``namespace`` in this ROS domain: two nodes of one name answer each
    other's lifecycle requests, and the second prefix could not own the ring (it would stay unconfigured on the
    graph). Checked through the ring (its owner and consumer) and the ROS graph (``ros.graph.running_pipeline``)."""
    from hybrid_vla_ros.ros.graph import running_pipeline

    ring_name = _file_value(prefix_file, namespace, "prefix_node", "ring_name") or "prefix_states"
    node = get_ros_node(context)
    domain = node.context.get_domain_id()
    found = running_pipeline(node, namespace, ring_name, domain)
    if found:
        raise RuntimeError(f"{' and '.join(found)} {'is' if len(found) == 1 else 'are'} already running in ROS "
                           f"domain {domain}: stop {'it' if len(found) == 1 else 'them'} first, or launch into "
                           "another namespace:=")


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
        # the camera's CameraInfo beside it (read by the published query heads): the prefix's default for
        # ~/input/image<i> is ~/input/camera_info<i> (params.camera_info_topic)
        remaps.append((f"~/input/camera_info{i}", f"/sensing/camera/camera{i}/camera_info"))
    namespace = "/" + values["namespace"].strip("/")
    planning = "/planning/" + (values["namespace"].strip("/") or "hybrid_vla")
    topics = {"output_trajectory": f"{planning}/trajectory",
              "output_candidate_trajectories": f"{planning}/candidate_trajectories",
              "input_navigation_command": f"{planning}/navigation_command"}
    topics = {name: values[name] or default for name, default in topics.items()}
    respawn = _flag(values, "respawn")
    try:
        respawn_delay = float(values["respawn_delay"])
    except ValueError:
        raise ValueError(f"respawn_delay must be a number of seconds, got {values['respawn_delay']!r}") from None
    if not respawn_delay >= 0:
        raise ValueError(f"respawn_delay must be >= 0 s, got {respawn_delay}")
    prefix_overrides = _overrides(values, "prefix_node")
    prefix_cores = _prefix_cores(values, prefix_file, suffix_file)
    if prefix_cores is not None:
        prefix_overrides["cpu_affinity"] = prefix_cores
    _refuse_if_running(context, namespace, prefix_file)
    restart = {"respawn": respawn, "respawn_delay": respawn_delay}
    prefix = LifecycleNode(
        package=PACKAGE, executable="prefix_node", name="prefix_node", namespace=values["namespace"],
        output="screen", **restart,
        parameters=[prefix_file, {"camera_topics": inputs, "camera_transports": [transport], **prefix_overrides}],
        remappings=remaps + [("~/input/kinematic_state", values["input_kinematic_state"]),
                             ("~/input/acceleration", values["input_acceleration"]),
                             ("~/input/navigation_command", topics["input_navigation_command"])])
    suffix = LifecycleNode(
        package=PACKAGE, executable="suffix_node", name="suffix_node", namespace=values["namespace"],
        output="screen", **restart,
        parameters=[suffix_file, _overrides(values, "suffix_node")],
        remappings=[("~/input/kinematic_state", values["input_kinematic_state"]),
                    ("~/input/navigation_command", topics["input_navigation_command"]),
                    ("~/output/trajectory", topics["output_trajectory"]),
                    ("~/output/candidate_trajectories", topics["output_candidate_trajectories"])])
    actions = []
    if _flag(values, "autostart"):
        actions += [_autostart(prefix), _autostart(suffix)]  # registered before the processes start
    if _flag(values, "rviz"):
        actions.append(Node(package="rviz2", executable="rviz2", name="rviz2", namespace=values["namespace"],
                            arguments=["-d", f"{share}/rviz/hybrid_vla.rviz"], output="log"))
    return actions + [prefix, suffix]


def _flag(values: dict, name: str) -> bool:
    """A true/false launch argument (true, 1, yes / false, 0, no, any case); ValueError otherwise."""
    text = values[name].strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{name} must be true or false, got {values[name]!r}")


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription(
        [DeclareLaunchArgument(name, default_value=default, description=description)
         for name, default, description in ARGUMENTS]
        + [OpaqueFunction(function=launch_setup)])
