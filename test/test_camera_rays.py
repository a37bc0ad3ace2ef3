"""Issue 21: the query heads' 3-D position embedding (model/camera_rays.py) against the published code: MindDrive's
detector method ``position_embeding`` with its own ``locations`` and ``inverse_sigmoid`` (../shared/reference/
minddrive, loaded by path: test/minddrive_reference.py), called on a small module carrying the attributes it reads,
on the same weights and camera geometry, fp32.

The geometry is six cameras around the vehicle as the published model sees them: the camera matrix of the model
image (the published crop and resize of a 1600 x 900 camera, `orion_crop_geometry`) times a model-frame-to-camera
transform (x right, y forward, z up -> x right, y down, z forward, each camera turned about z and moved)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from hybrid_vla_ros.model.camera_rays import CameraRayEmbedding, RayEmbeddingConfig, depth_bins
from hybrid_vla_ros.vehicle.image import orion_crop_geometry
from minddrive_reference import load_detector

# the published `locations` calls torch.meshgrid without `indexing` (a torch warning, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:torch.meshgrid")


def _lidar2img(size: int) -> torch.Tensor:
    """(6, 4, 4) float32: camera matrix of the size x size model image times the model-to-camera transform."""
    k = orion_crop_geometry(900, 1600, size).intrinsics(np.array([[1266.4, 0.0, 816.3], [0.0, 1266.4, 491.5],
                                                                 [0.0, 0.0, 1.0]]))
    mats = []
    for i, yaw in enumerate(np.radians([0.0, 55.0, -55.0, 180.0, 110.0, -110.0])):
        turn = np.array([[math.cos(yaw), -math.sin(yaw), 0.0], [math.sin(yaw), math.cos(yaw), 0.0], [0, 0, 1.0]])
        axes = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]])  # model (x r, y f, z u) -> camera
        rot = axes @ turn.T
        centre = np.array([0.3 * i - 0.8, 1.2 - 0.2 * i, 1.6])
        ext = np.eye(4)
        ext[:3, :3], ext[:3, 3] = rot, -rot @ centre
        k4 = np.eye(4)
        k4[:3, :3] = k
        mats.append(k4 @ ext)
    return torch.tensor(np.stack(mats), dtype=torch.float32)


def test_depth_bins_are_the_published_lid_bins():
    """The published detector's coords_d: LID bins from 1 m to 61.2 m over 64 depths (its constructor's formula,
    evaluated here on its own)."""
    index = torch.arange(0, 64, 1).float()
    published = 1.0 + (torch.tensor(61.2) - 1.0) / (64 * 65) * index * (index + 1)
    assert torch.equal(depth_bins(RayEmbeddingConfig()), published)
    assert float(depth_bins(RayEmbeddingConfig())[-1]) < 61.2


@pytest.mark.parametrize("size", [128, 96])
def test_ray_embedding_equals_the_published_code(monkeypatch, size):
    """Our CameraRayEmbedding on the published module's weights (loaded by the published names, strict) gives its
    position_embeding within 1e-4 for six cameras (a 96 px image: a 6 x 6 grid, a 128 px one 8 x 8)."""
    detector, _ = load_detector(monkeypatch)
    cfg = RayEmbeddingConfig(embed_dims=32, depth_num=16)
    torch.manual_seed(2)
    ours = CameraRayEmbedding(cfg).eval()
    ref = nn.Module()
    ref.position_encoder = nn.Sequential(nn.Linear(3 * 16, 4 * 32), nn.ReLU(), nn.Linear(4 * 32, 32))
    index = torch.arange(0, 16, 1).float()  # the published constructor's coords_d and range
    ref.position_range = nn.Parameter(torch.tensor(cfg.position_range), requires_grad=False)
    ref.coords_d = nn.Parameter(1.0 + (ref.position_range[3] - 1.0) / (16 * 17) * index * (index + 1),
                                requires_grad=False)
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if k.startswith("position_encoder.")},
                         strict=True)
    assert torch.allclose(ours.coords_d, ref.coords_d)
    grid = size // 16
    lidar2img = _lidar2img(size)
    feats = torch.zeros(6, 4, grid, grid)
    centres = detector.locations(feats, 16, size, size)[None].repeat(6, 1, 1, 1)
    data = {"cam_intrinsic": lidar2img.unsqueeze(0).clone(), "lidar2img": lidar2img.unsqueeze(0).clone()}
    with torch.no_grad():
        expected = detector.Minddrive.position_embeding(ref, data, centres, [{"pad_shape": [(size, size, 3)]}])[0]
        got = ours(lidar2img, grid, grid, size, size)
    assert got.shape == expected.shape == (6 * grid * grid, 32)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max(), float((got - expected).abs().max())
    # the geometry matters: another camera layout gives another embedding
    with torch.no_grad():
        moved = ours(_lidar2img(size).roll(1, dims=0), grid, grid, size, size)
    assert (moved - expected).abs().max() > 1e-2 * expected.abs().max()


def test_a_bad_geometry_is_a_clear_error():
    e = CameraRayEmbedding(RayEmbeddingConfig(embed_dims=8, depth_num=4))
    with pytest.raises(ValueError, match=r"finite \(C, 4, 4\)"):
        e(torch.eye(3).expand(6, 3, 3), 2, 2, 32, 32)
    bad = torch.eye(4).repeat(6, 1, 1)
    bad[2] = 0.0  # a camera whose calibration is all zeros
    with pytest.raises(ValueError, match=r"camera\(s\) \[2\] is not invertible"):
        e(bad, 2, 2, 32, 32)
    nan = torch.eye(4).repeat(6, 1, 1)
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        e(nan, 2, 2, 32, 32)
