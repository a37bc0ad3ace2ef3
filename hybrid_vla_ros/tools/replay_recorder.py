"""What ``hybrid-vla replay`` receives from the nodes while it plays (:class:`Recorder`): the trajectories and the
per-frame timing (also written into the output bag), the nodes' /diagnostics, and what was played for the
pictures."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..ros.status import FrameTiming, PrefixStatus, StatusError, SuffixStatus, pipeline_status_name
from ..util.bags import BagMessage
from ..vehicle.open_loop import PlannedPath

SIDES = ("prefix", "suffix")
STATUS_OF = {"prefix": PrefixStatus, "suffix": SuffixStatus}


@dataclass(frozen=True)
class Statuses:
    """The pipeline status of both nodes of one namespace (ros/status.py), None for a node not heard from."""

    prefix: PrefixStatus | None = None
    suffix: SuffixStatus | None = None

    def of(self, node_name: str):
        """The status of node ``node_name`` ('<ns>/prefix_node' or '<ns>/suffix_node')."""
        return self.prefix if node_name.rsplit("/", 1)[-1] == "prefix_node" else self.suffix


@dataclass(frozen=True)
class PlayedOdometry:
    """One odometry message as the replay played it: ``loop`` (0-based), ``t_ns`` its receive time in the bag with
    the loop's offset (ns), ``msg`` the ``nav_msgs/msg/Odometry`` with its header stamp shifted as played."""

    loop: int
    t_ns: int
    msg: object


