"""The decode channel of a ring: decode steps down (prefix -> suffix) and the chosen tokens back up.

A frame's prefill crosses in a slot as before. Each decode step then crosses in the *decode region* after the slots
(up to :data:`~.layout.MAX_DECODE_ROWS` hidden-state rows, and their rotary positions where the model has
multimodal ones), announced by the global header's ``step`` group; the suffix answers every prefill and every
step with the ``reply`` group (the chosen token ids and whether the frame ended). The two strictly alternate for a
frame, so each direction has one writer and one reader and no slot states. The suffix takes the next frame as soon
as it sent a frame's last reply, so that reply can be replaced before the prefix read it: an ending reply is also
copied to the ``ended`` group, which only the next ending replaces, and the prefix reads it there. Each header is a
sequence lock: the writer makes its 8-byte counter odd (one aligned store: ``struct.pack_into`` zero-fills the whole
struct before it writes the fields, so a reader could see a half-written one), writes the data and the header
fields, then makes the counter even; the reader takes a header read between two equal even counters (stores and
loads keep program order on x86-64, Intel SDM vol. 3 8.2.2; other CPUs are refused for now). A waiting end polls
for :data:`SPIN_S`, then blocks on its datagram socket: the consumer's wake socket for steps, the producer's
``reply`` socket in the same 0700 directory for replies.

Either end gives up waiting at its deadline and returns None; the runner then asks whether its peer is alive.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .contract import itemsize
from .errors import RingError
from .layout import GLOBAL, MAX_DECODE_ROWS
from .segment import align
from .slots import STORES_VISIBLE_IN_ORDER

__all__ = ["DecodeRegion", "StepView", "Reply", "GO_ON", "STOP_TOKEN", "MAX_TOKENS", "ABANDONED", "END_NAMES",
           "decode_region_bytes", "POSITION_ROWS", "PLACE", "TURN"]

#: ``reply_end`` values: go on with the chosen token(s); the frame ended (stop token, ``max_new_tokens``, given up);
#: ``PLACE``: the decode ended, run these placed tokens (the read-out after the decode) and send their rows;
#: ``TURN``: a decode ended and a turn follows: run these tokens (the first step: the decode's last token, then the
#: turn's first ids; later steps: the turn's next ids) and send their rows; the reply to the last chooses again.
GO_ON, STOP_TOKEN, MAX_TOKENS, ABANDONED, PLACE, TURN = 0, 1, 2, 3, 4, 5
END_NAMES = {GO_ON: "go_on", STOP_TOKEN: "stop_token", MAX_TOKENS: "max_new_tokens", ABANDONED: "abandoned",
             PLACE: "place", TURN: "turn"}
#: Rows of multimodal rotary positions (temporal, height, width) a step carries when the model has them.
POSITION_ROWS = 3
#: How long a waiting end polls the counter before it blocks on its socket (s).
SPIN_S = 0.002


def decode_region_bytes(rows: int, row_bytes: int, positions: int) -> int:
    """Bytes of the decode region: ``rows`` hidden-state rows, then ``positions`` x ``rows`` int64 positions,
    each part 64-byte aligned; 0 without decode."""
    if rows == 0:
        return 0
    return align(rows * row_bytes, 64) + align(positions * rows * 8, 64)


@dataclass(frozen=True)
class StepView:
    """A decode step as the suffix reads it: ``frame`` (its prefill slot's seq), ``index`` (1, 2, ...), ``rows``
    (k, H) in the ring's dtype and ``positions`` (3, 1, k) int64 or None: views of shared memory, valid until the
    suffix replies."""

    frame: int
    index: int
    rows: torch.Tensor
    positions: torch.Tensor | None
    t_publish_ns: int
    compute_ns: int = 0  # the prefix's compute of the step (0: not said)


@dataclass(frozen=True)
class Reply:
    """The suffix's answer to a prefill (``index`` 0) or a step: ``tokens`` chosen, ``end`` (:data:`GO_ON`,
    :data:`STOP_TOKEN`, :data:`MAX_TOKENS` or :data:`ABANDONED`)."""

    frame: int
    index: int
    tokens: tuple[int, ...]
    end: int
    t_publish_ns: int

    @property
    def ended(self) -> bool:
        """True when the frame's decode is over on the suffix (no step answers it)."""
        return self.end not in (GO_ON, PLACE, TURN)


