"""What the replay tests check on a `hybrid-vla replay` output: the published Trajectories against a reference's
waypoints, placed with the ego pose the suffix uses (the bag's odometry at the camera stamp)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def published_and_odometry(out: Path, bag: Path) -> tuple[list, object]:
    """(the Trajectory messages in ``out/trajectories``, an OdometryBuffer of the bag's kinematic state)."""
    from rosbags.highlevel import AnyReader

    from hybrid_vla_ros.tools.output_bag import typestore
    from hybrid_vla_ros.util.bags import read_bag
    from hybrid_vla_ros.vehicle.odometry import OdometryBuffer
    from hybrid_vla_ros.vehicle.trajectory import ego_state_from_odometry

    store = typestore()
    odometry = OdometryBuffer()
    for m in read_bag(bag):
        if m.topic == "/localization/kinematic_state":
            odometry.add(ego_state_from_odometry(store.deserialize_cdr(m.raw, m.msgtype)))
    with AnyReader([Path(out) / "trajectories"], default_typestore=store) as reader:
        conns = [c for c in reader.connections if c.msgtype == "autoware_planning_msgs/msg/Trajectory"
                 and c.topic != "/ground_truth/trajectory"]  # the published ones, not the logged drive
        published = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages(connections=conns)]
    return published, odometry


def stamp_ns(msg) -> int:
    return msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec


def assert_trajectory_matches(traj, waypoints: np.ndarray, dt_s: float, odometry, tol_m: float = 1e-4) -> None:
    """``traj``'s points equal ``waypoints`` (N, 2) m, ego frame, placed at the odometry pose of its stamp
    (wheelbase 2.79 m, the suffix node's default), within ``tol_m``; every speed finite."""
    from hybrid_vla_ros.vehicle.trajectory import waypoints_to_trajectory

    ego, _ = odometry.pose_at(stamp_ns(traj), int(1e9))
    expected = waypoints_to_trajectory(waypoints, dt_s, ego, 2.79)
    got = np.array([[p.pose.position.x, p.pose.position.y] for p in traj.points])
    assert np.abs(got - np.stack([expected.x, expected.y], axis=1)).max() <= tol_m
    assert all(math.isfinite(p.longitudinal_velocity_mps) for p in traj.points)
