"""Vision-language models whole, from transformers' own classes: the prefix's front and what crosses the split.

A VLM family (:data:`VLM_MODEL_TYPES`) is transformers' ``<Family>Model``: vision tower, connector and a text
model (``language_model``; Idefics3 / SmolVLM: ``text_model``). The prefix runs the family's own base-model
forward (vision features scattered into the embeddings, multimodal rotary positions, DeepStack) up to the text
model's call, where :class:`TextCapture` records its inputs and stops; nothing of that front is re-implemented.
The text blocks then run split at K (:mod:`hybrid_vla_ros.model.text`), with a
:class:`~hybrid_vla_ros.model.contract.SplitState` besides the hidden states.

Images go through the family's own processor (:func:`load_processor`), without a video processor. Stored tensor
names map as transformers' ``from_pretrained`` maps them, so legacy and 5.x layouts read the same
(:class:`VLMKeyMap`).
"""
from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from .config import VLM_MODEL_TYPES
from .contract import BlockMaskRule

#: The base model's attribute holding the text model, where it is not ``language_model``.
_TEXT_ATTRIBUTE = {"idefics3": "text_model", "smolvlm": "text_model"}
#: Families whose forward hands its text model masks where some tokens attend both ways, and how it combines
#: them per attention kind (``modeling_gemma3.py``, ``modeling_paligemma.py``, transformers 5.24).
_BLOCK_MASK_RULES = {"gemma3": BlockMaskRule.WINDOW_OF_BLOCKS, "paligemma": BlockMaskRule.EACH_KIND}


class CheckpointLayoutError(ValueError):
    """A stored tensor name transformers would convert (merge or split) rather than rename: not read 1:1."""


@dataclass(frozen=True)
class VLMFamily:
    """transformers' classes of one VLM family (e.g. ``Qwen2_5_VLConfig``, ``Qwen2_5_VLModel``, ...)."""

    model_type: str
    config_class: type
    base_class: type
    generation_class: type
    processor_class: type
    text_attribute: str


@functools.lru_cache(maxsize=None)
def vlm_family(model_type: str) -> VLMFamily:
    """The :class:`VLMFamily` of ``model_type``; ValueError if not in :data:`VLM_MODEL_TYPES`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, MODEL_MAPPING
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    if model_type not in VLM_MODEL_TYPES:
        raise ValueError(f"VLM type {model_type!r} is not supported; this package splits {', '.join(VLM_MODEL_TYPES)}")
    config_class = CONFIG_MAPPING[model_type]
    return VLMFamily(model_type, config_class, MODEL_MAPPING[config_class],
                     MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[config_class], PROCESSOR_MAPPING[config_class],
                     _TEXT_ATTRIBUTE.get(model_type, "language_model"))


# ----------------------------------------------------------------------------------------------- processor

def block_mask_rule(model_type: str) -> BlockMaskRule | None:
    """How the VLM family ``model_type`` combines its both-ways blocks with each attention kind's mask; None for a
    family whose text model's masks are causal (or sliding) only."""
    return _BLOCK_MASK_RULES.get(model_type)


#: The logit factors a causal-LM head may apply (:class:`~.decode.LMHead`).
LOGIT_FACTORS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@functools.lru_cache(maxsize=None)
def logit_factors(model_type: str) -> frozenset:
    """The logit factors (:data:`LOGIT_FACTORS`) the family's ``ForConditionalGeneration.forward`` applies, read
    from its source in transformers (Gemma 3 and PaliGemma soft-cap; Aya Vision applies none of its Cohere 2 text
    model's ``logit_scale``). ValueError for a type not in :data:`VLM_MODEL_TYPES`."""
    source = inspect.getsource(vlm_family(model_type).generation_class.forward)
    return frozenset(name for name in LOGIT_FACTORS if name in source)


def images_only(processor_class: type) -> type:
    """``processor_class`` built without a video processor (those need torchvision; the nodes feed stills)."""

    takes_video = "video_processor" in inspect.signature(processor_class.__init__).parameters

    class ImagesOnly(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            if takes_video:
                kwargs["video_processor"] = None
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template,
                             **kwargs)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{processor_class.__name__}ImagesOnly"
    return ImagesOnly


