"""Per VLM family: the prefix's camera preprocessing and vision time for 6 cameras, and the bytes crossing the split.

For each family a VLM of transformers' own classes is built with its published vision tower shape (one vision
block built and timed; the tower's time is that block's median times its depth, plus the patch embedding and
the connector, timed whole) and its published text width (one text block: the text blocks are what the split
moves, their time is the pipeline's business, not this part's). Its processor is the family's own image
processor with the published settings and a word-level tokenizer (:func:`word_tokenizer`) that knows the
family's image tokens. Input: one synchronized frame of the embedded bag, six cameras resized to the family's
camera size.

Reported per family: ``preprocess_ms`` (the family's processor on the six RGB images: its resize, tiling,
normalisation and prompt expansion; p50), ``vision_ms`` (the front: vision tower + connector + the scatter into the
token embeddings, one block timed and counted ``depth`` times), T, and ``handoff_bytes`` (h_K in bf16 plus the side
tensors the family sends: multimodal positions, DeepStack features; :func:`~hybrid_vla_ros.model.contract.side_bytes`).
Published shapes (``PUBLISHED``) are the config.json values of the checkpoints named there, as transformers' model
cards give them; no weights are downloaded (random init: timing only).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

#: Words the benchmark tokenizer knows besides the special tokens (the default prompt's).
WORDS = ("camera front left right rear back the plan route drive ahead waypoints for ego vehicle image images "
         "of a an and in on to is this what where describe scene car road lane stop go speed").split()


def word_tokenizer(special: list[str], vocab_size: int, path: Path, extra: dict | None = None):
    """A fast word-level tokenizer (whitespace split; the ``tokenizers`` library) whose vocabulary is
    ``special`` tokens, then :data:`WORDS`, then filler words up to ``vocab_size``, saved into ``path``.
    ``extra``: named special tokens (``extra_special_tokens``, e.g. InternVL's ``context_image_token``), which
    become tokenizer attributes as in the families' published tokenizer configs. Returns the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {}
    for tok in ["<unk>", "<pad>"] + special + list(WORDS):
        vocab.setdefault(tok, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  extra_special_tokens=extra or {})
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.save_pretrained(str(path))
    return tok


_QWEN = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
#: family -> (published checkpoint, vision config, text width, extra VLM config, camera size (W, H)).
PUBLISHED = {
    "qwen2_vl": ("Qwen/Qwen2-VL-2B-Instruct", dict(depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4,
                                                  num_heads=16, patch_size=14, spatial_merge_size=2), 1536, {},
                 (448, 252)),
    "qwen2_5_vl": ("Qwen/Qwen2.5-VL-3B-Instruct", dict(depth=32, hidden_size=1280, intermediate_size=3420,
                                                       num_heads=16, patch_size=14, spatial_merge_size=2,
                                                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                                       out_hidden_size=2048), 2048, {}, (448, 252)),
    "qwen3_vl": ("Qwen/Qwen3-VL-2B-Instruct", dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                                   patch_size=16, spatial_merge_size=2, out_hidden_size=2048,
                                                   num_position_embeddings=2304,
                                                   deepstack_visual_indexes=[5, 11, 17]), 2048, {}, (512, 288)),
    "internvl": ("OpenGVLab/InternVL3-1B-hf", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                   num_attention_heads=16, image_size=[448, 448], patch_size=[14, 14]),
                 896, dict(image_seq_length=256, downsample_ratio=0.5), (448, 448)),
    "llava_onevision": ("llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
                        dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                             num_hidden_layers=27, num_attention_heads=16, image_size=384, patch_size=14), 896,
                        dict(vision_feature_select_strategy="full", vision_feature_layer=-1), (384, 384)),
}


def _depth(vision: dict) -> tuple[str, int]:
    key = "depth" if "depth" in vision else "num_hidden_layers"
    return key, int(vision[key])


