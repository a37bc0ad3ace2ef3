"""Orion and MindDrive as published: their mmcv ``.pth`` checkpoints converted once into this package's format.

This is the package's one reader of a pickle, at conversion time only (:func:`read_pth`: torch's weights-only
unpickler, which refuses anything but tensors and plain containers). The converted directory reads safetensors
only (:mod:`hybrid_vla_ros.model.checkpoint`).

Published layout (Orion's and MindDrive's released code), stored name -> here:

==============================================================  ================================================
``lm_head.base_model.model.model.embed_tokens.weight``          ``llm/`` ``model.embed_tokens.weight`` (the
                                                                checkpoint's rows set ``vocab_size``)
``lm_head.base_model.model.model.layers.{i}.<m>.base_layer.*``  ``llm/`` ``model.layers.{i}.<m>.*`` (new PEFT)
``lm_head.base_model.model.model.layers.{i}.<m>.{weight,bias}`` the same (old PEFT)
``...<m>.lora_A.<adapter>.weight`` (r, in), ``lora_B`` (out, r)  merged (one adapter) or per-pass deltas (two)
``lm_head.base_model.model.model.norm.weight``                  ``llm/`` ``model.norm.weight``
``lm_head.base_model.model.lm_head.weight``                     ``llm/`` ``lm_head.weight``; MindDrive: its rows
                                                                of the meta-action tokens -> ``decision_head``
``img_backbone.*`` (EVA-02-L)                                   ``vision.*`` (:func:`place_backbone`)
``pts_bbox_head.*``, ``map_head.*``, shared encoders            ``projector.*`` (:func:`place_query_heads`)
``present_distribution.*`` etc., ``pw_*``                       ``head.*`` (:func:`place_planner`)
anything else                                                   not placed, reported by name
==============================================================  ================================================

LoRA (Hu et al., 2021, eq. 3; peft's ``LoraLayer.scaling``): ``W + (lora_alpha / r) * B @ A``. r and lora_alpha
come from ``adapter_config.json`` (in the LLM config directory or its ``<adapter>/``), else the options
(published: 16, 16); rsLoRA, DoRA and per-module rank / alpha patterns are refused.

Layouts: ``orion``: one adapter (``default``) merged into the base; planning token ``<waypoint_ego>``.
``minddrive``: ``decision_expert`` (pass 0) and ``action_expert`` (pass 1) on one unmerged base, each pass's delta
as :class:`hybrid_vla_ros.model.modeling.PassLoRALinear` tensors, and both again as peft directories
``adapters/<name>/`` (for the reference ``verify-split``).

Output directory: ``llm/`` (a transformers directory with the checkpoint's vocabulary size and the tokenizer
files), ``config.json`` + ``model.safetensors`` (this package's own tensors, ``llm_path: "llm"``), ``adapters/``
(MindDrive), ``convert_report.json``.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import hf
from .sources import CheckpointError, MissingFileError

#: Where the PEFT-wrapped LLM sits in the published state dicts (Orion's / MindDrive's ``self.lm_head``).
LLM_PREFIX = "lm_head.base_model.model."
#: Where the published checkpoints keep the EVA-02 vision backbone (placed as ``vision.*``).
BACKBONE_PREFIX = "img_backbone."
#: MindDrive's adapters, in pass order (decision pass first, action pass last).
MINDDRIVE_ADAPTERS = ("decision_expert", "action_expert")
#: Orion's single adapter (peft's default name).
ORION_ADAPTER = "default"
#: Published LoRA hyper-parameters (Orion and MindDrive: r = 16, lora_alpha = 16 on q/k/v/o).
DEFAULT_R, DEFAULT_ALPHA = 16, 16
LAYOUTS = ("orion", "minddrive", "auto")
#: The planning token's text in both tokenizers.
WAYPOINT_TOKEN = "<waypoint_ego>"
#: MindDrive's path planner's token (the last of the action pass).
PATH_WAYPOINT_TOKEN = "<path_waypoint_ego>"
#: Tokenizer / generation files copied from the LLM config directory into ``OUT/llm`` (small text files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json")
REPORT_FILE = "convert_report.json"
#: Largest shard of ``OUT/llm`` written at once, bytes (bounds the conversion's memory: merged tensors are
#: new memory, unmerged ones views of the memory-mapped ``.pth``).
DEFAULT_SHARD_BYTES = 2 * 10**9

_LORA = re.compile(r"(?P<mod>.+)\.lora_(?P<ab>[AB])\.(?P<ad>[^.]+)\.weight")
_SAVED = re.compile(r"(?P<mod>.+)\.modules_to_save\.(?P<ad>[^.]+)\.(?P<p>weight|bias)")
_BASE = re.compile(r"(?P<mod>.+)\.base_layer\.(?P<p>weight|bias)")
_LLM_PART = re.compile(r"model\.(embed_tokens\.weight|norm\.weight|layers\.\d+\..+)|lm_head\.weight")


def read_pth(path: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state dict of an mmcv-style ``.pth`` (``{"state_dict": ..., "meta": ...}`` or bare), tensors as views
    of the file's memory map. Returns ``({name: tensor}, [names of non-tensor entries])``.

    Raises MissingFileError, or CheckpointError for a pickle holding anything but tensors and plain containers
    (nothing of it run), an old non-zip ``torch.save`` file (mmap needs torch >= 1.6's format), or no tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: checkpoint file not found")
    try:
        obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: refused: the pickle holds objects other than tensors and plain containers "
                              f"(torch.load weights_only=True: {first}). Nothing of it was run. Re-save the state "
                              "dict alone (tensors only) where you trust the file") from None
    except (RuntimeError, ValueError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: not a torch.save zip file that can be memory-mapped ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict ({{name: tensor}})")
    tensors, other = {}, []
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[str(name)] = value
        else:
            other.append(str(name))
    if not tensors:
        raise CheckpointError(f"{path}: its state dict holds no tensors")
    return tensors, sorted(other)


@dataclass
class Adapter:
    """One LoRA adapter: per target module (e.g. ``model.layers.0.self_attn.q_proj``) ``A`` (r, in) and ``B``
    (out, r)."""

    name: str
    r: int
    alpha: float
    a: dict[str, torch.Tensor] = field(default_factory=dict)
    b: dict[str, torch.Tensor] = field(default_factory=dict)
    source: str = "options"

    @property
    def scaling(self) -> float:
        """lora_alpha / r (peft's ``LoraLayer.scaling``)."""
        return self.alpha / self.r

    def delta(self, module: str) -> torch.Tensor:
        """(out, in) float32."""
        return self.scaling * (self.b[module].float() @ self.a[module].float())


@dataclass
class PublishedParts:
    """A published state dict taken apart: ``llm`` (transformers names -> base tensors), ``adapters``, and the
    stored names ``placed`` and ``not_placed``."""

    llm: dict[str, torch.Tensor]
    adapters: dict[str, Adapter]
    not_placed: list[str]
    placed: list[str]


def _adapter_hparams(config_dir: Path, name: str, r: int, alpha: float) -> tuple[int, float, str]:
    for file in (config_dir / name / "adapter_config.json", config_dir / "adapter_config.json"):
        if file.is_file():
            try:
                doc = json.loads(file.read_text())
                ar, aalpha = int(doc["r"]), float(doc["lora_alpha"])
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{file}: no usable r / lora_alpha ({e})") from None
            if doc.get("use_rslora") or doc.get("use_dora") or doc.get("rank_pattern") or doc.get("alpha_pattern"):
                raise CheckpointError(f"{file}: rsLoRA / DoRA / per-module rank or alpha patterns are not "
                                      "supported (the merge would not be W + alpha / r * B A)")
            return ar, aalpha, str(file)
    return int(r), float(alpha), "options"


def take_apart(tensors: dict[str, torch.Tensor], config_dir: Path, r: int = DEFAULT_R,
                alpha: float = DEFAULT_ALPHA) -> PublishedParts:
    """Take a published state dict apart. Raises CheckpointError for a LoRA tensor without its partner, a rank
    that differs from the adapter's r, DoRA magnitudes, a name stored twice (with and without ``base_layer``)."""
    llm: dict[str, torch.Tensor] = {}
    adapters: dict[str, Adapter] = {}
    not_placed, placed = [], []
    for stored in sorted(tensors):
        if not stored.startswith(LLM_PREFIX):
            not_placed.append(stored)
            continue
        rest = stored[len(LLM_PREFIX):]
        if ".lora_magnitude_vector." in rest:
            raise CheckpointError(f"{stored}: a DoRA adapter; only plain LoRA (W + alpha / r * B A) is supported")
        m = _LORA.fullmatch(rest)
        if m:
            name = m["ad"]
            if name not in adapters:
                ar, aalpha, src = _adapter_hparams(config_dir, name, r, alpha)
                adapters[name] = Adapter(name, ar, aalpha, source=src)
            (adapters[name].a if m["ab"] == "A" else adapters[name].b)[m["mod"]] = tensors[stored]
            placed.append(stored)
            continue
        if ".original_module." in rest:  # peft's frozen copy of a module it also trains (modules_to_save)
            not_placed.append(stored)
            continue
        m = _SAVED.fullmatch(rest) or _BASE.fullmatch(rest)
        target = f"{m['mod']}.{m['p']}" if m else rest
        if not _LLM_PART.fullmatch(target):
            not_placed.append(stored)
            continue
        if target in llm:
            raise CheckpointError(f"{stored}: the LLM tensor {target!r} is stored twice")
        llm[target] = tensors[stored]
        placed.append(stored)
    for ad in adapters.values():
        for mod in sorted(set(ad.a) | set(ad.b)):
            if mod not in ad.a or mod not in ad.b:
                raise CheckpointError(f"adapter {ad.name!r}: {mod} has lora_{'B' if mod in ad.a else 'A'} "
                                      "without its partner")
            rank = ad.a[mod].shape[0]
            if ad.a[mod].dim() != 2 or ad.b[mod].dim() != 2 or ad.b[mod].shape[1] != rank or rank != ad.r:
                raise CheckpointError(f"adapter {ad.name!r}: {mod} has lora_A {list(ad.a[mod].shape)} / lora_B "
                                      f"{list(ad.b[mod].shape)}, not rank r = {ad.r} ({ad.source}): set --lora-r")
            if f"{mod}.weight" not in llm:
                raise CheckpointError(f"adapter {ad.name!r} adapts {mod}, which the checkpoint's LLM lacks")
    return PublishedParts(llm, adapters, not_placed, placed)


def _token_id(config_dir: Path, text: str) -> int | None:
    """The id of an added token from ``added_tokens.json``, else ``tokenizer.json``; None when not found."""
    file = config_dir / "added_tokens.json"
    if file.is_file():
        doc = json.loads(file.read_text())
        if text in doc:
            return int(doc[text])
    file = config_dir / "tokenizer.json"
    if file.is_file():
        for tok in json.loads(file.read_text()).get("added_tokens", []):
            if tok.get("content") == text:
                return int(tok["id"])
    return None


def _group(names: list[str], depth: int = 1) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for n in names:
        key = ".".join(n.split(".")[:depth])
        g = out.setdefault(key, {"count": 0, "names": []})
        g["count"] += 1
        g["names"].append(n)
    return out


def _adapter_dir(out: Path, ad: Adapter, targets: list[str]) -> None:
    """``out/<name>/``: the adapter in peft's ``save_pretrained`` layout, A / B as stored."""
    d = out / ad.name
    d.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": ad.r, "lora_alpha": ad.alpha, "target_modules": targets, "bias": "none",
           "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
           "task_type": None, "base_model_name_or_path": None, "inference_mode": True}
    (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {}
    for mod in ad.a:
        state[f"base_model.model.{mod}.lora_A.weight"] = ad.a[mod].contiguous()
        state[f"base_model.model.{mod}.lora_B.weight"] = ad.b[mod].contiguous()
    save_file(state, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})