def load_processor(path: str | Path, model_type: str):
    """The family's processor of the VLM directory ``path``, options from ``processor_config.json`` if present.

    Raises MissingFileError when the image processor or tokenizer files are missing, or when the family's
    processor class needs a library not installed here (Mistral 3's ``PixtralProcessor`` imports torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from .sources import MissingFileError

    path = Path(path)
    family = vlm_family(model_type)
    if not (path / "preprocessor_config.json").is_file():
        raise MissingFileError(f"{path}: no preprocessor_config.json (the VLM's image processor); a VLM directory "
                               "as saved by transformers or downloaded whole has it")
    try:
        images = AutoImageProcessor.from_pretrained(str(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise MissingFileError(f"{path}: cannot load the VLM's image processor or tokenizer ({e})") from None
    except ImportError as e:  # an image processor with a torchvision backend only (Llama 4's)
        raise MissingFileError(_needs_library(path, model_type, "image processor", e)) from None
    options = {}
    doc_file = path / "processor_config.json"
    if doc_file.is_file():
        doc = json.loads(doc_file.read_text())
        accepted = inspect.signature(family.processor_class.__init__).parameters
        options = {k: v for k, v in doc.items() if k in accepted and k not in ("image_processor", "tokenizer",
                                                                               "video_processor", "chat_template")}
    try:
        return images_only(family.processor_class)(image_processor=images, tokenizer=tokenizer, **options)
    except ImportError as e:  # transformers' placeholder for a processor whose module needs a missing library
        what = f"processor ({family.processor_class.__name__})"
        raise MissingFileError(_needs_library(path, model_type, what, e)) from None


def _needs_library(path, model_type: str, what: str, error: ImportError) -> str:
    """The one line for a VLM ``what`` (its processor, image processor) that needs a library not installed."""
    if "orchvision" not in str(error):
        return f"{path}: the {model_type} {what} cannot be imported here ({str(error).strip()})"
    return (f"{path}: the {model_type} {what} needs torchvision, which is not installed here: install the "
            f"torchvision built for this torch ({torch.__version__}) to run this family")


def image_placeholder(processor) -> str:
    """The text standing for one image in the family's prompt (e.g. ``<image>``); the processor expands it."""
    token = getattr(processor, "image_token", None) or "<image>"
    start = getattr(processor, "vision_start_token", None)
    if token == "<|image_pad|>":
        return "<|vision_start|><|image_pad|><|vision_end|>"
    if start:
        return f"{start}{token}{getattr(processor, 'vision_end_token', '')}"
    return token


def default_prompt(processor, cameras: int) -> str:
    """``camera 1 <image> camera 2 <image> ... plan the route ahead``, cameras in ``camera_topics`` order."""
    holder = image_placeholder(processor)
    return " ".join(f"camera {i + 1} {holder}" for i in range(cameras)) + " plan the route ahead"


@dataclass
class VLMInputs:
    """One processed frame: ``input_ids`` (1, T) int64, placeholders expanded, and ``images``, the processor's
    other outputs (``pixel_values``, ``image_grid_thw``, ...; not ``attention_mask``) as the base model takes them."""

    input_ids: torch.Tensor
    images: dict

    @property
    def tokens(self) -> int:
        """T."""
        return int(self.input_ids.shape[-1])

    def to(self, device, dtype) -> "VLMInputs":
        """Floating tensors in ``dtype`` on ``device``, the others on ``device``."""
        moved = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
                 if isinstance(v, torch.Tensor) else v for k, v in self.images.items()}
        return VLMInputs(self.input_ids.to(device), moved)


