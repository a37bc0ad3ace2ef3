"""What every measurement (``hybrid-vla bench``, ``hybrid-vla gpu-check``, scripts/bench_*.py) shares: one way to set
a preset's sizes, one cache of random-init checkpoints with one key, and one report writer."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path


def sized(name: str, image_size: int | None = None, overrides: dict | None = None) -> dict:
    """``overrides`` of preset ``name`` with its cameras at ``image_size`` px (None, or the preset's own size:
    unchanged): the top-level ``image_size`` and the vision encoder's own ``vision.image_size`` together (the config
    refuses them differing; a preset override replaces top-level fields only, so the vision dict is copied)."""
    from ..model.config import preset

    out = dict(overrides or {})
    base = preset(name, **out)
    if not image_size or int(image_size) == base.image_size:
        return out
    out.update(image_size=int(image_size), vision=dict(base.vision, image_size=int(image_size)))
    return out


def checkpoint_key(name: str, overrides: dict, dtype: str) -> str:
    """The cache folder name of a preset's checkpoint: ``<preset>-<dtype>``, plus a digest of the overrides."""
    key = f"{name}-{dtype}"
    if overrides:
        key += "-" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
    return key


def ensure_checkpoint(cache: str | Path, name: str, overrides: dict | None = None, dtype: str = "fp32",
                      log=print) -> Path:
    """A random-init checkpoint of preset ``name`` with ``overrides`` stored in ``dtype``, under ``cache`` at
    :func:`checkpoint_key`: reused while its config is the preset's and every tensor's bytes are in its file (not one
    cut short by a killed writer), else written again (``init_model``, into a temporary folder renamed into place:
    a 7B one takes a minute or two)."""
    from ..model.checkpoint import init_model, open_checkpoint
    from ..model.config import preset

    overrides = dict(overrides or {})
    path = Path(cache) / checkpoint_key(name, overrides, dtype)
    want = json.loads(json.dumps(preset(name, **overrides).to_dict()))  # tuples -> lists, as in the file
    want["random_init"] = True
    try:
        if json.loads((path / "config.json").read_text()) == want:
            open_checkpoint(path)
            return path
    except (OSError, ValueError):
        pass
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    init_model(name, tmp, seed=0, overrides=overrides, dtype=dtype)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    log(f"  wrote the {name} checkpoint ({dtype}) to {path} in {time.perf_counter() - t0:.1f} s (cached)")
    return path


def finite(obj):
    """``obj`` with every NaN / inf float as None (strict JSON), dicts' keys as strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_report(doc: dict, path: str | Path, markdown: str | None = None, indent: int = 1, default=None) -> Path:
    """Write ``doc`` as strict JSON to ``path`` (and ``markdown`` beside it, ``.md``), creating the folder; each file
    is written beside itself and renamed over the old one, so a run killed while writing leaves the previous whole
    report, never a truncated one. The markdown is renamed into place first, so a reader who sees a JSON has a
    markdown at least as new beside it (a run killed between the two renames leaves the newer markdown beside the
    older JSON, never the reverse). Returns the JSON's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files = [] if markdown is None else [(path.with_suffix(".md"), markdown)]
    files.append((path, json.dumps(finite(doc), indent=indent, allow_nan=False, default=default) + "\n"))
    for target, text in files:
        part = target.with_name(target.name + ".part")
        part.write_text(text)
        os.replace(part, target)
    return path
