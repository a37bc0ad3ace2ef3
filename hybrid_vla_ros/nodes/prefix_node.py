"""prefix_node: cameras -> vision encoder, projector, decoder blocks [0, K) -> shared-memory ring.

Lifecycle (ROS 2 managed node, as in ros2/demos lifecycle_py):
  on_configure  validate parameters, load the prefix onto the device, create the ring;
  on_activate   subscribe to the cameras, start the worker thread;
  on_deactivate unsubscribe, stop the worker (a frame in progress finishes and is published);
  on_cleanup    remove the ring, free the device memory;
  on_shutdown   as cleanup, from any state.
Subscription callbacks only stamp and queue messages; decoding and inference run on one worker
thread that always takes the newest synchronized frame (older unprocessed ones are counted as
``superseded``), so a slow model never backs up DDS queues.
"""
from __future__ import annotations

import sys
import threading
import time

import rclpy
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from ..core.config import VLAConfig
from ..core.image import ImageDecodeError
from ..core.params import ParameterError, Params
from ..core.pipeline import PrefixRunner
from ..core.sync import CameraSynchronizer
from . import common
from .msg_conv import stamp_to_ns


#: Log text of each synchronizer drop cause (core.sync.DROP_CAUSES).
SYNC_DROP_REASONS = {
    "out_of_order": "header stamp older than this camera's previous message (stamps must increase per camera)",
    "duplicate": "header stamp equal to this camera's previous message",
    "unsynced": "camera messages without a partner on every camera within sync_tolerance_ms were discarded",
    "queue_overflow": "a camera sent nothing for a while: the oldest message queued for it was pushed out",
    "time_jump": "header stamp more than 1 s older than this camera's previous one (clock reset, bag restart "
                 "or earlier stamps in the future): synchronization restarted, queued messages discarded",
}


class PrefixNode(common.PipelineNode):
    """Lifecycle node running the GPU prefix. See the module docstring and README for topics."""

    def __init__(self, **kwargs):
        super().__init__("prefix_node", **kwargs)
        self.runner: PrefixRunner | None = None
        self.params: Params | None = None
        self.frames_in = 0
        self.frames_synced = 0
        self.frames_out = 0
        self._subs = []
        self._sync: CameraSynchronizer | None = None
        self._pending = None  # newest synchronized frame waiting for the worker
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._running = False

    # ----------------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            p = self.read_parameters()  # schema checks first: model_path must name a directory
            cfg = VLAConfig.load(p.model_path)
            p = self.read_parameters(n_cameras=cfg.n_cameras, num_layers=cfg.num_layers)
            self.runner = PrefixRunner(p.model_path, p.split_layer, device=p.device, dtype=p.dtype,
                                       ring_name=p.ring_name, namespace=self.get_namespace(),
                                       ring_slots=p.ring_slots, torch_threads=p.torch_threads)
        except (ParameterError, ValueError, OSError, RuntimeError) as e:
            self.last_error = str(e)
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        self.params = p
        cfg = self.runner.cfg
        self.get_logger().info(
            f"configured: split_layer={p.split_layer}/{cfg.num_layers} device={self.runner.device} dtype={p.dtype} "
            f"hidden states {cfg.prefix_state_shape} -> ring '{self.runner.ring.name}' ({p.ring_slots} slots)"
            + (" [random-init weights: trajectories are not driving advice]" if cfg.random_init else ""))
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.params
        self._sync = CameraSynchronizer(len(p.camera_topics), int(p.sync_tolerance_ms * 1e6))
        for cam, (topic, transport) in enumerate(zip(p.camera_topics, p.camera_transports)):
            if transport == "compressed":
                sub = self.create_subscription(CompressedImage, f"{topic}/compressed",
                                               self._make_callback(cam, transport), qos_profile_sensor_data)
            else:
                sub = self.create_subscription(Image, topic, self._make_callback(cam, transport),
                                               qos_profile_sensor_data)
            self._subs.append(sub)
        self._running = True
        self._worker = threading.Thread(target=self._work, name="prefix_worker", daemon=True)
        self._worker.start()
        self.get_logger().info(f"active: {len(self._subs)} camera subscriptions "
                               f"({', '.join(s.topic_name for s in self._subs)})")
        return super().on_activate(state)

    def _stop(self) -> None:
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs = []
        with self._cv:
            self._running = False
            if self._pending is not None:  # a synchronized frame the worker had not started: count it
                self.drops.add("deactivated")
            self._pending = None
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _release(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
            self.get_logger().info("cleaned up: ring removed, model memory freed")

    # ------------------------------------------------------------------------------------- frames
    def _make_callback(self, cam: int, transport: str):
        def callback(msg) -> None:
            self.frames_in += 1
            try:
                stamp = stamp_to_ns(msg.header.stamp)
                if stamp < 0:  # int32 sec may be negative; the synchronizer takes stamps >= 0 only
                    raise ValueError(f"negative stamp {msg.header.stamp.sec} s {msg.header.stamp.nanosec} ns")
            except ValueError as e:
                self._drop("bad_stamp", f"camera {cam}: {e}")
                return
            emitted = self._sync.add(cam, stamp, (transport, msg))
            for cause, n in self._sync.pop_drops().items():
                self._count(cause, n, f"camera {cam} message stamped {stamp} ns: {SYNC_DROP_REASONS[cause]}")
            if emitted is None:
                return
            self.frames_synced += 1
            with self._cv:
                if self._pending is not None:
                    self._count("superseded", 1, "a newer synchronized frame arrived before the worker took this "
                                "one (the prefix is slower than the camera rate)")
                self._pending = emitted
                self._cv.notify()
        return callback

    def _count(self, cause: str, n: int, message: str) -> None:
        """Count ``n`` drops of ``cause`` and log it at most every 2 s per cause, as ``_drop`` does."""
        total = self.drops.add(cause, n)
        self.last_error = message
        if self._throttle(cause):
            self.get_logger().warning(f"dropped ({cause}, {total} so far): {message}")

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._running and self._pending is None:
                    self._cv.wait()
                if not self._running:
                    return
                stamp, items = self._pending
                self._pending = None
            try:
                result = self.runner.run(items, stamp)
            except ImageDecodeError as e:
                self._drop("decode_error", str(e))
                continue
            except (ValueError, FloatingPointError) as e:
                self._drop("model_error", str(e))
                continue
            except Exception as e:  # noqa: BLE001 - the node keeps running, the error is counted and reported
                self._drop("internal_error", f"{type(e).__name__}: {e}")
                continue
            self.frames_out += 1
            self.times.add("preprocess", result.preprocess_ms)
            self.times.add("prefix", result.prefix_ms)

    def _io_counts(self) -> tuple[int, int]:
        return self.frames_in, self.frames_out

    def _ring(self):
        return self.runner.ring if self.runner is not None else None

    def _diagnostic_values(self) -> dict:
        ring = self.runner.ring.stats if self.runner is not None else {}
        return {"frames_in": self.frames_in, "frames_synchronized": self.frames_synced,
                "frames_out": self.frames_out, "ring_published": ring.get("published", 0),
                "ring_dropped_oldest": ring.get("dropped_oldest", 0),
                "split_layer": self.params.split_layer if self.params else ""}


def main(args: list[str] | None = None) -> int:
    """Console entry point: ``ros2 run hybrid_vla_ros prefix_node --ros-args ...``."""
    rclpy.init(args=args if args is not None else sys.argv)
    return common.spin(PrefixNode())


if __name__ == "__main__":
    sys.exit(main())
