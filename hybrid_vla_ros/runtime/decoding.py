"""Decoding across the split over the ring (issue 40): after a frame's prefill crosses in a slot, the suffix
answers it with the first token, the prefix runs that token through blocks [0, K) and sends the rows down as a
decode step, and so on until the suffix ends the frame (stop token or ``max_new_tokens``).

The sides' model work is :class:`~hybrid_vla_ros.model.decode.PrefixDecoding` and
:class:`~hybrid_vla_ros.model.decode.SuffixDecoding` (the same objects :func:`~hybrid_vla_ros.model.decode.
decode_in_process` hands to each other directly); what crosses is the ring's decode channel
(:class:`~hybrid_vla_ros.transport.decode_channel.DecodeRegion`). Either side gives up a frame whose peer does not
answer within its timeout and says so (``no_reply`` / ``no_step``); the other side then finds the frame abandoned.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from ..model.decode import MAX_TOKENS, STOP_TOKEN, PrefixDecoding, SuffixDecoding
from ..transport import decode_channel as channel

__all__ = ["FollowedDecode", "AnsweredDecode", "PrefixDecodeLoop", "SuffixDecodeLoop", "NO_REPLY", "NO_STEP",
           "SKIPPED", "ENDED_UNSEEN", "StepFirst", "DecodeFollower", "chunk_modules"]

#: How a frame's decode ended on the side that waited in vain; ``SKIPPED``: the suffix answers a later frame (it
#: never took this one); ``ENDED_UNSEEN``: the suffix answers a later frame after answering steps of this one, and
#: this frame's ending reply is gone from the channel too (the channel keeps the latest reply and a copy of the
#: latest ending one: a later frame also ended before the prefix read this one's, a prefix held off its core that
#: long): the suffix's record says how it ended.
NO_REPLY, NO_STEP, SKIPPED, ENDED_UNSEEN = "no_reply", "no_step", "skipped", "ended_unseen"
#: How often a waiting side asks whether its peer is still there (s).
PEER_CHECK_S = 0.25
_END_CODE = {"": channel.GO_ON, STOP_TOKEN: channel.STOP_TOKEN, MAX_TOKENS: channel.MAX_TOKENS}


@dataclass
class FollowedDecode:
    """One frame's decode as the prefix followed it: the ``tokens`` the suffix chose (placed read-out tokens not
    included), how it ended (:data:`~hybrid_vla_ros.model.decode.STOP_TOKEN`, ``MAX_TOKENS``, ``abandoned``,
    :data:`NO_REPLY`, :data:`SKIPPED` or :data:`ENDED_UNSEEN`: then ``tokens`` lacks the last reply's), ``placed``
    (tokens run for the read-out after the decode), and per step the prefix's compute (ms: embedding + blocks
    [0, K)) and its wait for the reply (ms: from publishing the step, or the prefill slot,
    to the reply: the suffix's compute and both crossings)."""

    tokens: list[int] = field(default_factory=list)
    ended: str = ""
    placed: int = 0
    turn_tokens: int = 0  # tokens of turns run between decodes (decode.turns)
    prefix_step_ms: list[float] = field(default_factory=list)
    reply_wait_ms: list[float] = field(default_factory=list)
    step_held_ms: list[float] = field(default_factory=list)  # each step's wait for a prefill chunk (overlap)


@dataclass
class AnsweredDecode:
    """One frame's decode as the suffix answered it: the ``tokens`` and ``logits`` (V,) float32 per step (from
    :class:`~hybrid_vla_ros.model.decode.SuffixDecoding`), how it ended (``STOP_TOKEN``, ``MAX_TOKENS`` or
    :data:`NO_STEP`), per token the suffix's compute (ms: blocks [K, L), norm, LM head, choice) and, from the
    second token on, its wait for the step (ms: from its reply to the step's arrival) and the prefix's compute of
    it (ms, from the step's header: ``prefix_step_ms``); ``plan``: the planning
    head's :class:`~hybrid_vla_ros.model.modeling.PlanOutput` on the tokens placed after the decode (None when none
    are placed or the frame ended without them), ``readout_ms`` its compute (ms); ``turn_starts``: where each decode
    after a turn starts in ``tokens`` (a turn's steps count in the per-token lists as steps)."""

    tokens: list[int]
    logits: list[torch.Tensor]
    ended: str
    suffix_token_ms: list[float] = field(default_factory=list)
    step_wait_ms: list[float] = field(default_factory=list)
    plan: object = None
    readout_ms: float = 0.0
    prefix_step_ms: list[float] = field(default_factory=list)  # each step's prefix compute, as the step said
    turn_starts: list[int] = field(default_factory=list)


class PrefixDecodeLoop:
    """The prefix's part after it published a frame's prefill slot: wait for each reply, run the chosen token(s)
    through ``decoding`` and publish the step on ``region``, until the suffix ends the frame or does not reply
    within ``reply_timeout_s`` (s)."""

    def __init__(self, decoding: PrefixDecoding, region: channel.DecodeRegion, reply_timeout_s: float,
                 peer_alive=None):
        self.decoding, self.region, self.reply_timeout_s = decoding, region, float(reply_timeout_s)
        #: Asked every :data:`PEER_CHECK_S` while a reply is awaited: False ends the frame at once (``no_reply``).
        self.peer_alive = peer_alive or (lambda: True)

    def _wait_reply(self, frame: int, index: int, skipped: bool = False):
        """The reply to step ``index`` of ``frame``; None at the timeout or once the peer is gone; when the suffix
        already replies to a later frame: at the prefill (``index`` 0) :data:`SKIPPED` with ``skipped``, after a
        step :data:`ENDED_UNSEEN` (this frame's ending reply and its copy were both replaced before it was read)."""
        deadline = time.monotonic() + self.reply_timeout_s
        while True:
            left = deadline - time.monotonic()
            reply = self.region.wait_reply(frame, index, max(0.0, min(PEER_CHECK_S, left)))
            if reply is not None or left <= PEER_CHECK_S or not self.peer_alive():
                return reply
            if skipped or index > 0:
                latest = self.region.latest_reply()
                if latest is not None and latest.frame > frame:
                    return ENDED_UNSEEN if index > 0 else SKIPPED

    def follow(self, frame: int, gate: StepFirst | None = None, skipped: bool = False) -> FollowedDecode:
        """Follow the decode of the frame whose prefill slot has seq ``frame`` (its prefill already run by
        ``decoding.prefill``); each step's compute inside ``gate.step()`` when given; with ``skipped`` a frame the
        suffix passed over ends :data:`SKIPPED`. Raises what the prefix stage raises (the suffix then finds no step:
        ``no_step``)."""
        done, index, in_turn = FollowedDecode(), 0, False
        sm = self.decoding.sm
        while True:
            t0 = time.perf_counter_ns()
            reply = self._wait_reply(frame, index, skipped)
            done.reply_wait_ms.append((time.perf_counter_ns() - t0) / 1e6)
            if reply is None or reply in (SKIPPED, ENDED_UNSEEN):
                done.ended = NO_REPLY if reply is None else reply
                return done
            if reply.end == channel.PLACE:
                done.placed += len(reply.tokens)
            elif reply.end == channel.TURN:  # a turn's first step leads with the decode's last token
                lead = 0 if in_turn else 1
                done.tokens.extend(reply.tokens[:lead])
                done.turn_tokens += len(reply.tokens) - lead
            else:
                done.tokens.extend(reply.tokens)
            in_turn = reply.end == channel.TURN
            if reply.ended:
                done.placed = max(0, done.placed - 1)  # the last decoded token led the placed ones
                done.ended = {channel.STOP_TOKEN: STOP_TOKEN, channel.MAX_TOKENS: MAX_TOKENS}.get(
                    reply.end, channel.END_NAMES[reply.end])
                return done
            with gate.step() if gate is not None else nullcontext(0.0) as held_ms:
                t1 = time.perf_counter_ns()
                rows, positions = sm.step_crossing(self.decoding.step(reply.tokens,
                                                                      placed=reply.end == channel.PLACE))
                if not torch.isfinite(rows).all():
                    raise FloatingPointError("the prefix produced non-finite hidden states in a decode step")
                compute_ns = time.perf_counter_ns() - t1
            done.step_held_ms.append(held_ms)
            index += 1
            self.region.publish_step(frame, index, rows, positions, compute_ns)
            done.prefix_step_ms.append(compute_ns / 1e6)


class SuffixDecodeLoop:
    """The suffix's part for a frame taken from the ring: answer the prefill, then each step the prefix sends on
    ``region``, with ``decoding``; a step that does not come within ``step_timeout_s`` (s) ends the frame
    (:data:`NO_STEP`). ``dtype``: the suffix's compute dtype (step rows are converted from the ring's)."""

    def __init__(self, decoding: SuffixDecoding, region: channel.DecodeRegion, step_timeout_s: float,
                 dtype: torch.dtype, peer_alive=None):
        self.decoding, self.region = decoding, region
        self.step_timeout_s, self.dtype = float(step_timeout_s), dtype
        #: Asked every :data:`PEER_CHECK_S` while a step is awaited: False ends the frame at once (``no_step``).
        self.peer_alive = peer_alive or (lambda: True)
        self._prefix_ms: list[float] = []

    def answer(self, frame: int, prefill, k: int | None = None) -> AnsweredDecode:
        """Decode the frame whose prefill slot has seq ``frame`` and split layer ``k`` (default the decoding's);
        ``prefill``: the slot's state (h_K, or a SplitState with its side tensors) in this suffix's dtype. After the
        decode, the tokens the decoding places (:meth:`~hybrid_vla_ros.model.decode.SuffixDecoding.placed_steps`)
        are sent up, their rows come down, and the planning head reads the last step. Raises ValueError /
        FloatingPointError as the suffix stage does (after replying ``abandoned``, so the prefix stops waiting)."""
        d, region = self.decoding, self.region
        d.begin(frame, k)
        self._prefix_ms = []
        times, waits, index = [], [], 0
        state = prefill
        while True:
            t0 = time.perf_counter_ns()
            ids = self._guarded(frame, index, lambda: d.take(state))
            times.append((time.perf_counter_ns() - t0) / 1e6)
            if d.result.ended:
                break
            region.publish_reply(frame, index, ids, channel.TURN if d.turn_step else channel.GO_ON)
            index += 1
            state = self._step(frame, index, waits)
            if state is None:
                d.result.ended = NO_STEP
                break
        r = d.result
        readout_ms = 0.0
        if r.ended in (STOP_TOKEN, MAX_TOKENS):
            steps = d.placed_steps()
            for i, ids in enumerate(steps):
                region.publish_reply(frame, index, ids, channel.PLACE)
                index += 1
                state = self._step(frame, index, waits)
                if state is None:
                    r.ended, r.plan = NO_STEP, None
                    break
                t0 = time.perf_counter_ns()
                self._guarded(frame, index, lambda: d.take_placed(state, last=i == len(steps) - 1))
                readout_ms += (time.perf_counter_ns() - t0) / 1e6
            if r.ended != NO_STEP:
                region.publish_reply(frame, index, [r.tokens[-1]], _END_CODE[r.ended])
        return AnsweredDecode(r.tokens, r.logits, r.ended, times, waits, r.plan, readout_ms, self._prefix_ms,
                              list(r.turn_starts))

    def _guarded(self, frame: int, index: int, work):
        """``work()``; on any exception reply ``abandoned`` to step ``index`` first (the prefix stops waiting)."""
        try:
            return work()
        except BaseException:
            self.region.publish_reply(frame, index, [], channel.ABANDONED)
            raise

    def _step(self, frame: int, index: int, waits: list):
        """Wait for step ``index`` of ``frame``: the suffix's input from its rows (copied out of the region), or
        None at the timeout."""
        t1 = time.perf_counter_ns()
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            left = deadline - time.monotonic()
            step = self.region.wait_step(frame, index, max(0.0, min(PEER_CHECK_S, left)))
            if step is not None or left <= PEER_CHECK_S or not self.peer_alive():
                break
        waits.append((time.perf_counter_ns() - t1) / 1e6)
        if step is None:
            return None
        self._prefix_ms.append(step.compute_ns / 1e6)
        positions = None if step.positions is None else step.positions.clone()
        return self.decoding.sm.step_arrived(step.rows.to(self.dtype, copy=True), positions)


class StepFirst:
    """Compute priority on the prefix between a frame's decode steps and the next frame's prefill (issue 40 item 4):
    a step waits at most for the prefill's current chunk (one block), never for the whole prefill.

    The follower wraps each step in :meth:`step`; the prefill calls :meth:`boundary` before each of its chunks (a
    forward pre-hook on every block, :func:`chunk_modules`) inside :meth:`prefill`. While a step waits or runs, the
    prefill holds at its next boundary. ``held_ms`` of each step: how long it waited for a chunk to end."""

    def __init__(self):
        self._cv = threading.Condition()
        self._waiting = 0  # steps waiting for the compute
        self._stepping = False
        self._chunk = False  # a prefill chunk computes now
        self._prefill_thread = 0  # the thread of the prefill in progress
        self._yielded_ns = 0
        #: Prefill chunks started so far.
        self.chunks_started = 0
        #: How long the last prefill waited for steps at its boundaries (ms): its wall time minus this is its compute.
        self.last_yield_ms = 0.0
        #: The most prefill chunks that started while one step waited: 0, since a step waits only for the chunk
        #: computing when it came (what a test asserts, where a wait's milliseconds depend on the host's load).
        self.most_chunks_waited = 0

    @contextmanager
    def step(self):
        """Run a decode step's compute (yields the ms it waited for the prefill's chunk to end)."""
        t0 = time.perf_counter_ns()
        with self._cv:
            self._waiting += 1
            started = self.chunks_started
            while self._chunk:
                self._cv.wait()
            self._waiting -= 1
            self._stepping = True
            self.most_chunks_waited = max(self.most_chunks_waited, self.chunks_started - started)
        try:
            yield (time.perf_counter_ns() - t0) / 1e6
        finally:
            with self._cv:
                self._stepping = False
                self._cv.notify_all()

    def boundary(self, *_args) -> None:
        """Between two prefill chunks: let every waiting step run first (a forward pre-hook's signature). The blocks
        are the steps' too: called on any other thread than the prefill's, it does nothing."""
        if threading.get_ident() != self._prefill_thread:
            return
        t0 = time.perf_counter_ns()
        with self._cv:
            self._chunk = False
            self._cv.notify_all()
            while self._waiting or self._stepping:
                self._cv.wait()
            self._chunk = True
            self.chunks_started += 1
        self._yielded_ns += time.perf_counter_ns() - t0

    @property
    def yielded_ms(self) -> float:
        """How long the prefill in progress has waited for steps so far (ms)."""
        return self._yielded_ns / 1e6

    @contextmanager
    def prefill(self, modules):
        """A prefill that yields to steps before each of ``modules`` runs (their forward pre-hooks), and wherever
        its thread calls :meth:`boundary` (between cameras)."""
        self._prefill_thread, self._yielded_ns = threading.get_ident(), 0
        handles = [m.register_forward_pre_hook(self.boundary) for m in modules]
        self.boundary()
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            with self._cv:
                self._chunk = False
                self._prefill_thread = 0
                self.last_yield_ms = self._yielded_ns / 1e6
                self._cv.notify_all()


def chunk_modules(stage) -> list:
    """The prefill's chunk boundaries in ``stage``: every element of every ``nn.ModuleList`` in it (the decoder
    blocks, a vision tower's blocks) and every linear and convolution layer (so a step waits for one matrix
    product of the prefill, not a whole vision block over every camera's patches)."""
    from torch import nn

    heavy = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    chosen = {id(m): m for lst in stage.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    chosen.update((id(m), m) for m in stage.modules() if isinstance(m, heavy))
    return list(chosen.values())


class DecodeFollower:
    """The prefix's decode follower thread: follows the decodes of published frames in publication order, each with
    the :class:`~hybrid_vla_ros.model.decode.PrefixDecoding` (KV cache) its prefill filled; a decoding is free again
    when its frame's decode ended. ``done(seq, FollowedDecode)`` is told of each frame's end (on this thread).

    With ``overlap`` the runner prefills the next frame while this thread follows the current one (steps first,
    :class:`StepFirst`), so it holds two decodings; without, one, and the runner waits for each frame's end."""

    def __init__(self, decodings: list, region: channel.DecodeRegion, reply_timeout_s: float, peer_alive, done):
        self._free = list(decodings)
        self._cv = threading.Condition()
        self._queue: list = []  # (seq, decoding) published, not followed yet
        self._busy = 0
        self._closed = False
        self.gate = StepFirst()
        self.region, self.reply_timeout_s, self.peer_alive, self.done = region, reply_timeout_s, peer_alive, done
        self.results: dict[int, FollowedDecode] = {}  # seq -> the decode, for callers that wait for it
        self._thread = threading.Thread(target=self._work, name="prefix_decode", daemon=True)
        self._thread.start()

    def acquire(self) -> PrefixDecoding:
        """A free decoding for the next frame's prefill, waiting while every one is in flight."""
        with self._cv:
            while not self._free and not self._closed:
                self._cv.wait()
            if self._closed:
                raise RuntimeError("the prefix runner is closed")
            return self._free.pop()

    def release(self, decoding: PrefixDecoding) -> None:
        """Give back a decoding whose frame was not published (its prefill failed)."""
        with self._cv:
            self._free.append(decoding)
            self._cv.notify_all()

    def follow(self, seq: int, decoding: PrefixDecoding) -> None:
        """Follow the decode of the frame published as slot ``seq``, prefilled with ``decoding``."""
        with self._cv:
            self._queue.append((seq, decoding))
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every published frame's decode ended (before a re-split, or without overlap)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    def _work(self) -> None:
        import torch

        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                seq, decoding = self._queue.pop(0)
                self._busy = 1
            loop = PrefixDecodeLoop(decoding, self.region, self.reply_timeout_s,
                                    peer_alive=lambda: self.peer_alive() and not self._closed)
            try:
                with torch.inference_mode():
                    followed = loop.follow(seq, gate=self.gate, skipped=True)
            except Exception as e:  # noqa: BLE001 - the prefix stage failed in a step: the suffix finds no step
                followed = FollowedDecode(ended=f"error: {type(e).__name__}: {e}")
            with self._cv:
                self.results[seq] = followed
                while len(self.results) > 16:
                    self.results.pop(min(self.results))
                self._free.append(decoding)
                self._busy = 0
                self._cv.notify_all()
            self.done(seq, followed)
