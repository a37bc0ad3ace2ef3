"""The suffix stage without ROS: ring slot -> decoder blocks [K, L), norm, planning head -> waypoints.

Run in two processes with :mod:`hybrid_vla_ros.runtime.prefix` it forms the cross-frame asynchronous
pipeline: while the suffix computes frame t from one ring slot, the prefix already computes frame t+1 into
another. Timing fields (ms): ``handoff`` (start of the copy into the slot -> the suffix holds a view of it)
and ``suffix`` (blocks K..L-1, norm, head); instants (CLOCK_MONOTONIC ns): ``t_write_start_ns`` from the slot
header, ``t_ready_ns`` (the suffix holds the view) and ``t_suffix_end_ns``.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..model.checkpoint import load_stage, model_id, parse_dtype
from ..model.modeling import DEFAULT_COMMAND, check_split_layer
from ..split.resplit import BlockPrefetcher, Resplit, ResplitError, SplitRequest, move_split
from ..transport.ring import FrameMeta, RingConsumer, RingError, segment_name


class StaleFrame(RuntimeError):
    """A frame published before this consumer attached (left in the ring from before a restart)."""


@dataclass
class SuffixResult:
    """Waypoints of one frame with its slot metadata, stage timings (ms) and instants (CLOCK_MONOTONIC ns).

    ``waypoints`` is the mode the navigation command selected, ``modes`` every mode of the planner (M = 1 or
    6, one per navigation command) and ``mode`` the selected one's index (``waypoints == modes[mode]``).
    Only ``waypoints`` is checked for finiteness here; a non-finite other mode is the caller's to judge.
    """

    waypoints: np.ndarray  # (N, 2) float64 metres, ego frame
    meta: FrameMeta
    handoff_ms: float
    suffix_ms: float
    t_ready_ns: int = 0  # the suffix holds the view of the slot
    t_suffix_end_ns: int = 0  # the suffix stage returned the waypoints
    resplits: tuple = ()  # Resplit events applied while taking this frame (blocks loaded / freed)
    modes: np.ndarray | None = None  # (M, N, 2) float64 metres, ego frame, every planner mode
    mode: int = 0  # index of the selected mode in modes

    @property
    def preprocess_ms(self) -> float:
        return self.meta.timings_ms[0] if self.meta.timings_ms else float("nan")

    @property
    def prefix_ms(self) -> float:
        return self.meta.timings_ms[1] if len(self.meta.timings_ms) > 1 else float("nan")

    @property
    def t_prefix_start_ns(self) -> int:
        """When the prefix started on this frame (decode); 0 when the producer did not send it."""
        return round(self.meta.timings_ms[2] * 1e6) if len(self.meta.timings_ms) > 2 else 0


class SuffixRunner:
    """Suffix stage plus ring consumer (CPU).

    ``poll(timeout_s)`` waits for the oldest unread frame, runs blocks [K, L), norm and head on a
    zero-copy view of the slot and returns a :class:`SuffixResult`. K is the one in the frame's slot
    header: the suffix follows the prefix through a live re-split. Frames arrive in sequence order,
    so once a frame at a higher K has been computed no frame at a lower K can follow, and the blocks
    below it are freed (unless :meth:`request_split_layer` asked to keep them ready for a coming move
    down). A frame at a K below the first block held loads the missing blocks first (``on_demand``):
    a frame is never computed with a mismatched K. ``poll`` returns None on timeout or while it
    cannot attach to the prefix's ring (``attach_error`` says why; it retries on the next poll, and
    re-attaches by itself when the prefix restarts and replaces the ring). Raises ``SlotRejected``
    (counted by the ring) for a slot whose header fails validation, e.g. another model or a K outside
    [0, L]; FloatingPointError for non-finite waypoints; StaleFrame for a frame published before this
    consumer attached (left over from before a restart); ResplitError, once, when blocks requested
    with :meth:`request_split_layer` could not be loaded (the request is dropped; no frame is lost).
    """

    def __init__(self, model_path: str, split_layer: int, *, dtype: str = "fp32", ring_name: str = "prefix_states",
                 namespace: str = "/", threads: int = 0):
        if threads > 0:
            torch.set_num_threads(threads)
        self.dtype = parse_dtype(dtype)
        self.model_path = str(model_path)
        self.stage = load_stage(model_path, "suffix", split_layer, device="cpu", dtype=self.dtype)
        self.cfg = self.stage.cfg
        self.split_layer = split_layer  # K of the last frame computed (or the configured one)
        self._request = SplitRequest()
        self._keep_from: int | None = None  # keep blocks from here on for an announced move down
        self.prefetcher = BlockPrefetcher(self.model_path, torch.device("cpu"), self.dtype, model_id(model_path))
        self._events: list[Resplit] = []  # moves made while no frame was returned, reported with the next
        self.model_id = model_id(model_path)
        self.segment = segment_name(ring_name, namespace)
        #: Navigation command index (0..5, config.NAV_COMMANDS) used for the next frame; it selects the mode
        #: of a multi-mode planner. The node sets it from its parameter and command topic.
        self.command = DEFAULT_COMMAND
        self.ring: RingConsumer | None = None
        self.attach_error = ""  # why the last attach attempt failed ("" when attached)
        self._attached_ns = 0  # CLOCK_MONOTONIC time of the last attach

    def _attach(self) -> bool:
        if self.ring is not None and self.ring.producer_gone:
            self.ring.close()
            self.ring = None
        if self.ring is None:
            try:
                self.ring = RingConsumer(self.segment, expected_model_id=self.model_id,
                                         expected_split_layer=range(0, self.cfg.num_layers + 1))
            except FileNotFoundError:
                self.attach_error = "the prefix has not created the ring yet"
                return False
            except RingError as e:  # e.g. another consumer holds the ring, or a foreign segment
                self.attach_error = str(e)
                return False
            self.attach_error = ""
            self._attached_ns = time.monotonic_ns()
        return True

    @property
    def attached(self) -> bool:
        return self.ring is not None

    def request_split_layer(self, split_layer: int) -> None:
        """Prepare for frames at ``split_layer`` (thread-safe): blocks [K, first held) are loaded in the
        background, swapped in between frames and kept until a frame at that K arrives, so the prefix's
        move down costs no wait here. Raises ValueError for a K out of [0, L]."""
        check_split_layer(self.cfg, split_layer)
        self._request.set(split_layer)
        if split_layer < self.stage.split_layer:
            self.prefetcher.prefetch(split_layer, self.stage.split_layer)
        else:
            self.prefetcher.discard()

    def _load_front(self, k: int, on_demand: bool, timeout: float | None) -> Resplit | None:
        """Prepend blocks [k, first held) (prefetched, or loaded now); None when not loaded within ``timeout``."""
        t0 = time.perf_counter()
        blocks, load_ms = self.prefetcher.take(k, self.stage.split_layer, timeout)
        if blocks is None:
            return None
        return move_split(self.stage, k, torch.device("cpu"), blocks, load_ms, on_demand, t_start=t0)

    def _before_frame(self) -> None:
        k = self._request.pending
        if k is None:
            return
        if k < self.stage.split_layer:
            try:
                event = self._load_front(k, False, 0.0)
            except Exception as e:
                self._request.done(k)
                raise ResplitError(f"preparing blocks [{k}, {self.stage.split_layer}) failed, request dropped: "
                                   f"{type(e).__name__}: {e}") from e
            if event is None:
                return  # still loading: swapped in before a later frame (or waited for by the frame that needs it)
            self._events.append(event)
        self._request.done(k)
        self._keep_from = k if k < self.split_layer else None

    def _after_frame(self, k: int) -> None:
        self.split_layer = k
        if self._keep_from is not None and k <= self._keep_from:
            self._keep_from = None  # the announced move down has happened
        keep = min(x for x in (k, self._keep_from, self._request.pending) if x is not None)
        if keep > self.stage.split_layer:
            self._events.append(move_split(self.stage, keep, torch.device("cpu")))

    @torch.inference_mode()
    def poll(self, timeout_s: float) -> SuffixResult | None:
        """Wait up to ``timeout_s`` (s) for a frame and run the suffix on it; see the class docstring."""
        if not self._attach():
            time.sleep(min(timeout_s, 0.05))  # no ring to wait on yet: retry at a modest rate
            return None
        self._before_frame()
        slot = self.ring.read(timeout_s)
        if slot is None:
            return None
        with slot:
            if slot.meta.t_publish_ns < self._attached_ns:
                raise StaleFrame(f"frame seq {slot.meta.seq} was published before the suffix attached")
            k = slot.meta.split_layer
            if k < self.stage.split_layer:  # the frame needs blocks this side does not hold (yet)
                announced = self.prefetcher.pending == (k, self.stage.split_layer)
                self._events.append(self._load_front(k, not announced, None))
            t_ready = time.monotonic_ns()
            out = self.stage.plan_all(slot.tensor, self.command, k)
            t_end = time.monotonic_ns()
            meta = slot.meta
        self._after_frame(k)
        resplits, self._events = tuple(self._events), []
        modes = out.modes.double().numpy()
        wp = modes[out.mode]
        if not np.isfinite(wp).all():
            raise FloatingPointError("suffix produced non-finite waypoints")
        return SuffixResult(wp, meta, (t_ready - meta.t_write_start_ns) / 1e6, (t_end - t_ready) / 1e6, t_ready, t_end,
                            resplits, modes, out.mode)

    def ring_stats(self) -> dict:
        return dict(self.ring.stats) if self.ring is not None else {}

    def close(self) -> None:
        self.prefetcher.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.stage = None
        gc.collect()
