"""A driving VLA as an ordered list of blocks, and its partition at a split layer K.

Forward pass of one frame (one prefill; a model that decodes continues in :mod:`.decode`)::

    pixels (C, 3, S, S) --vision encoder--> (C, P, Dv) --projector--> (V, H)   vision tokens
    prompt ids (p,)     --embed_tokens-->                             (p, H)   text tokens
    ego state (3,)      --ego_embed-->                                (1, H)   ego token (optional)
    planning token id   --embed_tokens-->                             (1, H)   waypoint query
    concat -> hidden states h_0 (T, H), T = p + V + [1] + 1
    [two LLM passes: h_0 (2, T, H) = h_0 + pass_embed[pass], or each pass's own text after the vision tokens
     (``pass_prompt_token_ids``, MindDrive's two prompts), the shorter padded at its end to T]
    h_{i+1} = decoder_block_i(h_i)  for i in [0, L)     (the LLM family's own transformers decoder block)
    modes (M, N, 2) = planning_head(final_norm(h_L)[..., t, :])   (ego frame, metres, at dt .. N*dt)
                      t = the planning token's position (T-1 unless the prompts put it elsewhere)
    waypoints (N, 2) = modes[navigation command]                    (M = 1: the only mode)

Split layer K in [0, L]: the *prefix* runs the vision encoder, projector, embeddings and blocks [0, K); the
*suffix* runs blocks [K, L), the final norm and the planning head. Only h_K crosses, (T, H) or (2, T, H) in the
model dtype: positions (``arange(T)``), the causal mask (a pass padded at its end needs none) and the read-out
positions follow from T and the config; the ego state travels inside h_K, the navigation command goes to the
suffix directly, and no KV cache is needed (block i's keys and values are used only inside block i).

Layout and naming follow transformers' ``modeling_llama.py``; the vision side is transformers' SigLIP, the MLP
projector LLaVA's (Liu et al., 2023, "Visual Instruction Tuning"); the planning head reads a waypoint token's last
hidden state as in Orion (Fu et al., 2025), with a plain MLP regressing per-step displacements for each mode.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel

from . import text
from .config import EGO_FEATURES, NAV_COMMANDS, SCENE_QUERIES, LMConfig, VLAConfig
from .eva02 import EVA02_TYPE
from .stages import PlanOutput, PrefixSide, SuffixSide, _shift_layer_key, check_split_layer

if TYPE_CHECKING:  # imported where used: the annotation only names it
    from .contract import SplitState
    from .query_heads import SceneInputs

#: Default navigation command (index into NAV_COMMANDS): LANE_FOLLOW.
DEFAULT_COMMAND = NAV_COMMANDS.index("LANE_FOLLOW")


class PlanningHead(nn.Module):
    """MLP from the planning token's final-norm state (H,) to float32 waypoints (M, N, 2) in metres, x forward,
    y left (REP 103 base_link), at dt .. N*dt: the cumulative sum of predicted per-step displacements.

    Untrained (``init-model``'s random heads), the output layer is :data:`UNTRAINED_OUTPUT_SCALE` times torch's
    default initialisation, without bias: centimetres of noise around the ego ("stay here") instead of ~0.5 m
    random steps, a zigzag the output guard rejects as too sharp a turn. Loaded weights replace it.
    """

    #: Factor on torch's default initialisation of the output layer of an untrained head (see above).
    UNTRAINED_OUTPUT_SCALE = 0.05

    def __init__(self, hidden_size: int, n_waypoints: int, n_modes: int = 1):
        super().__init__()
        self.n_waypoints, self.n_modes = n_waypoints, n_modes
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_size, n_modes * n_waypoints * 2)
        with torch.no_grad():
            self.fc2.weight.mul_(self.UNTRAINED_OUTPUT_SCALE)
            self.fc2.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(H,) -> (M, N, 2) float32 metres."""
        deltas = self.fc2(self.act(self.fc1(h))).float()
        return torch.cumsum(deltas.unflatten(-1, (self.n_modes, self.n_waypoints, 2)), dim=-2)


class QueryHead(nn.Module):
    """Waypoints from N learned query tokens appended to the sequence, one step each (SimLingo's read-out shape):
    ``proj`` Linear(H, 2 M) on each query's final-norm state gives that step's displacement per mode. Output and
    untrained initialisation as :class:`PlanningHead`'s."""

    def __init__(self, hidden_size: int, n_waypoints: int, n_modes: int = 1):
        super().__init__()
        self.n_waypoints, self.n_modes = n_waypoints, n_modes
        self.proj = nn.Linear(hidden_size, 2 * n_modes)
        with torch.no_grad():
            self.proj.weight.mul_(PlanningHead.UNTRAINED_OUTPUT_SCALE)
            self.proj.bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (M, N, 2) float32 metres."""
        steps = self.proj(h).float().unflatten(-1, (self.n_modes, 2)).transpose(0, 1)  # (M, N, 2)
        return torch.cumsum(steps, dim=-2)


def own_head(cfg: VLAConfig, hidden_size: int) -> nn.Module:
    """The read-out head of ``cfg.readout`` (types: :class:`~.config.VLAConfig`). A ``module`` class is imported
    only with the model-code opt-in (:func:`~.extension.import_head_class`), built ``cls(hidden_size=H,
    n_waypoints=N, n_modes=M, **config)`` and must map the (T, H) final states to (M, N, 2); raises
    CheckpointError when ``readout.config`` does not fit it."""
    kind = cfg.readout_type
    if kind == "queries":
        return QueryHead(hidden_size, cfg.n_waypoints, cfg.n_modes)
    if kind == "vae":
        from .vae_planner import VAEPlanner

        return VAEPlanner(hidden_size, cfg.n_waypoints, cfg.n_modes)
    if kind == "vae_speed_path":
        from .vae_planner import SpeedPathPlanner

        return SpeedPathPlanner(hidden_size, cfg.n_waypoints, len(cfg.decision_token_ids),
                                int(cfg.readout["path_points"]), cfg.n_modes)
    if kind == "module":
        from .extension import import_head_class

        from .sources import CheckpointError

        cls = import_head_class(cfg.readout["class"])
        try:
            return cls(hidden_size=hidden_size, n_waypoints=cfg.n_waypoints, n_modes=cfg.n_modes,
                       **cfg.readout.get("config", {}))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"readout.config does not fit {cfg.readout['class']}: {e}") from None
    return PlanningHead(hidden_size, cfg.n_waypoints, cfg.n_modes)


class QueryProjector(nn.Module):
    """Q learned queries read all cameras' patch tokens in ``num_layers`` pre-norm torch
    ``TransformerDecoderLayer``s (GELU, MLP 4*Dv), then an MLP maps them to the LLM width: (C, P, Dv) -> (Q, H).
    The token count and width of Orion's QT-Former (513 x 4096); the published module's internals are not
    reproduced."""

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


#: Attention projections that carry a per-pass low-rank delta (MindDrive's LoRA targets: q/k/v/o).
PASS_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class PassLoRALinear(nn.Module):
    """A linear layer shared by P LLM passes, each adding its own LoRA delta: x (P, T, in), row p = pass p, in the
    layer's dtype -> ``y[p] = x[p] @ W^T + b + (x[p] @ A[p]^T) @ B[p]^T`` (P, T, out), pass p's merged weight up
    to rounding. Raises ValueError when the batch is not P.

    ``weight`` (out, in) / ``bias`` keep ``nn.Linear``'s checkpoint names; ``lora_A`` (P, r, in) and ``lora_B``
    (P, out, r) are the adapters', with ``lora_alpha / r`` folded into ``lora_B`` (Hu et al., 2021, "LoRA", eq. 3;
    peft's ``LoraLayer.scaling``).
    """

    def __init__(self, linear: nn.Linear, passes: int, rank: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.passes, self.rank = passes, rank
        self.weight = linear.weight
        self.bias = linear.bias
        self.lora_A = nn.Parameter(torch.zeros(passes, rank, self.in_features, dtype=linear.weight.dtype))
        self.lora_B = nn.Parameter(torch.zeros(passes, self.out_features, rank, dtype=linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(P, T, in) -> (P, T, out)."""
        if x.dim() != 3 or x.shape[0] != self.passes:
            raise ValueError(f"a per-pass LoRA layer takes (passes={self.passes}, T, {self.in_features}), "
                             f"got {tuple(x.shape)}")
        base = nn.functional.linear(x, self.weight, self.bias)
        return base + torch.bmm(torch.bmm(x, self.lora_A.transpose(1, 2)), self.lora_B.transpose(1, 2))


def add_pass_lora_(block: nn.Module, passes: int, rank: int) -> nn.Module:
    """Replace a decoder block's q/k/v/o projections (:data:`PASS_LORA_TARGETS`) by :class:`PassLoRALinear`
    (same base weights, zero deltas until loaded). Returns the block."""
    attn = block.self_attn
    for name in PASS_LORA_TARGETS:
        setattr(attn, name, PassLoRALinear(getattr(attn, name), passes, rank))
    return block


def llm_config(cfg: VLAConfig):
    """transformers config of the checkpoint's LLM, attention pinned (:func:`text.text_config`); a VLM whose forward
    builds masks with both-ways blocks keeps its text model's bidirectional flag (:func:`vlm.block_mask_rule`)."""
    from .vlm import block_mask_rule

    return text.text_config(cfg.llm, both_ways=block_mask_rule(getattr(cfg, "vlm_type", None)) is not None)


def llm_family(cfg: VLAConfig) -> text.TextFamily:
    """transformers' classes of the checkpoint's LLM family (:func:`text.text_family`)."""
    return text.text_family(cfg.llm_type)


def _vision_config(cfg: VLAConfig):
    """transformers config of the vision encoder (SigLIP, or a LLaVA tower's ``vision.model_type``), SDPA attention."""
    if "model_type" in cfg.vision:
        from transformers import AutoConfig

        kwargs = {k: v for k, v in cfg.vision.items() if k != "model_type"}
        vision = AutoConfig.for_model(cfg.vision["model_type"], **kwargs)
    else:
        vision = SiglipVisionConfig(**cfg.vision)
    vision._attn_implementation = "sdpa"
    return vision


def _llava_config(cfg: VLAConfig, vision, llm):
    """A transformers LlavaConfig for LlavaMultiModalProjector, on copies of ``vision`` / ``llm``: LlavaConfig resets
    their attention implementation, and eager attention is not causal without a mask."""
    import copy

    from transformers import LlavaConfig

    p = cfg.projector
    return LlavaConfig(vision_config=copy.deepcopy(vision), text_config=copy.deepcopy(llm),
                       image_token_index=p["image_token_index"],
                       projector_hidden_act=p["projector_hidden_act"],
                       vision_feature_select_strategy=p["vision_feature_select_strategy"],
                       vision_feature_layer=p["vision_feature_layer"],
                       multimodal_projector_bias=p["multimodal_projector_bias"])


def _add_prefix_side(m: nn.Module, cfg: VLAConfig, llm) -> None:
    """Attach the modules before block 0: ``vision`` (:mod:`.eva02` or SigLIP), ``projector``, ``embed_tokens``,
    optional ``ego_embed`` / ``pass_embed``; with a LLaVA projector ``vision_tower`` and ``multi_modal_projector``
    under LLaVA's names, so the directory's tensors load unchanged."""
    h = llm.hidden_size
    if cfg.vision_type == EVA02_TYPE:
        from .eva02 import EVA02Config, EVA02ViT

        m.vision = EVA02ViT(EVA02Config.from_dict(cfg.vision))
        width = m.vision.cfg.hidden_size
        if cfg.projector["type"] == SCENE_QUERIES:
            from .camera_rays import RayEmbeddingConfig
            from .query_heads import QueryHeads

            heads = cfg.scene_heads_config
            rays = RayEmbeddingConfig(embed_dims=heads.embed_dims, stride=int(cfg.vision["patch_size"]))
            m.projector = QueryHeads(heads, rays)
    elif cfg.projector["type"] == "llava":
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        vision = _vision_config(cfg)
        m.vision_tower = AutoModel.from_config(vision)
        m.multi_modal_projector = LlavaMultiModalProjector(_llava_config(cfg, vision, llm))
    else:
        vision = _vision_config(cfg)
        m.vision = SiglipVisionModel(vision)
        width = vision.hidden_size
    if cfg.projector["type"] == "query":
        q = cfg.projector
        m.projector = QueryProjector(width, h, q["num_queries"], q["num_layers"], q["num_heads"])
    elif cfg.projector["type"] == "mlp":
        m.projector = nn.Sequential(nn.Linear(width, h), nn.GELU(), nn.Linear(h, h))
    m.embed_tokens = text.make_embedding(llm_family(cfg), llm)
    _add_query_tokens(m, cfg, h)
    if cfg.ego_state_input:
        m.ego_embed = nn.Linear(len(EGO_FEATURES), h)
    if cfg.llm_passes > 1 and not cfg.pass_lora_rank:
        m.pass_embed = nn.Embedding(cfg.llm_passes, h)


def _add_query_tokens(m: nn.Module, cfg, hidden_size: int) -> None:
    """A ``queries`` read-out's ``query_tokens`` (N, H), drawn N(0, 1) as transformers draws token embeddings so
    they weigh in the attention like the prompt's tokens."""
    if isinstance(cfg, VLAConfig) and cfg.query_count:
        m.query_tokens = nn.Parameter(torch.randn(cfg.query_count, hidden_size))


def _add_suffix_side(m: nn.Module, cfg: VLAConfig, llm) -> None:
    """Attach ``norm`` and, unless ``cfg.planning_head`` is false, ``head`` and a ``decision_head`` if any."""
    m.norm = text.make_norm(llm_family(cfg), llm)
    if not cfg.planning_head:
        return
    m.head = own_head(cfg, llm.hidden_size)
    if cfg.decision_token_ids:
        # the LM head's rows of the meta-action tokens only (MindDrive's decision read-out)
        m.decision_head = nn.Linear(llm.hidden_size, len(cfg.decision_token_ids), bias=False)
    elif cfg.llm_passes > 1:
        m.decision_head = nn.Linear(llm.hidden_size, len(NAV_COMMANDS))


def _blocks(cfg: VLAConfig, llm, start: int, stop: int) -> nn.ModuleList:
    """Decoder blocks [start, stop) of the LLM family (their ``layer_idx`` the global index). Raises
    RuntimeError unless the config pins the attention implementation :func:`run_blocks` builds masks for."""
    want = text.attention_implementation(llm_family(cfg))
    if llm._attn_implementation != want:
        raise RuntimeError(f"decoder blocks need {want} attention (the masks run_blocks builds are for it), the "
                           f"config has {llm._attn_implementation!r}")
    blocks = text.make_blocks(llm_family(cfg), llm, start, stop)
    rank = getattr(cfg, "pass_lora_rank", 0)
    if rank:
        return nn.ModuleList(add_pass_lora_(block, cfg.llm_passes, rank) for block in blocks)
    return blocks


class VLAModel(nn.Module):
    """The whole model (monolithic reference); parameter names are the checkpoint's keys. Children: see
    :func:`_add_prefix_side`, ``layers`` (L blocks), :func:`_add_suffix_side`, ``rotary_emb`` (no weights)."""

    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.cfg = cfg
        llm = llm_config(cfg)
        _add_prefix_side(self, cfg, llm)
        self.layers = _blocks(cfg, llm, 0, cfg.num_layers)
        _add_suffix_side(self, cfg, llm)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def checkpoint_key(self, local_key: str) -> str:
        """The monolithic model's keys are the checkpoint's (canonical) keys."""
        return local_key

    def forward(self, pixel_values: torch.Tensor, ego_state: torch.Tensor | None = None,
                command: int = DEFAULT_COMMAND, *, scene=None) -> torch.Tensor:
        """Pixels (C, 3, S, S) in the model dtype [+ ego state, scene], command 0..5 -> waypoints (N, 2) float32 m."""
        h = embed(self, pixel_values, ego_state, scene=scene)
        h = run_blocks(self, self.layers, h, embedded=True)
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


def check_scene(cfg: VLAConfig, scene) -> None:
    """Raise ValueError unless ``scene`` fits the model: a :class:`~.query_heads.SceneInputs` with one (4, 4)
    geometry per camera for a ``scene_queries`` model, None for any other."""
    if cfg.projector.get("type") != SCENE_QUERIES:
        if scene is not None:
            raise ValueError("this model takes no scene inputs (camera geometry, ego frame)")
        return
    if scene is None:
        raise ValueError("this model's query heads need each frame's camera geometry and ego frame (SceneInputs)")
    if tuple(scene.lidar2img.shape) != (cfg.n_cameras, 4, 4):
        raise ValueError(f"scene lidar2img must be ({cfg.n_cameras}, 4, 4), got {tuple(scene.lidar2img.shape)}")


def example_scene(cfg) -> "SceneInputs | None":
    """Made-up scene inputs (:func:`~hybrid_vla_ros.model.query_heads.example_scene_inputs`) for checks without a
    vehicle, for a ``scene_queries`` model; None for any other. Never for driving."""
    if not isinstance(cfg, VLAConfig) or cfg.projector.get("type") != SCENE_QUERIES:
        return None
    from .query_heads import example_scene_inputs

    return example_scene_inputs(cfg.n_cameras, cfg.image_size)


def embed(m: nn.Module, pixel_values: torch.Tensor, ego_state: torch.Tensor | None = None, *,
          scene=None, out=None) -> torch.Tensor:
    """Hidden states before block 0: (C, 3, S, S) pixels [+ ego state (3,)] -> (T, H) or (2, T, H).

    ``m`` provides ``cfg`` and the modules of :func:`_add_prefix_side`; all cameras go through the vision encoder
    as one batch. ``scene``: the frame's :class:`~hybrid_vla_ros.model.query_heads.SceneInputs` for a
    ``scene_queries`` model (its heads keep a memory of earlier frames), else None. ``out``: None, or the
    destination (a tensor of the result's shape, dtype and device, or a callable returning one, called just before
    the last op), written by that op, bit for bit as without ``out``. Raises ValueError for another camera count or
    size, or an ego state or scene that does not fit.
    """
    cfg: VLAConfig = m.cfg
    expected = (cfg.n_cameras, 3, cfg.image_size, cfg.image_size)
    if tuple(pixel_values.shape) != expected:
        raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} != expected {expected}")
    check_ego_state(cfg, ego_state)
    check_scene(cfg, scene)
    if cfg.projector["type"] == "llava":
        *parts, text = _llava_parts(m, cfg, pixel_values)
        vis = text
    else:
        if cfg.projector["type"] == SCENE_QUERIES:  # the query heads read the feature maps, with their memory
            vis = m.projector(m.vision.feature_map(pixel_values), scene.lidar2img, scene.frame).tokens  # (V, H) fp32
            vis = vis.to(m.embed_tokens.weight.dtype)  # the heads compute in float32 whatever the stage's dtype
        else:
            vis = m.vision(pixel_values=pixel_values)  # (C, P, Dv): EVA-02 gives the tensor, SigLIP an output
            vis = vis if isinstance(vis, torch.Tensor) else vis.last_hidden_state
            vis = m.projector(vis) if cfg.projector["type"] == "query" else m.projector(vis.flatten(0, 1))  # (V, H)
        if cfg.pass_prompt_token_ids:  # each pass's own text after the vision tokens (MindDrive's two prompts)
            return _embed_pass_prompts(m, cfg, vis, out)
        reads = len(cfg.readout_token_ids)  # the planning token (and MindDrive's path token after it)
        ids = torch.tensor(cfg.prompt_token_ids + cfg.readout_token_ids, device=vis.device)
        text = m.embed_tokens(ids)
        parts = [text[:-reads], vis]
    if ego_state is not None:
        parts.append(m.ego_embed(ego_state.to(device=vis.device, dtype=vis.dtype).unsqueeze(0)))
    if not cfg.decode:  # a decoding model places its read-out tokens after the decode
        parts.append(m.query_tokens if cfg.query_count else text[-len(cfg.readout_token_ids):])
    if cfg.llm_passes > 1 and cfg.pass_lora_rank:  # same tokens for each pass; the adapters tell them apart
        h = torch.cat(parts, dim=0).unsqueeze(0).expand(cfg.llm_passes, -1, -1)
        return h.contiguous() if out is None else _destination(out).copy_(h)
    if cfg.llm_passes > 1:
        h = torch.cat(parts, dim=0)
        if out is None:
            return h.unsqueeze(0) + m.pass_embed.weight.unsqueeze(1)  # (passes, T, H)
        return torch.add(h.unsqueeze(0), m.pass_embed.weight.unsqueeze(1), out=_destination(out))
    return torch.cat(parts, dim=0) if out is None else torch.cat(parts, dim=0, out=_destination(out))


