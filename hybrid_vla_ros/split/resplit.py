"""Moving the split layer K of a running stage: one state machine, :class:`StageSplit`, for both runners.

A :class:`SplitRequest` holds the newest K asked for (from any thread); a :class:`BlockPrefetcher` loads the blocks
a move needs in the background while frames continue at the old K; :func:`move_split` swaps them in (or drops
blocks) between frames and reports a :class:`Resplit`.

* prefix: holds blocks [0, K) and computes every frame at K; a request applies at the next frame boundary once
  its blocks are loaded (moving up) or at once (moving down, returning the device memory).
* suffix: holds blocks [first, L) and computes each frame at its slot header's K. Frames arrive in order, so blocks
  below a computed frame's K are freed unless a request keeps them for a coming move down; a frame below ``first``
  loads the missing blocks first (``on_demand`` when unannounced), so K never mismatches.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ..model.checkpoint import load_blocks, model_id
from ..model.text import block_index
from ..model.stages import check_split_layer


@dataclass
class Resplit:
    """One move of the split layer on one side of the pipeline.

    ``*_split_layer``: first block held (K on the prefix side). ``duration_ms``: what the next frame waited (the
    swap, or the whole load when unannounced); ``load_ms``: the checkpoint load, in the background when announced.
    Bytes around the move: ``stage_bytes_*`` (parameters and packed weights), ``device_bytes_*``
    (``memory_allocated`` on CUDA, else stage bytes), ``reserved_bytes_*`` (``memory_reserved``) and
    ``driver_used_*`` (total - free of ``mem_get_info``, every process); the last two are 0 off CUDA.
    ``on_demand``: a suffix frame arrived at an unannounced K.
    """

    old_split_layer: int
    new_split_layer: int
    duration_ms: float
    blocks_loaded: int
    blocks_freed: int
    stage_bytes_before: int
    stage_bytes_after: int
    device_bytes_before: int
    device_bytes_after: int
    on_demand: bool = False
    load_ms: float = 0.0
    reserved_bytes_before: int = 0
    reserved_bytes_after: int = 0
    driver_used_before: int = 0
    driver_used_after: int = 0

    @property
    def returned_to_driver_bytes(self) -> int:
        """Bytes given back to the driver; negative when the device's use grew (loads, other processes)."""
        return self.driver_used_before - self.driver_used_after


def _cuda_figures(device: torch.device) -> tuple[int, int, int]:
    """(allocated, reserved, driver-level used = total - free) bytes of a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device)), int(total - free)


def _stage_bytes(stage: torch.nn.Module) -> int:
    """Bytes of the stage's weights: its parameters and its packed (oneDNN) weights."""
    packed = (t for t in stage.buffers() if t.is_mkldnn)
    return sum(t.numel() * t.element_size() for t in (*stage.parameters(), *packed))


class BlockPrefetcher:
    """Loads decoder blocks [start, stop) of a checkpoint on a background thread, one job at a time.

    A job for another range replaces the pending one; a discarded running load finishes and is dropped. Each load
    first checks the model id on disk (ValueError if it changed), so blocks of different weights are never mixed.
    """

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, expected_model_id: int):
        from concurrent.futures import ThreadPoolExecutor

        self.model_path, self.device, self.dtype = model_path, device, dtype
        self.expected_model_id = expected_model_id
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="block_loader")
        self._job = None  # (start, stop, future of (blocks, load_ms))
        self._lock = threading.Lock()
        #: Applied to every loaded block list on the loader thread (e.g. packing its weights), or None.
        self.prepare = None
        self.load_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _load(self, start: int, stop: int):
        t0 = time.perf_counter()
        found = model_id(self.model_path)
        if found != self.expected_model_id:
            raise ValueError(f"the checkpoint at {self.model_path} changed on disk since it was loaded (model id "
                             f"{found & (2**64 - 1):016x}, loaded {self.expected_model_id & (2**64 - 1):016x}): "
                             "reconfigure the nodes to use it")
        if self.load_stream is None:
            blocks = load_blocks(self.model_path, start, stop, device=self.device, dtype=self.dtype)
            if self.prepare is not None:
                self.prepare(blocks)
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.load_stream):  # a new thread: device 0
                blocks = load_blocks(self.model_path, start, stop, device=self.device, dtype=self.dtype)
                event = torch.cuda.Event()
                event.record(self.load_stream)
            event.synchronize()  # this thread only: load_ms is the time until the blocks are on the device
            blocks.ready_event, blocks.ready_device = event, self.device
        return blocks, (time.perf_counter() - t0) * 1e3

    def prefetch(self, start: int, stop: int):
        """Start loading blocks [start, stop) unless that job is already pending; returns its future."""
        with self._lock:
            if self._job is not None and self._job[:2] == (start, stop):
                return self._job[2]
            if self._job is not None:
                self._job[2].cancel()
            future = self._pool.submit(self._load, start, stop)
            self._job = (start, stop, future)
            return future

    def discard(self) -> None:
        """Drop the pending job and its result (the move it was for is no longer wanted)."""
        with self._lock:
            if self._job is not None:
                self._job[2].cancel()
                self._job = None

    def _forget(self, future) -> None:
        with self._lock:
            if self._job is not None and self._job[2] is future:
                self._job = None

    def take(self, start: int, stop: int, timeout: float | None = 0.0):
        """(blocks, load ms) of [start, stop), waiting up to ``timeout`` s (None: until loaded); (None, 0.0) when
        not loaded in time (the job goes on). Raises what the loader raised (the job is dropped)."""
        from concurrent.futures import CancelledError
        from concurrent.futures import TimeoutError as FutureTimeout

        future = self.prefetch(start, stop)
        try:
            blocks, load_ms = future.result(timeout)
        except FutureTimeout:
            return None, 0.0
        except CancelledError:  # replaced by a request from another thread meanwhile
            return None, 0.0
        except BaseException:
            self._forget(future)
            raise
        self._forget(future)
        ready_for_current_stream(blocks)
        return blocks, load_ms

    @property
    def pending(self) -> tuple[int, int] | None:
        """(start, stop) of the job in progress or waiting to be taken, else None."""
        with self._lock:
            return None if self._job is None else self._job[:2]

    def close(self) -> None:
        """Stop the loader thread (a load in progress finishes; its result is dropped)."""
        self.discard()
        self._pool.shutdown(wait=True, cancel_futures=True)


