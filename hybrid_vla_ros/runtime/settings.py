"""One frozen, typed settings object per runner (ROS-free); ``dataclasses.replace`` makes a variant.

The nodes build them from their parameters (``ros.settings``: ``*NodeSettings.runner_settings``); tools and tests
build them directly. Defaults are the node schemas' (``schema/<node>.schema.json``, checked by
test/test_settings.py), except ``split_layer``, a resolved K here (no ``auto`` or -1), so without a default.
Each class's ``PARAMETER_OF`` maps runner fields to node parameters; fields absent from it come from the node.
Units are in the field comments (this side takes bytes where the node's ``gpu_budget_gb`` is GB, 1e9 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

#: Data type names of the weights and of the hidden states in the ring (``model.checkpoint.parse_dtype``).
Dtype = Literal["fp32", "bf16", "fp16"]
#: Which frame a suffix takes from the ring (``transport.ring.RingConsumer``'s ``delivery``).
Delivery = Literal["newest", "fifo"]
#: How a suffix computes decoder blocks [K, L) (``runtime.suffix_backend``).
Backend = Literal["eager", "openvino"]
#: How a decoding suffix computes a one-row decode step (``runtime.compiled_step``).
DecodeStep = Literal["eager", "inductor"]
#: How a CPU stage chooses the dtype it computes in (:mod:`hybrid_vla_ros.util.precision`).
PrecisionMode = Literal["auto", "dtype"]


@dataclass(frozen=True)
class PrefixRunnerSettings:
    """Settings of one :class:`~hybrid_vla_ros.runtime.prefix.PrefixRunner`; checked by the runner (ValueError)."""

    #: K: the prefix loads decoder blocks [0, K). Resolved already: the node's ``split_layer: auto`` plans K first.
    split_layer: int
    #: ``auto`` (``cuda`` when available, else ``cpu``), ``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N``.
    device: str = "auto"
    #: Weights and ring hidden states: ``fp32``, ``bf16`` or ``fp16``.
    dtype: Dtype = "fp32"
    #: Ring name; the segment is ``hybrid_vla.<uid>.d<domain>.<namespace>.<ring_name>`` in /dev/shm.
    ring_name: str = "prefix_states"
    #: Slots in the ring (frames in flight between the two stages), 3..64.
    ring_slots: int = 4
    #: Torch intra-op threads; 0 leaves torch's setting alone (the node passes one per pinned core for 0).
    torch_threads: int = 0
    #: Decode JPEGs scaled down inside libjpeg when both sides stay >= the model's input size.
    fast_jpeg_decode: bool = False
    #: GPU memory budget in bytes (the node's ``gpu_budget_gb`` x 1e9); enforced on CUDA only. 0: no budget.
    gpu_budget_bytes: int = 0
    #: ROS namespace that scopes the ring's name (the node's own namespace; not a parameter).
    namespace: str = "/"
    #: ROS domain id that scopes and is declared in the ring; None: ``ROS_DOMAIN_ID`` (not a parameter).
    domain_id: int | None = None
    #: A decoding model: prefill the next frame between the current frame's decode steps (two prefix KV caches);
    #: False: each frame's decode ends before the next frame starts (not a parameter; the bench measures both).
    decode_overlap: bool = True
    #: With ``decode_overlap``: the next frame's prefill runs its tokens through the blocks this many at a time, so
    #: a decode step waits at most for one block over that many tokens (0: one block over every token).
    decode_prefill_chunk: int = 64

    #: Runner field -> the prefix node parameter it comes from (``gpu_budget_bytes``: ``gpu_budget_gb`` x 1e9).
    PARAMETER_OF: ClassVar[dict[str, str]] = {
        "split_layer": "split_layer", "device": "device", "dtype": "dtype", "ring_name": "ring_name",
        "ring_slots": "ring_slots", "torch_threads": "torch_threads", "fast_jpeg_decode": "fast_jpeg_decode",
        "gpu_budget_bytes": "gpu_budget_gb"}


@dataclass(frozen=True)
class SplitPolicySettings:
    """How the prefix chooses its split layer K and moves it live (:class:`~.split_control.SplitLayerControl`)."""

    #: A K in [0, L], or ``"auto"``: planned (split.planner) and moved live by the policy.
    split_layer: int | str
    #: Checkpoint directory the plan is made for.
    model_path: str
    #: ``hybrid-vla profile`` file of the plan's times; "": none (no latency moves then).
    profile_path: str = ""
    #: Device memory budget, GB (1e9 bytes); 0: the device's free memory on CUDA, none on the CPU.
    gpu_budget_gb: float = 0.0
    #: The prefix's device and dtype, as :class:`PrefixRunnerSettings`.
    device: str = "auto"
    dtype: Dtype = "fp32"
    #: Move K down when free device memory falls under this, MiB (2**20 bytes); 0: off. CUDA only.
    auto_resplit_free_mb: float = 0.0
    #: Free device memory a move back up must leave, MiB; 0: twice ``auto_resplit_free_mb``.
    auto_resplit_recover_mb: float = 0.0
    #: Move K live towards the lowest latency at the measured load (needs a profile).
    auto_rebalance: bool = True
    #: The most blocks one latency move takes; 0: straight to the latency-best K.
    auto_rebalance_max_step: int = 0
    #: The prefix waits for a slower suffix (the balancer then predicts the paced pipeline).
    pace_to_suffix: bool = True

    #: Field -> the prefix node parameter it comes from (all of the same name).
    PARAMETER_OF: ClassVar[dict[str, str]] = {
        name: name for name in ("split_layer", "model_path", "profile_path", "gpu_budget_gb", "device", "dtype",
                                "auto_resplit_free_mb", "auto_resplit_recover_mb", "auto_rebalance",
                                "auto_rebalance_max_step", "pace_to_suffix")}


@dataclass(frozen=True)
class SuffixRunnerSettings:
    """Settings of one :class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner`; checked by the runner (ValueError)."""

    #: K the suffix prepares for: it loads decoder blocks [K, L) (L: none, for a node's ``split_layer: auto``,
    #: which follows the prefix). Every frame is computed at the K in its slot header.
    split_layer: int
    #: Weights dtype (``fp32``, ``bf16`` or ``fp16``); the ring's hidden states are converted to the dtype computed
    #: in when they differ.
    dtype: Dtype = "fp32"
    #: ``auto``: compute a bf16 / fp16 ``dtype`` in fp32 on a CPU without native units for it; ``dtype``: always in
    #: ``dtype`` (:func:`hybrid_vla_ros.util.precision.inference_precision`).
    inference_precision: PrecisionMode = "auto"
    #: Ring name to attach to, as the prefix's.
    ring_name: str = "prefix_states"
    #: Torch intra-op threads; 0 leaves torch's setting alone (the node passes one per pinned core for 0).
    threads: int = 0
    #: ``newest`` (the newest published frame; older unread ones are superseded) or ``fifo`` (every frame in order).
    delivery: Delivery = "newest"
    #: Start polling the ring this long before the next frame is due (ms).
    spin_lead_ms: float = 1.0
    #: Longest poll for one frame (ms); 0: no polling, the wait blocks on the wake-up socket.
    spin_max_ms: float = 5.0
    #: ``eager`` (torch) or ``openvino`` (compiled in the background, eager meanwhile and as the fallback).
    backend: Backend = "eager"
    #: Folder of the compiled backend's artifacts; "" = the default (``runtime.suffix_backend.default_cache_dir``).
    backend_cache_dir: str = ""
    #: A decoding model's one-row decode step: ``eager`` (torch, module by module) or ``inductor`` (blocks [K, L),
    #: norm and LM head compiled by ``torch.compile`` in the background, eager meanwhile; its costs:
    #: ``runtime.compiled_step``). Where it cannot be compiled the step stays eager, said at configure.
    decode_step: DecodeStep = "eager"
    #: Build the compiled backend (and the compiled decode step) on a background thread (False: at construction,
    #: for tests and tools).
    background_build: bool = True
    #: ROS namespace that scopes the ring's name (the node's own namespace; not a parameter).
    namespace: str = "/"
    #: ROS domain id of the pipeline; a ring that declares another is refused. None: ``ROS_DOMAIN_ID``.
    domain_id: int | None = None
    #: The oldest a frame may be for its trajectory to be published (s after its camera stamp; the output guard's
    #: ``guard.max_age_s`` while ``guard.check_age``; 0: no limit), announced to the prefix in the ring.
    frame_age_limit_s: float = 1.0

    #: Runner field -> the suffix node parameter it comes from.
    PARAMETER_OF: ClassVar[dict[str, str]] = {
        "split_layer": "split_layer", "dtype": "dtype", "inference_precision": "inference_precision",
        "ring_name": "ring_name", "threads": "threads",
        "delivery": "ring.delivery", "spin_lead_ms": "ring.spin_lead_ms", "spin_max_ms": "ring.spin_max_ms",
        "backend": "suffix_backend", "backend_cache_dir": "backend_cache_dir", "decode_step": "decode_step",
        "frame_age_limit_s": "guard.max_age_s"}