def convert(checkpoint: str | Path, llm_config: str | Path, out: str | Path, **options) -> dict:
    """Convert a published ``.pth`` into a checkpoint directory ``out`` (options, return and errors:
    :func:`_convert`). A failed conversion removes the ``out`` it created."""
    out = Path(out)
    created = not out.exists()
    try:
        return _convert(checkpoint, llm_config, out, **options)
    except BaseException:
        if created and out.exists():
            shutil.rmtree(out)
        raise


def _convert(checkpoint: str | Path, llm_config: str | Path, out: str | Path, *, layout: str = "auto",
            preset_name: str | None = None, overrides: dict | None = None, lora_r: int = DEFAULT_R,
            lora_alpha: float = DEFAULT_ALPHA, waypoint_token_id: int | None = None,
            decision_token_ids: list[int] | None = None, seed: int = 0, dtype: str | torch.dtype | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES, prompts: str = "published", log=None) -> dict:
    """Convert a published ``.pth`` into a checkpoint directory ``out``.

    ``llm_config``: the directory with the LLM's ``config.json`` (and tokenizer; optionally
    ``adapter_config.json``); ``layout``: ``auto`` tells it from the adapter names; ``preset_name``: the preset
    whose driving I/O and stand-ins go around the LLM (default ``orion`` / ``minddrive-0.5b``), ``overrides`` its
    fields (as ``init-model --set``); ``waypoint_token_id``: default from the tokenizer files, else, for Orion,
    the one row the checkpoint adds to config.json's vocabulary; ``decision_token_ids``: the LM-head rows of
    MindDrive's decision read-out (with ``prompts="published"`` read from the tokenizer and only checked against
    it; required with ``"preset"``); ``prompts``: ``published`` (:mod:`.published_prompts`) or ``preset`` (the
    preset's fixed prompt, not the published computation; the report says so); ``dtype``: of the written tensors
    (default: as stored; merges run in float32); ``max_shard_bytes``: per ``OUT/llm`` shard, one shard in memory
    at a time (a larger tensor alone).

    Returns the report (also written to ``out/convert_report.json``). Raises FileExistsError (``out`` holds
    files), MissingFileError, CheckpointError (refused pickle, unknown layout, inconsistent adapters or shapes),
    ValueError (bad options).
    """
    from .checkpoint import open_checkpoint, parse_dtype

    say = log or (lambda _line: None)
    out, config_dir = Path(out), Path(llm_config)
    doc = _check_inputs(out, config_dir, layout, max_shard_bytes)
    say(f"reading {checkpoint} (torch.load weights_only=True, mmap=True) ...")
    tensors, non_tensor = read_pth(checkpoint)
    parts = take_apart(tensors, config_dir, lora_r, lora_alpha)
    layout, wanted = _choose_layout(checkpoint, parts, layout)
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        if key not in parts.llm:
            raise CheckpointError(f"{checkpoint}: no {LLM_PREFIX}{key}: not a published Orion / MindDrive layout")
    stored_dtype = parts.llm["model.embed_tokens.weight"].dtype
    store_dtype = stored_dtype if dtype is None else (parse_dtype(dtype) if isinstance(dtype, str) else dtype)
    # the tokenizer and the token id options are checked before anything is written (OUT/llm is gigabytes)
    published = _published_prompts(config_dir, layout, int(parts.llm["model.embed_tokens.weight"].shape[0]),
                                    waypoint_token_id, decision_token_ids, prompts, overrides)
    if layout == "minddrive" and published is None and not decision_token_ids:
        raise ValueError("--prompts preset needs --decision-token-ids: the ids of the meta-action (speed) tokens "
                         "whose LM-head logits the decision pass reads (with --prompts published they come from the "
                         "tokenizer files beside --llm-config)")
    llm = _write_llm(checkpoint, config_dir, doc, parts, layout, out, store_dtype, max_shard_bytes)
    cfg, own_extra = _driving_config(config_dir, parts, llm, layout, preset_name, overrides, waypoint_token_id,
                                     decision_token_ids, store_dtype, out, published)
    backbone = place_backbone(tensors, parts, cfg, store_dtype)
    own_extra.update(backbone.tensors)
    planner = place_planner(tensors, parts, cfg, layout, store_dtype)
    own_extra.update(planner.tensors)
    heads = place_query_heads(tensors, parts, cfg, store_dtype)
    own_extra.update(heads.tensors)
    # random_init says the nodes run random stand-ins (logged, marked on every trajectory): only while a part is one
    cfg.random_init = bool(_stand_in_parts(cfg, backbone_placed=bool(backbone.tensors),
                                           planner_placed=bool(planner.tensors), heads_placed=bool(heads.tensors)))
    _write_own(out, cfg, own_extra, store_dtype, seed, checkpoint, layout)
    report = _conversion_report(checkpoint, out, layout, wanted, parts, llm, cfg, non_tensor, backbone,
                                bool(planner.tensors), bool(heads.tensors))
    report["prompt"] = _prompt_report(cfg, config_dir)
    report["placed"]["planner (present_distribution, predict_model, ego_fut_decoder -> head.*)"] = len(planner.tensors)
    report["placed"]["query heads (pts_bbox_head, map_head, shared encoders, position_encoder -> projector.*)"] = \
        len(heads.tensors)
    report["derived_checked"]["query heads (constants and extra copies of shared modules)"] = len(heads.checked)
    training = planner.training_only + [k for k, why in heads.left_out.items() if why.startswith("training")]
    report["left_out_training_only"] = _group(training)
    report["left_out_output_only"] = _group([k for k, why in heads.left_out.items() if why.startswith("output")], 2)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    open_checkpoint(out)  # opens (the referred llm/ consistent) before success is reported
    return report


