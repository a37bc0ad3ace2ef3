"""The one place that builds ROS messages from core values: stamps and Autoware trajectories.

Imports message types only (``builtin_interfaces``, ``geometry_msgs``, ``autoware_planning_msgs``), not
rclpy and not torch. Field meanings follow ``autoware_planning_msgs/msg/TrajectoryPoint.msg`` and
``builtin_interfaces/msg/Time.msg`` / ``Duration.msg`` (``int32 sec``, ``uint32 nanosec``).
"""

from __future__ import annotations

from autoware_planning_msgs.msg import Trajectory, TrajectoryPoint
from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import Point, Pose, Quaternion

from ..util.stamps import NS_PER_S, split_ns
from ..vehicle.trajectory import TrajectoryArrays

__all__ = ["ns_to_stamp", "trajectory_to_msg"]

def ns_to_stamp(ns: int) -> Time:
    """``builtin_interfaces/msg/Time`` for ``ns`` nanoseconds since the epoch (``sec = ns // 1e9``, ``nanosec = ns % 1e9``).

    Raises:
        ValueError: negative ``ns`` or seconds beyond int32 (year 2038).
        TypeError: ``ns`` is not an integer (use ``int(...)``; floats lose nanoseconds).
    """
    sec, nanosec = split_ns(ns, "stamp")
    return Time(sec=sec, nanosec=nanosec)


def trajectory_to_msg(arrays: TrajectoryArrays, stamp_ns: int, frame_id: str) -> Trajectory:
    """Build an ``autoware_planning_msgs/msg/Trajectory`` from :class:`TrajectoryArrays`.

    Args:
        arrays: P points (map frame, SI units; see :class:`TrajectoryArrays`).
        stamp_ns: ``header.stamp`` in ns (int >= 0), normally the camera stamp the plan was made from.
        frame_id: ``header.frame_id``, the frame of the poses (``map``).

    Returns:
        Trajectory with ``header`` set and one ``TrajectoryPoint`` per point, every field filled:
        ``time_from_start`` (sec/nanosec from ``t``, rounded to the nearest ns), ``pose`` (position
        x/y/z, orientation qx/qy/qz/qw), ``longitudinal_velocity_mps`` (v), ``lateral_velocity_mps``
        (lat_v), ``acceleration_mps2`` (acc), ``heading_rate_rps`` (heading_rate),
        ``front_wheel_angle_rad`` and ``rear_wheel_angle_rad`` (float32 on the wire).

    Raises:
        ValueError: negative or out-of-range ``stamp_ns``, a negative ``t``.
    """
    msg = Trajectory()
    msg.header.stamp = ns_to_stamp(stamp_ns)
    msg.header.frame_id = frame_id
    columns = zip(
        arrays.t.tolist(), arrays.x.tolist(), arrays.y.tolist(), arrays.z.tolist(),
        arrays.qx.tolist(), arrays.qy.tolist(), arrays.qz.tolist(), arrays.qw.tolist(),
        arrays.v.tolist(), arrays.lat_v.tolist(), arrays.acc.tolist(), arrays.heading_rate.tolist(),
        arrays.front_wheel_angle.tolist(), arrays.rear_wheel_angle.tolist(),
    )
    points = []
    for t, x, y, z, qx, qy, qz, qw, v, lat_v, acc, rate, front, rear in columns:
        sec, nanosec = split_ns(round(t * NS_PER_S), "time_from_start")
        points.append(
            TrajectoryPoint(
                time_from_start=Duration(sec=sec, nanosec=nanosec),
                pose=Pose(position=Point(x=x, y=y, z=z), orientation=Quaternion(x=qx, y=qy, z=qz, w=qw)),
                longitudinal_velocity_mps=v,
                lateral_velocity_mps=lat_v,
                acceleration_mps2=acc,
                heading_rate_rps=rate,
                front_wheel_angle_rad=front,
                rear_wheel_angle_rad=rear,
            )
        )
    msg.points = points
    return msg
