"""Checkpoint I/O: open any supported checkpoint directory, load one stage of it, write a preset.

:func:`open_checkpoint` recognises a directory by its ``config.json``:

* this package's own (``model_type: hybrid_vla``): :class:`VLAConfig` + ``model.safetensors``;
* *composed*: the same with ``llm_path`` (a transformers LM) or ``vlm_path`` (a transformers VLM); its
  ``model.safetensors`` holds only this package's own tensors, the rest is read from the referred directory;
* a transformers directory (:mod:`hybrid_vla_ros.model.hf`): no planning head, so ``verify-split``, ``plan``
  and ``profile`` only; the nodes refuse it saying how to compose a driving checkpoint;
* own model code (``model_type: hybrid_vla_code``, :mod:`hybrid_vla_ros.model.extension`), on opt-in only.

Weights are read only through safetensors, never pickle. A stage is built on the ``meta`` device and reads only
the tensors it owns (:meth:`~hybrid_vla_ros.model.sources.TensorSource.read`): the prefix process never holds
the suffix's weights and the other way round.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import hf
from .text import TESTED_TEXT_TYPES
from .config import MODEL_TYPE, LMConfig, VLAConfig, not_a_driving_checkpoint, preset
from .extension import CODE_FORMAT_VERSION, CODE_MODEL_TYPE, CodeModel, import_model_class
from .gguf_llm import PRESET_LLMS
from .sources import (
    FLOAT_DTYPES,
    PICKLE_SUFFIXES,
    SHARD_INDEX,
    CheckpointError,
    MissingFileError,
    SafetensorsSource,
    TensorSource,
    UnionSource,
    digest_files,
    hf_safetensors_files,
    pickle_hint,
    read_header,
)

if TYPE_CHECKING:  # imported where used: the annotation only names it
    from .config import VLMSpec

WEIGHTS_FILE = "model.safetensors"

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
#: ``llm`` config keys fixing the blocks' shapes and arithmetic; a composed checkpoint's must match the referred one.
ARCH_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_parameters", "attention_bias",
             "mlp_bias", "hidden_act")


def parse_dtype(name: str) -> torch.dtype:
    """'fp32' | 'bf16' | 'fp16' (or the long names) -> torch.dtype. Raises ValueError otherwise."""
    try:
        return DTYPES[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16") from None


@functools.lru_cache(maxsize=8)
def _cpu_runs(dtype: torch.dtype) -> str:
    """'' when the CPU runs a linear layer and causal SDPA in ``dtype``, else torch's error."""
    try:
        x = torch.ones(1, 2, 4, 8, dtype=dtype)
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        torch.nn.functional.linear(x, torch.ones(8, 8, dtype=dtype))
    except (RuntimeError, NotImplementedError) as e:
        return str(e)
    return ""


