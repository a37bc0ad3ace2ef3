"""Tiny vision-language models of transformers' own classes, saved with ``save_pretrained`` (sharded) together
with a processor (the family's own image processor and a word-level tokenizer that knows the family's image
tokens), as a user's downloaded VLM directory would hold them: ``config.json``, shards, ``preprocessor_config.json``,
``tokenizer.json``, ``processor_config.json``.

Weights are re-drawn so hidden states are O(1) (hf_builders.perturb_). The vision towers are small (a few
blocks, patch 8 or 14) and their image processors resize each camera frame to a few hundred pixels, so one
6-camera frame is some hundred tokens.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hf_builders import LLM, perturb_

from hybrid_vla_ros.tools.bench.families import word_tokenizer  # the benchmark's own, shared


def _text(model_type: str, **overrides) -> dict:
    return {**LLM, "model_type": model_type, "vocab_size": LLM["vocab_size"], "rope_theta": 1e4,
            "tie_word_embeddings": False, **overrides}


def write_qwen_vl(path: Path, family: str = "qwen2_5_vl", seed: int = 5, shard: str = "100KB") -> Path:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE (``family``) with its processor: vision patch 8, merge 2
    (one token per 2 x 2 patches), images resized to at most 64 x 64 px (16 tokens a camera at 16:9), multimodal
    rotary sections that sum to head_dim / 2 (8 = 2 + 3 + 3); Qwen3-VL with DeepStack features added after blocks 0
    and 1; Qwen3-VL-MoE with 8 experts, 2 active, in every block (stored per expert)."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    qwen3 = family in ("qwen3_vl", "qwen3_vl_moe")
    if qwen3:
        rope["mrope_interleaved"] = True
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32) if family == "qwen3_vl_moe" else {}
    text = _text(f"{family}_text", head_dim=16, rope_parameters=rope, **moe)
    if qwen3:
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=LLM["hidden_size"], num_position_embeddings=64,
                      deepstack_visual_indexes=[0, 1])
    elif family == "qwen2_5_vl":
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=LLM["hidden_size"], window_size=32,
                      fullatt_block_indexes=[1])
    else:
        vision = dict(depth=3, embed_dim=32, hidden_size=LLM["hidden_size"], mlp_ratio=2, num_heads=2, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2)
    cfg = AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                               vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = perturb_(AutoModelForImageTextToText.from_config(cfg), seed)
    model.save_pretrained(str(path), max_shard_size=shard)
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      min_pixels=16 * 16, max_pixels=64 * 64)
    _save_processor(path, images, cfg)
    return Path(path)


def _save_processor(path: Path, images, cfg, **options) -> None:
    """The image processor's ``preprocessor_config.json`` and a ``processor_config.json`` naming the family's
    processor class with its options, as a downloaded VLM directory holds them (the tokenizer is saved by
    :func:`word_tokenizer`)."""
    import json

    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    images.save_pretrained(str(path))
    doc = {"processor_class": PROCESSOR_MAPPING[type(cfg)].__name__, **options}
    (Path(path) / "processor_config.json").write_text(json.dumps(doc, indent=2) + "\n")


def _save_vlm(path: Path, cfg, seed: int, shard: str) -> None:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = perturb_(AutoModelForImageTextToText.from_config(cfg), seed)
    model.save_pretrained(str(path), max_shard_size=shard)


def write_internvl(path: Path, seed: int = 6, shard: str = "100KB", text: str = "qwen2") -> Path:
    """An InternVL (InternVL3 layout: InternViT tower, pixel-shuffle connector, a Qwen2 text model, or with
    ``text="qwen3_moe"`` InternVL3.5-A3B's Qwen3-MoE one: 8 experts, 2 active) with its processor: 32 px tiles,
    patch 8, downsample 0.5 (4 tokens a tile), no extra tiles."""
    from transformers import AutoConfig, GotOcr2ImageProcessorPil

    special = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={
        "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>"})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=[32, 32], patch_size=[8, 8])
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32) if text == "qwen3_moe" else {}
    cfg = AutoConfig.for_model("internvl", vision_config=vision, text_config=_text(text, **moe),
                               image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4,
                               downsample_ratio=0.5, vision_feature_layer=-1)
    _save_vlm(path, cfg, seed, shard)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    _save_processor(path, images, cfg, image_seq_length=4)
    return Path(path)


def write_gemma3(path: Path, seed: int = 9, shard: str = "100KB") -> Path:
    """A Gemma 3 (SigLIP tower, average-pooled projector, Gemma 3 text model with sliding layers of window 5) with
    its processor: 32 px images, patch 8, 4 tokens an image between ``<start_of_image>`` and ``<end_of_image>``;
    an image's tokens attend to each other both ways (transformers' ``token_type_ids`` masks)."""
    from transformers import AutoConfig, Gemma3ImageProcessorPil

    special = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    text = _text("gemma3_text", head_dim=16, sliding_window=5, query_pre_attn_scalar=16,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    text.pop("rope_theta")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                               boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                               image_token_index=ids["<image_soft_token>"])
    _save_vlm(path, cfg, seed, shard)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    _save_processor(path, images, cfg, image_seq_length=4)
    return Path(path)


def write_llava_next(path: Path, family: str = "llava_next", seed: int = 7, shard: str = "100KB") -> Path:
    """A LLaVA-NeXT (CLIP tower, llama text) or LLaVA-OneVision (SigLIP tower, qwen2 text) with its processor:
    32 px base image, patch 8, 'anyres' grids of 32 / 64 px (the base image plus its tiles, a newline token per
    row)."""
    from transformers import AutoConfig

    special = ["<image>", "<video>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={"image_token": "<image>", "video_token": "<video>"})
    grids = [[32, 32], [32, 64], [64, 32], [64, 64]]
    if family == "llava_next":
        from transformers import LlavaNextImageProcessorPil as Images

        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
        cfg = AutoConfig.for_model(family, vision_config=vision, text_config=_text("llama"),
                                   image_token_index=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=grids,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default")
        options = dict(patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    else:
        from transformers import LlavaOnevisionImageProcessorPil as Images

        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, image_size=32, patch_size=8)
        cfg = AutoConfig.for_model(family, vision_config=vision, text_config=_text("qwen2"),
                                   image_token_index=tok.convert_tokens_to_ids("<image>"),
                                   video_token_index=tok.convert_tokens_to_ids("<video>"), image_grid_pinpoints=grids,
                                   vision_feature_layer=-1, vision_feature_select_strategy="full",
                                   vision_aspect_ratio="anyres_max_9")
        options = dict(num_image_tokens=16, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    _save_vlm(path, cfg, seed, shard)
    images = Images(size={"height": 32, "width": 32} if family != "llava_next" else {"shortest_edge": 32},
                    crop_size={"height": 32, "width": 32}, image_grid_pinpoints=grids)
    _save_processor(path, images, cfg, **options)
    return Path(path)


def write_idefics3(path: Path, family: str = "idefics3", seed: int = 8, shard: str = "100KB") -> Path:
    """An Idefics3 or SmolVLM (SigLIP-style tower, pixel-shuffle connector, llama text) with its processor: 32 px
    tiles, patch 8, scale factor 2 (4 tokens a tile), images split into tiles of at most 32 px plus the whole
    image, each tile wrapped in the family's row / column tokens."""
    from transformers import AutoConfig

    special = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    special += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={"image_token": "<image>"})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    cfg = AutoConfig.for_model(family, vision_config=vision, text_config=_text("llama"),
                               image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    _save_vlm(path, cfg, seed, shard)
    if family == "idefics3":
        from transformers import Idefics3ImageProcessorPil as Images
    else:
        from transformers import SmolVLMImageProcessorPil as Images
    images = Images(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
    _save_processor(path, images, cfg, image_seq_len=4)
    return Path(path)


def write_mistral3(path: Path, seed: int = 10, shard: str = "100KB") -> Path:
    """A Mistral 3 (Pixtral tower with 2-D rotary positions, patch merger 2, a Mistral text model) with its
    processor: images resized to at most 32 px on the longest edge, patch 8 (2 x 1 tokens a 16:9 camera after the
    merge), rows ended by ``[IMG_BREAK]`` and the image by ``[IMG_END]``; the image sizes go with the pixels."""
    from transformers import AutoConfig, PixtralImageProcessorPil

    special = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tok = word_tokenizer(special, LLM["vocab_size"], path)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, head_dim=16, image_size=64, patch_size=8, rope_theta=1e4)
    cfg = AutoConfig.for_model("mistral3", vision_config=vision, text_config=_text("mistral", head_dim=16),
                               image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                               vision_feature_layer=-1)
    _save_vlm(path, cfg, seed, shard)
    images = PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size={"height": 8, "width": 8})
    _save_processor(path, images, cfg, patch_size=8, spatial_merge_size=2)
    return Path(path)


