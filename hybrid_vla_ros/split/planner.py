"""GPU memory plan per split layer K, predicted latency per K, and the automatic choice of K.

Units: bytes (int), ms (float), GB = 1e9 bytes. For every K in [0, L] a :class:`PlanRow` gives:

* **GPU bytes of the prefix** (vision, projector, embeddings, blocks [0, K)) = weights + activations +
  non-persistent buffers + CUDA overhead.

  - *weights*: exact, counted on the ``meta`` device (a 7B model in well under a second, no tensor memory);
    floating-point tensors in the requested dtype, others in their own, as ``load_stage`` loads them.
  - *buffers*: the non-persistent buffers ``load_stage`` rebuilds (rotary frequencies, position ids), a few kB.
  - *activations*: an analytic peak of one frame's forward (all cameras as one batch,
    :func:`activation_phases`): the **largest** set of tensors alive in any phase, not a sum, since inference
    without autograd frees intermediates at once. Attention assumes a fused SDPA kernel (no T x T scores).
  - *CUDA overhead*: an assumed allowance, :data:`DEFAULT_CUDA_OVERHEAD_GB` (context with lazy loading,
    cuBLAS / cuDNN workspaces, allocator rounding and fragmentation), not a measurement.

* **CPU bytes of the suffix** (blocks [K, L), final norm, head): same rules, in the suffix dtype.
* **Hand-off bytes** per frame: the ring slot payload (:func:`handoff_bytes`).
* **Latency** from a profile (:mod:`hybrid_vla_ros.split.profiler`, :func:`latency_model`): end-to-end = prefix +
  hand-off + suffix; throughput = 1000 / max(prefix, hand-off + suffix) frames/s, the two processes working on
  consecutive frames. None without a profile.

:func:`plan_for_checkpoint` is the entry point for ``split_layer: auto``; :func:`choose_split_layer` picks K.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.activations import Phase, element_size
from ..model.checkpoint import parse_dtype
from ..model.config import VLAConfig, preset
from ..model.kinds import split_model

GB = 1e9
#: Default CUDA context + workspace + allocator allowance, GB.
DEFAULT_CUDA_OVERHEAD_GB = 1.0
#: Predicted latencies within this fraction of the lowest count as a tie in :func:`choose_split_layer`.
TIE_REL = 0.01

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return parse_dtype(dtype) if isinstance(dtype, str) else dtype


# ----------------------------------------------------------------------------------------- weights

def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    size = element_size(dtype) if t.is_floating_point() else t.element_size()
    return t.numel() * size


def _module_bytes(module: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """(parameters + persistent buffers, non-persistent buffers) bytes; ``keeps_float32`` parts count 4 bytes."""
    persistent = set(module.state_dict().keys())
    kept = {id(t) for m in module.modules() if getattr(m, "keeps_float32", False)
            for t in [*m.parameters(), *m.buffers()]}

    def _bytes(t):
        return _tensor_bytes(t, torch.float32 if id(t) in kept else dtype)

    weights = sum(_bytes(p) for p in module.parameters())
    weights += sum(_bytes(b) for n, b in module.named_buffers() if n in persistent)
    other = sum(b.numel() * b.element_size() for n, b in module.named_buffers() if n not in persistent)
    return weights, other


@dataclass
class StageWeights:
    """Weight bytes of the model's parts in one dtype.

    ``front``: the prefix without blocks; ``blocks``: one entry per decoder block; ``tail``: the suffix without
    blocks; ``*_buffers``: a stage's non-persistent buffers (independent of K).
    """

    front: int
    blocks: list[int]
    tail: int
    prefix_buffers: int
    suffix_buffers: int

    def prefix(self, k: int) -> int:
        """Bytes of the parameters and persistent buffers of PrefixStage(cfg, k)."""
        return self.front + sum(self.blocks[:k])

    def suffix(self, k: int) -> int:
        """Bytes of the parameters and persistent buffers of SuffixStage(cfg, k)."""
        return self.tail + sum(self.blocks[k:])


def stage_weights(cfg, dtype: str | torch.dtype) -> StageWeights:
    """Exact weight bytes of the parts of ``cfg`` in ``dtype``, from both stages built at K = L on the meta device.

    Raises ValueError for an unknown dtype name.
    """
    dtype = _as_dtype(dtype)
    with torch.device("meta"):
        prefix = split_model(cfg).build_stage("prefix", cfg.num_layers)
        suffix = split_model(cfg).build_stage("suffix", cfg.num_layers)
    whole, prefix_buffers = _module_bytes(prefix, dtype)
    blocks = [_module_bytes(block, dtype)[0] for block in prefix.layers]
    tail, suffix_buffers = _module_bytes(suffix, dtype)
    return StageWeights(front=whole - sum(blocks), blocks=blocks, tail=tail, prefix_buffers=prefix_buffers,
                        suffix_buffers=suffix_buffers)


@dataclass(frozen=True)
class ExpertCounts:
    """A mixture-of-experts model's decoder-block parameters: ``total`` (every expert), ``active`` (what one token
    runs: the attention, routers, shared experts and ``active_experts`` of ``experts`` in each MoE block);
    ``moe_blocks`` of ``blocks`` have experts."""

    total: int
    active: int
    experts: int
    active_experts: int
    moe_blocks: int
    blocks: int


def expert_counts(cfg) -> ExpertCounts | None:
    """:class:`ExpertCounts` of ``cfg``'s decoder blocks (built on the meta device; a module with an ``experts``
    child is a MoE block, its experts' first dimension or list length E, ``num_experts_per_tok`` of the text config
    active), None for a model without experts or whose text config does not say how many are active."""
    sm = split_model(cfg)
    with torch.device("meta"):
        prefix = sm.build_stage("prefix", cfg.num_layers)
    has_experts = any(isinstance(getattr(m, "experts", None), torch.nn.Module) for m in prefix.layers.modules())
    if not has_experts:
        return None
    try:
        active_experts = getattr(sm.text_config(), "num_experts_per_tok", None)
    except (AttributeError, NotImplementedError, ValueError):  # own model code: no transformers text config
        active_experts = None
    total = active = moe_blocks = experts = 0
    for block in prefix.layers:
        params = sum(p.numel() for p in block.parameters())
        total += params
        moe = [m.experts for m in block.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
        if not moe or not active_experts:
            active += params
            continue
        moe_blocks += 1
        in_experts = sum(p.numel() for e in moe for p in e.parameters())
        e = moe[0]
        experts = len(e) if isinstance(e, torch.nn.ModuleList) else next(p.shape[0] for p in e.parameters())
        active += params - in_experts + in_experts * int(active_experts) // experts
    if not moe_blocks:
        return None
    return ExpertCounts(total, active, experts, int(active_experts), moe_blocks, len(prefix.layers))


def ring_side(cfg, dtype: torch.dtype) -> tuple:
    """The side tensors the ring carries next to h_K (:class:`~hybrid_vla_ros.transport.contract.TensorSpec`s,
    floating ones in ``dtype``)."""
    from ..model.contract import side_specs
    from ..transport.contract import TensorSpec

    return tuple(TensorSpec(name, shape, dt) for name, shape, dt in side_specs(cfg, _as_dtype(dtype)))


def handoff_bytes(cfg: VLAConfig, dtype: str | torch.dtype) -> int:
    """Bytes crossing the split per frame: prod(cfg.prefix_state_shape) x element size plus the side tensors."""
    from ..model.contract import side_bytes

    return math.prod(cfg.prefix_state_shape) * element_size(dtype) + side_bytes(cfg, _as_dtype(dtype))


# ------------------------------------------------------------------------------------- activations

def activation_phases(cfg, split_layer: int, dtype: str | torch.dtype, role: str = "prefix") -> list[Phase]:
    """The phases of one frame's forward of a stage, each with its bytes alive
    (:meth:`~hybrid_vla_ros.model.kinds.SplitModel.activation_phases`); [] for own model code. Raises ValueError
    for a bad K, role or dtype."""
    from ..model.stages import check_split_layer

    check_split_layer(cfg, split_layer)
    if role not in ("prefix", "suffix"):
        raise ValueError(f"unknown role {role!r}; use prefix or suffix")
    return split_model(cfg).activation_phases(split_layer, element_size(dtype), role)


def activation_peak(cfg: VLAConfig, split_layer: int, dtype: str | torch.dtype,
                    role: str = "prefix") -> tuple[int, str]:
    """(peak activation bytes, its phase's name) of a stage; (0, "not estimated") for own model code."""
    phases = activation_phases(cfg, split_layer, dtype, role)
    if not phases:
        return 0, "not estimated"
    best = max(phases, key=lambda p: p.total)
    return best.total, best.name


# ----------------------------------------------------------------------------------------- latency

def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ms = a + b * bytes over (bytes, ms) points; a >= 0, b >= 0. One point: a = 0."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    if len(set(xs)) < 2:
        return 0.0, (sum(ys) / sum(xs)) if sum(xs) > 0 else 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    b = max(b, 0.0)
    a = max(my - b * mx, 0.0)
    return a, b


@dataclass
class LatencyModel:
    """Per-part times (ms) read from a profile; see :func:`latency_model`."""

    prefix_device: str
    suffix_device: str
    prefix_fixed_ms: float  # camera preprocessing + vision + projector + embeddings (K-independent)
    prefix_rotary_ms: float
    prefix_blocks_ms: list[float]
    suffix_rotary_ms: float
    suffix_blocks_ms: list[float]
    head_ms: float
    handoff_a_ms: float
    handoff_b_ms_per_byte: float
    notes: list[str] = field(default_factory=list)
    #: Per-token times of a decode (``profile --decode``): one step per decoder block on each device (ms), the LM
    #: head on the suffix's device (0 for a model without one); empty lists when the profile has none.
    prefix_step_ms: list[float] = field(default_factory=list)
    suffix_step_ms: list[float] = field(default_factory=list)
    lm_head_step_ms: float = 0.0

    def predict_decode(self, k: int, tokens: int, row_bytes: int) -> tuple[float, float, float, float]:
        """(prefix ms, round trip ms, suffix ms per token, the frame's decode ms) at split layer k for ``tokens``
        new tokens: the first comes from the prefill's last row (the LM head once), each later one is a step
        (prefix blocks [0, k), a round trip of one ``row_bytes`` row down and a token back, suffix blocks [k, L)
        and the LM head). The round trip is two of the profile's ring hand-offs of one row. Raises ValueError
        when the profile has no decode steps."""
        if not self.prefix_step_ms or not self.suffix_step_ms:
            raise ValueError("the profile has no decode steps: profile with `hybrid-vla profile --decode`")
        prefix = sum(self.prefix_step_ms[:k])
        suffix = sum(self.suffix_step_ms[k:]) + self.lm_head_step_ms
        round_trip = 2 * (self.handoff_a_ms + self.handoff_b_ms_per_byte * row_bytes)
        return prefix, round_trip, suffix, self.lm_head_step_ms + (tokens - 1) * (prefix + round_trip + suffix)

    def predict(self, k: int, nbytes: int) -> tuple[float, float, float]:
        """(prefix ms, hand-off ms, suffix ms) at split layer k for a payload of ``nbytes`` bytes."""
        L = len(self.prefix_blocks_ms)
        prefix = self.prefix_fixed_ms + sum(self.prefix_blocks_ms[:k]) + (self.prefix_rotary_ms if k > 0 else 0.0)
        suffix = sum(self.suffix_blocks_ms[k:]) + self.head_ms + (self.suffix_rotary_ms if k < L else 0.0)
        handoff = self.handoff_a_ms + self.handoff_b_ms_per_byte * nbytes
        return prefix, handoff, suffix


def _arch_key(cfg) -> dict:
    return split_model(cfg).arch_key()


def profile_arch_key(doc: dict) -> dict:
    """The architecture key of the model a profile was measured on (:func:`~hybrid_vla_ros.model.kinds.
    profile_arch_key`)."""
    from ..model.kinds import profile_arch_key as key

    return key(doc)


def latency_model(profile: dict, cfg: VLAConfig, dtype: str | torch.dtype,
                  preprocess_ms: float | None = None) -> LatencyModel:
    """Turn a validated profile (:func:`hybrid_vla_ros.split.profiler.load_profile`) into per-part times.

    The prefix runs on the profile's ``cuda`` device if any, else ``cpu``; the suffix on ``cpu``. Hand-off is a
    least-squares line over the prefix device's ring measurements. The prefix's fixed time includes camera
    preprocessing: ``preprocess_ms``, else the profile's, else none (noted: too low for JPEG cameras). Raises
    ValueError for a profile of another architecture; another dtype is only noted.
    """
    mine, theirs = _arch_key(cfg), profile_arch_key(profile)
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if diff:
        raise ValueError(f"the profile was measured on another architecture (differs in {', '.join(diff)}); "
                         f"profile this model first (hybrid-vla profile)")
    notes = []
    want = DTYPE_NAMES.get(_as_dtype(dtype), str(dtype))
    if profile["dtype"] != want:
        notes.append(f"latencies were measured in {profile['dtype']}, the plan is for {want}")
    devices = profile["devices"]
    pre_name = "cuda" if "cuda" in devices else "cpu"
    if pre_name == "cpu":
        notes.append("the profile has no CUDA measurements: the prefix latency is its CPU time")
    pre, suf = devices[pre_name], devices["cpu"]
    parts = pre["parts_ms"]
    fixed = (parts["vision_embeddings"] + sum(pre["vision_blocks_ms"]) + parts["vision_post"]
             + parts["projector_embed"])
    if preprocess_ms is None and "preprocess" in profile:
        preprocess_ms = profile["preprocess"]["ms"]
        notes.append(f"camera preprocessing {preprocess_ms:.1f} ms a frame from the profile "
                     f"({profile['preprocess'].get('source', 'measured')})")
    elif preprocess_ms is None:
        preprocess_ms = 0.0
        notes.append("the profile has no camera preprocessing time: predicted prefix times leave out decoding "
                     "and resizing the cameras")
    else:
        notes.append(f"camera preprocessing {preprocess_ms:.1f} ms a frame (given)")
    fixed += preprocess_ms
    a, b = _fit_line([(m["bytes"], m["ms"]) for m in pre["handoff"]["ring"]])
    pre_dec, suf_dec = pre.get("decode") or {}, suf.get("decode") or {}
    return LatencyModel(prefix_device=pre["name"], suffix_device=suf["name"], prefix_fixed_ms=fixed,
                        prefix_rotary_ms=parts["rotary"], prefix_blocks_ms=list(pre["llm_blocks_ms"]),
                        suffix_rotary_ms=suf["parts_ms"]["rotary"], suffix_blocks_ms=list(suf["llm_blocks_ms"]),
                        head_ms=suf["parts_ms"]["head"], handoff_a_ms=a, handoff_b_ms_per_byte=b, notes=notes,
                        prefix_step_ms=list(pre_dec.get("llm_block_step_ms", [])),
                        suffix_step_ms=list(suf_dec.get("llm_block_step_ms", [])),
                        lm_head_step_ms=float(suf_dec.get("lm_head_step_ms") or 0.0))


# -------------------------------------------------------------------------------------------- plan

@dataclass
class PlanRow:
    """One split layer K. Bytes are ints; times in ms and throughput in frames/s are None without a profile."""

    k: int
    gpu_weight_bytes: int
    gpu_activation_bytes: int
    gpu_buffer_bytes: int
    gpu_overhead_bytes: int
    gpu_total_bytes: int
    gpu_peak_phase: str
    cpu_weight_bytes: int
    cpu_activation_bytes: int
    cpu_total_bytes: int
    handoff_bytes: int
    ring_slot_bytes: int
    prefix_ms: float | None = None
    handoff_ms: float | None = None
    suffix_ms: float | None = None
    e2e_ms: float | None = None
    throughput_fps: float | None = None
    fits: bool | None = None
    #: With a decode of ``decode_tokens`` new tokens a frame: both sides' KV caches (prompt + tokens - 1 tokens of
    #: their own blocks, or what the decode config bounds; the prefix's :data:`PREFIX_KV_CACHES` of them; included
    #: in the totals), and per token the prefix's step, the round trip and the suffix's
    #: step (ms; None without a profile), and the frame's decode time (included in e2e_ms).
    decode_tokens: int = 0
    gpu_kv_bytes: int = 0
    cpu_kv_bytes: int = 0
    prefix_token_ms: float | None = None
    round_trip_ms: float | None = None
    suffix_token_ms: float | None = None
    decode_ms: float | None = None


@dataclass
class Plan:
    """All rows, the chosen K and why. ``gpu_budget_bytes`` None means no budget (every K fits)."""

    model: str
    dtype: str
    num_layers: int
    prefix_state_shape: tuple[int, ...]
    gpu_budget_bytes: int | None
    cuda_overhead_bytes: int
    rows: list[PlanRow]
    chosen_k: int
    reason: str
    profile: str | None = None
    prefix_device: str | None = None
    suffix_device: str | None = None
    notes: list[str] = field(default_factory=list)
    #: The dtype the CPU suffix's memory columns count: what a suffix node computes in on this CPU
    #: (:func:`~hybrid_vla_ros.util.precision.inference_precision`), fp32 for bf16 / fp16 without native units.
    suffix_dtype: str = ""

    def row(self, k: int) -> PlanRow:
        """The row of split layer k. Raises IndexError when k is out of [0, L]."""
        if not 0 <= k < len(self.rows):
            raise IndexError(f"split layer {k} out of range [0, {len(self.rows) - 1}]")
        return self.rows[k]

    def to_dict(self) -> dict:
        """JSON-ready dict: every field, rows as dicts (bytes as ints, ms as floats or None)."""
        d = asdict(self)
        d["prefix_state_shape"] = list(self.prefix_state_shape)
        return d


def choose_split_layer(rows: list[PlanRow], gpu_budget_bytes: int | float | None,
                       tie_rel: float = TIE_REL) -> tuple[int, str]:
    """Pick the split layer: ``(K, reason)``.

    Among rows within ``gpu_budget_bytes`` (None: all), the lowest ``e2e_ms``; rows within ``tie_rel`` of it
    (below a profile's run-to-run noise) go to the higher throughput, then the smaller GPU need. Without
    latencies, the largest K that fits (fewest blocks on the slower CPU). Raises ValueError when ``rows`` is
    empty or none fits.
    """
    if not rows:
        raise ValueError("no split layers to choose from")
    budget = math.inf if gpu_budget_bytes is None else float(gpu_budget_bytes)
    fit = [r for r in rows if r.gpu_total_bytes <= budget]
    if not fit:
        least = min(rows, key=lambda r: r.gpu_total_bytes)
        raise ValueError(f"no split layer fits the GPU budget of {budget / GB:.3f} GB: the smallest need is "
                         f"{least.gpu_total_bytes / GB:.3f} GB at K={least.k} (weights "
                         f"{least.gpu_weight_bytes / GB:.3f} GB, activations "
                         f"{least.gpu_activation_bytes / GB:.3f} GB, overhead {least.gpu_overhead_bytes / GB:.3f} GB)")
    budget_txt = "(no GPU budget)" if gpu_budget_bytes is None else f"the {budget / GB:.2f} GB GPU budget"
    if any(r.e2e_ms is None for r in rows):
        best = max(fit, key=lambda r: r.k)
        return best.k, (f"no profile, latencies unknown: K={best.k}, the largest split layer that fits {budget_txt} "
                        f"(needs {best.gpu_total_bytes / GB:.2f} GB), keeps the fewest decoder blocks on the "
                        f"slower CPU")

    def pick(candidates: list[PlanRow]) -> tuple[PlanRow, int]:
        lowest = min(r.e2e_ms for r in candidates)
        tied = [r for r in candidates if r.e2e_ms <= lowest * (1.0 + tie_rel) + 1e-12]
        return min(tied, key=lambda r: (-r.throughput_fps, r.gpu_total_bytes, r.e2e_ms)), len(tied)

    best, n_tied = pick(fit)
    overall, _ = pick(rows)
    reason = (f"K={best.k}: lowest predicted end-to-end latency {best.e2e_ms:.2f} ms "
              f"({best.throughput_fps:.2f} frames/s pipelined) among the {len(fit)} of {len(rows)} split layers "
              f"that fit {budget_txt} (needs {best.gpu_total_bytes / GB:.2f} GB)")
    if n_tied > 1:
        reason += (f"; {n_tied} split layers are within {tie_rel:.0%} of the lowest latency, this one has the "
                   f"highest throughput")
    if overall.k != best.k:
        reason += (f"; the unconstrained best, K={overall.k} ({overall.e2e_ms:.2f} ms), needs "
                   f"{overall.gpu_total_bytes / GB:.2f} GB")
    return best.k, reason


#: KV caches a decoding prefix holds: the decoding frame's and the next frame's prefill's (decode_overlap on).
PREFIX_KV_CACHES = 2


def frame_decode(cfg) -> tuple[int, int]:
    """A decoding checkpoint's (tokens a frame, tokens each side's KV cache holds) as its ``decode`` config says at
    most, tokens counted as :meth:`LatencyModel.predict_decode` counts them (the first from the prefill, one step
    each after it): every decode's ``max_new_tokens``, plus the extra steps of the turns and the placed tokens (up
    to :data:`~hybrid_vla_ros.transport.layout.MAX_DECODE_ROWS` rows a step, the decode's last token leading);
    (0, 0) for a model that does not decode."""
    spec = getattr(cfg, "decode_spec", None)
    if spec is None:
        return 0, 0
    from ..model.decode import SuffixDecoding
    from ..transport.layout import MAX_DECODE_ROWS

    rows = MAX_DECODE_ROWS
    placed = len(cfg.decode_placed_token_ids)
    steps = spec.decodes_per_frame * spec.settings.max_new_tokens \
        + sum(-(-(len(t) + 1) // rows) - 1 for t in spec.turns) + (-(-(placed + 1) // rows) if placed else 0)
    return steps, SuffixDecoding.bound(cfg.num_tokens, spec.settings, placed, spec.turns)


def plan_split(cfg: VLAConfig, dtype: str | torch.dtype = "fp16", *, profile: dict | None = None,
               gpu_budget_bytes: int | float | None = None, cuda_overhead_bytes: int | float | None = None,
               suffix_dtype: str | torch.dtype | None = None, model_name: str = "",
               profile_name: str | None = None, preprocess_ms: float | None = None,
               decode_tokens: int | None = None, cpu_precision: str = "auto", cpu=None) -> Plan:
    """Memory (and, with a profile, latency) of every split layer of ``cfg``, and the chosen K.

    ``suffix_dtype`` defaults to ``dtype``; the CPU suffix's memory is counted in the dtype a suffix node with
    ``inference_precision: cpu_precision`` (``auto`` or ``dtype``) computes it in on ``cpu``
    (:class:`~hybrid_vla_ros.util.precision.CpuFeatures`; this host's when None): fp32 for a bf16 / fp16 suffix on a
    CPU without native units for it under ``auto``, said in the notes. ``decode_tokens`` > 0: each frame also
    decodes that many tokens (:meth:`LatencyModel.predict_decode`, both KV caches in the memory; the next frame's
    prefill runs in the decode's gaps, so the prefix's cycle is its prefill and its steps, the suffix's its prefill,
    the hand-off and the whole decode); None (default): what the checkpoint's ``decode`` config says
    (:func:`frame_decode`; its KV caches of every turn), 0 without one. Raises ValueError (bad dtype, precision mode
    or token count, profile of another architecture or, for a count given, without decode steps; no K fits),
    RuntimeError when the ring's slot size disagrees with the hand-off payload.
    """
    from_config = decode_tokens is None
    kv_from_config = 0
    if from_config:
        decode_tokens, kv_from_config = frame_decode(cfg)
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"decode_tokens must be an integer >= 0, got {decode_tokens!r}")
    from ..transport.ring import slot_bytes_for

    dtype = _as_dtype(dtype)
    sdtype = _as_dtype(suffix_dtype) if suffix_dtype is not None else dtype
    widened = None
    if sdtype in (torch.float32, torch.bfloat16, torch.float16):
        from ..util.precision import inference_precision

        precision = inference_precision(sdtype, cpu_precision, cpu)
        sdtype, widened = precision.dtype, precision if precision.widened else None
    overhead = int(round(DEFAULT_CUDA_OVERHEAD_GB * GB if cuda_overhead_bytes is None else cuda_overhead_bytes))
    if overhead < 0:
        raise ValueError("cuda overhead must be >= 0 bytes")
    gw = stage_weights(cfg, dtype)
    cw = gw if sdtype == dtype else stage_weights(cfg, sdtype)
    payload = handoff_bytes(cfg, dtype)
    side = ring_side(cfg, dtype)
    slot = slot_bytes_for(cfg.prefix_state_shape, dtype, side)
    # the ring and this plan must agree on the payload: each tensor's bytes rounded up to 64 in the slot
    if not payload <= slot < max(64, payload) + 64 * (1 + len(side)):
        raise RuntimeError(f"ring slot {slot} bytes disagrees with the hand-off payload {payload} bytes")
    lat = latency_model(profile, cfg, dtype, preprocess_ms) if profile is not None else None
    sm = split_model(cfg)
    extra_notes = list(sm.plan_notes)
    if widened is not None:
        extra_notes.append(f"the CPU suffix's memory counts {widened.name}: {widened.reason}")
    moe = expert_counts(cfg)
    if moe is not None:
        extra_notes.append(
            f"mixture of experts: {moe.moe_blocks} of {moe.blocks} decoder blocks route each token to "
            f"{moe.active_experts} of {moe.experts} experts; the blocks hold {moe.total / 1e6:.2f} M parameters, "
            f"{moe.active / 1e6:.2f} M of them active per token: the memory columns count every expert (the last "
            f"block moved to the CPU frees {gw.blocks[-1] / 1e6:.2f} MB of GPU memory in {DTYPE_NAMES.get(dtype)}), "
            "the compute follows the active ones")
    kv_layer = kv_tokens = 0
    decode_latency = bool(decode_tokens)
    if decode_tokens:
        text_cfg = sm.text_config()
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        kv_tokens = kv_from_config or int(cfg.prefix_state_shape[-2]) + decode_tokens - 1
        kv_layer = 2 * int(text_cfg.num_key_value_heads) * int(head_dim) * kv_tokens
        extra_notes.append(f"the prefix holds {PREFIX_KV_CACHES} KV caches (the decoding frame's and the next "
                           "prefill's: decode_overlap, the default)")
        source = "as its decode config says at most" if from_config else "as asked"
        extra_notes.append(f"{decode_tokens} tokens a frame ({source}; the first from the prefill, a decode step "
                           f"each after it): each side holds a KV cache of "
                           f"{kv_tokens} tokens of its own blocks; the round trip per token is two ring hand-offs of "
                           "one row from the profile (`hybrid-vla bench --only decode` measures the real one); the "
                           "next frame's prefill runs in the decode's gaps")
        if from_config and lat is not None and not lat.prefix_step_ms:
            decode_latency = False
            extra_notes.append("the profile has no decode steps: the latency leaves the decode out (profile with "
                               "`hybrid-vla profile --decode`)")
    rows = []
    for k in range(cfg.num_layers + 1):
        act, phase = activation_peak(cfg, k, dtype, "prefix")
        weights = gw.prefix(k)
        sact, _ = activation_peak(cfg, k, sdtype, "suffix")
        row = PlanRow(k=k, gpu_weight_bytes=weights, gpu_activation_bytes=act, gpu_buffer_bytes=gw.prefix_buffers,
                      gpu_overhead_bytes=overhead, gpu_total_bytes=weights + act + gw.prefix_buffers + overhead,
                      gpu_peak_phase=phase, cpu_weight_bytes=cw.suffix(k), cpu_activation_bytes=sact,
                      cpu_total_bytes=cw.suffix(k) + cw.suffix_buffers + sact, handoff_bytes=payload,
                      ring_slot_bytes=slot)
        if decode_tokens:
            row.decode_tokens = decode_tokens
            row.gpu_kv_bytes = PREFIX_KV_CACHES * k * kv_layer * dtype.itemsize
            row.cpu_kv_bytes = (cfg.num_layers - k) * kv_layer * sdtype.itemsize
            row.gpu_total_bytes += row.gpu_kv_bytes
            row.cpu_total_bytes += row.cpu_kv_bytes
        if lat is not None:
            p, h, s = lat.predict(k, payload)
            row.prefix_ms, row.handoff_ms, row.suffix_ms = p, h, s
            decode = prefix_steps = 0.0
            if decode_latency:
                row_bytes = int(cfg.prefix_state_shape[-1]) * dtype.itemsize
                row.prefix_token_ms, row.round_trip_ms, row.suffix_token_ms, decode = lat.predict_decode(
                    k, decode_tokens, row_bytes)
                row.decode_ms = decode
                prefix_steps = (decode_tokens - 1) * row.prefix_token_ms
            row.e2e_ms = p + h + s + decode
            # the next prefill fills the decode's gaps: the prefix is busy for its prefill and its steps, the suffix
            # waits through the whole decode
            cycle = max(p + prefix_steps, h + s + decode)
            row.throughput_fps = 1000.0 / cycle if cycle > 0 else math.inf
        row.fits = gpu_budget_bytes is None or row.gpu_total_bytes <= gpu_budget_bytes
        rows.append(row)
    k, reason = choose_split_layer(rows, gpu_budget_bytes)
    return Plan(model=model_name or cfg.preset or "checkpoint", dtype=DTYPE_NAMES.get(dtype, str(dtype)),
                num_layers=cfg.num_layers, prefix_state_shape=tuple(cfg.prefix_state_shape),
                gpu_budget_bytes=None if gpu_budget_bytes is None else int(gpu_budget_bytes),
                cuda_overhead_bytes=overhead, rows=rows, chosen_k=k, reason=reason, profile=profile_name,
                prefix_device=lat.prefix_device if lat else None, suffix_device=lat.suffix_device if lat else None,
                notes=(list(lat.notes) if lat else []) + extra_notes,
                suffix_dtype=DTYPE_NAMES.get(sdtype, str(sdtype)))


def _gb_to_bytes(gb: float | None) -> int | None:
    if gb is None:
        return None
    if not (gb >= 0 and math.isfinite(gb)):
        raise ValueError(f"a size in GB must be a finite number >= 0, got {gb!r}")
    return int(round(gb * GB))


def plan_for_checkpoint(model_path: str | Path, profile_path: str | Path | None = None,
                        gpu_budget_gb: float | None = None, dtype: str = "fp16",
                        cuda_overhead_gb: float | None = None, preprocess_ms: float | None = None, *,
                        tokens: int = 512, cameras: int | None = None, trust_model_code: bool | None = None,
                        prompt: str | None = None, camera_size: tuple[int, int] | None = None,
                        decode_tokens: int | None = None, cpu_precision: str = "auto") -> Plan:
    """Plan the checkpoint at ``model_path`` from its config files only (no weights).

    ``tokens``: T of a bare transformers language model; ``cameras`` / ``prompt`` / ``camera_size`` /
    ``trust_model_code``: as :func:`hybrid_vla_ros.model.checkpoint.open_checkpoint`. ``gpu_budget_gb``: None for
    no limit. ``decode_tokens``, ``cpu_precision``: as :func:`plan_split`. Raises FileNotFoundError (no config or
    profile), ValueError (bad config, dtype or profile, no K fits).
    """
    from ..model.checkpoint import open_checkpoint

    ck = open_checkpoint(model_path, tokens=tokens, cameras=cameras, trust_model_code=trust_model_code,
                         prompt=prompt, camera_size=camera_size)
    return _plan_with(ck.model, str(model_path), profile_path, gpu_budget_gb, dtype, cuda_overhead_gb, preprocess_ms,
                      decode_tokens, cpu_precision)


def plan_for_preset(name: str, profile_path: str | Path | None = None, gpu_budget_gb: float | None = None,
                    dtype: str = "fp16", cuda_overhead_gb: float | None = None, preprocess_ms: float | None = None,
                    decode_tokens: int | None = None, cpu_precision: str = "auto", **overrides) -> Plan:
    """Like :func:`plan_for_checkpoint` for a preset architecture (``overrides`` as in :func:`preset`)."""
    return _plan_with(preset(name, **overrides), name, profile_path, gpu_budget_gb, dtype, cuda_overhead_gb,
                      preprocess_ms, decode_tokens, cpu_precision)


def _plan_with(cfg, name, profile_path, gpu_budget_gb, dtype, cuda_overhead_gb, preprocess_ms=None,
               decode_tokens: int | None = None, cpu_precision: str = "auto") -> Plan:
    if preprocess_ms is not None and not (preprocess_ms >= 0 and math.isfinite(preprocess_ms)):
        raise ValueError(f"preprocess_ms must be a finite number >= 0, got {preprocess_ms!r}")
    profile = None
    if profile_path is not None:
        from .profiler import load_profile

        profile = load_profile(profile_path)
    return plan_split(cfg, dtype, profile=profile, gpu_budget_bytes=_gb_to_bytes(gpu_budget_gb),
                      cuda_overhead_bytes=_gb_to_bytes(cuda_overhead_gb), model_name=name,
                      profile_name=None if profile_path is None else str(profile_path), preprocess_ms=preprocess_ms,
                      decode_tokens=decode_tokens, cpu_precision=cpu_precision)


# ------------------------------------------------------------------------------------------ output

def _fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def format_table(plan: Plan, dtype_note: str = "") -> str:
    """The plan as a text table (GB, or MB below 1 GB), then the chosen K and the reason."""
    big = max(max(r.gpu_weight_bytes, r.cpu_total_bytes) for r in plan.rows) >= GB
    unit, div = ("GB", GB) if big else ("MB", 1e6)
    cols = ["K", f"GPU weights {unit}", f"GPU act {unit}", f"GPU ovh+buf {unit}", f"GPU total {unit}",
            f"CPU suffix {unit}", "hand-off MB", "prefix ms", "hand-off ms", "suffix ms", "e2e ms", "fps", "fits"]
    lines = []
    for r in plan.rows:
        mark = "*" if r.k == plan.chosen_k else ""
        lines.append([f"{r.k}{mark}", f"{r.gpu_weight_bytes / div:.3f}", f"{r.gpu_activation_bytes / div:.3f}",
                      f"{(r.gpu_overhead_bytes + r.gpu_buffer_bytes) / div:.3f}", f"{r.gpu_total_bytes / div:.3f}",
                      f"{r.cpu_total_bytes / div:.3f}", f"{r.handoff_bytes / 1e6:.3f}", _fmt_ms(r.prefix_ms),
                      _fmt_ms(r.handoff_ms), _fmt_ms(r.suffix_ms), _fmt_ms(r.e2e_ms),
                      "n/a" if r.throughput_fps is None else f"{r.throughput_fps:.2f}",
                      "yes" if r.fits else "no"])
    if plan.rows[0].decode_tokens:
        cols[-2:-2] = [f"KV GPU/CPU {unit}", "token ms (pre+rt+suf)", "decode ms"]
        for line, r in zip(lines, plan.rows):
            token = ("n/a" if r.prefix_token_ms is None else
                     f"{r.prefix_token_ms:.2f}+{r.round_trip_ms:.2f}+{r.suffix_token_ms:.2f}")
            line[-2:-2] = [f"{r.gpu_kv_bytes / div:.3f}/{r.cpu_kv_bytes / div:.3f}", token, _fmt_ms(r.decode_ms)]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    if plan.suffix_dtype and plan.suffix_dtype != plan.dtype:
        dtype_note += f" (the CPU suffix in {plan.suffix_dtype})"
    out = [f"split plan for {plan.model}: {plan.num_layers} decoder blocks, dtype {plan.dtype}{dtype_note}, "
           f"hidden states {tuple(plan.prefix_state_shape)}; GPU budget "
           + ("none" if plan.gpu_budget_bytes is None else f"{plan.gpu_budget_bytes / GB:.2f} GB")
           + f"; CUDA overhead allowance {plan.cuda_overhead_bytes / GB:.2f} GB (assumed)"]
    if plan.profile:
        out.append(f"latencies from {plan.profile}: prefix on {plan.prefix_device}, suffix on {plan.suffix_device}")
    else:
        out.append("no profile: latencies n/a (run `hybrid-vla profile` and pass --profile)")
    out += [f"note: {n}" for n in plan.notes]
    out.append(" | ".join(c.rjust(w) for c, w in zip(cols, widths)))
    out.append("-+-".join("-" * w for w in widths))
    out += [" | ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    out.append(f"chosen split layer: K={plan.chosen_k} -- {plan.reason}")
    return "\n".join(out)


def plot_plan(plan: Plan, path: str | Path) -> Path:
    """Write a PNG of memory and (with a profile) predicted latency vs K; returns the path. Raises OSError."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r.k for r in plan.rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    w = [r.gpu_weight_bytes / GB for r in plan.rows]
    a = [r.gpu_activation_bytes / GB for r in plan.rows]
    o = [(r.gpu_overhead_bytes + r.gpu_buffer_bytes) / GB for r in plan.rows]
    ax1.bar(ks, w, label="GPU weights")
    ax1.bar(ks, a, bottom=w, label="GPU activations (est.)")
    ax1.bar(ks, o, bottom=[x + y for x, y in zip(w, a)], label="CUDA overhead (assumed)")
    ax1.plot(ks, [r.cpu_total_bytes / GB for r in plan.rows], "k.-", label="CPU suffix")
    if plan.gpu_budget_bytes is not None:
        ax1.axhline(plan.gpu_budget_bytes / GB, color="r", ls="--",
                    label=f"budget {plan.gpu_budget_bytes / GB:.1f} GB")
    ax1.axvline(plan.chosen_k, color="g", ls=":", label=f"chosen K={plan.chosen_k}")
    ax1.set_ylabel("memory, GB")
    title = f"{plan.model}, {plan.dtype}: memory and latency vs split layer K"
    if plan.prefix_device == "cpu":  # profiled where there is no GPU: the bars are the plan for one
        title += "\n(prefix profiled on the CPU: the bars are what the prefix would hold on a GPU)"
    ax1.set_title(title, fontsize=10)
    ax1.legend(fontsize=7, loc="upper left")
    if plan.rows[0].e2e_ms is not None:
        ax2.plot(ks, [r.prefix_ms for r in plan.rows], label=f"prefix ({plan.prefix_device})")
        ax2.plot(ks, [r.handoff_ms + r.suffix_ms for r in plan.rows],
                 label=f"hand-off + suffix ({plan.suffix_device})")
        if plan.rows[0].decode_ms is not None:
            ax2.plot(ks, [r.decode_ms for r in plan.rows], "m--",
                     label=f"decode of {plan.rows[0].decode_tokens} tokens (in end-to-end)")
        ax2.plot(ks, [r.e2e_ms for r in plan.rows], "k-", lw=2, label="end-to-end")
        ax2.legend(fontsize=7)
    else:
        ax2.text(0.5, 0.5, "no profile: latency n/a", ha="center", va="center", transform=ax2.transAxes)
    ax2.axvline(plan.chosen_k, color="g", ls=":")
    ax2.set_xlabel("split layer K (decoder blocks on the GPU)")
    ax2.set_ylabel("predicted ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ live re-split policy

def budget_under_pressure(plan: Plan, current_k: int, free_bytes: int, threshold_bytes: int) -> int | None:
    """GPU budget (bytes) for a re-plan under memory pressure: the current need minus the shortfall
    ``threshold_bytes - free_bytes``; None when ``free_bytes >= threshold_bytes``."""
    if free_bytes >= threshold_bytes:
        return None
    return plan.row(current_k).gpu_total_bytes - (threshold_bytes - free_bytes)


def check_budget(plan: Plan, k: int, budget_bytes: int | float | None) -> None:
    """Raise ValueError (naming the largest K that fits) when the plan's GPU total for ``k`` exceeds
    ``budget_bytes``; None or <= 0: no budget. Pure."""
    if budget_bytes is None or budget_bytes <= 0:
        return
    need = plan.row(k).gpu_total_bytes
    if need <= budget_bytes:
        return
    fitting = [r.k for r in plan.rows if r.gpu_total_bytes <= budget_bytes]
    hint = (f"the largest K that fits is {max(fitting)}" if fitting
            else "no K fits (even K=0 needs " f"{plan.rows[0].gpu_total_bytes / GB:.2f} GB)")
    raise ValueError(f"split layer {k} needs {need / GB:.2f} GB of GPU memory by the plan (`hybrid-vla plan`), "
                     f"over the {budget_bytes / GB:.2f} GB gpu_budget_gb: {hint}")


@dataclass
class AutoResplitPolicy:
    """When ``split_layer: auto`` moves K on memory pressure, and back, given driver-level free bytes (pure).

    * down, at once: free < ``low_bytes`` -> the largest K within :func:`budget_under_pressure`;
    * up: for ``up_after`` readings in a row a move to K' (at most ``plan.chosen_k``) leaves ``high_bytes`` free
      -> the largest such K'. ``high_bytes`` > ``low_bytes`` prevents oscillation.

    ``calm``: readings in a row that allowed a move up. Raises ValueError for ``low_bytes`` <= 0,
    ``high_bytes`` <= ``low_bytes`` or ``up_after`` < 1.
    """

    plan: Plan
    low_bytes: int
    high_bytes: int
    up_after: int = 3
    calm: int = 0

    def __post_init__(self):
        if self.low_bytes <= 0:
            raise ValueError(f"the low free-memory threshold must be > 0 bytes, got {self.low_bytes}")
        if self.high_bytes <= self.low_bytes:
            raise ValueError(f"the recover threshold ({self.high_bytes} bytes) must be above the low one "
                             f"({self.low_bytes} bytes)")
        if self.up_after < 1:
            raise ValueError(f"up_after must be >= 1 reading, got {self.up_after}")

    @staticmethod
    def thresholds(free_mb: float, recover_mb: float) -> tuple[int, int]:
        """(low, high) bytes from MiB thresholds; ``recover_mb`` 0 means twice ``free_mb``."""
        low = int(free_mb * 2**20)
        high = int((recover_mb if recover_mb > 0 else 2 * free_mb) * 2**20)
        return low, high

    def decide(self, current_k: int, free_bytes: int) -> tuple[int | None, str]:
        """(new K or None to stay, why). Raises ValueError when under the low threshold and no K fits."""
        if free_bytes < self.low_bytes:
            self.calm = 0
            budget = budget_under_pressure(self.plan, current_k, free_bytes, self.low_bytes)
            k, reason = choose_split_layer(self.plan.rows, budget)
            if k < current_k:
                return k, (f"free {free_bytes / 2**20:.0f} MiB < {self.low_bytes / 2**20:.0f} MiB: down to K={k} "
                           f"({reason})")
            return None, (f"free {free_bytes / 2**20:.0f} MiB under the threshold, and K={current_k} is already "
                          "the lowest that fits")
        need_now = self.plan.row(current_k).gpu_total_bytes
        best = None
        for r in self.plan.rows[current_k + 1:self.plan.chosen_k + 1]:
            if free_bytes - (r.gpu_total_bytes - need_now) >= self.high_bytes:
                best = r.k
        if best is None:
            self.calm = 0
            return None, "no pressure"
        self.calm += 1
        if self.calm < self.up_after:
            return None, f"free memory recovered ({self.calm}/{self.up_after} readings)"
        self.calm = 0
        return best, (f"free {free_bytes / 2**20:.0f} MiB: up to K={best} leaves >= "
                      f"{self.high_bytes / 2**20:.0f} MiB free for {self.up_after} readings")
