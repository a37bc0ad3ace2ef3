"""What crosses the split for one frame (:class:`SplitState`): h_K plus the side tensors the blocks after K need
that are not a function of T alone (Qwen-VL / GLM-4V rotary positions, Qwen3-VL DeepStack features, Gemma 3's
image blocks, PaliGemma's prefix and positions, Mllama's vision states and cross-attention masks); text models send
h_K only. The ring carries them as
:class:`~hybrid_vla_ros.transport.contract.TensorSpec` entries (:func:`side_specs`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch

from ..util.numerics import warm_vector_math

# oneMKL's vector math chooses its kernels on this thread, before a model's first multi-threaded sin / cos / exp;
# here because every path that computes with a model imports this module (util/numerics.py says what happened
# without it)
warm_vector_math()

#: Side tensor names, as the ring's contract declares them.
POSITION_IDS, VISUAL_MASK, DEEPSTACK, IMAGE_BLOCKS = "position_ids", "visual_mask", "deepstack", "image_blocks"
CROSS_STATES, CROSS_MASK, CROSS_ROWS = "cross_states", "cross_mask", "cross_rows"
#: Side tensors in the model's floating dtype (moved with it); the others are integer or bool.
FLOATING_SIDE = (DEEPSTACK, CROSS_STATES, CROSS_MASK, CROSS_ROWS)


class BlockMaskRule(enum.Enum):
    """How a VLM family's forward lets the tokens of one block (:attr:`SplitState.image_blocks`) attend to each other
    both ways, per attention kind; known on both sides from the spec's VLM type (:func:`~.vlm.block_mask_rule`).

    ``WINDOW_OF_BLOCKS`` (Gemma 3, transformers' ``create_masks_for_vision_model``): full layers causal OR the
    block, sliding layers the window AND (causal OR the block). ``EACH_KIND`` (PaliGemma's forward): each kind's own
    mask (causal, or the causal window) OR the block."""

    WINDOW_OF_BLOCKS = "window_of_blocks"
    EACH_KIND = "each_kind"


@dataclass
class SplitState:
    """One frame's state at split layer K.

    ``hidden_states``: h_K, (T, H) or (P, T, H) with P LLM passes, model dtype. ``position_ids``: (3 or 4, 1, T)
    int64 (Qwen2/2.5/3-VL, GLM-4V: multimodal rotary positions) or (1, 1, T) (PaliGemma: positions from 1), None
    for ``arange(T)``. ``visual_mask``: (T,) bool; ``deepstack``: (levels, V, H) model
    dtype, level i added to the visual tokens after block i (Qwen3-VL); both None otherwise. The side tensors hold
    every level whatever K is, so a re-split keeps the contract; the suffix adds levels >= K. ``image_blocks``:
    (T,) int64, transformers' ``block_sequence_ids``: tokens with the same number >= 0 attend to each other both
    ways, -1 causally (Gemma 3: each image a block; PaliGemma: images and prompt one block), so every block's masks
    need it (combined per :class:`BlockMaskRule`); None otherwise. ``cross_states`` (N, P, H) model dtype: the
    projected vision states Mllama's cross-attention blocks read (N = images x tiles, P patches a tile);
    ``cross_mask`` (1, 1, T, N * P) and ``cross_rows`` (1, 1, T, 1), model dtype: the additive cross-attention mask
    and the rows that see any tile, as ``MllamaModel.forward`` prepares them; all three None otherwise.
    """

    hidden_states: torch.Tensor
    position_ids: torch.Tensor | None = None
    visual_mask: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None
    image_blocks: torch.Tensor | None = None
    cross_states: torch.Tensor | None = None
    cross_mask: torch.Tensor | None = None
    cross_rows: torch.Tensor | None = None

    def side(self) -> dict[str, torch.Tensor]:
        """The side tensors present, by their contract name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "hidden_states" and getattr(self, f.name) is not None}

    @classmethod
    def from_side(cls, hidden_states: torch.Tensor, side: dict[str, torch.Tensor]) -> "SplitState":
        """The state from h_K and a ring slot's side tensors. Raises ValueError for an unknown name."""
        known = {f.name for f in fields(cls)} - {"hidden_states"}
        unknown = set(side) - known
        if unknown:
            raise ValueError(f"unknown side tensor(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(hidden_states, **side)

    def rows(self, start: int, stop: int) -> "SplitState":
        """Tokens [start, stop) of a one-pass state (a chunk of a prefill): their hidden states, positions, visual
        mask and the DeepStack rows of the visual tokens among them. Raises ValueError for a state with
        ``image_blocks`` (an image's tokens attend to later ones of the same image: not chunked) or cross-attention
        side tensors (not chunked here)."""
        if self.image_blocks is not None:
            raise ValueError("a state whose images attend both ways (image_blocks) is not split into chunks")
        if self.cross_states is not None:
            raise ValueError("a state with cross-attention vision states is not split into chunks")
        deep = None
        if self.deepstack is not None:
            before = int(self.visual_mask[:start].sum())
            deep = self.deepstack[:, before:before + int(self.visual_mask[start:stop].sum())]
        return SplitState(self.hidden_states[start:stop],
                          None if self.position_ids is None else self.position_ids[..., start:stop],
                          None if self.visual_mask is None else self.visual_mask[start:stop], deep)

    def to(self, device=None, dtype=None) -> "SplitState":
        """Float tensors to ``dtype`` and ``device``; integer / bool side tensors to ``device`` only."""
        def move(t, floating):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype) if floating and dtype is not None else t.to(device=device)

        return SplitState(move(self.hidden_states, True), **{name: move(t, name in FLOATING_SIDE)
                                                             for name, t in self.side().items()})


def side_specs(cfg, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of each side tensor sent with h_K, from ``cfg.side`` / ``cfg.side_shapes``."""
    dtypes = {POSITION_IDS: torch.int64, VISUAL_MASK: torch.bool, IMAGE_BLOCKS: torch.int64,
              **{name: dtype for name in FLOATING_SIDE}}
    shapes = getattr(cfg, "side_shapes", {}) or {}
    return [(name, tuple(int(d) for d in shapes[name]), dtypes[name]) for name in getattr(cfg, "side", ())]


def side_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of the side tensors per frame."""
    total = 0
    for _, shape, dt in side_specs(cfg, dtype):
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty((), dtype=dt).element_size()
    return total

