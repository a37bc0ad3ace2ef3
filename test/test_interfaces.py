"""The locally built interface packages match upstream Autoware's types exactly: autoware_planning_msgs'
Trajectory, autoware_internal_planning_msgs' CandidateTrajectories, CandidateTrajectory and GeneratorInfo and
autoware_internal_debug_msgs' StringStamped (autowarefoundation/autoware_internal_msgs), by their RIHS01 type
hashes on the DDS graph, in the installed type descriptions and as rosbags computes them from the .msg files."""
import json
from pathlib import Path

import pytest

UPSTREAM_TRAJECTORY_HASH = "RIHS01_8259168af0abd0d3fa8297048f83aae4dad0955bd2d4e0904bcdc4f6f99a61b2"
#: autoware_internal_planning_msgs types -> upstream's hashes
UPSTREAM_INTERNAL_PLANNING_HASHES = {
    "CandidateTrajectories": "RIHS01_64c383ed8984651da0da8cc403af88918835869c4e4f028676e3023c6122b29c",
    "CandidateTrajectory": "RIHS01_65c7f26774c9459f94b7b95452c712f460ed20f4a008f972e71cb768b06576ee",
    "GeneratorInfo": "RIHS01_b930bac9138649852a4f9b06a66dd6d83a3639d44d4efdf6c1a5b6ff178cfbc4",
}
#: autoware_internal_debug_msgs/msg/StringStamped (the suffix's ~/output/reasoning): upstream's hash, as rosbags
#: computes it from upstream's StringStamped.msg (autoware_internal_msgs commit 1856e5b)
UPSTREAM_STRING_STAMPED_HASH = "RIHS01_e31ef527080bc4557f253671c1509b5d23f328414ea3e90b538ca151329f2faf"
REPO = Path(__file__).resolve().parent.parent


def test_built_type_hash_is_upstream_autoware():
    """The hash the DDS graph advertises for our Trajectory equals upstream Autoware's, so Autoware
    nodes and our publisher match on the topic."""
    import rclpy
    from autoware_planning_msgs.msg import Trajectory
    from rclpy.node import Node

    rclpy.init()
    try:
        node = Node("type_hash_probe")
        node.create_publisher(Trajectory, "/type_hash_probe/trajectory", 1)
        infos = node.get_publishers_info_by_topic("/type_hash_probe/trajectory")
        assert infos and infos[0].topic_type == "autoware_planning_msgs/msg/Trajectory"
        assert str(infos[0].topic_type_hash) == UPSTREAM_TRAJECTORY_HASH
        node.destroy_node()
    finally:
        rclpy.shutdown()


def test_installed_type_description_hash():
    from hybrid_vla_ros.tools.output_bag import share_directory

    share = share_directory("autoware_planning_msgs")
    desc = json.loads((share / "msg" / "Trajectory.json").read_text())
    hashes = {h["type_name"]: h["hash_string"] for h in desc["type_hashes"]}
    assert hashes["autoware_planning_msgs/msg/Trajectory"] == UPSTREAM_TRAJECTORY_HASH


