"""prefix_node: cameras -> vision encoder, projector, decoder blocks [0, K) -> shared-memory ring.

Lifecycle (ROS 2 managed node, as in ros2/demos lifecycle_py):
  on_configure  validate parameters, load the prefix onto the device, create the ring;
  on_activate   subscribe to the cameras (and, for a checkpoint with ``ego_state_input``, to
                ``~/input/kinematic_state`` and ``~/input/acceleration``), start the worker thread;
  on_deactivate unsubscribe, stop the worker (a frame in progress finishes and is published);
  on_cleanup    remove the ring, free the device memory;
  on_shutdown   as cleanup, from any state.
Subscription callbacks only stamp and queue messages; decoding and inference run on one worker
thread that always takes the newest synchronized frame (older unprocessed ones are counted as
``superseded``), so a slow model never backs up DDS queues.

Ego state (checkpoints with ``ego_state_input``): the odometry and acceleration callbacks only buffer
samples (``core/ego_input.py``); the worker waits up to ``ego_state_wait_s`` for the kinematic state at
or after the camera stamp, then feeds speed, acceleration and yaw rate at that stamp to the model. A
frame without a usable ego state is dropped and counted (``no_ego_state``, ``stale_ego_state``,
``no_acceleration``), never computed with a made-up one.

CPU cores: ``main`` pins the process to ``cpu_affinity`` (from the command line or params file) before
``rclpy.init`` starts the DDS threads and before torch's and OpenCV's pools start; the few threads the
imports above started already are pinned with them (``util.cores.pin_process``), and configure pins
again and sizes torch's and OpenCV's pools to the pinned cores. Give the prefix the cores the suffix
does not have (the launch file and ``hybrid-vla replay`` do).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import cv2
import torch
from geometry_msgs.msg import AccelWithCovarianceStamped
from nav_msgs.msg import Odometry
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image

from ..model.config import VLAConfig
from ..runtime.device import resolve_device
from ..runtime.prefix import PrefixRunner
from ..util.stamps import header_stamp_ns
from ..vehicle.ego_input import (
    ACCEL_SOURCES,
    EgoInputBuffer,
    acceleration_sample_from_msg,
    kinematic_sample_from_odometry,
)
from ..vehicle.image import ImageDecodeError
from ..util.cores import pin_process
from ..vehicle.sync import CameraSynchronizer
from . import node_base
from .params import ParameterError, Params
from .params_file import pin_from_ros_args

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


class PrefixNode(node_base.PipelineNode):
    """Lifecycle node running the GPU prefix. See the module docstring and README for topics."""

    LIVE_PARAMETERS = ("split_layer",)

    def __init__(self, early_affinity: list[int] | None = None, **kwargs):
        super().__init__("prefix_node", **kwargs)
        self.early_affinity = early_affinity  # cores main() pinned the process to before rclpy.init
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
        self._ego = EgoInputBuffer()  # speed, yaw rate and acceleration samples (ego_state_input checkpoints)
        self._ego_subs = []
        self.ego_accel_sources = {source: 0 for source in ACCEL_SOURCES}  # frames out, by acceleration source
        self.plan = None  # the split plan of `split_layer: auto` (split.planner.Plan), None for a fixed K
        self.resplits = 0  # live moves of the split layer applied
        self._pressure_timer = None
        self._policy = None  # split.planner.AutoResplitPolicy of the running `auto` plan

    # ----------------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            p = self.read_parameters()  # schema checks first: model_path must name a directory
            cfg = VLAConfig.load(p.model_path)
            p = self.read_parameters(n_cameras=cfg.n_cameras, num_layers=cfg.num_layers)
            if p.cpu_affinity:
                pin_process(p.cpu_affinity)
                cv2.setNumThreads(len(p.cpu_affinity))
            self.plan = None
            k = p.split_layer
            if k == "auto":
                self.plan = self._make_plan(p)
                k = self.plan.chosen_k
                self.get_logger().info(f"split_layer auto: {self.plan.reason}")
            self.runner = PrefixRunner(p.model_path, k, device=p.device, dtype=p.dtype,
                                       ring_name=p.ring_name, namespace=self.get_namespace(),
                                       ring_slots=p.ring_slots,
                                       torch_threads=p.torch_threads or len(p.cpu_affinity),
                                       fast_jpeg_decode=p.fast_jpeg_decode,
                                       gpu_budget_bytes=int(round(p.gpu_budget_gb * 1e9)))
        except (ParameterError, ValueError, OSError, RuntimeError) as e:
            self.last_error = str(e)
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        self.params = p
        cfg = self.runner.cfg
        self.get_logger().info(
            f"configured: split_layer={self.runner.split_layer}/{cfg.num_layers} device={self.runner.device} dtype={p.dtype} "
            f"hidden states {cfg.prefix_state_shape} -> ring '{self.runner.ring.name}' ({p.ring_slots} slots)"
            + ("; fast_jpeg_decode ON (JPEGs decoded scaled down: validate the model with it)"
               if p.fast_jpeg_decode else "")
            + (f"; ego state input (wait {p.ego_state_wait_s} s, max age {p.max_ego_state_age_s} s)"
               if cfg.ego_state_input else "")
            + (f"; cores {p.cpu_affinity} (pinned early: {self.early_affinity or 'no'})" if p.cpu_affinity
               else "; not pinned (cpu_affinity [])")
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
        if self.runner.cfg.ego_state_input:
            self._ego.clear()  # samples from before a deactivate may lie behind a clock jump
            self._ego_subs = [
                self.create_subscription(Odometry, "~/input/kinematic_state", self._on_kinematic_state, 10),
                self.create_subscription(AccelWithCovarianceStamped, "~/input/acceleration", self._on_acceleration, 10),
            ]
        self._running = True
        self._update_pressure_timer()
        self._worker = threading.Thread(target=self._work, name="prefix_worker", daemon=True)
        self._worker.start()
        self.get_logger().info(f"active: {len(self._subs)} camera subscriptions "
                               f"({', '.join(s.topic_name for s in self._subs)})"
                               + (f", ego state from {', '.join(s.topic_name for s in self._ego_subs)}"
                                  if self._ego_subs else ""))
        return super().on_activate(state)

    def _stop(self) -> None:
        if self._pressure_timer is not None:
            self.destroy_timer(self._pressure_timer)
            self._pressure_timer = None
        for sub in self._subs + self._ego_subs:
            self.destroy_subscription(sub)
        self._subs, self._ego_subs = [], []
        with self._cv:
            self._running = False
            if self._pending is not None:  # a synchronized frame the worker had not started: count it
                self.drops.add("deactivated")
            self._pending = None
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    # ------------------------------------------------------------------------------ split layer
    def _make_plan(self, p, budget_bytes: int | None = None):
        """The split plan of ``split_layer: auto`` (split.planner.Plan) for budget ``budget_bytes`` (default:
        ``gpu_budget_gb``, or the device's free memory on CUDA when that is 0). Raises ValueError (no K fits,
        bad profile), FileNotFoundError."""
        from ..split.planner import plan_for_checkpoint

        device = resolve_device(p.device)
        if budget_bytes is not None:
            budget_gb = budget_bytes / 1e9
        elif p.gpu_budget_gb > 0:
            budget_gb = p.gpu_budget_gb
        elif device.type == "cuda":
            # free memory, plus what this prefix holds already when it is running (a live switch to auto)
            held = torch.cuda.memory_reserved(device) if self.runner is not None else 0
            budget_gb = (torch.cuda.mem_get_info(device)[0] + held) / 1e9
        else:
            budget_gb = None  # a CPU prefix: no device budget
        return plan_for_checkpoint(p.model_path, p.profile_path or None, budget_gb, p.dtype,
                                   cuda_overhead_gb=None if device.type == "cuda" else 0.0)

    def _live_parameter_problems(self, values: dict) -> list[str]:
        k = values.get("split_layer")
        if isinstance(k, int) and self.runner is not None and k > self.runner.cfg.num_layers:
            return [f"split_layer: {k} out of range [0, {self.runner.cfg.num_layers}] for this model"]
        return []

    def _apply_live_parameters(self, values: dict) -> None:
        k = values.get("split_layer")
        if k is None or self.runner is None:
            return  # unconfigured: read at configure
        if k == "auto":
            try:
                self.plan = self._make_plan(self.params)
            except (ValueError, OSError) as e:
                self.get_logger().error(f"split_layer auto: no plan ({e}); K stays {self.runner.split_layer}")
                return
            self.get_logger().info(f"split_layer auto: {self.plan.reason}")
            k = self.plan.chosen_k
        else:
            self.plan = None
        self._update_pressure_timer()
        self.runner.request_split_layer(k)
        with self._cv:
            self._cv.notify()  # an idle worker applies it at once
        self.get_logger().info(f"split_layer {k} requested (now {self.runner.split_layer}): the frame in progress "
                               "finishes at its K, the next one is computed at the new K")

    def _update_pressure_timer(self) -> None:
        """Run the 2 s memory-pressure check while active with ``split_layer: auto``, ``auto_resplit_free_mb``
        > 0 and a CUDA prefix; stop it otherwise."""
        wanted = (self._running and self.plan is not None and self.params.auto_resplit_free_mb > 0
                  and self.runner is not None and self.runner.device.type == "cuda")
        if wanted and self._pressure_timer is None:
            self._pressure_timer = self.create_timer(2.0, self._check_memory_pressure)
        elif not wanted and self._pressure_timer is not None:
            self.destroy_timer(self._pressure_timer)
            self._pressure_timer = None

    def _check_memory_pressure(self) -> None:
        """2 s timer (``split_layer: auto`` on CUDA with ``auto_resplit_free_mb`` > 0): move K down when the
        device's free memory falls under ``auto_resplit_free_mb`` and back up (at most to the planned K) when a
        move up leaves ``auto_resplit_recover_mb`` free for 3 readings (split.planner.AutoResplitPolicy)."""
        from ..split.planner import AutoResplitPolicy

        if self.runner is None or self.plan is None:
            return
        low, high = AutoResplitPolicy.thresholds(self.params.auto_resplit_free_mb, self.params.auto_resplit_recover_mb)
        if self._policy is None or self._policy.plan is not self.plan:
            try:
                self._policy = AutoResplitPolicy(self.plan, low, high)
            except ValueError as e:
                if self._throttle("memory_pressure"):
                    self.get_logger().error(f"auto re-split off: {e}")
                return
        free = torch.cuda.mem_get_info(self.runner.device)[0]
        try:
            k, reason = self._policy.decide(self.runner.split_layer, free)
        except ValueError as e:
            if self._throttle("memory_pressure"):
                self.get_logger().error(f"free device memory {free / 2**20:.0f} MiB < {low / 2**20:.0f} MiB and "
                                        f"no split layer fits: {e}")
            return
        if k is not None and k != self.runner.split_layer:
            self.get_logger().warning(f"moving K {self.runner.split_layer} -> {k}: {reason}")
            self.runner.request_split_layer(k)
            with self._cv:
                self._cv.notify()

    def _log_resplit(self, e) -> None:
        self.resplits += 1
        moved = f"loaded {e.blocks_loaded}" if e.blocks_loaded else f"freed {e.blocks_freed}"
        self.get_logger().info(
            f"re-split K {e.old_split_layer} -> {e.new_split_layer}: {moved} block(s) in {e.duration_ms:.1f} ms"
            + (f" (loaded in the background in {e.load_ms:.1f} ms)" if e.blocks_loaded else "") + "; "
            f"prefix weights {e.stage_bytes_before / 2**20:.1f} -> {e.stage_bytes_after / 2**20:.1f} MiB"
            + (f", device memory allocated {e.device_bytes_before / 2**20:.1f} -> {e.device_bytes_after / 2**20:.1f} MiB, "
               f"reserved {e.reserved_bytes_before / 2**20:.1f} -> {e.reserved_bytes_after / 2**20:.1f} MiB, driver-level "
               f"used {e.driver_used_before / 2**20:.1f} -> {e.driver_used_after / 2**20:.1f} MiB "
               f"({e.returned_to_driver_bytes / 2**20:.1f} MiB returned)"
               if self.runner.device.type == "cuda" else ""))

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
                stamp = header_stamp_ns(msg)  # int32 sec may be negative: the synchronizer takes >= 0 only
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

    def _on_kinematic_state(self, msg: Odometry) -> None:
        try:
            self._ego.add_kinematic(*kinematic_sample_from_odometry(msg))
        except ValueError as e:
            self._drop("bad_kinematic_state", f"~/input/kinematic_state: {e}")

    def _on_acceleration(self, msg: AccelWithCovarianceStamped) -> None:
        try:
            self._ego.add_acceleration(*acceleration_sample_from_msg(msg))
        except ValueError as e:
            self._drop("bad_acceleration", f"~/input/acceleration: {e}")

    def _ego_state(self, stamp: int):
        """(ego state (3,) float32, acceleration source) at the camera stamp (ns), after waiting up to
        ``ego_state_wait_s`` for the kinematic state at or after it; (None, None) when the model takes none.
        Raises LookupError (cause in args[0]) when there is no usable ego state."""
        if not self.runner.cfg.ego_state_input:
            return None, None
        p = self.params
        t0 = time.perf_counter()
        self._ego.wait_for(stamp, p.ego_state_wait_s)
        self.times.add("ego_wait", (time.perf_counter() - t0) * 1e3)
        return self._ego.ego_state_at(stamp, int(p.max_ego_state_age_s * 1e9))

    def _count(self, cause: str, n: int, message: str) -> None:
        """Count ``n`` drops of ``cause`` and log it at most every 2 s per cause, as ``_drop`` does."""
        total = self.drops.add(cause, n)
        self.last_error = message
        if self._throttle(cause):
            self.get_logger().warning(f"dropped ({cause}, {total} so far): {message}")

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._running and self._pending is None and not self.runner.split_requested:
                    self._cv.wait()
                # Pace to a slower suffix: a frame started now would wait in the ring; newer frames replace
                # _pending meanwhile (the older one counts as superseded), so the one started is fresher.
                delay = self.runner.pacing_delay_s() if self._pending is not None and self.params.pace_to_suffix else 0
                deadline = time.monotonic() + delay
                while self._running and (remaining := deadline - time.monotonic()) > 0:
                    self._cv.wait(remaining)
                if not self._running:
                    return
                frame, self._pending = self._pending, None
            if frame is None:  # a split layer change while no frame waits: apply it now (frees memory now)
                try:  # blocks for a move up load in the background: check back every 50 ms (frames may come)
                    event = self.runner.apply_split_request(timeout=0.05)
                except Exception as e:  # noqa: BLE001 - e.g. a missing block in the checkpoint: counted, K stays
                    self._drop("resplit_error", str(e))
                    continue
                if event is not None:
                    self._log_resplit(event)
                continue
            stamp, items = frame
            try:
                ego, accel_source = self._ego_state(stamp)
            except LookupError as e:
                cause = str(e.args[0])
                self._drop(cause, f"frame stamped {stamp} ns: "
                           + EGO_DROP_REASONS[cause].format(age=self.params.max_ego_state_age_s))
                continue
            try:
                result = self.runner.run(items, stamp, ego_state=ego)
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
            if result.resplit is not None:
                self._log_resplit(result.resplit)
            if result.resplit_error is not None:
                self._drop("resplit_error", result.resplit_error)
            if accel_source is not None:
                self.ego_accel_sources[accel_source] += 1
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
                "split_layer": self.runner.split_layer if self.runner is not None else "",
                "split_layer_auto": self.plan is not None, "resplits": self.resplits,
                "fast_jpeg_decode": bool(self.params.fast_jpeg_decode) if self.params else "",
                "ego_state_input": self.runner is not None and self.runner.cfg.ego_state_input,
                **{f"ego_accel_{source}": n for source, n in self.ego_accel_sources.items()},
                "ego_time_jumps": self._ego.time_jumps, "cpu_affinity": sorted(os.sched_getaffinity(0))}


def main(args: list[str] | None = None) -> int:
    """Console entry point: ``ros2 run hybrid_vla_ros prefix_node --ros-args -p cpu_affinity:=[0,1] ...``. Exit code
    0 after a clean shutdown (SIGINT / SIGTERM), 2 when the parameters given cannot be read (see
    ``node_base.run_node``)."""
    argv = args if args is not None else sys.argv
    try:
        early = pin_from_ros_args(argv, "prefix_node")
    except ValueError as e:
        print(f"prefix_node: {e}", file=sys.stderr)
        return 2
    return node_base.run_node("prefix_node", lambda: PrefixNode(early_affinity=early), argv)


if __name__ == "__main__":
    sys.exit(main())
