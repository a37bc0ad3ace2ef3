"""SuffixNode class (imported by suffix_node.main only after the process is pinned)."""
from __future__ import annotations

import os
import threading
import time

import torch
from autoware_internal_planning_msgs.msg import CandidateTrajectories
from autoware_planning_msgs.msg import Trajectory
from diagnostic_msgs.msg import DiagnosticArray
from nav_msgs.msg import Odometry
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import String

from ..model.config import NAV_COMMANDS, VLAConfig, nav_command_index
from ..model.modeling import DEFAULT_COMMAND
from ..runtime.suffix import StaleFrame, SuffixRunner
from ..split.resplit import ResplitError
from ..transport.ring import SlotRejected
from ..util.cores import pin_process, thread_affinities
from ..vehicle.guard import GuardLimits
from ..vehicle.odometry import OdometryBuffer
from ..vehicle.output import guarded_outputs
from ..vehicle.trajectory import ego_state_from_odometry
from . import node_base
from .msg_conv import candidate_trajectories_to_msg, generator_uuid, ns_to_stamp, trajectory_to_msg
from .params import ParameterError, Params


class SuffixNode(node_base.PipelineNode):
    """Lifecycle node running the CPU suffix. See ``suffix_node`` and the README for topics."""

    LIVE_PARAMETERS = ("navigation_command", "split_layer")

    def __init__(self, early_affinity: list[int] | None = None, **kwargs):
        super().__init__("suffix_node", **kwargs)
        self.early_affinity = early_affinity
        self.runner: SuffixRunner | None = None
        self.params: Params | None = None
        self.guard: GuardLimits | None = None  # output guard limits, from the guard.* parameters at configure
        self.frames_in = 0  # frames taken from the ring, rejected ones included
        self.frames_out = 0
        self.odometry_propagated = 0  # trajectories placed with a pose propagated, not interpolated
        self.odometry_late = 0  # frames placed at once because the odometry stream was late (no wait)
        self.candidates_out = 0  # candidates published on ~/output/candidate_trajectories
        self.candidate_msgs_out = 0  # CandidateTrajectories messages published
        self.resplits = 0  # block moves (loads or frees) that followed the prefix's split layer
        self.resplits_on_demand = 0  # of which loads for a frame at a K this side was not prepared for
        self._odom = OdometryBuffer()
        self._odom_sub = None
        self._command = DEFAULT_COMMAND  # navigation command index (NAV_COMMANDS) for the next frame
        self._command_lock = threading.Lock()
        self._command_sub = None
        self._worker: threading.Thread | None = None
        self._running = False
        self._superseded_seen = 0
        self._traj_pub = self.create_lifecycle_publisher(
            Trajectory, "~/output/trajectory", QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
        self._timing_pub = self.create_lifecycle_publisher(DiagnosticArray, "~/debug/frame_timing", 10)
        # ~/output/candidate_trajectories, while configured with publish_candidate_trajectories
        self._candidates_pub = None
        self.generator_id = generator_uuid(self.get_fully_qualified_name())

    # ----------------------------------------------------------------------------------- lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            p = self.read_parameters()  # schema checks first: model_path must name a directory
            num_layers = VLAConfig.load(p.model_path).num_layers
            p = self.read_parameters(num_layers=num_layers)
            if p.cpu_affinity:
                pin_process(p.cpu_affinity)
            threads = p.threads or len(p.cpu_affinity) or torch.get_num_threads()
            # 'auto' follows the prefix: no blocks up front, the first frame loads those its K needs.
            k = num_layers if p.split_layer == "auto" else p.split_layer
            self.runner = SuffixRunner(p.model_path, k, dtype=p.dtype, ring_name=p.ring_name,
                                       namespace=self.get_namespace(), threads=threads,
                                       delivery=p["ring.delivery"], spin_lead_ms=p["ring.spin_lead_ms"],
                                       spin_max_ms=p["ring.spin_max_ms"], backend=p.suffix_backend,
                                       backend_cache_dir=p.backend_cache_dir or None, log=self._backend_log)
        except (ParameterError, ValueError, OSError, RuntimeError) as e:
            self.last_error = str(e)
            self.get_logger().error(f"configure failed: {e}")
            self.runner = None
            return TransitionCallbackReturn.FAILURE
        self.params = p
        self.guard = GuardLimits.from_params(p)
        if p.publish_candidate_trajectories:
            self._candidates_pub = self.create_lifecycle_publisher(
                CandidateTrajectories, "~/output/candidate_trajectories",
                QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
        self._set_command(nav_command_index(p.navigation_command), "parameter navigation_command")
        cores = sorted(set().union(*thread_affinities().values()))
        spin = f"{p['ring.spin_lead_ms']} ms lead, <= {p['ring.spin_max_ms']} ms" if p["ring.spin_max_ms"] else "off"
        self._superseded_seen = 0
        self.get_logger().info(
            f"configured: split_layer={p.split_layer}/{self.runner.cfg.num_layers} dtype={p.dtype} "
            f"threads={torch.get_num_threads()} cores={cores} (pinned early: {self.early_affinity or 'no'}) "
            f"ring '{self.runner.segment}' (delivery {p['ring.delivery']}, spin {spin}) "
            f"navigation_command={p.navigation_command} "
            f"suffix_backend={p.suffix_backend}"
            + (f" (in use: eager: {self.runner.backend.error})" if self.runner.backend.error else "")
            + (f" (building for K={k} in the background, cache {self.runner.backend.cache_dir}; eager meanwhile)"
               if self.runner.backend.status()["building"] is not None else "")
            + (f"; candidate trajectories of all {self.runner.cfg.n_modes} modes on "
               f"{self._candidates_pub.topic_name} (generator_id {self.generator_id})" if self._candidates_pub else "")
            + (" [random-init weights: trajectories are not driving advice]" if self.runner.cfg.random_init else ""))
        if not self.guard.check_age:
            self.get_logger().warning("guard.check_age is false: trajectories are published however old their "
                                      "camera stamp is (for replays of recorded bags, not for a vehicle)")
        return TransitionCallbackReturn.SUCCESS

    def _backend_log(self, level: str, message: str) -> None:
        """Log a line of the suffix backend (its build thread included) at ``level`` (info | warning | error)."""
        getattr(self.get_logger(), level if level in ("info", "warning", "error") else "info")(message)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._odom_sub = self.create_subscription(Odometry, "~/input/kinematic_state", self._on_odometry, 10)
        self._command_sub = self.create_subscription(String, "~/input/navigation_command",
                                                     self._on_navigation_command, 10)
        self._running = True
        self._worker = threading.Thread(target=self._work, name="suffix_worker", daemon=True)
        self._worker.start()
        return super().on_activate(state)

    def _stop(self) -> None:
        self._running = False
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        for name in ("_odom_sub", "_command_sub"):
            sub = getattr(self, name)
            if sub is not None:
                self.destroy_subscription(sub)
                setattr(self, name, None)

    def _release(self) -> None:
        self.fault = ""
        if self._candidates_pub is not None:
            self.destroy_lifecycle_publisher(self._candidates_pub)
            self._candidates_pub = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
            self.get_logger().info("cleaned up: detached from the ring, model freed")

    # ------------------------------------------------------------------------------------- frames
    def _on_odometry(self, msg: Odometry) -> None:
        try:
            ego = ego_state_from_odometry(msg)
        except ValueError as e:
            self._drop("bad_odometry", str(e))
            return
        self._odom.add(ego)

    def _on_navigation_command(self, msg: String) -> None:
        """A command name (NAV_COMMANDS, any case) for the next frames; another name is a counted drop and
        the command in use stays."""
        try:
            index = nav_command_index(msg.data)
        except ValueError as e:
            self._drop("bad_navigation_command", f"~/input/navigation_command: {e}; keeping "
                       f"{NAV_COMMANDS[self._command]}")
            return
        self._set_command(index, "topic ~/input/navigation_command")

    def _apply_live_parameters(self, values: dict) -> None:
        if "navigation_command" in values:  # the schema's enum has checked the name
            self._set_command(nav_command_index(values["navigation_command"]), "parameter navigation_command")
        k = values.get("split_layer")
        if isinstance(k, int) and self.runner is not None:  # 'auto' needs nothing: frames carry their K
            self.runner.request_split_layer(k)
            self.get_logger().info(f"split_layer {k} set: blocks [{k}, {self.runner.cfg.num_layers}) will be ready "
                                   "before the next frame; each frame is computed at the K in its slot header")

    def _live_parameter_problems(self, values: dict) -> list[str]:
        k = values.get("split_layer")
        if isinstance(k, int) and self.runner is not None and k > self.runner.cfg.num_layers:
            return [f"split_layer: {k} out of range [0, {self.runner.cfg.num_layers}] for this model"]
        return []

    def _log_resplits(self, result) -> None:
        """Log and count the block moves the suffix made to follow the frame's split layer."""
        for e in result.resplits:
            self.resplits += 1
            self.resplits_on_demand += int(e.on_demand)
            what = (f"loaded {e.blocks_loaded} block(s) (load {e.load_ms:.1f} ms)" if e.blocks_loaded
                    else f"freed {e.blocks_freed} block(s)")
            self.get_logger().info(
                f"re-split: now holding blocks [{e.new_split_layer}, {self.runner.cfg.num_layers}) for frame seq "
                f"{result.meta.seq} at K={result.meta.split_layer}: {what}, frame waited {e.duration_ms:.1f} ms, weights "
                f"{e.stage_bytes_before / 2**20:.1f} -> {e.stage_bytes_after / 2**20:.1f} MiB"
                + (" (on demand: this side was not told of the move; set split_layer on both nodes to load ahead)"
                   if e.on_demand else ""))

    def _set_command(self, index: int, source: str) -> None:
        """Use navigation command ``index`` (0..5) from the next frame on; a change is logged with its source."""
        with self._command_lock:
            old, self._command = self._command, index
        if old != index:
            self.get_logger().info(f"navigation command {NAV_COMMANDS[old]} -> {NAV_COMMANDS[index]} (from {source})")

    def _check_ring_contract(self) -> None:
        """Log a ring contract that does not fit this suffix once per distinct problem (ERROR, with what to
        change), and report it in /diagnostics (``ring_contract_error``, level ERROR) while it lasts."""
        error = self.runner.contract_error
        if error != self.fault:
            self.fault = error
            if error:
                self.last_error = error
                self.get_logger().error(f"cannot attach to the ring '{self.runner.segment}': {error}; no frame "
                                        "is taken until the prefix and this suffix fit (dtype, model, shape)")
            else:
                self.get_logger().info("the ring's contract fits now")

    def _count_superseded(self) -> None:
        n = self.runner.superseded - self._superseded_seen
        if n > 0:
            self._superseded_seen = self.runner.superseded
            total = self.drops.add("superseded", n)
            self.frames_in += n
            if self._throttle("superseded"):
                self.get_logger().info(f"took the newest frame: {n} older unread frame(s) dropped (superseded, "
                                       f"{total} so far; ring.delivery newest)")

    def _work(self) -> None:
        ring = None  # the ring end we were attached to, to log every (re-)attach
        while self._running and self.context.ok():
            try:
                self.runner.command = self._command  # the command of the frame this poll computes
                try:
                    result = self.runner.poll(0.1)
                finally:
                    self._count_superseded()
                attached = self.runner.attached
                self._check_ring_contract()
                if self.runner.ring is not ring:
                    ring = self.runner.ring
                    if attached:
                        c = ring.contract
                        self.get_logger().info(f"attached to the ring '{self.runner.segment}': {c.describe()}, "
                                               f"conversion to {self.params.dtype}: {ring.conversion}")
                    else:
                        self.get_logger().info("the prefix's ring went away; waiting for it to come back")
                if not attached and not self.fault and self._throttle("attach"):
                    self.get_logger().info(f"waiting for the prefix node's ring: {self.runner.attach_error}")
                if result is not None:
                    self.frames_in += 1
                    if result.resplits:
                        self._log_resplits(result)
                    self._publish(result)
            except SlotRejected as e:
                self.frames_in += 1
                self._drop(f"slot_{e.cause}", str(e))
            except StaleFrame as e:
                self.frames_in += 1
                self._drop("stale_frame", str(e))
            except ResplitError as e:  # no frame was taken: counted as an event, frames_in unchanged
                self._drop("resplit_error", str(e))
            except FloatingPointError as e:
                self.frames_in += 1
                self._drop("non_finite_output", str(e))
            except Exception as e:  # noqa: BLE001 - counted and reported, the node keeps running
                if not self.context.ok():
                    return  # ROS is shutting down (Ctrl-C): publishing can no longer succeed
                self._drop("internal_error", f"{type(e).__name__}: {e}")

    def _publish(self, result) -> None:
        stamp = result.meta.stamp_ns
        # Wait for the odometry after the camera stamp only while it is due (docs/design.md, "Pipeline and
        # timing"); a late or stopped stream holds no frame: the pose is propagated from the newest one.
        budget_s, why = self._odom.wait_budget(stamp, self.params.odometry_wait_s)
        odometry_wait_ms = 0.0
        if budget_s > 0:
            t_wait = time.perf_counter()
            self._odom.wait_for(stamp, budget_s)
            odometry_wait_ms = (time.perf_counter() - t_wait) * 1e3
        try:
            ego, method = self._odom.pose_at(stamp, int(self.params.max_odometry_age_s * 1e9))
        except LookupError as e:
            self._drop(str(e.args[0]), f"no odometry within {self.params.max_odometry_age_s} s of the camera stamp")
            return
        now_ns = self.get_clock().now().nanoseconds
        modes = result.modes
        names = NAV_COMMANDS if modes is not None and len(modes) == len(NAV_COMMANDS) else ()
        out = guarded_outputs(result.waypoints, modes, result.mode, self.runner.cfg.waypoint_dt_s, ego,
                              self.params.wheelbase_m, self.guard, stamp, now_ns,
                              candidates=self._candidates_pub is not None, mode_names=names)
        for cause, message in out.drops:
            hint = f" ({node_base.NO_CLOCK_HINT})" if cause == "guard_no_clock" and self.use_sim_time() else ""
            self._drop(cause, message + hint)
        if out.selected is None:
            return
        violations = out.violations
        if not violations:  # the output guard: an invalid trajectory is never published
            self._traj_pub.publish(trajectory_to_msg(out.selected, stamp, self.params.output_frame))
        t_publish_ns = time.monotonic_ns()
        if out.candidates:
            self._candidates_pub.publish(candidate_trajectories_to_msg(
                out.candidates, stamp, self.params.output_frame, self.generator_id, self.get_fully_qualified_name()))
            self.candidates_out += len(out.candidates)
            self.candidate_msgs_out += 1
        if violations:
            return
        self.frames_out += 1
        if method == "propagated":
            self.odometry_propagated += 1
            self.odometry_late += why == "late"
        stages = {"preprocess": result.preprocess_ms, "prefix": result.prefix_ms,
                  "handoff": result.handoff_ms, "suffix": result.suffix_ms, "odometry_wait": odometry_wait_ms}
        for k, ms in stages.items():
            self.times.add(k, ms)
        # CLOCK_MONOTONIC instants (ns, system-wide): a process on this host can lay frames on one timeline.
        instants = {"t_prefix_start_ns": result.t_prefix_start_ns, "t_write_start_ns": result.meta.t_write_start_ns,
                    "t_ready_ns": result.t_ready_ns, "t_suffix_end_ns": result.t_suffix_end_ns,
                    "t_publish_ns": t_publish_ns}
        timing = node_base.diagnostic_array(self, "frame_timing", node_base.OK, f"seq {result.meta.seq}",
                                         {**{f"{k}_ms": f"{ms:.4f}" for k, ms in stages.items()}, **instants})
        timing.header.stamp = ns_to_stamp(stamp)
        self._timing_pub.publish(timing)

    def _io_counts(self) -> tuple[int, int]:
        return self.frames_in, self.frames_out

    def _ring(self):
        return self.runner.ring if self.runner is not None else None

    def _diagnostic_values(self) -> dict:
        ring = self.runner.ring_stats() if self.runner is not None else {}
        return {"frames_in": self.frames_in, "trajectories_out": self.frames_out,
                "ring_attached": self.runner is not None and self.runner.attached,
                "ring_contract_error": self.fault,
                "ring_conversion": self._ring().conversion if self._ring() is not None else "",
                "ring_owner_alive": self._ring() is not None and self._ring().owner_alive,
                "ring_read": ring.get("read", 0),
                "odometry_propagated": self.odometry_propagated, "odometry_late": self.odometry_late,
                "odometry_time_jumps": self._odom.time_jumps,
                "candidate_trajectories_out": self.candidate_msgs_out, "candidates_out": self.candidates_out,
                "split_layer": self.runner.split_layer if self.runner is not None else "",
                "blocks_held_from": self.runner.stage.split_layer if self.runner is not None else "",
                "resplits": self.resplits, "resplits_on_demand": self.resplits_on_demand,
                "navigation_command": NAV_COMMANDS[self._command],
                **self._backend_diagnostics(),
                "cpu_affinity": sorted(os.sched_getaffinity(0))}

    def _backend_diagnostics(self) -> dict:
        """/diagnostics values of the suffix backend: asked for, in use, the K it covers, build state, error."""
        if self.runner is None:
            return {"suffix_backend": self.params.suffix_backend if self.params else "", "suffix_backend_in_use": ""}
        st = self.runner.backend.status()
        return {"suffix_backend": st["requested"], "suffix_backend_in_use": st["in_use"],
                "suffix_backend_k": "" if st["compiled_k"] is None else st["compiled_k"],
                "suffix_backend_building": "" if st["building"] is None else st["building"],
                "suffix_backend_precision": st["precision"], "suffix_backend_error": st["error"],
                "suffix_backend_frames_compiled": st["frames_compiled"],
                "suffix_backend_frames_eager": st["frames_eager"]}
