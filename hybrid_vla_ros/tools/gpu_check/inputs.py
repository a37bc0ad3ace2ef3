"""What the sections feed the model: random-init checkpoints (written once per config, reused) and synthetic
camera frames."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace


def ensure_checkpoint(cache: Path, name: str, overrides: dict, dtype: str = "fp16", log=print) -> Path:
    """The cached random-init checkpoint of preset ``name`` (:func:`~..harness.ensure_checkpoint`), fp16 by default."""
    from ..harness import ensure_checkpoint as cached

    return cached(cache, name, overrides, dtype, log=log)


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



@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_checkpoints` reports per checkpoint (sent over a pipe, read by ``Check``): ``index`` in
    its list, ``seconds`` the write took, ``error`` ('' when written), ``done_at`` the CLOCK_MONOTONIC instant it
    finished (system-wide on Linux: the parent compares it with its own start)."""

    index: int
    seconds: float
    error: str
    done_at: float


def spec_key(name: str, overrides: dict, dtype: str) -> tuple[str, str, str]:
    """A hashable key of one checkpoint (preset name, overrides, dtype), the same for equal overrides."""
    return name, json.dumps(overrides, sort_keys=True), dtype


def prepare_checkpoints(cache: str, specs: list, conn) -> None:
    """Child process (``multiprocessing`` spawn) of :class:`~hybrid_vla_ros.tools.gpu_check.check.Check`: write the
    random-init checkpoints ``specs`` ((preset name, overrides, dtype), in the order the sections need them) with
    :func:`ensure_checkpoint` while the first section runs, sending a :class:`Prepared` on ``conn`` after each.
    (Writing ``orion``'s 14 GB serially on a CPU takes about a minute, which was eaten from the paper table's
    share of the budget when it was done inside that section.)"""
    for i, (name, overrides, dtype) in enumerate(specs):
        t0 = time.perf_counter()
        try:
            ensure_checkpoint(Path(cache), name, overrides, dtype, log=lambda text: None)
            conn.send(Prepared(i, round(time.perf_counter() - t0, 2), "", time.monotonic()))
        except Exception as e:  # noqa: BLE001 - the parent writes it itself then, and reports what fails
            error = f"{type(e).__name__}: {e}"
            conn.send(Prepared(i, round(time.perf_counter() - t0, 2), error, time.monotonic()))
    conn.close()
