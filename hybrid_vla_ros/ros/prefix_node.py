"""prefix_node: cameras -> vision encoder, projector, decoder blocks [0, K) -> shared-memory ring.

Lifecycle (as ros2/demos lifecycle_py): configure validates parameters, loads the prefix onto the device and
creates the ring; activate subscribes (cameras; :mod:`.prefix_inputs` ego state for ``ego_state_input``;
:mod:`.prefix_scene` for the published query heads) and starts the worker; deactivate unsubscribes and stops it
(a frame in progress is published); cleanup / shutdown remove the ring and free device memory.

One worker thread (:mod:`.prefix_worker`) always takes the newest synchronized frame (older ones count as
``superseded``), so a slow model never backs up DDS queues; a frame without a usable ego state or scene is a
counted drop, never computed with a made-up one. ``runtime.split_control`` chooses and moves the split layer.

CPU cores: :mod:`.prefix_main` pins the process before this module's imports; configure pins again (for cores
given only as parameters, e.g. in a composed process) and sizes torch's and OpenCV's pools. Give the prefix the
cores the suffix does not have.
"""
from __future__ import annotations

import sys

if __name__ == "__main__":  # python -m hybrid_vla_ros.ros.prefix_node: pin first, before the imports below
    from hybrid_vla_ros.ros.prefix_main import main as _pinned_main

    sys.exit(_pinned_main())

import cv2
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn

from ..util.ids import model_id_text
from ..model.checkpoint import driving_config
from ..model.config import NAV_COMMANDS, nav_command_index, takes_scene
from ..runtime.prefix import PrefixRunner
from ..runtime.split_control import SplitLayerControl
from ..transport.ring import ProducerStats
from ..util.cores import pin_process
from ..util.precision import CpuFeatures, inference_precision
from . import node_base
from .params import ParameterError
from .settings import PrefixNodeSettings
from .prefix_inputs import EGO_DROP_REASONS, SYNC_DROP_REASONS, CameraInputs, EgoStateInputs
from .prefix_scene import SceneSource
from .prefix_worker import prefix_loop
from .status import PrefixStatus

__all__ = ["PrefixNode", "main", "SYNC_DROP_REASONS", "EGO_DROP_REASONS"]


