"""The one place that builds ROS messages from core values: stamps, Autoware trajectories and candidates.

Imports message types only, not rclpy or torch. Field meanings follow ``TrajectoryPoint.msg``,
``autoware_internal_planning_msgs/msg/CandidateTrajectories.msg`` and ``builtin_interfaces`` Time / Duration.
"""

from __future__ import annotations

import uuid
from typing import Sequence

from autoware_internal_planning_msgs.msg import CandidateTrajectories, CandidateTrajectory, GeneratorInfo
from autoware_planning_msgs.msg import Trajectory, TrajectoryPoint
from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import Point, Pose, Quaternion
from std_msgs.msg import Header, String
from std_msgs.msg import ColorRGBA
from unique_identifier_msgs.msg import UUID
from visualization_msgs.msg import Marker, MarkerArray

from ..util.stamps import NS_PER_S, split_ns
from ..vehicle.trajectory import TrajectoryArrays, yaw_to_quaternion

__all__ = ["ns_to_stamp", "trajectory_to_msg", "pose_trajectory_to_msg", "generator_uuid",
           "candidate_trajectories_to_msg", "trajectory_markers_to_msg", "reasoning_marker_to_msg"]

def ns_to_stamp(ns: int) -> Time:
    """``builtin_interfaces/msg/Time`` of ``ns`` since the epoch.

    Raises ValueError for negative ``ns`` or seconds beyond int32 (2038), TypeError for a non-integer.
    """
    sec, nanosec = split_ns(ns, "stamp")
    return Time(sec=sec, nanosec=nanosec)


def trajectory_to_msg(arrays: TrajectoryArrays, stamp_ns: int, frame_id: str) -> Trajectory:
    """An ``autoware_planning_msgs/msg/Trajectory``, one point per point of ``arrays`` (``t`` rounded to the ns).

    Raises ValueError for a negative or out-of-range ``stamp_ns`` or a negative ``t``.
    """
    msg = Trajectory()
    msg.header.stamp = ns_to_stamp(stamp_ns)
    msg.header.frame_id = frame_id
    msg.points = _points(arrays)
    return msg


def pose_trajectory_to_msg(t_s, xy, yaw, stamp_ns: int, frame_id: str) -> Trajectory:
    """A Trajectory of poses only (``time_from_start`` and ``pose``; z 0, every velocity field 0), as
    autoware_planning_data_analyzer's ``/ground_truth/trajectory``: ``t_s`` (P,) s, ``xy`` (P, 2) m, ``yaw`` (P,)
    rad. Raises ValueError for a bad stamp, a negative time or a non-finite yaw."""
    msg = Trajectory()
    msg.header.stamp = ns_to_stamp(stamp_ns)
    msg.header.frame_id = frame_id
    points = []
    for t, (x, y), a in zip(t_s.tolist(), xy.tolist(), yaw.tolist()):
        sec, nanosec = split_ns(round(t * NS_PER_S), "time_from_start")
        qx, qy, qz, qw = yaw_to_quaternion(a)
        points.append(TrajectoryPoint(time_from_start=Duration(sec=sec, nanosec=nanosec),
                                      pose=Pose(position=Point(x=x, y=y, z=0.0),
                                                orientation=Quaternion(x=qx, y=qy, z=qz, w=qw))))
    msg.points = points
    return msg


def _points(arrays: TrajectoryArrays) -> list[TrajectoryPoint]:
    """One ``TrajectoryPoint`` per point of ``arrays``."""
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
    """``uuid5(NAMESPACE_URL, "ros2:" + fully_qualified_name)``: the same node name gives the same id everywhere.

    Raises ValueError for a name without a leading ``/``.
    """
    if not fully_qualified_name.startswith("/"):
        raise ValueError(f"{fully_qualified_name!r} is not a fully qualified node name (no leading '/')")
    return uuid.uuid5(GENERATOR_UUID_NAMESPACE, "ros2:" + fully_qualified_name)