def run_processor(processor, images: list, prompt: str) -> VLMInputs:
    """Process RGB uint8 (H, W, 3) ``images``, one per prompt placeholder; ValueError when the counts differ."""
    holder = getattr(processor, "image_token", None) or "<image>"
    if prompt.count(holder) != len(images):
        raise ValueError(f"the prompt holds {prompt.count(holder)} image placeholder(s) ({holder!r}) for "
                         f"{len(images)} camera image(s): one per camera, in camera order")
    out = processor(images=list(images), text=prompt, return_tensors="pt")
    ids = out.pop("input_ids")
    out.pop("attention_mask", None)  # one unpadded prompt: no mask (the blocks' masks are causal)
    out.pop("labels", None)  # PaliGemma's training targets (its prompt holds no suffix: all ignored)
    return VLMInputs(ids, dict(out))


# --------------------------------------------------------------------------------------------------- front

class _Captured(Exception):
    def __init__(self, kwargs: dict):
        super().__init__("text model input captured")
        self.kwargs = kwargs


class TextCapture(nn.Module):
    """Stand-in text model: holds ``embed_tokens`` (for ``get_input_embeddings``); called, it stops the forward."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, *args, **kwargs):
        raise _Captured(kwargs)


@dataclass
class FrontOutput:
    """What the base model hands its text model for one frame.

    ``inputs_embeds`` (T, H) in the model dtype; ``position_ids`` (3 or 4, 1, T) int64 (multimodal) or (1, 1, T)
    (PaliGemma's from 1), None for ``arange(T)``;
    ``visual_mask`` (T,) bool and ``deepstack`` (levels, V, H): Qwen3-VL's DeepStack features (added to the
    visual tokens after blocks 0 .. levels-1), else None; ``image_blocks`` (T,) int64: blocks that attend both
    ways (:class:`~.contract.SplitState`), else None; ``cross_states``, ``cross_mask``, ``cross_rows``: what
    Mllama's cross-attention blocks read (:class:`~.contract.SplitState`), else None."""

    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor | None = None
    visual_mask: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None
    image_blocks: torch.Tensor | None = None
    cross_states: torch.Tensor | None = None
    cross_mask: torch.Tensor | None = None
    cross_rows: torch.Tensor | None = None

    def side(self) -> dict:
        """The side tensors present, by their :class:`~.contract.SplitState` field names."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "inputs_embeds" and getattr(self, f.name) is not None}


def build_front(config, family: VLMFamily, embed_tokens: nn.Module) -> nn.Module:
    """The family's base model with a :class:`TextCapture` for its text model.

    Parameters on the meta device (the loader fills them), non-persistent buffers on the CPU."""
    import copy

    from accelerate import init_empty_weights

    config = copy.deepcopy(config)
    text = config.text_config if hasattr(config, "text_config") else config
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[:1])
    with torch.device("cpu"), init_empty_weights(include_buffers=False):
        base = family.base_class(config)
    setattr(base, family.text_attribute, TextCapture(embed_tokens))
    return base


def run_front(front: nn.Module, inputs: VLMInputs) -> FrontOutput:
    """The front's forward on one frame. Where the front builds the text model's attention masks itself, the
    blocks of tokens that attend both ways they come from, from the processor's ``token_type_ids``: Gemma 3's
    images by the family's own ``get_block_sequence_ids_for_mask``, PaliGemma's prefix (images and prompt, type 0)
    as its forward numbers it (0, the rest -1). Positions other than ``arange(T)`` from 1-D position ids
    (PaliGemma counts from 1) come back as (1, 1, T). A front that hands its text model token ids (Mllama) has them
    embedded by the text model's embedding it holds; its cross-attention inputs (vision states, the prepared mask
    and row mask) are kept. RuntimeError if it never calls its text model, or hands it masks of another kind or
    position ids of another form."""
    try:
        front(input_ids=inputs.input_ids, **inputs.images)
    except _Captured as c:
        kw = c.kwargs
    else:
        raise RuntimeError(f"{type(front).__name__}.forward never called its text model")
    blocks = None
    if kw.get("attention_mask") is not None:
        import sys

        rule = block_mask_rule(front.config.model_type)
        own = getattr(sys.modules[type(front).__module__], "get_block_sequence_ids_for_mask", None)
        types = inputs.images.get("token_type_ids")
        if rule is None or types is None or (rule is BlockMaskRule.WINDOW_OF_BLOCKS and own is None):
            raise RuntimeError(f"{type(front).__name__}.forward hands its text model attention masks of its own, "
                               "which this package cannot rebuild on both sides of the split")
        types = types.to(inputs.input_ids.device)
        if rule is BlockMaskRule.WINDOW_OF_BLOCKS:
            blocks = own(types).reshape(-1)
        else:  # PaliGemma's prefix: one block numbered 0
            blocks = torch.where(types == 0, 0, -1).reshape(-1)
    h = kw.get("inputs_embeds")
    if h is None and kw.get("input_ids") is not None:  # the text model embeds (Mllama)
        h = getattr(front, _text_attribute(front)).embed_tokens(kw["input_ids"])
    if h is None or h.dim() != 3 or h.shape[0] != 1:
        raise RuntimeError(f"the VLM front gave inputs_embeds {tuple(h.shape)}, expected (1, T, H)")
    positions = kw.get("position_ids")
    if positions is not None and positions.dim() == 2:  # (1, T): plain positions, arange for a prefill
        steps = torch.arange(h.shape[1], device=positions.device)
        if positions.shape != (1, h.shape[1]) or not torch.equal(positions[0] - positions[0, 0], steps):
            raise RuntimeError("the VLM front gave 2-D position ids that are not consecutive")
        positions = None if int(positions[0, 0]) == 0 else positions.unsqueeze(0)
    deep = kw.get("deepstack_visual_embeds")
    mask = kw.get("visual_pos_masks")
    cross = kw.get("cross_attention_states")
    rows = kw.get("full_text_row_masked_out_mask")
    if cross is not None and (kw.get("cross_attention_mask") is None or rows is None):
        raise RuntimeError(f"{type(front).__name__}.forward hands its text model vision states without the "
                           "prepared cross-attention masks")
    return FrontOutput(h[0], positions, None if mask is None else mask.reshape(-1),
                       None if deep is None or len(deep) == 0 else torch.stack(list(deep)), blocks,
                       cross, None if cross is None else kw["cross_attention_mask"], None if cross is None else rows)


def _text_attribute(front: nn.Module) -> str:
    """The front's attribute holding its :class:`TextCapture`."""
    return next(name for name, child in front.named_children() if isinstance(child, TextCapture))