def write_aya_vision(path: Path, seed: int = 11, shard: str = "100KB") -> Path:
    """An Aya Vision (SigLIP tower, pixel-shuffle 2 with a SwiGLU projector, a Cohere 2 text model with sliding
    layers of window 6) with its processor: 32 px tiles, patch 8 (4 tokens a tile), no extra tiles, the image
    wrapped in ``<|START_OF_IMG|>`` ... ``<|END_OF_IMG|>``."""
    from transformers import AutoConfig, GotOcr2ImageProcessorPil

    special = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE",
               "TILE_GLOBAL"]
    tok = word_tokenizer(special, LLM["vocab_size"], path)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    text = _text("cohere2", head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                                                         "sliding_attention"],
                 pad_token_id=1, bos_token_id=None, eos_token_id=None)
    cfg = AutoConfig.for_model("aya_vision", vision_config=vision, text_config=text, downsample_factor=2,
                               image_token_index=tok.convert_tokens_to_ids("<|IMG_PATCH|>"),
                               vision_feature_select_strategy="full", vision_feature_layer=-1)
    _save_vlm(path, cfg, seed, shard)
    images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=False)
    _save_processor(path, images, cfg, patch_size=8, img_size=32, downsample_factor=2)
    return Path(path)


def write_paligemma(path: Path, seed: int = 12, shard: str = "100KB") -> Path:
    """A PaliGemma 2 (SigLIP tower, linear projector, a Gemma 2 text model with sliding layers of window 6) with its
    processor: 32 px images, patch 8 (16 tokens an image, all images first, then the prompt); images and prompt
    attend to each other both ways (the prefix of transformers' ``token_type_ids``), positions counted from 1."""
    from transformers import AutoConfig, SiglipImageProcessorPil

    special = ["<image>", "<bos>", "<eos>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={"image_token": "<image>"})
    tok.bos_token, tok.eos_token = "<bos>", "<eos>"
    tok.save_pretrained(str(path))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8, projection_dim=LLM["hidden_size"])
    text = _text("gemma2", head_dim=16, sliding_window=6, query_pre_attn_scalar=16)
    cfg = AutoConfig.for_model("paligemma", vision_config=vision, text_config=text,
                               image_token_index=tok.convert_tokens_to_ids("<image>"),
                               projection_dim=LLM["hidden_size"], hidden_size=LLM["hidden_size"],
                               vocab_size=LLM["vocab_size"])
    _save_vlm(path, cfg, seed, shard)
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16
    _save_processor(path, images, cfg)
    return Path(path)