def _build(family: str, root: Path, vision_blocks: int = 1, text_blocks: int = 1):
    """A VLM of the family at its published widths with ``vision_blocks`` vision and ``text_blocks`` text blocks
    (default one of each), with its processor files; returns (directory, vision depth published)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    name, vision, width, extra, _ = PUBLISHED[family]
    key, depth = _depth(vision)
    vision = {**vision, key: int(vision_blocks)}
    if "deepstack_visual_indexes" in vision:  # the published levels, all taken after the first block built
        vision["deepstack_visual_indexes"] = [0] * len(vision["deepstack_visual_indexes"])
    path = root / family
    text = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=int(text_blocks), vocab_size=512,
                num_attention_heads=max(1, width // 128), num_key_value_heads=max(1, width // 128))
    if family.startswith("qwen"):
        tok = word_tokenizer(_QWEN, 512, path)
        head_dim = width // text["num_attention_heads"]
        text.update(model_type=f"{family}_text", head_dim=head_dim,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                     "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]}
                    | ({"mrope_interleaved": True} if family == "qwen3_vl" else {}))
        ids = {t: tok.convert_tokens_to_ids(t) for t in _QWEN}
        cfg = AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                                   video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                                   vision_end_token_id=ids["<|vision_end|>"])
        from transformers import Qwen2VLImageProcessorPil

        patch = int(vision["patch_size"])
        images = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                          min_pixels=4 * patch * patch, max_pixels=16384 * 28 * 28)
        options = {}
    elif family == "internvl":
        special = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
        tok = word_tokenizer(special, 512, path, extra={"start_image_token": "<img>", "end_image_token": "</img>",
                                                       "context_image_token": "<IMG_CONTEXT>",
                                                       "video_token": "<video>"})
        cfg = AutoConfig.for_model(family, vision_config=vision, text_config={**text, "model_type": "qwen2"},
                                   image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), **extra)
        from transformers import GotOcr2ImageProcessorPil

        images = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, crop_to_patches=False)
        options = {"image_seq_length": 256}
    else:
        tok = word_tokenizer(["<image>", "<video>"], 512, path,
                             extra={"image_token": "<image>", "video_token": "<video>"})
        cfg = AutoConfig.for_model(family, vision_config=vision, text_config={**text, "model_type": "qwen2"},
                                   image_token_index=tok.convert_tokens_to_ids("<image>"),
                                   video_token_index=tok.convert_tokens_to_ids("<video>"),
                                   image_grid_pinpoints=[[384, 384]], vision_aspect_ratio="anyres_max_9", **extra)
        from transformers import LlavaOnevisionImageProcessorPil

        images = LlavaOnevisionImageProcessorPil(size={"height": 384, "width": 384},
                                                 crop_size={"height": 384, "width": 384},
                                                 image_grid_pinpoints=[[384, 384]])
        options = {"num_image_tokens": 729, "vision_feature_select_strategy": "full",
                   "vision_aspect_ratio": "anyres_max_9"}
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForImageTextToText.from_config(cfg)
    model.save_pretrained(str(path))
    images.save_pretrained(str(path))
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    (path / "processor_config.json").write_text(json.dumps({"processor_class": PROCESSOR_MAPPING[type(cfg)].__name__,
                                                            **options}))
    return path, depth


def run_families(families: list[str] | None = None, repeats: int = 3, log=print, dtype_name: str = "fp32") -> dict:
    """Measure every family of ``families`` (default: all of :data:`PUBLISHED`) on this process's cores, the
    front in ``dtype_name`` (fp32 by default: a CPU without bf16 units emulates bf16 slowly; the crossing bytes
    are given for bf16, the GPU prefix's dtype).
    Returns ``{"dtype", "cameras", "results": [{family, checkpoint, camera_size, tokens, preprocess_ms,
    vision_ms, vision_block_ms, vision_depth, hidden_bytes, side_bytes, handoff_bytes, side}]}``. Raises
    ValueError for an unknown family."""
    import torch

    from ...model.checkpoint import open_checkpoint
    from ...model.contract import side_bytes
    from ...model.vlm import run_processor
    from ...split.verify import bag_images

    from ...model.checkpoint import parse_dtype

    dtype = parse_dtype(dtype_name)
    families = list(PUBLISHED) if families is None else families
    bad = [f for f in families if f not in PUBLISHED]
    if bad:
        raise ValueError(f"unknown families {bad}; use {', '.join(PUBLISHED)}")
    out = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for family in families:
            name, _, _, _, size = PUBLISHED[family]
            path, depth = _build(family, Path(tmp))
            ck = open_checkpoint(path, cameras=6, camera_size=size)
            cfg = ck.model
            processor = ck.split_model().processor()
            images = bag_images(6, size)
            pre = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                inputs = run_processor(processor, images, cfg.prompt)
                pre.append((time.perf_counter() - t0) * 1e3)
            front = ck.load("prefix", 0, dtype=dtype)
            inputs = inputs.to("cpu", dtype)
            front(inputs)  # warm-up
            whole, block = [], []
            blocks = _vision_blocks(front.vlm)
            times = []
            hook = [b.register_forward_pre_hook(lambda m, a: times.append(time.perf_counter())) for b in blocks]
            hook += [b.register_forward_hook(lambda m, a, o: times.append(time.perf_counter())) for b in blocks]
            for _ in range(repeats):
                times.clear()
                t0 = time.perf_counter()
                front(inputs)
                whole.append((time.perf_counter() - t0) * 1e3)
                block.append((times[1] - times[0]) * 1e3 if len(times) >= 2 else 0.0)
            for h in hook:
                h.remove()
            b = statistics.median(block)
            vision = statistics.median(whole) + b * (depth - 1)
            hidden = cfg.num_tokens * cfg.hidden_size * 2
            side = side_bytes(cfg, torch.bfloat16)
            row = {"family": family, "checkpoint": name, "camera_size": list(size), "tokens": cfg.num_tokens,
                   "preprocess_ms": statistics.median(pre), "vision_ms": vision, "vision_block_ms": b,
                   "vision_depth": depth, "hidden_bytes": hidden, "side_bytes": side, "handoff_bytes": hidden + side,
                   "side": list(cfg.side)}
            out.append(row)
            log(f"  {family}: T {row['tokens']}, preprocess {row['preprocess_ms']:.1f} ms, vision {vision:.0f} ms "
                f"({depth} x {b:.1f} ms), {row['handoff_bytes'] / 1e6:.2f} MB crossing")
            del front
    return {"dtype": dtype_name, "handoff_dtype": "bf16", "cameras": 6, "results": out}


def _vision_blocks(front) -> list:
    """The vision tower's block modules of a VLM front (the ModuleList of its encoder layers)."""
    from torch import nn

    best = []
    for name, module in front.named_modules():
        if isinstance(module, nn.ModuleList) and ("visual" in name or "vision" in name) and len(module) >= 1:
            if not best or len(name) < len(best[0]):
                best = [name, module]
    return list(best[1]) if best else []


def markdown(part: dict) -> str:
    """The part as a markdown table."""
    lines = [f"\n**VLM families**, 6 cameras of the embedded bag, the front in {part['dtype']} on the CPU, published "
             "vision shapes (one block timed, counted for the tower's depth): the family's processor, its front, what "
             f"crosses (h_K in {part.get('handoff_dtype', 'bf16')} and the side tensors).",
             "", "| family (checkpoint) | camera px | T | preprocess ms | vision ms | crossing MB | side tensors |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in part["results"]:
        lines.append(f"| {r['family']} ({r['checkpoint']}) | {r['camera_size'][0]} x {r['camera_size'][1]} | "
                     f"{r['tokens']} | {r['preprocess_ms']:.1f} | {r['vision_ms']:.0f} | "
                     f"{r['handoff_bytes'] / 1e6:.2f} | {', '.join(r['side']) or '-'} |")
    return "\n".join(lines)
