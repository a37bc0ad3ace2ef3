"""The suffix node's worker thread: ring -> SuffixRunner.poll -> ego pose -> guarded trajectory.

Imports nothing from ROS: it reads the runner and settings of its node's PartContext, counts drops through it,
and publishes through the node's TrajectoryOutputs (suffix_outputs).
"""
from __future__ import annotations

import threading

from ..runtime.suffix import StaleFrame
from ..split.resplit import ResplitError
from ..transport.ring import SlotRejected


class SuffixWorker:
    """One thread that takes frames from the ring and publishes their trajectories.

    Each poll (0.1 s) computes the next frame with the command of ``inputs``; the frame's ego pose comes from
    ``inputs`` (SuffixInputs.pose_at) and what it may publish goes out through ``outputs``
    (TrajectoryOutputs.publish). The thread attaches to the prefix's ring (logging every attach and loss,
    waiting while the prefix has none), reports a ring contract that does not fit as the node's ``fault``, and
    logs the block moves that follow the prefix's split layer. A rejected slot, a stale frame, a re-split or
    compute error is a counted drop and the thread goes on. Counts ``frames_in`` (frames taken from the ring,
    rejected and superseded ones included), ``resplits`` and ``resplits_on_demand``.
    """

    def __init__(self, ctx, inputs, outputs):
        """``ctx``: the node's node_base.PartContext; ``inputs``: suffix_inputs.SuffixInputs; ``outputs``:
        suffix_outputs.TrajectoryOutputs."""
        self._ctx = ctx
        self._inputs = inputs
        self._outputs = outputs
        self._thread: threading.Thread | None = None
        self._running = False
        self._superseded_seen = 0
        self._fault = ""  # the ring contract error last reported as the node's fault
        self.frames_in = 0  # frames taken from the ring, rejected ones included
        self.resplits = 0  # block moves (loads or frees) that followed the prefix's split layer
        self.resplits_on_demand = 0  # of which loads for a frame at a K this side was not prepared for

    def new_runner(self) -> None:
        """The node has a new SuffixRunner (configure): its count of superseded frames starts at 0, and no ring
        contract fault is known for it."""
        self._superseded_seen = 0
        self._fault = ""

    @property
    def running(self) -> bool:
        """True from :meth:`start` to :meth:`stop`."""
        return self._running

    def start(self) -> None:
        """Start the thread ('suffix_worker', daemon)."""
        self._running = True
        self._thread = threading.Thread(target=self._work, name="suffix_worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the poll in progress (idempotent)."""
        self._running = False
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _work(self) -> None:
        ctx = self._ctx
        runner, log = ctx.runner(), ctx.logger
        ring = None  # the ring end we were attached to, to log every (re-)attach
        while self._running and ctx.ros_ok():
            try:
                runner.command = self._inputs.command  # the command of the frame this poll computes
                try:
                    result = runner.poll(0.1)
                finally:
                    self._count_superseded()
                attached = runner.attached
                self._check_ring_contract()
                if runner.ring is not ring:
                    ring = runner.ring
                    if attached:
                        c = ring.contract
                        log.info(f"attached to the ring '{runner.segment}': {c.describe()}, "
                                 f"conversion to {ctx.settings().dtype}: {ring.conversion}")
                    else:
                        log.info("the prefix's ring went away; waiting for it to come back")
                if not attached and not runner.contract_error and ctx.log_every("attach"):
                    log.info(f"waiting for the prefix node's ring: {runner.attach_error}")
                if result is not None:
                    self.frames_in += 1
                    if result.resplits:
                        self._log_resplits(result)
                    self._publish(result)
            except SlotRejected as e:
                self.frames_in += 1
                ctx.drop(f"slot_{e.cause}", str(e))
            except StaleFrame as e:
                self.frames_in += 1
                ctx.drop("stale_frame", str(e))
            except ResplitError as e:  # no frame was taken: counted as an event, frames_in unchanged
                ctx.drop("resplit_error", str(e))
            except FloatingPointError as e:
                self.frames_in += 1
                ctx.drop("non_finite_output", str(e))
            except Exception as e:  # noqa: BLE001 - counted and reported, the node keeps running
                if not ctx.ros_ok():
                    return  # ROS is shutting down (Ctrl-C): publishing can no longer succeed
                ctx.drop("internal_error", f"{type(e).__name__}: {e}")

    def _publish(self, result) -> None:
        p = self._ctx.settings()
        try:
            ego, method, why, wait_ms = self._inputs.pose_at(result.meta.stamp_ns, p.odometry_wait_s,
                                                             p.max_odometry_age_s)
        except LookupError as e:
            self._ctx.drop(str(e.args[0]), f"no odometry within {p.max_odometry_age_s} s of the camera stamp")
            return
        if self._outputs.publish(result, ego, wait_ms):
            self._inputs.count_placed(method, why)

    def _check_ring_contract(self) -> None:
        """Log a ring contract that does not fit this suffix once per distinct problem (ERROR, with what to
        change), and report it in /diagnostics (``ring_contract_error``, level ERROR) while it lasts."""
        ctx = self._ctx
        runner = ctx.runner()
        error = runner.contract_error
        if error != self._fault:
            self._fault = error
            ctx.set_fault(error)
            if error:
                ctx.logger.error(f"cannot attach to the ring '{runner.segment}': {error}; no frame "
                                 "is taken until the prefix and this suffix fit (dtype, model, shape)")
            else:
                ctx.logger.info("the ring's contract fits now")

    def _count_superseded(self) -> None:
        runner = self._ctx.runner()
        n = runner.superseded - self._superseded_seen
        if n > 0:
            self._superseded_seen = runner.superseded
            total = self._ctx.count("superseded", n)
            self.frames_in += n
            if self._ctx.log_every("superseded"):
                self._ctx.logger.info(f"took the newest frame: {n} older unread frame(s) dropped (superseded, "
                                             f"{total} so far; ring.delivery newest)")

    def _log_resplits(self, result) -> None:
        """Log and count the block moves the suffix made to follow the frame's split layer."""
        for e in result.resplits:
            self.resplits += 1
            self.resplits_on_demand += int(e.on_demand)
            what = (f"loaded {e.blocks_loaded} block(s) (load {e.load_ms:.1f} ms)" if e.blocks_loaded
                    else f"freed {e.blocks_freed} block(s)")
            self._ctx.logger.info(
                f"re-split: now holding blocks [{e.new_split_layer}, {self._ctx.runner().cfg.num_layers}) for frame "
                f"seq {result.meta.seq} at K={result.meta.split_layer}: {what}, frame waited {e.duration_ms:.1f} ms, "
                f"weights {e.stage_bytes_before / 2**20:.1f} -> {e.stage_bytes_after / 2**20:.1f} MiB"
                + (" (on demand: this side was not told of the move; set split_layer on both nodes to load ahead)"
                   if e.on_demand else ""))
