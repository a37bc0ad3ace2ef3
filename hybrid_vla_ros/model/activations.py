"""Activation memory (bytes) of one frame's forward pass of a stage: the tensors alive together at each moment.

The planner's memory columns add the peak phase to the weights; each model kind (:mod:`.kinds`) says which phases
its stages go through. Sizes follow the shapes in the code as written, in inference mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: Name -> torch dtype for the planner's dtype arguments.
_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def element_size(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``dtype`` ('fp32' / torch.float16 / ...). Raises ValueError for an unknown name."""
    if isinstance(dtype, str):
        if dtype.lower() not in _NAMES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
        dtype = _NAMES[dtype.lower()]
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass
class Phase:
    """One moment of a forward pass: the tensors alive together, name -> bytes; ``total`` is their sum."""

    name: str
    live: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.live.values())


def llm_dims(cfg) -> dict[str, int]:
    """The LLM's sizes: widths H, Hq, Hkv, head_dim hd, MLP I, passes B, tokens T."""
    llm = cfg.llm
    heads = int(llm["num_attention_heads"])
    head_dim = int(llm.get("head_dim") or cfg.hidden_size // heads)
    kv = int(llm.get("num_key_value_heads") or heads)
    return {"H": cfg.hidden_size, "Hq": heads * head_dim, "Hkv": kv * head_dim, "hd": head_dim,
            "I": int(llm["intermediate_size"]), "B": cfg.llm_passes, "T": cfg.num_tokens}


def llm_block_phases(cfg, e: int, held: dict[str, int], label: str) -> list[Phase]:
    """Phases of one LLM decoder block (transformers LlamaDecoderLayer / Qwen2DecoderLayer, SDPA) at N = B*T
    tokens; ``held``: bytes the caller keeps alive meanwhile.

    RMSNorm works in float32: 8*H bytes a token whatever the dtype. Attention peaks at q's rotary embedding;
    GQA runs inside SDPA (``enable_gqa``), so k/v are never repeated, and SDPA's output and its contiguous copy
    come after q's raw copy is freed (smaller). The MLP peaks at act(gate) * up, with the block input (in
    ``held``), the post-attention residual and its normalised copy alive.
    """
    d = llm_dims(cfg)
    n = d["B"] * d["T"]
    rotary = 2 * d["T"] * d["hd"] * e  # cos, sin tables (1, T, head_dim) in the model dtype
    base = dict(held, rotary_tables=rotary)
    return [
        Phase(f"{label}.rmsnorm", {**base, "norm_fp32_work": 8 * n * d["H"]}),
        Phase(f"{label}.attention", {**base, "normed": n * d["H"] * e, "q_raw": n * d["Hq"] * e,
                                     "q_rotary_work": 3 * n * d["Hq"] * e, "k_v": 2 * n * d["Hkv"] * e}),
        Phase(f"{label}.mlp", {**base, "residual": n * d["H"] * e, "normed": n * d["H"] * e,
                               "act_up_product": 3 * n * d["I"] * e}),
    ]


def llm_prefix_phases(cfg, e: int, split_layer: int, first: list[Phase], held: dict[str, int] | None = None
                      ) -> list[Phase]:
    """A prefix's phases: its front's (``first``), then up to two decoder blocks, with h_0 (``run_blocks``'
    argument) and ``held`` (the caller's input, e.g. the pixels) alive throughout."""
    d = llm_dims(cfg)
    state = d["B"] * d["T"] * d["H"] * e
    phases = list(first)
    for i in range(min(split_layer, 2)):
        kept = {**(held or {}), "h0": state, **({"block_input": state} if i >= 1 else {})}
        phases += llm_block_phases(cfg, e, kept, f"llm.block{i}")
    return phases


def llm_suffix_phases(cfg, e: int, split_layer: int, tail: Phase) -> list[Phase]:
    """A suffix's phases: up to two decoder blocks from ``split_layer``, then ``tail`` (final norm or a head)."""
    d = llm_dims(cfg)
    state = d["B"] * d["T"] * d["H"] * e
    phases = []
    for i in range(min(cfg.num_layers - split_layer, 2)):
        held = {"block_input": state} if i >= 1 else {}
        phases += llm_block_phases(cfg, e, held, f"llm.block{split_layer + i}")
    return phases + [tail]


def norm_phase(cfg, e: int) -> Phase:
    """The final norm of a bare LM or VLM suffix: its output state and float32 working copies."""
    d = llm_dims(cfg)
    n = d["B"] * d["T"]
    return Phase("norm", {"block_output": n * d["H"] * e, "norm_fp32_work": 8 * n * d["H"]})


def head_phase(cfg) -> Phase:
    """A planning head on the last token of each pass (float32)."""
    last = llm_dims(cfg)["B"] * cfg.hidden_size * 4
    return Phase("head", {"last_token_states": 2 * last, "head_hidden": 2 * last})


def token_embed_phase(cfg, e: int) -> Phase:
    """A bare LM's embedding of its T token ids."""
    d = llm_dims(cfg)
    return Phase("embed", {"token_ids": d["T"] * 8, "embeddings": d["B"] * d["T"] * d["H"] * e})


def own_front_phases(cfg, e: int) -> list[Phase]:
    """This package's vision side, projector and embeddings, in ``e``-byte elements; every phase counts the
    pixels (C*3*S*S), which the caller holds throughout.

    Vision: one block's attention (fused SDPA writes (B, T, heads, d), so the transpose back is free) and MLP,
    with the patch convolution counting oneDNN's reordered weight copy. Query projector: nn.MultiheadAttention's
    packed k|v and its contiguous copy; query heads leave out the earlier frames' memory (about 1 MB).

    Not modelled: O(T) softmax statistics, per-thread SDPA tiles and GEMM packing buffers, cuDNN workspaces (in
    the CUDA overhead allowance), allocator rounding. On the CPU in fp32 the estimate is within 0.2 % of the peak
    :func:`hybrid_vla_ros.split.profiler.measure_peak_cpu_bytes` measures for ``tiny`` and ``smol``
    (test/test_planner.py).
    """
    d = llm_dims(cfg)
    H = d["H"]
    state = d["B"] * d["T"] * H * e
    phases: list[Phase] = []
    C, S = cfg.n_cameras, cfg.image_size
    v = cfg.vision
    llava = cfg.projector["type"] == "llava"
    patch = int(v["patch_size"])
    # vision tokens per camera as the tower computes them (CLIP adds a class token; LLaVA selects from them)
    P = (S // patch) ** 2 + int(v.get("model_type") == "clip_vision_model")
    Dv, Mv = int(v["hidden_size"]), int(v["intermediate_size"])
    N = C * P
    tok = N * Dv * e
    pixels = {"pixels": C * 3 * S * S * e}
    conv_weight = Dv * 3 * patch * patch * e
    phases.append(Phase("vision.patch_conv", {**pixels, "conv_weight_reorder": conv_weight, "patch_conv": tok}))
    phases.append(Phase("vision.embeddings", {**pixels, "patch_conv": tok, "position_embedding": P * Dv * e,
                                              "embeddings": tok}))
    nv = int(v["num_hidden_layers"])
    block_in = {"block_input": tok} if nv >= 2 else {}
    held_v = {**pixels, "embeddings_x0": tok, **block_in}
    if llava:  # LLaVA reads hidden states of inner layers: the tower keeps every layer's output (all but one held)
        held_v = {**pixels, "hidden_states_kept": nv * tok}
    if cfg.vision_type == "eva02":  # EVA-02 (model/eva02.py): windows cut from a zero-padded grid, rotary q / k,
        # SwiGLU (w1 and w2 outputs and their product live together), no final norm
        w, g = int(v["window_size"]), S // patch
        gp = g + (-g) % w if w and any(i not in v["global_blocks"] for i in range(nv)) else g
        tok_p = C * gp * gp * Dv * e
        phases.append(Phase("vision.block.attention", {**held_v, "ln1": tok, "windows": tok_p, "q_k_v": 3 * tok_p,
                                                       "rotary": 2 * tok_p, "sdpa_out": tok_p, "out_proj": tok_p}))
        phases.append(Phase("vision.block.mlp", {**held_v, "residual": tok, "ln2": tok, "swiglu": 3 * N * Mv * e}))
        phases.append(Phase("vision.tokens", {**pixels, "encoder_out": tok, "tokens": tok}))
    else:
        phases.append(Phase("vision.block.attention", {**held_v, "ln1": tok, "q_k_v": 3 * tok, "sdpa_out": tok,
                                                       "out_proj": tok}))
        phases.append(Phase("vision.block.mlp", {**held_v, "residual": tok, "ln2": tok,
                                                 "fc1_gelu": 2 * N * Mv * e}))
        phases.append(Phase("vision.post_layernorm", {**pixels, "embeddings_x0": tok, "encoder_out": tok,
                                                      "post_ln": tok}))
    V = cfg.num_vision_tokens
    if llava:
        layers = cfg.projector["vision_feature_layer"]
        n_feat = len(layers) if isinstance(layers, list) else 1
        phases.append(Phase("projector.mlp", {**pixels, "hidden_states_kept": (nv + 1) * tok,
                                              "selected_features": V * Dv * n_feat * e, "mlp": 3 * V * H * e}))
    elif cfg.projector["type"] == "query":
        Q = V
        phases.append(Phase("projector.cross_attention", {**pixels, "memory": tok, "kv_proj": 2 * tok,
                                                          "kv_contiguous": 2 * tok, "queries": 3 * Q * Dv * e}))
        phases.append(Phase("projector.mlp", {**pixels, "memory": tok, "queries": Q * Dv * e,
                                              "mlp": 2 * Q * H * e}))
    elif cfg.projector["type"] == "scene_queries":
        hc = cfg.scene_heads_config
        E, Q = hc.embed_dims, hc.num_extra + hc.num_lane  # the map head has the most queries
        K = Q + hc.map_memory_len
        # while the 3-D position embedding runs: the feature maps and its MLP's hidden layer (N x 4E); while a
        # head's cross-attention runs: the projected features, their position embedding, keys with it, the k / v
        # projections, and the queries' working set (tgt, positions, q, output, FFN) with the self-attention mask
        phases.append(Phase("projector.position_embedding", {**pixels, "feature_maps": tok,
                                                             "rays_hidden": N * 4 * E * e, "pos_embed": N * E * e}))
        phases.append(Phase("projector.query_heads", {
            **pixels, "feature_maps": tok, "pos_embed": N * E * e, "features": N * E * e, "keys": N * E * e,
            "kv_proj": 2 * N * E * e, "queries": 6 * Q * E * e + Q * hc.feedforward_dims * e, "self_attn_mask": Q * K,
            "tokens": V * H * e}))
    else:
        phases.append(Phase("projector.mlp", {**pixels, "vision_features": tok, "mlp": 2 * N * H * e}))
    T = d["T"]
    text = len(cfg.prompt_token_ids) + (sum(map(len, cfg.pass_prompt_token_ids)) if getattr(
        cfg, "pass_prompt_token_ids", None) else 1)  # each pass's own prompt, or the planning token
    emb = {**pixels, "vision_tokens": V * H * e, "text_embeddings": text * H * e,
           "ego_token": int(cfg.ego_state_input) * H * e, "concat": T * H * e}
    if d["B"] > 1:
        emb["pass_embedded"] = state
    phases.append(Phase("embed", emb))
    return phases


def vlm_front_phases(cfg, e: int, state: int) -> list[Phase]:
    """A transformers VLM front's live tensors, estimated from the config (tower internals differ per family;
    ``hybrid-vla profile`` measures): the vision tower's widest block, then the T token embeddings."""
    v = cfg.vlm.get("vision_config", {})
    Dv = int(v.get("hidden_size") if "embed_dim" not in v else v["embed_dim"])
    Mv = int(v.get("intermediate_size") or Dv * float(v.get("mlp_ratio", 4)))
    N = max(int(cfg.vision_patches), 1)
    tok = N * Dv * e
    pixels = {"pixels": N * 3 * int(v.get("patch_size", 14) if not isinstance(v.get("patch_size"), list)
                                   else v["patch_size"][0]) ** 2 * 2 * e}
    from .contract import side_bytes

    side = side_bytes(cfg, {1: torch.int8, 2: torch.float16, 4: torch.float32}[e])
    return [Phase("vision.block", {**pixels, "block_input": tok, "q_k_v": 3 * tok, "mlp": N * Mv * e}),
            Phase("embed", {"vision_features": tok, "token_embeddings": state, "merged": state, "side_tensors": side})]


