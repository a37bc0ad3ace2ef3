"""The mixture-of-experts suffix on the CPU: a few decoder blocks of Qwen3-30B-A3B's shape, timed as the suffix runs
them, as transformers runs them, and against the best this host could do (the FLOPs of the active parameters at the
same run's GEMM peak, the weights read at its memory bandwidth).

Configuration (``QWEN3_30B_A3B``): Qwen3-30B-A3B's config.json (hidden 2048, 32 query / 4 key-value heads of 128,
128 experts of width 768, 8 active per token), ``blocks`` of its 48 decoder blocks, random weights drawn so routing
sends the tokens to many experts (``family_check._draw_``). Per dtype and prompt length T:

* ``suffix_ms``: the blocks as the CPU suffix runs them (:func:`~hybrid_vla_ros.model.modeling.run_blocks`); in bf16
  where the CPU computes it natively, linear layers and experts packed for oneDNN as the suffix node packs them
  (``runtime/packed_linear.py``: :class:`~hybrid_vla_ros.runtime.packed_linear.PackedExperts`), else the experts
  in transformers' ``grouped_mm``;
* ``grouped_ms``: the same blocks as transformers' ``from_pretrained`` model runs them (``grouped_mm`` experts,
  plain linear layers); ``eager_ms``: transformers' ``eager`` experts (a loop over the experts hit);
* ``active_gflop``: 2 x the active parameters (attention projections, router, 8 experts) x T, plus the causal
  attention's 2 x T^2 x heads x head_dim, per block; ``gemm_gflops``: a (2048 x 2048) @ (2048 x 2048) product in the
  same dtype on the same threads, the core's GEMM peak here; ``ratio_to_gemm_peak`` = active FLOP/s / that;
* ``read_gb``: the weights a forward must read (everything but the experts, plus the experts T tokens reach under
  uniform routing: E x (1 - (1 - k / E)^T)); ``stream_gbs``: the same run's memory bandwidth (a one-row fp32
  product over a 256 MiB matrix, as a GEMM streams its weights); ``floor_ms`` = max(active FLOPs at the GEMM peak,
  the read weights at that bandwidth), the best this host allows; ``ratio_to_floor`` = floor / suffix;
* ``gpu_bytes_per_block``: a block's parameters in 16-bit, all experts: the GPU memory one block moved to the CPU
  frees.

Goals (issue 41): prefill at >= 0.6 of the GEMM peak, >= 3x transformers' eager experts. Where the floor is above
0.6 of the peak's time (the weights cannot be read faster than the memory gives them), the first goal cannot be met
on that host: the report says so beside it.
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


def _stream_gbs(repeats: int) -> float:
    """This thread's memory bandwidth in GB/s as a GEMM sees it: a one-row fp32 product over a 256 MiB matrix."""
    import torch

    w, x = torch.randn(8192, 8192), torch.randn(1, 8192)
    return w.numel() * w.element_size() / _median_ms(lambda: x @ w, repeats) / 1e6


def _read_bytes(block, tokens: int, element: int) -> int:
    """Bytes of ``block``'s weights that a forward over ``tokens`` tokens reads: everything but the experts, and the
    experts reached under uniform routing (E x (1 - (1 - k / E)^T) of them)."""
    experts = block.mlp.experts
    expert_params = sum(p.numel() for p in experts.parameters())
    every = sum(p.numel() for p in block.parameters())
    e, k = experts.num_experts, block.mlp.gate.top_k
    reached = e * (1 - (1 - k / e) ** tokens)
    return int(element * (every - expert_params + reached * expert_params / e))


