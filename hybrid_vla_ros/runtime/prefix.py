"""The prefix stage without ROS: one synchronized camera frame -> vision, projector, blocks [0, K) -> ring slot.

The node owns one :class:`PrefixRunner` and adds only ROS I/O. Timings (ms, this host's wall time): ``preprocess``
(decode + resize + normalise of all cameras) and ``prefix`` (vision .. block K-1); they travel in the slot header's
:class:`~hybrid_vla_ros.transport.ring.SlotTimings` with the frame's start (``prefix_start_ns``, CLOCK_MONOTONIC).
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
from ..model.decode import PrefixDecoding, SideCache, SuffixDecoding
from ..split.planner import ring_side
from ..model.modeling import check_ego_state, check_scene, output_into_is_exact
from ..split.rebalance import StageSample
from ..split.resplit import Resplit, ResplitError, StageSplit
from ..transport.pinned import SlotCopier
from ..transport.layout import MAX_DECODE_ROWS
from ..transport.ring import RingProducer, SlotTimings, ros_domain_id, segment_name, slot_bytes_for
from ..vehicle.image import compressed_msg_to_rgb, image_msg_to_rgb, preprocess, resize_rgb
from .decoding import DecodeFollower, FollowedDecode, chunk_modules
from .device import cap_device_memory, keep_frame_buffers, resolve_device
from .peer import PeerStatus, consumer_status, stall_grace_ns
from .settings import PrefixRunnerSettings


class _LiveFrames:
    """A frame's decoded images as :class:`~hybrid_vla_ros.model.kinds.CameraFrames` (resized, or runner pixels)."""

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
    """One frame handed to the ring: slot sequence number, K, timings (ms), and the re-split applied before it."""

    seq: int
    stamp_ns: int
    preprocess_ms: float
    prefix_ms: float
    split_layer: int = -1
    resplit: Resplit | None = None
    resplit_error: str | None = None  # a requested move failed before this frame (it ran at the old K)
    decode: FollowedDecode | None = None  # the frame's decode as this prefix followed it (a decoding model)
    prefill_wait_ms: float = 0.0  # of prefix_ms, waits for the steps of the frame before (a decoding model)
    preprocess_wait_ms: float = 0.0  # of preprocess_ms, waits for a free KV cache and for those steps


#: Longest wait for the suffix's answer to a decode step or prefill (s): beyond it the frame ends ``no_reply``. A
#: suffix that detaches ends it at once; this bounds a suffix that hangs (its first answer runs blocks [K, L) over
#: the whole prefill: up to about 15 s on one core for ``minddrive-0.5b``, docs/performance.md).
DECODE_REPLY_TIMEOUT_S = 30.0

#: Longest pacing delay whatever the suffix's cycle (ns); beyond it the delay must be within two of its cycles.
PACE_LIMIT_FLOOR_NS = 1_000_000_000


def pacing_delay_ns(now_ns: int, taken_ns: int, next_read_ns: int, cycle_p_ns: float, last_publish_ns: int,
                    max_ns: int) -> int:
    """Delay (ns) before starting the next frame so it is published just as the suffix becomes free for it.

    Instants are CLOCK_MONOTONIC ns; the suffix's cycle S is ``next_read_ns - taken_ns``, ``cycle_p_ns`` the
    prefix's cycle P with margin. The target is ``next_read_ns``, or one S later when a published frame already
    waits for it. 0 when a frame started now would find the suffix free (waiting would only age it; an idle
    suffix does not read every S), without an announcement, when S <= P, when the announcement is stale (nothing
    taken for 2 S), or past ``max_ns`` or the longer of :data:`PACE_LIMIT_FLOOR_NS` and 2 S.
    """
    cycle_s = next_read_ns - taken_ns
    if taken_ns <= 0 or cycle_s <= cycle_p_ns or now_ns - taken_ns > 2 * cycle_s:
        return 0
    free = next_read_ns if last_publish_ns <= taken_ns else next_read_ns + cycle_s  # a frame waits for next_read
    delay = round(free - (now_ns + cycle_p_ns))
    return delay if 0 < delay <= min(max_ns, max(PACE_LIMIT_FLOOR_NS, 2 * cycle_s)) else 0


