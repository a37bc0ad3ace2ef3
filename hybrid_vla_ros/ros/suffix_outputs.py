"""The suffix node's outputs: the guarded trajectory, the candidate trajectories and each frame's timing."""
from __future__ import annotations

import math
import statistics
import time

from autoware_internal_debug_msgs.msg import StringStamped
from autoware_internal_planning_msgs.msg import CandidateTrajectories
from autoware_planning_msgs.msg import Trajectory
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import QoSProfile, ReliabilityPolicy
from visualization_msgs.msg import Marker, MarkerArray

from ..model.config import NAV_COMMANDS, takes_scene
from ..util.bags import read_bag
from ..vehicle.guard import GuardLimits
from ..vehicle.open_loop import LoggedPath, oracle_waypoints
from ..vehicle.output import guarded_outputs
from ..vehicle.trajectory import EgoState, model_track_to_base_link
from .diagnostics import NO_CLOCK_HINT, OK, diagnostic_array
from .status import FrameTiming
from .msg_conv import (candidate_trajectories_to_msg, generator_uuid, ns_to_stamp, reasoning_marker_to_msg,
                       trajectory_markers_to_msg, trajectory_to_msg)


def load_oracle(bag: str) -> LoggedPath:
    """The logged drive of rosbag2 folder ``bag`` (its ``/localization/kinematic_state``) for ``oracle_bag``.
    Raises ValueError naming the bag when it cannot be read or holds fewer than 2 usable odometry messages."""
    from nav_msgs.msg import Odometry
    from rclpy.serialization import deserialize_message

    try:
        messages = read_bag(bag)
    except Exception as e:  # rosbags raises several types for a bad bag
        raise ValueError(f"oracle_bag {bag!r} cannot be read: {e}") from e
    types = {m.msgtype for m in messages if m.topic == "/localization/kinematic_state"}
    if types - {"nav_msgs/msg/Odometry"}:
        raise ValueError(f"oracle_bag {bag!r}: /localization/kinematic_state is {', '.join(sorted(types))}, not "
                         "nav_msgs/msg/Odometry")
    odometry, unreadable = [], 0
    for m in messages:
        if m.topic == "/localization/kinematic_state":
            try:
                odometry.append(deserialize_message(m.raw, Odometry))
            except Exception:  # noqa: BLE001  (another type on the topic, or bad CDR: an unusable message)
                unreadable += 1
    path, dropped = LoggedPath.from_odometry(odometry)
    if path is None:
        raise ValueError(f"oracle_bag {bag!r} has {len(odometry) + unreadable} odometry message(s) on "
                         f"/localization/kinematic_state, {len(dropped) + unreadable} unusable: the oracle needs 2 "
                         "or more")
    return path