@dataclass
class Recorder:
    """What the replay node received, by camera stamp (ns)."""

    trajectories: dict[int, float] = field(default_factory=dict)  # stamp -> wall receive time (s)
    timings: dict[int, FrameTiming] = field(default_factory=dict)  # stamp -> the suffix's frame timing
    diagnostics: dict[str, list] = field(default_factory=dict)  # status name -> (key, value) pairs as received
    diagnostics_at: dict[str, float] = field(default_factory=dict)  # status name -> monotonic receive time (s)
    paths: dict[int, np.ndarray] = field(default_factory=dict)  # stamp -> (P, 3) time_from_start s, map x, y (m)
    odometry: list = field(default_factory=list)  # EgoState of each odometry message played (stamps as played)
    played_odometry: list[PlayedOdometry] = field(default_factory=list)  # the odometry messages as played
    first_camera: dict[int, BagMessage] = field(default_factory=dict)  # played stamp -> first camera's image
    reasoning: dict[int, str] = field(default_factory=dict)  # stamp -> the decoded text (a decoding model)
    planned: dict[int, PlannedPath] = field(default_factory=dict)  # stamp -> the trajectory, for the open-loop figures
    unreadable: dict[str, int] = field(default_factory=dict)  # why a trajectory is not in ``planned`` -> count
    lock: threading.Lock = field(default_factory=threading.Lock)
    _decoded: dict = field(default_factory=dict)  # status name -> (receive time, its decoded status)
    _output_subs: list = field(default_factory=list)  # record_outputs' subscriptions
    _marker_subs: list = field(default_factory=list)  # record_outputs' subscriptions to the RViz topics

    def on_diagnostics(self, msg) -> None:
        """/diagnostics callback (a DiagnosticArray): each status's key/values and when they arrived."""
        t = time.monotonic()
        with self.lock:
            for status in msg.status:
                self.diagnostics[status.name] = [(kv.key, kv.value) for kv in status.values]
                self.diagnostics_at[status.name] = t

    def statuses(self, ns: str) -> Statuses:
        """The latest pipeline status of each node in namespace ``ns`` (None for one not heard from)."""
        out = {}
        for side in SIDES:
            name = pipeline_status_name(f"{ns}/{side}_node")
            with self.lock:
                pairs, at = self.diagnostics.get(name), self.diagnostics_at.get(name)
                cached = self._decoded.get(name)
            if pairs is None:
                out[side] = None
            elif cached is not None and cached[0] == at:
                out[side] = cached[1]  # the playback loop asks per message: decode each report once
            else:
                try:
                    out[side] = STATUS_OF[side].from_key_values(pairs)
                except StatusError as e:
                    print(f"warning: cannot read the {side} node's /diagnostics: {e}", file=sys.stderr)
                    out[side] = None
                with self.lock:
                    self._decoded[name] = (at, out[side])
        return Statuses(**out)

    def fresh_statuses(self, ns: str, since: float, timeout: float = 10.0) -> Statuses:
        """The pipeline statuses of the nodes in namespace ``ns`` received after monotonic time ``since`` (each
        node publishes its status at 1 Hz), waiting up to ``timeout`` s; a node without one then has its latest
        (None if none came)."""
        names = [pipeline_status_name(f"{ns}/{side}_node") for side in SIDES]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(self.diagnostics_at.get(n, -1.0) > since for n in names):
                    break
            time.sleep(0.05)
        return self.statuses(ns)

    def record_outputs(self, node, bag, output_topic: str, timing_topic: str, reasoning_topic: str = "",
                       marker_topics: tuple[str, ...] = ()) -> None:
        """Subscribe ``node`` to the Trajectory topic, the suffix's frame timing (a DiagnosticArray per frame) and,
        for a decoding model, its ``reasoning_topic`` (StringStamped); each message is kept here by its stamp and
        written into ``bag`` (:class:`~.output_bag.OutputBag`). ``marker_topics``: the suffix's RViz topics
        (``~/debug/trajectory_markers``: MarkerArray; ``~/debug/reasoning_text``: Marker), written into ``bag`` at
        their stamps so a replay of it shows them in RViz."""
        from autoware_planning_msgs.msg import Trajectory
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rclpy.serialization import serialize_message

        from ..util.stamps import stamp_to_ns

        traj_conn = bag.add_topic(output_topic, "autoware_planning_msgs/msg/Trajectory")
        timing_conn = bag.add_topic(timing_topic, "diagnostic_msgs/msg/DiagnosticArray")

        def on_trajectory(msg):
            stamp = stamp_to_ns(msg.header.stamp)
            t_recv = time.monotonic()
            path = np.array([(p.time_from_start.sec + p.time_from_start.nanosec * 1e-9, p.pose.position.x,
                              p.pose.position.y) for p in msg.points]).reshape(-1, 3)
            try:
                planned, why = PlannedPath.from_message(msg), None
            except ValueError as err:
                planned, why = None, f"unreadable trajectory: {err}"
            with self.lock:
                self.trajectories[stamp] = t_recv
                self.paths[stamp] = path
                if planned is not None:
                    self.planned[stamp] = planned
                else:
                    self.unreadable[why] = self.unreadable.get(why, 0) + 1
            bag.write(traj_conn, stamp, serialize_message(msg))

        def on_timing(msg):
            stamp = stamp_to_ns(msg.header.stamp)
            try:
                timing = FrameTiming.from_key_values((kv.key, kv.value) for kv in msg.status[0].values)
            except StatusError as e:
                print(f"warning: frame timing stamped {stamp} ns: {e}", file=sys.stderr)
                timing = None
            if timing is not None:
                with self.lock:
                    self.timings[stamp] = timing
            bag.write(timing_conn, stamp, serialize_message(msg))

        self._output_subs = [
            node.create_subscription(Trajectory, output_topic, on_trajectory,
                                     QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)),
            node.create_subscription(DiagnosticArray, timing_topic, on_timing, 50)]
        if reasoning_topic:
            from autoware_internal_debug_msgs.msg import StringStamped

            reasoning_conn = bag.add_topic(reasoning_topic, "autoware_internal_debug_msgs/msg/StringStamped")

            def on_reasoning(msg):
                stamp = stamp_to_ns(msg.stamp)
                with self.lock:
                    self.reasoning[stamp] = msg.data
                bag.write(reasoning_conn, stamp, serialize_message(msg))

            self._output_subs.append(node.create_subscription(
                StringStamped, reasoning_topic, on_reasoning,
                QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)))

        for topic in marker_topics:
            self._record_markers(node, bag, topic)

    def _record_markers(self, node, bag, topic: str) -> None:
        """Write each message on ``topic`` (a MarkerArray ``.../trajectory_markers``, else a Marker) into ``bag``
        at its first marker's stamp."""
        from rclpy.serialization import serialize_message
        from visualization_msgs.msg import Marker, MarkerArray

        from ..util.stamps import stamp_to_ns

        array = topic.endswith("trajectory_markers")
        cls = MarkerArray if array else Marker
        conn = bag.add_topic(topic, f"visualization_msgs/msg/{cls.__name__}")

        def on_markers(msg):
            first = (msg.markers[0] if msg.markers else None) if array else msg
            if first is not None:
                bag.write(conn, stamp_to_ns(first.header.stamp), serialize_message(msg))

        self._marker_subs.append(node.create_subscription(cls, topic, on_markers, 10))

    def wait_outputs_matched(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` s until the subscriptions of :meth:`record_outputs` are each matched to a
        publisher (DDS discovery; messages published before that are not delivered). False if one was not."""
        deadline = time.monotonic() + timeout
        while not all(sub.get_publisher_count() >= 1 for sub in self._output_subs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def wait_for_answers(self, n_frames: int, stall_s: float = 3.0) -> None:
        """Let frames in flight finish: return when ``n_frames`` trajectories are in or none came for ``stall_s``."""
        last_count, last_change = -1, time.monotonic()
        while time.monotonic() - last_change < stall_s and len(self.trajectories) < n_frames:
            if len(self.trajectories) != last_count:
                last_count, last_change = len(self.trajectories), time.monotonic()
            time.sleep(0.05)
