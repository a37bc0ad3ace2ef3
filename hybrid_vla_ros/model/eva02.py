"""The EVA-02 vision backbone of Orion and MindDrive: a ViTDet-style EVA-02 (window and global blocks, 2-D rotary
positions, SwiGLU MLP), with the parameter names of the published ``img_backbone`` so a converted checkpoint
loads one to one. No final norm, no class token.

Sources: Fang et al., 2024, "EVA-02: A Visual Representation for Neon Genesis" (the block layout); Li et al.,
2022, "Exploring Plain Vision Transformer Backbones for Object Detection" (ViTDet: window attention, resized
absolute position embedding); the published configuration (MindDrive's inference configs, Orion's README), which
:class:`EVA02Config`'s defaults are.

The rotary tables are non-persistent buffers: the published checkpoints store them, and ``hybrid-vla convert``
checks those against :func:`rotary_table` (see :func:`derived_tensor_names`) instead of loading them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

#: ``vision.type`` of a model config whose vision side is this backbone.
EVA02_TYPE = "eva02"


def _published_global_blocks(depth: int, every: int = 3) -> tuple[int, ...]:
    return tuple(range(every - 1, depth, every))


@dataclass(frozen=True)
class EVA02Config:
    """The backbone's shape; defaults are the published EVA-02-L at 640 px (Orion, MindDrive 0.5B and 3B).

    ``window_size``: attention window side in patches (0: every block global); ``pretrain_image_size``: the image
    side of ``pos_embed``'s grid (plus a class-token entry when ``pretrain_cls_token``); ``rope_grid``: the rotary
    pre-training grid side, into which larger grids' positions are scaled.
    """

    hidden_size: int = 1024
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    intermediate_size: int = 2730
    patch_size: int = 16
    image_size: int = 640
    window_size: int = 16
    global_blocks: tuple[int, ...] = field(default_factory=lambda: _published_global_blocks(24))
    pretrain_image_size: int = 224
    pretrain_cls_token: bool = True
    rope_grid: int = 16
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "global_blocks", tuple(int(i) for i in self.global_blocks))
        problems = []
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
                     "image_size", "pretrain_image_size", "rope_grid"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if problems:
            raise ValueError("invalid EVA-02 config: " + "; ".join(problems))
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            problems.append("hidden_size / num_attention_heads must be a multiple of 4 (2-D rotary pairs)")
        if self.image_size % self.patch_size or self.pretrain_image_size % self.patch_size:
            problems.append("image_size and pretrain_image_size must be multiples of patch_size")
        if not isinstance(self.window_size, int) or self.window_size < 0:
            problems.append(f"window_size must be >= 0, got {self.window_size!r}")
        if any(not 0 <= i < self.num_hidden_layers for i in self.global_blocks):
            problems.append(f"global_blocks must be in [0, {self.num_hidden_layers}), got {list(self.global_blocks)}")
        if problems:
            raise ValueError("invalid EVA-02 config: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, d: dict) -> "EVA02Config":
        """From a model config's ``vision`` dict (``type`` ignored). Raises ValueError on an unknown or invalid
        field."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names - {"type"})
        if unknown:
            raise ValueError(f"invalid EVA-02 config: unknown field(s) {unknown}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict:
        """The ``vision`` dict of a model config (``type`` first), JSON-ready."""
        return {"type": EVA02_TYPE, **{f.name: (list(getattr(self, f.name)) if f.name == "global_blocks"
                                                else getattr(self, f.name)) for f in fields(self)}}

    @property
    def grid(self) -> int:
        """Patch grid side S / p (40 at 640 px)."""
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def window_of(self, block: int) -> int:
        """The attention window side of ``block`` in patches (0: global)."""
        return 0 if block in self.global_blocks else self.window_size


def rotary_table(head_dim: int, side: int, rope_grid: int, theta: float = 10000.0) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(cos, sin), each (side * side, head_dim) float32: EVA-02's 2-D rotary angles for a side x side grid,
    positions scaled to the ``rope_grid`` side. Dims [0, head_dim/2) carry the row's angles, the rest the column's,
    each angle on two adjacent dims. Raises ValueError unless head_dim % 4 == 0.
    """
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4, got {head_dim}")
    half = head_dim // 2
    bands = theta ** (-torch.arange(0, half, 2, dtype=torch.float32) / half)  # (head_dim / 4,)
    t = torch.arange(side, dtype=torch.float32) / side * rope_grid
    axis = torch.repeat_interleave(torch.outer(t, bands), 2, dim=-1)  # (side, half): each band twice
    angles = torch.cat([axis[:, None, :].expand(side, side, half), axis[None, :, :].expand(side, side, half)],
                       dim=-1).reshape(side * side, head_dim)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., N, head_dim) rotated on dim pairs (2i, 2i+1); ``cos`` / ``sin`` (N, head_dim), cast to x's
    dtype."""
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


class EVA02Attention(nn.Module):
    """Multi-head self-attention with 2-D rotary q and k, q and v biases, no k bias."""

    def __init__(self, cfg: EVA02Config):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(d))
        self.v_bias = nn.Parameter(torch.zeros(d))
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, N, D) -> (B, N, D)."""
        b, n, d = x.shape
        heads = (b, n, self.num_heads, d // self.num_heads)
        q = F.linear(x, self.q_proj.weight, self.q_bias).view(heads).transpose(1, 2)
        k = F.linear(x, self.k_proj.weight).view(heads).transpose(1, 2)
        v = F.linear(x, self.v_proj.weight, self.v_bias).view(heads).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1 / sqrt(head_dim)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class EVA02SwiGLU(nn.Module):
    """The EVA-02 MLP: ``w3(ffn_ln(silu(w1 x) * w2 x))``."""

    def __init__(self, cfg: EVA02Config):
        super().__init__()
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.w1 = nn.Linear(d, m)
        self.w2 = nn.Linear(d, m)
        self.ffn_ln = nn.LayerNorm(m, eps=cfg.layer_norm_eps)
        self.w3 = nn.Linear(m, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., D)."""
        return self.w3(self.ffn_ln(F.silu(self.w1(x)) * self.w2(x)))


