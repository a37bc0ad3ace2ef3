#!/usr/bin/env python3
"""Rewrite a bag's nav_msgs/Odometry twist from the parent frame into the child frame (REP 105), in place.

    .venv/bin/python scripts/odometry_twist_to_base_link.py data/dgp_scene02_6cam_mcap \
        --topic /localization/kinematic_state

nav_msgs/msg/Odometry.msg: "The twist in this message should be specified in the coordinate frame given by the
child_frame_id" (base_link), as Autoware's /localization/kinematic_state is. A bag built from world-frame
velocities (the embedded DGP bag was: DGP gives the LiDAR's velocity in the world frame) carries them in
``header.frame_id`` instead. This rotates both twist vectors by the inverse of the pose's orientation,
``v_child = R(q)^T v_parent``, and leaves every other message and field (covariances included) byte for byte as
it was. The bag is rewritten with rosbags under the same directory name, storage and metadata version; a message
whose twist is already in the child frame cannot be told apart, so run it once per bag.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from _bag_folder import replace_bag_folder  # scripts/ is on sys.path when a script runs


def rotation_matrix(x: float, y: float, z: float, w: float) -> np.ndarray:
    """The 3 x 3 rotation matrix of a unit quaternion (x, y, z, w) (Hamilton convention, as tf2 and
    geometry_msgs/Quaternion); the quaternion is normalised first. Raises ValueError for a (near) zero one."""
    q = np.array([x, y, z, w], dtype=np.float64)
    norm = np.linalg.norm(q)
    if not norm > 1e-9:
        raise ValueError("zero quaternion has no orientation")
    x, y, z, w = q / norm
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bag", type=Path, help="rosbag2 directory (sqlite3 or mcap)")
    parser.add_argument("--topic", default="/localization/kinematic_state")
    args = parser.parse_args(argv)

    from rosbags.highlevel import AnyReader
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    bag = args.bag.resolve()
    with tempfile.TemporaryDirectory(dir=bag.parent) as tmp:
        out = Path(tmp) / bag.name
        with AnyReader([bag], default_typestore=store) as reader:
            storage = StoragePlugin.MCAP if any(p.suffix == ".mcap" for p in bag.iterdir()) else StoragePlugin.SQLITE3
            rewritten = 0
            with Writer(out, version=8, storage_plugin=storage) as writer:
                conns = {c.id: writer.add_connection(c.topic, c.msgtype, typestore=store) for c in reader.connections}
                for conn, t_ns, raw in reader.messages():
                    if conn.topic == args.topic and conn.msgtype == "nav_msgs/msg/Odometry":
                        msg = reader.deserialize(raw, conn.msgtype)
                        q = msg.pose.pose.orientation
                        r_t = rotation_matrix(q.x, q.y, q.z, q.w).T
                        for vec in (msg.twist.twist.linear, msg.twist.twist.angular):
                            vec.x, vec.y, vec.z = (float(v) for v in r_t @ np.array([vec.x, vec.y, vec.z]))
                        raw = store.serialize_cdr(msg, conn.msgtype)
                        rewritten += 1
                    writer.write(conns[conn.id], t_ns, raw)
        if not rewritten:
            print(f"no nav_msgs/msg/Odometry on {args.topic} in {bag}: nothing rewritten", file=sys.stderr)
            return 1
        replace_bag_folder(bag, out)
    print(f"{bag}: {rewritten} Odometry twist(s) on {args.topic} rotated into the child frame")
    return 0


if __name__ == "__main__":
    sys.exit(main())
