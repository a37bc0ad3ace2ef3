"""Start prefix_node and suffix_node as managed (lifecycle) nodes and bring both to active.

ros2 launch hybrid_vla_ros hybrid_vla.launch.py model_path:=/path/to/checkpoint split_layer:=16 \
    cpu_affinity:='[6, 7]' output_trajectory:=/planning/hybrid_vla/trajectory

Each node is configured as soon as it starts and activated as soon as it reaches "inactive"
(the pattern of launch_ros' lifecycle examples), so no separate lifecycle manager is needed. With
``autostart:=false`` the nodes stay unconfigured for your own manager. Camera inputs
``~/input/image<i>`` are remapped onto Autoware's ``/sensing/camera/camera<i>/<camera_topic_suffix>``;
with ``camera_transport:=compressed`` the node subscribes to ``.../compressed``.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, RegisterEventHandler
from launch.conditions import IfCondition
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.substitutions import FindPackageShare
from lifecycle_msgs.msg import Transition

N_CAMERAS = 6

ARGUMENTS = [
    ("model_path", None, "checkpoint directory (config.json + model.safetensors)"),
    ("split_layer", "-1", "split layer K in [0, L]: decoder blocks [0, K) on the GPU, [K, L) on the CPU"),
    ("cpu_affinity", "[]", "cores for the suffix process, e.g. '[6, 7]' ([] = not pinned)"),
    ("device", "auto", "prefix device: auto | cpu | cuda | cuda:N"),
    ("dtype", "fp32", "fp32 | bf16 | fp16"),
    ("camera_topic_suffix", "image_rect_color", "camera i is /sensing/camera/camera<i>/<this>"),
    ("camera_transport", "raw", "raw | compressed"),
    ("input_kinematic_state", "/localization/kinematic_state", "nav_msgs/Odometry of the ego vehicle"),
    ("output_trajectory", "/planning/hybrid_vla/trajectory", "where the Trajectory is published"),
    ("namespace", "hybrid_vla", "namespace of both nodes (also scopes the shared-memory ring)"),
    ("prefix_param_file", None, "parameter file of prefix_node"),
    ("suffix_param_file", None, "parameter file of suffix_node"),
    ("autostart", "true", "configure and activate both nodes at start"),
]


def _share(*parts):
    return PathJoinSubstitution([FindPackageShare("hybrid_vla_ros"), *parts])


def generate_launch_description() -> LaunchDescription:
    defaults = {
        "prefix_param_file": _share("config", "prefix_node.param.yaml"),
        "suffix_param_file": _share("config", "suffix_node.param.yaml"),
    }
    args = []
    for name, default, description in ARGUMENTS:
        default = defaults.get(name, default)
        if default is None:
            args.append(DeclareLaunchArgument(name, description=description))
        else:
            args.append(DeclareLaunchArgument(name, default_value=default, description=description))
    arg = LaunchConfiguration

    common = {"model_path": arg("model_path"), "split_layer": arg("split_layer"), "dtype": arg("dtype")}
    camera_remaps = []
    for i in range(N_CAMERAS):
        target = ["/sensing/camera/camera", str(i), "/", arg("camera_topic_suffix")]
        camera_remaps.append((f"~/input/image{i}", target))
        camera_remaps.append((f"~/input/image{i}/compressed", target + ["/compressed"]))

    prefix = LifecycleNode(
        package="hybrid_vla_ros", executable="prefix_node", name="prefix_node", namespace=arg("namespace"),
        output="screen",
        parameters=[arg("prefix_param_file"), {
            **common, "device": arg("device"), "camera_transports": ["", arg("camera_transport")][1:],
            "camera_topics": [f"~/input/image{i}" for i in range(N_CAMERAS)]}],
        remappings=camera_remaps,
    )
    suffix = LifecycleNode(
        package="hybrid_vla_ros", executable="suffix_node", name="suffix_node", namespace=arg("namespace"),
        output="screen",
        parameters=[arg("suffix_param_file"), {**common, "cpu_affinity": arg("cpu_affinity")}],
        remappings=[("~/input/kinematic_state", arg("input_kinematic_state")),
                    ("~/output/trajectory", arg("output_trajectory"))],
    )

    autostart = IfCondition(arg("autostart"))
    actions = [*args, prefix, suffix]
    for node in (prefix, suffix):
        actions.append(EmitEvent(
            event=ChangeState(lifecycle_node_matcher=matches_action(node),
                              transition_id=Transition.TRANSITION_CONFIGURE),
            condition=autostart))
        actions.append(RegisterEventHandler(
            OnStateTransition(
                target_lifecycle_node=node, goal_state="inactive",
                entities=[EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                                      transition_id=Transition.TRANSITION_ACTIVATE))]),
            condition=autostart))
    return LaunchDescription(actions)
