"""The mixture-of-experts suffix on the CPU: a few decoder blocks of Qwen3-30B-A3B's shape, timed as the suffix runs
them and as transformers' eager experts run them, against the FLOPs of the active parameters at the same run's GEMM
peak.

Configuration (``QWEN3_30B_A3B``): Qwen3-30B-A3B's config.json (hidden 2048, 32 query / 4 key-value heads of 128,
128 experts of width 768, 8 active per token), ``blocks`` of its 48 decoder blocks, random weights drawn so routing
sends the tokens to many experts (``family_check._draw_``). Per dtype and prompt length T:

* ``suffix_ms``: the blocks as the CPU suffix runs them (:func:`~hybrid_vla_ros.model.modeling.run_blocks`; the
  experts in the implementation transformers' ``from_pretrained`` picks, ``TextFamily.experts_implementation``;
  bf16 linear layers packed for oneDNN where the CPU computes bf16 natively, as the suffix node packs them);
* ``eager_ms``: the same blocks and weights in transformers' ``eager`` experts (a loop over the experts hit) with
  plain linear layers;
* ``active_gflop``: 2 x the active parameters (attention projections, router, 8 experts) x T, plus the causal
  attention's 2 x T^2 x heads x head_dim, per block; ``gemm_gflops``: a (2048 x 2048) @ (2048 x 2048) product in the
  same dtype on the same threads, the core's GEMM peak here; ``ratio_to_gemm_peak`` = active FLOP/s / that;
* ``gpu_bytes_per_block``: a block's parameters in 16-bit, all experts: the GPU memory one block moved to the CPU
  frees.

Goals (issue 41): prefill at >= 0.6 of the GEMM peak, >= 3x transformers' eager experts.
"""
from __future__ import annotations

import statistics
import time

#: Qwen3-30B-A3B's configuration (its config.json), without the block count.
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_theta=1e6, max_position_embeddings=40960)
#: The goals the part is judged by (issue 41): prefill active FLOP/s over the GEMM peak, speed-up over eager.
GOAL_RATIO, GOAL_SPEEDUP = 0.6, 3.0


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _active_params(block) -> tuple[int, int]:
    """(active parameters per token, all parameters) of one MoE decoder block: everything but the experts, plus
    ``top_k`` experts' share of theirs."""
    experts = block.mlp.experts
    expert_params = sum(p.numel() for p in experts.parameters())
    every = sum(p.numel() for p in block.parameters())
    per_expert = expert_params // experts.num_experts
    top_k = block.mlp.gate.top_k
    return every - expert_params + top_k * per_expert, every


