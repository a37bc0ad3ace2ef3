"""The two pipeline stages without ROS: prefix (images -> ring) and suffix (ring -> waypoints).

The nodes own one of these each and add only ROS I/O. Run in two processes they form the
cross-frame asynchronous pipeline: while the suffix process computes frame t from one ring slot,
the prefix process already computes frame t+1 into another slot.

Timing fields (ms, wall time of this host; CLOCK_MONOTONIC where two processes compare):
``preprocess`` (decode + resize + normalise of all cameras), ``prefix`` (vision .. block K-1),
``handoff`` (start of the device-to-host copy into the slot -> the suffix holds a view of it),
``suffix`` (blocks K..L-1, norm, head).

Instants (``time.monotonic_ns()``, CLOCK_MONOTONIC, system-wide, so other processes on the host can
put them on one timeline): the instant the prefix starts a frame travels as the third of the slot
header's timings (in ms; ``SuffixResult.t_prefix_start_ns``); the slot header holds
``t_write_start_ns``; the suffix adds ``t_ready_ns`` (it holds the view) and ``t_suffix_end_ns``.
"""
from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from .checkpoint import load_blocks, load_stage, model_id, parse_dtype
from .model import DEFAULT_COMMAND, check_ego_state, check_split_layer
from .image import compressed_msg_to_rgb, image_msg_to_rgb, preprocess
from .shm_ring import FrameMeta, RingConsumer, RingError, RingProducer, segment_name, slot_bytes_for


#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_frame_buffers(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 128 * 2**20) -> bool:
    """Make glibc malloc keep the memory of freed camera frames for the next frame (process-wide).

    By default glibc serves blocks over its dynamic mmap threshold (a decoded 1936 x 1216 RGB image is
    7 MB) with ``mmap`` and gives them back with ``munmap`` when freed, so every frame pays for unmapping
    six images after publishing and for page-faulting six fresh ones while decoding (measured here: 1.6 ms
    per frame after publishing, and decoding 24 % slower). Raising ``M_MMAP_THRESHOLD`` (bytes; glibc's
    maximum on 64-bit is 32 MiB) keeps such blocks in the heap, and ``M_TRIM_THRESHOLD`` (bytes) stops the
    heap top from being returned after each frame. Returns False (nothing changed) where ``mallopt`` is not
    glibc's. Same effect as the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cpu', 'cuda', 'cuda:N' as given.

    Raises ValueError when CUDA is asked for and not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


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


def _move_split(stage, k: int, device: torch.device, blocks=None, load_ms: float = 0.0,
                on_demand: bool = False, t_start: float | None = None) -> Resplit:
    """Move ``stage`` (PrefixStage or SuffixStage) to first/last block ``k`` in place with ``blocks``
    (the decoder blocks it lacks, already loaded) or by dropping blocks; return what it cost."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter() if t_start is None else t_start
    old, before = stage.split_layer, _stage_bytes(stage)
    dev_before = torch.cuda.memory_allocated(device) if cuda else before
    n_before = len(stage.layers)

    def provide(a: int, b: int):
        if blocks is None or len(blocks) != b - a or (b > a and blocks[0].self_attn.layer_idx != a):
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


@dataclass
class PrefixResult:
    """One frame handed to the ring: its slot sequence number, the split layer it was computed at,
    stage timings (ms) and the re-split applied just before it (None when K did not change), or why a
    requested one failed."""

    seq: int
    stamp_ns: int
    preprocess_ms: float
    prefix_ms: float
    split_layer: int = -1
    resplit: Resplit | None = None
    resplit_error: str | None = None  # a requested move failed before this frame (it ran at the old K)


