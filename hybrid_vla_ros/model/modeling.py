"""A driving VLA as an ordered list of blocks, and its partition at a split layer K.

Forward pass of one frame (one prefill, no autoregressive decode)::

    pixels (C, 3, S, S) --vision encoder--> (C, P, Dv) --projector--> (V, H)   vision tokens
    prompt ids (p,)     --embed_tokens-->                             (p, H)   text tokens
    ego state (3,)      --ego_embed-->                                (1, H)   ego token (optional)
    planning token id   --embed_tokens-->                             (1, H)   waypoint query
    concat -> hidden states h_0 (T, H), T = p + V + [1] + 1
    [two LLM passes: h_0 (2, T, H) = h_0 + pass_embed[pass]]
    h_{i+1} = decoder_block_i(h_i)  for i in [0, L)     (transformers LlamaDecoderLayer / Qwen2DecoderLayer)
    modes (M, N, 2) = planning_head(final_norm(h_L)[..., T-1, :])   (ego frame, metres, at dt .. N*dt)
    waypoints (N, 2) = modes[navigation command]                    (M = 1: the only mode)

V is C*P with the MLP projector, the query count with the query projector (:class:`QueryProjector`).

Split layer K in [0, L]: the *prefix* runs the vision encoder, the projector, the embeddings and
decoder blocks [0, K); the *suffix* runs blocks [K, L), the final norm and the planning head.

What crosses the split: only the hidden states h_K, shape (T, H) (or (2, T, H) with two passes), in
the model dtype. Everything else the suffix needs is a function of T alone and is recomputed there:
  * position ids are ``arange(T)`` (one prefill from position 0), so the rotary (cos, sin) tables
    are rebuilt from T;
  * the attention mask is plain causal over the T tokens (``is_causal`` in SDPA), no padding;
  * the planning token is always the last token, index T-1.
The ego state enters at the embedding, so it travels inside h_K; the navigation command only picks
the planner mode, so the suffix takes it directly. No KV cache crosses either: block i's keys and
values are computed from h_i inside block i and are never needed by another block. A KV cache only
pays off for autoregressive decoding, which the planning pass does not do.

Layout and naming follow transformers' ``modeling_llama.py`` (a plain ``layers`` ModuleList of
decoder blocks, ``norm``, ``embed_tokens``); the vision side is transformers' SigLIP vision
transformer, the MLP projector LLaVA's two-layer MLP (Liu et al., 2023, "Visual Instruction
Tuning"). The planning head reads the last hidden state of a waypoint token as in Orion
(Fu et al., 2025), here with a plain MLP regressing per-step displacements for each mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config, SiglipVisionConfig, SiglipVisionModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from .config import EGO_FEATURES, NAV_COMMANDS, VLAConfig

#: transformers classes of each LLM family: (config, decoder block, RMS norm, rotary embedding).
LLM_FAMILIES = {
    "llama": (LlamaConfig, LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding),
}
#: Default navigation command (index into NAV_COMMANDS): LANE_FOLLOW.
DEFAULT_COMMAND = NAV_COMMANDS.index("LANE_FOLLOW")


class PlanningHead(nn.Module):
    """MLP from the planning token's last hidden state to ego-frame waypoints of M modes.

    Input: (H,) hidden state after the final norm. Output: float32 waypoints (M, N, 2) in metres,
    x forward, y left (REP 103 base_link), at times dt, 2dt, ... N*dt. The MLP predicts per-step
    displacements; their cumulative sum gives positions, so the first waypoint is one step away
    from the ego origin.
    """

    def __init__(self, hidden_size: int, n_waypoints: int, n_modes: int = 1):
        super().__init__()
        self.n_waypoints, self.n_modes = n_waypoints, n_modes
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_size, n_modes * n_waypoints * 2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(H,) -> waypoints (M, N, 2) float32 metres (cumulative displacements)."""
        deltas = self.fc2(self.act(self.fc1(h))).float()
        return torch.cumsum(deltas.unflatten(-1, (self.n_modes, self.n_waypoints, 2)), dim=-2)