def candidate_trajectories_to_msg(candidates: Sequence[TrajectoryArrays], stamp_ns: int, frame_id: str,
                                  generator_id: uuid.UUID, generator_name: str) -> CandidateTrajectories:
    """A ``CandidateTrajectories`` with one candidate per entry (in order) and one ``GeneratorInfo``.

    Raises ValueError as :func:`trajectory_to_msg`.
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


#: Colours (r, g, b) of the markers: the published trajectory, and each planner mode's candidate by mode index
#: (matplotlib's tab10 order, the published trajectory's cyan apart).
TRAJECTORY_RGB = (0.0, 0.9, 1.0)
MODE_RGB = ((0.12, 0.47, 0.71), (1.0, 0.5, 0.05), (0.17, 0.63, 0.17), (0.84, 0.15, 0.16), (0.58, 0.4, 0.74),
            (0.55, 0.34, 0.29))
#: Widths (m) of the trajectory lines and points in RViz.
LINE_WIDTH_M, POINT_SIZE_M = 0.3, 0.5


def _line_marker(arrays: TrajectoryArrays, header: Header, ns: str, rgb, alpha: float, width: float) -> Marker:
    """A LINE_STRIP through the trajectory's points (its ``z``), one colour."""
    m = Marker(header=header, ns=ns, id=0, type=Marker.LINE_STRIP, action=Marker.ADD)
    m.pose.orientation.w = 1.0
    m.scale.x = width
    m.color = ColorRGBA(r=rgb[0], g=rgb[1], b=rgb[2], a=alpha)
    m.points = [Point(x=x, y=y, z=z) for x, y, z in zip(arrays.x.tolist(), arrays.y.tolist(), arrays.z.tolist())]
    return m


def trajectory_markers_to_msg(selected: TrajectoryArrays, candidates: Sequence[TrajectoryArrays],
                              candidate_names: Sequence[str], candidate_modes: Sequence[int], stamp_ns: int,
                              frame_id: str) -> MarkerArray:
    """``~/debug/trajectory_markers``: a DELETEALL first (no stale candidate stays), then the published trajectory
    as a cyan line (ns ``trajectory``) with its points (ns ``trajectory_points``, spheres of ``POINT_SIZE_M``), and
    each candidate as a thinner line in its mode's colour (ns ``candidate/<name>``), all in ``frame_id`` at the
    camera stamp. Raises ValueError as :func:`trajectory_to_msg`."""
    header = Header(stamp=ns_to_stamp(stamp_ns), frame_id=frame_id)
    clear = Marker(header=header, action=Marker.DELETEALL)
    line = _line_marker(selected, header, "trajectory", TRAJECTORY_RGB, 1.0, LINE_WIDTH_M)
    dots = _line_marker(selected, header, "trajectory_points", TRAJECTORY_RGB, 1.0, POINT_SIZE_M)
    dots.type = Marker.SPHERE_LIST
    dots.scale.y = dots.scale.z = POINT_SIZE_M
    out = [clear, line, dots]
    for arrays, name, mode in zip(candidates, candidate_names, candidate_modes):
        out.append(_line_marker(arrays, header, f"candidate/{name}", MODE_RGB[mode % len(MODE_RGB)], 0.8,
                                LINE_WIDTH_M / 2))
    return MarkerArray(markers=out)


def reasoning_marker_to_msg(text: str, x: float, y: float, z: float, stamp_ns: int, frame_id: str,
                            height_m: float = 0.8, max_chars: int = 300) -> Marker:
    """``~/debug/reasoning_text``: the decoded text as a TEXT_VIEW_FACING marker ``height_m`` tall (text over
    ``max_chars`` cut with an ellipsis), at ``(x, y, z)`` m in ``frame_id`` (the suffix: 3 m above the ego pose)."""
    m = Marker(header=Header(stamp=ns_to_stamp(stamp_ns), frame_id=frame_id), ns="reasoning", id=0,
               type=Marker.TEXT_VIEW_FACING, action=Marker.ADD)
    m.pose.position = Point(x=float(x), y=float(y), z=float(z))
    m.pose.orientation.w = 1.0
    m.scale.z = height_m
    m.color = ColorRGBA(r=1.0, g=1.0, b=1.0, a=1.0)
    m.text = text if len(text) <= max_chars else text[: max_chars - 1] + "\u2026"
    return m