def run_moe(blocks: int = 2, tokens: tuple[int, ...] = (256, 1024), dtypes: tuple[str, ...] = ("bf16", "fp32"),
            repeats: int = 3, threads: int = 1, experts: int | None = None, cpu=None, log=print) -> dict:
    """Measure ``blocks`` Qwen3-30B-A3B decoder blocks (``experts``: fewer experts, for a short run) on ``threads``
    threads of this process, per dtype and prompt length. Each dtype is measured in the precision a suffix node
    computes it in on this CPU (``cpu``: :class:`~hybrid_vla_ros.util.precision.CpuFeatures`, read when None): a
    dtype computed in another that is measured too (bf16 in fp32 where the CPU has no native bf16) is not measured
    twice but listed in ``computed_as``. Returns ``{"config", "blocks", "threads", "gpu_bytes_per_block",
    "active_params_per_block", "params_per_block", "stream_gbs", "computed_as": {dtype: {"precision", "reason"}},
    "results": [{dtype, precision, precision_reason, tokens, suffix_ms, grouped_ms, eager_ms, speedup_vs_grouped,
    speedup_vs_eager, active_gflop, active_gflops, gemm_gflops, ratio_to_gemm_peak, read_gb, floor_ms,
    ratio_to_floor, experts_implementation, packed_linears, packed_experts}]}``. Raises ValueError for an unknown
    dtype."""
    import torch
    from torch import nn

    from ...model import text
    from ...model.checkpoint import parse_dtype
    from ...model.family_check import _draw_
    from ...model.modeling import run_blocks
    from ...runtime.packed_linear import pack_experts_, pack_linears_
    from .common import measured_precisions

    llm = dict(QWEN3_30B_A3B, num_hidden_layers=int(blocks))
    if experts:
        llm["num_experts"] = int(experts)
    family = text.text_family("qwen3_moe")
    order = sorted(dtypes, key=lambda n: parse_dtype(n) != torch.float32)  # fp32 first: then cast in place
    precision, computed_as = measured_precisions(order, cpu)
    order = [n for n in order if n not in computed_as]
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        config = text.text_config(llm)
        chosen = config._experts_implementation
        layers = text.make_blocks(family, config, 0, blocks)  # one copy of the weights, cast in place
        _draw_(layers, torch.Generator().manual_seed(0))
        active, every = _active_params(layers[0])
        read = {(t, n): blocks * _read_bytes(layers[0], int(t), precision[n].dtype.itemsize)
                for t in tokens for n in order}
        holder = nn.Module()
        holder.rotary_emb = text.make_rotary(family, config)
        heads, head_dim = int(config.num_attention_heads), int(config.head_dim)
        stream = _stream_gbs(repeats + 2)
        results = []
        for name in order:
            dtype = precision[name].dtype
            if precision[name].widened:
                log(f"  moe {name}: {precision[name].reason}")
            layers.to(dtype)
            a = torch.randn(2048, 2048).to(dtype)
            inputs = {t: torch.randn(int(t), int(config.hidden_size)).to(dtype) for t in tokens}
            with torch.inference_mode():
                gemm = 2 * 2048 ** 3 / _median_ms(lambda: a @ a, repeats + 2) / 1e6
                baseline = {}
                for impl in ("eager", chosen):  # transformers' own, on plain linear layers
                    config._experts_implementation = impl
                    for t in tokens:
                        baseline[impl, t] = _median_ms(lambda: run_blocks(holder, layers, inputs[t]), repeats)
                config._experts_implementation = chosen
                packed = (pack_linears_(layers), pack_experts_(layers)) if dtype == torch.bfloat16 else (0, 0)
                for t in tokens:  # as the suffix node runs them
                    suffix_ms = _median_ms(lambda: run_blocks(holder, layers, inputs[t]), repeats)
                    gflop = blocks * (2 * active * t + 2 * t * t * heads * head_dim) / 1e9
                    floor_ms = max(gflop / gemm * 1e3, read[t, name] / stream / 1e6)
                    row = {"dtype": name, "precision": precision[name].name,
                           "precision_reason": precision[name].reason, "tokens": int(t), "suffix_ms": suffix_ms,
                           "grouped_ms": baseline[chosen, t],
                           "eager_ms": baseline["eager", t], "speedup_vs_grouped": baseline[chosen, t] / suffix_ms,
                           "speedup_vs_eager": baseline["eager", t] / suffix_ms, "active_gflop": gflop,
                           "active_gflops": gflop / suffix_ms * 1e3, "gemm_gflops": gemm,
                           "ratio_to_gemm_peak": gflop / suffix_ms * 1e3 / gemm, "read_gb": read[t, name] / 1e9,
                           "floor_ms": floor_ms, "ratio_to_floor": floor_ms / suffix_ms,
                           "experts_implementation": chosen, "packed_linears": packed[0], "packed_experts": packed[1]}
                    results.append(row)
                    log(f"  moe {name} T={t}: suffix {suffix_ms:.0f} ms ({row['active_gflops']:.0f} GFLOP/s, "
                        f"{row['ratio_to_gemm_peak']:.2f} of the {gemm:.0f} GFLOP/s GEMM; the floor {floor_ms:.0f} ms "
                        f"is {row['ratio_to_floor']:.2f} of it), transformers {chosen} {baseline[chosen, t]:.0f} ms "
                        f"({row['speedup_vs_grouped']:.2f}x), eager {baseline['eager', t]:.0f} ms "
                        f"({row['speedup_vs_eager']:.2f}x)")
    finally:
        torch.set_num_threads(before)
    return {"config": dict(llm), "blocks": int(blocks), "threads": int(threads),
            "gpu_bytes_per_block": 2 * every, "active_params_per_block": active, "params_per_block": every,
            "stream_gbs": stream, "computed_as": computed_as, "results": results}


