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
import time
from dataclasses import dataclass

import numpy as np
import torch

from .checkpoint import load_stage, model_id, parse_dtype
from .image import compressed_msg_to_rgb, image_msg_to_rgb, preprocess
from .shm_ring import FrameMeta, RingConsumer, RingError, RingProducer, segment_name, slot_bytes_for


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
class PrefixResult:
    """One frame handed to the ring: its slot sequence number and stage timings (ms)."""

    seq: int
    stamp_ns: int
    preprocess_ms: float
    prefix_ms: float


class PrefixRunner:
    """Prefix stage plus ring producer.

    ``run(items, stamp_ns)`` takes one synchronized frame: a list, in camera order, of
    ``("raw", sensor_msgs/Image-like)`` or ``("compressed", sensor_msgs/CompressedImage-like)``
    items, decodes each image once, resizes all cameras into one pre-allocated (C, 3, S, S) float
    tensor, runs the prefix and copies the hidden states (T, H) straight into a ring slot (the
    only copy: device-to-host). Raises ImageDecodeError (with the camera index in the message)
    for a bad image; nothing reaches the ring in that case.
    """

    def __init__(self, model_path: str, split_layer: int, *, device: str = "auto", dtype: str = "fp32",
                 ring_name: str = "prefix_states", namespace: str = "/", ring_slots: int = 4,
                 torch_threads: int = 0):
        self.device = resolve_device(device)
        self.dtype = parse_dtype(dtype)
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.stage = load_stage(model_path, "prefix", split_layer, device=self.device, dtype=self.dtype)
        self.cfg = self.stage.cfg
        self.split_layer = split_layer
        self.model_id = model_id(model_path)
        self.state_shape = self.cfg.prefix_state_shape
        self.ring = RingProducer(segment_name(ring_name, namespace), ring_slots,
                                 slot_bytes_for(self.state_shape, self.dtype), self.model_id)
        s = self.cfg.image_size
        self._pixels_cpu = torch.empty((self.cfg.n_cameras, 3, s, s), dtype=torch.float32)

    def decode(self, items: list) -> list[np.ndarray]:
        """Decode every camera image of a frame to HxWx3 uint8 RGB (camera order)."""
        images = []
        for cam, (transport, msg) in enumerate(items):
            try:
                images.append(compressed_msg_to_rgb(msg) if transport == "compressed" else image_msg_to_rgb(msg))
            except ValueError as e:
                raise type(e)(f"camera {cam}: {e}") from e
        return images

    @torch.inference_mode()
    def run(self, items: list, stamp_ns: int) -> PrefixResult:
        """One synchronized frame (camera-order ``(transport, msg)`` items, camera stamp in ns) into the
        ring; see the class docstring. Raises ImageDecodeError, ValueError (camera count) and
        FloatingPointError (non-finite hidden states: nothing is published)."""
        if len(items) != self.cfg.n_cameras:
            raise ValueError(f"frame has {len(items)} cameras, the model takes {self.cfg.n_cameras}")
        t_start_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        images = self.decode(items)
        preprocess(images, self.cfg.image_size, self.cfg.image_mean, self.cfg.image_std, out=self._pixels_cpu)
        t1 = time.perf_counter()
        pixels = self._pixels_cpu.to(self.device, self.dtype, non_blocking=True)
        hidden = self.stage(pixels)
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
        return PrefixResult(seq, stamp_ns, pre_ms, prefix_ms)

    def close(self) -> None:
        """Remove the ring and free the stage's (device) memory."""
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
    zero-copy view of the slot and returns a :class:`SuffixResult`, or None on timeout or while it
    cannot attach to the prefix's ring (``attach_error`` says why; it retries on the next poll, and
    re-attaches by itself when the prefix restarts and replaces the ring). Raises ``SlotRejected`` (counted by the ring) for a slot whose
    header fails validation, e.g. another split layer or model, and FloatingPointError for
    non-finite waypoints, and StaleFrame for a frame published before this consumer attached (left
    over from before a restart).
    """

    def __init__(self, model_path: str, split_layer: int, *, dtype: str = "fp32", ring_name: str = "prefix_states",
                 namespace: str = "/", threads: int = 0):
        if threads > 0:
            torch.set_num_threads(threads)
        self.dtype = parse_dtype(dtype)
        self.stage = load_stage(model_path, "suffix", split_layer, device="cpu", dtype=self.dtype)
        self.cfg = self.stage.cfg
        self.split_layer = split_layer
        self.model_id = model_id(model_path)
        self.segment = segment_name(ring_name, namespace)
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
                                         expected_split_layer=self.split_layer)
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

    @torch.inference_mode()
    def poll(self, timeout_s: float) -> SuffixResult | None:
        """Wait up to ``timeout_s`` (s) for a frame and run the suffix on it; see the class docstring."""
        if not self._attach():
            time.sleep(min(timeout_s, 0.05))  # no ring to wait on yet: retry at a modest rate
            return None
        slot = self.ring.read(timeout_s)
        if slot is None:
            return None
        with slot:
            if slot.meta.t_publish_ns < self._attached_ns:
                raise StaleFrame(f"frame seq {slot.meta.seq} was published before the suffix attached")
            t_ready = time.monotonic_ns()
            waypoints = self.stage(slot.tensor)
            t_end = time.monotonic_ns()
            meta = slot.meta
        wp = waypoints.double().numpy()
        if not np.isfinite(wp).all():
            raise FloatingPointError("suffix produced non-finite waypoints")
        return SuffixResult(wp, meta, (t_ready - meta.t_write_start_ns) / 1e6, (t_end - t_ready) / 1e6, t_ready, t_end)

    def ring_stats(self) -> dict:
        return dict(self.ring.stats) if self.ring is not None else {}

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.stage = None
        gc.collect()
