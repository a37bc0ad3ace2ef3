"""A driving VLA as an ordered list of blocks, and its partition at a split layer K.

Forward pass of one frame (one prefill, no autoregressive decode)::

    pixels (C, 3, S, S) --vision encoder--> (C, P, Dv) --projector--> (C*P, H)  vision tokens
    prompt ids (p,)     --embed_tokens-->                              (p, H)    text tokens
    planning token id   --embed_tokens-->                              (1, H)    waypoint query
    concat -> hidden states h_0 (T, H), T = p + C*P + 1
    h_{i+1} = decoder_block_i(h_i)  for i in [0, L)        (transformers LlamaDecoderLayer, causal)
    waypoints (N, 2) = planning_head(final_norm(h_L)[T-1])  (ego frame, metres, at dt, 2dt, ... N*dt)

Split layer K in [0, L]: the *prefix* runs the vision encoder, the projector, the embeddings and
decoder blocks [0, K); the *suffix* runs blocks [K, L), the final norm and the planning head.

What crosses the split: only the hidden states h_K, shape (T, H), in the model dtype. Everything
else the suffix needs is a function of T alone and is recomputed on the suffix side:
  * position ids are ``arange(T)`` (one prefill from position 0), so the rotary (cos, sin) tables
    are rebuilt from T;
  * the attention mask is plain causal over the T tokens (``is_causal`` in SDPA), no padding;
  * the planning token is always the last token, index T-1.
No KV cache crosses either: block i's keys and values are computed from h_i inside block i and
are never needed by another block. A KV cache only pays off for autoregressive decoding, which the
planning pass does not do, so the suffix gets everything it needs from h_K.

Layout and naming follow transformers' ``modeling_llama.py`` (a plain ``layers`` ModuleList of
decoder blocks, ``norm``, ``embed_tokens``); the vision side is transformers' SigLIP vision
transformer, the projector a LLaVA-style two-layer MLP (Liu et al., 2023, "Visual Instruction
Tuning"). The planning head reads the last hidden state of a waypoint token as in Orion
(Fu et al., 2025), here with a plain MLP regressing per-step displacements.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, SiglipVisionConfig, SiglipVisionModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from .config import VLAConfig


class PlanningHead(nn.Module):
    """MLP from the planning token's last hidden state to ego-frame waypoints.

    Input: (H,) or (B, H) hidden state after the final norm. Output: float32 waypoints
    (N, 2) or (B, N, 2) in metres, x forward, y left (REP 103 base_link), at times dt, 2dt, ... N*dt.
    The MLP predicts per-step displacements; their cumulative sum gives positions, so the first
    waypoint is one step away from the ego origin.
    """

    def __init__(self, hidden_size: int, n_waypoints: int):
        super().__init__()
        self.n_waypoints = n_waypoints
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_size, n_waypoints * 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(H,) or (B, H) -> waypoints (N, 2) or (B, N, 2) float32 metres (cumulative displacements)."""
        deltas = self.fc2(self.act(self.fc1(h))).float()
        deltas = deltas.unflatten(-1, (self.n_waypoints, 2))
        return torch.cumsum(deltas, dim=-2)


def _llama_config(cfg: VLAConfig) -> LlamaConfig:
    llm = LlamaConfig(**cfg.llm)
    # SDPA with attention_mask=None is causal; "eager" with no mask would not be. Pin it.
    llm._attn_implementation = "sdpa"
    return llm


def _vision_config(cfg: VLAConfig) -> SiglipVisionConfig:
    vision = SiglipVisionConfig(**cfg.vision)
    vision._attn_implementation = "sdpa"
    return vision


def _add_vision_side(m: nn.Module, cfg: VLAConfig, llm: LlamaConfig) -> None:
    """Attach ``vision``, ``projector`` and ``embed_tokens`` (the modules before block 0) to ``m``."""
    vision = _vision_config(cfg)
    m.vision = SiglipVisionModel(vision)
    m.projector = nn.Sequential(
        nn.Linear(vision.hidden_size, llm.hidden_size), nn.GELU(), nn.Linear(llm.hidden_size, llm.hidden_size)
    )
    m.embed_tokens = nn.Embedding(llm.vocab_size, llm.hidden_size)


