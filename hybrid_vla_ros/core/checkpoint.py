"""Checkpoint I/O: write a random-init preset, load the whole model or one stage of it.

A checkpoint is a directory with ``config.json`` (:class:`VLAConfig`) and ``model.safetensors``.
Weights are read only through safetensors (never pickle / ``torch.load``). A stage reads only the
tensors it owns, straight to its device, so the prefix process never holds the suffix's weights and
the other way round: that is the memory the split saves on the GPU.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .config import VLAConfig, preset
from .model import PrefixStage, SuffixStage, VLAModel

WEIGHTS_FILE = "model.safetensors"

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' (or the long names) -> torch.dtype. Raises ValueError otherwise."""
    try:
        return DTYPES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


def init_model(preset_name: str, path: str | Path, seed: int = 0) -> VLAConfig:
    """Write a random-init checkpoint of a preset to ``path`` (created). Returns its config.

    The weights are random (``random_init: true`` in config.json): the trajectories such a model
    produces exercise the pipeline and are not driving advice. Raises FileExistsError if ``path``
    already holds a checkpoint, ValueError for an unknown preset.
    """
    path = Path(path)
    if (path / "config.json").exists() or (path / WEIGHTS_FILE).exists():
        raise FileExistsError(f"{path} already holds a checkpoint")
    cfg = preset(preset_name)
    cfg.random_init = True
    torch.manual_seed(seed)
    model = VLAModel(cfg)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt", "preset": preset_name, "seed": str(seed)})
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return cfg


def model_id(path: str | Path) -> int:
    """Signed 64-bit id of a checkpoint, the same in every process that loads it (the slot header carries it).

    sha256 over config.json and the safetensors header, keys sorted (tensor names, dtypes, shapes, offsets and
    metadata, which includes the seed for presets), first 8 bytes as a signed int64. It does not
    hash the weight bytes (a 7B checkpoint would take seconds): two checkpoints that differ only in
    weight values with identical headers share an id. Raises FileNotFoundError, ValueError.
    """
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    with open(path / WEIGHTS_FILE, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path / WEIGHTS_FILE} is not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"{path / WEIGHTS_FILE}: implausible safetensors header size {n}")
        header = json.loads(f.read(n))  # canonical form: safetensors writes metadata in hash order
    digest.update(json.dumps(header, sort_keys=True).encode())
    return int.from_bytes(digest.digest()[:8], "little", signed=True)


def _materialize(module: nn.Module, path: Path, device: torch.device, dtype: torch.dtype) -> None:
    """Fill a meta-device module with the checkpoint tensors it owns, on ``device`` in ``dtype``."""
    local_keys = list(module.state_dict().keys())
    state = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt", device=str(device)) as f:
        available = set(f.keys())
        missing = [module.checkpoint_key(k) for k in local_keys if module.checkpoint_key(k) not in available]
        if missing:
            raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for k in local_keys:
            t = f.get_tensor(module.checkpoint_key(k))
            state[k] = t.to(dtype) if t.is_floating_point() else t
    module.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary inverse frequencies, SigLIP position ids) are not in the
    # checkpoint; rebuild them on the device from the config.
    with torch.device(device):
        module.rotary_emb = type(module.rotary_emb)(module.rotary_emb.config)
    for sub in module.modules():
        if "position_ids" in dict(sub.named_buffers(recurse=False)):
            n = sub.position_ids.shape[-1]
            sub.register_buffer("position_ids", torch.arange(n, device=device).expand(1, -1), persistent=False)
    leftovers = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftovers:
        raise RuntimeError(f"tensors left uninitialised after loading: {leftovers[:5]}")


class _FullModel(VLAModel):
    def checkpoint_key(self, local_key: str) -> str:
        return local_key


def load_stage(path: str | Path, role: str, split_layer: int | None = None, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = torch.float32) -> nn.Module:
    """Load ``role`` = "prefix", "suffix" or "full" of the checkpoint at ``path``.

    The stage is built on the meta device (no memory), then only its own tensors are read from the
    safetensors file directly onto ``device`` and cast to ``dtype``. Returns the module in eval mode:
    PrefixStage (pixels (C,3,S,S) -> hidden states (T,H)), SuffixStage (hidden states (T,H) ->
    waypoints (N,2) float32 m) or VLAModel (pixels -> waypoints).

    Raises FileNotFoundError (no checkpoint), ValueError (bad config, split layer out of [0, L],
    unknown role or dtype, missing tensors).
    """
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (expected config.json and {WEIGHTS_FILE})")
    cfg = VLAConfig.load(path)
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    with torch.device("meta"):
        if role == "prefix":
            module = PrefixStage(cfg, split_layer)
        elif role == "suffix":
            module = SuffixStage(cfg, split_layer)
        elif role == "full":
            module = _FullModel(cfg)
        else:
            raise ValueError(f"unknown role {role!r}; use prefix, suffix or full")
    _materialize(module, path, device, dtype)
    return module.eval().requires_grad_(False)
