"""CPU suffix speed: achieved FLOP/s of decoder blocks [K, L) + final norm + heads against the GEMM peak torch
reaches on the same pinned cores, thread count and dtype.

FLOP count (:func:`block_flops`, :func:`suffix_flops`), per frame at the preset's token count T, times B = 2 for
two LLM passes (they run as a batch of 2 sequences):

* every ``nn.Linear``: 2 x MACs = 2 x B x T x in_features x out_features (bias adds and the elementwise work of
  RMSNorm, rotary embedding, SiLU x up, residual adds and softmax are not counted: O(T x H) against the
  GEMMs' O(T x H x I)). Per block (LLaMA / Qwen2 layout, transformers' ``LlamaDecoderLayer`` /
  ``Qwen2DecoderLayer``): q (H -> n_h d), k and v (H -> n_kv d; grouped-query attention), o (n_h d -> H),
  gate and up (H -> I), down (I -> H).
* attention: Q K^T and A V each take d MACs per head and (query, key) pair, i.e. 2 x B x n_h x d FLOPs per pair
  each. Causal attention is counted as **half**: T (T + 1) / 2 pairs, the useful work (the flash-attention
  repository's benchmarks/benchmark_flash_attention.py likewise halves 4 B T^2 n_h d when causal);
  ``attention_full`` gives T^2 pairs for reference. Attention is 1-7 % of the suffix FLOPs of these presets, so
  counting it as full would move the ratio by at most that much.
* heads, on the last token only: final-norm output -> PlanningHead fc1 (H -> H) and fc2 (H -> M N 2), plus the
  decision head (H -> 6) with two passes.

Measured: ``SuffixStage(hidden, command, K)`` (random weights, the real module) in a worker pinned to the suffix
cores with torch threads = number of cores; median of ``repeats`` samples (:func:`.common.time_call`). GEMM peak:
the best of ``torch.mm(a, b, out=c)`` and ``F.linear(a, w)`` (the nn.Linear path) over the block's own shapes
(B T x H @ H x I, B T x I @ I x H, B T x H @ H x H) and a large 2048 x 2048 x 2048 product, same dtype, cores
and threads; FLOP/s = 2 M K N / median time. Ratio = achieved / peak (goal >= 0.6). A one-call torch.profiler
breakdown (self CPU time per aten op, its own overhead included) shows where the rest goes.
"""
from __future__ import annotations

import time

from .common import time_call

DEFAULT_PRESETS = ("tiny", "smol", "minddrive-0.5b")
LARGE_GEMM = (2048, 2048, 2048)


