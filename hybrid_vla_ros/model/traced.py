"""Decoder blocks [K, L) in the form a graph compiler traces (the compiled suffix, runtime.suffix_backend): the
family's own block classes rebuilt over the stage's weights with plain causal attention."""
from __future__ import annotations

import torch
from torch import nn


def traceable(stage) -> str:
    """"" when a suffix stage's blocks can be traced, else why not, in a sentence."""
    if not hasattr(stage, "rotary_emb"):
        return "own model code: its blocks are not traced (only transformers decoder blocks are)"
    if getattr(stage.cfg, "side", ()):
        return (f"the model's blocks after the split take side tensors ({', '.join(stage.cfg.side)}); the compiled "
                "model takes the hidden states only")
    from .modeling import llm_family

    if getattr(stage.cfg, "llm", None) is not None and llm_family(stage.cfg).captured:
        return ("hybrid blocks (convolution, state-space or linear-attention layers) run with the inputs their "
                "family's forward hands them, which a traced graph does not: this suffix runs eagerly")
    return ""


#: Name of :func:`causal_attention` in transformers' attention registry (``AttentionInterface``).
ATTENTION_NAME = "hybrid_vla_causal_sdpa"
def causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask=None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Causal self-attention for the traced graph: queries (B, n_h, T, d), keys and values (B, n_kv, T, d) ->
    (B, T, n_h, d), as transformers' ``sdpa_attention_forward`` returns.

    K/V are repeated to n_h heads (``repeat_kv``), giving one 4-D SDPA per block that OpenVINO's CPU plugin fuses
    into one MHA subgraph (``enable_gqa``'s 5-D form is not fused; the two measured alike, docs/performance.md).
    Raises ValueError for an ``attention_mask``: positions are 0..T-1, no padding."""
    from transformers.models.llama.modeling_llama import repeat_kv

    if attention_mask is not None:
        raise ValueError("causal_attention takes no attention mask (positions 0..T-1, no padding)")
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, causal_attention)


def traced_blocks(cfg, layers: list, weight_dtype: torch.dtype) -> nn.ModuleList:
    """New decoder blocks holding ``layers``' weights (the same tensors when ``weight_dtype`` is theirs, else cast
    copies), with a config of their own using :func:`causal_attention`; the stage is untouched, so its eager path
    may keep running on another thread. Raises ValueError for attention other than full causal (sliding windows,
    Gemma 2's logit soft-capping) and for mixture-of-experts blocks (data-dependent routing)."""
    import copy

    from .modeling import llm_config, llm_family

    _register_attention()
    llm = copy.copy(llm_config(cfg))
    from .text import FULL, attention_kinds, block_index

    kinds = {attention_kinds(llm)[block_index(old)] for old in layers}
    if kinds != {FULL} or getattr(llm, "use_sliding_window", False):
        raise ValueError(f"{cfg.llm_type}: blocks of attention kind {sorted(kinds)}: the traced attention is plain "
                         "causal; this model's suffix runs eagerly")
    moe = sorted({type(m).__name__ for old in layers for m in old.modules() if hasattr(m, "experts")})
    if moe:
        raise ValueError(f"{cfg.llm_type}: mixture-of-experts blocks ({', '.join(moe)}) route each token at run "
                         "time, and a traced graph would keep the example's routing; this model's suffix runs "
                         "eagerly")
    if getattr(llm, "attn_logit_softcapping", None):
        raise ValueError(f"{cfg.llm_type}: attention logit soft-capping ({llm.attn_logit_softcapping}) is not in "
                         "the traced attention; this model's suffix runs eagerly")
    llm._attn_implementation = ATTENTION_NAME
    block_cls = llm_family(cfg).block_class
    with torch.device("meta"):
        blocks = nn.ModuleList(block_cls(llm, block_index(old)) for old in layers)
    for new, old in zip(blocks, layers):
        new.load_state_dict({k: v.detach().to(weight_dtype) for k, v in old.state_dict().items()}, strict=True,
                            assign=True)
    return blocks.eval().requires_grad_(False)


def read_out_tokens(cfg) -> int:
    """How many last tokens of blocks [K, L)'s output the heads read: enough for every
    :attr:`~hybrid_vla_ros.model.config.VLAConfig.readout_positions` entry and a ``queries`` read-out's query
    tokens; every token for a ``module`` read-out."""
    kind = getattr(cfg, "readout_type", "mlp")
    if kind == "module":  # the team's head reads every token
        return int(cfg.num_tokens)
    positions = getattr(cfg, "readout_positions", None)
    return max(1, getattr(cfg, "query_count", 0), positions.tokens_from_end if positions is not None else 1)


def last_rows_of_block(block: nn.Module, x: torch.Tensor, rows: int, positions: torch.Tensor,
                        cos_sin: tuple) -> torch.Tensor:
    """``block`` on ``x`` (B, T, H) -> its output's last ``rows`` tokens (B, rows, H): attention over every token
    (keys and values need them all), the per-token rest (residuals, post-attention norm, MLP) for those rows only.
    Follows transformers' pre-norm ``LlamaDecoderLayer`` (shared by Qwen2, Qwen3, Mistral, Phi-3); :func:`prunable`
    checks a block against it. Raises AttributeError for a block without ``input_layernorm`` / ``self_attn`` /
    ``post_attention_layernorm`` / ``mlp``."""
    attn = block.self_attn(hidden_states=block.input_layernorm(x), attention_mask=None, position_ids=positions,
                           position_embeddings=cos_sin)[0]
    out = x[:, -rows:, :] + attn[:, -rows:, :]
    return out + block.mlp(block.post_attention_layernorm(out))


def prunable(block: nn.Module, shape: tuple, rows: int, rotary_emb: nn.Module) -> bool:
    """Whether :func:`last_rows_of_block` gives ``block``'s own last ``rows`` output tokens, checked on an fp32
    copy (bf16 rounding would hide differences) with one seeded random input of ``shape`` (B, T, H): the rows'
    updates (output minus input) must agree within 1e-4 of the largest update (GEMM kernels vary with the row
    count; the right layout measured within 1e-6). False when ``rows`` >= T, for another layout, or on any error."""
    import copy

    if not 0 < rows < shape[1]:
        return False
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(shape[1]).unsqueeze(0)
    try:
        block32 = copy.deepcopy(block).float()
        with torch.no_grad():
            cos_sin = tuple(t.float() for t in rotary_emb(x, positions))
            whole = block32(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            whole = (whole[0] if isinstance(whole, tuple) else whole)[:, -rows:, :]
            part = last_rows_of_block(block32, x, rows, positions, cos_sin)
    except Exception:  # noqa: BLE001 -- any failure means: trace the block whole
        return False
    if part.shape != whole.shape or not bool(torch.isfinite(part).all()):
        return False
    update = whole - x[:, -rows:, :]
    return float((part - whole).abs().max()) <= 1e-4 * float(update.abs().max())


class BlocksToLastTokens(nn.Module):
    """The traced module: (B, T, H) float32 -> blocks [K, L) in ``dtype`` -> the last ``tokens_out`` tokens
    (B, tokens_out, H) float32, before the final norm; positions 0..T-1. ``prune_last``: block L-1 runs as
    :func:`last_rows_of_block` (only where :func:`prunable` says so)."""

    def __init__(self, layers: nn.ModuleList, rotary_emb: nn.Module, dtype: torch.dtype, tokens_out: int = 1,
                 prune_last: bool = False):
        super().__init__()
        self.layers = layers
        self.rotary_emb = rotary_emb
        self.dtype = dtype
        self.tokens_out = int(tokens_out)
        self.prune_last = bool(prune_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # model.modeling.run_blocks with no mask: causal_attention is causal by construction (traced, transformers'
        # mask functions would build a mask tensor instead of SDPA's is_causal).
        x = x.to(self.dtype)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary_emb(x, positions)
        whole = self.layers[:-1] if self.prune_last else self.layers
        for block in whole:
            x = block(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        if self.prune_last:
            return last_rows_of_block(self.layers[-1], x, self.tokens_out, positions, cos_sin).float()
        return x[:, -self.tokens_out:, :].float()