class PrefixRunner:
    """Prefix stage plus ring producer.

    ``run(items, stamp_ns)`` takes one synchronized frame: a list, in camera order, of
    ``("raw", sensor_msgs/Image-like)`` or ``("compressed", sensor_msgs/CompressedImage-like)``
    items, decodes each image once, resizes all cameras into one pre-allocated (C, 3, S, S) float
    tensor, runs the prefix and copies the hidden states (T, H) straight into a ring slot (the
    only copy: device-to-host). With ``fast_jpeg_decode`` a JPEG is decoded scaled down inside
    libjpeg when the model input is small enough (``image.decode_compressed``'s ``min_size``).
    Raises ImageDecodeError (with the camera index in the message) for a bad image; nothing reaches
    the ring in that case.
    """

    def __init__(self, model_path: str, split_layer: int, *, device: str = "auto", dtype: str = "fp32",
                 ring_name: str = "prefix_states", namespace: str = "/", ring_slots: int = 4,
                 torch_threads: int = 0, fast_jpeg_decode: bool = False):
        self.device = resolve_device(device)
        self.fast_jpeg_decode = fast_jpeg_decode
        self.dtype = parse_dtype(dtype)
        keep_frame_buffers()  # decoded camera images are reused, not unmapped and faulted in again per frame
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.model_path = str(model_path)
        self.stage = load_stage(model_path, "prefix", split_layer, device=self.device, dtype=self.dtype)
        self.cfg = self.stage.cfg
        self.split_layer = split_layer
        self._request = SplitRequest()
        self.model_id = model_id(model_path)
        self.prefetcher = BlockPrefetcher(self.model_path, self.device, self.dtype, self.model_id)
        self.state_shape = self.cfg.prefix_state_shape
        self.ring = RingProducer(segment_name(ring_name, namespace), ring_slots,
                                 slot_bytes_for(self.state_shape, self.dtype), self.model_id)
        s = self.cfg.image_size
        self._pixels_cpu = torch.empty((self.cfg.n_cameras, 3, s, s), dtype=torch.float32)

    def request_split_layer(self, split_layer: int) -> None:
        """Ask for a live re-split to ``split_layer`` (thread-safe; e.g. from a parameter callback).

        Moving K up loads blocks [K, K') on the device in the background while frames continue at the
        old K; the first frame that starts after they are loaded swaps them in. Moving K down applies at
        the start of the next frame. Either way it happens between frames (in :meth:`run` or
        :meth:`apply_split_request`): a frame in progress finishes with the K it started with, and every
        later frame carries the new K in its slot header. Raises ValueError for a K out of [0, L].
        """
        check_split_layer(self.cfg, split_layer)
        self._request.set(split_layer)
        if split_layer > self.split_layer:
            self.prefetcher.prefetch(self.split_layer, split_layer)
        else:
            self.prefetcher.discard()  # a load for an earlier move up is no longer wanted

    @property
    def split_requested(self) -> bool:
        """True while a :meth:`request_split_layer` waits to be applied."""
        return self._request.pending is not None

    def apply_split_request(self, timeout: float | None = 0.0) -> Resplit | None:
        """Apply a pending :meth:`request_split_layer`: swap in the blocks loaded in the background when K
        goes up (waiting up to ``timeout`` s for the load; None: until loaded), drop blocks and return
        their device memory when it goes down. Returns what it cost, or None when nothing was applied
        (no request, or the blocks are still loading: the request stays pending). Raises what loading
        the blocks raised as :class:`ResplitError` (the request is then dropped and K stays)."""
        k = self._request.pending
        if k is None or k == self.split_layer:
            if k is not None:
                self._request.done(k)
            return None
        t0 = time.perf_counter()
        blocks, load_ms = None, 0.0
        if k > self.split_layer:
            try:
                blocks, load_ms = self.prefetcher.take(self.split_layer, k, timeout)
            except Exception as e:
                self._request.done(k)
                raise ResplitError(f"split layer {k} not applied, K stays {self.split_layer}: "
                                   f"{type(e).__name__}: {e}") from e
            if blocks is None:
                return None
        else:
            self.prefetcher.discard()
        self._request.done(k)  # a newer request that arrived meanwhile stays for the next call
        event = _move_split(self.stage, k, self.device, blocks, load_ms, t_start=t0)
        self.split_layer = k
        return event

    def decode(self, items: list) -> list[np.ndarray]:
        """Decode every camera image of a frame to HxWx3 uint8 RGB (camera order)."""
        images = []
        for cam, (transport, msg) in enumerate(items):
            try:
                images.append(compressed_msg_to_rgb(msg, self.cfg.image_size if self.fast_jpeg_decode else None)
                              if transport == "compressed" else image_msg_to_rgb(msg))
            except ValueError as e:
                raise type(e)(f"camera {cam}: {e}") from e
        return images

    @torch.inference_mode()
    def run(self, items: list, stamp_ns: int, ego_state=None) -> PrefixResult:
        """One synchronized frame (camera-order ``(transport, msg)`` items, camera stamp in ns) into the
        ring; see the class docstring. ``ego_state``: (speed m/s, acceleration m/s^2, yaw rate rad/s)
        at the camera stamp, required when the model takes it (``cfg.ego_state_input``), else None.
        Raises ImageDecodeError, ValueError (camera count, missing or non-finite ego state) and
        FloatingPointError (non-finite hidden states: nothing is published)."""
        if len(items) != self.cfg.n_cameras:
            raise ValueError(f"frame has {len(items)} cameras, the model takes {self.cfg.n_cameras}")
        ego = None if ego_state is None else torch.as_tensor(ego_state, dtype=torch.float32)
        check_ego_state(self.cfg, ego)
        resplit_error = None
        try:
            resplit = self.apply_split_request()
        except ResplitError as e:  # the frame still goes out, at the K it had
            resplit, resplit_error = None, str(e)
        t_start_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        images = self.decode(items)
        preprocess(images, self.cfg.image_size, self.cfg.image_mean, self.cfg.image_std, out=self._pixels_cpu)
        t1 = time.perf_counter()
        pixels = self._pixels_cpu.to(self.device, self.dtype, non_blocking=True)
        hidden = self.stage(pixels, ego)
        if not torch.isfinite(hidden).all():
            raise FloatingPointError("prefix produced non-finite hidden states")
        t2 = time.perf_counter()
        pre_ms, prefix_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        slot = self.ring.acquire(self.state_shape, self.dtype)
        try:
            slot.tensor.copy_(hidden)
        except BaseException:
            self.ring.abort(slot)
            raise
        seq = self.ring.publish(slot, stamp_ns=stamp_ns, split_layer=self.split_layer,
                                timings_ms=(pre_ms, prefix_ms, t_start_ns / 1e6))  # start instant in ms
        return PrefixResult(seq, stamp_ns, pre_ms, prefix_ms, self.split_layer, resplit, resplit_error)

    def close(self) -> None:
        """Remove the ring and free the stage's (device) memory."""
        self.prefetcher.close()
        self.ring.close()
        self.stage = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class StaleFrame(RuntimeError):
    """A frame published before this consumer attached (left in the ring from before a restart)."""