class VLAModel(nn.Module):
    """The whole model (monolithic reference). Parameter names are the checkpoint's keys.

    Children: ``vision`` (SigLIP vision transformer), ``projector`` (Linear-GELU-Linear, Dv -> H),
    ``embed_tokens`` (vocab, H), ``layers`` (L LlamaDecoderLayer), ``norm`` (LlamaRMSNorm),
    ``head`` (PlanningHead), ``rotary_emb`` (no weights).
    """

    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.cfg = cfg
        llm = _llama_config(cfg)
        _add_vision_side(self, cfg, llm)
        self.layers = nn.ModuleList(LlamaDecoderLayer(llm, i) for i in range(llm.num_hidden_layers))
        self.norm = LlamaRMSNorm(llm.hidden_size, eps=llm.rms_norm_eps)
        self.head = PlanningHead(llm.hidden_size, cfg.n_waypoints)
        self.rotary_emb = LlamaRotaryEmbedding(llm)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixels (C, 3, S, S) float in the model dtype -> waypoints (N, 2) float32 metres."""
        h = embed(self, pixel_values)
        h = run_blocks(self, self.layers, h)
        return plan(self, h)


def embed(m: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    """Hidden states before block 0: (C, 3, S, S) pixels -> (T, H), T = p + C*P + 1.

    ``m`` provides ``vision``, ``projector``, ``embed_tokens`` and ``cfg``. All cameras go through
    the vision encoder as one batch. Raises ValueError if the camera count or size is not the
    checkpoint's.
    """
    cfg: VLAConfig = m.cfg
    expected = (cfg.n_cameras, 3, cfg.image_size, cfg.image_size)
    if tuple(pixel_values.shape) != expected:
        raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} != expected {expected}")
    vis = m.vision(pixel_values=pixel_values).last_hidden_state  # (C, P, Dv)
    vis = m.projector(vis.flatten(0, 1))  # (C*P, H)
    ids = torch.tensor(cfg.prompt_token_ids + [cfg.planning_token_id], device=vis.device)
    text = m.embed_tokens(ids)
    return torch.cat([text[:-1], vis, text[-1:]], dim=0)


def run_blocks(m: nn.Module, layers: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """Run decoder blocks over hidden states (T, H) -> (T, H), causal, positions 0..T-1.

    The rotary tables come from ``m.rotary_emb`` and depend only on T: this is why positions need
    not cross the split.
    """
    if len(layers) == 0:
        return h
    x = h.unsqueeze(0)
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    cos_sin = m.rotary_emb(x, positions)
    for block in layers:
        x = block(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    return x.squeeze(0)


def plan(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Final norm and planning head on hidden states (T, H) -> waypoints (N, 2) float32 metres."""
    return m.head(m.norm(h[-1]))


class PrefixStage(nn.Module):
    """Vision encoder, projector, embeddings and decoder blocks [0, K).

    ``forward(pixel_values (C, 3, S, S)) -> hidden states h_K (T, H)`` in the stage dtype on the
    stage device. ``layers`` holds the K owned blocks (their ``layer_idx`` keeps the global index).
    """

    role = "prefix"

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = _llama_config(cfg)
        _add_vision_side(self, cfg, llm)
        self.layers = nn.ModuleList(LlamaDecoderLayer(llm, i) for i in range(split_layer))
        self.rotary_emb = LlamaRotaryEmbedding(llm)

    def checkpoint_key(self, local_key: str) -> str:
        """Map a key of this stage's state dict to the checkpoint's key."""
        return _shift_layer_key(local_key, 0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixels (C, 3, S, S) in the stage dtype -> hidden states h_K (T, H). Raises ValueError on a wrong shape."""
        return run_blocks(self, self.layers, embed(self, pixel_values))


class SuffixStage(nn.Module):
    """Decoder blocks [K, L), final norm and planning head.

    ``forward(h_K (T, H)) -> waypoints (N, 2)`` float32 metres, ego frame. The input may be a
    zero-copy view of a shared-memory slot; it is only read.
    """

    role = "suffix"

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = _llama_config(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(llm, i) for i in range(split_layer, cfg.num_layers))
        self.norm = LlamaRMSNorm(llm.hidden_size, eps=llm.rms_norm_eps)
        self.head = PlanningHead(llm.hidden_size, cfg.n_waypoints)
        self.rotary_emb = LlamaRotaryEmbedding(llm)

    def checkpoint_key(self, local_key: str) -> str:
        """Map a key of this stage's state dict to the checkpoint's key."""
        return _shift_layer_key(local_key, self.split_layer)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states h_K (T, H) -> waypoints (N, 2) float32 m. Raises ValueError on a wrong shape."""
        expected = self.cfg.prefix_state_shape
        if tuple(hidden_states.shape) != expected:
            raise ValueError(f"hidden states shape {tuple(hidden_states.shape)} != expected {expected}")
        return plan(self, run_blocks(self, self.layers, hidden_states))


def check_split_layer(cfg: VLAConfig, split_layer: int) -> None:
    """Raise ValueError unless 0 <= split_layer <= L (an int, not a bool)."""
    if isinstance(split_layer, bool) or not isinstance(split_layer, int):
        raise ValueError(f"split_layer must be an integer, got {split_layer!r}")
    if not 0 <= split_layer <= cfg.num_layers:
        raise ValueError(f"split_layer {split_layer} out of range [0, {cfg.num_layers}] for this model")


def _shift_layer_key(key: str, offset: int) -> str:
    if key.startswith("layers."):
        _, idx, rest = key.split(".", 2)
        return f"layers.{int(idx) + offset}.{rest}"
    return key
