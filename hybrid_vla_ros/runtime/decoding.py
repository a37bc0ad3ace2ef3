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

import time
from dataclasses import dataclass, field

import torch

from ..model.decode import MAX_TOKENS, STOP_TOKEN, PrefixDecoding, SuffixDecoding
from ..transport import decode_channel as channel

__all__ = ["FollowedDecode", "AnsweredDecode", "PrefixDecodeLoop", "SuffixDecodeLoop", "NO_REPLY", "NO_STEP"]

#: How a frame's decode ended on the side that waited in vain.
NO_REPLY, NO_STEP = "no_reply", "no_step"
_END_CODE = {"": channel.GO_ON, STOP_TOKEN: channel.STOP_TOKEN, MAX_TOKENS: channel.MAX_TOKENS}


@dataclass
class FollowedDecode:
    """One frame's decode as the prefix followed it: the ``tokens`` the suffix chose, how it ended
    (:data:`~hybrid_vla_ros.model.decode.STOP_TOKEN`, ``MAX_TOKENS``, ``abandoned`` or :data:`NO_REPLY`), and per
    step the prefix's compute (ms: embedding + blocks [0, K)) and its wait for the reply (ms: from publishing the
    step, or the prefill slot, to the reply: the suffix's compute and both crossings)."""

    tokens: list[int] = field(default_factory=list)
    ended: str = ""
    prefix_step_ms: list[float] = field(default_factory=list)
    reply_wait_ms: list[float] = field(default_factory=list)


@dataclass
class AnsweredDecode:
    """One frame's decode as the suffix answered it: the ``tokens`` and ``logits`` (V,) float32 per step (from
    :class:`~hybrid_vla_ros.model.decode.SuffixDecoding`), how it ended (``STOP_TOKEN``, ``MAX_TOKENS`` or
    :data:`NO_STEP`), per token the suffix's compute (ms: blocks [K, L), norm, LM head, choice) and, from the
    second token on, its wait for the step (ms: from its reply to the step's arrival)."""

    tokens: list[int]
    logits: list[torch.Tensor]
    ended: str
    suffix_token_ms: list[float] = field(default_factory=list)
    step_wait_ms: list[float] = field(default_factory=list)


class PrefixDecodeLoop:
    """The prefix's part after it published a frame's prefill slot: wait for each reply, run the chosen token(s)
    through ``decoding`` and publish the step on ``region``, until the suffix ends the frame or does not reply
    within ``reply_timeout_s`` (s)."""

    def __init__(self, decoding: PrefixDecoding, region: channel.DecodeRegion, reply_timeout_s: float):
        self.decoding, self.region, self.reply_timeout_s = decoding, region, float(reply_timeout_s)

    def follow(self, frame: int) -> FollowedDecode:
        """Follow the decode of the frame whose prefill slot has seq ``frame`` (its prefill already run by
        ``decoding.prefill``). Raises what the prefix stage raises (the suffix then finds no step: ``no_step``)."""
        done, index = FollowedDecode(), 0
        sm = self.decoding.sm
        while True:
            t0 = time.perf_counter_ns()
            reply = self.region.wait_reply(frame, index, self.reply_timeout_s)
            done.reply_wait_ms.append((time.perf_counter_ns() - t0) / 1e6)
            if reply is None:
                done.ended = NO_REPLY
                return done
            done.tokens.extend(reply.tokens)
            if reply.ended:
                done.ended = {channel.STOP_TOKEN: STOP_TOKEN, channel.MAX_TOKENS: MAX_TOKENS}.get(
                    reply.end, channel.END_NAMES[reply.end])
                return done
            t1 = time.perf_counter_ns()
            rows, positions = sm.step_crossing(self.decoding.step(reply.tokens))
            if not torch.isfinite(rows).all():
                raise FloatingPointError("the prefix produced non-finite hidden states in a decode step")
            index += 1
            self.region.publish_step(frame, index, rows, positions)
            done.prefix_step_ms.append((time.perf_counter_ns() - t1) / 1e6)


class SuffixDecodeLoop:
    """The suffix's part for a frame taken from the ring: answer the prefill, then each step the prefix sends on
    ``region``, with ``decoding``; a step that does not come within ``step_timeout_s`` (s) ends the frame
    (:data:`NO_STEP`). ``dtype``: the suffix's compute dtype (step rows are converted from the ring's)."""

    def __init__(self, decoding: SuffixDecoding, region: channel.DecodeRegion, step_timeout_s: float,
                 dtype: torch.dtype):
        self.decoding, self.region = decoding, region
        self.step_timeout_s, self.dtype = float(step_timeout_s), dtype

    def answer(self, frame: int, prefill) -> AnsweredDecode:
        """Decode the frame whose prefill slot has seq ``frame``; ``prefill``: the slot's state (h_K, or a
        SplitState with its side tensors) in this suffix's dtype. Raises ValueError / FloatingPointError as the
        suffix stage does (after replying ``abandoned``, so the prefix stops waiting)."""
        d, region = self.decoding, self.region
        d.begin(frame)
        times, waits, index = [], [], 0
        state = prefill
        while True:
            t0 = time.perf_counter_ns()
            try:
                token = d.take(state)
            except BaseException:
                region.publish_reply(frame, index, [], channel.ABANDONED)
                raise
            times.append((time.perf_counter_ns() - t0) / 1e6)
            region.publish_reply(frame, index, [token], _END_CODE[d.result.ended])
            if d.result.ended:
                break
            index += 1
            t1 = time.perf_counter_ns()
            step = region.wait_step(frame, index, self.step_timeout_s)
            waits.append((time.perf_counter_ns() - t1) / 1e6)
            if step is None:
                d.result.ended = NO_STEP
                break
            positions = None if step.positions is None else step.positions.clone()
            state = d.sm.step_arrived(step.rows.to(self.dtype, copy=True), positions)
        r = d.result
        return AnsweredDecode(r.tokens, r.logits, r.ended, times, waits)
