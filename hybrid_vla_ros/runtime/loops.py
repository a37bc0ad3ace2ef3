"""The frame loops of the two stages without ROS, shared by the nodes, the bench and the GPU check.

Each loop runs on its own thread (``start`` / ``stop``: the nodes) or is driven frame by frame (``process`` /
``poll_once``: tools); a frame that fails is a drop counted by cause. The host is a :class:`LoopContext`.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..split.resplit import ResplitError
from ..transport.ring import SlotRejected
from ..util.stats import StageTimes
from ..vehicle.ego_input import ACCEL_SOURCES
from ..vehicle.image import ImageDecodeError
from ..model.decode import MAX_TOKENS
from .decoding import NO_REPLY
from .suffix import DecodeDropped, StaleFrame

__all__ = ["LoopContext", "FrameInputs", "FrameInputError", "PrefixLoop", "SuffixLoop", "Drops", "counting_context"]


@dataclass(frozen=True)
class LoopContext:
    """What a loop uses of its host. ``logger``: ``info`` / ``warning`` / ``error`` of one line; ``drop(cause,
    message, n=1)``: count dropped frames of ``cause`` (the host logs them, rate-limited); ``count(cause, n=1) ->
    total``: count without a log line; ``log_every(key) -> bool``: True at most every 2 s per key; ``times``: the
    stage times; ``runner()`` the stage runner now; ``set_fault(text)``: a standing fault ("" clears it);
    ``alive()``: False once the host shuts down."""

    logger: Any
    drop: Callable[..., None]
    count: Callable[..., int]
    log_every: Callable[[str], bool]
    times: StageTimes
    runner: Callable[[], Any]
    set_fault: Callable[[str], None]
    alive: Callable[[], bool]


class Drops(dict):
    """Drops by cause (cause -> count) and ``last``, the message of the latest."""

    last = ""


def counting_context(runner, logger=None) -> tuple[LoopContext, Drops]:
    """A :class:`LoopContext` for a tool that drives a loop itself: drops counted into the returned :class:`Drops`
    by cause, every log line to ``logger`` (default: none)."""
    drops = Drops()

    class _Quiet:
        def info(self, line):
            pass

        warning = error = info

    def count(cause: str, n: int = 1) -> int:
        drops[cause] = drops.get(cause, 0) + n
        return drops[cause]

    def drop(cause: str, message: str, n: int = 1) -> None:
        drops.last = message
        count(cause, n)

    ctx = LoopContext(logger or _Quiet(), drop, count, lambda key: True, StageTimes(), lambda: runner,
                      lambda text: None, lambda: True)
    return ctx, drops


@dataclass
class FrameInputs:
    """What a frame takes beside its cameras: the ego state (speed m/s, acceleration m/s^2, yaw rate rad/s) at
    its stamp where the model takes it, the query heads' scene inputs, where the acceleration came from, and how
    long the host waited for them (ms; NaN: not timed)."""

    ego_state: tuple | None = None
    scene: Any = None
    accel_source: str | None = None
    ego_wait_ms: float = math.nan


class FrameInputError(Exception):
    """A frame's inputs cannot be had (no ego state, no camera geometry): dropped as ``cause``, with ``message``."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