def _embed_pass_prompts(m: nn.Module, cfg: VLAConfig, vis: torch.Tensor, out) -> torch.Tensor:
    """:func:`embed` with one prompt per pass (``cfg.pass_prompt_token_ids``) after the vision tokens ``vis``
    (V, H): (P, T, H), or (T, H) with one pass."""
    T = cfg.num_tokens
    head = m.embed_tokens(torch.tensor(cfg.prompt_token_ids, dtype=torch.long, device=vis.device))
    rows = []
    for ids in cfg.pass_prompt_token_ids:
        padded = ids + [ids[-1]] * (T - len(cfg.prompt_token_ids) - vis.shape[0] - len(ids))
        tail = m.embed_tokens(torch.tensor(padded, dtype=torch.long, device=vis.device))
        rows.append(torch.cat([head, vis, tail], dim=0))
    h = torch.stack(rows)
    if cfg.llm_passes > 1 and not cfg.pass_lora_rank:
        h = h + m.pass_embed.weight.unsqueeze(1)
    if cfg.llm_passes == 1:
        h = h[0]
    return h if out is None else _destination(out).copy_(h)


def _destination(out) -> torch.Tensor:
    return out() if callable(out) else out


def block_forward_into(block: nn.Module, x: torch.Tensor, out, *, position_ids, position_embeddings,
                       attention_mask=None) -> torch.Tensor:
    """One transformers decoder block (no cache, SDPA) on ``x`` (B, T, H), its last residual add written into
    ``out`` (as :func:`embed`'s, called after the MLP); returns it. Step for step transformers 5.x
    ``LlamaDecoderLayer.forward`` (shared by Qwen2, Qwen3, Mistral, Phi-3); :func:`output_into_is_exact` checks it
    against the installed family, and another layout (Gemma's extra norms) fails, so its runner copies."""
    residual = x
    h = block.input_layernorm(x)
    h, _ = block.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                           position_embeddings=position_embeddings)
    h = residual + h
    residual = h
    h = block.mlp(block.post_attention_layernorm(h))
    return torch.add(residual, h, out=_destination(out))


