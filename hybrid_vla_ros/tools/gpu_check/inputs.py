"""What the sections feed the model: random-init checkpoints (written once per config, reused) and synthetic
camera frames."""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace


def ensure_checkpoint(cache: Path, name: str, overrides: dict, dtype: str = "fp16", log=print) -> Path:
    """A random-init checkpoint of preset ``name`` with ``overrides`` stored in ``dtype`` under ``cache``,
    written once and reused while its config matches (``init_model``; a 7B one takes a minute or two)."""
    from ...model.checkpoint import init_model
    from ...model.config import preset

    import hashlib

    key = f"{name}-{dtype}"
    if overrides:
        key += "-" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cache) / key
    want = preset(name, **overrides).to_dict()
    want["random_init"] = True
    cfg_file = path / "config.json"
    if cfg_file.is_file() and (path / "model.safetensors").is_file():
        try:
            if json.loads(cfg_file.read_text()) == want:
                return path
        except (OSError, ValueError):
            pass
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    t0 = time.perf_counter()
    init_model(name, path, seed=0, overrides=dict(overrides), dtype=dtype)
    log(f"  wrote the {name} checkpoint ({dtype}) to {path} in {time.perf_counter() - t0:.1f} s")
    return path


def synthetic_rgb(width: int, height: int, seed: int = 0):
    """An (H, W, 3) uint8 image with smooth gradients and noise (compresses like a camera frame)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([(x / width) * 200, (y / height) * 200, ((x + y) / (width + height)) * 255], axis=-1)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def raw_items(n_cameras: int, wh: tuple[int, int]) -> list:
    """One synchronized frame of ``n_cameras`` raw ``rgb8`` Image-like messages of ``wh`` (W, H) px."""
    items = []
    for cam in range(n_cameras):
        img = synthetic_rgb(wh[0], wh[1], seed=cam)
        msg = SimpleNamespace(encoding="rgb8", height=img.shape[0], width=img.shape[1], step=img.shape[1] * 3,
                              is_bigendian=0, data=img.tobytes())
        items.append(("raw", msg))
    return items

