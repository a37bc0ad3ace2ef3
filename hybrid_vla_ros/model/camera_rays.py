"""The 3-D position embedding of Orion's and MindDrive's query heads: each camera feature's ray, sampled at fixed
depths, mapped into the model frame and encoded by an MLP. Sources: PETR (Liu et al., 2022), the linear-increasing
depth bins (LID) of CaDDN (Reading et al., 2021), and MindDrive's detector (the defaults and parameter names).

``lidar2img`` per camera: the model image's camera matrix (:meth:`hybrid_vla_ros.vehicle.image.CropResize.intrinsics`)
times the model-frame-to-camera transform, 4 x 4; the prefix node builds it on a vehicle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: The published detection range of the position embedding, metres: (x_min, y_min, z_min, x_max, y_max, z_max).
POSITION_RANGE = (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0)


@dataclass(frozen=True)
class RayEmbeddingConfig:
    """``depth_num`` depths from ``depth_start`` m to the range's x_max, LID or uniform; ``stride``: image pixels
    per feature cell; ``embed_dims`` E."""

    embed_dims: int = 256
    depth_num: int = 64
    depth_start: float = 1.0
    position_range: tuple[float, ...] = POSITION_RANGE
    lid: bool = True
    stride: int = 16


def depth_bins(cfg: RayEmbeddingConfig) -> torch.Tensor:
    """(depth_num,) float32 depths in metres (the published ``coords_d``)."""
    i = torch.arange(cfg.depth_num, dtype=torch.float32)
    top = torch.tensor(cfg.position_range[3], dtype=torch.float32)
    if cfg.lid:
        return cfg.depth_start + (top - cfg.depth_start) / (cfg.depth_num * (1 + cfg.depth_num)) * i * (i + 1)
    return cfg.depth_start + (top - cfg.depth_start) / cfg.depth_num * i


def patch_centres(grid_h: int, grid_w: int, stride: int, pad_h: int, pad_w: int) -> torch.Tensor:
    """(grid_h * grid_w, 2) float32 pixel centres (u, v) of the feature cells, row-major, rounded as the published
    code does (normalised by the padded size, then scaled back)."""
    xs = (torch.arange(0, stride * grid_w, stride, dtype=torch.float32) + stride // 2) / pad_w
    ys = (torch.arange(0, stride * grid_h, stride, dtype=torch.float32) + stride // 2) / pad_h
    v, u = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack((u.reshape(-1) * pad_w, v.reshape(-1) * pad_h), dim=-1)


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """log(x / (1 - x)) of x clamped to [0, 1], both terms at least ``eps``."""
    x = x.clamp(0.0, 1.0)
    return torch.log(x.clamp(min=eps) / (1.0 - x).clamp(min=eps))


class CameraRayEmbedding(nn.Module):
    """``forward(lidar2img, grid_h, grid_w, pad_h, pad_w)``: (C, 4, 4) float -> (C * grid_h * grid_w, E)
    embeddings, camera-major then row-major (the feature tokens' order).

    ``coords_d`` and ``position_range`` are non-persistent buffers; a converter checks a checkpoint's copies
    instead of loading them. Raises ValueError for a geometry that is not finite (C, 4, 4) or not invertible."""

    def __init__(self, cfg: RayEmbeddingConfig = RayEmbeddingConfig()):
        super().__init__()
        self.cfg = cfg
        d, e = cfg.depth_num, cfg.embed_dims
        self.position_encoder = nn.Sequential(nn.Linear(3 * d, 4 * e), nn.ReLU(), nn.Linear(4 * e, e))
        self.rebuild_buffers(None)

    def rebuild_buffers(self, device) -> None:
        """(Re)compute the buffers on ``device`` (None: the default), e.g. after a build on the meta device."""
        cfg = self.cfg
        self.register_buffer("coords_d", depth_bins(cfg).to(device), persistent=False)
        self.register_buffer("position_range", torch.tensor(cfg.position_range, dtype=torch.float32, device=device),
                             persistent=False)

    def forward(self, lidar2img: torch.Tensor, grid_h: int, grid_w: int, pad_h: int, pad_w: int) -> torch.Tensor:
        if lidar2img.dim() != 3 or lidar2img.shape[1:] != (4, 4) or not torch.isfinite(lidar2img).all():
            raise ValueError(f"lidar2img must be finite (C, 4, 4), got {tuple(lidar2img.shape)}")
        img2lidar, info = torch.linalg.inv_ex(lidar2img.float())
        bad = (info != 0) | ~torch.isfinite(img2lidar).flatten(1).all(dim=1)
        if bool(bad.any()):
            raise ValueError(f"the geometry (lidar2img) of camera(s) {bad.nonzero().flatten().tolist()} is not "
                             "invertible")
        c = lidar2img.shape[0]
        uv = patch_centres(grid_h, grid_w, self.cfg.stride, pad_h, pad_w).to(lidar2img.device)  # (P, 2)
        depth = self.coords_d.view(1, -1, 1)  # (1, D, 1)
        scaled = uv.unsqueeze(1) * torch.clamp(depth, min=1e-5)  # (P, D, 2)
        points = torch.cat([scaled, depth.expand(uv.shape[0], -1, 1), torch.ones_like(depth).expand(
            uv.shape[0], -1, 1)], dim=-1)  # (P, D, 4) homogeneous image points
        xyz = torch.einsum("cij,pdj->cpdi", img2lidar, points)[..., :3]  # (C, P, D, 3)
        lo, hi = self.position_range[:3], self.position_range[3:]
        normed = ((xyz - lo) / (hi - lo)).reshape(c * uv.shape[0], -1)  # (C P, D 3)
        weight = self.position_encoder[0].weight
        return self.position_encoder(inverse_sigmoid(normed).to(weight.dtype))