@dataclass
class SuffixResult:
    """Waypoints of one frame with its slot metadata, stage timings (ms) and instants (CLOCK_MONOTONIC ns)."""

    waypoints: np.ndarray  # (N, 2) float64 metres, ego frame
    meta: FrameMeta
    handoff_ms: float
    suffix_ms: float
    t_ready_ns: int = 0  # the suffix holds the view of the slot
    t_suffix_end_ns: int = 0  # the suffix stage returned the waypoints
    resplits: tuple = ()  # Resplit events applied while taking this frame (blocks loaded / freed)

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
        return _move_split(self.stage, k, torch.device("cpu"), blocks, load_ms, on_demand, t_start=t0)

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
            self._events.append(_move_split(self.stage, keep, torch.device("cpu")))

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
            waypoints = self.stage(slot.tensor, self.command, k)
            t_end = time.monotonic_ns()
            meta = slot.meta
        self._after_frame(k)
        resplits, self._events = tuple(self._events), []
        wp = waypoints.double().numpy()
        if not np.isfinite(wp).all():
            raise FloatingPointError("suffix produced non-finite waypoints")
        return SuffixResult(wp, meta, (t_ready - meta.t_write_start_ns) / 1e6, (t_end - t_ready) / 1e6, t_ready, t_end,
                            resplits)

    def ring_stats(self) -> dict:
        return dict(self.ring.stats) if self.ring is not None else {}

    def close(self) -> None:
        self.prefetcher.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.stage = None
        gc.collect()
