"""Models cut into parts that can be timed one at a time (read by split.profiler): each part is built on the
``meta`` device, given random weights (:func:`random_init_`), timed and freed (:func:`free_`), so a preset is
profiled without ever holding its weights. This is the one module that knows the vision encoders apart.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from .eva02 import EVA02ViT


def random_init_(module: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """Give a meta-device module random weights on ``device`` in ``dtype``, in place; returns it in eval mode
    without gradients. Uses the global torch RNG; a child ``rotary_emb`` is rebuilt with float32 tables, as a
    loaded stage has. Raises RuntimeError for a buffer other than ``position_ids`` or one a ``rebuild_buffers``
    computes, which would be left uninitialised.
    """
    device = torch.device(device)
    rotary = getattr(module, "rotary_emb", None)
    if rotary is not None:
        del module.rotary_emb
    module.to(dtype)  # on meta this only records the dtype of floating tensors
    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    for sub in module.modules():
        if hasattr(sub, "rebuild_buffers"):
            sub.rebuild_buffers(device)
            continue
        for bname, buf in list(sub.named_buffers(recurse=False)):
            if bname != "position_ids":
                raise RuntimeError(f"cannot initialise buffer {bname!r} of {type(sub).__name__}")
            sub.register_buffer(bname, torch.arange(buf.shape[-1], device=device).expand(1, -1), persistent=False)
    if rotary is not None:
        with torch.device(device):
            module.rotary_emb = type(rotary)(rotary.config)
    return module.eval().requires_grad_(False)


def free_(module: nn.Module) -> None:
    """Release a module's weights (back onto the meta device)."""
    module.to_empty(device="meta")


class FixedVision(nn.Module):
    """A vision encoder returning fixed features (C, P, Dv) (``feature_map``: EVA-02's (C, Dv, G, G)), to time a
    prefix without its encoder."""

    def __init__(self, features: torch.Tensor):
        super().__init__()
        self.features = features

    def forward(self, pixel_values: torch.Tensor):
        return SimpleNamespace(last_hidden_state=self.features)

    def feature_map(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c, p, d = self.features.shape
        g = int(math.isqrt(p))
        return self.features.transpose(1, 2).reshape(c, d, g, g)


class VisionParts:
    """A vision encoder's parts on example inputs: the stem, each block, and the step to tokens (post).

    ``vision``: on ``meta`` when ``random`` (parts get weights in :meth:`prepare`), else loaded. ``pixels``:
    (C, 3, S, S); ``features``: (C, P, Dv), every block's input. ``groups[i]``: blocks of one group cost the same,
    so the first of each can stand for it.
    """

    groups: list[str]

    def __init__(self, vision: nn.Module, pixels: torch.Tensor, features: torch.Tensor, random: bool):
        self.vision, self.pixels, self.features, self.random = vision, pixels, features, random

    @staticmethod
    def of(vision: nn.Module, pixels: torch.Tensor, features: torch.Tensor, random: bool) -> "VisionParts":
        """The parts of ``vision``: EVA-02's or a transformers vision model's."""
        cls = _EVA02Parts if isinstance(vision, EVA02ViT) else _TransformersParts
        return cls(vision, pixels, features, random)

    def prepare(self, part: str, index: int = 0) -> None:
        """Random weights for ``part`` ("stem", "block" ``index``, "post") when ``random``."""
        if self.random:
            self._prepare(part, index, self.features.device, self.features.dtype)

    def release(self, index: int) -> None:
        """Free block ``index`` again when ``random``."""
        if self.random:
            free_(self.blocks()[index])

    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def stem(self) -> torch.Tensor:
        raise NotImplementedError

    def block(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def post(self) -> torch.Tensor:
        raise NotImplementedError

    def _prepare(self, part, index, device, dtype) -> None:
        raise NotImplementedError


class _TransformersParts(VisionParts):
    """A transformers vision model (SigLIP, CLIP layout): ``embeddings``, ``encoder.layers``, ``post_layernorm``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.groups = ["block"] * len(self.blocks())

    def blocks(self):
        return self.vision.encoder.layers

    def stem(self):
        return self.vision.embeddings(self.pixels)

    def block(self, index):
        return self.blocks()[index](self.features, None)

    def post(self):
        return self.vision.post_layernorm(self.features)

    def _prepare(self, part, index, device, dtype):
        module = {"stem": self.vision.embeddings, "post": self.vision.post_layernorm}.get(part)
        random_init_(self.blocks()[index] if module is None else module, device, dtype)


class _EVA02Parts(VisionParts):
    """EVA-02: window and global blocks on the (C, G, G, D) grid; post is a flatten (no final norm)."""

    def __init__(self, *args):
        super().__init__(*args)
        cfg = self.vision.cfg
        self.groups = ["window" if cfg.window_of(i) else "global" for i in range(len(self.blocks()))]
        self.grid = self.features.view(self.features.shape[0], cfg.grid, cfg.grid, -1)

    def blocks(self):
        return self.vision.blocks

    def stem(self):
        v = self.vision
        return v.patch_embed.proj(self.pixels).permute(0, 2, 3, 1) + v.position_embedding().to(self.pixels.dtype)

    def block(self, index):
        v, b = self.vision, self.vision.blocks[index]
        tables = (v.rope_window_cos, v.rope_window_sin) if b.window else (v.rope_global_cos, v.rope_global_sin)
        return b(self.grid, *tables)

    def post(self):
        return self.grid.flatten(1, 2).contiguous()

    def _prepare(self, part, index, device, dtype):
        v = self.vision
        if part == "block":
            random_init_(v.blocks[index], device, dtype)
        elif part == "stem":  # the stem alone onto the device; the blocks follow one at a time
            blocks = v.blocks
            del v.blocks
            v.to(dtype)
            v.to_empty(device=device)
            with torch.no_grad():
                v.patch_embed.proj.weight.normal_(0.0, 0.02)
                v.patch_embed.proj.bias.zero_()
                v.pos_embed.normal_(0.0, 0.02)
            v.rebuild_buffers(device)
            v.blocks = blocks
