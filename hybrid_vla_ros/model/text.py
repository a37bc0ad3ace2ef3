"""The decoder-block stack of any transformers causal LM built as ``embed_tokens -> layers -> norm``.

A *text family* is a transformers ``model_type`` whose base model (``LlamaModel``, ``Qwen3MoeModel``, ...) holds a
token embedding, a plain ``ModuleList`` of decoder blocks and a final norm, with one rotary embedding per forward.
Blocks, norm and rotary are transformers' own classes, found through its registries; this package only runs the
loop of ``<Family>Model.forward`` (``modeling_<family>.py``, transformers 5.24) around them:

* position ids ``arange(T)`` (a prefill from position 0; a decode continues after the tokens its KV cache holds);
* one mask per *attention kind* from ``masking_utils`` (``full_attention`` -> ``create_causal_mask``,
  ``sliding_attention`` -> ``create_sliding_window_causal_mask``, ``chunked_attention`` ->
  ``create_chunked_causal_mask``). A block's kind is ``config.layer_types[i]`` (Qwen2/3, Gemma 2/3, Llama 4), else
  sliding when ``config.sliding_window`` is set (Mistral, Phi-3), else full (LLaMA); Mllama's cross-attention
  blocks (:data:`CROSS`) read what its VLM's front prepared instead. With SDPA the causal mask is ``None``, as is a
  window no shorter than T;
* the rotary (cos, sin) once per forward, per kind where the rotary takes one (Gemma 3), else shared;
* Gemma's sqrt(H) embedding scale (:class:`ScaledEmbedding`).

All of these depend on T and the config only, so both sides of the split compute them and only hidden states
cross. What a block does inside (its attention, q/k norms, NoPE layers, mixture-of-experts routing, attention
sinks, latent attention) is transformers' code and needs nothing here.

Which families: any ``model_type`` transformers knows whose base model has exactly that structure
(:func:`text_family` checks it and names what differs). The families of :data:`TESTED_TEXT_TYPES` are proven
equal to transformers' forward by this package's tests; any other is proven once per process and configuration by
:func:`~.family_check.check_forward_matches` (a small random copy of the configuration run both ways, this
package's loop split in two against the family's own forward), so a family whose forward does more than the
loop is refused, naming the difference, instead of split wrong. Families whose blocks are not all the standard
attention block, or of other kinds (convolution, state-space, linear attention: LFM2, Falcon-H1, Jamba, Qwen3-Next)
are *captured* (:attr:`TextFamily.captured`): each block runs with what the family's own forward hands it
(:func:`captured_block_inputs`), a prefill only. Refused by structure: bidirectional overlays
(:func:`check_splittable`), base models with other parts than embedding, blocks, one final norm and a rotary
embedding, blocks without a layer index or that read another block's input.
"""
from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

#: transformers ``model_type`` of the language models this package's tests prove split exactly (the text models of
#: the Qwen VLMs among them: multimodal rotary positions; Qwen3-VL: DeepStack features); any other that
#: :func:`text_family` accepts is checked by :func:`~.family_check.check_forward_matches` when opened.
TESTED_TEXT_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3",
                     "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
#: The causal LM class transformers' ``save_pretrained`` names in ``architectures``, by tested model_type.
CAUSAL_LM_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
#: The attention kinds the loop builds masks for (transformers' ``layer_types`` names): causal, a causal window of
#: ``sliding_window`` keys, causal within chunks of ``attention_chunk_size`` tokens (Llama 4).
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)
#: The kind of a cross-attention block (the indices a config lists in ``cross_attention_layers``, Mllama): it reads
#: the vision states with the masks its VLM's front prepared (:class:`~.contract.SplitState`), not a causal mask.
CROSS = "cross_attention"
#: The children a splittable base model has, and nothing else (``<Family>Model.__init__``).
BASE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