def write_glm4v(path: Path, seed: int = 13, shard: str = "100KB") -> Path:
    """A GLM-4.1V (its own vision tower with 2-D rotary and interpolated position embeddings, patch merger 2, a
    GLM-4 text model with multimodal rotary positions) with its processor: images resized to at most 64 x 64 px,
    patch 8, merge 2, each image between ``<|begin_of_image|>`` and ``<|end_of_image|>``."""
    from transformers import AutoConfig, Glm4vImageProcessorPil

    special = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>",
               "<|video|>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={"image_token": "<|image|>",
                                                                  "video_token": "<|video|>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "partial_rotary_factor": 0.5}
    text = _text("glm4v_text", head_dim=32, rope_parameters=rope)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=LLM["hidden_size"], image_size=32)
    cfg = AutoConfig.for_model("glm4v", text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                               video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                               image_end_token_id=ids["<|end_of_image|>"],
                               video_start_token_id=ids["<|begin_of_video|>"],
                               video_end_token_id=ids["<|end_of_video|>"])
    _save_vlm(path, cfg, seed, shard)
    images = Glm4vImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64})
    _save_processor(path, images, cfg)
    return Path(path)


def write_mllama(path: Path, seed: int = 14, shard: str = "100KB") -> Path:
    """An Mllama (Llama 3.2 Vision: a tiled vision tower with a global encoder, a projector, a Llama text model whose
    block 1 is a cross-attention block reading the vision states) with its processor: 32 px tiles, patch 8 (16
    patches and a class token a tile), at most 2 tiles an image; each ``<|image|>`` token marks where the text
    starts attending to that camera's tiles."""
    from transformers import AutoConfig, MllamaImageProcessorPil

    special = ["<|image|>", "<|begin_of_text|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]
    tok = word_tokenizer(special, LLM["vocab_size"], path, extra={"image_token": "<|image|>"})
    tok.bos_token, tok.pad_token = "<|begin_of_text|>", "<|finetune_right_pad_id|>"
    tok.save_pretrained(str(path))
    ids = {t: tok.convert_tokens_to_ids(t) for t in special}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=32, patch_size=8, max_num_tiles=2, vision_output_dim=64,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = _text("mllama_text_model", cross_attention_layers=[1], bos_token_id=ids["<|begin_of_text|>"],
                 pad_token_id=ids["<|finetune_right_pad_id|>"], eos_token_id=None)
    text.pop("max_position_embeddings")
    cfg = AutoConfig.for_model("mllama", vision_config=vision, text_config=text, image_token_index=ids["<|image|>"])
    _save_vlm(path, cfg, seed, shard)
    images = MllamaImageProcessorPil(size={"height": 32, "width": 32}, max_image_tiles=2)
    _save_processor(path, images, cfg)
    return Path(path)


#: Every VLM family of the tests: name -> (builder, kwargs).
VLM_BUILDERS = {
    "qwen2_vl": (write_qwen_vl, dict(family="qwen2_vl")),
    "qwen2_5_vl": (write_qwen_vl, dict(family="qwen2_5_vl")),
    "qwen3_vl": (write_qwen_vl, dict(family="qwen3_vl")),
    "qwen3_vl_moe": (write_qwen_vl, dict(family="qwen3_vl_moe")),
    "gemma3": (write_gemma3, {}),
    "internvl": (write_internvl, {}),
    "internvl_qwen3_moe": (write_internvl, dict(text="qwen3_moe")),
    "llava_next": (write_llava_next, dict(family="llava_next")),
    "llava_onevision": (write_llava_next, dict(family="llava_onevision")),
    "idefics3": (write_idefics3, dict(family="idefics3")),
    "smolvlm": (write_idefics3, dict(family="smolvlm")),
    "aya_vision": (write_aya_vision, {}),
    "paligemma": (write_paligemma, {}),
    "glm4v": (write_glm4v, {}),
    "mllama": (write_mllama, {}),
}
