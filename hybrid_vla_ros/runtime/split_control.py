"""The prefix's split layer K, without ROS: the plan of ``split_layer: auto``, a K set while running, and the one
policy that moves it live (measured stage times, memory pressure; split.rebalance). The prefix node, the bench's
load step and the GPU check all move K through :class:`SplitLayerControl`."""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

import torch

from .device import resolve_device
from .settings import SplitPolicySettings


class Timers(Protocol):
    """A host's periodic timers: ``start(period_s, fn) -> handle`` calls ``fn`` every ``period_s`` (steady clock)
    until ``cancel(handle)``."""

    def start(self, period_s: float, fn: Callable[[], None]) -> Any: ...

    def cancel(self, handle: Any) -> None: ...


def cuda_free_bytes(runner) -> int:
    """Free memory of the runner's CUDA device, bytes (the driver's count)."""
    return int(torch.cuda.mem_get_info(runner.device)[0])


class SplitLayerControl:
    """Chooses the prefix's split layer K and asks the PrefixRunner to move it; the worker applies moves between
    frames (``wake`` tells it one was requested).

    K is ``split_layer``, or for ``auto`` a plan's (``plan``) for the memory budget. With ``auto`` while active, one
    policy (split.rebalance.SplitPolicy) moves it: the latency balancer after every frame, and on CUDA a 2 s
    memory-pressure timer; memory wins. ``moves`` counts moves by kind ('latency', 'memory'); ``reason`` is the
    last judgement (/diagnostics); ``on_move(move, from_k)`` is told of each request. ``settings()``: the
    :class:`SplitPolicySettings` now (None while unconfigured); ``timers`` None: the caller runs
    :meth:`check_memory`; ``read_free(runner)``: free device bytes (default: CUDA's).
    """

    def __init__(self, ctx, settings: Callable[[], SplitPolicySettings | None],
                 wake: Callable[[], None] = lambda: None, *, timers: Timers | None = None,
                 read_free: Callable[[Any], int] = cuda_free_bytes, on_move: Callable[[Any, int], None] | None = None):
        self._ctx, self._settings, self._wake = ctx, settings, wake
        self._timers, self._read_free, self._on_move = timers, read_free, on_move
        self.plan = None  # the split plan of `split_layer: auto` (split.planner.Plan), None for a fixed K
        self._timer = None
        self._policy = None  # split.rebalance.SplitPolicy of the running `auto` plan
        self._lock = threading.Lock()  # the loop's after_frame and the host's timer share the policy
        self.moves = {"latency": 0, "memory": 0}
        self.reason = ""

    @classmethod
    def of_policy(cls, ctx, policy, **kwargs) -> "SplitLayerControl":
        """A control that runs the caller's ``policy`` from the first frame, as ``split_layer: auto`` does."""
        control = cls(ctx, lambda: None, **kwargs)
        control.plan, control._policy = policy.plan, policy
        return control

    def initial_layer(self, p: SplitPolicySettings) -> int:
        """K to load at configure (settings ``p``); logs the plan's reason for 'auto'. Raises ValueError (no K
        fits, bad profile), FileNotFoundError."""
        self.plan = None
        self._policy = None
        k = p.split_layer
        if k == "auto":
            self.plan = self.make_plan(p)
            k = self.plan.chosen_k
            self._ctx.logger.info(f"split_layer auto: {self.plan.reason}")
        return k

    def make_plan(self, p: SplitPolicySettings, budget_bytes: int | None = None):
        """The plan of ``split_layer: auto`` for ``budget_bytes`` (default: ``gpu_budget_gb``, else CUDA's free
        memory). Raises ValueError (no K fits, bad profile), FileNotFoundError."""
        from ..split.planner import plan_for_checkpoint

        device = resolve_device(p.device)
        if budget_bytes is not None:
            budget_gb = budget_bytes / 1e9
        elif p.gpu_budget_gb > 0:
            budget_gb = p.gpu_budget_gb
        elif device.type == "cuda":
            # free memory, plus what this prefix holds already when it is running (a live switch to auto)
            held = torch.cuda.memory_reserved(device) if self._ctx.runner() is not None else 0
            budget_gb = (torch.cuda.mem_get_info(device)[0] + held) / 1e9
        else:
            budget_gb = None  # a CPU prefix: no device budget
        return plan_for_checkpoint(p.model_path, p.profile_path or None, budget_gb, p.dtype,
                                   cuda_overhead_gb=None if device.type == "cuda" else 0.0)

    def set_split_layer(self, k, active: bool) -> None:
        """Request K = ``k`` (an int, or 'auto': a new plan) of the running prefix; None or an unconfigured
        node: nothing (configure reads it). ``active``: the worker runs (for the memory-pressure timer)."""
        runner, log = self._ctx.runner(), self._ctx.logger
        if k is None or runner is None:
            return  # unconfigured: read at configure
        if k == "auto":
            try:
                plan = self.make_plan(self._settings())
            except (ValueError, OSError) as e:
                log.error(f"split_layer auto: no plan ({e}); K stays {runner.split_layer}")
                return
            log.info(f"split_layer auto: {plan.reason}")
            k = plan.chosen_k
        else:
            plan = None
        with self._lock:
            self.plan, self._policy, self.reason = plan, None, ""
        self.update_timer(active)
        runner.request_split_layer(k)
        self._wake()  # an idle worker applies it at once
        log.info(f"split_layer {k} requested (now {runner.split_layer}): the frame in progress "
                 "finishes at its K, the next one is computed at the new K")

    def _make_policy(self):
        """The running plan's SplitPolicy, built on first use (why a part is off is logged once). Hold ``_lock``."""
        from ..split.planner import AutoResplitPolicy
        from ..split.rebalance import LatencyBalancer, SplitPolicy

        ctx, p, runner = self._ctx, self._settings(), self._ctx.runner()
        memory = latency = None
        if p.auto_resplit_free_mb > 0 and runner.device.type == "cuda":
            try:
                memory = AutoResplitPolicy(self.plan, *AutoResplitPolicy.thresholds(p.auto_resplit_free_mb,
                                                                                     p.auto_resplit_recover_mb))
            except ValueError as e:
                ctx.logger.error(f"auto re-split on memory pressure off: {e}")
        if p.auto_rebalance:
            try:
                latency = LatencyBalancer.from_plan(self.plan, paced=p.pace_to_suffix,
                                                    max_step=p.auto_rebalance_max_step)
            except ValueError as e:
                self.reason = f"live rebalancing off: {e}"
                ctx.logger.warning(self.reason)
        self._policy = SplitPolicy(self.plan, memory=memory, latency=latency)
        if latency is not None:
            step = (f"at most {latency.max_step} block(s) a move" if latency.max_step
                    else "straight to the best K")
            ctx.logger.info(f"live rebalancing on: K moves within K <= {self._policy.k_max} towards the lowest "
                            f"latency at the measured load ({step}; back when a move measures slower)")
        return self._policy

    def after_frame(self, camera_period_ns: int | None) -> None:
        """On the worker after each frame: with ``auto``, request the latency move the policy decides."""
        runner = self._ctx.runner()
        if runner is None or (self.plan is None and self._policy is None):
            return
        sample = runner.stage_sample(camera_period_ns)
        if sample is None:
            return
        with self._lock:
            policy = self._policy if self._policy is not None else self._make_policy()
            if policy.latency is None:
                return
            move = policy.on_frame(sample, runner.split_layer)
            self.reason = move.reason
        if move.k is not None and move.k != runner.split_layer and not runner.split_requested:
            self.moves["latency"] += 1
            self._ctx.logger.info(f"rebalancing K {runner.split_layer} -> {move.k}: {move.reason}")
            self._request(runner, move)

    def update_timer(self, active: bool) -> None:
        """Run the memory-pressure timer while ``active`` with ``auto``, ``auto_resplit_free_mb`` > 0 and CUDA; else
        stop it. Going active builds the policy now rather than at the first frame."""
        runner, p = self._ctx.runner(), self._settings()
        if active and self.plan is not None and runner is not None and p is not None:
            with self._lock:
                if self._policy is None:
                    self._make_policy()
        wanted = (active and self.plan is not None and p is not None and p.auto_resplit_free_mb > 0
                  and runner is not None and runner.device.type == "cuda" and self._timers is not None)
        if wanted and self._timer is None:
            self._timer = self._timers.start(2.0, self.check_memory)
        elif not wanted:
            self.stop_timer()

    def stop_timer(self) -> None:
        """Stop the memory-pressure check (idempotent)."""
        if self._timer is not None:
            self._timers.cancel(self._timer)
            self._timer = None

    def _request(self, runner, move) -> None:
        if self._on_move is not None:
            self._on_move(move, runner.split_layer)
        runner.request_split_layer(move.k)

    def check_memory(self) -> None:
        """Memory-pressure check (split.planner.AutoResplitPolicy): K down when free memory falls under
        ``auto_resplit_free_mb``, back up (at most to the plan's K; with rebalancing, the balancer's way) once
        ``auto_resplit_recover_mb`` stays free for 3 readings."""
        ctx = self._ctx
        runner = ctx.runner()
        if runner is None or (self.plan is None and self._policy is None):
            return
        free = self._read_free(runner)
        with self._lock:
            policy = self._policy if self._policy is not None else self._make_policy()
            if policy.memory is None:
                return
            try:
                move = policy.on_memory(runner.split_layer, free)
            except ValueError as e:
                if ctx.log_every("memory_pressure"):
                    ctx.logger.error(f"free device memory {free / 2**20:.0f} MiB under the threshold and no split "
                                     f"layer fits: {e}")
                return
            if move.k is not None or (policy.latency is None and move.reason):
                self.reason = move.reason  # a reading that moves nothing leaves the latency judgement shown
        if move.k is not None and move.k != runner.split_layer:
            self.moves["memory"] += 1
            ctx.logger.warning(f"moving K {runner.split_layer} -> {move.k}: {move.reason}")
            self._request(runner, move)
            self._wake()