def goals(part: dict, add) -> None:
    """The part's goals through ``add(id, part, what, value, target, met)``, at the largest T per dtype: the
    issue's two (each naming the most this host's floor allows) and never slower than transformers' own experts
    where the suffix packs them."""
    for name in dict.fromkeys(r["dtype"] for r in part["results"]):
        row = max((r for r in part["results"] if r["dtype"] == name), key=lambda r: r["tokens"])
        most = row["active_gflop"] / row["gemm_gflops"] * 1e3 / row["floor_ms"]
        add(f"moe_{name}_vs_gemm_peak", "moe", f"MoE suffix {name} T={row['tokens']}: active FLOP/s / GEMM peak "
            f"(this host's floor allows {min(most, 1.0):.2f})", row["ratio_to_gemm_peak"], f">= {GOAL_RATIO}",
            row["ratio_to_gemm_peak"] >= GOAL_RATIO)
        add(f"moe_{name}_vs_eager", "moe", f"MoE suffix {name} T={row['tokens']}: transformers eager / suffix "
            f"(the floor allows {row['eager_ms'] / row['floor_ms']:.1f}x)", row["speedup_vs_eager"],
            f">= {GOAL_SPEEDUP}", row["speedup_vs_eager"] >= GOAL_SPEEDUP)
        if row["packed_experts"]:  # else the suffix runs transformers' own experts: nothing to compare
            add(f"moe_{name}_vs_transformers", "moe", f"MoE suffix {name} T={row['tokens']}: transformers "
                f"{row['experts_implementation']} / suffix", row["speedup_vs_grouped"], ">= 1.0",
                row["speedup_vs_grouped"] >= 1.0)


def markdown(part: dict) -> str:
    """The part as a markdown table."""
    c = part["config"]
    fewer = "" if c["num_experts"] == QWEN3_30B_A3B["num_experts"] else f" of its {QWEN3_30B_A3B['num_experts']}"
    lines = [f"\n**MoE suffix**: {part['blocks']} Qwen3-30B-A3B decoder block(s) ({c['num_experts']}{fewer} experts "
             f"of {c['moe_intermediate_size']}, {c['num_experts_per_tok']} active), {part['threads']} thread(s); "
             f"a block frees {part['gpu_bytes_per_block'] / 1e9:.2f} GB of 16-bit GPU memory "
             f"({part['params_per_block'] / 1e6:.0f} M parameters, {part['active_params_per_block'] / 1e6:.0f} M "
             f"active per token); memory read at {part['stream_gbs']:.1f} GB/s.", "",
             "| dtype | T | suffix ms | active GFLOP/s | of GEMM peak | weights read GB | floor ms (floor / suffix) "
             "| transformers ms (speed-up) | eager ms (speed-up) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in part.get("computed_as", {}).items():
        lines[0] += f" {name} is not measured apart: {c['reason']} (the {c['precision']} rows)."
    for r in part["results"]:
        lines.append(f"| {r['dtype']} | {r['tokens']} | {r['suffix_ms']:.0f} | {r['active_gflops']:.0f} | "
                     f"{r['ratio_to_gemm_peak']:.2f} (of {r['gemm_gflops']:.0f}) | {r['read_gb']:.2f} | "
                     f"{r['floor_ms']:.0f} ({r['ratio_to_floor']:.2f}) | {r['grouped_ms']:.0f} "
                     f"({r['speedup_vs_grouped']:.2f}x {r['experts_implementation']}) | {r['eager_ms']:.0f} "
                     f"({r['speedup_vs_eager']:.2f}x) |")
    return "\n".join(lines)
