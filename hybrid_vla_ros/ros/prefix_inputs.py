"""The prefix node's inputs: the cameras and, for a checkpoint with ``ego_state_input``, the ego state.

Callbacks only read stamps, count and buffer; decoding and inference run on the worker thread (:mod:`.prefix_worker`).
Every bad or discarded message is a drop counted by cause.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from geometry_msgs.msg import AccelWithCovarianceStamped
from nav_msgs.msg import Odometry
from rclpy.clock import Clock, ClockType
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from ..util.bags import played_topic
from ..util.stamps import header_stamp_ns
from ..vehicle.ego_input import EgoInputBuffer, acceleration_sample_from_msg, kinematic_sample_from_odometry
from ..vehicle.odometry import OdometryBuffer
from ..vehicle.trajectory import EgoState, ego_state_from_odometry
from ..vehicle.sync import CameraSynchronizer, SyncedSet

#: Log text of each synchronizer drop cause (vehicle.sync.DROP_CAUSES).
SYNC_DROP_REASONS = {
    "out_of_order": "header stamp older than this camera's previous message (stamps must increase per camera)",
    "duplicate": "header stamp equal to this camera's previous message",
    "unsynced": "camera messages without a partner on every camera within sync_tolerance_ms were discarded",
    "queue_overflow": "a camera sent nothing for a while: the oldest message queued for it was pushed out",
    "time_jump": "header stamp more than 1 s older than this camera's previous one (clock reset, bag restart "
                 "or earlier stamps in the future): synchronization restarted (this camera alone when the "
                 "others are on its new timeline), queued messages discarded",
}
#: Log text of each ego-state drop cause (vehicle.ego_input.LOOKUP_CAUSES); {age} is max_ego_state_age_s.
EGO_DROP_REASONS = {
    "no_ego_state": "no kinematic state received on ~/input/kinematic_state (this checkpoint takes the ego state)",
    "stale_ego_state": "no kinematic state within {age} s of the camera stamp",
    "no_acceleration": "no acceleration on ~/input/acceleration within {age} s of the camera stamp, and fewer than "
                       "two kinematic states within it to take the speed difference",
    "no_odometry": "no pose received on ~/input/kinematic_state (the query heads' memory moves with the ego pose)",
    "stale_odometry": "no pose on ~/input/kinematic_state within {age} s of the camera stamp",
}


class CameraInputs:
    """The camera subscriptions of a prefix node, synchronized undecoded by header stamp
    (:class:`~..vehicle.sync.CameraSynchronizer`); each SyncedSet of ``(transport, msg)`` goes to ``on_frame``.

    Also watches the inputs: silent cameras (:meth:`silence`), late images (:meth:`lateness`), and frames already
    older than the suffix's frame age limit when complete (:meth:`too_old`, each to be dropped as
    ``guard_too_old``).
    """

    #: A camera silent for this many of the others' message periods (and at least SILENT_MIN_S) is named.
    SILENT_PERIODS = 3
    SILENT_MIN_S = 0.5
    #: Fraction of the suffix's frame age limit (guard.max_age_s) past which a camera's median arrival delay is
    #: late: large raw images over an untuned DDS transport arrive seconds late (docs/deployment.md).
    LATE_FRACTION = 0.5
    #: Images per camera whose median arrival delay judges it late as soon as the second is; a camera also stays
    #: late while its median over :data:`DELAY_WINDOW` (the one /diagnostics reports) is, so a report never shows
    #: a late median with OK.
    LATE_WINDOW = 3
    #: The frame age limit assumed while no suffix announced one: the output guard's default guard.max_age_s.
    DEFAULT_AGE_LIMIT_S = 1.0
    #: Arrival delays kept per camera.
    DELAY_WINDOW = 8
    #: Synchronized frames in a row already too old when complete, from which the prefix reports ERROR.
    TOO_OLD_FRAMES = 3
    DOCS_LARGE_IMAGES = "docs/deployment.md, 'Large images'"
    #: What to do about late large images, in the messages.
    REMEDY = ("large raw images need a DDS transport made for them: the package's large-data profile "
              "(config/fastdds_shm_large.xml as FASTDDS_DEFAULT_PROFILES_FILE) in the camera publishers' own "
              "environment, the compressed image transport, or a shared-memory RMW (" + DOCS_LARGE_IMAGES + ")")

    def __init__(self, ctx, on_frame: Callable[[SyncedSet], None],
                 frame_age_limit: Callable[[], float | None] = lambda: None):
        """``ctx``: the node's PartContext; ``frame_age_limit``: the suffix's limit now (s; None while unknown)."""
        self._ctx = ctx
        self._on_frame = on_frame
        self._frame_age_limit = frame_age_limit
        self._sync: CameraSynchronizer | None = None
        self.subscriptions = []
        self.frames_in = 0
        self.frames_synced = 0
        self._topics: list[str] = []
        self._last_ns: list[int] = []  # per camera: CLOCK_MONOTONIC ns of its last message (0: none)
        self._gaps_ns: deque = deque(maxlen=32)  # intervals between a camera's consecutive messages
        self._synced_ns: deque = deque(maxlen=16)  # arrival of synchronized frames
        self._delays_ns: list[deque] = []  # per camera: node clock at arrival - header stamp, recent messages
        self._late_said: frozenset[int] = frozenset()  # the cameras last logged as late
        #: Synchronized frames in a row that were older than the frame age limit when complete.
        self.too_old_in_a_row = 0
        self._too_old_said = False
        self._silent_said: dict[int, int] = {}  # camera -> when it was said to be silent (CLOCK_MONOTONIC ns)
        self._qos_timer = None
        self._reliability_mode = "auto"
        self._transports: list[str] = []
        self._topics_asked: list[str] = []
        #: Reliability of each camera subscription now (rclpy ReliabilityPolicy).
        self.reliabilities: list = []
        self._generation: list[int] = []  # per camera: the generation of its current subscription
        self._delivered: list[bool] = []  # per camera: the current subscription has delivered a message
        self._retiring: list = []  # (camera, old subscription, CLOCK_MONOTONIC deadline ns) kept while switching
        self._last_stamp: list[int] = []  # per camera: the stamp of its last message (-1: none)

    def start(self, topics: list[str], transports: list[str], tolerance_ms: float, reliability: str = "auto") -> None:
        """Subscribe camera i at ``topics[i]`` (Image) or ``topics[i]/compressed`` with a new synchronizer
        (``tolerance_ms``); ``reliability`` 'auto' follows the publishers every second (:meth:`_match_publishers`)."""
        self._reliability_mode = reliability
        self._sync = CameraSynchronizer(len(topics), int(tolerance_ms * 1e6))
        self._topics_asked = [played_topic(t, tr) for t, tr in zip(topics, transports)]
        self._topics = list(self._topics_asked)  # resolved (remapped) names once subscribed
        self._last_ns = [0] * len(topics)
        self._gaps_ns.clear()
        self._synced_ns.clear()
        self._delays_ns = [deque(maxlen=self.DELAY_WINDOW) for _ in topics]
        self.too_old_in_a_row = 0
        self._started_ns = time.monotonic_ns()
        self._transports = list(transports)
        first = ReliabilityPolicy.RELIABLE if reliability == "reliable" else ReliabilityPolicy.BEST_EFFORT
        self.reliabilities = [first] * len(topics)
        self._generation, self._delivered = [0] * len(topics), [False] * len(topics)
        self._last_stamp, self._retiring, self._silent_said = [-1] * len(topics), [], {}
        self.subscriptions = [self._subscribe(cam, first) for cam in range(len(topics))]
        self._topics = [sub.topic_name for sub in self.subscriptions]
        if reliability == "auto":
            self._match_publishers()
            # on the steady clock: with use_sim_time a /clock that has not moved yet (a replay before it plays, a
            # paused bag) would stop a ROS-time timer, and the switch to reliable would wait for the first frames
            self._qos_timer = self._ctx.ros.create_timer(1.0, self._match_publishers,
                                                         clock=Clock(clock_type=ClockType.STEADY_TIME))

    #: How long the previous subscription of a camera stays while a new one (other reliability) is matched (s).
    SWITCH_OVERLAP_S = 3.0

    def _subscribe(self, cam: int, reliability: ReliabilityPolicy):
        """Camera ``cam``'s subscription (current generation) with ``reliability``, keep last 5, volatile."""
        qos = QoSProfile(depth=qos_profile_sensor_data.depth, history=HistoryPolicy.KEEP_LAST, reliability=reliability,
                         durability=qos_profile_sensor_data.durability)
        kind = CompressedImage if self._transports[cam] == "compressed" else Image
        return self._ctx.ros.create_subscription(kind, self._topics_asked[cam],
                                              self._callback(cam, self._transports[cam], self._generation[cam]), qos)

    def _match_publishers(self) -> None:
        """``camera_reliability: auto``: re-subscribe each camera reliable when all its publishers are (DDS then
        repairs a large image's lost fragments), else best effort, and log the switch.

        No frame is lost: the old subscription stays until the new one delivers, or SWITCH_OVERLAP_S passed and
        the new one is matched as widely; a message both deliver is taken once.
        """
        now = time.monotonic_ns()
        keep = []
        for cam, old, deadline in self._retiring:
            # past the deadline only once the new subscription is matched to the publishers too: until then
            # the old one is the camera's only way in (discovery can take seconds on a loaded machine)
            matched = self.subscriptions[cam].get_publisher_count() >= max(1, old.get_publisher_count())
            if self._delivered[cam] or (now >= deadline and matched):
                self._ctx.ros.destroy_subscription(old)
            else:
                keep.append((cam, old, deadline))
        self._retiring = keep
        for cam, sub in enumerate(self.subscriptions):
            topic = self._topics[cam]
            try:
                offered = [info.qos_profile.reliability for info in self._ctx.ros.get_publishers_info_by_topic(topic)]
            except Exception as e:  # noqa: BLE001 - a graph query must never stop the executor
                if self._ctx.log_every("camera_qos"):
                    self._ctx.logger.warning(f"camera {cam} ({topic}): cannot read its publishers' QoS: {e}")
                continue
            wanted = (ReliabilityPolicy.RELIABLE if offered and all(r == ReliabilityPolicy.RELIABLE for r in offered)
                      else ReliabilityPolicy.BEST_EFFORT)
            if not offered or wanted == self.reliabilities[cam]:
                continue
            for r in [r for r in self._retiring if r[0] == cam]:  # a switch back during a switch: the oldest goes
                self._ctx.ros.destroy_subscription(r[1])
                self._retiring.remove(r)
            self._retiring.append((cam, sub, now + int(self.SWITCH_OVERLAP_S * 1e9)))
            self._generation[cam] += 1
            self._delivered[cam] = False
            self.subscriptions[cam] = self._subscribe(cam, wanted)
            self.reliabilities[cam] = wanted
            self._ctx.logger.info(
                f"camera {cam} ({topic}): subscribed {wanted.name.lower()} to match its {len(offered)} "
                f"publisher(s) ({', '.join(sorted({r.name.lower() for r in offered}))})")

    def stop(self) -> None:
        """Unsubscribe (idempotent)."""
        if self._qos_timer is not None:
            self._ctx.ros.destroy_timer(self._qos_timer)
            self._qos_timer = None
        for sub in self.subscriptions + [old for _cam, old, _deadline in self._retiring]:
            self._ctx.ros.destroy_subscription(sub)
        self.subscriptions, self._retiring = [], []

    def frame_period_ns(self) -> int | None:
        """Median interval between synchronized frames' arrivals (ns), None before two."""
        if len(self._synced_ns) < 2:
            return None
        arrivals = list(self._synced_ns)
        gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))
        return gaps[len(gaps) // 2]

    def camera_delays_ms(self) -> list[tuple[float, float] | None]:
        """Per camera: (median, largest) arrival delay in ms (node clock at arrival minus header stamp, the last
        :data:`DELAY_WINDOW`), None without a sample."""
        out = []
        for delays in self._delays_ns:
            ordered = sorted(delays)
            out.append((ordered[len(ordered) // 2] / 1e6, ordered[-1] / 1e6) if ordered else None)
        return out

    def arrival_delay_ms(self) -> tuple[int, float, float] | None:
        """(camera with the largest median delay, its median, the largest delay of any camera) ms, or None."""
        delays = [(d[0], cam) for cam, d in enumerate(self.camera_delays_ms()) if d is not None]
        if not delays:
            return None
        p50, cam = max(delays)
        return cam, p50, max(d[1] for d in self.camera_delays_ms() if d is not None)

    def _recent_median_ns(self, cam: int) -> float:
        recent = sorted(list(self._delays_ns[cam])[-self.LATE_WINDOW:])
        return recent[len(recent) // 2] if recent else 0.0

    def _age_limit_s(self) -> float:
        limit = self._frame_age_limit()
        return limit if limit else self.DEFAULT_AGE_LIMIT_S

    def lateness(self) -> str:
        """"" while images arrive in time, else a sentence naming each late camera and the remedy; changes are
        logged."""
        limit = self._age_limit_s()
        delays = self.camera_delays_ms()
        late = {cam: d for cam, d in enumerate(delays)
                if d is not None and max(self._recent_median_ns(cam), d[0] * 1e6) > self.LATE_FRACTION * limit * 1e9}
        named = ", ".join(f"camera {cam} ({self._topics[cam]}) {d[0] / 1e3:.2f} s (up to {d[1] / 1e3:.2f} s)"
                          for cam, d in sorted(late.items()))
        if frozenset(late) != self._late_said:
            if late:
                self._ctx.logger.warning(f"camera images arrive late after their stamp (median): {named}; "
                                         f"see {self.DOCS_LARGE_IMAGES}")
            elif self._late_said:
                self._ctx.logger.info("camera images arrive in time again")
            self._late_said = frozenset(late)
        if not late:
            return ""
        return (f"images arrive late after their header stamp (median of the last {self.DELAY_WINDOW}): {named}, "
                f"over half the suffix's frame age limit ({limit:.2f} s): its frames are about to be dropped as too "
                f"old. The publishers' DDS transport is too slow for these images ({self.REMEDY}), or the cameras' "
                "clock is behind this computer's")

    def too_old(self) -> str:
        """"" unless :data:`TOO_OLD_FRAMES` frames in a row were too old when complete; then a sentence naming the
        latest camera and the remedy, logged once as ERROR."""
        bad = self.too_old_in_a_row >= self.TOO_OLD_FRAMES
        message = ""
        if bad:
            worst = self.arrival_delay_ms()
            camera = "" if worst is None else (f"; the latest is camera {worst[0]} ({self._topics[worst[0]]}), "
                                               f"{worst[1] / 1e3:.2f} s after its stamp (median)")
            message = (f"the last {self.too_old_in_a_row} synchronized frames were older than the suffix's frame age "
                       f"limit ({self._age_limit_s():.2f} s) when their last image arrived: each is dropped as too "
                       f"old{camera}. {self.REMEDY[0].upper()}{self.REMEDY[1:]}")
        if bad != self._too_old_said:
            self._too_old_said = bad
            if bad:
                self._ctx.logger.error(message)
            else:
                self._ctx.logger.info("synchronized frames are young enough to plan on again")
        return message

    def silent_cameras(self, now_ns: int | None = None) -> list[tuple[int, float]]:
        """(camera, seconds silent) of each camera silent for ``SILENT_PERIODS`` median periods (at least
        ``SILENT_MIN_S``) while another sent; [] when all or none send."""
        if not self._last_ns:
            return []
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        gaps = sorted(self._gaps_ns)
        period = gaps[len(gaps) // 2] if gaps else 0
        limit = max(self.SILENT_PERIODS * period, int(self.SILENT_MIN_S * 1e9))
        since = [now_ns - (t or self._started_ns) for t in self._last_ns]
        if min(since) > limit:
            return []
        return [(cam, s / 1e9) for cam, s in enumerate(since) if s > limit]

    def silence(self) -> str:
        """"" while every camera sends, else a sentence naming each silent camera; changes are logged once."""
        now = time.monotonic_ns()
        silent = self.silent_cameras(now)
        cams = {cam for cam, _ in silent}
        if cams != set(self._silent_said):
            new = sorted(cams - set(self._silent_said))
            if new:
                self._ctx.logger.warning(
                    "silent: " + ", ".join(f"camera {c} ({self._topics[c]})" for c in new)
                    + "; the other cameras send")
            back = [c for c, since in self._silent_said.items() if c not in cams and self._last_ns[c] > since]
            if back:
                self._ctx.logger.info(", ".join(f"camera {c} ({self._topics[c]})" for c in back)
                                             + ": sends again")
            self._silent_said = {c: self._silent_said.get(c, now) for c in cams}
        if not silent:
            return ""
        return ("no frame can be synchronized: " + ", ".join(
            f"camera {cam} ({self._topics[cam]}) sent nothing for {s:.1f} s" for cam, s in silent)
            + " while the other cameras send")

    def _callback(self, cam: int, transport: str, generation: int):
        def callback(msg) -> None:
            if generation != self._generation[cam]:  # a subscription being replaced (camera_reliability auto)
                if self._delivered[cam]:
                    return  # the new one delivers: this one is on its way out
            else:
                self._delivered[cam] = True
            header = getattr(msg, "header", None)
            if header is not None:
                seen = header.stamp.sec * 10**9 + header.stamp.nanosec
                if self._retiring and seen == self._last_stamp[cam]:
                    return  # delivered by both subscriptions while they overlap: taken once
                self._last_stamp[cam] = seen
            self.frames_in += 1
            now = time.monotonic_ns()
            if self._last_ns[cam]:
                self._gaps_ns.append(now - self._last_ns[cam])
            self._last_ns[cam] = now
            try:
                stamp = header_stamp_ns(msg)  # int32 sec may be negative: the synchronizer takes >= 0 only
            except ValueError as e:
                self._ctx.drop("bad_stamp", f"camera {cam}: {e}")
                return
            clock = self._ctx.ros.get_clock().now().nanoseconds
            if clock > 0:
                self._delays_ns[cam].append(clock - stamp)
            emitted = self._sync.add(cam, stamp, (transport, msg))
            for cause, n in self._sync.pop_drops().items():
                why = SYNC_DROP_REASONS[cause]
                if cause == "queue_overflow":
                    silent = self.silent_cameras(now)
                    why += (" (silent: " + ", ".join(f"camera {c} {self._topics[c]}" for c, _ in silent) + ")"
                            if silent else "")
                self._ctx.drop(cause, f"camera {cam} message stamped {stamp} ns: {why}", n)
            if emitted is None:
                return
            self.frames_synced += 1
            self._synced_ns.append(now)
            limit = self._frame_age_limit()
            if limit and clock > 0 and clock - emitted.stamp_ns > limit * 1e9:
                self.too_old_in_a_row += 1
            else:
                self.too_old_in_a_row = 0
            self._on_frame(emitted)
        return callback


class EgoStateInputs:
    """``~/input/kinematic_state`` and ``~/input/acceleration`` of a prefix whose checkpoint takes the ego state or
    has the published query heads, buffered in ``buffer`` (EgoInputBuffer) and ``poses`` (OdometryBuffer).
    """

    def __init__(self, ctx):
        """``ctx``: the node's PartContext."""
        self._ctx = ctx
        self.buffer = EgoInputBuffer()  # speed, yaw rate and acceleration samples
        self.poses = OdometryBuffer()  # the poses of the same kinematic states
        self.subscriptions = []

    def start(self) -> None:
        """Forget the samples (they may predate a clock jump) and subscribe."""
        self.buffer.clear()
        self.poses.clear()
        self.subscriptions = [
            self._ctx.ros.create_subscription(Odometry, "~/input/kinematic_state", self._on_kinematic_state, 10),
            self._ctx.ros.create_subscription(AccelWithCovarianceStamped, "~/input/acceleration",
                                           self._on_acceleration, 10),
        ]

    def stop(self) -> None:
        """Unsubscribe (idempotent)."""
        for sub in self.subscriptions:
            self._ctx.ros.destroy_subscription(sub)
        self.subscriptions = []

    def _on_kinematic_state(self, msg: Odometry) -> None:
        try:
            sample, pose = kinematic_sample_from_odometry(msg), ego_state_from_odometry(msg)
        except ValueError as e:
            self._ctx.drop("bad_kinematic_state", f"~/input/kinematic_state: {e}")
            return
        try:
            self.buffer.add_kinematic(*sample)
            self.poses.add(pose)
        except ValueError as e:
            self._ctx.drop("bad_kinematic_state", f"~/input/kinematic_state: {e}")

    def _on_acceleration(self, msg: AccelWithCovarianceStamped) -> None:
        try:
            self.buffer.add_acceleration(*acceleration_sample_from_msg(msg))
        except ValueError as e:
            self._ctx.drop("bad_acceleration", f"~/input/acceleration: {e}")

    def state_at(self, stamp: int, wait_s: float, max_age_s: float):
        """(:meth:`EgoInputBuffer.ego_state_at` values, source, ms waited) after waiting up to ``wait_s`` (timed
        as stage ``ego_wait``). Raises its LookupError (cause in args[0])."""
        t0 = time.perf_counter()
        self.buffer.wait_for(stamp, wait_s)
        wait_ms = (time.perf_counter() - t0) * 1e3
        self._ctx.times.add("ego_wait", wait_ms)
        return (*self.buffer.ego_state_at(stamp, int(max_age_s * 1e9)), wait_ms)

    def pose_at(self, stamp: int, max_age_s: float) -> EgoState:
        """The ego pose at the camera stamp (OdometryBuffer.pose_at); call after :meth:`state_at`, which waited."""
        return self.poses.pose_at(stamp, int(max_age_s * 1e9))[0]