@dataclass(frozen=True)
class TextFamily:
    """transformers' classes of one text family (e.g. ``Qwen3Config``, ``Qwen3Model``, ``Qwen3DecoderLayer``).

    ``causal_lm_class`` is None for a VLM's text model (``qwen2_5_vl_text``); ``rotary_per_kind``: the rotary's
    forward takes the attention kind (Gemma 3); ``experts_implementation``: what transformers' model init picks for
    the family's experts (``grouped_mm`` where it can, as ``from_pretrained`` runs them; else ``eager``).
    """

    model_type: str
    config_class: type
    base_class: type
    causal_lm_class: type
    block_class: type
    norm_class: type
    rotary_class: type
    rotary_per_kind: bool
    experts_implementation: str | None = None
    #: The block class of the layers its config lists in ``cross_attention_layers`` (Mllama), else None.
    cross_block_class: type | None = None
    #: The base model's attribute holding its final norm (``norm``; LFM2's ``embedding_norm``, Falcon-H1's and
    #: Jamba's ``final_layernorm``).
    norm_attribute: str = "norm"
    #: Hybrid blocks (convolution, state-space or linear-attention layers, :func:`captured_block_inputs`): what each
    #: block is handed is recorded from the family's own forward instead of built here; no decode across the split.
    captured: bool = False


@functools.lru_cache(maxsize=None)
def text_family(model_type: str) -> TextFamily:
    """The :class:`TextFamily` of ``model_type``, read off a one-block meta-device base model.

    Raises ValueError naming what makes it unsplittable here: unknown to the installed transformers, a base model
    with other parts than :data:`BASE_PARTS` (a hybrid's extra norms, a vision tower), blocks other than
    ``_no_split_modules`` declares or without ``self_attn.layer_idx``, a block forward that does not take rotary
    tables, a mask and a cache (as ``LlamaDecoderLayer.forward``)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    where = f"language model type {model_type!r} (transformers {transformers.__version__})"
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: not a model type the installed transformers knows; this package splits the "
                         f"decoders transformers has (tested: {', '.join(TESTED_TEXT_TYPES)})")
    config_class = CONFIG_MAPPING[model_type]
    base_class = MODEL_MAPPING[config_class] if config_class in MODEL_MAPPING else _unmapped_base(config_class)
    if base_class is None:
        raise ValueError(f"{where}: transformers has no base model for it")
    try:
        config = _one_block_config(config_class())
        with torch.device("meta"):
            shell = base_class(config)
    except Exception as e:  # noqa: BLE001 - any family's constructor: its error is the reason
        raise ValueError(f"{where}: its base model {base_class.__name__} cannot be built from its default "
                         f"configuration ({type(e).__name__}: {e}); not a plain decoder") from None
    parts = [name for name, _ in shell.named_children()]
    others = [p for p in parts if p not in ("embed_tokens", "layers", "rotary_emb")]
    norms = [p for p in others if "norm" in p.lower() or "Norm" in type(getattr(shell, p)).__name__]
    extra = [p for p in others if p not in norms[:1]]
    lacking = [p for p in ("embed_tokens", "layers") if p not in parts] + ([] if norms else ["a final norm"])
    if extra or lacking:
        raise ValueError(f"{where}: its base model {base_class.__name__} has parts {parts}, not "
                         f"{list(BASE_PARTS)} (" + "; ".join(
                             ([f"extra: {extra}"] if extra else []) + ([f"lacking: {lacking}"] if lacking else []))
                         + "): its forward is not embed -> decoder blocks -> norm, which is what the split runs")
    if not isinstance(shell.layers, nn.ModuleList) or len(shell.layers) != 1:
        raise ValueError(f"{where}: {base_class.__name__}.layers is not a plain list of decoder blocks")
    block_class = type(shell.layers[0])
    if block_class.__name__ not in (base_class._no_split_modules or []):
        raise ValueError(f"transformers {base_class.__name__}'s blocks are {block_class.__name__}, not the "
                         f"decoder block it declares ({base_class._no_split_modules}): not a plain block list")
    params = inspect.signature(block_class.forward).parameters
    needed = {"hidden_states", "attention_mask", "position_embeddings"}
    standard = (getattr(getattr(shell.layers[0], "self_attn", None), "layer_idx", None) == 0
                and needed <= set(params) and bool({"cache", "past_key_values"} & set(params))
                and "rotary_emb" in parts and norms[0] == "norm")
    hybrid = sorted(set(attention_kinds(config_class())) - set(ATTENTION_KINDS) - {CROSS})
    if not standard or hybrid:
        _check_hybrid(where, base_class, config_class, hybrid)
    rotary_class = type(shell.rotary_emb) if "rotary_emb" in parts else None
    per_kind = rotary_class is not None and _rotary_per_kind(rotary_class)
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING[config_class] if config_class in MODEL_FOR_CAUSAL_LM_MAPPING else None
    return TextFamily(model_type, config_class, base_class, causal_lm, block_class, type(getattr(shell, norms[0])),
                      rotary_class, per_kind, getattr(shell.config, "_experts_implementation", None),
                      _cross_block_class(base_class, config, where), norms[0], not standard or bool(hybrid))


def _check_hybrid(where: str, base_class: type, config_class: type, kinds: list[str]) -> None:
    """Raise ValueError unless a family whose blocks are not all the standard attention block (:attr:`TextFamily.
    captured`) has, in its default configuration, only blocks it declares, each with a layer index."""
    try:
        with torch.device("meta"):
            shell = base_class(config_class())
    except Exception as e:  # noqa: BLE001 - any family's constructor
        raise ValueError(f"{where}: its base model {base_class.__name__} cannot be built from its default "
                         f"configuration ({type(e).__name__}: {e})") from None
    declared = base_class._no_split_modules or []
    for i, block in enumerate(shell.layers):
        if type(block).__name__ not in declared:
            raise ValueError(f"{where}: its block {i} is {type(block).__name__}, not a decoder block it declares "
                             f"({declared}): not a plain block list")
        try:
            index = block_index(block)
        except ValueError:
            index = None
        if index != i:
            raise ValueError(f"{where}: its block {i} ({type(block).__name__}) has no layer index (layer_idx) of its "
                             "own: the split needs each block's index")
        if "original_hidden_states" in inspect.signature(type(block).forward).parameters:
            raise ValueError(f"{where}: its block {type(block).__name__} reads original_hidden_states (the "
                             "embeddings block 0 was given, Zamba's shared blocks): a block that reads another "
                             "block's input, which the suffix does not have; not split")


def _unmapped_base(config_class: type) -> type | None:
    """The base model of a text config transformers' auto classes do not map (Mllama's ``MllamaTextModel``): the one
    class of the family's modeling module named ``*TextModel`` whose ``config_class`` it is; None if not one."""
    import importlib

    module_name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    found = [c for name, c in vars(module).items() if isinstance(c, type) and name.endswith("TextModel")
             and getattr(c, "config_class", None) is config_class]
    return found[0] if len(found) == 1 else None