def _check_inputs(out: Path, config_dir: Path, layout: str, max_shard_bytes: int) -> dict:
    """The options :func:`_convert` checks before it reads anything; returns the LLM's ``config.json``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if not max_shard_bytes > 0:
        raise ValueError(f"the shard size must be positive, got {max_shard_bytes!r} bytes")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    doc = hf.read_config_json(config_dir)
    if doc.get("model_type") not in hf.LLM_MODEL_TYPES:
        raise CheckpointError(f"{config_dir / 'config.json'}: model_type {doc.get('model_type')!r}; the LLM config "
                              f"must be one of {', '.join(hf.LLM_MODEL_TYPES)}")
    return doc


def _choose_layout(checkpoint, parts, layout: str) -> tuple[str, tuple[str, ...]]:
    """The layout and the adapters it uses; other adapters' tensors move to ``parts.not_placed``. Raises
    CheckpointError when the adapters fit neither layout or the chosen one lacks one."""
    names = set(parts.adapters)
    if layout == "auto":
        if names == {ORION_ADAPTER}:
            layout = "orion"
        elif set(MINDDRIVE_ADAPTERS) <= names:
            layout = "minddrive"
        else:
            raise CheckpointError(f"{checkpoint}: adapters {sorted(names) or 'none'}: neither Orion's "
                                  f"({ORION_ADAPTER!r}) nor MindDrive's ({', '.join(MINDDRIVE_ADAPTERS)}); pass "
                                  "--layout")
    wanted = (ORION_ADAPTER,) if layout == "orion" else MINDDRIVE_ADAPTERS
    missing = [a for a in wanted if a not in parts.adapters]
    if missing:
        raise CheckpointError(f"{checkpoint}: the {layout} layout needs adapter(s) {missing}; the checkpoint has "
                              f"{sorted(names) or 'none'}")
    extra = sorted(names - set(wanted))
    for stored in sorted(parts.placed):
        m = _LORA.fullmatch(stored[len(LLM_PREFIX):])
        if m and m["ad"] in extra:
            parts.placed.remove(stored)
            parts.not_placed.append(stored)
    return layout, wanted


@dataclass
class _WrittenLLM:
    """What :func:`_write_llm` wrote: the directory read back, the vocabulary sizes, the merged modules."""

    ref: object
    keys: list[str]
    vocab: int
    declared_vocab: int
    merged: list[str]


def _write_llm(checkpoint, config_dir: Path, doc: dict, parts, layout: str, out: Path, store_dtype: torch.dtype,
               max_shard_bytes: int) -> _WrittenLLM:
    """Write ``OUT/llm``, Orion's adapter merged in float32, then cast."""
    vocab = int(parts.llm["model.embed_tokens.weight"].shape[0])
    llm_doc = dict(doc)
    declared_vocab = int(doc.get("vocab_size", vocab))
    llm_doc["vocab_size"] = vocab
    layers = sorted({int(k.split(".")[2]) for k in parts.llm if k.startswith("model.layers.")})
    if layers != list(range(int(doc["num_hidden_layers"]))):
        raise CheckpointError(f"{checkpoint}: decoder blocks {layers[:3]}...{layers[-3:]} do not match "
                              f"num_hidden_layers {doc['num_hidden_layers']} of {config_dir / 'config.json'}")
    merged = []

    def llm_tensor(key: str) -> torch.Tensor:  # one tensor of OUT/llm, merged when Orion's adapter adapts it
        t, mod = parts.llm[key], key.rsplit(".", 1)[0]
        if layout == "orion" and key.endswith(".weight") and mod in parts.adapters[ORION_ADAPTER].a:
            t = t.float() + parts.adapters[ORION_ADAPTER].delta(mod)
            merged.append(mod)
        return t.to(store_dtype).contiguous()

    llm_keys = sorted(parts.llm)
    if llm_doc.get("tie_word_embeddings") and "lm_head.weight" in parts.llm:
        if torch.equal(parts.llm["lm_head.weight"], parts.llm["model.embed_tokens.weight"]):
            llm_keys.remove("lm_head.weight")
        else:
            llm_doc["tie_word_embeddings"] = False  # the checkpoint's LM head is its own
    out.mkdir(parents=True, exist_ok=True)
    llm_dir = out / "llm"
    llm_dir.mkdir()
    llm_doc["architectures"] = [hf.ARCHITECTURES[doc["model_type"]]]
    (llm_dir / "config.json").write_text(json.dumps(llm_doc, indent=2) + "\n")
    _write_shards(llm_dir, llm_keys, {k: parts.llm[k].shape for k in llm_keys}, llm_tensor, store_dtype,
                  max_shard_bytes)
    for name in TOKENIZER_FILES:
        if (config_dir / name).is_file():
            shutil.copy2(config_dir / name, llm_dir / name)
    ref = hf.read_hf(llm_dir)
    return _WrittenLLM(ref, llm_keys, vocab, declared_vocab, merged)