def check_device_dtype(device: str | torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError when ``device`` cannot run the stages in ``dtype`` (bf16 on CUDA needs compute 8.0+)."""
    device = torch.device(device)
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"device {device} cannot run bf16 (no bf16 support on this GPU): use fp16 or fp32")
    if device.type == "cpu":
        problem = _cpu_runs(dtype)
        if problem:
            raise ValueError(f"the CPU cannot run {name} with this torch build ({problem}): use fp32")


def _resolve_ref(base: Path, ref: str) -> Path:
    p = Path(ref).expanduser()
    return p if p.is_absolute() else (base / p)


@dataclass
class Checkpoint:
    """An opened checkpoint directory and how to load its stages.

    ``kind``: ``hybrid_vla``, ``composed``, ``transformers`` or ``model_code``. ``model``: what stages are built
    from (:class:`VLAConfig`, :class:`LMConfig`, :class:`CodeModel`). ``hf``: the transformers directory (this
    one or the referred one). ``description``: one line for logs.
    """

    path: Path
    kind: str
    model: object
    description: str
    hf: hf.HFModel | None = None
    own_weights: Path | None = None
    _source: TensorSource | None = None

    @property
    def num_layers(self) -> int:
        """L: decoder blocks; the split layers are 0..L."""
        return int(self.model.num_layers)

    @property
    def cfg(self) -> VLAConfig | None:
        """The driving config when the nodes can run this checkpoint, else None."""
        m = self.model
        if isinstance(m, VLAConfig):
            return m if m.planning_head else None
        return m if getattr(m, "drives", False) else None  # own code that declares its driving I/O

    def split_model(self, prompt_ids: list[int] | None = None):
        """This checkpoint as a :class:`~.kinds.SplitModel`; ``prompt_ids``: a bare LM's example token ids."""
        from .kinds import split_model  # transformers' classes: imported where a model is built, not to read a config

        return split_model(self.model, self, prompt_ids=prompt_ids)

    def require_driving(self):
        """The driving config; ValueError saying what to do for a checkpoint without a planning head."""
        if self.cfg is None:
            doc = hf.read_config_json(self.path)
            raise ValueError(not_a_driving_checkpoint(self.path, doc))
        return self.cfg

    def source(self) -> TensorSource:
        """Every tensor in canonical names (built on first use from file headers)."""
        if self._source is None:
            parts = []
            if self.own_weights is not None:
                parts.append(SafetensorsSource([self.own_weights], label=str(self.own_weights)))
            if self.kind == "model_code":
                files, index, index_file = hf_safetensors_files(self.path)
                parts.append(SafetensorsSource(files, index=index, index_file=index_file,
                                               label=str(index_file or files[0])))
            if self.hf is not None:
                parts.append(self.hf.source())
            self._source = parts[0] if len(parts) == 1 else UnionSource(parts, f"composed checkpoint {self.path}")
        return self._source

    def model_id(self) -> int:
        """Signed 64-bit id, the same in every process (the ring's slot header carries it).

        First 8 bytes (little-endian) of sha256 over config.json, every read file's safetensors header and the
        referred directory's config.json and shard index. Weight bytes are not hashed: checkpoints differing only
        in weight values share an id. Raises MissingFileError, CheckpointError (unreadable header)."""
        digest = hashlib.sha256((self.path / "config.json").read_bytes())
        self.source().fingerprint(digest)
        if self.hf is not None and self.hf.path != self.path:
            digest_files(digest, self.hf.path / "config.json")
        if self.hf is not None and (self.hf.path / SHARD_INDEX).is_file():
            digest_files(digest, self.hf.path / SHARD_INDEX)
        return int.from_bytes(digest.digest()[:8], "little", signed=True)

    def build(self, role: str, split_layer: int | None = None, stop: int | None = None) -> nn.Module:
        """The stage on the meta device: ``prefix`` / ``suffix`` at K, ``full``, ``blocks`` [K, stop)."""
        with torch.device("meta"):
            from .kinds import split_model

            return split_model(self.model, self).build_stage(role, split_layer, stop)

    def load(self, role: str, split_layer: int | None = None, *, device: str | torch.device = "cpu",
             dtype: str | torch.dtype = torch.float32) -> nn.Module:
        """Load ``role`` onto ``device`` in ``dtype``, eval mode, no gradients, reading only its own tensors.

        Raises ValueError (K out of [0, L], role, dtype, missing / misshapen / quantized tensors as
        CheckpointError naming file and tensor), MissingFileError (a shard or referred directory missing)."""
        dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        device = torch.device(device)
        check_device_dtype(device, dtype)
        module = self.build(role, split_layer)
        _materialize(module, self.source(), device, dtype, f"the {role} of {self.path}")
        return module.eval().requires_grad_(False)

    def check_tensors(self) -> None:
        """Check from headers only that every tensor of both stages is stored, shaped and floating-point (what
        :meth:`load` checks first), before anything is read. Raises CheckpointError, MissingFileError."""
        L = self.num_layers
        for role, k in (("prefix", L), ("suffix", 0)):
            check_tensors(self.build(role, k), self.source(), f"the {role} of {self.path}")

    def load_blocks(self, start: int, stop: int, *, device: str | torch.device = "cpu",
                    dtype: str | torch.dtype = torch.float32) -> nn.ModuleList:
        """Decoder blocks [start, stop) as :meth:`load`; ``first_block`` is ``start``.

        Raises ValueError (range outside [0, L], missing tensors)."""
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"block range [{start}, {stop}) outside [0, {self.num_layers}]")
        dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        device = torch.device(device)
        module = self.build("blocks", start, stop)
        _materialize(module, self.source(), device, dtype, f"blocks [{start}, {stop}) of {self.path}")
        layers = module.eval().requires_grad_(False).layers
        layers.first_block = start
        return layers


def _not_a_directory(path: Path) -> Exception:
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        return MissingFileError(f"{path} is a PyTorch pickle checkpoint, not a checkpoint directory"
                                + pickle_hint(path))
    if path.is_file():
        return MissingFileError(f"{path} is a file; a checkpoint is a directory with config.json and safetensors "
                                "weights")
    return MissingFileError(f"no checkpoint at {path} (no such directory)")


def llava_view(model: hf.HFModel, cameras: int = 1, prompt_ids: list[int] | None = None,
               planning_token_id: int | None = None) -> VLAConfig:
    """A transformers LLaVA directory as an in-memory :class:`VLAConfig` without a planning head.

    ``prompt_ids`` holds one ``image_token_index`` per camera (default: those, then 8 fixed text ids);
    ``planning_token_id``: the token whose final hidden state is read (default: a fixed text id).
    """
    placeholder = int(model.config.image_token_index)
    vocab = int(model.text_config.vocab_size)
    text = [t for t in hf.lm_prompt_ids(vocab, 12) if t != placeholder]
    if prompt_ids is None:
        prompt_ids = [placeholder] * cameras + text[:8]
    mean, std = model.image_stats()
    return VLAConfig(n_cameras=cameras, image_size=int(model.vision_config.image_size), image_mean=mean,
                     image_std=std, vision=model.vision_dict(), llm=model.llm_dict(), projector=model.projector_dict(),
                     prompt_token_ids=list(prompt_ids),
                     planning_token_id=text[8] if planning_token_id is None else int(planning_token_id),
                     vlm_path=str(model.path), planning_head=False)


