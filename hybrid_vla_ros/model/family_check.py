"""The forward check of a text family outside :data:`~.text.TESTED_TEXT_TYPES`: this package's loop against the
family's own forward on a small random copy of the checkpoint's configuration (module docstring of :mod:`.text`).

Kept apart from :mod:`.text` because it runs the split path itself (:func:`~.modeling.run_blocks`,
:class:`~.decode.LMHead`), which builds on :mod:`.text`. Called where a checkpoint is opened
(:mod:`.hf`, :mod:`.checkpoint`).
"""
from __future__ import annotations

import functools
import json

import torch
from torch import nn

from . import text
from .decode import LMHead
from .modeling import run_blocks

__all__ = ["check_forward_matches", "small_copy", "check_family"]


def check_family(config) -> None:
    """:func:`check_forward_matches` for a family outside :data:`~.text.TESTED_TEXT_TYPES`; nothing for a tested
    one. Raises ValueError as it does."""
    if config.model_type not in text.TESTED_TEXT_TYPES:
        check_forward_matches(config)


#: Tokens of the forward check (a window of 5 below it is exercised).
_CHECK_TOKENS = 9
#: Widths of the forward check's small copy: config attribute -> value, set where the config has the attribute.
_SMALL_WIDTHS = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "head_dim": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "vocab_size": 128,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "n_group": 1, "topk_group": 1,
}
_TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def small_copy(config, blocks: int = 4):
    """A small configuration of the same family and structure as ``config`` for :func:`check_forward_matches`:
    widths of :data:`_SMALL_WIDTHS` (grouped KV kept grouped; the head width kept where multimodal rotary sections
    are declared for it), at most 8 experts and 2 active, a sliding window of at most 5, attention chunks of at
    most 4 tokens, the first ``blocks`` decoder blocks with every attention kind of the original among them. Built
    through the family's config class from a dict, so derived fields follow. Raises what the class raises."""
    doc = config.to_dict()
    n = min(int(config.num_hidden_layers), blocks)
    over = {k: v for k, v in _SMALL_WIDTHS.items() if k in doc and (doc[k] is not None or v is None)}
    for key in _TOKEN_ID_KEYS:  # ids inside the small vocabulary (a config may require them set: Mllama's)
        value = doc.get(key)
        if value is not None:
            vocab = int(over.get("vocab_size", doc.get("vocab_size") or 1))
            over[key] = [int(v) % vocab for v in value] if isinstance(value, list) else int(value) % vocab
    heads, kv = int(doc.get("num_attention_heads") or 4), doc.get("num_key_value_heads")
    if kv is not None:
        over["num_key_value_heads"] = 1 if int(kv) == 1 else (4 if int(kv) == heads else 2)
    for key in _EXPERT_COUNTS:
        if doc.get(key):
            over[key] = min(int(doc[key]), 8)
    if doc.get("num_experts_per_tok"):
        over["num_experts_per_tok"] = min(int(doc["num_experts_per_tok"]), 2)
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("mrope_section") and doc.get("head_dim"):  # sections sum to its half
        over["head_dim"] = int(doc["head_dim"])
    if doc.get("kv_lora_rank") and "head_dim" in doc:  # latent attention: the rotary runs on the rope part only
        over["head_dim"] = over["qk_rope_head_dim"]
    if doc.get("sliding_window"):
        over["sliding_window"] = min(int(doc["sliding_window"]), 5)
    if doc.get("attention_chunk_size"):  # chunks shorter than the check's tokens, so the chunked masks act
        over["attention_chunk_size"] = min(int(doc["attention_chunk_size"]), 4)
    if doc.get("layer_types"):
        kinds = list(doc["layer_types"])
        picked = kinds[:n]
        missing = [k for k in dict.fromkeys(kinds) if k not in picked]
        for j, kind in enumerate(missing[:n]):  # every kind among the n: the last ones replaced
            picked[n - 1 - j] = kind
        over["layer_types"] = picked
    over["num_hidden_layers"] = n
    small = type(config).from_dict({**doc, **over})
    return small