class DecodeRegion:
    """Both directions of the decode channel over a mapped segment ``mm``: ``rows`` (at most
    :data:`~.layout.MAX_DECODE_ROWS`) of width ``hidden`` in ``dtype``, ``positions`` (0 or :data:`POSITION_ROWS`)
    rotary rows, the region at ``offset``. ``notify()`` wakes the other end after a publish; ``receiver`` is this end's
    :class:`~.wake.WakeReceiver`. Raises ValueError for a geometry out of range."""

    def __init__(self, mm, offset: int, rows: int, hidden: int, dtype: torch.dtype, positions: int, notify, receiver):
        if not STORES_VISIBLE_IN_ORDER:
            raise RingError("the decode channel relies on stores becoming visible in program order (x86-64); "
                            "this CPU is not supported for decoding across processes yet")
        if not 1 <= rows <= MAX_DECODE_ROWS or positions not in (0, POSITION_ROWS) or hidden < 1:
            raise ValueError(f"decode geometry out of range: {rows} rows (1..{MAX_DECODE_ROWS}), {positions} "
                             f"position rows (0 or {POSITION_ROWS}), width {hidden}")
        self.rows, self.hidden, self.dtype, self.positions = rows, hidden, dtype, positions
        self._mm, self._notify, self._receiver = mm, notify, receiver
        with torch.inference_mode(False):  # plain tensors: writable in and out of inference mode, whoever attaches
            # the two sequence-lock counters as int64 views: element reads and writes are single aligned 8-byte
            # accesses
            self._step_seq = torch.frombuffer(mm, dtype=torch.int64, count=1, offset=GLOBAL.step_seq.offset)
            self._reply_seq = torch.frombuffer(mm, dtype=torch.int64, count=1, offset=GLOBAL.reply_seq.offset)
            self._ended_seq = torch.frombuffer(mm, dtype=torch.int64, count=1, offset=GLOBAL.ended_seq.offset)
            row_bytes = hidden * itemsize(dtype)
            buf = torch.frombuffer(mm, dtype=torch.uint8, count=decode_region_bytes(rows, row_bytes, positions),
                                   offset=offset)
            self._rows = buf[:rows * row_bytes].view(dtype).view(rows, hidden)
            start = align(rows * row_bytes, 64)
            self._positions = (buf[start:start + positions * rows * 8].view(torch.int64).view(positions, rows)
                               if positions else None)

    # ------------------------------------------------------------------------------------------ producer
    def publish_step(self, frame: int, index: int, rows: torch.Tensor, positions: torch.Tensor | None = None,
                     compute_ns: int = 0) -> None:
        """Write a step's ``rows`` (k, H) and ``positions`` ((3, 1, k) or (3, k) int64, where the region has them)
        and announce it with the prefix's ``compute_ns`` of it. Raises ValueError for a shape the region cannot
        hold."""
        k = rows.shape[0]
        if rows.dim() != 2 or rows.shape[1] != self.hidden or not 1 <= k <= self.rows:
            raise ValueError(f"a decode step carries (1..{self.rows}, {self.hidden}) rows, got {tuple(rows.shape)}")
        if (positions is None) != (self._positions is None):
            raise ValueError("this ring's decode steps carry rotary positions" if positions is None
                             else "this ring's decode steps carry no rotary positions")
        self._rows[:k].copy_(rows)
        if positions is not None:
            self._positions[:, :k].copy_(positions.reshape(self.positions, k))
        self._locked_write(self._step_seq, GLOBAL.step, frame, index, k, time.monotonic_ns(), int(compute_ns))

    def wait_reply(self, frame: int, index: int, timeout_s: float) -> Reply | None:
        """The suffix's reply to step ``index`` of ``frame`` (0: its prefill), or None at the deadline. An ending
        reply is found after the next frame's replies replaced it, until the next ending replaces its copy."""
        def take():  # the latest first; the ended copy only when the latest is another (each poll of the spin)
            for read in (self.latest_reply, self.last_ended_reply):
                reply = read()
                if reply is not None and (reply.frame, reply.index) == (frame, index):
                    return reply
            return None
        return self._wait(take, timeout_s)

    def latest_reply(self) -> Reply | None:
        """The last reply the suffix published, read whole; None before the first or while one is being written."""
        return self._read_reply(self._reply_seq, GLOBAL.reply)

    def last_ended_reply(self) -> Reply | None:
        """The last reply that ended a frame (``ended`` true), read whole; None before the first or while one is
        being written."""
        return self._read_reply(self._ended_seq, GLOBAL.ended)

    def _read_reply(self, counter: torch.Tensor, group) -> Reply | None:
        got = self._locked_read(counter, group)
        if got is None:
            return None
        f, i, count, end, t_pub, *tokens = got
        return Reply(f, i, tuple(int(t) for t in tokens[:count]), end, t_pub)

    # ------------------------------------------------------------------------------------------ consumer
    def wait_step(self, frame: int, index: int, timeout_s: float) -> StepView | None:
        """Step ``index`` of ``frame`` once the prefix has published it, or None at the deadline."""
        def take():
            got = self._locked_read(self._step_seq, GLOBAL.step)
            if got is None or got[0] != frame or got[1] != index:
                return None
            f, i, k, t_pub, compute_ns = got
            positions = None if self._positions is None else self._positions[:, :k].unsqueeze(1)
            return StepView(f, i, self._rows[:k], positions, t_pub, compute_ns)
        return self._wait(take, timeout_s)

    def publish_reply(self, frame: int, index: int, tokens, end: int = GO_ON) -> None:
        """Answer step ``index`` (0: the prefill) of ``frame`` with ``tokens`` and ``end``. Raises ValueError for
        more tokens than a reply holds or an unknown end."""
        tokens = [int(t) for t in tokens]
        if len(tokens) > MAX_DECODE_ROWS or end not in END_NAMES:
            raise ValueError(f"a reply holds at most {MAX_DECODE_ROWS} tokens and an end in {sorted(END_NAMES)}")
        padded, now = tokens + [0] * (MAX_DECODE_ROWS - len(tokens)), time.monotonic_ns()
        if end not in (GO_ON, PLACE, TURN):  # the copy first: whoever finds the latest replaced finds the copy
            self._locked_write(self._ended_seq, GLOBAL.ended, frame, index, len(tokens), end, now, *padded,
                               notify=False)
        self._locked_write(self._reply_seq, GLOBAL.reply, frame, index, len(tokens), end, now, *padded)

    # ---------------------------------------------------------------------------------------------- both
    def _locked_write(self, counter: torch.Tensor, group, *values, notify: bool = True) -> None:
        seq = int(counter[0])
        counter[0] = seq | 1  # odd: being written (a writer that died mid-write left it odd: made even here)
        group.write(self._mm, *values)
        counter[0] = (seq | 1) + 1
        if notify:
            self._notify()

    def _locked_read(self, counter: torch.Tensor, group) -> tuple | None:
        """The group's values read between two equal even counters, None while it is being written."""
        before = int(counter[0])
        if before & 1 or before == 0:
            return None
        values = group.read(self._mm)
        return values if int(counter[0]) == before else None

    def _wait(self, take, timeout_s: float):
        deadline = time.monotonic() + max(0.0, timeout_s)
        spin_until = time.monotonic() + min(SPIN_S, max(0.0, timeout_s))
        while True:
            got = take()
            if got is not None:
                return got
            now = time.monotonic()
            if now >= deadline:
                return None
            if now < spin_until:
                continue
            self._receiver.drain()
            got = take()  # published between the look and the drain: its wake byte is gone
            if got is not None:
                return got
            self._receiver.wait(max(1, int((deadline - time.monotonic()) * 1e3)))
