"""bf16 linear layers and mixture-of-experts experts whose weights are packed once for oneDNN: the CPU suffix's
decode steps and prefill.

torch computes a bf16 ``nn.Linear`` on the CPU through oneDNN's matmul, which reorders the weight into its blocked
layout on every call; for a decode step (one row) the reorder costs about as much as the product. Packing each
weight once (``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's weight freezing uses) and calling
``torch.ops.mkldnn._linear_pointwise`` runs the same kernels without it. Measured on the 2-vCPU Intel Xeon with
AMX (one thread): SmolLM2's 576 x 1536 projection 0.131 -> 0.064 ms for one row (2.0x), 0.346 -> 0.246 ms for 128
rows, MindDrive-0.5B's 896 x 4864 0.66 -> 0.37 ms for one row, with outputs bit-identical to the unpacked layer
(checked again for every model at pack time: :func:`pack_linears_` packs nothing where they differ).

Only where oneDNN computes bf16 natively (AVX512-BF16 or AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported``);
fp32 layers are left to MKL (its matrix-vector product already streams the weights).

A MoE block's experts (transformers' fused experts module run in ``grouped_mm``) are packed per expert by
:func:`pack_experts_` (:class:`PackedExperts`), with the same bit-for-bit check; figures and what is left in
docs/models.md ("The MoE suffix at speed").
"""
from __future__ import annotations

import functools
import inspect
import math
import threading

import torch
from torch import nn

__all__ = ["CHECK_ROWS", "ExpertsWorkspace", "PackedExperts", "PackedLinear", "fused_experts_count",
           "packing_supported", "pack_experts_", "pack_linears_", "pack_lm_head_", "packs_exactly"]


def packing_supported() -> tuple[bool, str]:
    """(whether bf16 weights can be packed on this CPU, why not)."""
    if not torch.backends.mkldnn.is_available():
        return False, "torch was built without oneDNN"
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError) as e:
        return False, f"this torch has no oneDNN bf16 query ({type(e).__name__})"
    return (True, "") if native else (False, "this CPU has no AVX512-BF16 / AMX (oneDNN would emulate bf16)")


