"""Moving the split layer K of a running stage: one state machine, :class:`StageSplit`, for both runners.

Each runner owns one :class:`StageSplit` and calls it at frame boundaries; a parameter callback on another
thread calls :meth:`StageSplit.request`. Its pieces: a :class:`SplitRequest` holds the newest K asked for;
a :class:`BlockPrefetcher` loads the decoder blocks a move needs on a background thread, so frames keep
flowing at the old K meanwhile; :func:`move_split` swaps them into (or drops them from) the stage between
frames and reports what the move cost as a :class:`Resplit`.

The two sides differ only in which blocks they hold and when they may let blocks go:

* prefix: holds blocks [0, K) and computes every frame at K. A requested K is applied at the next frame
  boundary once its blocks are loaded (moving up) or at once (moving down, the blocks' device memory is
  returned). Frames carry the K they were computed at in their slot header.
* suffix: holds blocks [first, L) and computes each frame at the K in its slot header (any K >= first).
  Frames arrive in order, so once a frame at a higher K has been computed the blocks below it are freed,
  unless a request asked to keep blocks ready for a coming move down. A frame at a K below ``first`` loads
  the missing blocks before it is computed (``on_demand`` when nobody announced the move): a frame is never
  computed with a mismatched K.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ..model.checkpoint import load_blocks, model_id
from ..model.stages import check_split_layer


@dataclass
class Resplit:
    """One move of the split layer on one side of the pipeline.

    old_split_layer, new_split_layer: first block held before and after (K on the prefix side).
    duration_ms: time the pipeline itself spent on the move (the frame that came next waited that long:
    swapping in blocks that were loaded in the background, dropping blocks, or, for an unannounced move,
    the whole load). load_ms: time the blocks took to load from the checkpoint (in the background when
    the move was announced). blocks_loaded / blocks_freed: decoder blocks moved in / out of this
    process. stage_bytes_before / stage_bytes_after: bytes of the stage's parameters.
    device_bytes_before / device_bytes_after: ``torch.cuda.memory_allocated`` around the move on CUDA
    (the tensors alive: what the stage dropped), else equal to the stage bytes. reserved_bytes_before /
    reserved_bytes_after: ``torch.cuda.memory_reserved`` (what this process's caching allocator holds;
    after a move down it is emptied, ``torch.cuda.empty_cache``, so the drop is memory handed back to the
    driver). driver_used_before / driver_used_after: total - free of ``torch.cuda.mem_get_info`` (the
    device's used memory over every process, what another process can take); all 0 off CUDA.
    on_demand: True when the suffix had to load blocks because a frame arrived at a K it had not been
    asked to prepare for.
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
        """Device memory the move gave back to the driver (driver-level used before - after; 0 off CUDA;
        negative when the device's use grew: blocks loaded, or another process allocated meanwhile)."""
        return self.driver_used_before - self.driver_used_after


def _cuda_figures(device: torch.device) -> tuple[int, int, int]:
    """(allocated, reserved, driver-level used = total - free) bytes of a CUDA device."""
    free, total = torch.cuda.mem_get_info(device)
    return int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device)), int(total - free)


def _stage_bytes(stage: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in stage.parameters())


