"""Moving the split layer K of a running stage: requests, background block loads and the move itself.

Both runners use these pieces: a :class:`SplitRequest` holds the newest K asked for by another thread (a
parameter callback); a :class:`BlockPrefetcher` loads the decoder blocks a move needs on a background
thread; :func:`move_split` swaps them into (or drops them from) a stage between frames and reports what the
move cost as a :class:`Resplit`.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ..model.checkpoint import load_blocks, model_id


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
    (memory really returned to the device), else equal to the stage bytes. on_demand: True when the
    suffix had to load blocks because a frame arrived at a K it had not been asked to prepare for.
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

    def _load(self, start: int, stop: int):
        t0 = time.perf_counter()
        found = model_id(self.model_path)
        if found != self.expected_model_id:
            raise ValueError(f"the checkpoint at {self.model_path} changed on disk since it was loaded (model id "
                             f"{found & (2**64 - 1):016x}, loaded {self.expected_model_id & (2**64 - 1):016x}): "
                             "reconfigure the nodes to use it")
        blocks = load_blocks(self.model_path, start, stop, device=self.device, dtype=self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
    dev_before = torch.cuda.memory_allocated(device) if cuda else before
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
    dev_after = torch.cuda.memory_allocated(device) if cuda else after
    return Resplit(old, k, (time.perf_counter() - t0) * 1e3, max(0, n_after - n_before),
                   max(0, n_before - n_after), before, after, dev_before, dev_after, on_demand, load_ms)