@torch.inference_mode()
def output_into_is_exact(stage: nn.Module, seed: int = 0, attempts: int = 3) -> bool:
    """True when ``run_blocks(..., out=)`` matches the stage's blocks without it bit for bit, on its last block
    and random hidden states of the state shape (stage dtype and device); True without blocks. False: the
    installed block no longer matches :func:`block_forward_into`, so copy instead. ``attempts``: runs before
    concluding, as the BLAS may split a GEMM over other thread counts per run (MKL on a busy machine), changing
    the last bits; another formula never matches. False for a hybrid family (its blocks run as its forward hands
    them inputs, :func:`_run_captured`, then the result is copied)."""
    if llm_family(stage.cfg).captured:
        return False
    if len(stage.layers) == 0:
        return True
    param = next(stage.parameters())
    shape = stage.cfg.prefix_state_shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(device=param.device, dtype=param.dtype)
    last = stage.layers[-1:]
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for _ in range(attempts):
        expected = run_blocks(stage, last, x)
        try:
            got = run_blocks(stage, last, x, out=torch.empty_like(x))
        except (AttributeError, TypeError):  # a block without the LLaMA layout's parts
            return False
        if torch.equal(expected.view(bits), got.view(bits)):  # bit for bit, a NaN (bad weights) included
            return True
    return False