@dataclass
class PlacedBackbone:
    """``tensors``: ``vision.<name>`` -> tensor; ``checked``: the stored rotary tables compared, not loaded."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)


def place_backbone(tensors: dict[str, torch.Tensor], parts: PublishedParts, cfg, store_dtype: torch.dtype
                   ) -> PlacedBackbone:
    """Place ``img_backbone.*`` one to one when the config's vision side is EVA-02; names placed or checked
    leave ``parts.not_placed``. Raises CheckpointError when a stored rotary table differs (another input size)
    or the backbone is only partly stored. Shapes are checked in :func:`_write_own`."""
    from .eva02 import EVA02_TYPE, EVA02Config, derived_tensor_names, expected_derived

    placed = PlacedBackbone()
    if cfg.vision_type != EVA02_TYPE:
        return placed
    eva = EVA02Config.from_dict(cfg.vision)
    derived = set(derived_tensor_names(eva))
    with torch.device("meta"):
        from .eva02 import EVA02ViT

        own = set(EVA02ViT(eva).state_dict())
    for stored in [n for n in parts.not_placed if n.startswith(BACKBONE_PREFIX)]:
        name = stored[len(BACKBONE_PREFIX):]
        if name in derived:
            want, got = expected_derived(eva, name), tensors[stored].float()
            tol = 1e-5 if tensors[stored].dtype == torch.float32 else 1e-2
            if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=tol):
                raise CheckpointError(f"{stored}: the stored rotary table ({list(got.shape)}) is not EVA-02's at "
                                      f"image_size {eva.image_size}, window {eva.window_size}, rotary grid "
                                      f"{eva.rope_grid}: the checkpoint was made for another input size")
            placed.checked.append(stored)
        elif name in own:
            placed.tensors[f"vision.{name}"] = tensors[stored].to(store_dtype).contiguous()
        else:
            continue
        parts.not_placed.remove(stored)
    missing = sorted(set(own) - {k[len("vision."):] for k in placed.tensors})
    if placed.tensors and missing:  # a part random part published backbone would run silently
        raise CheckpointError(f"the checkpoint's EVA-02 backbone ({BACKBONE_PREFIX}*) lacks {len(missing)} of its "
                              f"tensors, e.g. {[BACKBONE_PREFIX + n for n in missing[:3]]}")
    return placed


@dataclass
class PlacedQueryHeads:
    """As :class:`~.query_heads.PlacedHeads`, ``tensors`` keyed ``projector.<name>``."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)