class PrefixRunner:
    """Prefix stage plus ring producer, built from a checkpoint directory and :class:`~.settings.PrefixRunnerSettings`.

    On the CPU the hidden states (T, H) are produced *in* a ring slot: the last op (the last block's residual add,
    at K = 0 the embeddings') writes into the slot, bit for bit as the installed transformers would
    (:attr:`produce_in_slot`). On CUDA they are copied device-to-host
    (:class:`~hybrid_vla_ros.transport.pinned.SlotCopier`). Non-finite hidden states are never published. The ring
    declares model id, dtype, device kind, state shape and ROS domain (:mod:`hybrid_vla_ros.transport.contract`)
    for the suffix to check.

    CUDA: the stage is read in ``dtype`` onto the device (no transient full-precision copy there), and the caching
    allocator is emptied after configure and after every move of K down. ``gpu_budget_bytes`` > 0 is enforced on
    CUDA only: the plan's total for K must fit it (:func:`~hybrid_vla_ros.split.planner.check_budget`, ValueError
    before any weight is loaded) and the allocator is capped at it (:func:`~.device.cap_device_memory`).
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
        #: The checkpoint's decode (:class:`~hybrid_vla_ros.model.decode_spec.DecodeSpec`); None: one prefill a frame.
        self.decode_spec = getattr(self.cfg, "decode_spec", None)  # own model code declares none
        decoding = self.decode_spec is not None
        self.ring = RingProducer(segment_name(settings.ring_name, settings.namespace, self.domain_id),
                                 settings.ring_slots,
                                 slot_bytes_for(self.state_shape, self.dtype, self.side), self.model_id,
                                 dtype=self.dtype, state_shape=self.state_shape, device=self.device,
                                 domain_id=self.domain_id, side=self.side,
                                 decode_rows=MAX_DECODE_ROWS if decoding else 0,
                                 decode_positions=self.model.step_position_rows if decoding else 0)
        #: The decode follower thread (a decoding model): follows each published frame's decode while, with
        #: ``settings.decode_overlap``, the next frame's prefill runs between its steps.
        self.follower: DecodeFollower | None = None
        #: Told ``(seq, FollowedDecode)`` when a frame's decode ends (on the follower's thread); the loop sets it.
        self.on_decode = None
        self._chunks: tuple | None = None  # (stage key, its prefill chunk boundaries)
        if decoding:  # the prefix's KV caches (two with overlap: the decoding frame's, the next one's), reused
            bound = SuffixDecoding.bound(self.cfg.num_tokens, self.decode_spec.settings,
                                         len(self.cfg.decode_placed_token_ids), self.decode_spec.turns)
            chunk = settings.decode_prefill_chunk if settings.decode_overlap else 0
            placed = len(self.cfg.decode_placed_token_ids)
            decodings = [PrefixDecoding(self.model, self.stage, SideCache(self.model.text_config(), bound, 0), chunk,
                                        placed) for _ in range(2 if settings.decode_overlap else 1)]
            self.follower = DecodeFollower(decodings, self.ring.decode, DECODE_REPLY_TIMEOUT_S,
                                           self._suffix_answers, self._decode_done)
        #: Device-to-host path of a CUDA prefix (page-locked slot, staging buffer or plain copy: its ``mode``).
        self.copier = SlotCopier(self.ring, self.device) if self.device.type == "cuda" else None
        self._into_checked: type | None = None  # decoder block class checked by output_into_is_exact
        self._into_ok = self.device.type == "cpu" and self.model.produces_in_place and not decoding
        self._cycle_ns: deque = deque(maxlen=8)  # run() from its start to the frame published
        self._last_publish_ns = 0
        self._publishes_ns: deque = deque(maxlen=64)  # publish instants, for the consumer's stall check
        self._pixels_cpu: torch.Tensor | None = None  # the own front's (C, 3, S, S) float32 pixels, reused

    @property
    def split_layer(self) -> int:
        """K: the prefix runs decoder blocks [0, K); every frame carries it in its slot header."""
        return self.split.k

    def request_split_layer(self, split_layer: int) -> None:
        """Ask for a live re-split to ``split_layer`` (thread-safe); raises ValueError for a K out of [0, L].

        Moving up loads blocks [K, K') in the background while frames continue at the old K; moving down applies
        at the next frame. Either way the change happens between frames (:meth:`apply_split_request`).
        """
        self.split.request(split_layer)

    @property
    def split_requested(self) -> bool:
        """True while a :meth:`request_split_layer` waits to be applied."""
        return self.split.pending is not None

    def apply_split_request(self, timeout: float | None = 0.0) -> Resplit | None:
        """Apply a pending :meth:`request_split_layer`, waiting up to ``timeout`` s for loading blocks (None: until
        loaded). Returns the :class:`Resplit`, or None when nothing was applied (the request stays pending). Raises
        :class:`ResplitError` when loading failed (the request is dropped, K stays)."""
        return self.split.before_frame(timeout)

    def decode(self, items: list) -> list[np.ndarray]:
        """Decode a frame's images to HxWx3 uint8 RGB; a raw ``rgb8`` image is a view of its message (no copy)."""
        images = []
        gate = self.follower.gate if self.follower is not None else None
        for cam, (transport, msg) in enumerate(items):
            if gate is not None:  # a decode step of the frame before goes first (inside a gated prefill only)
                gate.boundary()
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
        """One synchronized frame into the ring.

        ``items``: camera-order ``("raw", Image-like)`` / ``("compressed", CompressedImage-like)``; ``stamp_ns``:
        camera stamp. ``ego_state``: (speed m/s, acceleration m/s^2, yaw rate rad/s), required iff
        ``cfg.ego_state_input``; ``ego_wait_ms``: the caller's wait for it (NaN: not timed). ``scene``:
        :class:`~hybrid_vla_ros.model.query_heads.SceneInputs`, required by a ``scene_queries`` model (whose query
        heads keep memory in this stage across frames). Raises ImageDecodeError (camera index in the message),
        ValueError (camera count, ego state, scene inputs) and FloatingPointError (non-finite hidden states);
        nothing is published then."""
        if len(items) != self.cfg.n_cameras:
            raise ValueError(f"frame has {len(items)} cameras, the model takes {self.cfg.n_cameras}")
        ego = None if ego_state is None else torch.as_tensor(ego_state, dtype=torch.float32)
        check_ego_state(self.cfg, ego)
        check_scene(self.cfg, scene)
        resplit_error = None
        if self.follower is not None and self.split_requested:  # never mid-frame: both caches' blocks move together
            self.follower.wait_idle()
        try:
            resplit = self.apply_split_request()
        except ResplitError as e:  # the frame still goes out, at the K it had
            resplit, resplit_error = None, str(e)
        t_start_ns = time.monotonic_ns()
        t0 = time.perf_counter()
        if self.follower is not None:  # the prefill fills a KV cache of this side; the follower takes the decode
            return self._run_decoding(items, ego_state, scene, stamp_ns, t_start_ns, t0, resplit, resplit_error,
                                      ego_wait_ms)
        frames = _LiveFrames(self.decode(items), self)
        inputs = self.model.frame_args(frames, ego_state, scene, self.device, self.dtype)
        t1 = time.perf_counter()
        if self.produce_in_slot:
            slot, t2 = self._run_in_slot(inputs)
        else:
            slot, t2 = self._copy_into_slot(self.model.split_state(self.model.run_prefix(self.stage, inputs)))
        return self._publish(slot, stamp_ns, t_start_ns, t0, t1, t2, resplit, resplit_error, ego_wait_ms)

    def _run_decoding(self, items, ego_state, scene, stamp_ns, t_start_ns, t0, resplit, resplit_error,
                      ego_wait_ms) -> PrefixResult:
        """A decoding model's frame: a free KV cache taken, then the cameras decoded and the prefill run into it,
        with overlap yielding to the decode steps of the frame before between cameras and before every block and
        linear layer (:class:`~.decoding.StepFirst`), the slot published, the decode handed to the follower.
        Without overlap it waits for the frame's decode (``PrefixResult.decode``). ``preprocess_wait_ms``: how much
        of ``preprocess_ms`` went to waiting for a free cache and for steps; ``prefill_wait_ms``: of ``prefix_ms``,
        for steps."""
        gate = self.follower.gate
        decoding = self.follower.acquire()  # before the gate: a step of the decode that frees one must not wait
        cache_wait_ms = (time.perf_counter() - t0) * 1e3
        try:
            decoding.stage = self.stage
            with gate.prefill(self._chunk_modules()):
                frames = _LiveFrames(self.decode(items), self)
                inputs = self.model.frame_args(frames, ego_state, scene, self.device, self.dtype)
                t1 = time.perf_counter()
                preprocess_wait_ms = gate.yielded_ms
                prefill = decoding.prefill(inputs)
            slot, t2 = self._copy_into_slot(self.model.split_state(prefill))
        except BaseException:
            self.follower.release(decoding)
            raise
        result = self._publish(slot, stamp_ns, t_start_ns, t0, t1, t2, resplit, resplit_error, ego_wait_ms)
        result.preprocess_wait_ms = cache_wait_ms + preprocess_wait_ms
        result.prefill_wait_ms = gate.last_yield_ms - preprocess_wait_ms
        self.follower.follow(result.seq, decoding)
        if not self.settings.decode_overlap:
            self.follower.wait_idle()
            result.decode = self.follower.results.get(result.seq)
        return result

    def _chunk_modules(self) -> list:
        """:func:`~.decoding.chunk_modules` of the stage, found again only after a re-split."""
        key = (id(self.stage), self.split_layer, len(self.stage.layers))
        if self._chunks is None or self._chunks[0] != key:
            self._chunks = (key, chunk_modules(self.stage))
        return self._chunks[1]

    def _suffix_answers(self) -> bool:
        """Whether a suffix may still answer a decode: one is attached and has not said it is paused (an inactive
        suffix node takes no frame until it is activated again)."""
        presence = self.ring.consumer()
        return presence.attached and presence.state != "paused"

    def _decode_done(self, seq: int, followed) -> None:
        callback = self.on_decode
        if callback is not None:
            callback(seq, followed)

    def _copy_into_slot(self, state) -> tuple:
        """The prefix's SplitState (h_K and side tensors) copied into a slot taken now; returns (slot, t2, the
        instant the stage's output was ready). Raises FloatingPointError for non-finite hidden states."""
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
        return slot, t2

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
        """Seconds to wait before the next frame so a slower suffix takes it fresh (:func:`pacing_delay_ns`).

        P is the median start-to-publish of recent frames plus 5 % + 1 ms; S comes from
        ``RingConsumer.announce_next_read``. 0 when no suffix is attached (a SIGKILLed one's announcement stays in
        the header) or past ``max_s`` (s; the default 30 s paces a suffix of up to about 15 s a frame, e.g.
        ``minddrive-0.5b``'s 24 blocks on one CPU core, docs/performance.md "Load step"). Cheap (a lock probe and
        two header reads), so callers re-ask while they wait."""
        if not self._cycle_ns or not self.ring.consumer_attached():  # a dead suffix's announcement is not now's
            return 0.0
        taken, next_read = self.ring.consumer_schedule()
        cycle_p = sorted(self._cycle_ns)[len(self._cycle_ns) // 2] * 1.05 + 1_000_000
        return pacing_delay_ns(time.monotonic_ns(), taken, next_read, cycle_p, self._last_publish_ns,
                               round(max_s * 1e9)) / 1e9

    def publish_interval_ns(self) -> int:
        """Median interval of the last 9 publishes (ns; 0 before the second), announced after each publish so the
        suffix can tell a stopped prefix from a slow one (:func:`~.peer.producer_status`)."""
        recent = list(self._publishes_ns)[-9:]
        gaps = sorted(b - a for a, b in zip(recent, recent[1:]))
        return gaps[len(gaps) // 2] if gaps else 0

    def suffix_frame_age_limit_s(self) -> float | None:
        """The attached suffix's announced ``guard.max_age_s`` (s after the camera stamp); None without one."""
        if not self.ring.consumer_attached():
            return None
        limit = self.ring.consumer_max_age_ns()
        return limit / 1e9 if limit > 0 else None

    def suffix_cycle_s(self) -> float | None:
        """The attached suffix's cycle S (s): announced next read minus last take; None when none is attached or
        announced."""
        if not self.ring.consumer_attached():
            return None
        taken, next_read = self.ring.consumer_schedule()
        return (next_read - taken) / 1e9 if 0 < taken < next_read else None

    def stage_sample(self, camera_period_ns: int | None = None) -> StageSample | None:
        """Both stages' times after the newest frame (:class:`~hybrid_vla_ros.split.rebalance.StageSample`); None
        before the first. Suffix figures are what it announced in the ring header (``RingConsumer.announce_*``)."""
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
        """Declare in the ring header whether this prefix runs or is paused (:func:`~.peer.producer_status`)."""
        self.ring.set_running(running)

    def peer_status(self, frame_period_ns: int | None) -> PeerStatus:
        """The suffix as this prefix sees it now (:func:`~.peer.consumer_status`); ``frame_period_ns``: cameras'."""
        presence = self.ring.consumer()
        waiting = next((t for t in self._publishes_ns if t > presence.last_take_ns), 0)
        return consumer_status(presence, self.ring.name, time.monotonic_ns(), waiting, stall_grace_ns(frame_period_ns))

    @property
    def produce_in_slot(self) -> bool:
        """True when output goes straight into the slot (CPU, and exact; checked once per decoder block class)."""
        if not self._into_ok:
            return False
        if len(self.stage.layers) and type(self.stage.layers[-1]) is not self._into_checked:
            self._into_ok = output_into_is_exact(self.stage)
            self._into_checked = type(self.stage.layers[-1])
        return self._into_ok

    @property
    def handoff_path(self) -> str:
        """How h_K reaches the slot, for logs: ``produced in slot``, ``copied into slot (<reason>)`` (a block that
        :func:`~hybrid_vla_ros.model.modeling.block_forward_into` does not reproduce, e.g. Gemma's extra norms), or
        ``device copy (<mode>)``."""
        if self.copier is not None:
            return f"device copy ({self.copier.mode})"
        if self.produce_in_slot:
            return "produced in slot"
        return f"copied into slot ({self.model.copy_reason(self.stage)})"

    def _run_in_slot(self, inputs: tuple) -> tuple:
        """Run the stage into a slot taken just before the last op; returns (slot, t2). FloatingPointError aborts."""
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
        """Decoded images -> (C, 3, S, S) float32 pixels, in one buffer reused across frames."""
        cfg = self.cfg
        if self._pixels_cpu is None:
            self._pixels_cpu = torch.empty((cfg.n_cameras, 3, cfg.image_size, cfg.image_size), dtype=torch.float32)
        return preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std, out=self._pixels_cpu,
                          resize=cfg.image_resize)

    def close(self) -> None:
        """Stop following decodes, remove the ring and free the stage's (device) memory."""
        if self.follower is not None:
            self.follower.close()
        self.split.close()
        if self.copier is not None:
            self.copier.close()
        self.ring.close()
        self.stage = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
