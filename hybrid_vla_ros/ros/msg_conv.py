"""The one place that builds ROS messages from core values: stamps, Autoware trajectories and candidates.

Imports message types only (``builtin_interfaces``, ``geometry_msgs``, ``std_msgs``, ``unique_identifier_msgs``,
``autoware_planning_msgs``, ``autoware_internal_planning_msgs``), not rclpy and not torch. Field meanings
follow ``autoware_planning_msgs/msg/TrajectoryPoint.msg``, ``autoware_internal_planning_msgs/msg/
CandidateTrajectories.msg`` (and its ``CandidateTrajectory``, ``GeneratorInfo``) and
``builtin_interfaces/msg/Time.msg`` / ``Duration.msg`` (``int32 sec``, ``uint32 nanosec``).
"""

from __future__ import annotations

import uuid
from typing import Sequence

from autoware_internal_planning_msgs.msg import CandidateTrajectories, CandidateTrajectory, GeneratorInfo
from autoware_planning_msgs.msg import Trajectory, TrajectoryPoint
from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import Point, Pose, Quaternion
from std_msgs.msg import Header, String
from unique_identifier_msgs.msg import UUID

from ..util.stamps import NS_PER_S, split_ns
from ..vehicle.trajectory import TrajectoryArrays

__all__ = ["ns_to_stamp", "trajectory_to_msg", "generator_uuid", "candidate_trajectories_to_msg"]

def ns_to_stamp(ns: int) -> Time:
    """``builtin_interfaces/msg/Time`` for ``ns`` nanoseconds since the epoch (``sec = ns // 1e9``,
    ``nanosec = ns % 1e9``).

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
    msg.points = _points(arrays)
    return msg


def _points(arrays: TrajectoryArrays) -> list[TrajectoryPoint]:
    """One ``TrajectoryPoint`` per point of ``arrays`` (see :func:`trajectory_to_msg`). Raises ValueError."""
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
    return points


#: Namespace of :func:`generator_uuid` (RFC 4122 name-based UUIDs, SHA-1).
GENERATOR_UUID_NAMESPACE = uuid.NAMESPACE_URL


def generator_uuid(fully_qualified_name: str) -> uuid.UUID:
    """The fixed ``generator_id`` of the trajectory generator that is the node ``fully_qualified_name``.

    ``uuid.uuid5(uuid.NAMESPACE_URL, "ros2:" + fully_qualified_name)``, e.g. ``/hybrid_vla/suffix_node`` ->
    ``ros2:/hybrid_vla/suffix_node``: the same node name gives the same id on every start and machine, two
    deployments in different namespaces get different ones. Raises ValueError for a name without a leading
    ``/`` (not fully qualified).
    """
    if not fully_qualified_name.startswith("/"):
        raise ValueError(f"{fully_qualified_name!r} is not a fully qualified node name (no leading '/')")
    return uuid.uuid5(GENERATOR_UUID_NAMESPACE, "ros2:" + fully_qualified_name)


def candidate_trajectories_to_msg(candidates: Sequence[TrajectoryArrays], stamp_ns: int, frame_id: str,
                                  generator_id: uuid.UUID, generator_name: str) -> CandidateTrajectories:
    """Build an ``autoware_internal_planning_msgs/msg/CandidateTrajectories`` from one generator's candidates.

    Args:
        candidates: C >= 0 trajectories (map frame, SI units; see :class:`TrajectoryArrays`), in the order
            they are to appear.
        stamp_ns: ``header.stamp`` of every candidate in ns (int >= 0), the camera stamp of the frame.
        frame_id: ``header.frame_id`` of every candidate (``map``).
        generator_id: the generator's UUID (:func:`generator_uuid`), each candidate's ``generator_id``.
        generator_name: ``generator_info[0].generator_name.data``.

    Returns:
        CandidateTrajectories with one ``CandidateTrajectory`` (header, generator_id, ``points`` built as
        :func:`trajectory_to_msg` builds them) per candidate and one ``GeneratorInfo`` (generator_id,
        generator_name).

    Raises:
        ValueError: negative or out-of-range ``stamp_ns``, a negative ``t``.
    """
    stamp = ns_to_stamp(stamp_ns)
    msg = CandidateTrajectories()
    msg.candidate_trajectories = [
        CandidateTrajectory(header=Header(stamp=stamp, frame_id=frame_id),
                            generator_id=UUID(uuid=list(generator_id.bytes)), points=_points(arrays))
        for arrays in candidates]
    msg.generator_info = [GeneratorInfo(generator_id=UUID(uuid=list(generator_id.bytes)),
                                        generator_name=String(data=generator_name))]
    return msg