class EVA02Block(nn.Module):
    """One pre-norm block on the (B, G, G, D) grid, attending inside ``window`` x ``window`` windows (0: globally).
    As in ViTDet, the normed grid is zero-padded at the bottom and right to a multiple of the window, and the
    padded tokens take part in the attention unmasked."""

    def __init__(self, cfg: EVA02Config, window: int):
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = EVA02Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = EVA02SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, G, G, D) -> (B, G, G, D); ``cos`` / ``sin`` for this block's attention extent."""
        b, g, _, d = x.shape
        y = self.norm1(x)
        w = self.window
        if w:
            pad = (w - g % w) % w
            gp = g + pad
            y = F.pad(y, (0, 0, 0, pad, 0, pad))
            y = y.view(b, gp // w, w, gp // w, w, d).transpose(2, 3).reshape(-1, w * w, d)
            y = self.attn(y, cos, sin)
            y = y.view(b, gp // w, gp // w, w, w, d).transpose(2, 3).reshape(b, gp, gp, d)[:, :g, :g]
        else:
            y = self.attn(y.reshape(b, g * g, d), cos, sin).view(b, g, g, d)
        x = x + y
        return x + self.mlp(self.norm2(x))


class EVA02ViT(nn.Module):
    """The EVA-02 backbone: pixels (C, 3, S, S) -> tokens (C, (S/p)^2, D)."""

    def __init__(self, cfg: EVA02Config):
        super().__init__()
        self.cfg = cfg
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, d, kernel_size=p, stride=p)
        positions = (cfg.pretrain_image_size // p) ** 2 + int(cfg.pretrain_cls_token)
        self.pos_embed = nn.Parameter(torch.zeros(1, positions, d))
        nn.init.normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList(EVA02Block(cfg, cfg.window_of(i)) for i in range(cfg.num_hidden_layers))
        self.rebuild_buffers(None)

    def rebuild_buffers(self, device=None) -> None:
        """(Re)compute the float32 rotary tables on ``device`` (None: where ``pos_embed`` is)."""
        device = self.pos_embed.device if device is None else torch.device(device)
        c = self.cfg
        for name, side in (("window", c.window_size), ("global", c.grid)):
            cos, sin = rotary_table(c.head_dim, side or 1, c.rope_grid, c.rope_theta)
            self.register_buffer(f"rope_{name}_cos", cos.to(device), persistent=False)
            self.register_buffer(f"rope_{name}_sin", sin.to(device), persistent=False)

    def position_embedding(self) -> torch.Tensor:
        """(1, G, G, D): ``pos_embed`` without its class-token entry, resized bicubically in float32 to the patch
        grid."""
        c = self.cfg
        pos = self.pos_embed[:, int(c.pretrain_cls_token):]
        side = int(math.isqrt(pos.shape[1]))
        grid = pos.reshape(1, side, side, -1)
        if side == c.grid:
            return grid
        resized = F.interpolate(grid.permute(0, 3, 1, 2).float(), size=(c.grid, c.grid), mode="bicubic",
                                align_corners=False)
        return resized.to(pos.dtype).permute(0, 2, 3, 1)

    def feature_map(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixels (C, 3, S, S) -> the published feature map (C, D, G, G), G = S / p, in the parameters' dtype.
        Raises ValueError on another image size."""
        c = self.cfg
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, c.image_size, c.image_size):
            raise ValueError(f"EVA-02 takes (C, 3, {c.image_size}, {c.image_size}) pixels, got "
                             f"{tuple(pixel_values.shape)}")
        w = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(w.dtype)).permute(0, 2, 3, 1)  # (C, G, G, D)
        x = x + self.position_embedding().to(x.dtype)
        for block in self.blocks:
            if block.window:
                x = block(x, self.rope_window_cos, self.rope_window_sin)
            else:
                x = block(x, self.rope_global_cos, self.rope_global_sin)
        return x.permute(0, 3, 1, 2)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The feature map flattened to (C, G * G, D) tokens in row, column order, as the query heads flatten it."""
        return self.feature_map(pixel_values).flatten(2).transpose(1, 2)


def derived_tensor_names(cfg: EVA02Config) -> tuple[str, ...]:
    """The published backbone's stored rotary tables, relative to ``img_backbone.``."""
    names = [f"rope_{n}.freqs_{t}" for n in ("win", "glb") for t in ("cos", "sin")]
    names += [f"blocks.{i}.attn.rope.freqs_{t}" for i in range(cfg.num_hidden_layers) for t in ("cos", "sin")]
    return tuple(names)


def expected_derived(cfg: EVA02Config, name: str) -> torch.Tensor:
    """The value a published checkpoint stores under ``name`` (one of :func:`derived_tensor_names`). Raises
    KeyError for another name."""
    if name not in derived_tensor_names(cfg):
        raise KeyError(name)
    cos_or_sin = 0 if name.endswith("cos") else 1
    if name.startswith("rope_"):
        window = name.startswith("rope_win")
    else:
        window = bool(cfg.window_of(int(name.split(".")[1])))
    side = cfg.window_size if window else cfg.grid
    return rotary_table(cfg.head_dim, side, cfg.rope_grid, cfg.rope_theta)[cos_or_sin]