class PrefixNode(node_base.PipelineNode):
    """Lifecycle node running the GPU prefix (module docstring; topics in the README)."""

    LIVE_PARAMETERS = ("navigation_command", "split_layer")
    STATUS = PrefixStatus

    def __init__(self, early_affinity: list[int] | None = None, **kwargs):
        super().__init__("prefix_node", **kwargs)
        self.early_affinity = early_affinity  # cores main() pinned the process to before rclpy.init
        self.runner: PrefixRunner | None = None
        self.params: PrefixNodeSettings | None = None
        ctx = self.part_context()
        self._ego_inputs = EgoStateInputs(ctx)  # speed, yaw rate, acceleration (ego_state_input checkpoints)
        self._scene = SceneSource(ctx, self._ego_inputs)  # camera geometry, ego frame (query heads)
        self._worker = prefix_loop(ctx, self._ego_inputs, self._scene,
                                   after_frame=lambda: self._split.after_frame(self._cameras.frame_period_ns()))
        self._cameras = CameraInputs(ctx, on_frame=self._worker.offer, frame_age_limit=self._frame_age_limit)
        self._split = SplitLayerControl(ctx, lambda: self.params.split_settings() if self.params else None,
                                        self._worker.wake, timers=node_base.SteadyTimers(self))

    # ----------------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            p = self.read_parameters()  # schema checks first: model_path must name a directory
            cfg = driving_config(p.model_path)
            p = self.read_parameters(n_cameras=cfg.n_cameras, num_layers=cfg.num_layers,
                                     needs_camera_info=takes_scene(cfg))
            if p.cpu_affinity:
                pin_process(p.cpu_affinity)
                cv2.setNumThreads(len(p.cpu_affinity))
            k = self._split.initial_layer(p.split_settings())
            self.runner = PrefixRunner(p.model_path, p.runner_settings(k, namespace=self.get_namespace(),
                                                                       domain_id=self.context.get_domain_id()))
        except (ParameterError, ValueError, OSError, RuntimeError) as e:
            return self.configure_failed(e)
        self.params = p
        self._scene.navigation.set_command(nav_command_index(p.navigation_command), "parameter navigation_command")
        self.configured()
        cfg = self.runner.cfg
        self.get_logger().info(
            f"configured: split_layer={self.runner.split_layer}/{cfg.num_layers} device={self.runner.device} "
            f"dtype={p.dtype} "
            f"hidden states {cfg.prefix_state_shape} -> ring '{self.runner.ring.name}' ({p.ring_slots} slots, "
            f"{self.runner.handoff_path})"
            + ("; fast_jpeg_decode ON (JPEGs decoded scaled down: validate the model with it)"
               if p.fast_jpeg_decode else "")
            + (f"; ego state input (wait {p.ego_state_wait_s} s, max age {p.max_ego_state_age_s} s)"
               if cfg.ego_state_input else "")
            + (f"; query heads: camera geometry from {', '.join(p.camera_info_topics)} and /tf_static "
               f"({p.base_frame} -> each camera's optical frame; model frame origin {list(p.model_frame_origin)} m), "
               f"ego frame from ~/input/kinematic_state, command {p.navigation_command}" if takes_scene(cfg) else "")
            + (f"; cores {list(p.cpu_affinity)} (pinned early: {self.early_affinity or 'no'})" if p.cpu_affinity
               else "; not pinned (cpu_affinity [])")
            + (" [random-init weights: trajectories are not driving advice]" if cfg.random_init else ""))
        cpu = CpuFeatures.read()
        if self.runner.device.type == "cpu" and inference_precision(self.runner.dtype, "dtype", cpu).emulated:
            self.get_logger().warning(  # a CPU prefix is computed in its dtype
                f"prefix on the CPU in {p.dtype}: this CPU ({cpu.isa_level}) has no native {p.dtype} "
                f"arithmetic, so it is emulated, several times slower than fp32; set dtype fp32 on both nodes for a "
                "pipeline on this CPU")
        if self.runner.ring.replaced_pid:
            # a restart (respawn, or by hand) of a prefix that died: the ring and wake-up directory it left are
            # replaced; what it was told at run time is not carried over
            self.get_logger().warning(
                f"replaced the ring left by a dead prefix (pid {self.runner.ring.replaced_pid}); this one starts at "
                f"split_layer {self.runner.split_layer} from its parameters: a split_layer set at run time on the "
                "dead one is not kept (put it in the launch arguments or the parameter file to keep it)")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.params
        self._cameras.start(p.camera_topics, p.camera_transports, p.sync_tolerance_ms, p.camera_reliability)
        if self.runner.cfg.ego_state_input or takes_scene(self.runner.cfg):
            self._ego_inputs.start()
        if takes_scene(self.runner.cfg):
            self._scene.start(p, self.runner.cfg)
        self._worker.pace = p.pace_to_suffix
        self._worker.handoff["path"] = self.runner.handoff_path  # as the configure log said
        self._worker.start()
        self.runner.set_running(True)
        self._split.update_timer(active=True)
        cameras, ego = self._cameras.subscriptions, self._ego_inputs.subscriptions
        scene = self._scene.subscriptions + [s for s in [self._scene.navigation.subscription] if s is not None]
        self.get_logger().info(f"active: {len(cameras)} camera subscriptions "
                               f"({', '.join(s.topic_name for s in cameras)}; reliability {p.camera_reliability}: "
                               f"{', '.join(sorted({r.name.lower() for r in self._cameras.reliabilities}))} now)"
                               + (f", ego state from {', '.join(s.topic_name for s in ego)}" if ego else "")
                               + (f", scene from {', '.join(s.topic_name for s in scene)}" if scene else ""))
        return super().on_activate(state)

    def _stop(self) -> None:
        self._split.stop_timer()
        self._cameras.stop()
        self._worker.stop()  # first: a frame still in the worker reads the ego state and the scene inputs
        self._ego_inputs.stop()
        self._scene.stop()
        if self.runner is not None:
            self.runner.set_running(False)

    def _release(self) -> None:
        if self.runner is not None:
            self.runner.close()
            self.runner = None
            self.get_logger().info("cleaned up: ring removed, model memory freed")

    # ------------------------------------------------------------------------------ split layer
    def live_parameter_problems(self, values: dict) -> list[str]:
        k = values.get("split_layer")
        if isinstance(k, int) and self.runner is not None and k > self.runner.cfg.num_layers:
            return [f"split_layer: {k} out of range [0, {self.runner.cfg.num_layers}] for this model"]
        return []

    def apply_live_parameters(self, values: dict) -> None:
        if "navigation_command" in values:  # the schema's enum has checked the name
            self._scene.navigation.set_command(nav_command_index(values["navigation_command"]),
                                               "parameter navigation_command")
        if "split_layer" in values:
            self._split.set_split_layer(values["split_layer"], active=self._worker.running)

    # ------------------------------------------------------------------------------- diagnostics
    def io_counts(self) -> tuple[int, int]:
        return self._cameras.frames_in, self._worker.frames_out

    def stall_s(self) -> float:
        """:attr:`STALL_S`, or two suffix cycles when longer (``pace_to_suffix`` publishes once per cycle)."""
        cycle_s = self.runner.suffix_cycle_s() if self.runner is not None else None
        return max(self.STALL_S, 2 * cycle_s) if cycle_s else self.STALL_S

    def peer_status(self):
        runner = self.runner
        if runner is None or not self._worker.running:
            return None
        return runner.peer_status(self._cameras.frame_period_ns())

    def _frame_age_limit(self) -> float | None:
        """The attached suffix's frame age limit (s), None while unknown."""
        runner = self.runner
        return runner.suffix_frame_age_limit_s() if runner is not None else None

    def input_problem(self) -> str:
        return self._cameras.silence() or self._cameras.too_old()

    def input_warning(self) -> str:
        return self._cameras.lateness()

    def status_fields(self) -> dict:
        """This node's fields of :class:`~.status.PrefixStatus`."""
        runner, cameras, worker = self.runner, self._cameras, self._worker
        calibration = self._scene.calibration
        ring = runner.ring.stats if runner is not None else ProducerStats()
        delay, delays = cameras.arrival_delay_ms(), cameras.camera_delays_ms()
        return dict(
            frames_in=cameras.frames_in, frames_synchronized=cameras.frames_synced, frames_out=worker.frames_out,
            ring_published=ring.published, ring_dropped_oldest=ring.dropped_oldest,
            split_layer=runner.split_layer if runner is not None else None,
            model_id=model_id_text(runner.model_id) if runner is not None else "",
            num_layers=runner.cfg.num_layers if runner is not None else None,
            split_layer_auto=self._split.plan is not None, resplits=worker.resplits,
            decode_tokens=worker.decode_tokens,
            split_moves_latency=self._split.moves["latency"], split_moves_memory=self._split.moves["memory"],
            split_move_reason=self._split.reason,
            handoff_path=runner.handoff_path if runner is not None else "",
            fast_jpeg_decode=bool(self.params.fast_jpeg_decode) if self.params else None,
            ego_state_input=runner is not None and runner.cfg.ego_state_input,
            ego_accel=dict(worker.ego_accel_sources), ego_time_jumps=self._ego_inputs.buffer.time_jumps,
            camera_reliability=",".join(r.name.lower() for r in cameras.reliabilities),
            camera_delay_worst=None if delay is None else delay[0],
            camera_delay_p50_ms=None if delay is None else delay[1],
            camera_delay_max_ms=None if delay is None else delay[2],
            camera_delays_p50_ms=tuple(None if d is None else d[0] for d in delays),
            camera_delays_max_ms=tuple(None if d is None else d[1] for d in delays),
            frames_too_old_in_a_row=cameras.too_old_in_a_row, frame_age_limit_s=self._frame_age_limit(),
            cameras_silent=tuple(c for c, _ in cameras.silent_cameras()),
            scene_inputs=runner is not None and takes_scene(runner.cfg),
            camera_infos_in=calibration.camera_infos if calibration is not None else 0,
            static_transforms_in=calibration.static_transforms if calibration is not None else 0,
            navigation_command=NAV_COMMANDS[self._scene.navigation.command])


def main(args: list[str] | None = None) -> int:
    """:func:`.prefix_main.main`, for older installed scripts. OpenCV and torch are already imported here, so their
    pools are not sized to ``cpu_affinity`` (``pin_then_import`` warns): prefer the ``prefix_node`` executable."""
    from .prefix_main import main as pinned_main

    return pinned_main(args)