def deepstack_add(h: torch.Tensor, visual_mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL's DeepStack step: ``features`` (V, H) added to ``h`` (1, T, H) where ``visual_mask`` (T,) is set.

    Calls transformers' ``Qwen3VLTextModel._deepstack_process`` unbound (it uses no model state)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    return Qwen3VLTextModel._deepstack_process(None, h, visual_mask.reshape(h.shape[:-1]), features)


# ---------------------------------------------------------------------------------------------- key names

class VLMKeyMap:
    """Stored tensor names -> canonical names, after transformers' ``from_pretrained`` renaming.

    The text model's ``embed_tokens`` / ``layers.{i}`` / ``norm`` keep those names, the rest of the base model
    becomes ``vlm.<rest>``, the LM head is dropped. ``canonical`` raises CheckpointLayoutError for a name
    transformers would convert rather than rename (read through a converting source, it never sees one)."""

    def __init__(self, config, family: VLMFamily):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        with torch.device("meta"):
            model = family.generation_class(_small_copy(config))
        transforms = get_model_conversion_mapping(model)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        #: transformers' converters of this family (a MoE text model's per-expert tensors merged): a
        #: :class:`~.weight_conversion.ConvertedSource` runs them before this map names the merged tensors.
        self.converters = list(self._converters)
        self.shell = model  # the one-text-block model on the meta device (its parameters' shapes)
        self._prefix = model.base_model_prefix
        self._meta = _AnyBlock(model.state_dict())
        text = re.escape(family.text_attribute)
        self._text = re.compile(rf"{re.escape(self._prefix)}\.{text}\.(embed_tokens\..+|layers\.\d+\..+|norm\..+)")
        self._rest = re.compile(rf"{re.escape(self._prefix)}\.(.+)")
        self.name = f"transformers {family.generation_class.__name__}"

    def renaming_only(self) -> "VLMKeyMap":
        """This map without the converters' check: for names a converter already produced (a converter may keep
        its tensor's name, e.g. Qwen3-VL-MoE's transposed experts)."""
        import copy

        other = copy.copy(self)
        other._converters = []
        return other

    def canonical(self, stored: str) -> str | None:
        from transformers.core_model_loading import rename_source_key

        if stored.endswith("rotary_emb.inv_freq"):
            return None
        name, converter = rename_source_key(stored, self._renamings, self._converters, self._prefix, self._meta)
        if converter is not None:
            raise CheckpointLayoutError(f"stored tensor {stored!r} is converted by transformers on load "
                                        f"({converter}), not renamed: this package reads tensors 1:1")
        if name == "lm_head.weight":  # read by a decode only
            return name
        if name.startswith("lm_head."):
            return None
        m = self._text.fullmatch(name)
        if m:
            return m.group(1)
        m = self._rest.fullmatch(name)
        if m:
            return f"vlm.{m.group(1)}"
        return None


class _AnyBlock(dict):
    """The one-text-block model's state-dict names; a lookup of block i's name answers for block 0's."""

    def __init__(self, state: dict):
        super().__init__({k: True for k in state})

    def get(self, key, default=None):
        return super().get(re.sub(r"\.layers\.\d+\.", ".layers.0.", key), default)


def _small_copy(config):
    """A deep copy of a VLM config with one text block."""
    import copy

    config = copy.deepcopy(config)
    text = config.text_config
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[:1])
    return config