class QueryProjector(nn.Module):
    """Q learned queries read all cameras' patch tokens, then an MLP maps them to the LLM width.

    Input: vision features (C, P, Dv). Output: (Q, H) tokens. Each of ``num_layers`` torch
    ``TransformerDecoderLayer`` (pre-norm, GELU, MLP 4*Dv) lets the queries attend to each other and
    cross-attend to the C*P patch tokens. This has the token count and width of Orion's QT-Former
    (513 tokens of width 4096); the published module's internals are not reproduced.
    """

    def __init__(self, vision_width: int, hidden_size: int, num_queries: int, num_layers: int, num_heads: int):
        super().__init__()
        self.queries = nn.Parameter(torch.empty(num_queries, vision_width))
        nn.init.normal_(self.queries, std=0.02)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(vision_width, num_heads, 4 * vision_width, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(num_layers))
        self.mlp = nn.Sequential(nn.Linear(vision_width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(C, P, Dv) -> (Q, H)."""
        memory = features.flatten(0, 1).unsqueeze(0)
        x = self.queries.unsqueeze(0)
        for layer in self.layers:
            x = layer(x, memory)
        return self.mlp(x.squeeze(0))


def llm_config(cfg: VLAConfig):
    """transformers config (LlamaConfig or Qwen2Config) of the checkpoint's LLM, attention pinned to SDPA."""
    conf_cls = LLM_FAMILIES[cfg.llm_type][0]
    llm = conf_cls(**{k: v for k, v in cfg.llm.items() if k != "model_type"})
    # SDPA with attention_mask=None is causal; "eager" with no mask would not be. Pin it.
    llm._attn_implementation = "sdpa"
    return llm


def _vision_config(cfg: VLAConfig) -> SiglipVisionConfig:
    vision = SiglipVisionConfig(**cfg.vision)
    vision._attn_implementation = "sdpa"
    return vision


def _add_prefix_side(m: nn.Module, cfg: VLAConfig, llm) -> None:
    """Attach the modules before block 0 to ``m``: ``vision``, ``projector``, ``embed_tokens``, and
    ``ego_embed`` / ``pass_embed`` when the config asks for them."""
    vision = _vision_config(cfg)
    m.vision = SiglipVisionModel(vision)
    h = llm.hidden_size
    if cfg.projector["type"] == "query":
        q = cfg.projector
        m.projector = QueryProjector(vision.hidden_size, h, q["num_queries"], q["num_layers"], q["num_heads"])
    else:
        m.projector = nn.Sequential(nn.Linear(vision.hidden_size, h), nn.GELU(), nn.Linear(h, h))
    m.embed_tokens = nn.Embedding(llm.vocab_size, h)
    if cfg.ego_state_input:
        m.ego_embed = nn.Linear(len(EGO_FEATURES), h)
    if cfg.llm_passes > 1:
        m.pass_embed = nn.Embedding(cfg.llm_passes, h)


def _add_suffix_side(m: nn.Module, cfg: VLAConfig, llm) -> None:
    """Attach the modules after block L-1: ``norm``, ``head`` and, with two passes, ``decision_head``."""
    m.norm = LLM_FAMILIES[cfg.llm_type][2](llm.hidden_size, eps=llm.rms_norm_eps)
    m.head = PlanningHead(llm.hidden_size, cfg.n_waypoints, cfg.n_modes)
    if cfg.llm_passes > 1:
        m.decision_head = nn.Linear(llm.hidden_size, len(NAV_COMMANDS))


def _blocks(cfg: VLAConfig, llm, start: int, stop: int) -> nn.ModuleList:
    block_cls = LLM_FAMILIES[cfg.llm_type][1]
    return nn.ModuleList(block_cls(llm, i) for i in range(start, stop))


class VLAModel(nn.Module):
    """The whole model (monolithic reference). Parameter names are the checkpoint's keys.

    Children: ``vision`` (SigLIP vision transformer), ``projector`` (MLP or :class:`QueryProjector`,
    Dv -> H), ``embed_tokens`` (vocab, H), ``ego_embed`` (3 -> H, optional), ``pass_embed`` (passes,
    H, optional), ``layers`` (L decoder blocks), ``norm`` (RMSNorm), ``head`` (PlanningHead),
    ``decision_head`` (H -> 6, two passes only), ``rotary_emb`` (no weights).
    """

    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.cfg = cfg
        llm = llm_config(cfg)
        _add_prefix_side(self, cfg, llm)
        self.layers = _blocks(cfg, llm, 0, cfg.num_layers)
        _add_suffix_side(self, cfg, llm)
        self.rotary_emb = LLM_FAMILIES[cfg.llm_type][3](llm)

    def forward(self, pixel_values: torch.Tensor, ego_state: torch.Tensor | None = None,
                command: int = DEFAULT_COMMAND) -> torch.Tensor:
        """Pixels (C, 3, S, S) in the model dtype, ego state (3,) (when the model takes it), command
        index 0..5 -> waypoints (N, 2) float32 metres."""
        h = embed(self, pixel_values, ego_state)
        h = run_blocks(self, self.layers, h)
        return plan(self, h, command).waypoints


def check_ego_state(cfg: VLAConfig, ego_state: torch.Tensor | None) -> None:
    """Raise ValueError unless ``ego_state`` fits the model: None when it takes none, else (3,) finite."""
    if not cfg.ego_state_input:
        if ego_state is not None:
            raise ValueError("this model takes no ego state")
        return
    if ego_state is None:
        raise ValueError(f"this model takes the ego state ({', '.join(EGO_FEATURES)})")
    if tuple(ego_state.shape) != (len(EGO_FEATURES),) or not torch.isfinite(ego_state).all():
        raise ValueError(f"ego state must be {len(EGO_FEATURES)} finite values, got {ego_state.tolist()}")


def embed(m: nn.Module, pixel_values: torch.Tensor, ego_state: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states before block 0: (C, 3, S, S) pixels [+ ego state (3,)] -> (T, H) or (2, T, H).

    ``m`` provides ``vision``, ``projector``, ``embed_tokens`` (and ``ego_embed`` / ``pass_embed``
    when configured) and ``cfg``. All cameras go through the vision encoder as one batch. Raises
    ValueError if the camera count or size is not the checkpoint's, or the ego state does not fit
    (:func:`check_ego_state`).
    """
    cfg: VLAConfig = m.cfg
    expected = (cfg.n_cameras, 3, cfg.image_size, cfg.image_size)
    if tuple(pixel_values.shape) != expected:
        raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} != expected {expected}")
    check_ego_state(cfg, ego_state)
    vis = m.vision(pixel_values=pixel_values).last_hidden_state  # (C, P, Dv)
    vis = m.projector(vis) if cfg.projector["type"] == "query" else m.projector(vis.flatten(0, 1))  # (V, H)
    ids = torch.tensor(cfg.prompt_token_ids + [cfg.planning_token_id], device=vis.device)
    text = m.embed_tokens(ids)
    parts = [text[:-1], vis]
    if ego_state is not None:
        parts.append(m.ego_embed(ego_state.to(device=vis.device, dtype=vis.dtype).unsqueeze(0)))
    parts.append(text[-1:])
    h = torch.cat(parts, dim=0)
    if cfg.llm_passes > 1:
        h = h.unsqueeze(0) + m.pass_embed.weight.unsqueeze(1)  # (passes, T, H)
    return h


def run_blocks(m: nn.Module, layers: nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """Run decoder blocks over hidden states (T, H) or (B, T, H) -> same shape, causal, positions 0..T-1.

    The rotary tables come from ``m.rotary_emb`` and depend only on T: this is why positions need
    not cross the split.
    """
    if len(layers) == 0:
        return h
    x = h if h.dim() == 3 else h.unsqueeze(0)
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    cos_sin = m.rotary_emb(x, positions)
    for block in layers:
        x = block(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    return x if h.dim() == 3 else x.squeeze(0)


@dataclass
class PlanOutput:
    """Planner output of one frame.

    waypoints: (N, 2) float32 metres, the mode the command selected. modes: (M, N, 2) float32, all
    modes. decision_logits: (6,) float32 logits over NAV_COMMANDS from the decision pass (two-pass
    models), else None. mode: index of the selected mode in ``modes`` (``waypoints == modes[mode]``).
    """

    waypoints: torch.Tensor
    modes: torch.Tensor
    decision_logits: torch.Tensor | None = None
    mode: int = 0


def plan(m: nn.Module, h: torch.Tensor, command: int = DEFAULT_COMMAND) -> PlanOutput:
    """Final norm and planning head on hidden states (T, H) / (2, T, H) -> :class:`PlanOutput`.

    ``command``: navigation command index 0..5 (NAV_COMMANDS); it picks the mode of a 6-mode planner
    and is ignored by a 1-mode one. Raises ValueError for a command out of range.
    """
    if isinstance(command, bool) or not 0 <= int(command) < len(NAV_COMMANDS):
        raise ValueError(f"navigation command index {command!r} out of range [0, {len(NAV_COMMANDS)})")
    last = m.norm(h[..., -1, :])
    decision = None
    if last.dim() == 2:  # two passes: decision pass first, action pass last
        decision = m.decision_head(last[0]).float()
        last = last[-1]
    modes = m.head(last)
    mode = int(command) if modes.shape[0] > 1 else 0
    return PlanOutput(modes[mode], modes, decision, mode)


class PrefixStage(nn.Module):
    """Vision encoder, projector, embeddings and decoder blocks [0, K).

    ``forward(pixel_values (C, 3, S, S), ego_state (3,) | None) -> hidden states h_K`` of shape
    ``cfg.prefix_state_shape`` in the stage dtype on the stage device. ``layers`` holds the K owned
    blocks (their ``layer_idx`` keeps the global index).
    """

    role = "prefix"

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        _add_prefix_side(self, cfg, llm)
        self.layers = _blocks(cfg, llm, 0, split_layer)
        self.rotary_emb = LLM_FAMILIES[cfg.llm_type][3](llm)

    def checkpoint_key(self, local_key: str) -> str:
        """Map a key of this stage's state dict to the checkpoint's key."""
        return _shift_layer_key(local_key, 0)

    def forward(self, pixel_values: torch.Tensor, ego_state: torch.Tensor | None = None) -> torch.Tensor:
        """Pixels (C, 3, S, S) in the stage dtype [+ ego state (3,)] -> hidden states h_K.
        Raises ValueError on a wrong shape or ego state."""
        return run_blocks(self, self.layers, embed(self, pixel_values, ego_state))

    def move_split(self, split_layer: int, load_blocks) -> None:
        """Re-split in place: own blocks [0, split_layer) from now on.

        Moving K up appends blocks [K, K') made by ``load_blocks(start, stop) -> nn.ModuleList`` (on this
        stage's device and dtype); moving it down drops blocks [K', K) so their memory can be returned.
        Raises ValueError for a split layer out of range.
        """
        check_split_layer(self.cfg, split_layer)
        if split_layer > self.split_layer:
            self.layers.extend(load_blocks(self.split_layer, split_layer))
        else:
            del self.layers[split_layer:]
        self.split_layer = split_layer


class SuffixStage(nn.Module):
    """Decoder blocks [K, L), final norm and planning head.

    ``forward(h_K, command) -> waypoints (N, 2)`` float32 metres, ego frame. The input may be a
    zero-copy view of a shared-memory slot; it is only read.
    """

    role = "suffix"

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        self.layers = _blocks(cfg, llm, split_layer, cfg.num_layers)
        _add_suffix_side(self, cfg, llm)
        self.rotary_emb = LLM_FAMILIES[cfg.llm_type][3](llm)

    def checkpoint_key(self, local_key: str) -> str:
        """Map a key of this stage's state dict to the checkpoint's key."""
        return _shift_layer_key(local_key, self.split_layer)

    def plan_all(self, hidden_states: torch.Tensor, command: int = DEFAULT_COMMAND,
                 split_layer: int | None = None) -> PlanOutput:
        """Hidden states h_K -> :class:`PlanOutput` (all modes, decision logits).

        ``split_layer``: the K the hidden states were computed at (default: this stage's); blocks [K, L)
        run. Raises ValueError on a wrong shape or command, or a K below the first block this stage holds
        (never computed with a mismatched K).
        """
        expected = self.cfg.prefix_state_shape
        if tuple(hidden_states.shape) != expected:
            raise ValueError(f"hidden states shape {tuple(hidden_states.shape)} != expected {expected}")
        k = self.split_layer if split_layer is None else split_layer
        if isinstance(k, bool) or not self.split_layer <= k <= self.cfg.num_layers:
            raise ValueError(f"hidden states at split layer {k}: this suffix holds blocks "
                             f"[{self.split_layer}, {self.cfg.num_layers})")
        layers = self.layers if k == self.split_layer else self.layers[k - self.split_layer:]
        return plan(self, run_blocks(self, layers, hidden_states), command)

    def move_split(self, split_layer: int, load_blocks) -> None:
        """Re-split in place: own blocks [split_layer, L) from now on.

        Moving K down prepends blocks [K', K) made by ``load_blocks(start, stop) -> nn.ModuleList``; moving
        it up drops blocks [K, K') so their memory can be returned. Raises ValueError for a K out of range.
        """
        check_split_layer(self.cfg, split_layer)
        if split_layer < self.split_layer:
            self.layers = nn.ModuleList([*load_blocks(split_layer, self.split_layer), *self.layers])
        else:
            self.layers = self.layers[split_layer - self.split_layer:]
        self.split_layer = split_layer

    def forward(self, hidden_states: torch.Tensor, command: int = DEFAULT_COMMAND,
                split_layer: int | None = None) -> torch.Tensor:
        """Hidden states h_K -> waypoints (N, 2) float32 m of the command's mode; see :meth:`plan_all`."""
        return self.plan_all(hidden_states, command, split_layer).waypoints


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


def parameter_counts(cfg: VLAConfig) -> dict[str, int]:
    """Parameters per part of the model, counted on the meta device (no memory, any size).

    Keys: ``vision``, ``projector``, ``llm`` (embed_tokens, decoder blocks, final norm: the LLM as
    built here), ``lm_head`` (vocab x H when the published LLM has an untied LM head, which the
    planning pass does not need and the model does not build; 0 when tied), ``llm_published``
    (llm + lm_head: what model cards report), ``planner`` (ego / pass embeddings and heads),
    ``total`` (everything built).
    """
    with torch.device("meta"):
        model = VLAModel(cfg)
    counts = {"vision": 0, "projector": 0, "llm": 0, "planner": 0}
    part = {"vision": "vision", "projector": "projector", "embed_tokens": "llm", "layers": "llm", "norm": "llm"}
    for name, p in model.named_parameters():
        counts[part.get(name.split(".", 1)[0], "planner")] += p.numel()
    tied = bool(cfg.llm.get("tie_word_embeddings", False))
    counts["lm_head"] = 0 if tied else cfg.hidden_size * int(cfg.llm["vocab_size"])
    counts["llm_published"] = counts["llm"] + counts["lm_head"]
    counts["total"] = counts["vision"] + counts["projector"] + counts["llm"] + counts["planner"]
    return counts