def run_moe(blocks: int = 2, tokens: tuple[int, ...] = (256, 1024), dtypes: tuple[str, ...] = ("bf16", "fp32"),
            repeats: int = 3, threads: int = 1, experts: int | None = None, log=print) -> dict:
    """Measure ``blocks`` Qwen3-30B-A3B decoder blocks (``experts``: fewer experts, for a short run) on ``threads``
    threads of this process, per dtype and prompt length. Returns ``{"config", "blocks", "threads",
    "gpu_bytes_per_block", "active_params_per_block", "params_per_block", "results": [{dtype, tokens, suffix_ms,
    eager_ms, speedup_vs_eager, active_gflop, active_gflops, gemm_gflops, ratio_to_gemm_peak,
    experts_implementation, packed_linears}]}``. Raises ValueError for an unknown dtype."""
    import torch
    from torch import nn

    from ...model import text
    from ...model.checkpoint import parse_dtype
    from ...model.family_check import _draw_
    from ...model.modeling import run_blocks
    from ...runtime.packed_linear import pack_linears_

    llm = dict(QWEN3_30B_A3B, num_hidden_layers=int(blocks))
    if experts:
        llm["num_experts"] = int(experts)
    family = text.text_family("qwen3_moe")
    order = sorted(dtypes, key=lambda n: parse_dtype(n) != torch.float32)  # fp32 first: then cast in place
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        config = text.text_config(llm)
        chosen = config._experts_implementation
        layers = text.make_blocks(family, config, 0, blocks)  # one copy of the weights, cast in place
        _draw_(layers, torch.Generator().manual_seed(0))
        active, every = _active_params(layers[0])
        holder = nn.Module()
        holder.rotary_emb = text.make_rotary(family, config)
        heads, head_dim = int(config.num_attention_heads), int(config.head_dim)
        results = []
        for name in order:
            dtype = parse_dtype(name)
            layers.to(dtype)
            a = torch.randn(2048, 2048).to(dtype)
            with torch.inference_mode():
                gemm = 2 * 2048 ** 3 / _median_ms(lambda: a @ a, repeats + 2) / 1e6
                eager_ms = {}
                config._experts_implementation = "eager"  # transformers' eager experts, plain linear layers
                for t in tokens:
                    x = torch.randn(int(t), int(config.hidden_size)).to(dtype)
                    eager_ms[t] = _median_ms(lambda: run_blocks(holder, layers, x), repeats)
                config._experts_implementation = chosen
                packed = pack_linears_(layers) if dtype == torch.bfloat16 else 0  # as the suffix node packs
                for t in tokens:
                    x = torch.randn(int(t), int(config.hidden_size)).to(dtype)
                    suffix_ms = _median_ms(lambda: run_blocks(holder, layers, x), repeats)
                    gflop = blocks * (2 * active * t + 2 * t * t * heads * head_dim) / 1e9
                    row = {"dtype": name, "tokens": int(t), "suffix_ms": suffix_ms, "eager_ms": eager_ms[t],
                           "speedup_vs_eager": eager_ms[t] / suffix_ms, "active_gflop": gflop,
                           "active_gflops": gflop / suffix_ms * 1e3, "gemm_gflops": gemm,
                           "ratio_to_gemm_peak": gflop / suffix_ms * 1e3 / gemm, "experts_implementation": chosen,
                           "packed_linears": packed}
                    results.append(row)
                    log(f"  moe {name} T={t}: suffix {suffix_ms:.0f} ms ({row['active_gflops']:.0f} GFLOP/s, "
                        f"{row['ratio_to_gemm_peak']:.2f} of the {gemm:.0f} GFLOP/s GEMM), transformers eager "
                        f"{eager_ms[t]:.0f} ms ({row['speedup_vs_eager']:.2f}x)")
    finally:
        torch.set_num_threads(before)
    return {"config": dict(llm), "blocks": int(blocks), "threads": int(threads),
            "gpu_bytes_per_block": 2 * every, "active_params_per_block": active, "params_per_block": every,
            "results": results}


def goals(part: dict, add) -> None:
    """The part's goals through ``add(id, part, what, value, target, met)``: the largest T per dtype."""
    for name in dict.fromkeys(r["dtype"] for r in part["results"]):
        row = max((r for r in part["results"] if r["dtype"] == name), key=lambda r: r["tokens"])
        add(f"moe_{name}_vs_gemm_peak", "moe", f"MoE suffix {name} T={row['tokens']}: active FLOP/s / GEMM peak",
            row["ratio_to_gemm_peak"], f">= {GOAL_RATIO}", row["ratio_to_gemm_peak"] >= GOAL_RATIO)
        add(f"moe_{name}_vs_eager", "moe", f"MoE suffix {name} T={row['tokens']}: transformers eager / suffix",
            row["speedup_vs_eager"], f">= {GOAL_SPEEDUP}", row["speedup_vs_eager"] >= GOAL_SPEEDUP)


def markdown(part: dict) -> str:
    """The part as a markdown table."""
    c = part["config"]
    fewer = "" if c["num_experts"] == QWEN3_30B_A3B["num_experts"] else f" of its {QWEN3_30B_A3B['num_experts']}"
    lines = [f"\n**MoE suffix**: {part['blocks']} Qwen3-30B-A3B decoder block(s) ({c['num_experts']}{fewer} experts "
             f"of {c['moe_intermediate_size']}, {c['num_experts_per_tok']} active), {part['threads']} thread(s); "
             f"a block frees {part['gpu_bytes_per_block'] / 1e9:.2f} GB of 16-bit GPU memory "
             f"({part['params_per_block'] / 1e6:.0f} M parameters, {part['active_params_per_block'] / 1e6:.0f} M "
             "active per token).", "",
             "| dtype | T | suffix ms | active GFLOP/s | of GEMM peak | transformers eager ms | speed-up |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in part["results"]:
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['suffix_ms']:.0f} | {r['active_gflops']:.0f} | "
                     f"{r['ratio_to_gemm_peak']:.2f} (of {r['gemm_gflops']:.0f}) | {r['eager_ms']:.0f} | "
                     f"{r['speedup_vs_eager']:.2f}x |")
    return "\n".join(lines)