def llava_image_features(m: nn.Module, cfg: VLAConfig, pixel_values: torch.Tensor) -> torch.Tensor:
    """LLaVA's image features, (C, 3, S, S) pixels -> (C, P, H), as transformers'
    ``LlavaModel.get_image_features``: the tower's hidden states at ``vision_feature_layer`` (a list: concatenated
    on the feature axis), minus the first token with the ``default`` strategy, through ``multi_modal_projector``."""
    p = cfg.projector
    states = m.vision_tower(pixel_values=pixel_values, output_hidden_states=True).hidden_states
    layers = p["vision_feature_layer"]
    picked = [states[i] for i in (layers if isinstance(layers, list) else [layers])]
    if p["vision_feature_select_strategy"] == "default":
        picked = [x[:, 1:] for x in picked]
    return m.multi_modal_projector(torch.cat(picked, dim=-1))


def _llava_parts(m: nn.Module, cfg: VLAConfig, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    """Prompt pieces with each image placeholder replaced by its camera's features, in order; the last entry
    is the embedded token ids (the planning token's row is its last) for the caller."""
    feats = llava_image_features(m, cfg, pixel_values)  # (C, P, H)
    ids = cfg.prompt_token_ids + [cfg.planning_token_id]
    text = m.embed_tokens(torch.tensor(ids, device=feats.device))
    placeholder = cfg.projector["image_token_index"]
    parts, start, cam = [], 0, 0
    for j, token in enumerate(cfg.prompt_token_ids):
        if token == placeholder:
            parts += [text[start:j], feats[cam]]
            start, cam = j + 1, cam + 1
    parts.append(text[start:len(cfg.prompt_token_ids)])
    return parts + [text]


def llava_input_ids(cfg: VLAConfig) -> list[int]:
    """The token ids transformers' LlavaForConditionalGeneration takes for this layout (each image placeholder
    repeated P times, as LLaVA's processor does), then the planning token; only without ego / pass embeddings."""
    placeholder = cfg.projector["image_token_index"]
    out = []
    for token in cfg.prompt_token_ids:
        out += [token] * (cfg.tokens_per_camera if token == placeholder else 1)
    return out + [cfg.planning_token_id]


def _kind(block: nn.Module, kinds: list[str]) -> str:
    return kinds[text.block_index(block)]


def run_blocks(m: nn.Module, layers: nn.ModuleList, h: torch.Tensor, *, out=None, state=None,
               cache=None, embedded: bool = False) -> torch.Tensor:
    """Run decoder blocks over hidden states (T, H) or (B, T, H) -> same shape.

    Masks and rotary tables are the family's, as its base model builds them (:func:`text.block_inputs`: causal,
    or sliding-window per block; rotary from ``m.rotary_emb``), from positions 0..T-1 -- or, with ``state`` (a
    :class:`~hybrid_vla_ros.model.contract.SplitState`), from its multimodal ``position_ids``, adding its DeepStack
    features after each block that has a level (:func:`vlm.deepstack_add`), and its cross-attention tensors to the
    cross-attention blocks (Mllama; without them those blocks are skipped, as ``MllamaTextModel.forward`` skips
    them for text alone). ``out``: as :func:`embed`'s (called after the last block's MLP), written by the last
    residual add (:func:`block_forward_into`), or copied into with DeepStack levels left, a cross-attention block
    last or no blocks; returns ``out`` then. ``cache``: this side's KV cache (:mod:`.decode`): the blocks read and
    extend it, positions continue after what it holds. ``embedded``: ``h`` is the token embeddings (a prefix): a
    hybrid family's forward may change given embeddings before block 0, and h_0 is block 0's input.
    """
    if len(layers) == 0 and not embedded:
        return h if out is None else _destination(out).copy_(h)
    config = m.rotary_emb.config
    family = text.text_family(config.model_type)
    if family.captured:
        x = h if h.dim() == 3 else h.unsqueeze(0)
        y = _run_captured(family, m.rotary_emb, layers, x, state, cache, embedded)
        y = y if h.dim() == 3 else y.squeeze(0)
        return y if out is None else _destination(out).copy_(y)
    if len(layers) == 0:
        return h if out is None else _destination(out).copy_(h)
    x = h if h.dim() == 3 else h.unsqueeze(0)
    kinds = text.attention_kinds(config)
    positions = state.position_ids if state is not None else None
    cross = None
    if state is not None and state.cross_states is not None:
        cross = {"cross_attention_states": state.cross_states, "cross_attention_mask": state.cross_mask,
                 "full_text_row_masked_out_mask": state.cross_rows}
    elif any(_kind(b, kinds) == text.CROSS for b in layers):  # no vision states: the text model skips these
        layers = [b for b in layers if _kind(b, kinds) != text.CROSS]
        if not layers:
            return h if out is None else _destination(out).copy_(h)
    first = {}
    for b in layers:
        first.setdefault(_kind(b, kinds), text.block_index(b))
    blocks_of_images = state.image_blocks if state is not None else None
    rule = None
    if blocks_of_images is not None:
        from .vlm import block_mask_rule

        rule = block_mask_rule(m.cfg.vlm_type)
    inputs = text.block_inputs(config, m.rotary_emb, x, set(first), positions, cache=cache, first_layer=first,
                               image_blocks=blocks_of_images, block_rule=rule, cross=cross)
    deep = state.deepstack if state is not None else None
    levels = 0 if deep is None else deep.shape[0]
    if out is not None and (text.block_index(layers[-1]) < levels or _kind(layers[-1], kinds) == text.CROSS):
        y = run_blocks(m, layers, h, state=state, cache=cache)
        return _destination(out).copy_(y)
    last = len(layers) - 1 if out is not None else len(layers)
    for block in layers[:last]:
        x = block(x, **inputs.for_block(block, _kind(block, kinds)))
        i = text.block_index(block)
        if i < levels:
            from .vlm import deepstack_add

            x = deepstack_add(x, state.visual_mask, deep[i])
    if out is None:
        return x if h.dim() == 3 else x.squeeze(0)
    dest = []

    def batched():  # the caller's (T, H) destination seen as the blocks' (1, T, H)
        dest.append(_destination(out))
        return dest[0] if dest[0].dim() == 3 else dest[0].unsqueeze(0)

    block = layers[last]
    block_forward_into(block, x, batched, **inputs.for_block(block, _kind(block, kinds)))
    return dest[0]


def _run_captured(family, rotary, layers, x: torch.Tensor, state, cache, embedded: bool) -> torch.Tensor:
    """:func:`run_blocks` for a hybrid family (:attr:`text.TextFamily.captured`): each block gets what the family's
    own forward hands it (:func:`text.captured_block_inputs`); from the embeddings (``embedded``) the blocks start
    from the forward's own block-0 input. Raises ValueError with a KV cache (their recurrent / convolution state is
    not carried across the split)."""
    if cache is not None:
        raise ValueError(f"{family.model_type}: its blocks keep recurrent or convolution state, which a decode across "
                         "the split does not carry yet")
    if x.is_meta:  # FLOP counting: no values to run the family's forward on; the blocks' own arithmetic counts
        return x
    positions = state.position_ids if state is not None else None
    captured = text.captured_block_inputs(family, rotary, x, positions)
    if embedded:
        x = captured.first
    for block in layers:
        x = captured.calls[text.block_index(block)].run(block, x)
    return x


def _check_modes(cfg, modes: torch.Tensor) -> None:
    """Raise ValueError unless a read-out gave (M, N, 2) waypoints (a team's own head may not)."""
    want = (cfg.n_modes, cfg.n_waypoints, 2)
    if tuple(modes.shape) != want:
        raise ValueError(f"the read-out head gave waypoints {tuple(modes.shape)}, the model declares {want} "
                         "(n_modes, n_waypoints, 2)")


def plan(m: nn.Module, h: torch.Tensor, command: int = DEFAULT_COMMAND) -> PlanOutput:
    """Final norm and read-out head on hidden states (T, H) / (2, T, H) -> :class:`PlanOutput`.

    ``command``: navigation command index 0..5; it picks the mode of a 6-mode planner. Two passes: ``h[0]`` is the
    decision pass, ``h[-1]`` the action pass. Tokens are read at ``cfg.readout_positions``, so ``h`` may also be
    the last ``tokens_from_end`` tokens only (a compiled suffix's output); ``queries`` reads the last
    ``query_count`` tokens, ``module`` every token. With ``decision_token_ids`` (one pass or two) the decision is
    the final-norm state at ``decision_position`` times ``decision_head.weight`` (D, H), argmax -> ``speed_mode``.
    The ``vae`` planner (zero noise) works in the published frame (x right, y forward), turned to base_link
    (:func:`~.vae_planner.published_to_base_link`). Raises ValueError for a command out of range, a model
    without a planning head, or a head whose waypoints are not (M, N, 2).
    """
    if isinstance(command, bool) or not 0 <= int(command) < len(NAV_COMMANDS):
        raise ValueError(f"navigation command index {command!r} out of range [0, {len(NAV_COMMANDS)})")
    if not hasattr(m, "head"):
        raise ValueError("this model has no planning head: it gives hidden states, not waypoints "
                         "(attach one with `hybrid-vla init-model --vlm DIR --head FILE OUT`)")
    at = m.cfg.readout_positions
    last = m.norm(h[..., at.planning, :])
    decision = speed = None
    token_ids = getattr(m.cfg, "decision_token_ids", None)
    kind = m.cfg.readout_type
    if kind not in ("mlp", "vae", "vae_speed_path"):  # one pass: (T, H)
        if kind == "queries":
            modes = m.head(m.norm(h[..., -m.cfg.query_count:, :]))
        else:
            modes = m.head(m.norm(h))
        if token_ids:
            decision = m.decision_head(m.norm(h[at.decision, :])).float()
            speed = None if decision.is_meta else int(decision.argmax())
        _check_modes(m.cfg, modes)
        mode = int(command) if modes.shape[0] > 1 else 0
        return PlanOutput(modes[mode], modes, decision, mode, speed)
    if last.dim() == 1 and token_ids:  # one pass with an LM-head decision read-out
        decision = m.decision_head(m.norm(h[at.decision, :])).float()
        speed = None if decision.is_meta else int(decision.argmax())
    if last.dim() == 2:  # two passes: decision pass first, action pass last
        decision = m.decision_head(m.norm(h[0, at.decision, :])).float()
        if token_ids:
            speed = None if decision.is_meta else int(decision.argmax())  # meta: FLOP counting, no values
        last = last[-1]
    if kind == "vae_speed_path":
        action = h[-1] if h.dim() == 3 else h
        return speed_path_plan(m, m.norm(action[[at.planning, at.path]]), int(command), decision, speed)
    modes = m.head(last)
    if kind == "vae":  # the published planner's frame (x right, y forward) -> base_link axes
        from .vae_planner import published_to_base_link

        modes = published_to_base_link(modes)
    mode = int(command) if modes.shape[0] > 1 else 0
    return PlanOutput(modes[mode], modes, decision, mode, speed)


def speed_path_plan(m: nn.Module, states: torch.Tensor, command: int, decision: torch.Tensor | None,
                    speed: int | None) -> PlanOutput:
    """MindDrive's planners (``m.head``, a :class:`~.vae_planner.SpeedPathPlanner`) on the final-norm states (2, H)
    of ``<waypoint_ego>`` and ``<path_waypoint_ego>``: ``modes`` are the decided speed plan (``speed``; 0 when None,
    e.g. on ``meta``) driven along each path mode (:func:`~.vae_planner.follow_path`), ``mode`` the command's
    (:data:`~.vae_planner.PATH_MODE_OF_COMMAND`); base_link axes."""
    from .vae_planner import PATH_MODE_OF_COMMAND, follow_path, published_to_base_link

    speed_modes, path_modes = m.head(states[0], states[1])
    k = speed if speed is not None else 0
    driven = torch.stack([follow_path(speed_modes[k], p) for p in path_modes])  # (Mp, N, 2)
    mode = PATH_MODE_OF_COMMAND[command]
    modes = published_to_base_link(driven)
    return PlanOutput(modes[mode], modes, decision, mode, speed, published_to_base_link(speed_modes[k]),
                      published_to_base_link(path_modes[mode]))


class PrefixStage(PrefixSide):
    """Vision encoder, projector, embeddings and decoder blocks [0, K) (``layer_idx`` global): pixels -> h_K of
    ``cfg.prefix_state_shape`` in the stage dtype on the stage device."""

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        _add_prefix_side(self, cfg, llm)
        self.layers = _blocks(cfg, llm, 0, split_layer)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def forward(self, pixel_values: torch.Tensor, ego_state: torch.Tensor | None = None, *, scene=None,
                out=None, cache=None, chunk_rows: int = 0) -> torch.Tensor:
        """Pixels (C, 3, S, S) in the stage dtype [+ ego state (3,)] [+ scene] -> h_K; a ``scene_queries`` model's
        query-head memory lives in this stage and moves on with every call. ``out`` (e.g. a ring slot's view): as
        :func:`embed`'s, so no copy follows. ``cache``: the prefix's KV cache (a decoding model's prefill);
        ``chunk_rows`` > 0 with it: the blocks run over the tokens that many at a time, each chunk attending to the
        cached ones (as :meth:`VLMPrefixStage.forward`). Raises ValueError on a wrong shape or ego state."""
        if cache is not None:
            h = embed(self, pixel_values, ego_state, scene=scene)
            if chunk_rows <= 0 or chunk_rows >= h.shape[-2] or not len(self.layers):
                return run_blocks(self, self.layers, h, cache=cache)
            return torch.cat([run_blocks(self, self.layers, h[i:i + chunk_rows], cache=cache)
                              for i in range(0, h.shape[-2], chunk_rows)], dim=0)
        if len(self.layers) == 0 and not llm_family(self.cfg).captured:
            return embed(self, pixel_values, ego_state, scene=scene, out=out)
        return run_blocks(self, self.layers, embed(self, pixel_values, ego_state, scene=scene), out=out,
                          embedded=True)

    def step(self, token_ids: torch.Tensor, cache) -> torch.Tensor:
        """A decode step: token ids (k,) int64 -> their h_K rows (k, H), through the token embeddings and blocks
        [0, K) against the prefix's KV cache (positions continue after what it holds)."""
        h = self.embed_tokens(token_ids.to(self.embed_tokens.weight.device))
        return run_blocks(self, self.layers, h, cache=cache)


class SuffixStage(SuffixSide):
    """Decoder blocks [K, L), final norm and planning head. h_K may be a zero-copy view of a shared-memory slot;
    it is only read. Without a planning head (``cfg.planning_head`` false) only :meth:`final_hidden_states` works."""

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        self.layers = _blocks(cfg, llm, split_layer, cfg.num_layers)
        _add_suffix_side(self, cfg, llm)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def _check_shape(self, hidden_states: torch.Tensor) -> None:
        expected = self.cfg.prefix_state_shape
        if tuple(hidden_states.shape) != expected:
            raise ValueError(f"hidden states shape {tuple(hidden_states.shape)} != expected {expected}")

    def final_hidden_states(self, hidden_states: torch.Tensor, split_layer: int | None = None,
                            cache=None) -> torch.Tensor:
        """h_K -> final-norm hidden states of every token, same shape; with ``cache`` (the suffix's KV cache, a
        decoding model) a prefill's h_K or a decode step's rows (k, H). Raises ValueError as :meth:`plan_all`."""
        if cache is not None and hidden_states.dim() == 2 and hidden_states.shape[0] != self.cfg.num_tokens:
            self._check_step(hidden_states)
        else:
            self._check_shape(hidden_states)
        return self.norm(run_blocks(self, self._layers_from(split_layer), hidden_states, cache=cache))

    def _check_step(self, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"decode step rows {tuple(rows.shape)} are not (k, {self.cfg.hidden_size})")

    def step_rows(self, hidden_states: torch.Tensor, cache, split_layer: int | None = None) -> torch.Tensor:
        """A decode step's rows (k, H) through blocks [K, L) against the suffix's KV cache: their hidden states
        before the final norm (what :func:`plan` reads), (k, H)."""
        self._check_step(hidden_states)
        return run_blocks(self, self._layers_from(split_layer), hidden_states, cache=cache)

    def plan_all(self, hidden_states: torch.Tensor, command: int = DEFAULT_COMMAND,
                 split_layer: int | None = None) -> PlanOutput:
        """h_K computed at ``split_layer`` (default this stage's K) -> :class:`PlanOutput`. Raises ValueError on
        a wrong shape, command or K, or when the model has no planning head."""
        self._check_shape(hidden_states)
        return plan(self, run_blocks(self, self._layers_from(split_layer), hidden_states), command)

    def forward(self, hidden_states: torch.Tensor, command: int = DEFAULT_COMMAND,
                split_layer: int | None = None) -> torch.Tensor:
        """h_K -> the command's waypoints (N, 2) float32 m; see :meth:`plan_all`."""
        return self.plan_all(hidden_states, command, split_layer).waypoints


# ------------------------------------------------------------------------- bare language models

class TokenPrefixStage(PrefixSide):
    """A bare language model's prefix: ``embed_tokens`` and ``layers`` [0, K) (transformers' names)."""

    def __init__(self, cfg: LMConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        self.embed_tokens = text.make_embedding(llm_family(cfg), llm)
        self.layers = _blocks(cfg, llm, 0, split_layer)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def forward(self, input_ids: torch.Tensor, cache=None) -> torch.Tensor:
        """Token ids (T,) -> h_K (T, H) in the stage dtype; ``cache``: this side's KV cache (a decode, after the
        tokens it holds). Raises ValueError for ids that are not a 1-D integer tensor inside the vocabulary."""
        vocab = self.embed_tokens.num_embeddings
        if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32) or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty 1-D integer tensor, got {tuple(input_ids.shape)} "
                             f"{input_ids.dtype}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(f"input_ids outside the vocabulary [0, {vocab})")
        return run_blocks(self, self.layers, self.embed_tokens(input_ids.to(self.embed_tokens.weight.device)),
                          cache=cache, embedded=True)


class LMSuffixStage(SuffixSide):
    """A bare language model's suffix: blocks [K, L) and the final norm (transformers' ``last_hidden_state``)."""

    def __init__(self, cfg: LMConfig, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        self.layers = _blocks(cfg, llm, split_layer, cfg.num_layers)
        self.norm = text.make_norm(llm_family(cfg), llm)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def final_hidden_states(self, hidden_states: torch.Tensor, split_layer: int | None = None,
                            cache=None) -> torch.Tensor:
        """h_K (T, H) -> final-norm hidden states (T, H); ``cache`` as the prefix's. Raises ValueError on a wrong
        width or K."""
        if hidden_states.dim() != 2 or hidden_states.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"hidden states shape {tuple(hidden_states.shape)} != (T, {self.cfg.hidden_size})")
        return self.norm(run_blocks(self, self._layers_from(split_layer), hidden_states, cache=cache))

    forward = final_hidden_states


# ----------------------------------------------------------------------------- vision-language models

def vlm_config(cfg):
    """The transformers config of a :class:`~hybrid_vla_ros.model.config.VLMSpec`'s VLM (its family's config
    class), the text model's attention pinned as for a text family (:func:`text.attention_implementation`)."""
    from .vlm import vlm_family

    family = vlm_family(cfg.vlm_type)
    config = family.config_class.from_dict({k: v for k, v in cfg.vlm.items() if k != "model_type"})
    config.text_config._attn_implementation = text.attention_implementation(llm_family(cfg))
    return config


class VLMPrefixStage(PrefixSide):
    """A transformers VLM's front (:func:`vlm.build_front`: vision tower, connector, token embeddings, multimodal
    positions) and the text model's blocks [0, K). State-dict names: the front under ``vlm.`` (its token embeddings
    ``embed_tokens.*`` in the checkpoint, as a text model's), ``layers.{i}``."""

    def __init__(self, cfg, split_layer: int):
        super().__init__()
        from .vlm import build_front, vlm_family

        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        self.family = vlm_family(cfg.vlm_type)
        self.vlm = build_front(vlm_config(cfg), self.family, text.make_embedding(llm_family(cfg), llm))
        _add_query_tokens(self, cfg, llm.hidden_size)
        self.layers = _blocks(cfg, llm, 0, split_layer)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def checkpoint_key(self, local_key: str) -> str:
        """``vlm.<text model>.embed_tokens.*`` -> ``embed_tokens.*``; ``layers.{i}`` as they are; else as is."""
        embed = f"vlm.{self.family.text_attribute}.embed_tokens."
        if local_key.startswith(embed):
            return "embed_tokens." + local_key[len(embed):]
        return _shift_layer_key(local_key, 0)

    def rebuild_buffers(self, device) -> None:
        """The front's non-persistent buffers (made on the CPU) onto the stage's device."""
        for module in self.vlm.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf.device != torch.device(device):
                    module._buffers[name] = buf.to(device)

    def forward(self, inputs, cache=None, chunk_rows: int = 0) -> "SplitState":
        """Processor outputs (:class:`~hybrid_vla_ros.model.vlm.VLMInputs`) -> SplitState at K, h_K in the stage
        dtype (``cache``: the prefix's KV cache, a decode). ``chunk_rows`` > 0 (with a cache): the blocks run over
        the tokens ``chunk_rows`` at a time, each chunk attending to the cached ones before it (a chunked prefill:
        what runs between two decode steps of another frame stays short; equal to the whole prefill up to the
        attention's rounding). Raises ValueError when T is not the spec's (another camera size or prompt)."""
        from .contract import SplitState
        from .vlm import run_front

        param = self.rotary_emb.inv_freq if hasattr(self.rotary_emb, "inv_freq") else None
        dtype = next(self.vlm.parameters()).dtype
        device = param.device if param is not None else next(self.vlm.parameters()).device
        if inputs.tokens != self.cfg.num_tokens:
            raise ValueError(f"the frame has {inputs.tokens} tokens, this model's split is for "
                             f"{self.cfg.num_tokens} (camera_size {self.cfg.camera_size}, {self.cfg.cameras} "
                             "cameras and the prompt fix T)")
        front = run_front(self.vlm, inputs.to(device, dtype))
        h0 = front.inputs_embeds
        if hasattr(self, "query_tokens") and not self.cfg.decode:  # the learned queries in place of the
            # planning-token copies (a decoding model places them after the decode: :meth:`step`)
            h0 = torch.cat([h0[:-len(self.query_tokens)], self.query_tokens.to(h0.dtype)], dim=0)
        state = SplitState(h0, **front.side())
        T = state.hidden_states.shape[-2]
        if (cache is None or chunk_rows <= 0 or chunk_rows >= T or not len(self.layers)
                or state.image_blocks is not None):  # images attending both ways are computed whole
            state.hidden_states = run_blocks(self, self.layers, state.hidden_states, state=state, cache=cache)
            return state
        outs = []
        for start in range(0, T, chunk_rows):
            part = state.rows(start, min(T, start + chunk_rows))
            outs.append(run_blocks(self, self.layers, part.hidden_states, state=part, cache=cache))
        state.hidden_states = torch.cat(outs, dim=0)
        return state

    def step(self, token_ids: torch.Tensor, position_ids: torch.Tensor | None, cache,
             queries: tuple[int, int] = (0, 0)) -> "SplitState":
        """A decode step: token ids (k,) -> SplitState of their h_K (k, H) and rotary ``position_ids`` (3, 1, k)
        int64 (None: positions continue from ``cache``), through the text model's embeddings and blocks [0, K).
        ``queries`` (first, count): the last ``count`` rows take the learned query embeddings ``first`` ..
        (a ``queries`` read-out placed after a decode)."""
        from .contract import SplitState

        embed = getattr(self.vlm, self.family.text_attribute).embed_tokens
        h = embed(token_ids.to(embed.weight.device))
        first, count = queries
        if count:
            h = torch.cat([h[:-count], self.query_tokens[first:first + count].to(h.dtype)], dim=0)
        state = SplitState(h, position_ids)
        state.hidden_states = run_blocks(self, self.layers, h, state=state, cache=cache)
        return state


class VLMSuffixStage(SuffixSide):
    """A transformers VLM's text blocks [K, L) and final norm: SplitState -> the text ``last_hidden_state`` (T, H)."""

    def __init__(self, cfg, split_layer: int):
        super().__init__()
        check_split_layer(cfg, split_layer)
        self.cfg, self.split_layer = cfg, split_layer
        llm = llm_config(cfg)
        self.layers = _blocks(cfg, llm, split_layer, cfg.num_layers)
        self.norm = text.make_norm(llm_family(cfg), llm)
        self.rotary_emb = text.make_rotary(llm_family(cfg), llm)

    def _check_state(self, state, step: bool = False):
        """``state`` (a bare h_K is wrapped) as a checked SplitState; ``step``: a decode step's rows (any count,
        their positions only). Raises ValueError."""
        from .contract import SplitState

        if isinstance(state, torch.Tensor):
            state = SplitState(state)
        if step:
            if state.hidden_states.dim() != 2 or state.hidden_states.shape[-1] != self.cfg.prefix_state_shape[-1]:
                raise ValueError(f"decode step rows {tuple(state.hidden_states.shape)} are not (k, H)")
            return state
        missing = [n for n in self.cfg.side if n not in state.side()]
        if missing:
            raise ValueError(f"this model's blocks after the split need side tensor(s) {missing}, which the "
                             "prefix did not send")
        if tuple(state.hidden_states.shape) != self.cfg.prefix_state_shape:
            raise ValueError(f"hidden states shape {tuple(state.hidden_states.shape)} != expected "
                             f"{self.cfg.prefix_state_shape}")
        return state

    def final_hidden_states(self, state, split_layer: int | None = None, cache=None) -> torch.Tensor:
        """SplitState at K -> (T, H); with ``cache`` (a decode) a prefill or a step's rows. Raises ValueError on a
        wrong shape or K, or missing side tensors."""
        rows = (state if isinstance(state, torch.Tensor) else state.hidden_states).shape[-2]
        state = self._check_state(state, step=cache is not None and rows != self.cfg.prefix_state_shape[-2])
        h = run_blocks(self, self._layers_from(split_layer), state.hidden_states, state=state, cache=cache)
        return self.norm(h)

    def forward(self, state, split_layer: int | None = None) -> torch.Tensor:
        return self.final_hidden_states(state, split_layer)


class VLMDriveSuffixStage(VLMSuffixStage):
    """The suffix of a composed driving checkpoint on a transformers VLM (``projector.type`` ``vlm``):
    :class:`VLMSuffixStage` plus this package's planning head; ``forward`` -> waypoints (N, 2) float32 m."""

    def __init__(self, cfg: VLAConfig, split_layer: int):
        super().__init__(cfg, split_layer)
        _add_suffix_side(self, cfg, llm_config(cfg))

    def plan_all(self, state, command: int = DEFAULT_COMMAND, split_layer: int | None = None) -> "PlanOutput":
        """SplitState at K -> :class:`PlanOutput`. Raises ValueError as :meth:`final_hidden_states` or :func:`plan`."""
        state = self._check_state(state)
        return plan(self, run_blocks(self, self._layers_from(split_layer), state.hidden_states, state=state), command)

    def step_rows(self, state, cache, split_layer: int | None = None) -> torch.Tensor:
        """A decode step's rows (k, H) through blocks [K, L) against the KV cache ``cache``: their hidden states
        before the final norm (what :func:`plan` reads), (k, H)."""
        state = self._check_state(state, step=True)
        return run_blocks(self, self._layers_from(split_layer), state.hidden_states, state=state, cache=cache)

    def forward(self, state, command: int = DEFAULT_COMMAND, split_layer: int | None = None) -> torch.Tensor:
        return self.plan_all(state, command, split_layer).waypoints


class BlockRange(nn.Module):
    """Decoder blocks [start, stop) of a checkpoint, for moving a split layer (no rotary tables)."""

    def __init__(self, cfg: VLAConfig | LMConfig, start: int, stop: int):
        super().__init__()
        self.start = start
        self.layers = _blocks(cfg, llm_config(cfg), start, stop)

    def checkpoint_key(self, local_key: str) -> str:
        return _shift_layer_key(local_key, self.start)


def parameter_counts(cfg: VLAConfig) -> dict[str, int]:
    """Parameters per part, counted on the meta device (no memory): ``vision``, ``projector``, ``llm`` (embeddings,
    blocks, final norm), ``lm_head`` (vocab x H for an untied published LM head, which is not built; 0 when tied),
    ``llm_published`` (llm + lm_head, as model cards report), ``planner`` (ego / pass embeddings, heads), ``total``
    (all built)."""
    with torch.device("meta"):
        model = VLAModel(cfg)
    counts = {"vision": 0, "projector": 0, "llm": 0, "planner": 0}
    part = {"vision": "vision", "projector": "projector", "embed_tokens": "llm", "layers": "llm", "norm": "llm",
            "vision_tower": "vision", "multi_modal_projector": "projector"}
    for name, p in model.named_parameters():
        counts[part.get(name.split(".", 1)[0], "planner")] += p.numel()
    tied = bool(cfg.llm.get("tie_word_embeddings", False))
    counts["lm_head"] = 0 if tied else cfg.hidden_size * int(cfg.llm["vocab_size"])
    counts["llm_published"] = counts["llm"] + counts["lm_head"]
    counts["total"] = counts["vision"] + counts["projector"] + counts["llm"] + counts["planner"]
    return counts