def vlm_view(model: hf.HFModel, cameras: int = 6, prompt: str | None = None,
             camera_size: tuple[int, int] | None = None) -> "VLMSpec":
    """A transformers VLM directory as an in-memory :class:`~hybrid_vla_ros.model.config.VLMSpec`.

    ``camera_size``: (width, height); ``prompt``: one image placeholder per camera (default
    :func:`~hybrid_vla_ros.model.vlm.default_prompt`). T comes from running the processor once on blank images.
    Raises MissingFileError (no processor files), ValueError (placeholder count)."""
    import numpy as np

    from .config import DEFAULT_CAMERA_SIZE, VLMSpec
    from .contract import CROSS_MASK, CROSS_ROWS, CROSS_STATES, DEEPSTACK, IMAGE_BLOCKS, POSITION_IDS, VISUAL_MASK
    from .vlm import default_prompt, load_processor, run_processor

    processor = load_processor(model.path, model.config.model_type)
    size = tuple(int(v) for v in (camera_size or DEFAULT_CAMERA_SIZE))
    prompt = default_prompt(processor, cameras) if prompt is None else prompt
    blank = [np.zeros((size[1], size[0], 3), dtype=np.uint8) for _ in range(cameras)]
    inputs = run_processor(processor, blank, prompt)
    tokens = inputs.tokens
    side, shapes = (), {}
    kind = model.config.model_type
    if kind in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v"):
        side, shapes = (POSITION_IDS,), {POSITION_IDS: [3, 1, tokens]}
    if kind == "gemma3":  # images attend both ways: their blocks cross with h_K
        side, shapes = (IMAGE_BLOCKS,), {IMAGE_BLOCKS: [tokens]}
    if kind == "paligemma":  # images and prompt attend both ways; positions from 1
        side, shapes = (POSITION_IDS, IMAGE_BLOCKS), {POSITION_IDS: [1, 1, tokens], IMAGE_BLOCKS: [tokens]}
    if kind == "mllama":  # cross-attention blocks read every tile's projected vision states
        vision = model.vision_config
        tiles = int(inputs.images["pixel_values"].shape[1]) * int(inputs.images["pixel_values"].shape[2])
        patches = (int(vision.image_size) // int(vision.patch_size)) ** 2 + 1  # MllamaVisionModel.num_patches
        side = (CROSS_STATES, CROSS_MASK, CROSS_ROWS)
        shapes = {CROSS_STATES: [tiles, patches, int(model.text_config.hidden_size)],
                  CROSS_MASK: [1, 1, tokens, tiles * patches], CROSS_ROWS: [1, 1, tokens, 1]}
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        visual = int((inputs.input_ids == int(model.config.image_token_id)).sum())
        levels = len(model.vision_config.deepstack_visual_indexes)
        side = (POSITION_IDS, VISUAL_MASK, DEEPSTACK)
        shapes.update({VISUAL_MASK: [tokens], DEEPSTACK: [levels, visual, int(model.text_config.hidden_size)]})
    return VLMSpec(vlm=hf.config_dict(model.config), llm=model.llm_dict(), num_tokens=tokens, cameras=cameras,
                   camera_size=size, prompt=prompt, vlm_path=str(model.path), side=side, side_shapes=shapes,
                   vision_patches=_vision_patches(inputs, model.vision_config))


def _vision_patches(inputs, vision) -> int:
    """Patches the vision tower takes for one frame (Qwen-VL: rows of flat ``pixel_values``; else per tile)."""
    pixels = inputs.images.get("pixel_values")
    if pixels is None:
        return 0
    if pixels.dim() == 2:
        return int(pixels.shape[0])
    patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else int(vision.patch_size)
    side = pixels.shape[-1]
    return int(pixels.numel() // (3 * side * pixels.shape[-2])) * (side // patch) * (pixels.shape[-2] // patch)


def _check_same_llm(cfg: VLAConfig, ref: hf.HFModel, path: Path) -> None:
    theirs = ref.llm_dict()
    diff = [k for k in ARCH_KEYS if cfg.llm.get(k) != theirs.get(k)]
    if diff:
        raise CheckpointError(f"{path / 'config.json'}: its llm config differs from {ref.path / 'config.json'} in "
                              f"{', '.join(diff)} (the referred directory changed?): write the composed checkpoint "
                              "again with `hybrid-vla init-model`")


def open_checkpoint(path: str | Path, *, trust_model_code: bool | None = None, cameras: int | None = None,
                    prompt_ids: list[int] | None = None, planning_token_id: int | None = None,
                    tokens: int = 512, prompt: str | None = None,
                    camera_size: tuple[int, int] | None = None) -> Checkpoint:
    """Open the checkpoint directory at ``path`` (:func:`_open`) and :meth:`TensorSource.check_files` it.

    A missing or truncated shard is refused here, before any stage reads it. Raises as :func:`_open`, and
    MissingFileError / CheckpointError for unreadable weights."""
    ck = _open(path, trust_model_code=trust_model_code, cameras=cameras, prompt_ids=prompt_ids,
               planning_token_id=planning_token_id, tokens=tokens, prompt=prompt, camera_size=camera_size)
    ck.source().check_files()
    return ck


def _open(path: str | Path, *, trust_model_code: bool | None = None, cameras: int | None = None,
          prompt_ids: list[int] | None = None, planning_token_id: int | None = None,
          tokens: int = 512, prompt: str | None = None, camera_size: tuple[int, int] | None = None) -> Checkpoint:
    """Open the checkpoint directory at ``path`` (module docstring); reads config files, no weights.

    ``trust_model_code``: as :func:`~.extension.trusted`. A LLaVA directory is viewed by :func:`llava_view`
    (cameras default 1), a VLM by :func:`vlm_view` (cameras default 6); ``tokens``: T for a bare LM.

    Raises FileNotFoundError / MissingFileError (no directory, config.json or weights; a pickle checkpoint),
    ValueError / CheckpointError (bad or unsupported config, a referred directory of the wrong kind or changed
    since, own code not trusted).
    """
    path = Path(path)
    if not path.is_dir():
        raise _not_a_directory(path)
    if not (path / "config.json").is_file():
        raise MissingFileError(f"no checkpoint at {path} (no config.json)" + pickle_hint(path))
    doc = hf.read_config_json(path)
    kind = doc.get("model_type")
    if kind == MODEL_TYPE:
        cfg = VLAConfig.from_dict(doc)
        own = path / WEIGHTS_FILE
        if not own.is_file():
            raise MissingFileError(f"no checkpoint at {path} (expected config.json and {WEIGHTS_FILE})"
                                   + pickle_hint(path))
        ref_path = cfg.llm_path or cfg.vlm_path
        if not ref_path:
            if cfg.llm_type not in TESTED_TEXT_TYPES:  # (transformers' classes imported only then)
                from .family_check import check_family
                from .modeling import llm_config

                try:  # its own blocks of a family no test proves (a --set llm.model_type): the forward check
                    check_family(llm_config(cfg))
                except ValueError as e:
                    raise CheckpointError(f"{path / 'config.json'}: {e}") from None
            return Checkpoint(path, "hybrid_vla", cfg, f"hybrid_vla checkpoint ({cfg.preset or 'custom'})",
                              own_weights=own)
        ref_dir = _resolve_ref(path, ref_path)
        if not ref_dir.is_dir():
            field = "llm_path" if cfg.llm_path else "vlm_path"
            raise MissingFileError(f"{path / 'config.json'} refers to {ref_dir} ({field}), which is not a directory")
        ref = hf.read_hf(ref_dir)
        want = "llm" if cfg.llm_path else ("vlm" if cfg.vlm_front else "llava")
        if ref.kind != want:
            what = {"llm": "a causal language model", "llava": "a LLaVA model", "vlm": f"a {cfg.vlm_type} VLM"}
            raise CheckpointError(f"{path / 'config.json'}: {'llm_path' if cfg.llm_path else 'vlm_path'} names "
                                  f"{ref_dir}, a transformers {ref.architecture} (expected {what[want]})")
        _check_same_llm(cfg, ref, path)
        return Checkpoint(path, "composed", cfg, f"composed checkpoint ({cfg.preset or 'custom'} with "
                          f"{ref.architecture} from {ref_dir})", hf=ref, own_weights=own)
    if kind == CODE_MODEL_TYPE:
        if doc.get("format_version") != CODE_FORMAT_VERSION:
            raise CheckpointError(f"{path / 'config.json'}: format_version {doc.get('format_version')!r}; this "
                                  f"package reads {CODE_FORMAT_VERSION}")
        if not isinstance(doc.get("config", {}), dict):
            raise CheckpointError(f"{path / 'config.json'}: 'config' must be an object")
        cls = import_model_class(path, doc.get("model_class"), trust_model_code)
        code = CodeModel(path, cls, doc.get("config", {}), doc["model_class"])
        hf_safetensors_files(path)  # weights present (or a clear error) before anything else
        return Checkpoint(path, "model_code", code, f"own model code {doc['model_class']}")
    model = hf.read_hf(path)
    if model.kind == "llm":
        spec = LMConfig(model.llm_dict(), num_tokens=tokens)
    elif model.kind == "vlm":
        spec = vlm_view(model, 6 if cameras is None else cameras, prompt, camera_size)
    else:
        spec = llava_view(model, 1 if cameras is None else cameras, prompt_ids, planning_token_id)
    files, index, _ = hf_safetensors_files(path)
    shards = f"{len(files)} shards" if index is not None else "unsharded"
    return Checkpoint(path, "transformers", spec, f"transformers {model.architecture} ({shards})", hf=model)


def check_tensors(module: nn.Module, source: TensorSource, what: str) -> dict[str, str]:
    """Check, from headers only, that ``source`` holds every tensor of the (meta-device) ``module`` with its shape
    and a floating-point stored dtype; returns local name -> canonical name. Raises CheckpointError naming file and
    tensor (a MoE group that cannot be merged: :class:`~.weight_conversion.ConvertedSource`)."""
    wanted = module.state_dict()
    keys = {local: module.checkpoint_key(local) for local in wanted}
    missing = [c for c in keys.values() if c not in source]
    if missing:
        raise CheckpointError(f"{source.label} lacks {len(missing)} tensor(s) {what} needs, e.g. {missing[:3]} "
                              "(this package's names)")
    for local, canonical in keys.items():
        info, want = source.info(canonical), wanted[local]
        if tuple(info.shape) != tuple(want.shape):
            raise CheckpointError(f"{info.where()} has shape {list(info.shape)}; {what} needs {list(want.shape)} "
                                  f"for {canonical!r}")
        if want.is_floating_point() and info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.where()} is stored as {info.dtype} (quantized?); this package loads "
                                  f"floating-point weights ({', '.join(FLOAT_DTYPES)}): dequantize it first")
    return keys