def _dims(cfg) -> dict:
    llm = cfg.llm
    h = int(llm["hidden_size"])
    nh = int(llm["num_attention_heads"])
    nkv = int(llm.get("num_key_value_heads") or nh)
    d = int(llm.get("head_dim") or h // nh)
    return {"H": h, "I": int(llm["intermediate_size"]), "n_heads": nh, "n_kv_heads": nkv, "head_dim": d}


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Linear of one decoder block."""
    x = _dims(cfg)
    h, i, q, kv = x["H"], x["I"], x["n_heads"] * x["head_dim"], x["n_kv_heads"] * x["head_dim"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def block_flops(cfg, tokens: int, batch: int = 1) -> dict:
    """FLOPs of one decoder block on ``batch`` sequences of ``tokens`` tokens (see the module docstring):
    ``linear`` {name: FLOPs}, ``attention`` {"qk", "av"} causal-half, ``attention_full`` (T^2 pairs),
    ``total`` = linear + causal-half attention."""
    x = _dims(cfg)
    lin = {name: 2 * batch * tokens * fin * fout for name, (fin, fout) in linear_shapes(cfg).items()}
    half_pairs = tokens * (tokens + 1) // 2
    per_pair = 2 * batch * x["n_heads"] * x["head_dim"]
    attn = {"qk": per_pair * half_pairs, "av": per_pair * half_pairs}
    full = 2 * per_pair * tokens * tokens
    return {"linear": lin, "attention": attn, "attention_full": full,
            "total": sum(lin.values()) + attn["qk"] + attn["av"]}


def head_flops(cfg) -> int:
    """FLOPs of the heads on the last token: fc1 (H x H), fc2 (H x M N 2), decision head (H x 6, two passes)."""
    h = cfg.hidden_size
    flops = 2 * h * h + 2 * h * cfg.n_modes * cfg.n_waypoints * 2
    if cfg.llm_passes > 1:
        flops += 2 * h * 6
    return flops


def suffix_flops(cfg, split_layer: int) -> dict:
    """FLOPs of the suffix at split layer K for one frame: ``blocks`` = L - K, ``per_block`` (block_flops at
    T = cfg.num_tokens, batch = llm_passes), ``head``, ``total``."""
    n = cfg.num_layers - split_layer
    per = block_flops(cfg, cfg.num_tokens, cfg.llm_passes)
    head = head_flops(cfg)
    return {"blocks": n, "tokens": cfg.num_tokens, "passes": cfg.llm_passes, "per_block": per, "head": head,
            "linear_total": n * sum(per["linear"].values()) + head,
            "attention_total": n * (per["attention"]["qk"] + per["attention"]["av"]),
            "total": n * per["total"] + head}


def gemm_shapes(cfg) -> list[tuple[int, int, int]]:
    """(M, K, N) of the block's main products at the preset's token count, plus the large square one."""
    x = _dims(cfg)
    m = cfg.num_tokens * cfg.llm_passes
    shapes = [(m, x["H"], x["I"]), (m, x["I"], x["H"]), (m, x["H"], x["n_heads"] * x["head_dim"]), LARGE_GEMM]
    return list(dict.fromkeys(shapes))


def _op_breakdown(fn, top: int = 8, calls: int = 3) -> dict:
    """Self CPU time per aten op over ``calls`` calls of ``fn`` (torch.profiler), as shares of the total. A first,
    discarded profiled call absorbs the set-up the profiler charges to the first op of its first session."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(t for _, t in events) or 1.0
    gemm_ops = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_mkldnn_linear", "aten::mkldnn_linear",
                "aten::_addmm_activation")
    attn_ops = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
                "aten::_scaled_dot_product_efficient_attention")
    gemm = sum(t for k, t in events if k in gemm_ops)
    attn = sum(t for k, t in events if k in attn_ops)
    events.sort(key=lambda e: -e[1])
    return {"gemm_share": gemm / total, "attention_share": attn / total, "other_share": (total - gemm - attn) / total,
            "top_ops": [{"op": k, "share": t / total} for k, t in events[:top]]}


