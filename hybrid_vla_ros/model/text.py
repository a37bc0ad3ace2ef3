"""The decoder-block stack of any transformers causal LM built as ``embed_tokens -> layers -> norm``.

A *text family* is a transformers ``model_type`` whose base model (``LlamaModel``, ``Qwen3Model``,
``Gemma3TextModel``, ...) holds a token embedding, a plain ``ModuleList`` of decoder blocks and a final norm, with
a rotary embedding computed once per forward. The blocks, the norm and the rotary embedding are transformers'
own classes of that family, found through transformers' own registries (``CONFIG_MAPPING``, ``MODEL_MAPPING``)
and built from the checkpoint's config; this package never re-implements a block's forward. What it does itself
is the loop the family's base model runs around the blocks (``<Family>Model.forward`` in
``modeling_<family>.py``, transformers 5.24), step for step:

* position ids ``arange(T)`` (one prefill from position 0, no cache);
* one attention mask per *attention kind*, each from transformers' ``masking_utils``: ``full_attention`` ->
  ``create_causal_mask``, ``sliding_attention`` -> ``create_sliding_window_causal_mask``. A block's kind is
  ``config.layer_types[i]`` where the config has that list (Qwen2, Qwen3, Gemma 2 / 3), else
  ``sliding_attention`` for every block when ``config.sliding_window`` is set (Mistral, Phi-3), else
  ``full_attention`` (LLaMA). With SDPA and no padding the causal mask is ``None`` (SDPA's ``is_causal``); a
  sliding window no shorter than T gives the same; a shorter window gives a boolean band mask;
* the rotary (cos, sin) once per forward, per attention kind where the family's rotary takes one (Gemma 3:
  local and global bases), else one table for every block;
* Gemma's token embeddings are scaled by sqrt(H) in the embedding module (``Gemma3TextScaledWordEmbedding``):
  :class:`ScaledEmbedding` does the same multiply (the scale as a float32 tensor cast to the weight dtype).

Every one of these is a function of T and the config alone, so both sides of the split compute it and nothing
but the hidden states needs to cross. What cannot be split exactly is refused at once
(:func:`check_splittable`): bidirectional attention overlays (Gemma 3's ``use_bidirectional_attention``), which
make a token's state depend on later tokens through a mask this loop does not build.
"""
from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .config import LLM_TYPES

#: transformers ``model_type`` of the language models whose decoder blocks this package runs (tested families).
TEXT_MODEL_TYPES = LLM_TYPES
#: The causal LM class transformers' ``save_pretrained`` names in ``architectures``, by model_type.
CAUSAL_LM_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class TextFamily:
    """transformers' classes of one text family (see the module docstring).

    ``config_class`` (e.g. ``Qwen3Config``), ``base_class`` (``Qwen3Model``), ``causal_lm_class``
    (``Qwen3ForCausalLM``; None for a VLM's text model, e.g. ``qwen2_5_vl_text``), ``block_class``
    (``Qwen3DecoderLayer``, built ``block_class(config, layer_idx)``),
    ``norm_class`` (``Qwen3RMSNorm``, built ``norm_class(H, eps=rms_norm_eps)``), ``rotary_class``
    (``Qwen3RotaryEmbedding``, built ``rotary_class(config)``); ``rotary_per_kind``: the rotary's forward takes
    the attention kind (Gemma 3).
    """

    model_type: str
    config_class: type
    base_class: type
    causal_lm_class: type
    block_class: type
    norm_class: type
    rotary_class: type
    rotary_per_kind: bool


def check_model_type(model_type) -> None:
    """Raise ValueError unless ``model_type`` is one of :data:`TEXT_MODEL_TYPES`."""
    if model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"language model type {model_type!r} is not supported; this package splits "
                         f"{', '.join(TEXT_MODEL_TYPES)} (transformers {', '.join(CAUSAL_LM_ARCHITECTURES.values())})")