def _materialize(module: nn.Module, source: TensorSource, device: torch.device, dtype: torch.dtype,
                 what: str) -> None:
    """Fill a meta-device module with its tensors from ``source``, on ``device`` in ``dtype``.

    Every tensor is checked (present, shape, floating-point stored dtype) before any is read; parts marked
    ``keeps_float32`` are read in float32. Peak memory: the stage plus one stored tensor. Raises CheckpointError
    naming file and tensor, RuntimeError when a tensor is left uninitialised.
    """
    keys = check_tensors(module, source, what)
    local_of = {c: local for local, c in keys.items()}
    kept = tuple(f"{name}." for name, m in module.named_modules() if name and getattr(m, "keeps_float32", False))
    as_fp32 = [c for local, c in keys.items() if local.startswith(kept)] if kept else []
    rest = [c for c in keys.values() if c not in set(as_fp32)]
    tensors = source.read(rest, device, float_dtype=dtype)
    if as_fp32:
        tensors.update(source.read(as_fp32, device, float_dtype=torch.float32))
    module.load_state_dict({local_of[c]: t for c, t in tensors.items()}, strict=True, assign=True)
    _rebuild_buffers(module, device, dtype)
    leftovers = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if leftovers:
        raise RuntimeError(f"tensors left uninitialised after loading {what}: {leftovers[:5]}")


