"""The prefix node's inputs: the cameras and, for a checkpoint with ``ego_state_input``, the ego state.

Callbacks only read the header stamp, count and buffer (:class:`CameraInputs` hands each synchronized frame
to the worker, :class:`EgoStateInputs` keeps the samples); decoding and inference run on the worker thread
(``prefix_worker``). Every bad or discarded message is a drop counted on the node by cause.
"""
from __future__ import annotations

import time
from typing import Callable

from geometry_msgs.msg import AccelWithCovarianceStamped
from nav_msgs.msg import Odometry
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from ..util.stamps import header_stamp_ns
from ..vehicle.ego_input import EgoInputBuffer, acceleration_sample_from_msg, kinematic_sample_from_odometry
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
}


class CameraInputs:
    """The camera subscriptions of a prefix node, synchronized by header stamp.

    Each message's stamp (int ns, from ``header.stamp``) goes to a :class:`~..vehicle.sync.CameraSynchronizer`
    with the message, undecoded; each completed set (a SyncedSet: stamp ns, one ``(transport, msg)`` per camera
    in camera order) goes to ``on_frame``. Counts ``frames_in`` (messages, every camera) and ``frames_synced``
    (sets); a stamp that cannot be read is a ``bad_stamp`` drop, the synchronizer's discards are drops by its
    cause (SYNC_DROP_REASONS).
    """

    def __init__(self, node, on_frame: Callable[[SyncedSet], None]):
        self._node = node
        self._on_frame = on_frame
        self._sync: CameraSynchronizer | None = None
        self.subscriptions = []
        self.frames_in = 0
        self.frames_synced = 0

    def start(self, topics: list[str], transports: list[str], tolerance_ms: float) -> None:
        """Subscribe to camera ``i`` at ``topics[i]`` (sensor_msgs/Image, transport 'raw') or at
        ``topics[i]/compressed`` (sensor_msgs/CompressedImage, transport 'compressed'), sensor-data QoS, with
        a new synchronizer that pairs stamps within ``tolerance_ms`` (ms)."""
        self._sync = CameraSynchronizer(len(topics), int(tolerance_ms * 1e6))
        for cam, (topic, transport) in enumerate(zip(topics, transports)):
            if transport == "compressed":
                sub = self._node.create_subscription(CompressedImage, f"{topic}/compressed",
                                                     self._callback(cam, transport), qos_profile_sensor_data)
            else:
                sub = self._node.create_subscription(Image, topic, self._callback(cam, transport),
                                                     qos_profile_sensor_data)
            self.subscriptions.append(sub)

    def stop(self) -> None:
        """Unsubscribe from every camera (idempotent)."""
        for sub in self.subscriptions:
            self._node.destroy_subscription(sub)
        self.subscriptions = []

    def _callback(self, cam: int, transport: str):
        def callback(msg) -> None:
            self.frames_in += 1
            try:
                stamp = header_stamp_ns(msg)  # int32 sec may be negative: the synchronizer takes >= 0 only
            except ValueError as e:
                self._node._drop("bad_stamp", f"camera {cam}: {e}")
                return
            emitted = self._sync.add(cam, stamp, (transport, msg))
            for cause, n in self._sync.pop_drops().items():
                self._node._drop(cause, f"camera {cam} message stamped {stamp} ns: {SYNC_DROP_REASONS[cause]}", n)
            if emitted is None:
                return
            self.frames_synced += 1
            self._on_frame(emitted)
        return callback


class EgoStateInputs:
    """``~/input/kinematic_state`` (nav_msgs/Odometry) and ``~/input/acceleration``
    (geometry_msgs/AccelWithCovarianceStamped) of a prefix whose checkpoint takes the ego state.

    The callbacks only add samples to ``buffer`` (vehicle.ego_input.EgoInputBuffer); a message that cannot be
    read is a ``bad_kinematic_state`` / ``bad_acceleration`` drop. :meth:`state_at` gives the worker the ego
    state at a camera stamp.
    """

    def __init__(self, node):
        self._node = node
        self.buffer = EgoInputBuffer()  # speed, yaw rate and acceleration samples
        self.subscriptions = []

    def start(self) -> None:
        """Forget the samples (those from before a deactivate may lie behind a clock jump) and subscribe."""
        self.buffer.clear()
        self.subscriptions = [
            self._node.create_subscription(Odometry, "~/input/kinematic_state", self._on_kinematic_state, 10),
            self._node.create_subscription(AccelWithCovarianceStamped, "~/input/acceleration",
                                           self._on_acceleration, 10),
        ]

    def stop(self) -> None:
        """Unsubscribe from both topics (idempotent)."""
        for sub in self.subscriptions:
            self._node.destroy_subscription(sub)
        self.subscriptions = []

    def _on_kinematic_state(self, msg: Odometry) -> None:
        try:
            self.buffer.add_kinematic(*kinematic_sample_from_odometry(msg))
        except ValueError as e:
            self._node._drop("bad_kinematic_state", f"~/input/kinematic_state: {e}")

    def _on_acceleration(self, msg: AccelWithCovarianceStamped) -> None:
        try:
            self.buffer.add_acceleration(*acceleration_sample_from_msg(msg))
        except ValueError as e:
            self._node._drop("bad_acceleration", f"~/input/acceleration: {e}")

    def state_at(self, stamp: int, wait_s: float, max_age_s: float):
        """(ego state (3,) float32: speed m/s, acceleration m/s^2, yaw rate rad/s; acceleration source) at the
        camera stamp (ns), after waiting up to ``wait_s`` (s) for the kinematic state at or after it (the wait is
        timed as stage ``ego_wait``). Raises LookupError (cause in args[0], EGO_DROP_REASONS) when no sample
        lies within ``max_age_s`` (s)."""
        t0 = time.perf_counter()
        self.buffer.wait_for(stamp, wait_s)
        self._node.times.add("ego_wait", (time.perf_counter() - t0) * 1e3)
        return self.buffer.ego_state_at(stamp, int(max_age_s * 1e9))
