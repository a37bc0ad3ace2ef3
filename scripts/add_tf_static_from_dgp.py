#!/usr/bin/env python3
"""Add the cameras' static transforms (``/tf_static``, tf2_msgs/msg/TFMessage) to a bag made from a DGP scene.

    .venv/bin/python scripts/add_tf_static_from_dgp.py data/dgp_scene02_6cam_mcap \
        --calibration ../shared/data/ddad_dgp_test_scene/scene_02/calibration/<hash>.json \
        --cameras CAMERA_01 CAMERA_05 CAMERA_06 CAMERA_07 CAMERA_08 CAMERA_09

DGP's calibration file gives each sensor's pose in the vehicle body frame (``extrinsics``: translation in metres,
rotation quaternion qw, qx, qy, qz, mapping sensor coordinates to body coordinates) and its camera frames are optical
frames (x right, y down, z forward). Camera i of the bag (``--cameras``, in the bag's camera order) becomes one
``geometry_msgs/TransformStamped`` with ``header.frame_id`` = ``--base-frame`` (the body frame: the bag's odometry is
DGP's LiDAR pose and the LiDAR extrinsic is the identity, so body = base_link) and ``child_frame_id`` = the frame of
that camera's CameraInfo (``camera<i>/camera_optical_link`` in the embedded bag), as tf2's static_transform_publisher
would send them: one message, stamped and received at the bag's first message, offered reliable and transient local
(keep last 1) as ``/tf_static`` is. Every other message stays byte for byte as it was. A bag that already has
``/tf_static`` is refused.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _bag_folder import replace_bag_folder  # scripts/ is on sys.path when a script runs


def camera_frames(reader) -> dict[str, str]:
    """camera_info topic -> its CameraInfo's ``header.frame_id`` (the first message of each)."""
    frames: dict[str, str] = {}
    for conn, _t, raw in reader.messages():
        if conn.msgtype == "sensor_msgs/msg/CameraInfo" and conn.topic not in frames:
            frames[conn.topic] = reader.deserialize(raw, conn.msgtype).header.frame_id
    return frames


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bag", type=Path, help="rosbag2 directory (sqlite3 or mcap)")
    parser.add_argument("--calibration", type=Path, required=True, help="the DGP scene's calibration JSON")
    parser.add_argument("--cameras", nargs="+", required=True,
                        help="DGP camera names in the bag's camera order (camera0 first)")
    parser.add_argument("--base-frame", default="base_link")
    args = parser.parse_args(argv)

    from rosbags.highlevel import AnyReader
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    types = store.types
    cal = json.loads(args.calibration.read_text())
    bag = args.bag.resolve()
    never = QosTime(sec=0x7FFFFFFF, nsec=0xFFFFFFFF)
    latched = Qos(history=QosHistory.KEEP_LAST, depth=1, reliability=QosReliability.RELIABLE,
                  durability=QosDurability.TRANSIENT_LOCAL, deadline=never, lifespan=never,
                  liveliness=QosLiveliness.AUTOMATIC, liveliness_lease_duration=never,
                  avoid_ros_namespace_conventions=False)
    with tempfile.TemporaryDirectory(dir=bag.parent) as tmp:
        out = Path(tmp) / bag.name
        with AnyReader([bag], default_typestore=store) as reader:
            if any(c.topic == "/tf_static" for c in reader.connections):
                print(f"{bag} has /tf_static already: nothing changed", file=sys.stderr)
                return 1
            frames = camera_frames(reader)
            topics = sorted(frames)
            if len(topics) != len(args.cameras):
                print(f"{len(args.cameras)} DGP cameras named for {len(topics)} camera_info topics", file=sys.stderr)
                return 1
            first_ns = min(t for _c, t, _r in reader.messages())
            sec, nsec = divmod(first_ns, 10**9)
            stamp = types["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec)
            transforms = []
            for topic, name in zip(topics, args.cameras):
                e = cal["extrinsics"][cal["names"].index(name)]
                t, r = e["translation"], e["rotation"]
                transforms.append(types["geometry_msgs/msg/TransformStamped"](
                    header=types["std_msgs/msg/Header"](stamp=stamp, frame_id=args.base_frame),
                    child_frame_id=frames[topic],
                    transform=types["geometry_msgs/msg/Transform"](
                        translation=types["geometry_msgs/msg/Vector3"](x=t["x"], y=t["y"], z=t["z"]),
                        rotation=types["geometry_msgs/msg/Quaternion"](x=r["qx"], y=r["qy"], z=r["qz"],
                                                                       w=r["qw"]))))
                print(f"{args.base_frame} -> {frames[topic]} ({topic}): DGP {name}")
            tf_msg = types["tf2_msgs/msg/TFMessage"](transforms=transforms)
            storage = StoragePlugin.MCAP if any(p.suffix == ".mcap" for p in bag.iterdir()) else StoragePlugin.SQLITE3
            with Writer(out, version=8, storage_plugin=storage) as writer:
                conns = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store) for c in reader.connections}
                tf_conn = writer.add_connection("/tf_static", "tf2_msgs/msg/TFMessage", typestore=store,
                                                offered_qos_profiles=[latched])
                writer.write(tf_conn, first_ns, store.serialize_cdr(tf_msg, "tf2_msgs/msg/TFMessage"))
                for conn, t_ns, raw in reader.messages():
                    writer.write(conns[conn.id], t_ns, raw)
        replace_bag_folder(bag, out)
    print(f"{bag}: /tf_static with {len(transforms)} camera transform(s) added")
    return 0


if __name__ == "__main__":
    sys.exit(main())