def _cross_block_class(base_class: type, config, where: str) -> type | None:
    """The block class a base model builds at the indices its config lists in ``cross_attention_layers``: read off a
    two-block meta shell whose block 1 is one (None when the config has no such list). Raises ValueError when that
    block is not a declared decoder block with a ``layer_idx``."""
    if getattr(config, "cross_attention_layers", None) is None:
        return None
    two = copy.deepcopy(config)
    two.num_hidden_layers, two.cross_attention_layers = 2, [1]
    with torch.device("meta"):
        block = base_class(two).layers[1]
    if type(block).__name__ not in (base_class._no_split_modules or []) or getattr(block, "layer_idx", None) != 1:
        raise ValueError(f"{where}: its cross-attention block {type(block).__name__} is not a declared decoder block "
                         "with a layer_idx")
    return type(block)


def _one_block_config(config):
    config = copy.deepcopy(config)
    if getattr(config, "layer_types", None):
        try:
            config.layer_types = list(config.layer_types[:1])
        except AttributeError:  # derived from other fields (a hybrid's block pattern): left as it is
            pass
    config.num_hidden_layers = 1
    return config


def attention_implementation(family: TextFamily) -> str:
    """transformers' default for the family: ``sdpa`` where supported, else ``eager`` (Gemma 2's soft-capping)."""
    return "sdpa" if getattr(family.base_class, "_supports_sdpa", False) else "eager"


def text_config(llm: dict, both_ways: bool = False):
    """The transformers config of an ``llm`` dict (``model_type`` and config kwargs, as in ``config.json``).

    Attention implementation pinned to :func:`attention_implementation`, experts to the family's
    ``experts_implementation``. ``both_ways``: as :func:`check_splittable`'s. Raises ValueError for an unsupported
    model_type or a configuration :func:`check_splittable` refuses."""
    from transformers import PretrainedConfig

    family = text_family(llm.get("model_type", "llama"))  # this package's presets leave LLaMA implicit
    llm = PretrainedConfig._decode_special_floats(llm)  # as config_dict encodes them ({"__float__": "Infinity"})
    config = family.config_class(**{k: v for k, v in llm.items() if k != "model_type"})
    config._attn_implementation = attention_implementation(family)
    if family.experts_implementation:  # MoE blocks run their experts as from_pretrained's model does
        config._experts_implementation = family.experts_implementation
    check_splittable(config, both_ways)
    return config


