"""SuffixNode class (imported by suffix_node.main only after the process is pinned)."""
from __future__ import annotations


import torch
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn

from ..model.checkpoint import driving_config
from ..model.config import NAV_COMMANDS, nav_command_index
from ..runtime.suffix import SuffixRunner
from ..transport.ring import ConsumerStats
from ..util.cores import pin_process, thread_affinities
from . import node_base
from .params import ParameterError, Params
from .status import SuffixStatus
from .suffix_inputs import SuffixInputs
from .suffix_outputs import TrajectoryOutputs, load_oracle
from .suffix_worker import suffix_loop


class SuffixNode(node_base.PipelineNode):
    """Lifecycle node running the CPU suffix (parts and topics: :mod:`.suffix_node`, the README)."""

    LIVE_PARAMETERS = ("navigation_command", "split_layer")
    STATUS = SuffixStatus

    def __init__(self, early_affinity: list[int] | None = None, **kwargs):
        super().__init__("suffix_node", **kwargs)
        self.early_affinity = early_affinity
        self.runner: SuffixRunner | None = None
        self.params: Params | None = None
        ctx = self.part_context()
        self._inputs = SuffixInputs(ctx)
        self._outputs = TrajectoryOutputs(ctx)
        self._worker = suffix_loop(ctx, self._inputs, self._outputs)

    # ----------------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            p = self.read_parameters()  # schema checks first: model_path must name a directory
            num_layers = driving_config(p.model_path).num_layers
            p = self.read_parameters(num_layers=num_layers)
            if p.cpu_affinity:
                pin_process(p.cpu_affinity)
            # 'auto' follows the prefix: K = L, no blocks up front, the first frame loads those its K needs.
            settings = p.runner_settings(num_layers, namespace=self.get_namespace(),
                                         domain_id=self.context.get_domain_id())
            k = settings.split_layer
            self.runner = SuffixRunner(p.model_path, settings, log=self._backend_log)
            oracle = load_oracle(p.oracle_bag) if p.oracle_bag else None
        except (ParameterError, ValueError, OSError, RuntimeError) as e:
            self.runner = None
            return self.configure_failed(e)
        self.params = p
        self.configured()
        self._outputs.configure(p, decodes=self.runner.decode_spec is not None, oracle=oracle)
        self._inputs.set_command(nav_command_index(p.navigation_command), "parameter navigation_command")
        cores = sorted(set().union(*thread_affinities().values()))
        spin = f"{p.ring.spin_lead_ms} ms lead, <= {p.ring.spin_max_ms} ms" if p.ring.spin_max_ms else "off"
        self._worker.new_runner()
        candidates = self._outputs.candidates_pub
        self.get_logger().info(
            f"configured: split_layer={p.split_layer}/{self.runner.cfg.num_layers} dtype={p.dtype} "
            f"(inference precision {self.runner.precision.name}: {self.runner.precision.reason}) "
            f"threads={torch.get_num_threads()} cores={cores} (pinned early: {self.early_affinity or 'no'}) "
            f"ring '{self.runner.segment}' (delivery {p.ring.delivery}, spin {spin}) "
            f"navigation_command={p.navigation_command} "
            f"suffix_backend={p.suffix_backend}"
            + (f" (in use: eager: {self.runner.backend.error})" if self.runner.backend.error else "")
            + (f" (building for K={k} in the background, cache {self.runner.backend.cache_dir}; eager meanwhile)"
               if self.runner.backend.status().building is not None else "")
            + (f"; bf16 linear layers: {self.runner.linear_packing}" if self.runner.linear_packing else "")
            + (f"; decode step: {step}" if (step := self.runner.decode_step_status().line) else "")
            + (("; decodes " + (f"{self.runner.decode_spec.decodes_per_frame} answers of "
                                   if self.runner.decode_spec.turns else "")
                + f"up to {self.runner.decode_spec.settings.max_new_tokens} tokens a frame "
                f"(drives: {self.runner.decode_spec.drives}), text on {self._outputs.reasoning_pub.topic_name}"
                + ("" if self.runner.has_tokenizer else " (no tokenizer files beside the model: the text is the "
                                                        "token ids)"))
               if self.runner.decode_spec is not None else "")
            + (f"; candidate trajectories of all {self.runner.cfg.n_modes} modes on "
               f"{candidates.topic_name} (generator_id {self._outputs.generator_id})" if candidates else "")
            + (" [random-init weights: trajectories are not driving advice]" if self.runner.cfg.random_init else ""))
        if oracle is not None:
            self.get_logger().warning(
                f"oracle_bag is set: the trajectories are the drive logged in {p.oracle_bag} "
                f"({len(oracle.stamps_ns)} odometry samples), not the model's plan (a check of the open-loop "
                "figures, never for driving)")
        if self.runner.precision.emulated:
            self.get_logger().warning(self.runner.precision.reason)
        if not self._outputs.guard.check_age:
            self.get_logger().warning("guard.check_age is false: trajectories are published however old their "
                                      "camera stamp is (for replays of recorded bags, not for a vehicle)")
        return TransitionCallbackReturn.SUCCESS

    def _backend_log(self, level: str, message: str) -> None:
        """Log a line of the suffix backend (its build thread included) at ``level`` (info | warning | error)."""
        getattr(self.get_logger(), level if level in ("info", "warning", "error") else "info")(message)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._inputs.start()
        self.runner.set_running(True)
        self._worker.start()
        return super().on_activate(state)

    def _stop(self) -> None:
        self._worker.stop()
        self._inputs.stop()
        if self.runner is not None:
            self.runner.set_running(False)

    def _release(self) -> None:
        self.fault = ""
        self._outputs.release()
        if self.runner is not None:
            self.runner.close()
            self.runner = None
            self.get_logger().info("cleaned up: detached from the ring, model freed")

    # ---------------------------------------------------------------------------- live parameters
    def apply_live_parameters(self, values: dict) -> None:
        if "navigation_command" in values:  # the schema's enum has checked the name
            self._inputs.set_command(nav_command_index(values["navigation_command"]), "parameter navigation_command")
        k = values.get("split_layer")
        if isinstance(k, int) and self.runner is not None:  # 'auto' needs nothing: frames carry their K
            self.runner.request_split_layer(k)
            self.get_logger().info(f"split_layer {k} set: blocks [{k}, {self.runner.cfg.num_layers}) will be ready "
                                   "before the next frame; each frame is computed at the K in its slot header")

    def live_parameter_problems(self, values: dict) -> list[str]:
        k = values.get("split_layer")
        if isinstance(k, int) and self.runner is not None and k > self.runner.cfg.num_layers:
            return [f"split_layer: {k} out of range [0, {self.runner.cfg.num_layers}] for this model"]
        return []

    # ------------------------------------------------------------------------------- diagnostics
    def io_counts(self) -> tuple[int, int]:
        return self._worker.frames_in, self._outputs.frames_out

    def input_problem(self) -> str:
        return self._outputs.too_old()

    def peer_status(self):
        runner = self.runner
        if runner is None or not self._worker.running:
            return None
        return runner.peer_status()

    def status_fields(self) -> dict:
        """This node's fields of :class:`~.status.SuffixStatus`."""
        runner, ring, worker, outputs, inputs = self.runner, self.ring_end(), self._worker, self._outputs, self._inputs
        stats = runner.ring_stats() if runner is not None else ConsumerStats()
        return dict(
            frames_in=worker.frames_in, trajectories_out=outputs.frames_out,
            frames_too_old_in_a_row=outputs.too_old_in_a_row,
            ring_attached=runner is not None and runner.attached, ring_contract_error=self.fault,
            ring_conversion=ring.conversion if ring is not None else "",
            ring_owner_alive=ring is not None and ring.owner_alive, ring_read=stats.read,
            odometry_in=inputs.odometry_in, odometry_propagated=inputs.odometry_propagated,
            odometry_late=inputs.odometry_late,
            odometry_time_jumps=inputs.odometry.time_jumps, candidate_trajectories_out=outputs.candidate_msgs_out,
            candidates_out=outputs.candidates_out, split_layer=runner.split_layer if runner is not None else None,
            blocks_held_from=runner.stage.split_layer if runner is not None else None,
            resplits=worker.resplits, resplits_on_demand=worker.resplits_on_demand,
            decode_frames=worker.decode_frames, decode_tokens=worker.decode_tokens,
            decode_max_tokens=worker.decode_max_tokens,
            decode_tokens_last=len(worker.last_decode.tokens) if worker.last_decode is not None else 0,
            navigation_command=NAV_COMMANDS[inputs.command], **self._backend_fields())

    def _backend_fields(self) -> dict:
        """The suffix backend's fields of the status: asked for, in use, the K it covers, build state, error."""
        if self.runner is None:
            return {"suffix_backend": self.params.suffix_backend if self.params else "",
                    "decode_step": self.params.decode_step if self.params else ""}
        st = self.runner.backend.status()
        return {"suffix_backend": st.requested, "suffix_backend_in_use": st.in_use,
                "suffix_backend_k": st.compiled_k, "suffix_backend_building": st.building,
                "suffix_backend_precision": st.precision, "suffix_backend_error": st.error,
                "suffix_backend_cache_dir": st.cache_dir if st.requested != "eager" else "",
                "suffix_backend_frames_compiled": st.frames_compiled,
                "suffix_backend_frames_eager": st.frames_eager, "suffix_linear_packing": self.runner.linear_packing,
                "suffix_inference_precision": self.runner.precision.name,
                "suffix_inference_precision_reason": self.runner.precision.reason,
                **self._decode_step_fields()}

    def _decode_step_fields(self) -> dict:
        """The decode step's fields of the status (:class:`~hybrid_vla_ros.runtime.compiled_step.DecodeStepStatus`)."""
        st = self.runner.decode_step_status()
        return {"decode_step": st.requested, "suffix_decode_step": st.line, "suffix_decode_step_k": st.compiled_k,
                "suffix_decode_step_building": st.building, "suffix_decode_step_error": st.error}