@functools.lru_cache(maxsize=None)
def text_family(model_type: str) -> TextFamily:
    """The :class:`TextFamily` of a supported ``model_type``, from transformers' registries: the base model's
    ``_no_split_modules`` names its decoder block class; a one-block instance of the base model on the meta
    device (no memory) gives its norm and rotary classes. Raises ValueError for an unsupported model_type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    check_model_type(model_type)
    config_class = CONFIG_MAPPING[model_type]
    base_class = MODEL_MAPPING[config_class]
    config = _one_block_config(config_class())
    with torch.device("meta"):
        shell = base_class(config)
    block_class = type(shell.layers[0])
    if block_class.__name__ not in (base_class._no_split_modules or []):
        raise ValueError(f"transformers {base_class.__name__}'s blocks are {block_class.__name__}, not the "
                         f"decoder block it declares ({base_class._no_split_modules}): not a plain block list")
    rotary_class = type(shell.rotary_emb)
    per_kind = _rotary_per_kind(rotary_class)
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[config_class] if config_class in MODEL_FOR_CAUSAL_LM_MAPPING else None
    return TextFamily(model_type, config_class, base_class, causal_lm, block_class, type(shell.norm), rotary_class,
                      per_kind)


def _one_block_config(config):
    config = copy.deepcopy(config)
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:1])
    config.num_hidden_layers = 1
    return config


def attention_implementation(family: TextFamily) -> str:
    """The attention implementation transformers itself picks for the family when none is asked for: ``sdpa``
    where the base model supports it (``_supports_sdpa``), else ``eager`` (Gemma 2: its logit soft-capping is
    in the eager path only). The masks :func:`block_inputs` builds follow it (``None`` for causal SDPA, a mask
    tensor for eager)."""
    return "sdpa" if getattr(family.base_class, "_supports_sdpa", False) else "eager"


def text_config(llm: dict):
    """The transformers config (``Qwen3Config``, ``Gemma3TextConfig``, ...) of an ``llm`` dict (its
    ``model_type`` and config kwargs, as ``config.json`` holds them), its attention implementation pinned to
    :func:`attention_implementation`. Raises ValueError for an unsupported model_type, or a configuration
    :func:`check_splittable` refuses."""
    family = text_family(llm.get("model_type", "llama"))  # this package's presets leave LLaMA implicit
    config = family.config_class(**{k: v for k, v in llm.items() if k != "model_type"})
    config._attn_implementation = attention_implementation(family)
    check_splittable(config)
    return config


def check_splittable(config) -> None:
    """Raise ValueError when the configuration cannot be split exactly by this package's loop, naming the
    feature and what to do: bidirectional attention (Gemma 3 ``use_bidirectional_attention``)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{config.model_type}: use_bidirectional_attention is set (tokens attend to later tokens "
                         "through a mask overlay): not a causal language model, which is what the split runs; "
                         "use a causal checkpoint")


def attention_kinds(config) -> list[str]:
    """The attention kind of each decoder block (module docstring): ``full_attention`` or
    ``sliding_attention``, length L."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types:
        return [str(t) for t in types[:n]]
    return [SLIDING if getattr(config, "sliding_window", None) is not None else FULL] * n


def make_norm(family: TextFamily, config) -> nn.Module:
    """The family's final norm, (H,) gains, eps from the config."""
    return family.norm_class(config.hidden_size, eps=config.rms_norm_eps)


def make_rotary(family: TextFamily, config) -> nn.Module:
    """The family's rotary embedding module (no weights; its inverse frequencies are buffers)."""
    return family.rotary_class(config)


def make_blocks(family: TextFamily, config, start: int, stop: int) -> nn.ModuleList:
    """Decoder blocks [start, stop), transformers' own class, each with its global ``layer_idx``."""
    return nn.ModuleList(family.block_class(config, i) for i in range(start, stop))


def embed_scale(family: TextFamily, config) -> float | None:
    """The factor the family's base model multiplies token embeddings by (Gemma: sqrt(H)), None when it does
    not: read off the family's own embedding module (``scalar_embed_scale``) of a one-block meta instance."""
    small = _one_block_config(config)
    with torch.device("meta"):
        shell = family.base_class(small)
    scale = getattr(shell.embed_tokens, "scalar_embed_scale", None)
    return None if scale is None else float(scale)


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times a constant (Gemma's ``*ScaledWordEmbedding``: ``embedding(ids) *
    tensor(scale).to(weight.dtype)``). ``weight`` (vocab, H) keeps nn.Embedding's name."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, H) in the weight dtype."""
        factor = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(input_ids) * factor


