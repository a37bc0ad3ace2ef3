"""Issue 21: the camera pipeline of Orion's and MindDrive's published test configuration (`image_resize:
orion_crop`), against the published pipeline classes themselves (../shared/reference/minddrive's transforms_3d.py
with its own mmcv image functions, loaded by path: test/minddrive_reference.py) on the real nuScenes 1600 x 900
cameras in ../shared/data (see its SOURCE.txt).

The published pipeline takes BGR images (as its dataset and CARLA agent read them) and turns them to RGB when it
normalises; the package takes RGB, so the reference is given the same pictures in BGR order."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from hybrid_vla_ros.model.config import IMAGENET_MEAN, IMAGENET_STD, preset
from hybrid_vla_ros.vehicle.image import orion_crop_geometry, preprocess
from minddrive_reference import load_pipeline

NUSCENES = Path(__file__).resolve().parents[2] / "shared" / "data" / "nuscenes_scene0061_mmdet3d_demo"
# the published inference configs' settings (minddrive_qwen2_05B_infer.py: ida_aug_conf, img_norm_cfg)
IDA_AUG_CONF = {"resize_lim": (0.37, 0.45), "final_dim": (320, 640), "bot_pct_lim": (0.0, 0.0), "rot_lim": (0.0, 0.0),
                "H": 900, "W": 1600, "rand_flip": False}
# the published code (torch matrices in numpy products, regexes) warns under this numpy; not ours
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::SyntaxWarning")]
IMG_NORM_CFG = {"mean": [123.675, 116.28, 103.53], "std": [58.395, 57.12, 57.375], "to_rgb": True}


def _cameras() -> list[np.ndarray]:
    files = sorted(NUSCENES.glob("*CAM_*.jpg"))
    if len(files) < 6:
        pytest.skip(f"the nuScenes cameras are not at {NUSCENES} (../shared beside the checkout)")
    return [cv2.cvtColor(cv2.imread(str(f)), cv2.COLOR_BGR2RGB) for f in files[:6]]


def _camera_matrix(i: int) -> np.ndarray:
    """A plausible 1600 x 900 camera matrix per camera (zero skew, as calibrated cameras are)."""
    return np.array([[1260.0 + 3 * i, 0.0, 800.0 - 7 * i], [0.0, 1255.0 + 2 * i, 450.0 + 5 * i], [0.0, 0.0, 1.0]])


def _published(ref, images_rgb, size=640):
    """The published test pipeline on BGR copies: ResizeCropFlipRotImage (training False), ResizeMultiview3D to
    (size, size), NormalizeMultiviewImage, with a 4 x 4 cam_intrinsic / lidar2cam per camera as its loader gives."""
    conf = dict(IDA_AUG_CONF, final_dim=(size // 2, size))
    results = {"img": [img[..., ::-1].copy() for img in images_rgb], "cam_intrinsic": [], "lidar2cam": []}
    for i in range(len(images_rgb)):
        k4 = np.eye(4, dtype=np.float32)
        k4[:3, :3] = _camera_matrix(i)
        results["cam_intrinsic"].append(k4)
        results["lidar2cam"].append(np.eye(4, dtype=np.float32))
    results = ref.ResizeCropFlipRotImage(data_aug_conf=conf, training=False)(results)
    results = ref.ResizeMultiview3D(img_scale=(size, size), keep_ratio=False, multiscale_mode="value")(results)
    results = ref.NormalizeMultiviewImage(**IMG_NORM_CFG)(results)
    pixels = torch.from_numpy(np.stack(results["img"])).permute(0, 3, 1, 2)
    return pixels, [np.asarray(k)[:3, :3] for k in results["cam_intrinsic"]]


@pytest.mark.parametrize("size", [640, 112])
def test_orion_crop_equals_the_published_pipeline(monkeypatch, size):
    """The six real cameras through `preprocess(..., resize="orion_crop")` with ImageNet statistics give the
    published pipeline's normalised pixels (640: the published size; 112: a reduced size, final_dim scaled with
    it) within 1e-5 (float rounding of the normalisation only: the resized pixels are the same library calls), and
    `orion_crop_geometry(...).intrinsics` gives the camera matrices the published code updates alongside."""
    ref = load_pipeline(monkeypatch)
    cams = _cameras()
    assert all(c.shape == (900, 1600, 3) for c in cams)
    expected, matrices = _published(ref, cams, size)
    got = preprocess(cams, size, IMAGENET_MEAN, IMAGENET_STD, resize="orion_crop")
    assert got.shape == expected.shape == (6, 3, size, size)
    assert (got - expected).abs().max() <= 1e-5, float((got - expected).abs().max())
    geometry = orion_crop_geometry(900, 1600, size)
    for i, published in enumerate(matrices):
        np.testing.assert_allclose(geometry.intrinsics(_camera_matrix(i)), published, rtol=1e-6, atol=1e-4)
    if size == 640:
        assert geometry.resized == (640, 360) and geometry.crop == (0, 40, 640, 360)


def test_orion_crop_is_not_a_plain_resize(monkeypatch):
    """The crop matters: the whole picture squeezed to S x S (bicubic, no crop) differs from the published
    pixels by far more than the tolerance above, so the comparison can tell them apart."""
    ref = load_pipeline(monkeypatch)
    cams = _cameras()[:2]
    expected, _ = _published(ref, cams, 112)
    squeezed = preprocess(cams, 112, IMAGENET_MEAN, IMAGENET_STD, resize="bicubic")
    assert (squeezed - expected).abs().mean() > 0.05


def test_the_published_presets_take_the_published_pipeline():
    for name in ("orion", "minddrive-0.5b", "minddrive-3b"):
        cfg = preset(name)
        assert (cfg.image_resize, cfg.image_mean, cfg.image_std) == ("orion_crop", IMAGENET_MEAN, IMAGENET_STD)
    # the published statistics on 0-255 pixels are these divided by 255
    assert np.allclose(np.array(IMAGENET_MEAN) * 255, IMG_NORM_CFG["mean"]) and \
        np.allclose(np.array(IMAGENET_STD) * 255, IMG_NORM_CFG["std"])


def test_the_crop_stays_inside_the_first_resize_for_every_camera_size():
    """For every camera of 2:1 to 4:3 shape from 100 to 2199 px high, at the published side and a reduced one, the
    first resize covers the crop (int() alone rounds some sizes to S - 1, where Pillow would fill a black row or
    column), and a camera that would make that resize absurd is refused; a 154 x 77 camera has no black pixels."""
    for size in (640, 448, 112):
        for height in range(100, 2200, 7):
            for aspect in (2.0, 16 / 9, 1.5, 4 / 3):
                g = orion_crop_geometry(height, round(height * aspect), size)
                left, top, right, bottom = g.crop
                assert 0 <= left and 0 <= top and right <= g.resized[0] and bottom <= g.resized[1], (height, aspect)
    grey = np.full((77, 154, 3), 200, np.uint8)
    got = preprocess([grey], 640, IMAGENET_MEAN, IMAGENET_STD, resize="orion_crop")
    assert torch.allclose(got, got[:, :, :1, :1].expand_as(got))  # one colour: no black border
    with pytest.raises(ValueError, match="too far from 2:1"):
        orion_crop_geometry(5000, 2, 640)


def test_other_camera_sizes_and_bad_geometry():
    """Another camera size takes its own scale (the published code would assume 1600 x 900); a 4:3 camera is
    cropped at its centre columns; an odd side or an empty camera is an error; a camera matrix must be 3 x 3."""
    g = orion_crop_geometry(1216, 1936, 640)  # the embedded DGP bag's cameras
    assert g.resized == (640, 401) and g.crop == (0, 81, 640, 401)
    g43 = orion_crop_geometry(480, 640, 64)
    assert g43.resized == (64, 48) and g43.crop == (0, 16, 64, 48)
    wide = orion_crop_geometry(100, 1000, 64)  # wider than 2:1: the height sets the scale, the centre is kept
    assert wide.resized == (320, 32) and wide.crop == (128, 0, 192, 32)
    with pytest.raises(ValueError, match="even model side"):
        orion_crop_geometry(900, 1600, 641)
    with pytest.raises(ValueError, match="positive camera size"):
        orion_crop_geometry(0, 1600, 640)
    with pytest.raises(ValueError, match="3 x 3"):
        g.intrinsics(np.eye(4))
    with pytest.raises(ValueError, match="even image_size"):
        preset("orion", image_size=641, vision=dict(preset("orion").vision, image_size=641))