def place_query_heads(tensors: dict[str, torch.Tensor], parts: PublishedParts, cfg, store_dtype: torch.dtype
                      ) -> PlacedQueryHeads:
    """Place the published query heads into ``projector.*`` when the projector is ``scene_queries`` and the
    checkpoint has heads (:func:`~hybrid_vla_ros.model.query_heads.place_published_heads`); everything read leaves
    ``parts.not_placed``. Raises CheckpointError for heads only partly stored, copies that differ, or sizes /
    constants that are not the config's."""
    from .config import SCENE_QUERIES
    from .query_heads import PUBLISHED_PREFIXES, place_published_heads

    placed = PlacedQueryHeads()
    if cfg.projector.get("type") != SCENE_QUERIES:
        return placed
    stored = {n: tensors[n] for n in parts.not_placed if n.startswith(PUBLISHED_PREFIXES)}
    if not any(n.startswith(("pts_bbox_head.", "map_head.")) for n in stored):
        return placed
    heads = cfg.scene_heads_config
    from .camera_rays import RayEmbeddingConfig

    rays = RayEmbeddingConfig(embed_dims=heads.embed_dims, stride=int(cfg.vision["patch_size"]))
    try:
        result = place_published_heads(stored, heads, rays)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint's query heads do not fit this config: {e}") from None
    placed.tensors = {f"projector.{k}": v.to(store_dtype).contiguous() for k, v in result.tensors.items()}
    placed.checked, placed.left_out = list(result.checked), dict(result.left_out)
    for name in result.read:
        parts.not_placed.remove(name)
    return placed


#: The published planner's modules (Orion's single VAE planner; MindDrive's speed planner, its path planner with
#: the ``pw_`` prefix), placed under ``head.`` for a ``vae`` read-out.
PLANNER_MODULES = ("present_distribution", "predict_model", "ego_fut_decoder")