def _rebuild_buffers(module: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Rebuild the non-persistent buffers (not in the checkpoint) on ``device`` from the config; the floating ones a
    hybrid family's base model puts on its blocks (:func:`~.text.adopted_buffers`) in ``dtype``, as transformers'
    ``from_pretrained(dtype=...)`` makes them under that default dtype."""
    from .text import adopted_buffers

    for sub, name in adopted_buffers(module):
        buf = sub._buffers[name]
        sub._buffers[name] = buf.to(device=device, dtype=dtype if dtype is not None and buf.is_floating_point()
                                    else buf.dtype)
    if hasattr(module, "rotary_emb"):
        with torch.device(device):
            module.rotary_emb = type(module.rotary_emb)(module.rotary_emb.config)
    for sub in module.modules():
        if "position_ids" in dict(sub.named_buffers(recurse=False)):
            n = sub.position_ids.shape[-1]
            sub.register_buffer("position_ids", torch.arange(n, device=device).expand(1, -1), persistent=False)
    # parts that compute buffers from their config (EVA-02 rotary tables, query-head masks, 3-D position depths)
    for sub in module.modules():
        if hasattr(sub, "rebuild_buffers"):
            sub.rebuild_buffers(device)


def random_stage(cfg: VLAConfig, role: str, split_layer: int | None = None, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float16, seed: int = 0, std: float = 0.02) -> nn.Module:
    """A stage of ``cfg`` with random weights made directly on ``device``, for memory checks without a checkpoint
    (e.g. ``orion``'s 7B in fp16: 14 GB).

    Matrices are normal(0, ``std``), every 1-D parameter ones, integers zeros; nothing passes through host
    memory. Eval mode, no gradients. Raises ValueError (role, K, dtype), torch.OutOfMemoryError.
    """
    device = torch.device(device)
    check_device_dtype(device, dtype)
    with torch.device("meta"):
        from .kinds import split_model

        module = split_model(cfg).build_stage(role, split_layer)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, t in module.state_dict().items():
        new = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        if new.is_floating_point():
            if new.dim() >= 2:
                new.normal_(0.0, std, generator=gen)
            else:
                new.fill_(1.0)
        else:
            new.zero_()
        state[name] = new
    module.load_state_dict(state, strict=True, assign=True)
    del state
    _rebuild_buffers(module, device, dtype)
    return module.eval().requires_grad_(False)


def driving_config(path: str | Path):
    """The driving config the nodes read at configure: a :class:`VLAConfig` or a driving :class:`CodeModel`.

    Raises FileNotFoundError, ValueError / CheckpointError saying how to make a checkpoint the nodes run."""
    return open_checkpoint(path).require_driving()


def load_stage(path: str | Path, role: str, split_layer: int | None = None, *, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = torch.float32) -> nn.Module:
    """Load ``role`` = "prefix", "suffix" or "full" of the driving checkpoint at ``path`` (what the runners call).

    Returns, in eval mode, PrefixStage (pixels (C,3,S,S) -> hidden states (T,H)), SuffixStage (hidden states
    (T,H) -> waypoints (N,2) float32 m) or VLAModel (pixels -> waypoints).

    Raises FileNotFoundError (no checkpoint, a pickle checkpoint), ValueError (bad config, split layer out of
    [0, L], unknown role or dtype, missing tensors; no planning head:
    :func:`hybrid_vla_ros.model.config.not_a_driving_checkpoint`).
    """
    ck = open_checkpoint(path)
    ck.require_driving()
    return ck.load(role, split_layer, device=device, dtype=dtype)


def load_blocks(path: str | Path, start: int, stop: int, *, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = torch.float32) -> nn.ModuleList:
    """:meth:`Checkpoint.load_blocks` of the checkpoint at ``path``, to move a split layer without a reload.

    Raises FileNotFoundError, ValueError (range outside [0, L], missing tensors)."""
    return open_checkpoint(path).load_blocks(start, stop, device=device, dtype=dtype)


def model_id(path: str | Path) -> int:
    """:meth:`Checkpoint.model_id` of the checkpoint at ``path``. Raises FileNotFoundError, ValueError."""
    return open_checkpoint(path).model_id()


# ------------------------------------------------------------------------------------------ writing

def lm_head_rows(ref: hf.HFModel, token_ids: list[int]) -> torch.Tensor:
    """Rows ``token_ids`` of a transformers directory's LM head (or tied embeddings), (D, H) float32.

    Raises CheckpointError when neither is stored or an id is out of range."""
    files, index, index_file = hf_safetensors_files(ref.path)
    raw = SafetensorsSource(files, None, index=index, index_file=index_file, label=str(index_file or files[0]))
    stored = [n for n in raw.names() if n == "lm_head.weight" or n.endswith(".lm_head.weight")]
    if stored:
        table = raw.read([stored[0]])[stored[0]]
    elif "embed_tokens.weight" in ref.source():
        table = ref.source().read(["embed_tokens.weight"])["embed_tokens.weight"]
    else:
        raise CheckpointError(f"{ref.path}: no lm_head.weight and no token embeddings to read the decision rows from")
    ids = torch.tensor(token_ids)
    if int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]:
        raise CheckpointError(f"decision_token_ids {token_ids} outside the LM head's {table.shape[0]} rows")
    return table[ids].float()


def _default_planning_token(ref: hf.HFModel, vocab: int) -> int:
    """A VLM composition's default planning token: the tokenizer's eos, else pad, else the last vocabulary id."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(ref.path))
    except (OSError, ValueError):
        return vocab - 1
    for t in (tok.eos_token_id, tok.pad_token_id):
        if t is not None and 0 <= int(t) < vocab:
            return int(t)
    return vocab - 1


def _with_planning_token(shapes: dict) -> dict:
    """Side tensor shapes of a T-token frame for T + 1 (the planning token appended)."""
    from .contract import CROSS_MASK, CROSS_ROWS, IMAGE_BLOCKS, POSITION_IDS, VISUAL_MASK

    out = {k: list(v) for k, v in shapes.items()}
    for name in (POSITION_IDS, VISUAL_MASK, IMAGE_BLOCKS):
        if name in out:
            out[name][-1] += 1
    for name in (CROSS_MASK, CROSS_ROWS):  # (1, 1, T, ...)
        if name in out:
            out[name][-2] += 1
    return out


def _own_modules(cfg: VLAConfig) -> nn.Module:
    """A composed checkpoint's own modules, random-init on the CPU; the referred directory's parts are never
    built at full size."""
    from .modeling import _add_prefix_side, _add_query_tokens, _add_suffix_side, llm_config

    llm = llm_config(cfg)
    tiny = copy.deepcopy(llm)
    tiny.vocab_size = 1  # embed_tokens comes from the referred directory: never allocate vocab x H here
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # inside the one-row vocabulary (a config may
        value = getattr(tiny, key, None)  # require them set: Mllama's)
        if value is not None:
            setattr(tiny, key, [0] * len(value) if isinstance(value, list) else 0)
    m = nn.Module()
    if cfg.vlm_front:  # the VLM brings every part before the head (and query tokens)
        _add_query_tokens(m, cfg, llm.hidden_size)
        _add_suffix_side(m, cfg, llm)
        del m.norm
        return m
    if cfg.vlm_path:
        with torch.device("meta"):
            _add_prefix_side(m, cfg, tiny)
        for name in ("vision_tower", "multi_modal_projector"):
            delattr(m, name)
        for name in ("ego_embed", "pass_embed", "query_tokens"):  # rebuilt for real below
            if hasattr(m, name):
                delattr(m, name)
        _add_query_tokens(m, cfg, llm.hidden_size)
        h = llm.hidden_size
        if cfg.ego_state_input:
            m.ego_embed = nn.Linear(3, h)
        if cfg.llm_passes > 1 and not cfg.pass_lora_rank:
            m.pass_embed = nn.Embedding(cfg.llm_passes, h)
    else:
        _add_prefix_side(m, cfg, tiny)
    del m.embed_tokens
    _add_suffix_side(m, cfg, llm)
    del m.norm
    return m


def _read_own_weights(file: Path, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trained own tensors from safetensors ``file``, checked against ``own`` by name and shape."""
    file = Path(file)
    if not file.is_file():
        raise MissingFileError(f"{file}: file not found" + pickle_hint(file))
    if file.suffix in PICKLE_SUFFIXES:
        raise MissingFileError(f"{file} is a PyTorch pickle file" + pickle_hint(file))
    out = {}
    read_header(file)  # a clear CheckpointError for a file that is not safetensors
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            if key not in own:
                raise CheckpointError(f"{file}: tensor {key!r} is not one of this checkpoint's own tensors "
                                      f"({', '.join(sorted({k.split('.')[0] for k in own}))}.*)")
            t = f.get_tensor(key)
            if tuple(t.shape) != tuple(own[key].shape):
                raise CheckpointError(f"{file}: tensor {key!r} has shape {list(t.shape)}, the model needs "
                                      f"{list(own[key].shape)}")
            out[key] = t
    if not any(k.startswith("head.") for k in out):
        raise CheckpointError(f"{file} holds no planning head tensors (head.fc1.weight, ...)")
    return out


def init_model(preset_name: str, path: str | Path, seed: int = 0, *, overrides: dict | None = None,
               dtype: str | torch.dtype = torch.float32, llm: str | Path | None = None,
               vlm: str | Path | None = None, head: str | Path | None = None, prompt: str | None = None,
               camera_size: tuple[int, int] | None = None) -> VLAConfig:
    """Write a checkpoint of a preset to ``path`` (created) and return its config.

    ``overrides`` replace top-level config fields (:func:`preset`); ``dtype`` is the stored dtype. Weights are
    random (``random_init: true``; trajectories are not driving advice), except ``smol``'s LLM, which is
    SmolLM2-135M (:data:`~.gguf_llm.PRESET_LLMS`).

    Composing (the referred directory's config is repeated in config.json, its weights are not copied):

    * ``llm``: a transformers LM replaces the preset's; own vision side, projector and head stay random;
    * ``vlm``: a LLaVA directory (its tower, projector and LLM; prompt one placeholder per camera unless
      ``overrides`` sets ``prompt_token_ids``), or a VLM of another family (Qwen2/2.5/3-VL, InternVL,
      LLaVA-NeXT / OneVision, Idefics3, SmolVLM; the whole VLM, a planning token appended after ``prompt``;
      ``camera_size`` (W, H) as :func:`vlm_view`), under the preset's driving I/O and planning head;
    * ``head``: safetensors of trained own tensors (``head.*`` at least) replacing the random ones;
      ``random_init`` is false when every own tensor came from it.

    Raises FileExistsError if ``path`` holds a checkpoint, ValueError for an unknown preset, option or dtype,
    a referred directory of the wrong kind or head tensors that do not fit, FileNotFoundError when ``smol``'s
    GGUF file, a referred directory or the head file is missing.
    """
    path = Path(path)
    if (path / "config.json").exists() or (path / WEIGHTS_FILE).exists():
        raise FileExistsError(f"{path} already holds a checkpoint")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if "random_init" in (overrides or {}):
        raise ValueError("random_init cannot be overridden: init-model writes random weights (smol: its vision "
                         "side, projector and planner)")
    if llm is not None and vlm is not None:
        raise ValueError("--llm and --vlm exclude each other (a LLaVA directory brings its own LLM)")
    if llm is not None or vlm is not None:
        return _init_composed(preset_name, path, seed, overrides or {}, dtype, llm, vlm, head, prompt, camera_size)
    if prompt is not None or camera_size is not None:
        raise ValueError("--prompt / --camera-size say how a transformers VLM sees the cameras: use them with --vlm")
    if head is not None:
        raise ValueError("--head attaches trained tensors to a composed checkpoint: use it with --llm or --vlm")
    cfg = preset(preset_name, **(overrides or {}))
    cfg.random_init = True
    pretrained = None
    source = PRESET_LLMS.get(preset_name)
    if source is not None:
        llm_kwargs, pretrained = source.load()
        mismatched = {k: (v, cfg.llm.get(k)) for k, v in llm_kwargs.items() if k in cfg.llm and cfg.llm[k] != v}
        if mismatched:
            raise ValueError(f"{source.name}'s architecture differs from the {preset_name} preset: {mismatched}")
    torch.manual_seed(seed)
    # Build in the stored dtype: one copy in RAM (orion in fp16: 14 GB instead of 28 + 14 GB).
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    from .modeling import VLAModel

    try:
        model = VLAModel(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    if pretrained is not None:
        own = model.state_dict()
        extra = sorted(set(pretrained) - set(own))
        if extra:
            raise ValueError(f"{source.name} tensors with no place in the model: {extra[:3]}")
        model.load_state_dict(pretrained, strict=False)
    state = {k: v.detach().to(dtype).contiguous() if v.is_floating_point() else v.detach().contiguous()
             for k, v in model.state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "preset": preset_name, "seed": str(seed)}
    if pretrained is not None:
        meta["pretrained_llm"] = source.source
    save_file(state, str(path / WEIGHTS_FILE), metadata=meta)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return cfg


def _init_composed(preset_name: str, path: Path, seed: int, overrides: dict, dtype: torch.dtype,
                   llm: str | Path | None, vlm: str | Path | None, head: str | Path | None,
                   prompt: str | None = None, camera_size: tuple[int, int] | None = None) -> VLAConfig:
    ref_dir = Path(llm if llm is not None else vlm).expanduser().resolve()
    if not ref_dir.is_dir():
        raise _not_a_directory(ref_dir)
    ref = hf.read_hf(ref_dir)
    ref.source().check_files()  # every shard present and whole before anything is written
    fixed = {"preset", "llm_path", "vlm_path", "planning_head"}  # set by composing, not by --set
    unknown = set(overrides) - (set(VLAConfig.__dataclass_fields__) - fixed)
    if unknown:
        raise ValueError(f"unknown preset option(s) {sorted(unknown)}")
    base = preset(preset_name).to_dict()
    base.update(overrides)
    if llm is not None:
        if ref.kind != "llm":
            raise CheckpointError(f"--llm {ref_dir}: a transformers {ref.architecture}; use --vlm for a "
                                  "vision-language model")
        base.update(llm=ref.llm_dict(), llm_path=str(ref_dir))
    elif ref.kind == "vlm":
        if base.get("ego_state_input") or base.get("llm_passes", 1) != 1:
            raise ValueError(f"preset {preset_name!r} takes an ego token or two LLM passes; a VLM composition takes "
                             "the VLM's own inputs only (use --preset tiny or smol, or --set llm_passes=1 "
                             "--set ego_state_input=false)")
        view = vlm_view(ref, int(base["n_cameras"]), prompt, camera_size)
        vocab = int(ref.text_config.vocab_size)
        token = overrides.get("planning_token_id", _default_planning_token(ref, vocab))
        base.update(llm=ref.llm_dict(), vlm=view.vlm, vlm_path=str(ref_dir), projector={"type": "vlm"},
                    prompt_token_ids=[], planning_token_id=int(token),
                    vlm_view={"cameras": view.cameras, "camera_size": list(view.camera_size), "prompt": view.prompt,
                              "num_tokens": view.num_tokens, "side": list(view.side),
                              "side_shapes": (view.side_shapes if base.get("decode")  # placed after the decode
                                              else _with_planning_token(view.side_shapes)),
                              "vision_patches": view.vision_patches})
    else:
        if ref.kind != "llava":
            raise CheckpointError(f"--vlm {ref_dir}: a transformers {ref.architecture}; "
                                  "use --llm for a language model")
        mean, std = ref.image_stats()
        projector = ref.projector_dict()
        prompt = overrides.get("prompt_token_ids", [projector["image_token_index"]] * base["n_cameras"])
        base.update(image_size=int(ref.vision_config.image_size), image_mean=list(mean), image_std=list(std),
                    vision=ref.vision_dict(), llm=ref.llm_dict(), projector=projector, prompt_token_ids=prompt,
                    vlm_path=str(ref_dir))
    base.pop("model_type"), base.pop("format_version")
    cfg = VLAConfig(**base)
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        own = {k: v.detach().to(dtype).contiguous() for k, v in _own_modules(cfg).state_dict().items()}
    finally:
        torch.set_default_dtype(default_dtype)
    if cfg.decision_token_ids and "decision_head.weight" in own:
        # the decision read-out: the referred model's own LM-head rows of those tokens (its logits, exactly)
        own["decision_head.weight"] = lm_head_rows(ref, cfg.decision_token_ids).to(dtype).contiguous()
    trained = _read_own_weights(Path(head), own) if head is not None else {}
    own.update({k: v.to(dtype).contiguous() for k, v in trained.items()})
    cfg.random_init = set(trained) != set(own)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "preset": preset_name, "seed": str(seed), "composed_with": str(ref_dir)}
    if head is not None:
        meta["trained_tensors_from"] = str(Path(head).resolve())
    save_file(own, str(path / WEIGHTS_FILE), metadata=meta)
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    open_checkpoint(path)  # the checkpoint opens (referred directory consistent) before we report success
    return cfg