class BlockPrefetcher:
    """Loads decoder blocks [start, stop) of a checkpoint on a background thread.

    A live re-split that needs new blocks asks for them here first (:meth:`prefetch`) and swaps them in
    at a frame boundary once loaded (:meth:`take`), so frames keep flowing at the old K meanwhile: the
    move costs the pipeline the swap, not the load. One job at a time: a job for another range replaces
    the pending one, and :meth:`discard` drops it when the move is no longer wanted (a queued load never
    runs; a running one finishes and its blocks are freed, not kept). Each load first checks that the
    checkpoint on disk still has the model id the stage was loaded with, so blocks of different weights
    are never mixed.
    """

    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype, expected_model_id: int):
        from concurrent.futures import ThreadPoolExecutor

        self.model_path, self.device, self.dtype = model_path, device, dtype
        self.expected_model_id = expected_model_id
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="block_loader")
        self._job = None  # (start, stop, future of (blocks, load_ms))
        self._lock = threading.Lock()
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
        """Blocks [start, stop) and their load time in ms, waiting up to ``timeout`` s (None: until
        loaded). The pending job is used when it is for this range; otherwise one is started for it
        (replacing the pending one). Returns (None, 0.0) when not loaded in time (the job goes on).
        Raises what the loader raised (the job is then dropped)."""
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
    """Order blocks loaded on another CUDA stream before the current stream's next kernels: wait for their
    ``ready_event`` (recorded after their last host-to-device copy) and ``record_stream`` every parameter and
    buffer, so the caching allocator does not hand their memory to the load stream again while the current
    stream may still use it. No-op for blocks without an event (CPU, or loaded on the current stream)."""
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
    """The newest split layer asked for by another thread (a parameter callback), until a runner takes it.

    ``set(k)`` records it; ``pending`` is it (None when there is none); ``done(k)`` clears it, but only
    if no newer request replaced ``k`` meanwhile (that one stays for the next frame boundary).
    """

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
    """Move ``stage`` (PrefixStage or SuffixStage) to first/last block ``k`` in place with ``blocks``
    (the decoder blocks it lacks, already loaded) or by dropping blocks; return what it cost."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter() if t_start is None else t_start
    old, before = stage.split_layer, _stage_bytes(stage)
    if cuda:
        torch.cuda.synchronize(device)
    dev_before, res_before, used_before = _cuda_figures(device) if cuda else (before, 0, 0)
    n_before = len(stage.layers)

    def first_index(default: int) -> int:
        """Global index of the first block given: ``load_blocks`` records it as ``first_block``; a transformers
        decoder block knows its own ``layer_idx``."""
        first = getattr(blocks, "first_block", None)
        if first is None and len(blocks) and hasattr(blocks[0], "self_attn"):
            first = blocks[0].self_attn.layer_idx
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

    Args:
        stage: the :class:`~hybrid_vla_ros.model.modeling.PrefixStage` or ``SuffixStage`` it moves in place
            (its ``split_layer`` is the boundary of the blocks it holds; ``cfg.num_layers`` is L).
        side: "prefix" or "suffix" (see the module docstring for the difference).
        model_path, device, dtype, model_id: where blocks are loaded from and to (the prefetcher checks the
            model id on disk before each load, so blocks of different weights are never mixed).

    State (read-only for callers): ``k`` (prefix: the K frames are computed at; suffix: the K of the last
    frame computed), ``first_held`` / ``held`` (the block range the stage holds), ``pending`` (a requested K
    not applied yet), ``moves`` and ``moves_on_demand`` (counts of block moves), ``events`` (Resplit records
    not yet collected with :meth:`pop_events`). Thread-safety: :meth:`request` may be called from any thread;
    the other methods from the runner's own thread only.
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
        """Ask for split layer ``k`` (thread-safe): the blocks it needs start loading in the background now.

        prefix: frames move to ``k`` at the first boundary after the blocks are loaded (or at once, moving
        down). suffix: blocks [k, first held) are loaded ahead and kept until a frame at ``k`` arrives, so the
        prefix's move down costs no wait here. Raises ValueError for a K out of [0, L].
        """
        check_split_layer(self.stage.cfg, k)
        self._request.set(k)
        missing = self._missing(k)
        if missing is not None:
            self.prefetcher.prefetch(*missing)
        else:
            self.prefetcher.discard()  # a load for an earlier request is no longer wanted

    def before_frame(self, timeout: float | None = 0.0) -> Resplit | None:
        """Apply a pending request as far as it can be at this frame boundary; return the move made, if any.

        Waits up to ``timeout`` s (None: until loaded) for blocks still loading; when they are not ready the
        request stays pending and None is returned. prefix: K becomes the requested one. suffix: announced
        blocks are swapped in (frames still decide the K they are computed at). Raises :class:`ResplitError`
        when loading failed (the request is dropped and nothing changes).
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
        """suffix: make the stage able to compute a frame at ``k`` (its slot header's K), loading the blocks
        it lacks now (``on_demand`` unless exactly those were announced and are loading). Returns the move,
        or None when nothing was missing. Raises ValueError for a K outside [0, L]; what loading raised."""
        check_split_layer(self.stage.cfg, k)
        missing = self._missing(k)
        if missing is None:
            return None
        announced = self.prefetcher.pending == missing
        t0 = time.perf_counter()
        blocks, load_ms = self.prefetcher.take(*missing, None)
        return self._move(k, blocks, load_ms, t0, on_demand=not announced)

    def after_frame(self, k: int) -> Resplit | None:
        """suffix: a frame at ``k`` was computed. Frames come in order, so blocks below the lowest K still
        wanted (this one, an announced move down, a pending request) are freed. Returns that move, if any."""
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
        """The moves made since the last call, oldest first (each also returned by the call that made it)."""
        events, self._events = tuple(self._events), []
        return events

    def close(self) -> None:
        """Stop the background loader (a load in progress finishes; its blocks are dropped) and let go of the
        stage, so the runner's close frees its weights."""
        self.prefetcher.close()
        self.stage = None
        self._events.clear()