@dataclass
class PlacedPlanner:
    """``tensors``: ``head.<name>`` -> tensor; ``training_only``: the VAE posterior's stored names, left out."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    training_only: list[str] = field(default_factory=list)


def place_planner(tensors: dict[str, torch.Tensor], parts: PublishedParts, cfg, layout: str,
                  store_dtype: torch.dtype) -> PlacedPlanner:
    """Place Orion's VAE planner into ``head.*`` (``vae`` read-out), or MindDrive's speed and path (``pw_``)
    planners into ``head.speed.*`` / ``head.path.*`` (``vae_speed_path``); placed and training-only names leave
    ``parts.not_placed``. Raises CheckpointError for a planner only partly stored."""
    from .vae_planner import TRAINING_ONLY

    placed = PlacedPlanner()
    two = layout == "minddrive" and cfg.readout_type == "vae_speed_path"
    for stored in list(parts.not_placed):
        top = stored.split(".", 1)[0]
        if top in TRAINING_ONLY:
            placed.training_only.append(stored)
        elif top in PLANNER_MODULES and layout == "orion" and cfg.readout_type == "vae":
            placed.tensors[f"head.{stored}"] = tensors[stored].to(store_dtype).contiguous()
        elif top in PLANNER_MODULES and two:  # MindDrive's speed planner
            placed.tensors[f"head.speed.{stored}"] = tensors[stored].to(store_dtype).contiguous()
        elif top.startswith("pw_") and top[3:] in PLANNER_MODULES and two:  # and its path planner
            placed.tensors[f"head.path.{stored[3:]}"] = tensors[stored].to(store_dtype).contiguous()
        else:
            continue
        parts.not_placed.remove(stored)
    if placed.tensors:  # all of the planner(s) or none: a part random part published planner would run silently
        from .modeling import own_head

        with torch.device("meta"):
            wanted = {f"head.{k}" for k in own_head(cfg, cfg.hidden_size).state_dict()}
        missing = sorted(wanted - set(placed.tensors))
        if missing:
            raise CheckpointError(f"the checkpoint's planner lacks {len(missing)} of the tensors the "
                                  f"{cfg.readout_type} read-out needs, e.g. {missing[:3]} (as head.*)")
    return placed


def _driving_config(config_dir: Path, parts, llm: _WrittenLLM, layout: str, preset_name, overrides, waypoint_token_id,
                    decision_token_ids, store_dtype: torch.dtype, out: Path, prompts=None):
    """The converted VLAConfig and the own tensors from the checkpoint (MindDrive: decision rows, per-pass
    deltas; it also writes ``OUT/adapters``). Raises ValueError for a missing or out-of-range token id or a bad
    override."""
    from .config import VLAConfig, preset

    ref, llm_keys, vocab, declared_vocab = llm.ref, llm.keys, llm.vocab, llm.declared_vocab
    if prompts is not None:
        waypoint_token_id, decision_token_ids = prompts.waypoint_token_id, prompts.speed_token_ids
    wp = waypoint_token_id if waypoint_token_id is not None else _token_id(config_dir, WAYPOINT_TOKEN)
    if wp is None and layout == "orion" and vocab == declared_vocab + 1:
        wp = vocab - 1  # Orion adds <waypoint_ego> as the one new row after the base vocabulary
    if wp is None:
        raise ValueError(f"cannot tell the id of {WAYPOINT_TOKEN}: not in {config_dir}'s tokenizer files; pass "
                         "--waypoint-token-id")
    if not 0 <= int(wp) < vocab:
        raise ValueError(f"waypoint token id {wp} outside the checkpoint's vocabulary [0, {vocab})")
    base = preset(preset_name or ("orion" if layout == "orion" else "minddrive-0.5b")).to_dict()
    fixed = {"preset", "llm_path", "vlm_path", "planning_head", "llm", "pass_lora_rank", "pass_adapters",
             "decision_token_ids", "random_init"}
    bad = set(overrides or {}) - (set(VLAConfig.__dataclass_fields__) - fixed)
    if bad:
        raise ValueError(f"unknown or fixed option(s) {sorted(bad)}")
    base.update(overrides or {})
    base.update(llm=ref.llm_dict(), llm_path="llm", planning_token_id=int(wp))
    own_extra: dict[str, torch.Tensor] = {}
    if layout == "minddrive":
        ranks = [parts.adapters[a].r for a in MINDDRIVE_ADAPTERS]
        base.update(llm_passes=2, pass_lora_rank=max(ranks), pass_adapters=list(MINDDRIVE_ADAPTERS),
                    decision_token_ids=[int(t) for t in decision_token_ids])
        head_rows = parts.llm["lm_head.weight" if "lm_head.weight" in llm_keys else "model.embed_tokens.weight"]
        own_extra["decision_head.weight"] = head_rows[torch.tensor(base["decision_token_ids"])].to(
            store_dtype).contiguous()
        own_extra.update(_pass_deltas(parts, ref, max(ranks), store_dtype))
        for ad in (parts.adapters[a] for a in MINDDRIVE_ADAPTERS):
            _adapter_dir(out / "adapters", ad, sorted({m.rsplit(".", 1)[1] for m in ad.a}))
        readout = dict(base.get("readout") or {})
        if prompts is not None:  # the published conversation of each pass (model/published_prompts.py)
            base.update(prompt_token_ids=prompts.prompt_token_ids, pass_prompt_token_ids=prompts.pass_prompt_token_ids)
        if readout.get("type") == "vae_speed_path":  # the path planner's token: from the tokenizer files
            tid = prompts.path_token_id if prompts is not None else _token_id(config_dir, PATH_WAYPOINT_TOKEN)
            if tid is None and "readout" not in (overrides or {}):
                raise ValueError(f"cannot tell the id of {PATH_WAYPOINT_TOKEN}: not in {config_dir}'s tokenizer "
                                 "files; give it as readout.path_token_id (--set readout=...)")
            if tid is not None:
                base["readout"] = {**readout, "path_token_id": int(tid)}
    else:
        base.update(llm_passes=1, pass_lora_rank=0, pass_adapters=[], decision_token_ids=[])
        if prompts is not None:  # Orion's closed-loop conversation, or with its QA (model/published_prompts.py)
            base.update(prompt_token_ids=prompts.prompt_token_ids, pass_prompt_token_ids=[prompts.after_token_ids])
            if prompts.decode:  # --set decode={...} changes keys of it (e.g. max_new_tokens), the rest stays
                base["decode"] = {**prompts.decode, **dict((overrides or {}).get("decode") or {})}
    base.pop("model_type"), base.pop("format_version")
    base["random_init"] = True
    cfg = VLAConfig(**base)
    return cfg, own_extra


def _published_prompts(config_dir: Path, layout: str, vocab: int, waypoint_token_id, decision_token_ids,
                       use: str = "published", overrides: dict | None = None):
    """MindDrive's published prompts, Orion's closed-loop conversation (where its tokenizer is beside the LLM
    config), or None (``use="preset"``, Orion without a tokenizer). Raises CheckpointError when the tokenizer's size
    is not the checkpoint's ``vocab`` (another tokenizer: its ids would name other rows), ValueError for an unknown
    ``use``, no or a broken tokenizer (MindDrive), or options that contradict it."""
    from .published_prompts import TOKENIZER_MARKERS, has_tokenizer, minddrive_prompts, orion_prompt, orion_qa_prompt

    if use not in ("published", "preset", "published-qa"):
        raise ValueError(f"prompts {use!r}: use 'published', 'published-qa' (Orion) or 'preset'")
    if use == "preset":
        return None
    if use == "published-qa" and layout != "orion":
        raise ValueError("--prompts published-qa is Orion's conversation with its critical QA: an Orion checkpoint's")
    if use == "published-qa" and not has_tokenizer(config_dir):
        raise ValueError(f"{config_dir} has no tokenizer files ({', '.join(TOKENIZER_MARKERS)}): Orion's questions "
                         "are made with its tokenizer")
    if layout == "orion" and not has_tokenizer(config_dir):  # the preset's prompt without its tokenizer
        return None
    if layout not in ("orion", "minddrive"):
        return None
    if not has_tokenizer(config_dir):
        raise ValueError(f"{config_dir} has no tokenizer files ({', '.join(TOKENIZER_MARKERS)}): MindDrive's "
                         "published prompts are made with its tokenizer. Put the tokenizer beside config.json, or "
                         "give --prompts preset --decision-token-ids ... to keep the preset's fixed prompt (not the "
                         "published computation)")
    clash = sorted({"prompt_token_ids", "pass_prompt_token_ids"} & set(overrides or {}))
    if clash:
        raise ValueError(f"--set {', '.join(clash)}: the published prompts come from {config_dir}'s tokenizer; "
                         "use --prompts preset to give your own")
    try:
        make = orion_qa_prompt if use == "published-qa" else orion_prompt if layout == "orion" else minddrive_prompts
        prompts = make(config_dir)
    except ValueError as e:
        raise ValueError(f"{e}; --prompts preset keeps the preset's fixed prompt (not the published one)") from None
    if prompts.vocab_size != vocab:
        added = "Orion's <waypoint_ego>" if layout == "orion" else "MindDrive's additions"
        raise CheckpointError(f"{prompts.tokenizer}: {prompts.vocab_size} tokens after {added}, the checkpoint's "
                              f"embeddings have {vocab} rows: not the tokenizer it was trained with (--prompts "
                              "preset keeps the preset's fixed prompt, not the published one)")
    if waypoint_token_id is not None and int(waypoint_token_id) != prompts.waypoint_token_id:
        raise ValueError(f"--waypoint-token-id {waypoint_token_id}, but the tokenizer gives "
                         f"{prompts.waypoint_token_id} for {WAYPOINT_TOKEN}")
    if decision_token_ids and [int(t) for t in decision_token_ids] != list(prompts.speed_token_ids):
        raise ValueError(f"--decision-token-ids {list(decision_token_ids)}, but the tokenizer gives "
                         f"{prompts.speed_token_ids} for the speed meta-actions")
    return prompts


def _prompt_report(cfg, config_dir: Path) -> dict:
    """The report's ``prompt`` entry: whether the passes run the published conversation or the preset's prompt."""
    if cfg.pass_prompt_token_ids and cfg.llm_passes == 1 and cfg.decode:
        spec = cfg.decode_spec
        return {"source": f"Orion's conversation with its critical QA (desc_qa on: {spec.decodes_per_frame} "
                          f"questions answered by up to {spec.settings.max_new_tokens} tokens each, then the "
                          f"planning turn), tokenized with {config_dir}'s tokenizer",
                "tokens_before_scene": len(cfg.prompt_token_ids),
                "tokens_after_scene": len(cfg.pass_prompt_token_ids[0]),
                "turn_tokens": [len(t) for t in spec.turns],
                "planning_turn_tokens": len(cfg.decode_placed_token_ids)}
    if cfg.pass_prompt_token_ids and cfg.llm_passes == 1:
        return {"source": f"Orion's closed-loop conversation (its planning turn, desc_qa off), tokenized with "
                          f"{config_dir}'s tokenizer",
                "tokens_before_scene": len(cfg.prompt_token_ids),
                "tokens_after_scene": len(cfg.pass_prompt_token_ids[0]),
                "readout_positions_from_end": vars(cfg.readout_positions)}
    if cfg.pass_prompt_token_ids:
        return {"source": f"MindDrive's published prompts, tokenized with {config_dir}'s tokenizer",
                "tokens_before_scene": len(cfg.prompt_token_ids),
                "tokens_after_scene_per_pass": [len(p) for p in cfg.pass_prompt_token_ids],
                "readout_positions_from_end": vars(cfg.readout_positions)}
    return {"source": f"the {cfg.preset} preset's fixed prompt: NOT the published conversation"
                      + (" (--prompts preset)" if cfg.llm_passes > 1 else
                         " (no tokenizer files beside the LLM config, or --prompts preset)"),
            "tokens": cfg.num_tokens}


def _write_own(out: Path, cfg, own_extra: dict, store_dtype: torch.dtype, seed: int, checkpoint, layout: str) -> None:
    """``OUT/model.safetensors`` and ``OUT/config.json``: random stand-ins (from ``seed``) where the checkpoint
    has nothing. Raises CheckpointError on a shape mismatch."""
    from .checkpoint import WEIGHTS_FILE, _own_modules

    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(store_dtype)
    try:
        own = {k: v.detach().to(store_dtype).contiguous() for k, v in _own_modules(cfg).state_dict().items()}
    finally:
        torch.set_default_dtype(default_dtype)
    for k, v in own_extra.items():
        if k in own and tuple(own[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{k}: shape {list(v.shape)}, the model needs {list(own[k].shape)}")
        own[k] = v
    meta = {"format": "pt", "preset": cfg.preset, "converted_from": str(Path(checkpoint).resolve()),
            "layout": layout}
    save_file(own, str(out / WEIGHTS_FILE), metadata=meta)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def _conversion_report(checkpoint, out: Path, layout: str, wanted, parts, llm: _WrittenLLM, cfg, non_tensor,
                       backbone: PlacedBackbone, planner_placed: bool = False, heads_placed: bool = False) -> dict:
    """The ``convert_report.json`` contents: what was placed, merged and written, and what was not, by name."""
    ref, llm_keys, vocab, declared_vocab, merged = llm.ref, llm.keys, llm.vocab, llm.declared_vocab, llm.merged
    wp = cfg.planning_token_id
    placed_groups = {"llm (lm_head.base_model.model.*)": len(parts.placed),
                     "vision (img_backbone.* -> vision.*, EVA-02)": len(backbone.tensors)}
    report = {
        "checkpoint": str(Path(checkpoint).resolve()), "layout": layout, "out": str(out.resolve()),
        "llm": {"architecture": ref.architecture, "num_hidden_layers": ref.num_layers, "vocab_size": vocab,
                "config_vocab_size": declared_vocab, "planning_token_id": int(wp),
                "tensors_written": len(llm_keys), "merged_modules": len(merged)},
        "adapters": {a.name: {"r": a.r, "lora_alpha": a.alpha, "scaling": a.scaling, "modules": len(a.a),
                              "hparams_from": a.source,
                              "use": ("merged into llm/" if layout == "orion" else
                                      f"pass {MINDDRIVE_ADAPTERS.index(a.name)} delta + adapters/{a.name}/")}
                     for a in (parts.adapters[n] for n in wanted)},
        "placed": placed_groups,
        "not_placed": _group(parts.not_placed),
        "not_placed_total": len(parts.not_placed),
        "non_tensor_entries": non_tensor,
        "derived_checked": {"img_backbone rotary tables (computed from the config, equal to the stored ones)":
                            len(backbone.checked)},
        "stand_ins": _stand_ins(cfg, backbone_placed=bool(backbone.tensors), planner_placed=planner_placed,
                                heads_placed=heads_placed),
    }
    if layout == "minddrive":
        report["decision"] = {"token_ids": cfg.decision_token_ids, "position": cfg.decision_position,
                              "rows_from": "lm_head.weight" if "lm_head.weight" in llm_keys else
                              "model.embed_tokens.weight (tied)"}
    return report


def _stand_in_parts(cfg, *, backbone_placed: bool, planner_placed: bool, heads_placed: bool) -> list[str]:
    """The converted model's parts that are random-init stand-ins (no published model has an ego embedding,
    query tokens or a pass embedding)."""
    parts = [name for name, placed in (("vision.*", backbone_placed), ("projector.*", heads_placed),
                                       ("head.*", planner_placed)) if not placed]
    if cfg.ego_state_input:
        parts.append("ego_embed.*")
    if cfg.query_count:
        parts.append("query_tokens")
    if cfg.llm_passes > 1 and not cfg.pass_lora_rank:
        parts.append("pass_embed.*")
    return parts


def _stand_ins(cfg, *, backbone_placed: bool, planner_placed: bool, heads_placed: bool) -> str:
    """The report's line on the random-init stand-ins."""
    parts = _stand_in_parts(cfg, backbone_placed=backbone_placed, planner_placed=planner_placed,
                            heads_placed=heads_placed)
    if not parts:
        return "none: every module of the model comes from the checkpoint"
    return (f"{', '.join(parts)} are this package's random-init stand-ins ({cfg.preset} preset): the checkpoint has "
            "no such part this config takes (what it has and was not placed is listed in not_placed)")


