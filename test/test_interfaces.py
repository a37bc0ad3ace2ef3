"""The locally built autoware_planning_msgs matches upstream Autoware's Trajectory type exactly."""
import json
from pathlib import Path

UPSTREAM_TRAJECTORY_HASH = "RIHS01_8259168af0abd0d3fa8297048f83aae4dad0955bd2d4e0904bcdc4f6f99a61b2"
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