def check_splittable(config, both_ways: bool = False) -> None:
    """Raise ValueError for what this loop cannot split exactly by structure: ``use_bidirectional_attention``
    (Gemma 3's encoder use: every token attends to later ones), unless ``both_ways`` (the text model of a VLM whose
    forward builds its masks with blocks that attend both ways, :class:`~.contract.BlockMaskRule`: PaliGemma sets
    the flag and hands explicit masks, which both sides rebuild); attention kinds other than :data:`ATTENTION_KINDS`
    and :data:`CROSS` in a family that is not :attr:`~TextFamily.captured` (a family outside
    :data:`TESTED_TEXT_TYPES` is then proven by :func:`~.family_check.check_forward_matches`)."""
    if getattr(config, "use_bidirectional_attention", False) and not both_ways:
        raise ValueError(f"{config.model_type}: use_bidirectional_attention is set (tokens attend to later tokens "
                         "through a mask overlay): not a causal language model, which is what the split runs; "
                         "use a causal checkpoint")
    other = sorted(set(attention_kinds(config)) - set(ATTENTION_KINDS) - {CROSS})
    if other and not text_family(config.model_type).captured:
        raise ValueError(f"{config.model_type}: its layer_types include {other}, kinds its family's default "
                         f"configuration does not have (the loop builds masks for {', '.join(ATTENTION_KINDS)} blocks "
                         "only in such a family): not split")


def attention_kinds(config) -> list[str]:
    """The attention kind of each of the L decoder blocks (module docstring); :data:`CROSS` at the indices the
    config lists in ``cross_attention_layers``."""
    n = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types:
        kinds = [str(t) for t in types[:n]]
    else:
        kinds = [SLIDING if getattr(config, "sliding_window", None) is not None else FULL] * n
    for i in getattr(config, "cross_attention_layers", None) or ():
        if 0 <= int(i) < n:
            kinds[int(i)] = CROSS
    return kinds


def block_index(block: nn.Module) -> int:
    """A decoder block's global layer index: its ``layer_idx``, or that of the first of its direct parts that has
    one (its attention, convolution or state-space mixer). Raises ValueError when none has."""
    for part in (block, *block.children()):
        index = getattr(part, "layer_idx", None)
        if isinstance(index, int):
            return index
    raise ValueError(f"{type(block).__name__} has no layer_idx, nor any of its parts")


#: Where a family's config keeps its norms' epsilon, in the order looked for.
_EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon", "norm_epsilon")


def make_norm(family: TextFamily, config) -> nn.Module:
    """The family's final norm, (H,) gains, eps from the config (:data:`_EPS_KEYS`). Raises ValueError when the
    config has none of them."""
    eps = next((getattr(config, k) for k in _EPS_KEYS if getattr(config, k, None) is not None), None)
    if eps is None:
        raise ValueError(f"{config.model_type}: its config has no norm epsilon ({', '.join(_EPS_KEYS)})")
    return family.norm_class(config.hidden_size, eps=eps)


def make_rotary(family: TextFamily, config) -> nn.Module:
    """The family's rotary embedding module (no weights; its inverse frequencies are buffers); a
    :class:`NoRotary` for a family without one (Jamba)."""
    return family.rotary_class(config) if family.rotary_class is not None else NoRotary(config)