class PrefixLoop:
    """The prefix's frame loop: newest frame only, paced to a slower suffix, split-layer moves between frames.

    Frames are (stamp ns, camera-order items). With ``pace`` a frame waits per ``PrefixRunner.pacing_delay_s``
    (newer frames replace it meanwhile). ``frame_inputs(stamp, items) -> FrameInputs`` may raise
    :class:`FrameInputError`; ``after_frame()`` runs after each frame out (the split-layer policy; its errors are
    logged, not drops); ``resplit`` is told of each move applied; ``on_decode(seq, FollowedDecode)`` of each decoding
    model's frame whose decode ended (on the runner's follower thread)."""

    #: Longest wait (s) before the pacing delay is asked again (it shrinks; the suffix's announcement may change).
    PACE_RECHECK_S = 0.1

    def __init__(self, ctx: LoopContext, *, pace: bool = True,
                 frame_inputs: Callable[[int, list], FrameInputs] | None = None,
                 after_frame: Callable[[], None] | None = None, resplit: Callable[[Any], None] | None = None,
                 on_decode: Callable[[int, Any], None] | None = None):
        self._ctx, self.pace = ctx, pace
        self._on_decode = on_decode
        self._frame_inputs = frame_inputs or (lambda stamp, items: FrameInputs())
        self._after_frame, self._on_resplit = after_frame, resplit
        self._pending = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.frames_out = 0
        self.ego_accel_sources = {source: 0 for source in ACCEL_SOURCES}
        self.resplits = 0
        self.decode_tokens = 0  # tokens the suffix chose in this prefix's decodes
        self.last_decode = None  # the last frame's FollowedDecode

    @property
    def running(self) -> bool:
        """True from :meth:`start` to :meth:`stop`."""
        return self._running

    def start(self) -> None:
        """Start the thread ('prefix_worker', daemon)."""
        self._running = True
        self._thread = threading.Thread(target=self._work, name="prefix_worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread after the frame in progress (idempotent); a frame not started is ``deactivated``."""
        with self._cv:
            self._running = False
            if self._pending is not None:
                self._ctx.count("deactivated")
            self._pending = None
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def offer(self, frame) -> None:
        """Make ``frame`` the next one to compute, in place of any still waiting (that one is ``superseded``)."""
        with self._cv:
            if self._pending is not None:
                self._ctx.drop("superseded", "a newer synchronized frame arrived before the worker took this "
                                             "one (the prefix is slower than the camera rate)")
            self._pending = frame
            self._cv.notify()

    def wake(self) -> None:
        """Wake an idle thread, e.g. to apply a split layer just requested at once."""
        with self._cv:
            self._cv.notify()

    def process(self, frame):
        """Compute ``frame`` now on this thread, after the pacing wait; None when it was dropped."""
        runner = self._ctx.runner()
        if self.pace:
            import time

            while (delay := runner.pacing_delay_s()) > 0 and not runner.split_requested:
                time.sleep(min(delay, self.PACE_RECHECK_S))
        return self._compute(runner, frame)

    def _work(self) -> None:
        runner = self._ctx.runner()
        while True:
            with self._cv:
                while self._running and self._pending is None and not runner.split_requested:
                    self._cv.wait()
                while self._running and self._pending is not None and self.pace and not runner.split_requested:
                    delay = runner.pacing_delay_s()
                    if delay <= 0:
                        break
                    self._cv.wait(min(delay, self.PACE_RECHECK_S))
                if not self._running:
                    return
                frame, self._pending = self._pending, None
            if frame is None:  # a split layer change while no frame waits: apply it now (frees memory now)
                self._apply_split_request(runner)
            else:
                self._compute(runner, frame)

    def _apply_split_request(self, runner) -> None:
        try:  # blocks for a move up loaded in the background: check back every 50 ms (frames may come)
            event = runner.apply_split_request(timeout=0.05)
        except Exception as e:  # noqa: BLE001 - e.g. a missing block in the checkpoint: counted, K stays
            self._ctx.drop("resplit_error", str(e))
            return
        if event is not None:
            self._resplit(event)

    def _compute(self, runner, frame):
        ctx = self._ctx
        stamp, items = frame
        try:
            got = self._frame_inputs(stamp, items)
        except FrameInputError as e:
            ctx.drop(e.cause, str(e))
            return None
        runner.on_decode = self._decode_done  # a decoding model's frame ends on the follower's thread
        try:
            result = runner.run(items, stamp, ego_state=got.ego_state, ego_wait_ms=got.ego_wait_ms, scene=got.scene)
        except ImageDecodeError as e:
            ctx.drop("decode_error", str(e))
            return None
        except (ValueError, FloatingPointError) as e:
            ctx.drop("model_error", str(e))
            return None
        except Exception as e:  # noqa: BLE001 - the loop keeps running, the error is counted and reported
            ctx.drop("internal_error", f"{type(e).__name__}: {e}")
            return None
        self.frames_out += 1
        if result.resplit is not None:
            self._resplit(result.resplit)
        if self._after_frame is not None:
            try:
                self._after_frame()
            except Exception as e:  # noqa: BLE001 - the frame is out; a failing judgement must not stop the loop
                if ctx.log_every("split_policy"):
                    ctx.logger.error(f"split-layer policy failed, K stays: {type(e).__name__}: {e}")
        if result.resplit_error is not None:
            ctx.drop("resplit_error", result.resplit_error)
        if got.accel_source is not None:
            self.ego_accel_sources[got.accel_source] += 1
        ctx.times.add("preprocess", result.preprocess_ms)
        ctx.times.add("prefix", result.prefix_ms)
        return result

    def _decode_done(self, seq: int, decode) -> None:
        """A frame's decode ended (:class:`~.decoding.FollowedDecode`, on the follower's thread)."""
        ctx = self._ctx
        self.decode_tokens += len(decode.tokens)
        for ms in decode.prefix_step_ms:
            ctx.times.add("prefix_token", ms)
        if decode.ended == NO_REPLY:
            ctx.drop("decode_no_reply", f"frame seq {seq}: the suffix did not answer a decode step after "
                                        f"{len(decode.tokens)} token(s) (it went away or hangs)")
        elif decode.ended.startswith("error"):
            ctx.drop("model_error", f"frame seq {seq}: a decode step failed: {decode.ended}")
        self.last_decode = decode
        if self._on_decode is not None:
            self._on_decode(seq, decode)

    def _resplit(self, event) -> None:
        self.resplits += 1
        if self._on_resplit is not None:
            self._on_resplit(event)


class SuffixLoop:
    """The suffix's frame loop: each frame from the ring, computed with ``command()``, goes to ``publish(result)``.

    A ring contract that does not fit is the host's fault while it lasts. ``on_attach(attached)`` is told of every
    (re-)attach and loss, ``on_resplits(result)`` of a frame's block moves. ``frames_in`` counts every frame
    taken, rejected and superseded ones included."""

    def __init__(self, ctx: LoopContext, *, publish: Callable[[Any], None], command: Callable[[], int] | None = None,
                 on_attach: Callable[[bool], None] | None = None, on_resplits: Callable[[Any], None] | None = None,
                 poll_s: float = 0.1):
        self._ctx, self._publish, self._command = ctx, publish, command
        self._on_attach, self._on_resplits, self.poll_s = on_attach, on_resplits, poll_s
        self._thread: threading.Thread | None = None
        self._running = False
        self._superseded_seen = 0
        self._fault = ""
        self._ring = None
        self.frames_in = 0
        self.resplits = 0
        self.resplits_on_demand = 0
        #: Decoding models: frames decoded, tokens decoded, frames that ended at max_new_tokens, the last frame's.
        self.decode_frames = self.decode_tokens = self.decode_max_tokens = 0
        self.last_decode = None

    def new_runner(self) -> None:
        """The host has a new SuffixRunner: its superseded count starts at 0, no contract fault is known."""
        self._superseded_seen, self._fault, self._ring = 0, "", None

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
        while self._running and self._ctx.alive():
            self.poll_once(self.poll_s)

    def poll_once(self, timeout_s: float):
        """Wait up to ``timeout_s`` s for a frame, compute and publish it; None when none came or it was dropped."""
        ctx = self._ctx
        runner = ctx.runner()
        try:
            if self._command is not None:
                runner.command = self._command()
            try:
                result = runner.poll(timeout_s)
            finally:
                self._count_superseded(runner)
            self._check_ring(runner)
            if result is None:
                return None
            self.frames_in += 1
            for e in result.resplits:
                self.resplits += 1
                self.resplits_on_demand += int(e.on_demand)
            if result.resplits and self._on_resplits is not None:
                self._on_resplits(result)
            if result.decode is not None:
                self._count_decode(result.decode)
            self._publish(result)
            return result
        except DecodeDropped as e:
            self.frames_in += 1
            if e.outcome is not None:
                self._count_decode(e.outcome)
            ctx.drop(e.cause, str(e))
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
        except Exception as e:  # noqa: BLE001 - counted and reported, the loop keeps running
            if ctx.alive():
                ctx.drop("internal_error", f"{type(e).__name__}: {e}")
        return None

    def _count_decode(self, decode) -> None:
        ctx = self._ctx
        self.decode_frames += 1
        self.decode_tokens += len(decode.tokens)
        self.decode_max_tokens += int(decode.ended == MAX_TOKENS)
        self.last_decode = decode
        for ms in decode.suffix_token_ms:
            ctx.times.add("suffix_token", ms)
        for ms in decode.prefix_token_ms:
            ctx.times.add("prefix_token", ms)

    def _check_ring(self, runner) -> None:
        """Report each distinct contract problem once, and every (re-)attach and loss of the ring."""
        ctx, error = self._ctx, runner.contract_error
        if error != self._fault:
            self._fault = error
            ctx.set_fault(error)
            if error:
                ctx.logger.error(f"cannot attach to the ring '{runner.segment}': {error}; no frame is taken until the "
                                 "prefix and this suffix fit (dtype, model, shape)")
            else:
                ctx.logger.info("the ring's contract fits now")
        if runner.ring is not self._ring:
            self._ring = runner.ring
            if self._on_attach is not None:
                self._on_attach(runner.attached)
        if not runner.attached and not runner.contract_error and ctx.log_every("attach"):
            ctx.logger.info(f"waiting for the prefix node's ring: {runner.attach_error}")

    def _count_superseded(self, runner) -> None:
        n = runner.superseded - self._superseded_seen
        if n > 0:
            self._superseded_seen = runner.superseded
            total = self._ctx.count("superseded", n)
            self.frames_in += n
            if self._ctx.log_every("superseded"):
                self._ctx.logger.info(f"took the newest frame: {n} older unread frame(s) dropped (superseded, {total} "
                                      "so far; ring.delivery newest)")