def test_msg_files_hash_like_upstream_in_rosbags():
    """Independent check with rosbags' own RIHS01 implementation on the repo's .msg files."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for name in ("TrajectoryPoint", "Trajectory"):
        text = (REPO / "interfaces" / "autoware_planning_msgs" / "msg" / f"{name}.msg").read_text()
        types.update(get_types_from_msg(text, f"autoware_planning_msgs/msg/{name}"))
    store.register(types)
    assert store.hash_rihs01("autoware_planning_msgs/msg/Trajectory") == UPSTREAM_TRAJECTORY_HASH


def test_local_interface_copy_is_hidden_from_colcon():
    assert (REPO / "interfaces" / "COLCON_IGNORE").is_file()


def test_internal_planning_type_hashes_on_the_graph_are_upstream():
    """The hash the graph advertises for a publisher of each autoware_internal_planning_msgs type is
    upstream's, so Autoware's trajectory selector and our candidates publisher match on the topic."""
    import autoware_internal_planning_msgs.msg as msgs
    import rclpy
    from rclpy.node import Node

    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        node = Node("type_hash_probe_internal", context=context)
        for name, expected in UPSTREAM_INTERNAL_PLANNING_HASHES.items():
            topic = f"/type_hash_probe/{name.lower()}"
            node.create_publisher(getattr(msgs, name), topic, 1)
            infos = node.get_publishers_info_by_topic(topic)
            assert infos and infos[0].topic_type == f"autoware_internal_planning_msgs/msg/{name}"
            assert str(infos[0].topic_type_hash) == expected, name
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)


@pytest.mark.parametrize("name", sorted(UPSTREAM_INTERNAL_PLANNING_HASHES))
def test_installed_internal_planning_type_descriptions(name):
    from hybrid_vla_ros.tools.output_bag import share_directory

    desc = json.loads((share_directory("autoware_internal_planning_msgs") / "msg" / f"{name}.json").read_text())
    hashes = {h["type_name"]: h["hash_string"] for h in desc["type_hashes"]}
    assert hashes[f"autoware_internal_planning_msgs/msg/{name}"] == UPSTREAM_INTERNAL_PLANNING_HASHES[name]
    if name != "GeneratorInfo":  # the candidates carry Autoware's TrajectoryPoint
        assert hashes["autoware_planning_msgs/msg/TrajectoryPoint"] == json.loads(
            (share_directory("autoware_planning_msgs") / "msg" / "TrajectoryPoint.json").read_text()
        )["type_hashes"][0]["hash_string"]


def test_internal_planning_msg_files_hash_like_upstream_in_rosbags():
    """Independent check: rosbags' RIHS01 of the repo's .msg files (with Kilted's std_msgs and
    unique_identifier_msgs) is upstream's for all three types."""
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = {}
    for name in ("TrajectoryPoint", "Trajectory"):
        text = (REPO / "interfaces" / "autoware_planning_msgs" / "msg" / f"{name}.msg").read_text()
        types.update(get_types_from_msg(text, f"autoware_planning_msgs/msg/{name}"))
    for name in UPSTREAM_INTERNAL_PLANNING_HASHES:
        text = (REPO / "interfaces" / "autoware_internal_planning_msgs" / "msg" / f"{name}.msg").read_text()
        types.update(get_types_from_msg(text, f"autoware_internal_planning_msgs/msg/{name}"))
    store.register(types)
    for name, expected in UPSTREAM_INTERNAL_PLANNING_HASHES.items():
        assert store.hash_rihs01(f"autoware_internal_planning_msgs/msg/{name}") == expected, name


def test_tf2_msgs_built_here_is_the_upstream_type():
    """The TFMessage built into the venv (interfaces/tf2_msgs: no tf2_msgs wheel exists on PyPI) has the type hash
    of ROS 2 Kilted's own tf2_msgs/msg/TFMessage as rosbags knows it, so /tf_static publishers of a real ROS install
    and the prefix node match."""
    from rosbags.typesys import Stores, get_typestore

    from hybrid_vla_ros.tools.output_bag import share_directory

    upstream = get_typestore(Stores.ROS2_KILTED).hash_rihs01("tf2_msgs/msg/TFMessage")
    share = share_directory("tf2_msgs")
    desc = json.loads((share / "msg" / "TFMessage.json").read_text())
    hashes = {h["type_name"]: h["hash_string"] for h in desc["type_hashes"]}
    assert hashes["tf2_msgs/msg/TFMessage"] == upstream


def test_string_stamped_is_upstream_on_the_graph_in_the_description_and_in_rosbags():
    """The reasoning topic's StringStamped built here has upstream's hash three ways: what the DDS graph advertises
    for a publisher, the installed type description, and rosbags' RIHS01 of the repo's .msg file."""
    import rclpy
    from autoware_internal_debug_msgs.msg import StringStamped
    from rclpy.node import Node
    from rosbags.typesys import Stores, get_types_from_msg, get_typestore

    from hybrid_vla_ros.tools.output_bag import share_directory

    name = "autoware_internal_debug_msgs/msg/StringStamped"
    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        node = Node("type_hash_probe_debug", context=context)
        node.create_publisher(StringStamped, "/type_hash_probe/reasoning", 1)
        infos = node.get_publishers_info_by_topic("/type_hash_probe/reasoning")
        assert infos and infos[0].topic_type == name
        assert str(infos[0].topic_type_hash) == UPSTREAM_STRING_STAMPED_HASH
        node.destroy_node()
    finally:
        rclpy.try_shutdown(context=context)
    desc = json.loads((share_directory("autoware_internal_debug_msgs") / "msg" / "StringStamped.json").read_text())
    assert {h["type_name"]: h["hash_string"] for h in desc["type_hashes"]}[name] == UPSTREAM_STRING_STAMPED_HASH
    store = get_typestore(Stores.ROS2_KILTED)
    text = (REPO / "interfaces" / "autoware_internal_debug_msgs" / "msg" / "StringStamped.msg").read_text()
    store.register(get_types_from_msg(text, name))
    assert store.hash_rihs01(name) == UPSTREAM_STRING_STAMPED_HASH