def ready_for_current_stream(blocks) -> None:
    """Make the current CUDA stream wait for blocks loaded on another stream, and ``record_stream`` their tensors
    so the allocator does not reuse their memory early. No-op without a ``ready_event`` (CPU)."""
    event = getattr(blocks, "ready_event", None)
    if event is None:
        return
    stream = torch.cuda.current_stream(getattr(blocks, "ready_device", None))
    stream.wait_event(event)
    for t in list(blocks.parameters()) + list(blocks.buffers()):
        if t.is_cuda:
            t.record_stream(stream)
    blocks.ready_event = None


class SplitRequest:
    """The newest split layer asked for by another thread; ``done(k)`` clears it only if no newer one replaced it."""

    def __init__(self):
        self._k: int | None = None
        self._lock = threading.Lock()

    def set(self, k: int) -> None:
        with self._lock:
            self._k = k

    @property
    def pending(self) -> int | None:
        return self._k

    def done(self, k: int) -> None:
        with self._lock:
            if self._k == k:
                self._k = None


class ResplitError(RuntimeError):
    """Loading the blocks for a requested split layer failed; the request is dropped and K stays."""


def move_split(stage, k: int, device: torch.device, blocks=None, load_ms: float = 0.0,
                on_demand: bool = False, t_start: float | None = None) -> Resplit:
    """Move ``stage`` to split layer ``k`` in place, adding the loaded ``blocks`` it lacks or dropping blocks.

    Raises RuntimeError when ``blocks`` are not the range the move needs."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter() if t_start is None else t_start
    old, before = stage.split_layer, _stage_bytes(stage)
    if cuda:
        torch.cuda.synchronize(device)
    dev_before, res_before, used_before = _cuda_figures(device) if cuda else (before, 0, 0)
    n_before = len(stage.layers)

    def first_index(default: int) -> int:
        """Global index of the first block given (``first_block`` of ``load_blocks``, else ``layer_idx``)."""
        first = getattr(blocks, "first_block", None)
        if first is None and len(blocks) and (hasattr(blocks[0], "self_attn") or hasattr(blocks[0], "layer_idx")):
            first = block_index(blocks[0])
        return default if first is None else first

    def provide(a: int, b: int):
        if blocks is None or len(blocks) != b - a or (b > a and first_index(a) != a):
            raise RuntimeError(f"blocks [{a}, {b}) were not loaded for this move")
        return blocks

    stage.move_split(k, provide)
    n_after = len(stage.layers)
    if cuda:  # dropped blocks are freed as their last reference goes; hand the cached memory back
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    after = _stage_bytes(stage)
    dev_after, res_after, used_after = _cuda_figures(device) if cuda else (after, 0, 0)
    return Resplit(old, k, (time.perf_counter() - t0) * 1e3, max(0, n_after - n_before),
                   max(0, n_before - n_after), before, after, dev_before, dev_after, on_demand, load_ms,
                   res_before, res_after, used_before, used_after)


class StageSplit:
    """The split layer of one running stage (``side`` "prefix" or "suffix") and every move of it.

    ``stage`` is moved in place. ``k``: prefix, the K frames are computed at; suffix, the last frame's K.
    Thread-safety: :meth:`request` from any thread, the other methods from the runner's thread only.
    """

    def __init__(self, stage, side: str, *, model_path: str, device: torch.device, dtype: torch.dtype,
                 model_id: int):
        if side not in ("prefix", "suffix"):
            raise ValueError(f"side must be 'prefix' or 'suffix', got {side!r}")
        self.stage, self.side, self.device = stage, side, torch.device(device)
        self.num_layers = stage.cfg.num_layers
        self.k = stage.split_layer
        self.moves = 0
        self.moves_on_demand = 0
        self._request = SplitRequest()
        self._keep_from: int | None = None  # suffix: blocks from here on stay for an announced move down
        self._events: list[Resplit] = []
        self.prefetcher = BlockPrefetcher(str(model_path), self.device, dtype, model_id)

    # ------------------------------------------------------------------------------------------ state
    @property
    def first_held(self) -> int:
        """prefix: 0; suffix: the first decoder block the stage holds."""
        return 0 if self.side == "prefix" else self.stage.split_layer

    @property
    def held(self) -> tuple[int, int]:
        """[start, stop) of the decoder blocks the stage holds."""
        b = self.stage.split_layer
        return (0, b) if self.side == "prefix" else (b, self.num_layers)

    @property
    def pending(self) -> int | None:
        """The requested K not applied yet, else None."""
        return self._request.pending

    def _missing(self, k: int) -> tuple[int, int] | None:
        """[start, stop) of the blocks the stage lacks to compute at ``k``, None when it lacks none."""
        b = self.stage.split_layer
        if self.side == "prefix":
            return (b, k) if k > b else None
        return (k, b) if k < b else None

    # ---------------------------------------------------------------------------------------- moves
    def request(self, k: int) -> None:
        """Ask for split layer ``k`` (thread-safe); its blocks start loading now. ValueError for a K out of [0, L]."""
        check_split_layer(self.stage.cfg, k)
        self._request.set(k)
        missing = self._missing(k)
        if missing is not None:
            self.prefetcher.prefetch(*missing)
        else:
            self.prefetcher.discard()  # a load for an earlier request is no longer wanted

    def before_frame(self, timeout: float | None = 0.0) -> Resplit | None:
        """Apply a pending request at this frame boundary; return the move made, if any.

        Waits up to ``timeout`` s (None: until loaded); not ready: None, the request stays. Raises
        :class:`ResplitError` when loading failed (the request is dropped, nothing changes).
        """
        k = self._request.pending
        if k is None:
            return None
        t0 = time.perf_counter()
        missing = self._missing(k)
        blocks, load_ms = None, 0.0
        if missing is not None:
            try:
                blocks, load_ms = self.prefetcher.take(*missing, timeout)
            except Exception as e:
                self._request.done(k)
                raise ResplitError(f"split layer {k} not applied, K stays {self.k}; request dropped: loading blocks "
                                   f"[{missing[0]}, {missing[1]}) failed: {type(e).__name__}: {e}") from e
            if blocks is None:
                return None
        self._request.done(k)  # a newer request that arrived meanwhile stays for the next boundary
        event = None
        if self.side == "prefix":
            if k != self.k:
                event = self._move(k, blocks, load_ms, t0)
            self.k = k
        else:
            if blocks is not None:
                event = self._move(k, blocks, load_ms, t0)
            self._keep_from = k if k < self.k else None
        return event

    def for_frame(self, k: int) -> Resplit | None:
        """suffix: load now the blocks a frame at ``k`` lacks; the move or None. Raises ValueError for a K outside
        [0, L], and what loading raised."""
        check_split_layer(self.stage.cfg, k)
        missing = self._missing(k)
        if missing is None:
            return None
        announced = self.prefetcher.pending == missing
        t0 = time.perf_counter()
        blocks, load_ms = self.prefetcher.take(*missing, None)
        return self._move(k, blocks, load_ms, t0, on_demand=not announced)

    def after_frame(self, k: int) -> Resplit | None:
        """suffix: a frame at ``k`` was computed; free blocks below the lowest K still wanted, returning that move."""
        self.k = k
        if self._keep_from is not None and k <= self._keep_from:
            self._keep_from = None  # the announced move down has happened
        keep = min(x for x in (k, self._keep_from, self._request.pending) if x is not None)
        if keep > self.stage.split_layer:
            return self._move(keep)
        return None

    def _move(self, k: int, blocks=None, load_ms: float = 0.0, t_start: float | None = None,
              on_demand: bool = False) -> Resplit:
        event = move_split(self.stage, k, self.device, blocks, load_ms, on_demand, t_start)
        self.moves += 1
        self.moves_on_demand += int(on_demand)
        self._events.append(event)
        return event

    def pop_events(self) -> tuple[Resplit, ...]:
        """The moves made since the last call, oldest first."""
        events, self._events = tuple(self._events), []
        return events

    def close(self) -> None:
        """Stop the loader and let go of the stage, so the runner's close frees its weights."""
        self.prefetcher.close()
        self.stage = None
        self._events.clear()
