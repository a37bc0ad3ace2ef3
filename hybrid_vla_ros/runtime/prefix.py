"""The prefix stage without ROS: one synchronized camera frame -> vision, projector, blocks [0, K) -> ring slot.

The node owns one :class:`PrefixRunner` and adds only ROS I/O. Timing fields (ms, wall time of this host):
``preprocess`` (decode + resize + normalise of all cameras) and ``prefix`` (vision .. block K-1); the
instant the prefix starts a frame (``time.monotonic_ns()``, CLOCK_MONOTONIC, system-wide) travels with them in
the slot header's :class:`~hybrid_vla_ros.transport.ring.SlotTimings` (``prefix_start_ns``, exact ns).
"""
from __future__ import annotations

import gc
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..model.checkpoint import load_stage, model_id, open_checkpoint, parse_dtype
from ..split.planner import ring_side
from ..model.modeling import check_ego_state, check_scene, output_into_is_exact
from ..split.rebalance import StageSample
from ..split.resplit import Resplit, ResplitError, StageSplit
from ..transport.pinned import SlotCopier
from ..transport.ring import RingProducer, SlotTimings, ros_domain_id, segment_name, slot_bytes_for
from ..vehicle.image import compressed_msg_to_rgb, image_msg_to_rgb, preprocess, resize_rgb
from .device import cap_device_memory, keep_frame_buffers, resolve_device
from .peer import PeerStatus, consumer_status, stall_grace_ns
from .settings import PrefixRunnerSettings


class _LiveFrames:
    """One frame's decoded camera images as the model's front asks for them
    (:class:`~hybrid_vla_ros.model.kinds.CameraFrames`): resized to a VLM's camera size, or preprocessed into the
    runner's pixel buffer."""

    def __init__(self, images: list, runner: "PrefixRunner"):
        self._images, self._runner = images, runner

    def images(self, cameras: int, size=None) -> list:
        if len(self._images) != cameras:
            raise ValueError(f"frame has {len(self._images)} cameras, the model takes {cameras}")
        return [resize_rgb(im, size) for im in self._images] if size else list(self._images)

    def pixels(self, cfg) -> torch.Tensor:
        return self._runner.pixels(self._images)


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


#: Longest pacing delay whatever the suffix's cycle (ns); beyond it the delay must be within two of its cycles.
PACE_LIMIT_FLOOR_NS = 1_000_000_000


def pacing_delay_ns(now_ns: int, taken_ns: int, next_read_ns: int, cycle_p_ns: float, last_publish_ns: int,
                    max_ns: int) -> int:
    """The pacing rule of :meth:`PrefixRunner.pacing_delay_s`, on given instants (CLOCK_MONOTONIC ns).

    ``taken_ns`` / ``next_read_ns``: when the suffix took its last frame and when it expects to take the next
    (its cycle S is their difference); ``cycle_p_ns``: the prefix's cycle P with its margin; ``last_publish_ns``:
    when the prefix published its newest frame. Returns the delay in ns before starting the next frame so that
    it is published just as the suffix becomes free for it: at its next read (``next_read_ns``), or one cycle S
    later when a published frame already waits for that read. 0 when the suffix will be free by the time a frame
    started now is published (P from now: it then takes the frame at once, and waiting would only age it), when
    there is no announcement, when S <= P, when the announcement is stale (the suffix took nothing for 2 S) or
    when the delay would exceed ``max_ns`` or :data:`PACE_LIMIT_FLOOR_NS` and two cycles S, whichever is longer (the
    rule never asks more than about 2 S of a consistent announcement; up to 1 s it waits whatever S says, as
    before 2026-12-04). (An idle suffix does not read every S: it waits for the next frame; aiming at a later "read"
    left it idle and aged the frame by up to S, 164 ms in ``make demo``.)
    """
    cycle_s = next_read_ns - taken_ns
    if taken_ns <= 0 or cycle_s <= cycle_p_ns or now_ns - taken_ns > 2 * cycle_s:
        return 0
    free = next_read_ns if last_publish_ns <= taken_ns else next_read_ns + cycle_s  # a frame waits for next_read
    delay = round(free - (now_ns + cycle_p_ns))
    return delay if 0 < delay <= min(max_ns, max(PACE_LIMIT_FLOOR_NS, 2 * cycle_s)) else 0