def frame_inputs(processor, cfg, images: list) -> VLMInputs:
    """One camera frame through the processor with ``cfg.prompt``.

    ``images``: RGB uint8 (H, W, 3) of ``cfg.camera_size``, one per camera (resized by
    :func:`~hybrid_vla_ros.vehicle.image.resize_rgb`). A ``VLAConfig`` gets ``cfg.planning_token_id`` appended
    once per query token (at least once), unless it decodes (``cfg.decode``). Raises ValueError for a wrong camera
    count, image size or prompt."""
    from .config import VLAConfig

    if len(images) != cfg.cameras:
        raise ValueError(f"frame has {len(images)} cameras, the model takes {cfg.cameras}")
    w, h = cfg.camera_size
    wrong = [i for i, im in enumerate(images) if tuple(im.shape[:2]) != (h, w)]
    if wrong:
        raise ValueError(f"camera image(s) {wrong} are not {w} x {h} px (camera_size): resize them first (T, and "
                         "the ring's slot, are for that size)")
    inputs = run_processor(processor, list(images), cfg.prompt)
    if isinstance(cfg, VLAConfig) and not cfg.decode:  # the planning token, or one copy per query token (their
        # rows replaced later); a decoding model places it after the decode
        for _ in range(max(1, cfg.query_count)):
            inputs = with_token(inputs, int(cfg.planning_token_id))
    return inputs


def with_token(inputs: VLMInputs, token_id: int) -> VLMInputs:
    """``inputs`` with a text token appended; per-token outputs (``mm_token_type_ids``, ...) get a 0 for it, and
    Mllama's ``cross_attention_mask`` (1, T, images, tiles) a copy of the last token's row (the last image's tiles
    stay seen to the end of the prompt, as its processor marks the tokens after it)."""
    ids = torch.cat([inputs.input_ids, torch.tensor([[token_id]], dtype=inputs.input_ids.dtype)], dim=1)
    images = dict(inputs.images)
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in images and images[key].shape[-1] == inputs.tokens:
            images[key] = torch.cat([images[key], torch.zeros_like(images[key][..., :1])], dim=-1)
    cross = images.get("cross_attention_mask")
    if cross is not None and cross.dim() == 4 and cross.shape[1] == inputs.tokens:
        images["cross_attention_mask"] = torch.cat([cross, cross[:, -1:]], dim=1)
    return VLMInputs(ids, images)
