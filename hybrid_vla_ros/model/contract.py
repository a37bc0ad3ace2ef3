"""What crosses the split for one frame: the hidden states h_K and the side tensors the decoder blocks after K
need that are not a function of T alone.

A text model needs nothing but h_K: its positions are ``arange(T)`` and its masks follow from T and the config
(:mod:`hybrid_vla_ros.model.text`). A Qwen-VL family needs its multimodal rotary positions, which the VLM computes
from the image grid; Qwen3-VL also the DeepStack features its front adds to the visual tokens after blocks
0 .. levels-1 (with K below ``levels`` the suffix adds the rest). Both sides use :class:`SplitState`; the ring
carries the side tensors as declared :class:`~hybrid_vla_ros.transport.contract.TensorSpec` entries next to the
hidden states (:func:`side_specs`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

#: Side tensor names, as the ring's contract declares them.
POSITION_IDS, VISUAL_MASK, DEEPSTACK = "position_ids", "visual_mask", "deepstack"


@dataclass
class SplitState:
    """One frame's state at a split layer K.

    ``hidden_states``: h_K, (T, H) (or (P, T, H) with P LLM passes) in the model dtype. ``position_ids``:
    multimodal rotary positions (3 or 4, 1, T) int64 (Qwen2-VL / 2.5-VL / 3-VL), None for ``arange(T)``.
    ``visual_mask``: (T,) bool, the visual tokens; ``deepstack``: (levels, V, H) in the model dtype, level i
    added to the visual tokens after block i (Qwen3-VL), both None otherwise. The side tensors hold every
    level whatever K is (the contract does not change with a re-split); the suffix adds levels >= K.
    """

    hidden_states: torch.Tensor
    position_ids: torch.Tensor | None = None
    visual_mask: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None

    def side(self) -> dict[str, torch.Tensor]:
        """The side tensors present, by their contract name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "hidden_states" and getattr(self, f.name) is not None}

    @classmethod
    def from_side(cls, hidden_states: torch.Tensor, side: dict[str, torch.Tensor]) -> "SplitState":
        """The state from h_K and the side tensors by contract name (a ring slot's). Raises ValueError for a
        name this package does not know."""
        known = {f.name for f in fields(cls)} - {"hidden_states"}
        unknown = set(side) - known
        if unknown:
            raise ValueError(f"unknown side tensor(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(hidden_states, **side)

    def to(self, device=None, dtype=None) -> "SplitState":
        """hidden_states and deepstack in ``dtype`` on ``device``; the integer / bool side tensors on
        ``device`` only."""
        def move(t, floating):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype) if floating and dtype is not None else t.to(device=device)

        return SplitState(move(self.hidden_states, True), move(self.position_ids, False),
                          move(self.visual_mask, False), move(self.deepstack, True))


def side_specs(cfg, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every side tensor a model sends with h_K (a VLM spec's ``side`` /
    ``side_shapes``; none for other models): positions int64, the visual mask bool, DeepStack features in the
    model ``dtype``."""
    dtypes = {POSITION_IDS: torch.int64, VISUAL_MASK: torch.bool, DEEPSTACK: dtype}
    shapes = getattr(cfg, "side_shapes", {}) or {}
    return [(name, tuple(int(d) for d in shapes[name]), dtypes[name]) for name in getattr(cfg, "side", ())]


def side_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of the side tensors per frame (:func:`side_specs`)."""
    total = 0
    for _, shape, dt in side_specs(cfg, dtype):
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty((), dtype=dt).element_size()
    return total

