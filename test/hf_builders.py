"""Small random transformers checkpoints written by transformers' own ``save_pretrained`` (sharded), for the tests.

Every builder makes the model with transformers' classes, then perturbs what transformers initialises to
constants (biases 0, norm gains 1, so that a swapped or dropped bias / norm would still pass), and saves it with
a small ``max_shard_size`` so the shard index (``model.safetensors.index.json``) is exercised.
"""
from __future__ import annotations

from pathlib import Path

import torch

#: A small LLM shape: grouped KV (4 query heads, 2 KV heads), 3 decoder blocks.
LLM = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=320, max_position_embeddings=512)


def perturb_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw every parameter in place so hidden states are O(1) (transformers' init, std 0.02, leaves them
    ~0.05, where a 1e-5 tolerance would mean little) and nothing is a constant: matrices ~ N(0, 1/fan_in)
    (embedding tables ~ N(0, 1)), biases ~ N(0, 0.2), 1-D gains (norms) ~ 1 + N(0, 0.1) (random init leaves
    biases 0 and gains 1, so a dropped bias or norm would go unnoticed)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif p.dim() == 1:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            elif "embed" in name and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
    return model


def write_llama(path: Path, seed: int = 0, shard: str = "60KB", **overrides) -> Path:
    """A LlamaForCausalLM (untied LM head, rope theta 5e5) saved sharded at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**LLM, "rope_theta": 5e5, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **overrides})
    perturb_(LlamaForCausalLM(cfg), seed).save_pretrained(str(path), max_shard_size=shard)
    return Path(path)


def write_qwen2(path: Path, seed: int = 1, shard: str = "60KB", **overrides) -> Path:
    """A Qwen2ForCausalLM (q/k/v biases, grouped KV, tied embeddings) saved sharded at ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**{**LLM, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, **overrides})
    perturb_(Qwen2ForCausalLM(cfg), seed).save_pretrained(str(path), max_shard_size=shard)
    return Path(path)


#: Per text family: config overrides that exercise what sets it apart (T = 12 test tokens): its own head_dim,
#: q/k norms, sliding windows shorter than T, Gemma's alternating layer kinds, soft-capping and local rotary base.
TEXT_FAMILIES = {
    "qwen3": dict(head_dim=24, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "mistral": dict(sliding_window=5, rope_theta=1e6, tie_word_embeddings=False),
    "gemma2": dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3_text": dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "phi3": dict(sliding_window=7, rope_theta=1e4, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                 eos_token_id=2),
}


def write_text_lm(path: Path, model_type: str, seed: int = 3, shard: str = "60KB", **overrides) -> Path:
    """A causal LM of text family ``model_type`` (:data:`TEXT_FAMILIES`; transformers' own config and
    ``AutoModelForCausalLM`` classes), perturbed (:func:`perturb_`) and saved sharded at ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **{**LLM, **TEXT_FAMILIES[model_type], **overrides})
    perturb_(AutoModelForCausalLM.from_config(cfg), seed).save_pretrained(str(path), max_shard_size=shard)
    return Path(path)


#: Decoders split by the generic path (text.text_family; not in text.TESTED_TEXT_TYPES), as config overrides of
#: :data:`LLM` that exercise what sets each apart: mixture-of-experts blocks (8 experts, 2 active; Qwen2-MoE's shared
#: expert; DeepSeek-V3's latent attention and a dense first block; Granite-MoE's experts stored under names
#: transformers renames at load), Granite's embedding / residual / logit factors,
#: Cohere 2's logit scale and sliding layers, SmolLM3's NoPE layer, gpt-oss's sinks and alternating windows.
GENERIC_FAMILIES = {
    "olmo2": {},
    "glm4": {},
    "exaone4": dict(sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "smollm3": dict(no_rope_layers=[1, 1, 0]),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "cohere2": dict(sliding_window=5, logit_scale=0.5,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=2.0, logits_scaling=2.0),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96, head_dim=16,
                        attention_chunk_size=4, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0],
                        layer_types=["chunked_attention", "chunked_attention", "full_attention"]),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4),
}


#: Hybrid families (:attr:`hybrid_vla_ros.model.text.TextFamily.captured`): model_type -> config overrides on
#: :data:`LLM` (3 blocks, every block kind among them; Falcon-H1 5: its forward takes its blocks' output tuples
#: apart, which only shows from the fourth block on).
HYBRID_FAMILIES = {
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                      mamba_chunk_size=8, head_dim=16, embedding_multiplier=2.0, num_hidden_layers=5),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2,
                  use_mamba_kernels=False),
    "qwen3_next": dict(layer_types=["linear_attention", "linear_attention", "full_attention"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, head_dim=16),
}


def write_generic_lm(path: Path, model_type: str, seed: int = 3, shard: str = "60KB") -> Path:
    """A causal LM of ``model_type`` (:data:`GENERIC_FAMILIES`, :data:`HYBRID_FAMILIES`), perturbed
    (:func:`perturb_`: routers included, so tokens go to several experts) and saved sharded by transformers'
    ``save_pretrained`` (per-expert tensors, as published MoE checkpoints are stored)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    overrides = GENERIC_FAMILIES[model_type] if model_type in GENERIC_FAMILIES else HYBRID_FAMILIES[model_type]
    cfg = AutoConfig.for_model(model_type, **{**LLM, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                              **overrides})
    perturb_(AutoModelForCausalLM.from_config(cfg), seed).save_pretrained(str(path), max_shard_size=shard)
    return Path(path)


def write_llava(path: Path, vision: str = "clip", text: str = "llama", seed: int = 2, shard: str = "60KB",
                original_format: bool = True, **overrides) -> Path:
    """A LlavaForConditionalGeneration saved sharded at ``path``.

    ``vision`` clip: CLIP tower (32 px, patch 8: 16 patches + a class token), feature layer -2, ``default``
    selection (the class token dropped: 16 tokens an image); siglip: SigLIP tower (32 px, patch 16: 4 patches),
    feature layers [-2, -1] concatenated, ``full`` selection. ``text``: llama or qwen2. ``original_format``:
    transformers' default save (the 4.x layout ``language_model.model.*``); False: the 5.x in-memory layout
    (``model.language_model.*``).
    """
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, SiglipVisionConfig

    torch.manual_seed(seed)
    if vision == "clip":
        vcfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                                image_size=32, patch_size=8)
        extra = dict(vision_feature_layer=-2, vision_feature_select_strategy="default")
    else:
        vcfg = SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=16)
        extra = dict(vision_feature_layer=[-2, -1], vision_feature_select_strategy="full")
    tcfg = {**LLM, "model_type": text, "rope_theta": 1e4, "tie_word_embeddings": False}
    cfg = LlavaConfig(vision_config=vcfg, text_config=tcfg, image_token_index=LLM["vocab_size"] - 1,
                      **{**extra, **overrides})
    model = perturb_(LlavaForConditionalGeneration(cfg), seed)
    model.save_pretrained(str(path), max_shard_size=shard, save_original_format=original_format)
    return Path(path)


def shard_files(path: Path) -> list[Path]:
    return sorted(Path(path).glob("model-*-of-*.safetensors"))