class NoRotary(nn.Module):
    """Stands for the rotary embedding of a family that has none (its blocks take no rotary tables): holds the text
    config, as a rotary embedding does; called, it returns None."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, x, position_ids=None, *args):
        return None


def make_blocks(family: TextFamily, config, start: int, stop: int) -> nn.ModuleList:
    """Decoder blocks [start, stop), transformers' own class (the cross-attention class at the indices the config
    lists, Mllama; for a hybrid family the class its base model builds at each index), each with its global
    ``layer_idx``."""
    if family.captured:
        from accelerate import init_empty_weights

        # one base model, its parameters on the meta device and its buffers real: the block classes and the buffers
        with torch.device("cpu"), init_empty_weights(include_buffers=False):
            base = family.base_class(config)
        blocks = nn.ModuleList(type(base.layers[i])(config, i) for i in range(start, stop))
        _adopt_base_buffers(base, blocks)
        return blocks
    cross = {int(i) for i in getattr(config, "cross_attention_layers", None) or ()}
    return nn.ModuleList((family.cross_block_class if i in cross and family.cross_block_class else family.block_class)
                         (config, i) for i in range(start, stop))


def _adopt_base_buffers(base: nn.Module, blocks: nn.ModuleList) -> None:
    """Give each block the non-persistent buffers its base model's ``__init__`` registers on it (Falcon-H1's
    ``mup_vector``, computed from the config), on the CPU: read off ``base``, the family's base model built with its
    parameters on the meta device (accelerate's ``init_empty_weights``) and its buffers real."""
    for block in blocks:
        own = dict(block.named_modules())
        for name, buf in base.layers[block_index(block)].named_buffers():
            owner, _, leaf = name.rpartition(".")
            part = own.get(owner)
            if part is None or buf.is_meta:
                continue
            held = part._buffers.get(leaf)
            if held is None or held.is_meta:
                part.register_buffer(leaf, buf.clone(), persistent=False)
                part.__dict__.setdefault("_adopted_buffers", set()).add(leaf)


def adopted_buffers(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(part, buffer name) of every buffer :func:`_adopt_base_buffers` gave a block inside ``module``."""
    return [(part, name) for part in module.modules() for name in sorted(part.__dict__.get("_adopted_buffers", ()))
            if name in part._buffers]


def embed_scale(family: TextFamily, config) -> float | None:
    """The family's token-embedding factor, or None: Gemma's sqrt(H) (its embedding's ``scalar_embed_scale``),
    Granite's and Falcon-H1's ``embedding_multiplier`` (their base model's, applied to the embedded token ids)."""
    return _embedding_facts(family, config)[1]


def _embedding_facts(family: TextFamily, config) -> tuple[int, float | None]:
    """(rows of the family's token embedding, its factor: :func:`embed_scale`), read off a one-block meta shell."""
    with torch.device("meta"):
        shell = family.base_class(_one_block_config(config))
    scale = getattr(shell.embed_tokens, "scalar_embed_scale", None)
    if scale is None:
        scale = getattr(shell, "embedding_multiplier", None)
    return int(shell.embed_tokens.num_embeddings), None if scale is None else float(scale)


class ScaledEmbedding(nn.Embedding):
    """Gemma's ``*ScaledWordEmbedding``: ``embedding(ids) * tensor(scale).to(weight.dtype)``; ``weight`` (vocab, H)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) int64 -> (T, H) in the weight dtype."""
        factor = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(input_ids) * factor


def make_embedding(family: TextFamily, config) -> nn.Module:
    """The token embedding (rows, H) as the family's base model embeds (scaled for Gemma); rows as its base model
    sizes them (the vocabulary, Mllama's plus 8)."""
    scale = embed_scale(family, config)  # its own call: the factor is what a family check varies
    rows = _embedding_facts(family, config)[0]
    if scale is None:
        return nn.Embedding(rows, config.hidden_size)
    return ScaledEmbedding(rows, config.hidden_size, scale)


@dataclass
class BlockInputs:
    """A forward's block inputs besides the hidden states.

    ``position_ids`` (1, T) int64 (None for a VLM's multimodal positions), ``masks`` (kind -> None or a bool /
    additive mask), ``cos_sin`` (kind -> (cos, sin), each (1, T, head_dim) in the hidden states' dtype)."""

    position_ids: torch.Tensor
    masks: dict
    cos_sin: dict
    cache: object = None
    #: A cross-attention block's inputs (``cross_attention_states``, ``cross_attention_mask``,
    #: ``full_text_row_masked_out_mask``: :class:`~.contract.SplitState`'s cross tensors), None without them.
    cross: dict | None = None

    def for_block(self, block: nn.Module, kind: str) -> dict:
        """Keyword arguments of ``block(x, **kwargs)`` (with a KV cache: the block reads and extends it)."""
        if kind == CROSS:
            return {"attention_mask": None, **self.cross}
        kwargs = {"attention_mask": self.masks[kind], "position_ids": self.position_ids,
                  "position_embeddings": self.cos_sin[kind]}
        if self.cache is not None:
            kwargs[_cache_argument(type(block))] = self.cache
            kwargs["use_cache"] = True
        return kwargs


@functools.lru_cache(maxsize=None)
def _cache_argument(block_class: type) -> str:
    """The name a decoder block takes its KV cache under: ``cache`` (transformers 5.24), ``past_key_values``
    (earlier releases)."""
    return "cache" if "cache" in inspect.signature(block_class.forward).parameters else "past_key_values"


@functools.lru_cache(maxsize=None)
def _rotary_per_kind(rotary_class: type) -> bool:
    """Whether a rotary class's forward takes the attention kind (Gemma 3); cached, it runs every frame."""
    return "layer_type" in inspect.signature(rotary_class.forward).parameters


def split_positions(position_ids: torch.Tensor | None, x: torch.Tensor, past: int = 0) -> tuple:
    """(rotary position ids, text position ids) for hidden states ``x`` (B, T, H).

    None: ``arange(T)`` (1, T) for both. (1, B, T): plain positions not from 0 (PaliGemma's from 1), (B, T) for
    both. Multimodal positions (int64): (3, B, T) temporal / height / width, text None; (4, B, T): row 0 text,
    rows 1.. rotary, as ``Qwen2_5_VLTextModel.forward`` / ``Qwen3VLTextModel.forward`` (transformers 5.24). Raises
    ValueError for another shape."""
    if position_ids is None:
        positions = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)
        return positions, positions
    if position_ids.dim() != 3 or position_ids.shape[0] not in (1, 3, 4) or position_ids.shape[-1] != x.shape[1]:
        raise ValueError(f"position ids must be (1, 3 or 4, B, T={x.shape[1]}), got {tuple(position_ids.shape)}")
    position_ids = position_ids.to(x.device)
    if position_ids.shape[0] == 1:
        return position_ids[0], position_ids[0]
    if position_ids.shape[0] == 4:
        return position_ids[1:], position_ids[0]
    return position_ids, None


class _BlockRecorder(nn.Module):
    """Stands for decoder block ``index`` in :func:`captured_block_inputs`: records what the family's forward hands
    it and passes the hidden states on unchanged, as a tensor or, with ``as_tuple`` (a forward that takes
    ``layer(...)[0]``, Falcon-H1's), as a 1-tuple."""

    def __init__(self, index: int, record: dict):
        super().__init__()
        self.index, self.record, self.as_tuple = index, record, False

    def forward(self, *args, **kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs.pop("hidden_states", None)
        self.record[self.index] = (hidden, args[1:], kwargs)
        return (hidden,) if self.as_tuple else hidden


@dataclass
class BlockCall:
    """What a family's forward hands one decoder block besides its hidden states: ``args`` (positional, after the
    hidden states) and ``kwargs`` (masks per layer kind, rotary tables, a state-space mask, ...)."""

    args: tuple
    kwargs: dict

    def run(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``block`` on hidden states ``x`` (1, T, H) with these arguments -> (1, T, H) (a tuple output's first)."""
        y = block(x, *self.args, **self.kwargs)
        return y[0] if isinstance(y, tuple) else y


@dataclass
class CapturedInputs:
    """:func:`captured_block_inputs`' result: ``first`` (1, T, H), block 0's input as the family's forward makes it
    from the embeddings; ``calls``: one :class:`BlockCall` per block index 0..L-1."""

    first: torch.Tensor
    calls: list


def captured_block_inputs(family: TextFamily, rotary: nn.Module, x: torch.Tensor,
                          position_ids: torch.Tensor | None = None) -> CapturedInputs:
    """What a hybrid family's own base-model forward hands each of its L decoder blocks for hidden states ``x``
    (1, T, H) given as ``inputs_embeds`` (:attr:`TextFamily.captured`), as :class:`CapturedInputs` (block 0's
    input after whatever the forward does to given embeddings). Runs the family's forward on a shell of its base
    model (built once per ``rotary``, on the meta device) whose blocks are :class:`_BlockRecorder` and whose final
    norm is the identity, with ``rotary`` as its rotary embedding; no cache. Raises what the family's forward
    raises."""
    config = rotary.config
    shell = rotary.__dict__.get("_captured_shell")
    record: dict = {}
    if shell is None:
        with torch.device("meta"):
            shell = family.base_class(config)
        shell.layers = nn.ModuleList(_BlockRecorder(i, record) for i in range(len(shell.layers)))
        setattr(shell, family.norm_attribute, nn.Identity())
        if family.rotary_class is not None:
            shell.rotary_emb = rotary
        rotary.__dict__["_captured_shell"] = shell  # not a submodule: no state, not moved with the stage
    else:
        for recorder in shell.layers:
            recorder.record = record
    kwargs = {"inputs_embeds": x, "use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    try:
        shell(**kwargs)
        passed_on = all(record[i][0].shape == record[0][0].shape for i in range(len(shell.layers)))
    except (IndexError, TypeError, ValueError, RuntimeError):
        passed_on = False
    if not passed_on:  # the forward takes its blocks' output tuples apart: recorders answer with a 1-tuple
        for recorder in shell.layers:
            recorder.as_tuple = not recorder.as_tuple
        record.clear()
        shell(**kwargs)
    return CapturedInputs(record[0][0], [BlockCall(*record[i][1:]) for i in range(len(shell.layers))])


def cached_tokens(cache, first_layer: int) -> int:
    """Tokens a side's KV cache holds before this forward (0 without one), read at its first block's layer."""
    return 0 if cache is None else int(cache.get_seq_length(first_layer))


def block_inputs(config, rotary: nn.Module, x: torch.Tensor, kinds: set[str],
                 position_ids: torch.Tensor | None = None, *, cache=None, first_layer: dict | None = None,
                 image_blocks: torch.Tensor | None = None, block_rule=None, cross: dict | None = None) -> BlockInputs:
    """Position ids, masks and rotary tables for hidden states ``x`` (B, T, H) and the attention ``kinds`` the
    blocks to run use, as the family's base model computes them; ``position_ids``: None for a text model's
    positions, or a VLM's multimodal ones (:func:`split_positions`). ``cache``: this side's KV cache (a decode):
    positions continue after the tokens it holds and each mask is sized against the cache layer of
    ``first_layer[kind]``, the first block of that kind this side runs (the other side's layers stay empty).
    ``image_blocks``: (T,) int64 (:class:`~.contract.SplitState`): the masks also let each block's tokens attend to
    each other, combined per ``block_rule`` (:class:`~.contract.BlockMaskRule`, required with ``image_blocks``):
    by transformers' ``create_masks_for_vision_model`` (``modeling_gemma3.py``), or each kind's own mask function
    given the blocks (as ``PaliGemmaModel.forward`` calls them). ``cross``: the cross-attention blocks' inputs
    (:attr:`BlockInputs.cross`; :data:`CROSS` needs no mask here)."""
    from transformers.masking_utils import (create_causal_mask, create_chunked_causal_mask,
                                            create_sliding_window_causal_mask)

    first_layer = first_layer or {}
    kinds = set(kinds) - {CROSS}
    past = cached_tokens(cache, min(first_layer.values(), default=0))
    rotary_positions, text_positions = split_positions(position_ids, x, past)
    makers = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask,
              CHUNKED: create_chunked_causal_mask}
    masks = {}
    if image_blocks is not None and not x.is_meta:
        if cache is not None:
            raise ValueError("masks for images attending both ways against a KV cache are not built here")
        from .contract import BlockMaskRule

        blocks = image_blocks.reshape(1, -1).to(x.device)
        if block_rule is BlockMaskRule.WINDOW_OF_BLOCKS:
            from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model

            both = create_masks_for_vision_model(config, x, None, cache, text_positions, blocks)
            masks = {kind: both[kind] for kind in kinds}
        elif block_rule is BlockMaskRule.EACH_KIND:
            for kind in kinds:
                if kind not in makers:
                    raise ValueError(f"attention kind {kind!r} is not supported (only {', '.join(ATTENTION_KINDS)})")
                masks[kind] = makers[kind](config=config, inputs_embeds=x, attention_mask=None, cache=cache,
                                           position_ids=text_positions, block_sequence_ids=blocks)
        else:
            raise ValueError(f"blocks that attend both ways need a BlockMaskRule, got {block_rule!r}")
    for kind in set(kinds) - set(masks):
        if kind not in makers:
            raise ValueError(f"attention kind {kind!r} is not supported (only {', '.join(ATTENTION_KINDS)})")
        if x.is_meta:  # FLOP counting on the meta device (no values): transformers' mask functions read values
            masks[kind] = None
            continue
        masks[kind] = makers[kind](config=config, inputs_embeds=x, attention_mask=None, cache=cache,
                                   position_ids=text_positions, layer_idx=first_layer.get(kind))
    if _rotary_per_kind(type(rotary)):
        cos_sin = {kind: rotary(x, rotary_positions, kind) for kind in kinds}
    else:
        shared = rotary(x, rotary_positions)
        cos_sin = {kind: shared for kind in kinds}
    return BlockInputs(text_positions, masks, cos_sin, cache, cross)