class PackedLinear(nn.Module):
    """``nn.Linear`` (bf16, CPU) with its weight (out, in) packed into oneDNN's layout once: (..., in) -> (..., out),
    bf16. ``bias`` stays a parameter (or None). Built from a linear layer, whose weight it replaces."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _packable(m: nn.Module) -> bool:
    return (type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
            and not m.weight.is_meta)


@functools.cache
def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _weight_read_directly(parent: nn.Module, name: str) -> bool:
    """Whether ``parent``'s class reads its child ``name``'s ``weight`` itself (Jamba's state-space mixer computes
    ``self.dt_proj.weight @ ...``): such a layer must stay a plain ``nn.Linear``. A class whose source cannot be
    read counts as reading it."""
    source = _class_source(type(parent))
    return not source or f".{name}.weight" in source


#: Row counts the exactness checks try: every count a decode step or a short prefill gives, then larger ones. oneDNN
#: picks its kernel and blocking by the row count, the thread count and the weight's layout, and a packed product
#: differed from the unpacked one only in bands of row counts on the Intel AMX host (e.g. 33-127 rows of a 2048 x
#: 1536 product on 2 threads, 7-65 rows of gpt-oss's transposed experts on one): a few sampled counts missed them.
CHECK_ROWS = (*range(1, 161), 192, 200, 255, 256, 300, 384, 512)
#: Row counts the LM head's check tries: a decode step's logits are one row (a few with drafted tokens).
LM_HEAD_ROWS = tuple(range(1, 17))


@torch.inference_mode()
def packs_exactly(linear: nn.Linear, rows=CHECK_ROWS, seed: int = 0) -> bool:
    """True when the packed layer gives the unpacked one's output bit for bit on random inputs of each row count
    (on this process's torch threads: the check holds for the thread count it ran at)."""
    packed = PackedLinear(linear)
    g = torch.Generator().manual_seed(seed)
    for n in rows:
        x = torch.randn((n, linear.in_features), generator=g).to(torch.bfloat16)
        if not torch.equal(packed(x), linear(x)):
            return False
    return True


@torch.inference_mode()
def pack_linears_(module: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` inside ``module`` by a :class:`PackedLinear`, in place, where the CPU
    packs natively and the packed output stays bit-identical (:func:`packs_exactly` on the first layer of each
    weight shape, at every row count of :data:`CHECK_ROWS`, on this process's torch threads); returns how many were
    replaced (0: none, or not here). Layers already packed, layers of other dtypes and layers whose weight their
    parent reads itself (:func:`_weight_read_directly`) are left alone."""
    if not packing_supported()[0]:
        return 0
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if _packable(child) and not _weight_read_directly(parent, name)]
    exact: dict[tuple, bool] = {}  # per weight shape and bias: oneDNN's kernel choice depends on the shape
    done = 0
    for parent, name, child in targets:
        shape = (child.in_features, child.out_features, child.bias is not None)
        if shape not in exact:
            exact[shape] = packs_exactly(child)
        if exact[shape]:
            setattr(parent, name, PackedLinear(child))
            done += 1
    return done


@torch.inference_mode()
def pack_lm_head_(head) -> bool:
    """Pack a :class:`~hybrid_vla_ros.model.decode.LMHead`'s bf16 CPU weight (V, H) as :func:`pack_linears_` packs a
    linear layer, checked at :data:`LM_HEAD_ROWS` (its ``packed`` then computes the logits; its ``weight`` is let
    go). Returns whether it did."""
    w = head.weight
    if w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not packing_supported()[0]:
        return False
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    linear.weight = w
    if not packs_exactly(linear, rows=LM_HEAD_ROWS):
        return False
    head.packed = PackedLinear(linear)
    head.weight = None
    return True


def _is_fused_experts(m: nn.Module) -> bool:
    """A transformers experts module of the fused kind (``use_experts_implementation``: ``gate_up_proj`` or
    ``up_proj`` (E, out, in) or transposed, ``down_proj``), bf16 on the CPU and not yet packed."""
    weight = getattr(m, "gate_up_proj", None) if getattr(m, "has_gate", False) else getattr(m, "up_proj", None)
    down = getattr(m, "down_proj", None)
    return (hasattr(m, "is_transposed") and isinstance(weight, nn.Parameter) and isinstance(down, nn.Parameter)
            and weight.dim() == 3 and down.dim() == 3 and not getattr(m, "_is_expert_parallel", False)
            and all(p.dtype == torch.bfloat16 and p.device.type == "cpu" and not p.is_meta for p in (weight, down)))


class ExpertsWorkspace:
    """The (S, H) buffers :class:`PackedExperts` gathers, weights and reorders rows in (S = tokens x top-k), kept
    from block to block and frame to frame, one set per thread: a fresh 30-70 MB tensor per block pays its page
    faults each time (Qwen3-30B-A3B at T = 1024: the row gather 17 ms fresh, 3 ms into a kept buffer; on the Intel
    AMX host). Shared by every packed experts module of a stage (blocks run one after another); holds the largest
    size asked for."""

    def __init__(self):
        self._local = threading.local()

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (contents undefined) backed by this thread's buffer ``name``."""
        buffers = self._local.__dict__.setdefault("buffers", {})
        n = math.prod(shape)
        buf = buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = buffers[name] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)


class PackedExperts(nn.Module):
    """A mixture-of-experts block's experts (transformers' fused experts module: ``gate_up_proj`` (E, 2I, H) and
    ``down_proj`` (E, H, I), or both transposed) with each expert's two projections packed for oneDNN once, in bf16
    on the CPU: ``(hidden (T, H), top_k_index (T, k) int64, top_k_weights (T, k)) -> (T, H)`` in ``hidden``'s
    dtype, called by its block as the module it replaces.

    The steps are those of transformers' ``grouped_mm`` experts (``integrations/moe.py``: rows sorted by expert,
    gathered once, routing weights applied, the top-k rows summed per token in the same order), so the output is
    bit for bit the one ``from_pretrained``'s implementation gives (checked by :func:`pack_experts_`); each
    expert's two GEMMs run on packed weights, which spares oneDNN the weight reorder a plain bf16 product pays on
    every call (6 MB per expert and projection for Qwen3-30B-A3B), and the (S, H) intermediates live in a kept
    :class:`ExpertsWorkspace`. The family's own gate (``_apply_gate``: SwiGLU, gpt-oss's clamped one), activation,
    biases and post-expert norm are those of ``experts``, the wrapped module, which keeps no expert weights once
    :meth:`release` has run (they would double the memory). Raises AttributeError for a module without them."""

    def __init__(self, experts: nn.Module, workspace: ExpertsWorkspace | None = None):
        super().__init__()
        self.workspace = workspace or ExpertsWorkspace()
        self.has_gate = bool(experts.has_gate)
        self._names = ("gate_up_proj" if self.has_gate else "up_proj", "down_proj")
        first, down = (getattr(experts, n).detach() for n in self._names)
        self.num_experts = int(first.shape[0])
        self._first, self._down = [], []
        for e in range(self.num_experts):
            for name, stored, packed in (("first", first, self._first), ("down", down, self._down)):
                w = stored[e].t() if experts.is_transposed else stored[e]  # nn.Linear's (out, in)
                packed.append(torch.ops.mkldnn._reorder_linear_weight(w.contiguous()))
                self.register_buffer(f"{name}_{e}", packed[-1], persistent=False)
        self.experts = experts

    def release(self) -> None:
        """Let the wrapped module's unpacked expert weights go (the packed copies replace them)."""
        for name in self._names:
            if name in self.experts._parameters:
                delattr(self.experts, name)

    def _bias(self, name: str):
        return getattr(self.experts, name, None) if self.experts.has_bias else None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.size(-1)
        tokens, width = hidden_states.shape
        if tokens == 0:
            return hidden_states.new_zeros(hidden_states.shape)
        expert_ids, perm = torch.sort(top_k_index.reshape(-1))
        ws = self.workspace
        source = perm // top_k
        rows = torch.index_select(hidden_states.to(torch.bfloat16), 0, source,
                                  out=ws.take("rows", (source.numel(), width), torch.bfloat16))
        weights = top_k_weights.reshape(-1)[perm]
        first_bias = self._bias("gate_up_proj_bias" if self.has_gate else "up_proj_bias")
        down_bias = self._bias("down_proj_bias")
        out = None  # (S, H) in the routing product's dtype (transformers promotes bf16 x fp32 weights to fp32)
        start = 0
        for e, count in enumerate(torch.bincount(expert_ids, minlength=self.num_experts).tolist()):
            if count == 0:
                continue
            end = start + count
            h = torch.ops.mkldnn._linear_pointwise(rows[start:end], self._first[e], None, "none", [], "")
            if first_bias is not None:
                h.add_(first_bias[e])
            h = self.experts._apply_gate(h) if self.has_gate else self.experts.act_fn(h)
            y = torch.ops.mkldnn._linear_pointwise(h.to(torch.bfloat16), self._down[e], None, "none", [], "")
            if down_bias is not None:
                y.add_(down_bias[e])
            if self.experts.has_post_expert_norm:
                y = self.experts.post_expert_norm(y)
            if out is None:
                out = ws.take("routed", rows.shape, torch.result_type(y, weights))
            torch.mul(y, weights[start:end].unsqueeze(-1), out=out[start:end])  # the routing weights, in place
            start = end
        restore = torch.empty_like(perm)
        restore[perm] = torch.arange(perm.numel(), device=perm.device)
        ordered = torch.index_select(out, 0, restore, out=ws.take("ordered", out.shape, out.dtype))
        summed = torch.sum(ordered.view(tokens, top_k, width), dim=1,
                           out=ws.take("summed", (tokens, width), out.dtype))
        return summed.to(hidden_states.dtype, copy=True)  # a copy: the buffer is the next block's


@torch.inference_mode()
def _packs_experts_exactly(experts: nn.Module, packed: PackedExperts, rows=CHECK_ROWS, seed: int = 0) -> bool:
    """True when ``packed`` gives ``experts``' own output bit for bit when one expert takes each row count of
    ``rows`` (the counts a prefill gives an expert; the kernel oneDNN picks depends on it), on this process's torch
    threads."""
    g = torch.Generator().manual_seed(seed)
    stored = getattr(experts, packed._names[0])
    width = int(stored.shape[1] if experts.is_transposed else stored.shape[2])
    for n in rows:
        x = torch.randn((n, width), generator=g).to(torch.bfloat16)
        index = torch.full((n, 1), int(torch.randint(packed.num_experts, (1,), generator=g)), dtype=torch.long)
        weights = torch.rand((n, 1), generator=g)
        if not torch.equal(packed(x, index, weights), experts(x, index, weights)):
            return False
    return True


def fused_experts_count(module: nn.Module) -> int:
    """How many bf16 CPU experts modules of transformers' fused kind running ``grouped_mm`` ``module`` holds (those
    :func:`pack_experts_` would try)."""
    return sum(_is_fused_experts(m) and getattr(getattr(m, "config", None), "_experts_implementation", None)
               == "grouped_mm" for m in module.modules())


@torch.inference_mode()
def pack_experts_(module: nn.Module, workspace: ExpertsWorkspace | None = None) -> int:
    """Replace every bf16 CPU mixture-of-experts experts module inside ``module`` that runs transformers'
    ``grouped_mm`` experts by a :class:`PackedExperts` (one ``workspace`` for all), in place, where the CPU packs
    natively and the first one's output stays bit-identical at every row count of :data:`CHECK_ROWS` (on this
    process's torch threads); returns how many were replaced (0: none, not here,
    or another experts implementation, whose arithmetic differs: ``eager`` adds each expert's rows in bf16)."""
    if not packing_supported()[0]:
        return 0
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if _is_fused_experts(child)
               and getattr(getattr(child, "config", None), "_experts_implementation", None) == "grouped_mm"]
    if not targets:
        return 0
    workspace = workspace or ExpertsWorkspace()
    for i, (parent, name, child) in enumerate(targets):
        packed = PackedExperts(child, workspace)
        if i == 0 and not _packs_experts_exactly(child, packed):
            return 0
        packed.release()
        setattr(parent, name, packed)
    return len(targets)