def _draw_(module: nn.Module, generator: torch.Generator) -> None:
    """Re-draw every parameter so hidden states are O(1) and nothing is a constant (routers included, so tokens go
    to several experts): matrices ~ N(0, 1/fan_in) (last dim), embeddings ~ N(0, 1), biases ~ N(0, 0.2), 1-D gains
    ~ 1 + N(0, 0.1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            elif p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=generator) * 0.1)
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=generator))
            else:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


def check_forward_matches(config) -> None:
    """Prove this package's loop equals the family's own forward for ``config``'s structure: a small random copy
    (:func:`small_copy`) run by transformers' ``<Family>ForCausalLM`` (or base model) and by this package's
    embedding, :func:`~hybrid_vla_ros.model.modeling.run_blocks` split after half the blocks, norm and
    :class:`~hybrid_vla_ros.model.decode.LMHead`, in float32 on the CPU. Cached per configuration and process.

    Raises ValueError when they differ by more than 1e-4 (naming where: the hidden states, e.g. a scaled
    embedding or residual the loop does not apply, or only the logits, e.g. a logit scale), or when no small
    copy can be built."""
    doc = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version", "dtype",
                                                                  "torch_dtype", "architectures")}
    _check_forward_cached(config.model_type, json.dumps(doc, sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _check_forward_cached(model_type: str, config_json: str) -> None:
    family = text.text_family(model_type)
    where = f"language model type {model_type!r}"
    try:
        small = small_copy(family.config_class.from_dict(json.loads(config_json)))
    except Exception as e:  # noqa: BLE001 - any family's config validation: its error is the reason
        raise ValueError(f"{where}: no small copy of this configuration could be built to check the split against "
                         f"transformers' forward ({type(e).__name__}: {e}); not split unchecked") from None
    small._attn_implementation = text.attention_implementation(family)
    if family.experts_implementation:
        small._experts_implementation = family.experts_implementation
    try:
        _compare_on(family, small, where)
    except ValueError as e:
        if str(e).startswith(where):  # the comparison's own verdict
            raise
        raise ValueError(f"{where}: a small random copy of this configuration does not run through this package's "
                         f"loop ({type(e).__name__}: {e}): refused rather than split unchecked") from None
    except Exception as e:  # noqa: BLE001 - whatever the family's code raises on the small copy is the reason
        raise ValueError(f"{where}: a small random copy of this configuration does not run through this package's "
                         f"loop ({type(e).__name__}: {e}): refused rather than split unchecked") from None


def _compare_on(family: text.TextFamily, small, where: str) -> None:
    """:func:`check_forward_matches` on the small configuration ``small``."""
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(0)
        full = (family.causal_lm_class or family.base_class)(small).float().eval()
        _draw_(full, g)
        # the base model as the causal LM holds it (Llama 4's names a prefix it does not use: find it by class)
        base = next((m for m in full.children() if isinstance(m, family.base_class)), full.base_model)
        ids = (torch.arange(_CHECK_TOKENS) * 37 + 5) % int(small.vocab_size)
        reference = base(input_ids=ids[None], use_cache=False).last_hidden_state[0]
        with_logits = family.causal_lm_class is not None and not family.captured  # a hybrid family: no decode
        logits = full(input_ids=ids[None], use_cache=False).logits[0] if with_logits else None
        embedding = text.make_embedding(family, small)
        embedding.load_state_dict(base.embed_tokens.state_dict())
        norm = text.make_norm(family, small)
        norm.load_state_dict(getattr(base, family.norm_attribute).state_dict())
        holder = nn.Module()
        holder.rotary_emb = base.rotary_emb if family.rotary_class is not None else text.NoRotary(small)
        half = len(base.layers) // 2
        h = run_blocks(holder, base.layers[:half], embedding(ids), embedded=True)
        h = norm(run_blocks(holder, base.layers[half:], h))
        diff = float((h - reference).abs().max())
        if not diff <= 1e-4:
            raise ValueError(f"{where}: this package's loop (embedding -> decoder blocks split in two -> norm) "
                             f"differs from transformers' {type(base).__name__}.forward by {diff:.3g} on a small "
                             "random copy of this configuration: the family's forward does more than the loop "
                             "(e.g. a scaled embedding or residual, per-layer inputs): refused rather than split "
                             "wrong")
        if with_logits:
            head = LMHead(small)
            head.weight = nn.Parameter(full.get_output_embeddings().weight.detach().clone())
            diff = float((head(h) - logits.float()).abs().max())
            if not diff <= 1e-4:
                raise ValueError(f"{where}: its hidden states split exactly but its logits differ from "
                                 f"{type(full).__name__}'s by {diff:.3g} (a logit scale or cap the LM head here "
                                 "does not apply): refused, as a decode would choose wrong tokens")