def flops_task(chan, *, presets: list[dict], dtypes: list[str], threads: int, repeats: int = 5,
               min_sample_s: float = 0.05, gemm_repeats: int = 5, profile_ops: bool = True) -> dict:
    """Worker (pinned to the suffix cores): measure each preset's suffix and the GEMM peak per dtype.

    ``presets``: [{"name": preset, "blocks": n}] -- the suffix measured holds the last ``n`` blocks (K = L - n):
    every block has the same shapes, so the FLOP/s of a few blocks is that of any K, at a fraction of the time."""
    import torch
    import torch.nn.functional as F

    from ...model.checkpoint import parse_dtype
    from ...model.config import preset
    from ...model.modeling import DEFAULT_COMMAND, SuffixStage
    from ...split.profiler import random_init_

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    gemm_cache: dict[tuple, dict] = {}

    def gemm(shape, dtype) -> dict:
        key = (shape, dtype)
        if key not in gemm_cache:
            m, k, n = shape
            a = torch.randn(m, k).to(dtype)
            b = torch.randn(k, n).to(dtype)
            w = b.t().contiguous()  # (N, K): nn.Linear's weight layout
            c = torch.empty(m, n, dtype=dtype)
            flop = 2 * m * k * n
            with torch.inference_mode():
                t_mm = time_call(lambda: torch.mm(a, b, out=c), repeats=gemm_repeats, min_sample_s=min_sample_s)
                t_lin = time_call(lambda: F.linear(a, w), repeats=gemm_repeats, min_sample_s=min_sample_s)
            gemm_cache[key] = {"shape": list(shape), "mm_gflops": flop / t_mm["median"] / 1e9,
                               "linear_gflops": flop / t_lin["median"] / 1e9}
        return gemm_cache[key]

    out = []
    for spec in presets:
        cfg = preset(spec["name"])
        k = max(0, cfg.num_layers - int(spec["blocks"]))
        count = suffix_flops(cfg, k)
        for dname in dtypes:
            dtype = parse_dtype(dname)
            with torch.device("meta"):
                stage = SuffixStage(cfg, k)
            random_init_(stage, "cpu", dtype)
            h = torch.randn(cfg.prefix_state_shape).to(dtype)
            t0 = time.monotonic()
            with torch.inference_mode():
                t = time_call(lambda: stage(h, DEFAULT_COMMAND, k), repeats=repeats, min_sample_s=min_sample_s)
                calls = max(1, min(3, int(0.5 / t["median"])))  # about half a second of profiling
                ops = _op_breakdown(lambda: stage(h, DEFAULT_COMMAND, k), calls=calls) if profile_ops else None
            gemms = [gemm(s, dtype) for s in gemm_shapes(cfg)]
            best = max(gemms, key=lambda g: max(g["mm_gflops"], g["linear_gflops"]))
            peak = max(best["mm_gflops"], best["linear_gflops"])
            achieved = count["total"] / t["median"] / 1e9
            out.append({
                "preset": spec["name"], "dtype": dname, "split_layer": k, "num_layers": cfg.num_layers,
                "blocks": count["blocks"], "tokens": cfg.num_tokens, "passes": cfg.llm_passes,
                "gflop": count["total"] / 1e9, "gflop_linear": count["linear_total"] / 1e9,
                "gflop_attention": count["attention_total"] / 1e9, "time_ms": t["median"] * 1e3,
                "time_min_ms": t["min"] * 1e3, "per_block_ms": t["median"] * 1e3 / max(count["blocks"], 1),
                "achieved_gflops": achieved, "peak_gflops": peak, "peak_shape": best["shape"],
                "ratio": achieved / peak, "gemm": gemms, "ops": ops, "seconds": time.monotonic() - t0,
            })
            chan.send({"type": "progress", "line": f"  {spec['name']} {dname}: {achieved:.1f} of {peak:.1f} GFLOP/s "
                                                  f"({achieved / peak:.2f})"})
            del stage, h
    return {"results": out, "threads": torch.get_num_threads()}


def run_flops_part(presets, *, dtypes=("fp32", "bf16"), cores=(1,), blocks: int = 4, repeats: int = 5,
                   min_sample_s: float = 0.05, goal: float = 0.6, log=print) -> dict:
    """The whole FLOP/s part in one pinned worker; returns its JSON section."""
    from .common import Worker

    specs = [{"name": p, "blocks": blocks} for p in presets]
    log(f"suffix FLOP/s: {', '.join(presets)} x {', '.join(dtypes)} on cores {list(cores)}, last {blocks} blocks")
    with Worker("suffix_flops", {"presets": specs, "dtypes": list(dtypes), "threads": len(cores), "repeats": repeats,
                                 "min_sample_s": min_sample_s}, cores=list(cores)) as w:
        data = w.result(3600, log=log)
    return {"cores": list(cores), "threads": data["threads"], "goal_ratio": goal,
            "flop_counting": "2 x MACs of every Linear + QK^T and AV with causal attention counted as half "
                             "(T(T+1)/2 pairs); heads on the last token; elementwise ops not counted",
            "peak": "best of torch.mm(out=) and F.linear over the block's GEMM shapes and 2048^3, same dtype, cores "
                    "and threads",
            "results": data["results"]}