class TrajectoryOutputs:
    """A suffix node's lifecycle publishers: ``~/output/trajectory`` and ``~/output/candidate_trajectories`` (depth
    1, reliable; only what passes :func:`~hybrid_vla_ros.vehicle.output.guarded_outputs`, candidates under a
    per-node ``generator_id``) and ``~/debug/frame_timing`` (depth 10). ``too_old_in_a_row`` counts frames in a
    row dropped as ``guard_too_old``.
    """

    #: Frames in a row dropped as too old from which the suffix reports ERROR (:meth:`too_old`).
    TOO_OLD_FRAMES = 3

    def __init__(self, ctx):
        """``ctx``: the node's PartContext."""
        self._ctx = ctx
        node = ctx.ros
        self.guard: GuardLimits | None = None  # output guard limits, from the guard.* parameters at configure
        self.frames_out = 0
        self.candidates_out = 0  # candidates published on ~/output/candidate_trajectories
        self.candidate_msgs_out = 0  # CandidateTrajectories messages published
        self.too_old_in_a_row = 0
        self._traj_pub = node.create_lifecycle_publisher(
            Trajectory, "~/output/trajectory", QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
        self._timing_pub = node.create_lifecycle_publisher(DiagnosticArray, "~/debug/frame_timing", 10)
        # RViz: built only while something subscribes
        self._markers_pub = node.create_lifecycle_publisher(MarkerArray, "~/debug/trajectory_markers", 1)
        self.reasoning_text_pub = None  # ~/debug/reasoning_text, while configured with a model that decodes
        # ~/output/candidate_trajectories, while configured with publish_candidate_trajectories
        self.candidates_pub = None
        # ~/output/reasoning, while configured with a model that decodes
        self.reasoning_pub = None
        self.reasoning_out = 0
        self.generator_id = generator_uuid(node.get_fully_qualified_name())
        self.oracle: LoggedPath | None = None  # with oracle_bag: the logged drive that replaces the model's plan

    def configure(self, p, decodes: bool = False, oracle: LoggedPath | None = None) -> None:
        """Take the guard limits from parameters ``p`` and create the candidates publisher if asked for, and the
        reasoning publisher when the model ``decodes``; ``oracle`` (:func:`load_oracle`): the logged drive that
        replaces the model's plan, None for the model's."""
        self.guard = GuardLimits.from_params(p)
        self.too_old_in_a_row = 0
        self.oracle = oracle
        if decodes:
            self.reasoning_text_pub = self._ctx.ros.create_lifecycle_publisher(Marker, "~/debug/reasoning_text", 1)
            self.reasoning_pub = self._ctx.ros.create_lifecycle_publisher(
                StringStamped, "~/output/reasoning", QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        if p.publish_candidate_trajectories:
            self.candidates_pub = self._ctx.ros.create_lifecycle_publisher(
                CandidateTrajectories, "~/output/candidate_trajectories",
                QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))

    def release(self) -> None:
        """Destroy the candidates and reasoning publishers (idempotent)."""
        for name in ("candidates_pub", "reasoning_pub", "reasoning_text_pub"):
            pub = getattr(self, name)
            if pub is not None:
                self._ctx.ros.destroy_lifecycle_publisher(pub)
                setattr(self, name, None)

    def publish_reasoning(self, result) -> None:
        """Publish frame ``result``'s decoded text on ``~/output/reasoning``, stamped with its camera stamp (as
        alpamayo-autoware publishes its chain of causation); nothing for a frame without a decode."""
        if self.reasoning_pub is None or result.decode is None:
            return
        msg = StringStamped()
        msg.stamp = ns_to_stamp(result.meta.stamp_ns)
        msg.data = result.decode.text
        self.reasoning_pub.publish(msg)
        self.reasoning_out += 1

    def publish(self, result, ego: EgoState, odometry_wait_ms: float) -> bool:
        """Publish what frame ``result`` may, placed with ``ego`` (the pose at its camera stamp); True when the
        trajectory was published. For RViz, while subscribed: the markers of what was published and a decoded
        text 3 m above ``ego``."""
        ctx, node, p = self._ctx, self._ctx.ros, self._ctx.settings()
        stamp = result.meta.stamp_ns
        text_pub = self.reasoning_text_pub
        if result.decode is not None and text_pub is not None and text_pub.get_subscription_count():
            text_pub.publish(reasoning_marker_to_msg(result.decode.text, ego.x, ego.y, ego.z + 3.0, stamp,
                                                     p.output_frame))
        now_ns = node.get_clock().now().nanoseconds
        modes, waypoints = result.modes, result.waypoints
        names = NAV_COMMANDS if modes is not None and len(modes) == len(NAV_COMMANDS) else ()
        origin = p.model_frame_origin[:2]
        to_base_link = (  # the published planners plan the model frame origin's track
            (lambda w: model_track_to_base_link(w, origin)) if takes_scene(ctx.runner().cfg) else None)
        if self.oracle is not None:  # the sanity oracle: the logged future instead of the model's plan
            cfg = ctx.runner().cfg
            try:
                waypoints = oracle_waypoints(self.oracle, ego, cfg.n_waypoints, cfg.waypoint_dt_s)
            except ValueError as e:
                ctx.drop("oracle_no_logged_future", f"oracle_bag: {e}")
                return False
            modes, names, to_base_link = None, (), None
        out = guarded_outputs(waypoints, modes, result.mode, ctx.runner().cfg.waypoint_dt_s, ego,
                              p.wheelbase_m, self.guard, stamp, now_ns,
                              candidates=self.candidates_pub is not None, mode_names=names,
                              to_base_link=to_base_link)
        for cause, message in out.drops:
            sim = cause == "guard_no_clock" and node.get_parameter("use_sim_time").value
            ctx.drop(cause, message + (f" ({NO_CLOCK_HINT})" if sim else ""))
        if any(cause == "guard_too_old" for cause, _ in out.drops):
            self.too_old_in_a_row += 1
        if out.selected is None:
            return False
        violations = out.violations
        if not violations:  # the output guard: an invalid trajectory is never published
            self._traj_pub.publish(trajectory_to_msg(out.selected, stamp, p.output_frame))
        t_publish_ns = time.monotonic_ns()
        if out.candidates:
            self.candidates_pub.publish(candidate_trajectories_to_msg(
                out.candidates, stamp, p.output_frame, self.generator_id, node.get_fully_qualified_name()))
            self.candidates_out += len(out.candidates)
            self.candidate_msgs_out += 1
        if violations:
            return False
        if self._markers_pub.get_subscription_count():
            self._markers_pub.publish(trajectory_markers_to_msg(
                out.selected, out.candidates if self.candidates_pub is not None else [],
                [names[i] if i < len(names) else str(i) for i in out.candidate_modes], out.candidate_modes, stamp,
                p.output_frame))
        self.frames_out += 1
        self.too_old_in_a_row = 0
        self._publish_timing(result, odometry_wait_ms, t_publish_ns)
        return True

    def too_old(self) -> str:
        """"" unless :data:`TOO_OLD_FRAMES` frames in a row were dropped as too old, else the cause and remedy."""
        if self.too_old_in_a_row < self.TOO_OLD_FRAMES:
            return ""
        limit = self.guard.max_age_s if self.guard is not None else float("nan")
        return (f"the last {self.too_old_in_a_row} frames were older than guard.max_age_s ({limit:.2f} s) when "
                "planned, and dropped as too old: no trajectory comes out. The camera images reach the prefix late "
                "(its /diagnostics names the camera: large raw images need the large-data DDS profile in the "
                "publishers' environment, the compressed transport or a shared-memory RMW, docs/deployment.md "
                "'Large images'), or the prefix and suffix together take longer than the limit")

    def _publish_timing(self, result, odometry_wait_ms: float, t_publish_ns: int) -> None:
        # CLOCK_MONOTONIC instants (ns, system-wide): a process on this host can lay frames on one timeline.
        t = FrameTiming(ego_wait_ms=result.meta.timings.ego_wait_ms, preprocess_ms=result.preprocess_ms,
                        prefix_ms=result.prefix_ms, handoff_ms=result.handoff_ms,
                        suffix_ms=result.suffix_ms, odometry_wait_ms=odometry_wait_ms,
                        t_prefix_start_ns=result.t_prefix_start_ns, t_write_start_ns=result.meta.t_write_start_ns,
                        t_ready_ns=result.t_ready_ns, t_suffix_end_ns=result.t_suffix_end_ns,
                        t_publish_ns=t_publish_ns, **_decode_timing(result.decode))
        for stage, ms in t.stage_ms().items():
            if not math.isnan(ms):  # a stage this frame's producer did not time (ego_wait without ego state)
                self._ctx.times.add(stage, ms)
        timing = diagnostic_array(self._ctx.ros, "frame_timing", OK, f"seq {result.meta.seq}", t.key_values())
        timing.header.stamp = ns_to_stamp(result.meta.stamp_ns)
        self._timing_pub.publish(timing)


def _decode_timing(decode) -> dict:
    """A frame's decode figures for :class:`~.status.FrameTiming` (medians, ms); {} without a decode."""
    if decode is None:
        return {}

    def median(values) -> float:
        return statistics.median(values) if values else math.nan

    trips = [w - p for w, p in zip(decode.step_wait_ms, decode.prefix_token_ms)]
    return {"decode_tokens": len(decode.tokens), "prefix_token_ms": median(decode.prefix_token_ms),
            "suffix_token_ms": median(decode.suffix_token_ms), "decode_round_trip_ms": median(trips)}
