"""bf16 linear layers whose weights are packed once for oneDNN: the CPU suffix's decode steps and prefill.

torch computes a bf16 ``nn.Linear`` on the CPU through oneDNN's matmul, which reorders the weight into its blocked
layout on every call; for a decode step (one row) the reorder costs about as much as the product. Packing each
weight once (``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's weight freezing uses) and calling
``torch.ops.mkldnn._linear_pointwise`` runs the same kernels without it. Measured on the 2-vCPU Intel Xeon with
AMX (one thread): SmolLM2's 576 x 1536 projection 0.131 -> 0.064 ms for one row (2.0x), 0.346 -> 0.246 ms for 128
rows, MindDrive-0.5B's 896 x 4864 0.66 -> 0.37 ms for one row, with outputs bit-identical to the unpacked layer
(checked again for every model at pack time: :func:`pack_linears_` packs nothing where they differ).

Only where oneDNN computes bf16 natively (AVX512-BF16 or AMX: ``torch.ops.mkldnn._is_mkldnn_bf16_supported``);
fp32 layers are left to MKL (its matrix-vector product already streams the weights).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["PackedLinear", "packing_supported", "pack_linears_", "pack_lm_head_", "packs_exactly"]


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


@torch.inference_mode()
def packs_exactly(linear: nn.Linear, rows=(1, 4, 128), seed: int = 0) -> bool:
    """True when the packed layer gives the unpacked one's output bit for bit on random inputs of each row count."""
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
    packs natively and the first one's output stays bit-identical (:func:`packs_exactly`); returns how many were
    replaced (0: none, or not here). Layers already packed, and layers of other dtypes, are left alone."""
    if not packing_supported()[0]:
        return 0
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
               if _packable(child)]
    if not targets or not packs_exactly(targets[0][2]):
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


@torch.inference_mode()
def pack_lm_head_(head) -> bool:
    """Pack a :class:`~hybrid_vla_ros.model.decode.LMHead`'s bf16 CPU weight (V, H) as :func:`pack_linears_` packs a
    linear layer (its ``packed`` then computes the logits; its ``weight`` is let go). Returns whether it did."""
    w = head.weight
    if w is None or w.dtype != torch.bfloat16 or w.device.type != "cpu" or not packing_supported()[0]:
        return False
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    linear.weight = w
    if not packs_exactly(linear):
        return False
    head.packed = PackedLinear(linear)
    head.weight = None
    return True
