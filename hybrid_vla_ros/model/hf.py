"""Hugging Face transformers checkpoint directories: what they are, and how their tensors map onto the split.

A directory is ``config.json`` plus ``model.safetensors`` or shards with ``model.safetensors.index.json``, as
``save_pretrained`` writes it. Supported: a causal LM of a text family (:data:`LLM_MODEL_TYPES`; e.g. Vicuna,
LLaMA 2 / 3, SmolLM2, Qwen2.5, Gemma 3 text), blocks from :mod:`hybrid_vla_ros.model.text`; ``llava`` (CLIP or
SigLIP tower, LLaVA's two-layer projector, such an LM); the VLM families of :mod:`hybrid_vla_ros.model.vlm`.

Stored -> canonical names (:mod:`hybrid_vla_ros.model.sources`), from the transformers ``modeling_<family>.py``
and ``conversion_mapping.py`` sources, checked against transformers 5.24's ``save_pretrained``:

============================================================  ==========================================
stored                                                        canonical
============================================================  ==========================================
``model.embed_tokens.weight``                                 ``embed_tokens.weight``
``model.layers.{i}.<rest>``                                   ``layers.{i}.<rest>``
``model.norm.weight``                                         ``norm.weight``
``lm_head.weight``                                            ``lm_head.weight`` (read by a decode only)
LLaVA, transformers 4.x and 5.x ``save_pretrained`` (default ``save_original_format``):
``language_model.model.{embed_tokens,layers.{i},norm}.*``     as above
``vision_tower.[vision_model.]<rest>``                        ``vision_tower.<rest>``
``multi_modal_projector.<rest>``                              ``multi_modal_projector.<rest>``
LLaVA, transformers 5.x in-memory layout (``save_original_format=False``):
``model.language_model.{embed_tokens,layers.{i},norm}.*``     as above
``model.vision_tower.<rest>``, ``model.multi_modal_projector.<rest>``  as above
============================================================  ==========================================

(``vision_model.`` is transformers 4.x's CLIP / SigLIP wrapper.) Stored rotary ``inv_freq`` buffers are not read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .text import CAUSAL_LM_ARCHITECTURES, TESTED_TEXT_TYPES, check_splittable, text_family
from .sources import (
    CheckpointError,
    KeyMap,
    MissingFileError,
    SafetensorsSource,
    hf_safetensors_files,
)

#: transformers ``model_type`` of the tested causal LMs (TESTED_TEXT_TYPES less VLM text models); any other that
#: text.text_family accepts is read too.
LLM_MODEL_TYPES = tuple(t for t in TESTED_TEXT_TYPES if t in CAUSAL_LM_ARCHITECTURES)
#: transformers ``model_type`` of the vision towers a LLaVA model may have here.
VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")
#: Architectures (``config.json`` ``architectures``) read from a transformers directory, by model_type.
ARCHITECTURES = {**CAUSAL_LM_ARCHITECTURES, "llava": "LlavaForConditionalGeneration"}

#: Config keys about saving or training, not the architecture: left out of the stored ``llm`` / ``vision`` dicts.
_NOISE_KEYS = {"_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "id2label",
               "label2id", "problem_type", "return_dict", "output_hidden_states", "output_attentions",
               "chunk_size_feed_forward", "is_encoder_decoder", "use_cache", "initializer_range",
               "initializer_factor", "tokenizer_class", "auto_map"}

_LLM_PARTS = r"(embed_tokens\..+|layers\.\d+\..+|norm\..+)"
#: Stored names of a LlamaForCausalLM / Qwen2ForCausalLM (or a bare LlamaModel / Qwen2Model) -> canonical.
LLM_KEY_MAP = KeyMap([
    (r".*rotary_emb\.inv_freq", None),
    (r"(?:model\.)?" + _LLM_PARTS, r"\1"),
    (r"(lm_head\.weight)", r"\1"),
], "transformers causal LM")
def llm_key_map(norm_attribute: str = "norm") -> KeyMap:
    """:data:`LLM_KEY_MAP` for a family whose base model holds its final norm under ``norm_attribute`` (LFM2's
    ``embedding_norm``, Falcon-H1's ``final_layernorm``): stored there, canonical ``norm.*``."""
    if norm_attribute == "norm":
        return LLM_KEY_MAP
    return KeyMap([(r"(?:model\.)?" + re.escape(norm_attribute) + r"\.(.+)", r"norm.\1"), *LLM_KEY_MAP.rules_text],
                  f"transformers causal LM (final norm {norm_attribute})")


#: Stored names of a LlavaForConditionalGeneration (transformers 4.x and 5.x layouts) -> canonical.
LLAVA_KEY_MAP = KeyMap([
    (r".*rotary_emb\.inv_freq", None),
    (r"(?:model\.)?language_model\.(?:model\.)?" + _LLM_PARTS, r"\1"),
    (r"(?:model\.)?(?:language_model\.)?lm_head\..+", None),
    (r"(?:model\.)?vision_tower\.(?:vision_model\.)?(.+)", r"vision_tower.\1"),
    (r"(?:model\.)?multi_modal_projector\.(.+)", r"multi_modal_projector.\1"),
], "transformers LLaVA")

#: OpenAI CLIP's image mean / std, LLaVA's default without ``preprocessor_config.json``.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def read_config_json(path: Path) -> dict:
    """``config.json`` of a checkpoint directory as a dict (floats JSON cannot hold as transformers writes them,
    ``{"__float__": "Infinity"}``, left so). Raises MissingFileError, CheckpointError."""
    file = Path(path) / "config.json"
    try:
        doc = json.loads(file.read_text())
    except FileNotFoundError:
        raise MissingFileError(f"{Path(path)}: no config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return doc


def is_transformers_config(doc: dict) -> bool:
    """True when a parsed config.json looks like a transformers model config (not this package's)."""
    return "architectures" in doc or (doc.get("model_type") not in (None, "hybrid_vla", "hybrid_vla_code"))


def architecture_name(doc: dict) -> str:
    """The architecture a transformers config.json names (``architectures[0]``, else its model_type)."""
    archs = doc.get("architectures") or []
    return str(archs[0]) if archs else str(doc.get("model_type"))


def unsupported_message(path: Path, doc: dict) -> str:
    """Why a transformers config is not supported, naming the file, its architecture and what is."""
    from .vlm import VLM_MODEL_TYPES

    why = ""
    try:
        text_family(doc.get("model_type"))
    except (ValueError, TypeError) as e:
        why = f" ({e})"
    return (f"{Path(path) / 'config.json'}: architecture {architecture_name(doc)!r} (model_type "
            f"{doc.get('model_type')!r}) is not supported{why}; this package splits transformers causal LMs built "
            f"as embedding -> decoder blocks -> norm (e.g. {', '.join(sorted(ARCHITECTURES.values()))}; "
            "docs/models.md, 'Any decoder', lists the families checked), the "
            f"VLM families {', '.join(VLM_MODEL_TYPES)} (their ForConditionalGeneration), this package's own "
            "checkpoints and own model code (model_type 'hybrid_vla_code', see docs/models.md)")


def _check_text_config(path: Path, text) -> None:
    file = Path(path) / "config.json"
    try:
        family = text_family(text.model_type)
        if family.causal_lm_class is None:
            raise ValueError(f"language model type {text.model_type!r} is a VLM's text model, not a causal LM "
                             "directory (open the VLM's directory)")
        check_splittable(text)
        _check_family(text)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None


def causal_lm_config_class(model_type) -> type | None:
    """transformers' config class of a causal LM family :func:`~.text.text_family` accepts, else None."""
    try:
        family = text_family(model_type)
    except (ValueError, TypeError):
        return None
    return family.config_class if family.causal_lm_class is not None else None


def _check_family(text) -> None:
    """:func:`~.family_check.check_family` (imported here: it runs the split path, which this module is below)."""
    from .family_check import check_family

    check_family(text)


def _check_text_config_any(path: Path, text, both_ways: bool = False) -> None:
    try:
        check_splittable(text, both_ways)
        _check_family(text)
    except ValueError as e:
        raise CheckpointError(f"{Path(path) / 'config.json'}: {e}") from None


@dataclass
class HFModel:
    """A transformers directory, resolved through transformers' own config classes.

    ``kind``: ``llm``, ``llava`` or ``vlm``; ``config``: the transformers config (e.g. ``Qwen3Config``);
    ``text_config``: the language model's (``config`` itself for an LLM); ``vision_config``: None for an LLM.
    """

    path: Path
    kind: str
    architecture: str
    config: object
    text_config: object
    vision_config: object | None = None
    raw: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    def key_map(self) -> KeyMap:
        if self.kind == "vlm":
            from .vlm import VLMKeyMap, vlm_family

            return VLMKeyMap(self.config, vlm_family(self.config.model_type))
        if self.kind == "llava":
            return LLAVA_KEY_MAP
        return llm_key_map(text_family(self.config.model_type).norm_attribute)

    def source(self) -> SafetensorsSource:
        """The directory's tensors in canonical names. Raises MissingFileError (no weights, a missing shard),
        CheckpointError (the index names a tensor a shard lacks)."""
        files, index, index_file = hf_safetensors_files(self.path)
        label = f"{index_file or files[0]}"
        from .weight_conversion import ConvertedSource, OneBlockModel, conversion_transforms

        if self.kind == "llm":  # a family whose stored tensors transformers converts or renames at load
            raw = SafetensorsSource(files, None, index=index, index_file=index_file, label=label)
            transforms, shell = conversion_transforms(text_family(self.config.model_type), self.config, raw.names())
            if transforms:
                return ConvertedSource(raw, transforms, self.key_map(), label, shell)
        if self.kind == "vlm":  # its key map renames; the converters (a MoE text model's experts) run first
            key_map = self.key_map()
            if key_map.converters:
                raw = SafetensorsSource(files, None, index=index, index_file=index_file, label=label)
                return ConvertedSource(raw, key_map.converters, key_map.renaming_only(), label,
                                       OneBlockModel(key_map.shell))
            return SafetensorsSource(files, key_map, index=index, index_file=index_file, label=label)
        return SafetensorsSource(files, self.key_map(), index=index, index_file=index_file, label=label)

    def llm_dict(self) -> dict:
        """The language model's config as this package's ``llm`` dict."""
        return config_dict(self.text_config)

    def vision_dict(self) -> dict:
        """The vision tower's config as a ``vision`` dict (LLaVA only)."""
        return config_dict(self.vision_config)

    def projector_dict(self) -> dict:
        """LLaVA's projector and feature selection as a ``projector`` dict (``type: llava``)."""
        c = self.config
        layer = c.vision_feature_layer
        layer = list(layer) if isinstance(layer, (list, tuple)) else int(layer)
        return {"type": "llava", "vision_feature_layer": layer,
                "vision_feature_select_strategy": str(c.vision_feature_select_strategy),
                "projector_hidden_act": str(c.projector_hidden_act),
                "multimodal_projector_bias": bool(c.multimodal_projector_bias),
                "image_token_index": int(c.image_token_index)}

    def image_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) per RGB channel from ``preprocessor_config.json`` (CLIP's when the file is absent)."""
        file = self.path / "preprocessor_config.json"
        if file.is_file():
            try:
                doc = json.loads(file.read_text())
                return tuple(float(v) for v in doc["image_mean"]), tuple(float(v) for v in doc["image_std"])
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{file}: no usable image_mean / image_std ({e})") from None
        return CLIP_MEAN, CLIP_STD


def config_dict(config) -> dict:
    """A transformers config as a plain dict of its architecture kwargs, model_type included; floats JSON cannot
    hold written as transformers' ``save_pretrained`` writes them (``{"__float__": "Infinity"}``: Falcon-H1's
    ``time_step_limit``), so the dict is plain JSON (:func:`~.text.text_config` decodes them)."""
    from transformers import PretrainedConfig

    d = {k: v for k, v in config.to_dict().items() if k not in _NOISE_KEYS}
    d["model_type"] = config.model_type
    return PretrainedConfig._encode_special_floats(d)


def read_hf(path: str | Path) -> HFModel:
    """Resolve a local transformers directory (no network).

    Raises MissingFileError (no config.json), CheckpointError (unsupported architecture, language model or
    vision tower, a quantized checkpoint, attention that cannot be split exactly).
    """
    from transformers import LlavaConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(path)
    doc = read_config_json(path)
    model_type = doc.get("model_type")
    file = path / "config.json"
    if "quantization_config" in doc:
        method = doc["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{file}: a quantized checkpoint ({method}); "
                              "this package loads floating-point weights (F32, F16, BF16): dequantize it first")
    from .vlm import VLM_MODEL_TYPES

    classes = {**{t: CONFIG_MAPPING[t] for t in (*LLM_MODEL_TYPES, *VLM_MODEL_TYPES)}, "llava": LlavaConfig}
    if model_type not in classes and causal_lm_config_class(model_type) is not None:
        classes[model_type] = causal_lm_config_class(model_type)
    if model_type not in classes:
        raise CheckpointError(unsupported_message(path, doc))
    from transformers import PretrainedConfig

    try:  # floats JSON cannot hold decoded as transformers' from_pretrained decodes them (Falcon-H1's)
        config = classes[model_type].from_dict(PretrainedConfig._decode_special_floats(doc))
    except Exception as e:  # noqa: BLE001 - the config class's own validation (strict dataclass errors included)
        raise CheckpointError(f"{file}: transformers cannot read it as a {model_type} config "
                              f"({type(e).__name__}: {' '.join(str(e).split())})") from None
    if model_type in VLM_MODEL_TYPES:
        text = config.text_config
        try:
            text_family(text.model_type)
        except ValueError as e:
            raise CheckpointError(f"{file}: the text model of this {model_type} cannot be split: {e}") from None
        from .vlm import block_mask_rule

        _check_text_config_any(path, text, both_ways=block_mask_rule(model_type) is not None)
        return HFModel(path, "vlm", architecture_name(doc), config, text, config.vision_config, doc)
    if model_type == "llava":
        vision = config.vision_config
        if vision.model_type not in VISION_MODEL_TYPES:
            raise CheckpointError(f"{file}: vision tower {vision.model_type!r} is not supported (use one of "
                                  f"{', '.join(VISION_MODEL_TYPES)})")
        _check_text_config(path, config.text_config)
        return HFModel(path, "llava", ARCHITECTURES["llava"], config, config.text_config, vision, doc)
    _check_text_config(path, config)
    return HFModel(path, "llm", architecture_name(doc), config, config, None, doc)


def lm_prompt_ids(vocab_size: int, n: int = 16) -> list[int]:
    """``n`` fixed ids spread over the vocabulary, to verify a bare LM without a tokenizer."""
    return [(7 + 131 * i) % vocab_size for i in range(n)]