def _write_shards(directory: Path, keys: list[str], shapes: dict, make, dtype: torch.dtype, limit: int) -> None:
    """Write ``{key: make(key)}`` as transformers does: one file, or shards of at most ``limit`` bytes (a larger
    tensor alone) with an index. Only one shard's tensors are held at a time."""
    size = torch.empty((), dtype=dtype).element_size()
    groups, current, used = [], [], 0
    for key in keys:
        n = torch.Size(shapes[key]).numel() * size
        if current and used + n > limit:
            groups.append(current)
            current, used = [], 0
        current.append(key)
        used += n
    groups.append(current)
    if len(groups) == 1:
        save_file({k: make(k) for k in keys}, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        shard = {k: make(k) for k in group}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        del shard
        weight_map.update({k: name for k in group})
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _pass_deltas(parts: PublishedParts, ref: hf.HFModel, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-block ``lora_A`` (P, rank, in) and ``lora_B`` (P, out, rank), scaling folded into B, zero-padded to
    ``rank`` (exact). Raises CheckpointError when an adapter targets a module other than q/k/v/o."""
    from .modeling import PASS_LORA_TARGETS

    ads = [parts.adapters[a] for a in MINDDRIVE_ADAPTERS]
    for ad in ads:
        other = sorted(m for m in ad.a if m.rsplit(".", 1)[1] not in PASS_LORA_TARGETS or ".self_attn." not in m)
        if other:
            raise CheckpointError(f"adapter {ad.name!r} adapts {other[:3]}: per-pass deltas are supported on "
                                  f"self_attn {', '.join(PASS_LORA_TARGETS)} only")
    out = {}
    for i in range(ref.num_layers):
        for t in PASS_LORA_TARGETS:
            mod = f"model.layers.{i}.self_attn.{t}"
            w = parts.llm[f"{mod}.weight"]
            a = torch.zeros(len(ads), rank, w.shape[1])
            b = torch.zeros(len(ads), w.shape[0], rank)
            for p, ad in enumerate(ads):
                if mod in ad.a:
                    a[p, :ad.r] = ad.a[mod].float()
                    b[p, :, :ad.r] = ad.b[mod].float() * ad.scaling
            out[f"layers.{i}.self_attn.{t}.lora_A"] = a.to(dtype).contiguous()
            out[f"layers.{i}.self_attn.{t}.lora_B"] = b.to(dtype).contiguous()
    return out