class PrefixRunner:
    """Prefix stage plus ring producer: ``PrefixRunner(model_path, settings)``, the checkpoint directory and one
    :class:`~.settings.PrefixRunnerSettings` (K, device, dtype, ring, threads, budget; the names below are its
    fields).

    ``run(items, stamp_ns)`` takes one synchronized frame: a list, in camera order, of
    ``("raw", sensor_msgs/Image-like)`` or ``("compressed", sensor_msgs/CompressedImage-like)``
    items, decodes each image once, resizes all cameras into one pre-allocated (C, 3, S, S) float
    tensor and runs the prefix. On the CPU the hidden states (T, H) are produced *in* a ring slot: the
    slot is taken after the last block's MLP and that block's residual add (at K = 0 the embeddings'
    last op) writes into its view, so nothing is copied (``produce_in_slot``; bit for bit the same values,
    checked once against the installed transformers by ``model.modeling.output_into_is_exact``). On CUDA
    they are copied device-to-host into the slot (:class:`~hybrid_vla_ros.transport.pinned.SlotCopier`:
    the segment page-locked, a non-blocking copy on its own stream, synchronised before publish). Non-finite
    hidden states are never published: the slot is aborted. With ``fast_jpeg_decode`` a JPEG is decoded
    scaled down inside libjpeg when the model input is small enough (``image.decode_compressed``'s
    ``min_size``). Raises ImageDecodeError (with the camera index in the message) for a bad image; nothing
    reaches the ring in that case. The ring declares the model id, dtype, device kind, state shape and ROS domain
    in its global header (:mod:`hybrid_vla_ros.transport.contract`), which the suffix checks when it attaches.
    The ring is named by user, ROS domain (``domain_id``; None: ``ROS_DOMAIN_ID``) and namespace
    (:func:`~hybrid_vla_ros.transport.segment.segment_name`).

    CUDA: ``device`` ``cuda:N`` is checked against the device count and made the current device
    (:func:`~.device.resolve_device`). The stage is read straight in ``dtype`` onto the device (converted on the
    host, uploaded through page-locked staging: no transient full-precision copy on the device), and the
    caching allocator is emptied after configure (``torch.cuda.empty_cache``) and after every move of K down
    (:func:`~hybrid_vla_ros.split.resplit.move_split`). ``gpu_budget_bytes`` > 0 (the node's ``gpu_budget_gb``)
    is enforced on CUDA: the plan's GPU total for ``split_layer`` (:func:`~hybrid_vla_ros.split.planner.
    check_budget`) must fit it, else ValueError before any weight is loaded, and the process's caching
    allocator is capped at it (``torch.cuda.set_per_process_memory_fraction``: an allocation past it raises
    ``torch.OutOfMemoryError`` here instead of taking memory from other processes). Off CUDA the budget is not
    checked (a CPU prefix has no device budget).
    """

    def __init__(self, model_path: str, settings: PrefixRunnerSettings):
        #: What this runner was built with (:class:`~.settings.PrefixRunnerSettings`).
        self.settings = settings
        split_layer, dtype = settings.split_layer, settings.dtype
        self.device = resolve_device(settings.device)
        self.fast_jpeg_decode = settings.fast_jpeg_decode  # tools may switch it between frames
        self.dtype = parse_dtype(dtype)
        self.gpu_budget_bytes = int(settings.gpu_budget_bytes)
        #: Fraction of the device's memory the caching allocator is capped at (1.0: no cap).
        self.memory_fraction = 1.0
        if self.gpu_budget_bytes > 0 and self.device.type == "cuda":
            from ..split.planner import check_budget, plan_for_checkpoint

            check_budget(plan_for_checkpoint(model_path, None, None, dtype), split_layer, self.gpu_budget_bytes)
            self.memory_fraction = cap_device_memory(self.device, self.gpu_budget_bytes)
        keep_frame_buffers()  # decoded camera images are reused, not unmapped and faulted in again per frame
        if settings.torch_threads > 0:
            torch.set_num_threads(settings.torch_threads)
        self.model_path = str(model_path)
        self.stage = load_stage(model_path, "prefix", split_layer, device=self.device, dtype=self.dtype)
        self.cfg = self.stage.cfg
        if self.device.type == "cuda":  # the upload's staging and any scratch go back to the driver
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.model_id = model_id(model_path)
        #: The split layer and every move of it (split.resplit.StageSplit, side "prefix").
        self.split = StageSplit(self.stage, "prefix", model_path=self.model_path, device=self.device,
                                dtype=self.dtype, model_id=self.model_id)
        self.state_shape = self.cfg.prefix_state_shape
        self.domain_id = ros_domain_id(settings.domain_id)
        #: The model as this runner asks it (:class:`~hybrid_vla_ros.model.kinds.SplitModel`): how a frame's cameras
        #: become the stage's input (pixels, a VLM's processor outputs), and what crosses with h_K (side tensors).
        self.model = open_checkpoint(model_path).split_model()
        self.side = ring_side(self.cfg, self.dtype)
        self.ring = RingProducer(segment_name(settings.ring_name, settings.namespace, self.domain_id),
                                 settings.ring_slots,
                                 slot_bytes_for(self.state_shape, self.dtype, self.side), self.model_id,
                                 dtype=self.dtype, state_shape=self.state_shape, device=self.device,
                                 domain_id=self.domain_id, side=self.side)
        #: Device-to-host path of a CUDA prefix (page-locked slot, staging buffer or plain copy: its ``mode``).
        self.copier = SlotCopier(self.ring, self.device) if self.device.type == "cuda" else None
        self._into_checked: type | None = None  # decoder block class checked by output_into_is_exact
        self._into_ok = self.device.type == "cpu" and self.model.produces_in_place
        self._cycle_ns: deque = deque(maxlen=8)  # run() from its start to the frame published
        self._last_publish_ns = 0
        self._publishes_ns: deque = deque(maxlen=64)  # publish instants, for the consumer's stall check
        self._pixels_cpu: torch.Tensor | None = None  # the own front's (C, 3, S, S) float32 pixels, reused

    @property
    def split_layer(self) -> int:
        """K: the prefix runs decoder blocks [0, K); every frame carries it in its slot header."""
        return self.split.k

    def request_split_layer(self, split_layer: int) -> None:
        """Ask for a live re-split to ``split_layer`` (thread-safe; e.g. from a parameter callback).

        Moving K up loads blocks [K, K') on the device in the background while frames continue at the
        old K; the first frame that starts after they are loaded swaps them in. Moving K down applies at
        the start of the next frame. Either way it happens between frames (in :meth:`run` or
        :meth:`apply_split_request`): a frame in progress finishes with the K it started with, and every
        later frame carries the new K in its slot header. Raises ValueError for a K out of [0, L].
        """
        self.split.request(split_layer)

    @property
    def split_requested(self) -> bool:
        """True while a :meth:`request_split_layer` waits to be applied."""
        return self.split.pending is not None

    def apply_split_request(self, timeout: float | None = 0.0) -> Resplit | None:
        """Apply a pending :meth:`request_split_layer` (``StageSplit.before_frame``): swap in the blocks loaded
        in the background when K goes up (waiting up to ``timeout`` s; None: until loaded), drop blocks and
        return their device memory when it goes down. Returns what it cost, or None when nothing was applied
        (no request, or the blocks are still loading: the request stays pending). Raises
        :class:`ResplitError` when loading failed (the request is then dropped and K stays)."""
        return self.split.before_frame(timeout)

    def decode(self, items: list) -> list[np.ndarray]:
        """Decode every camera image of a frame to HxWx3 uint8 RGB (camera order). A raw ``rgb8`` image is a view
        of its message's data (no copy; the items outlive the frame's preprocessing)."""
        images = []
        for cam, (transport, msg) in enumerate(items):
            fast = self.fast_jpeg_decode and self.model.decodes_scaled  # a VLM's processor sizes its own input
            try:
                images.append(compressed_msg_to_rgb(msg, self.cfg.image_size if fast else None)
                              if transport == "compressed" else image_msg_to_rgb(msg, copy=False))
            except ValueError as e:
                raise type(e)(f"camera {cam}: {e}") from e
        return images

    @torch.inference_mode()
    def run(self, items: list, stamp_ns: int, ego_state=None, ego_wait_ms: float = math.nan, *,
            scene=None) -> PrefixResult:
        """One synchronized frame (camera-order ``(transport, msg)`` items, camera stamp in ns) into the
        ring; see the class docstring. ``ego_state``: (speed m/s, acceleration m/s^2, yaw rate rad/s)
        at the camera stamp, required when the model takes it (``cfg.ego_state_input``), else None.
        ``scene``: the frame's :class:`~hybrid_vla_ros.model.query_heads.SceneInputs` (camera geometry of the
        model images, ego frame), required by a ``scene_queries`` model (whose query heads keep their memory in
        this runner's stage from frame to frame), else None.
        ``ego_wait_ms``: how long the caller waited for that ego state before this call (ms; NaN: not timed),
        sent with the frame's timings (``SlotTimings.ego_wait_ms``).
        Raises ImageDecodeError, ValueError (camera count, missing or non-finite ego state, missing or wrong scene
        inputs) and FloatingPointError (non-finite hidden states: nothing is published)."""
        if len(items) != self.cfg.n_cameras:
            raise ValueError(f"frame has {len(items)} cameras, the model takes {self.cfg.n_cameras}")
        ego = None if ego_state is None else torch.as_tensor(ego_state, dtype=torch.float32)
        check_ego_state(self.cfg, ego)
        check_scene(self.cfg, scene)
        resplit_error = None
        try:
            resplit = self.apply_split_request()
        except ResplitError as e:  # the frame still goes out, at the K it had
            resplit, resplit_error = None, str(e)
        t_start_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        frames = _LiveFrames(self.decode(items), self)
        inputs = self.model.frame_args(frames, ego_state, scene, self.device, self.dtype)
        t1 = time.perf_counter()
        if self.produce_in_slot:
            slot, t2 = self._run_in_slot(inputs)
        else:
            state = self.model.split_state(self.model.run_prefix(self.stage, inputs))
            if not torch.isfinite(state.hidden_states).all():
                raise FloatingPointError("prefix produced non-finite hidden states")
            t2 = time.perf_counter()
            slot = self.ring.acquire(self.state_shape, self.dtype)
            try:
                if self.copier is not None:
                    self.copier.copy(state.hidden_states, slot.tensor)
                else:
                    slot.tensor.copy_(state.hidden_states)
                side = state.side()
                for spec in self.side:
                    slot.side[spec.name].copy_(side[spec.name].reshape(spec.shape))
            except BaseException:
                self.ring.abort(slot)
                raise
        return self._publish(slot, stamp_ns, t_start_ns, t0, t1, t2, resplit, resplit_error, ego_wait_ms)

    def _publish(self, slot, stamp_ns: int, t_start_ns: int, t0: float, t1: float, t2: float, resplit,
                 resplit_error, ego_wait_ms: float = math.nan) -> PrefixResult:
        pre_ms, prefix_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        seq = self.ring.publish(slot, stamp_ns=stamp_ns, split_layer=self.split_layer,
                                timings=SlotTimings(pre_ms, prefix_ms, t_start_ns, ego_wait_ms))
        self._last_publish_ns = time.monotonic_ns()
        self._publishes_ns.append(self._last_publish_ns)
        self._cycle_ns.append(self._last_publish_ns - t_start_ns)
        self.ring.announce_cycle(self.publish_interval_ns())
        return PrefixResult(seq, stamp_ns, pre_ms, prefix_ms, self.split_layer, resplit, resplit_error)

    def pacing_delay_s(self, max_s: float = 30.0) -> float:
        """How long to wait before starting the next frame (s; 0: start now) so that it is published just before
        the suffix asks for it. Only when the suffix is the slower stage: then a frame started at once waits in the
        ring (or is superseded) and reaches the planner older than the stage times say.

        The suffix announces when it took its last frame and when it expects to take the next
        (``RingConsumer.announce_next_read``); their difference is its cycle S. With this runner's cycle P (median
        start-to-publish time of its recent frames, plus 5 % + 1 ms of margin) the next frame is published just as
        the suffix becomes free for it (:func:`pacing_delay_ns`). 0 without a hint, when the suffix will be free by
        then anyway (an idle suffix takes a frame at once), when S <= P (prefix-bound: the suffix waits anyway),
        when no suffix is attached (a SIGKILLed one's announcement stays in the header), when the hint is stale
        (the suffix took nothing for 2 S) or the delay would exceed ``max_s`` (s; an announcement that far ahead is
        taken as wrong: a suffix waiting on it would idle that long), or beyond 1 s and two of the suffix's cycles
        (:func:`pacing_delay_ns`). The default 30 s paces a suffix of up to about 15 s a frame
        (``minddrive-0.5b``'s 24 blocks on one CPU core: 8.5 s, 2026-12-03); until 2026-12-04 every delay over 1 s
        was refused, and such a suffix's frames waited 1-3 s in the ring (docs/performance.md, "Load step"). Cheap
        (a lock probe and two header reads): callers re-ask while they wait
        (:class:`~hybrid_vla_ros.ros.prefix_worker.PrefixWorker`)."""
        if not self._cycle_ns or not self.ring.consumer_attached():  # a dead suffix's announcement is not now's
            return 0.0
        taken, next_read = self.ring.consumer_schedule()
        cycle_p = sorted(self._cycle_ns)[len(self._cycle_ns) // 2] * 1.05 + 1_000_000
        return pacing_delay_ns(time.monotonic_ns(), taken, next_read, cycle_p, self._last_publish_ns,
                               round(max_s * 1e9)) / 1e9

    def publish_interval_ns(self) -> int:
        """The median interval between this runner's last 9 publishes (ns; 0 before its second): how often it
        publishes (the camera rate, or its own cycle, or the suffix it is paced to, whichever is slowest). Announced
        in the ring after each publish (``RingProducer.announce_cycle``), so that the suffix can tell this prefix
        stopped from slow (:func:`~.peer.producer_status`)."""
        recent = list(self._publishes_ns)[-9:]
        gaps = sorted(b - a for a, b in zip(recent, recent[1:]))
        return gaps[len(gaps) // 2] if gaps else 0

    def suffix_frame_age_limit_s(self) -> float | None:
        """The oldest a frame may be (s after its camera stamp) for the attached suffix to publish its trajectory,
        as it announced it (its output guard's ``guard.max_age_s``); None without an attached suffix or when it
        announced no limit."""
        if not self.ring.consumer_attached():
            return None
        limit = self.ring.consumer_max_age_ns()
        return limit / 1e9 if limit > 0 else None

    def suffix_cycle_s(self) -> float | None:
        """The attached suffix's cycle S (s): its announced next read minus its last take
        (``RingConsumer.announce_next_read``); None when no suffix is attached (a SIGKILLed one's figures stay in the
        header) or it announced none."""
        if not self.ring.consumer_attached():
            return None
        taken, next_read = self.ring.consumer_schedule()
        return (next_read - taken) / 1e9 if 0 < taken < next_read else None

    def stage_sample(self, camera_period_ns: int | None = None) -> StageSample | None:
        """Both stages' times as this prefix sees them after its newest frame, for live rebalancing
        (:class:`~hybrid_vla_ros.split.rebalance.StageSample`); None before the first frame.

        ``prefix_ms``: the newest frame's cycle (start of :meth:`run` to its publish, ms); ``suffix_ms`` and ``k``:
        the suffix's stage time and the K it was measured at, which it announces in the ring header
        (``RingConsumer.announce_stage_time``; None and -1 before it announced one); ``suffix_cycle_ms``: its whole
        cycle from its last announced read (``RingConsumer.announce_next_read``), None without one.
        ``camera_period_ns``: the synchronized frames' spacing (ns), None when unknown."""
        if not self._cycle_ns:
            return None
        k, stage_ns = self.ring.consumer_stage_time()
        taken, next_read = self.ring.consumer_schedule()
        if not self.ring.consumer_attached():  # a SIGKILLed suffix's last figures stay in the header: not now's
            k, stage_ns, taken = -1, 0, 0
        return StageSample(k=k, prefix_ms=self._cycle_ns[-1] / 1e6, suffix_ms=stage_ns / 1e6 if stage_ns > 0 else None,
                           suffix_cycle_ms=(next_read - taken) / 1e6 if taken > 0 and next_read > taken else None,
                           camera_period_ms=camera_period_ns / 1e6 if camera_period_ns else None)

    def set_running(self, running: bool) -> None:
        """Say in the ring's header that this prefix works frames (its node is active) or is paused (inactive), so
        the suffix can report an inactive prefix (:func:`~.peer.producer_status`)."""
        self.ring.set_running(running)

    def peer_status(self, frame_period_ns: int | None) -> PeerStatus:
        """The suffix as this prefix sees it now (:func:`~.peer.consumer_status`): attached or not (the ring's
        consumer lock), paused, or holding the ring without taking the frames that wait past
        :func:`~.peer.stall_grace_ns` of ``frame_period_ns`` (the cameras' frame period, ns; None: unknown)."""
        presence = self.ring.consumer()
        waiting = next((t for t in self._publishes_ns if t > presence.last_take_ns), 0)
        return consumer_status(presence, self.ring.name, time.monotonic_ns(), waiting, stall_grace_ns(frame_period_ns))

    @property
    def produce_in_slot(self) -> bool:
        """True when the prefix writes its output straight into the ring slot (CPU device, and the last block's
        residual add reproduced bit for bit; checked once per decoder block class)."""
        if not self._into_ok:
            return False
        if len(self.stage.layers) and type(self.stage.layers[-1]) is not self._into_checked:
            self._into_ok = output_into_is_exact(self.stage)
            self._into_checked = type(self.stage.layers[-1])
        return self._into_ok

    @property
    def handoff_path(self) -> str:
        """How h_K reaches the ring slot, for the configure log and /diagnostics: ``produced in slot`` (the last
        op writes into the slot), ``copied into slot (<Block> layout: ...)`` (a decoder block whose forward is
        not the LLaMA layout :func:`~hybrid_vla_ros.model.modeling.block_forward_into` reproduces, e.g. Gemma's
        extra norms), or, on CUDA, ``device copy (<mode>)`` (:class:`SlotCopier`)."""
        if self.copier is not None:
            return f"device copy ({self.copier.mode})"
        if self.produce_in_slot:
            return "produced in slot"
        return f"copied into slot ({self.model.copy_reason(self.stage)})"

    def _run_in_slot(self, inputs: tuple) -> tuple:
        """The stage on ``inputs`` with its output produced in a ring slot taken just before the last op; returns
        (slot, t2). Aborts the slot and raises FloatingPointError for non-finite hidden states."""
        slot = None

        def destination():
            nonlocal slot
            slot = self.ring.acquire(self.state_shape, self.dtype)
            return slot.tensor

        try:
            hidden = self.model.run_prefix(self.stage, inputs, out=destination)
            if not torch.isfinite(hidden).all():
                raise FloatingPointError("prefix produced non-finite hidden states")
        except BaseException:
            if slot is not None:
                self.ring.abort(slot)
            raise
        slot.t_write_start_ns = time.monotonic_ns()  # the frame is complete in the slot: nothing to copy
        return slot, time.perf_counter()

    def pixels(self, images: list) -> torch.Tensor:
        """Decoded camera images -> the own front's (C, 3, S, S) float32 pixels, resized and normalised into one
        buffer kept from frame to frame (:func:`~hybrid_vla_ros.vehicle.image.preprocess`)."""
        cfg = self.cfg
        if self._pixels_cpu is None:
            self._pixels_cpu = torch.empty((cfg.n_cameras, 3, cfg.image_size, cfg.image_size), dtype=torch.float32)
        return preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std, out=self._pixels_cpu,
                          resize=cfg.image_resize)

    def close(self) -> None:
        """Remove the ring and free the stage's (device) memory."""
        self.split.close()
        if self.copier is not None:
            self.copier.close()
        self.ring.close()
        self.stage = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