def make_embedding(family: TextFamily, config) -> nn.Module:
    """The token embedding (vocab, H) as the family's base model embeds (scaled for Gemma)."""
    scale = embed_scale(family, config)
    if scale is None:
        return nn.Embedding(config.vocab_size, config.hidden_size)
    return ScaledEmbedding(config.vocab_size, config.hidden_size, scale)


@dataclass
class BlockInputs:
    """What every decoder block of one forward takes besides the hidden states, by attention kind:
    ``position_ids`` (1, T) int64 (None for a VLM's multimodal positions: its blocks take none), ``masks``
    (kind -> None or a bool / additive mask), ``cos_sin`` (kind -> (cos, sin), each (1, T, head_dim) in the
    hidden states' dtype)."""

    position_ids: torch.Tensor
    masks: dict
    cos_sin: dict

    def for_block(self, block: nn.Module, kind: str) -> dict:
        """Keyword arguments of ``block(x, **kwargs)``."""
        return {"attention_mask": self.masks[kind], "position_ids": self.position_ids,
                "position_embeddings": self.cos_sin[kind]}


@functools.lru_cache(maxsize=None)
def _rotary_per_kind(rotary_class: type) -> bool:
    """Whether a rotary class's forward takes the attention kind (Gemma 3), looked up once per class: the
    blocks run it every frame."""
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def split_positions(position_ids: torch.Tensor | None, x: torch.Tensor) -> tuple:
    """(rotary position ids, text position ids) for hidden states ``x`` (B, T, H).

    ``position_ids`` None: a text model's one prefill, ``arange(T)`` (1, T) for both. Multimodal rotary
    positions (Qwen2-VL / 2.5-VL / 3-VL, int64, as the VLM computed them from the image grid): (3, B, T) rows
    temporal / height / width, the text positions None; (4, B, T): row 0 the text positions, rows 1.. the
    rotary ones -- the rule of ``Qwen2_5_VLTextModel.forward`` / ``Qwen3VLTextModel.forward`` (transformers
    5.24). Raises ValueError for another shape."""
    if position_ids is None:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return positions, positions
    if position_ids.dim() != 3 or position_ids.shape[0] not in (3, 4) or position_ids.shape[-1] != x.shape[1]:
        raise ValueError(f"multimodal position ids must be (3 or 4, B, T={x.shape[1]}), got "
                         f"{tuple(position_ids.shape)}")
    position_ids = position_ids.to(x.device)
    if position_ids.shape[0] == 4:
        return position_ids[1:], position_ids[0]
    return position_ids, None


def block_inputs(config, rotary: nn.Module, x: torch.Tensor, kinds: set[str],
                 position_ids: torch.Tensor | None = None) -> BlockInputs:
    """Position ids, masks and rotary tables for hidden states ``x`` (B, T, H) and the attention ``kinds`` the
    blocks to run use, as the family's base model computes them (module docstring); ``position_ids``: None for
    a text model's ``arange(T)``, or a VLM's multimodal rotary positions (:func:`split_positions`)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    rotary_positions, text_positions = split_positions(position_ids, x)
    makers = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
    masks = {}
    for kind in kinds:
        if kind not in makers:
            raise ValueError(f"attention kind {kind!r} is not supported (only {FULL}, {SLIDING})")
        if x.is_meta:  # FLOP counting on the meta device (no values): transformers' mask functions read values
            masks[kind] = None
            continue
        masks[kind] = makers[kind](config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                   position_ids=text_positions)
    if _rotary_per_kind(type(rotary)):
        cos_sin = {kind: rotary(x, rotary_positions, kind) for kind in kinds}
    else:
        shared = rotary(x, rotary_positions)
        cos_sin = {kind: shared for kind in kinds}
    return BlockInputs(text_positions, masks, cos_sin)
