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
  decision head (H -> 6, or H -> the 7 meta-action tokens' LM-head rows) with two passes.

Measured: ``SuffixStage(hidden, command, K)`` (seeded random weights, the real module) in a worker pinned to the
suffix cores with torch threads = number of cores, eagerly and through each compiled backend
(:mod:`hybrid_vla_ros.runtime.suffix_backend`, built cold into an empty cache folder); median of ``repeats``
samples (:func:`.common.time_call`; with one thread on the CPU clock, which leaves out the time other processes
take the core, else the wall clock). GEMM peak: the best of ``torch.mm(a, b, out=c)`` and ``F.linear(a, w)``
(the nn.Linear path) over the block's own shapes (B T x H @ H x I, B T x I @ I x H, B T x H @ H x H) and a
large 2048 x 2048 x 2048 product, same dtype, cores and threads; FLOP/s = 2 M K N / median time. Ratio =
achieved / peak (legacy goal >= 0.6 for eager); the issue-16 goals take the best backend against the faster of
the dtype's and the fp32 peak (:data:`GOAL_RATIO_BEST`). A one-call torch.profiler breakdown (self CPU time per
aten op, its own overhead included) shows where the rest of the eager time goes.

Also: a restart of each compiled case in a fresh worker from the artifact the FLOP/s worker left
(:func:`restart_task`, goal :data:`GOAL_RESTART_S`), and the llama.cpp peer (:func:`run_peer`,
:mod:`.llama_peer`) when ``smol`` is among the presets.
"""
from __future__ import annotations

import math
import time

from .common import time_call

DEFAULT_PRESETS = ("tiny", "smol", "minddrive-0.5b")
LARGE_GEMM = (2048, 2048, 2048)
#: Goal of the best backend per dtype: achieved / the same run's best torch GEMM of that dtype (issue #16).
GOAL_RATIO_BEST = {"bf16": 0.85, "fp32": 0.9}
#: Presets the goals above apply to (``tiny``'s matrices are too small to keep a GEMM busy).
GOAL_PRESETS = ("smol", "minddrive-0.5b")
#: Goal of a compiled backend's restart from its cached artifact: seconds beyond the eager path.
GOAL_RESTART_S = 3.0


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
    rank = int(getattr(cfg, "pass_lora_rank", 0) or 0)
    if rank:  # a converted MindDrive checkpoint: per pass x A^T (r x in) then B^T (out x r) on q/k/v/o
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            fin, fout = linear_shapes(cfg)[name]
            lin[f"{name}.lora"] = 2 * batch * tokens * rank * (fin + fout)
    half_pairs = tokens * (tokens + 1) // 2
    per_pair = 2 * batch * x["n_heads"] * x["head_dim"]
    attn = {"qk": per_pair * half_pairs, "av": per_pair * half_pairs}
    full = 2 * per_pair * tokens * tokens
    return {"linear": lin, "attention": attn, "attention_full": full,
            "total": sum(lin.values()) + attn["qk"] + attn["av"]}


def vae_planner_flops(width: int, steps: int, modes: int) -> int:
    """FLOPs (2 per multiply-add) of one VAE planner (model/vae_planner.py) on one state of width D = ``width``:
    the latent's 1 x 1 convolutions (D -> 2D -> 2D -> D/2 -> 64: 14 D^2 + 64 D), then per step the 4-layer GRU of
    width h = D/4 (3 gates of input and hidden products: 6 (32 h + h^2) for the first layer, 12 h^2 for each other),
    the roll-out MLP (h -> 2h -> 4h -> D) and the decoder (2D -> 2D -> 2D -> 2M)."""
    d, h = width, width // 4
    latent = 2 * (d * 2 * d + 2 * d * 2 * d + 2 * d * d // 2 + d // 2 * 64)
    gru = 2 * 3 * (32 * h + h * h) + 3 * 2 * 3 * (h * h + h * h)
    rollout = 2 * (h * 2 * h + 2 * h * 4 * h + 4 * h * d)
    decoder = 2 * (2 * d * 2 * d + 2 * d * 2 * d + 2 * d * 2 * modes)
    return latent + steps * (gru + rollout + decoder)


def head_flops(cfg) -> int:
    """FLOPs of the heads on the last token(s): fc1 (H x H), fc2 (H x M N 2) for the MLP head; the VAE planner(s)
    for ``vae`` / ``vae_speed_path`` (:func:`vae_planner_flops`); the decision head (two passes: H x 6, or H x D
    with ``decision_token_ids``, MindDrive's LM-head rows of its D meta-action tokens)."""
    h = cfg.hidden_size
    kind = getattr(cfg, "readout_type", "mlp")
    if kind == "vae":
        flops = vae_planner_flops(h, cfg.n_waypoints, cfg.n_modes)
    elif kind == "vae_speed_path":
        flops = (vae_planner_flops(h, cfg.n_waypoints, len(cfg.decision_token_ids))
                 + vae_planner_flops(h, int(cfg.readout["path_points"]), cfg.n_modes))
    else:
        flops = 2 * h * h + 2 * h * cfg.n_modes * cfg.n_waypoints * 2
    if cfg.llm_passes > 1:
        flops += 2 * h * (len(getattr(cfg, "decision_token_ids", None) or []) or 6)
    return flops


def mlp_rows_flops(cfg, rows: int) -> int:
    """FLOPs of one block's MLP (gate, up: H -> I; down: I -> H) on ``rows`` tokens of each of the
    ``cfg.llm_passes`` passes: what a compiled suffix leaves out of block L-1 when it computes the MLP for the
    read-out rows only (:func:`hybrid_vla_ros.model.traced.last_rows_of_block`, T - rows rows)."""
    shapes = linear_shapes(cfg)
    return sum(2 * cfg.llm_passes * rows * fin * fout for fin, fout in (shapes[n] for n in ("gate_proj", "up_proj",
                                                                                           "down_proj")))


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


#: OpenVINO CPU node types counted as attention in :func:`_openvino_breakdown` (besides any node that took in the
#: traced ``scaled_dot_product_attention``: the fused MHA runs as a ``Subgraph``).
OV_ATTENTION_TYPES = ("ScaledDotProductAttention", "MHA", "Softmax")


def _openvino_breakdown(compiled, x, total_ms: float, linear_gflop: float, calls: int = 5) -> dict:
    """Where a compiled suffix's time goes, from the CPU plugin's own per-node counters (``PERF_COUNT``).

    ``compiled``: the :class:`~hybrid_vla_ros.runtime.suffix_backend.CompiledSuffix` measured; its artifact is
    compiled once more with ``PERF_COUNT`` on (same precision and threads; the counters cost little, but are kept
    off the timed model) and run ``calls`` times on ``x`` (its input, float32 numpy, (B, T, H)). ``total_ms``: the
    measured time of the whole suffix call (graph + the wrapper + final norm and heads in torch), ms.
    ``linear_gflop``: the Linear FLOPs of the blocks, GFLOP.

    Returns shares of ``total_ms`` that add up to 1 (node ``real_time`` summed per call, mean over ``calls``; the
    nodes split the graph's part, their sum over ``total_ms`` capped at 1): ``gemm_share`` (``FullyConnected``
    nodes: the Linears), ``attention_share`` (the attention nodes, :data:`OV_ATTENTION_TYPES`), ``other_share``
    (every other node: RMSNorm, rotary, transposes, element-wise subgraphs, reorders), ``outside_share`` (what is
    in no node: the infer call, the input and output copies, the final norm and heads in torch); ``gemm_ms``,
    ``attention_ms``, ``other_ms`` (ms per call of the counted run); ``counted_exceeds_timed`` (the counted
    run's nodes took longer than the timed call: ``outside_share`` is then 0 by the cap, not measured); and
    ``gemm_gflops_in_graph`` = ``linear_gflop`` / the FullyConnected time, the rate the Linears themselves reach
    inside the graph (GFLOP/s)."""
    from ...runtime.suffix_backend import _openvino, plugin_config

    ov = _openvino()
    config = plugin_config(compiled.precision, compiled.threads, perf_count=True)
    model = ov.Core().compile_model(str(compiled.folder / "model.xml"), "CPU", config)
    # A fused node is named after one of the operations it took in (the f32 MHA subgraph after its output
    # transpose); the runtime model lists all of them, so attention is found by what a node holds.
    fused = {}
    for op in model.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        names = info["originalLayersNames"].astype(str) if "originalLayersNames" in info else ""
        fused[op.get_friendly_name()] = names
    request = model.create_infer_request()
    request.infer([x])  # the first call's one-off work is not the steady state
    gemm = attention = other = 0.0
    for _ in range(calls):
        request.infer([x])
        for node in request.profiling_info:
            ms = node.real_time.total_seconds() * 1e3 / calls
            if node.node_type == "FullyConnected":
                gemm += ms
            elif (node.node_type in OV_ATTENTION_TYPES
                  or "scaled_dot_product_attention" in node.node_name + fused.get(node.node_name, "")):
                attention += ms
            else:
                other += ms
    # The counted run is a second compile: its graph time is not exactly the timed run's, so the nodes' shares
    # split the graph's part of the measured time and the shares add up to 1.
    nodes = max(gemm + attention + other, 1e-9)
    graph = min(1.0, nodes / max(total_ms, 1e-9))
    return {"gemm_share": graph * gemm / nodes, "attention_share": graph * attention / nodes,
            "other_share": graph * other / nodes, "outside_share": 1.0 - graph,
            "counted_exceeds_timed": nodes > total_ms,
            "gemm_ms": gemm, "attention_ms": attention, "other_ms": other,
            "gemm_gflops_in_graph": linear_gflop / (gemm / 1e3) if gemm > 0 else None}


def _blocks_linear_gflop(cfg, k: int) -> float:
    """Linear FLOPs of blocks [k, L) alone (no heads), GFLOP."""
    count = suffix_flops(cfg, k)
    return (count["linear_total"] - count["head"]) / 1e9


def _stage(cfg, k: int, dtype, seed: int):
    """A SuffixStage of blocks [k, L) with seeded random weights (the same in every process for one seed)."""
    import torch

    from ...model.modeling import SuffixStage
    from ...model.timing_parts import random_init_

    torch.manual_seed(seed)
    with torch.device("meta"):
        stage = SuffixStage(cfg, k)
    random_init_(stage, "cpu", dtype)
    h = torch.randn(cfg.prefix_state_shape).to(dtype)
    return stage, h


def _seed(*parts) -> int:
    import zlib

    return zlib.crc32("/".join(map(str, parts)).encode())


def _rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compiled_row(stage, h, k, dname, backend, cache_dir, threads, repeats, min_sample_s, eager_row,
                  clock: str = "wall") -> dict:
    """Build ``backend`` for the stage cold (empty cache folder), time it, compare it with eager and fp32."""
    import copy

    import torch

    from ...model.modeling import DEFAULT_COMMAND, plan, run_blocks
    from ...runtime.suffix_backend import build_openvino

    if backend != "openvino":
        raise ValueError(f"unknown backend {backend!r}")
    t0 = time.monotonic()
    c = build_openvino(stage, k, tuple(h.shape), model_id=0, cache_dir=cache_dir, threads=threads)
    with torch.inference_mode():
        t = time_call(lambda: plan(stage, c.run(h), DEFAULT_COMMAND).waypoints, repeats=repeats,
                      min_sample_s=min_sample_s, clock=clock)
        eager_last = run_blocks(stage, stage.layers, h)[..., -1:, :]
        ours = c.run(h)  # the last token (and the one before for a decision read-out: read_out_tokens)
        ours_last = ours[..., -1:, :]
        wp_eager = stage(h, DEFAULT_COMMAND, k)
        wp_ours = plan(stage, ours, DEFAULT_COMMAND).waypoints
        acc = {"rel_l2_last_hidden_vs_eager": _rel_l2(ours_last, eager_last),
               "waypoints_max_abs_vs_eager_m": float((wp_ours - wp_eager).abs().max())}
        if stage.layers[0].self_attn.q_proj.weight.dtype != torch.float32:  # how far each is from fp32
            s32 = copy.deepcopy(stage).float()
            ref = run_blocks(s32, s32.layers, h.float())[..., -1:, :]
            acc["rel_l2_last_hidden_vs_fp32"] = _rel_l2(ours_last, ref)
            acc["eager_rel_l2_last_hidden_vs_fp32"] = _rel_l2(eager_last, ref)
            del s32
    row = {key: eager_row[key] for key in ("preset", "dtype", "split_layer", "num_layers", "blocks", "tokens",
                                           "passes", "gflop", "gflop_linear", "gflop_attention", "peak_gflops",
                                           "peak_shape", "gemm", "fp32_peak_gflops", "best_peak_gflops",
                                           "block_peak_gflops")}
    # FLOPs this graph computes: block L-1 may run its MLP on the read-out rows only (c.last_block_rows)
    left_out = mlp_rows_flops(stage.cfg, stage.cfg.num_tokens - c.last_block_rows) if c.last_block_rows else 0
    gflop = eager_row["gflop"] - left_out / 1e9
    achieved = gflop * 1e9 / t["median"]
    row.update(gflop=gflop, gflop_linear=eager_row["gflop_linear"] - left_out / 1e9,
               last_block_rows=c.last_block_rows, backend=backend, time_ms=t["median"] * 1e3,
               time_min_ms=t["min"] * 1e3,
               per_block_ms=t["median"] * 1e3 / max(eager_row["blocks"], 1), achieved_gflops=achieved / 1e9,
               ratio=achieved / 1e9 / eager_row["peak_gflops"],
               ratio_vs_fp32_peak=achieved / 1e9 / eager_row["fp32_peak_gflops"],
               ratio_vs_best_peak=achieved / 1e9 / eager_row["best_peak_gflops"],
               ratio_vs_block_peak=achieved / 1e9 / eager_row["block_peak_gflops"],
               speedup_vs_eager=eager_row["time_ms"] / (t["median"] * 1e3), precision=c.precision,
               ops=_openvino_breakdown(c, (h if h.dim() == 3 else h.unsqueeze(0)).float().numpy(),
                                       t["median"] * 1e3, _blocks_linear_gflop(stage.cfg, k) - left_out / 1e9),
               build_cold_s=c.build_s, accuracy=acc, seconds=time.monotonic() - t0,
               artifact_bytes=sum(f.stat().st_size for f in c.folder.rglob("*") if f.is_file()))
    return row


def _reps(fn, repeats: int, slow_s: float = 1.0) -> int:
    """``repeats``, or 2 when one call of ``fn`` (timed here, CPU time) takes over ``slow_s`` seconds: bf16 on a
    CPU without bf16 instructions runs torch at 1-10 GFLOP/s, and the part must stay well under 10 minutes."""
    t0 = time.process_time()
    fn()
    return repeats if time.process_time() - t0 <= slow_s else min(repeats, 2)


class _GemmPeaks:
    """The best torch GEMM rates at a config's shapes (:func:`gemm_shapes`) per dtype, as F.linear and torch.mm, each
    shape timed once (``repeats`` samples of at least ``min_sample_s`` s on ``clock``)."""

    def __init__(self, repeats: int, min_sample_s: float, clock: str):
        self.repeats, self.min_sample_s, self.clock = repeats, min_sample_s, clock
        self.cache: dict[tuple, dict] = {}

    def gemm(self, shape, dtype) -> dict:
        """{shape, mm_gflops, linear_gflops} of one (M, K, N) GEMM in ``dtype`` (timed once per shape)."""
        import torch
        import torch.nn.functional as F

        key = (shape, dtype)
        if key not in self.cache:
            m, k, n = shape
            a = torch.randn(m, k).to(dtype)
            b = torch.randn(k, n).to(dtype)
            w = b.t().contiguous()  # (N, K): nn.Linear's weight layout
            c = torch.empty(m, n, dtype=dtype)
            flop = 2 * m * k * n
            with torch.inference_mode():
                t_lin = time_call(lambda: F.linear(a, w), repeats=_reps(lambda: F.linear(a, w), self.repeats),
                                  min_sample_s=self.min_sample_s, clock=self.clock)
                t0 = time.process_time()
                torch.mm(a, b, out=c)
                t_probe = time.process_time() - t0
                if t_probe > 1.0 and t_probe > 3 * t_lin["median"]:  # bf16 without bf16 instructions: torch.mm
                    t_mm = {"median": t_probe}  # runs at ~1 GFLOP/s, 10x below F.linear: one call tells enough
                else:
                    t_mm = time_call(lambda: torch.mm(a, b, out=c), repeats=self.repeats,
                                     min_sample_s=self.min_sample_s, clock=self.clock)
            self.cache[key] = {"shape": list(shape), "mm_gflops": flop / t_mm["median"] / 1e9,
                               "linear_gflops": flop / t_lin["median"] / 1e9}
        return self.cache[key]

    def peak_of(self, cfg, dtype):
        """(every GEMM timed at the config's shapes, the best one, its GFLOP/s)."""
        gemms = []
        for shape in gemm_shapes(cfg):
            rate = max((max(g["mm_gflops"], g["linear_gflops"]) for g in gemms), default=0.0)
            if shape == LARGE_GEMM and rate and 2 * math.prod(shape) / (rate * 1e9) > 0.5:
                # over 0.5 s a call at the block shapes' best rate (bf16 without bf16 instructions: 1-10 GFLOP/s,
                # torch.mm the slower): not the peak there, and timing it would take minutes
                gemms.append({"shape": list(shape), "mm_gflops": None, "linear_gflops": None,
                              "skipped": f"over 0.5 s a call at the {rate:.1f} GFLOP/s the block shapes reach"})
                continue
            gemms.append(self.gemm(shape, dtype))
        timed = [g for g in gemms if g["mm_gflops"] is not None]
        best = max(timed, key=lambda g: max(g["mm_gflops"], g["linear_gflops"]))
        return gemms, best, max(best["mm_gflops"], best["linear_gflops"])


def flops_task(chan, *, presets: list[dict], dtypes: list[str], threads: int, repeats: int = 5,
               min_sample_s: float = 0.05, gemm_repeats: int = 5, profile_ops: bool = True,
               backends: list[str] = ("eager",), cache_dir: str | None = None, clock: str = "wall",
               precision: str = "auto") -> dict:
    """Worker (pinned to the suffix cores): measure each preset's suffix per dtype and backend, and the GEMM peak
    per dtype.

    ``presets``: [{"name": preset, "blocks": n}] -- the suffix measured holds the last ``n`` blocks (K = L - n):
    every block has the same shapes, so a few blocks give the per-block rate at a fraction of the time; what each
    frame costs once (the final norm and heads, the compiled model's call, its last block's read-out rows) weighs
    more in a short suffix than in the one a chosen K leaves (``--flops-blocks``).
    ``backends``: "eager" always runs; "openvino" is built cold into ``cache_dir`` (which the restart workers
    reuse) and measured on the same stage. A backend that cannot be built is listed in ``skipped`` with the
    reason. ``clock``: :func:`.common.time_call`'s clock for every timing here (suffix and GEMMs alike).
    ``precision``: the suffix node's ``inference_precision``: with ``auto`` a bf16 / fp16 row is computed (and its
    GEMM peak taken) in fp32 on a CPU without native units for it; ``asked_peak_gflops`` keeps that dtype's peak."""
    import torch

    from ...model.checkpoint import parse_dtype
    from ...model.config import preset
    from ...model.modeling import DEFAULT_COMMAND
    from ...util.precision import inference_precision

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    peaks = _GemmPeaks(gemm_repeats, min_sample_s, clock)

    out, skipped = [], []
    for spec in presets:
        cfg = preset(spec["name"])
        k = max(0, cfg.num_layers - int(spec["blocks"]))
        count = suffix_flops(cfg, k)
        for dname in dtypes:
            asked = parse_dtype(dname)
            prec = inference_precision(asked, precision)  # as the suffix node computes it on this CPU
            dtype = prec.dtype
            stage, h = _stage(cfg, k, dtype, _seed(spec["name"], dname, k))
            t0 = time.monotonic()
            with torch.inference_mode():
                t = time_call(lambda: stage(h, DEFAULT_COMMAND, k), repeats=_reps(lambda: stage(h, DEFAULT_COMMAND, k),
                                                                                  repeats),
                              min_sample_s=min_sample_s, clock=clock)
                calls = max(1, min(3, int(0.5 / t["median"])))  # about half a second of profiling
                ops = _op_breakdown(lambda: stage(h, DEFAULT_COMMAND, k), calls=calls) if profile_ops else None
            gemms, best, peak = peaks.peak_of(cfg, dtype)
            peak32 = peak if dtype == torch.float32 else peaks.peak_of(cfg, torch.float32)[2]
            # the best GEMM at the block's own shapes (M = B T), in the faster of the two dtypes
            block_peak = max(max(g["mm_gflops"], g["linear_gflops"]) for dt in {dtype, torch.float32}
                             for g in peaks.peak_of(cfg, dt)[0]
                             if g["mm_gflops"] is not None and g["shape"] != list(LARGE_GEMM))
            achieved = count["total"] / t["median"] / 1e9
            row = {
                "preset": spec["name"], "dtype": dname, "backend": "eager", "split_layer": k,
                "num_layers": cfg.num_layers, "blocks": count["blocks"], "tokens": cfg.num_tokens,
                "passes": cfg.llm_passes, "gflop": count["total"] / 1e9, "gflop_linear": count["linear_total"] / 1e9,
                "gflop_attention": count["attention_total"] / 1e9, "time_ms": t["median"] * 1e3,
                "time_min_ms": t["min"] * 1e3, "per_block_ms": t["median"] * 1e3 / max(count["blocks"], 1),
                "achieved_gflops": achieved, "peak_gflops": peak, "peak_shape": best["shape"],
                "ratio": achieved / peak, "fp32_peak_gflops": peak32, "ratio_vs_fp32_peak": achieved / peak32,
                "best_peak_gflops": max(peak, peak32), "ratio_vs_best_peak": achieved / max(peak, peak32),
                "block_peak_gflops": block_peak, "ratio_vs_block_peak": achieved / block_peak,
                "speedup_vs_eager": 1.0, "gemm": gemms, "ops": ops, "seconds": time.monotonic() - t0,
                "precision": prec.name, "precision_reason": prec.reason,
                "asked_peak_gflops": peaks.peak_of(cfg, asked)[2] if prec.widened else peak,
            }
            out.append(row)
            why = (f"; {dname} GEMMs reach {row['asked_peak_gflops']:.1f} GFLOP/s on this CPU (no native units)"
                   if prec.widened else "")
            chan.send({"type": "progress", "line": f"  {spec['name']} {dname} eager ({prec.name}): {achieved:.1f} of "
                                                  f"{peak:.1f} GFLOP/s ({achieved / peak:.2f}){why}"})
            for backend in backends:
                if backend == "eager":
                    continue
                try:
                    r = _compiled_row(stage, h, k, dname, backend, cache_dir, threads, repeats, min_sample_s, row,
                                      clock)
                except ImportError as e:
                    skipped.append({"backend": backend, "preset": spec["name"], "dtype": dname, "reason": str(e)})
                    continue
                out.append(r)
                chan.send({"type": "progress", "line": f"  {spec['name']} {dname} {backend} ({r['precision']}): "
                                                      f"{r['achieved_gflops']:.1f} GFLOP/s ({r['ratio']:.2f}), "
                                                      f"{r['speedup_vs_eager']:.2f}x eager, cold build "
                                                      f"{r['build_cold_s']:.1f} s"})
            stage = h = None  # freed before the next (rebound, not deleted: the lambdas above read them)
    return {"results": out, "skipped": skipped, "threads": torch.get_num_threads()}


def restart_task(chan, *, preset_name: str, blocks: int, dtype: str, threads: int, cache_dir: str,
                 backend: str = "openvino", precision: str = "auto") -> dict:
    """Worker: a suffix restart in a fresh process, as the node does it. The stage (same seeded weights as the
    FLOP/s worker's) is built first -- the eager path could serve from then on -- and computes one frame
    eagerly; then ``backend`` comes up from the artifact the FLOP/s worker left in ``cache_dir`` (import, weights
    digest, read, compile with the CPU plugin's blob cache) and computes its first frame. Returns {eager_ready_s,
    eager_first_frame_ms, import_s, backend_build_s (digest + read + compile), cache_hit, first_frame_ms,
    steady_frame_ms (a later compiled frame), backend_extra_s}. backend_extra_s = import + build + first
    compiled frame - first eager frame: how much later than eager a restarted suffix returns its first frame
    when it waits for the compiled path (the node does not wait: eager serves while it builds). ``precision``:
    as :func:`flops_task`'s."""
    import torch

    from ...model.checkpoint import parse_dtype
    from ...model.config import preset
    from ...model.modeling import DEFAULT_COMMAND, plan
    from ...util.precision import inference_precision

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cfg = preset(preset_name)
    k = max(0, cfg.num_layers - int(blocks))
    computed = inference_precision(parse_dtype(dtype), precision).dtype  # as the FLOP/s worker built it
    stage, h = _stage(cfg, k, computed, _seed(preset_name, dtype, k))
    eager_ready = time.perf_counter() - t0
    with torch.inference_mode():
        t1 = time.perf_counter()
        stage(h, DEFAULT_COMMAND, k)
        eager_first = time.perf_counter() - t1
    t1 = time.perf_counter()
    import openvino  # noqa: F401 - the import is part of the restart

    import_s = time.perf_counter() - t1
    from ...runtime.suffix_backend import build_openvino

    c = build_openvino(stage, k, tuple(h.shape), model_id=0, cache_dir=cache_dir, threads=threads)
    ready = time.perf_counter() - t1  # import + digest + compile: the compiled path can take frames
    with torch.inference_mode():
        t2 = time.perf_counter()
        plan(stage, c.run(h), DEFAULT_COMMAND)
        first = time.perf_counter() - t2
        t3 = time.perf_counter()
        plan(stage, c.run(h), DEFAULT_COMMAND)
        steady = time.perf_counter() - t3
    return {"preset": preset_name, "dtype": dtype, "backend": backend, "eager_ready_s": eager_ready,
            "import_s": import_s, "backend_build_s": c.build_s, "backend_ready_s": ready,
            "backend_extra_s": ready + first - eager_first, "cache_hit": c.cache_hit, "first_frame_ms": first * 1e3,
            "steady_frame_ms": steady * 1e3, "eager_first_frame_ms": eager_first * 1e3}


def peer_ours_task(chan, *, tokens: int, threads: int, dtypes: list[str], backends: list[str], repeats: int = 5,
                   min_sample_s: float = 0.2, cache_dir: str, clock: str = "wall") -> dict:
    """Worker: all 30 ``smol`` blocks + norm + heads (K = 0, one pass of ``tokens`` tokens) per dtype and
    backend, the peer figure for llama.cpp's prefill. Returns {results: [{dtype, backend, time_ms, build_s}]}."""
    import torch

    from ...model.checkpoint import parse_dtype
    from ...model.config import preset
    from ...model.modeling import DEFAULT_COMMAND, plan

    torch.set_num_threads(threads)
    cfg = preset("smol")
    if cfg.num_tokens != tokens or cfg.llm_passes != 1:
        raise ValueError(f"smol has T = {cfg.num_tokens} in {cfg.llm_passes} pass(es), asked for {tokens}")
    out = []
    for dname in dtypes:
        stage, h = _stage(cfg, 0, parse_dtype(dname), _seed("smol-all", dname))
        for backend in backends:
            with torch.inference_mode():
                if backend == "eager":
                    t = time_call(lambda: stage(h, DEFAULT_COMMAND, 0), repeats=repeats, min_sample_s=min_sample_s,
                                  clock=clock)
                    build_s = 0.0
                else:
                    from ...runtime.suffix_backend import build_openvino

                    try:
                        c = build_openvino(stage, 0, tuple(h.shape), model_id=0, cache_dir=cache_dir,
                                           threads=threads)
                    except ImportError as e:
                        out.append({"dtype": dname, "backend": backend, "skipped": str(e)})
                        continue
                    build_s = c.build_s
                    t = time_call(lambda: plan(stage, c.run(h), DEFAULT_COMMAND), repeats=repeats,
                                  min_sample_s=min_sample_s, clock=clock)
                    c = None  # the compiled model goes before the next one is built (a rebinding: the lambda above
                    # reads ``c`` when it runs, so a ``del`` would read to pyflakes as an undefined name)
            out.append({"dtype": dname, "backend": backend, "time_ms": t["median"] * 1e3,
                        "time_min_ms": t["min"] * 1e3, "build_s": build_s})
            chan.send({"type": "progress", "line": f"  peer: smol 30 blocks {dname} {backend}: "
                                                  f"{t['median'] * 1e3:.1f} ms"})
        stage = h = None  # freed before the next dtype (rebound: the lambdas above read them)
    return {"results": out}


def peer_llama_task(chan, *, tokens: int, threads: int, repeats: int = 5, min_sample_s: float = 0.2,
                    clock: str = "wall") -> dict:
    """Worker: llama.cpp prefill of ``tokens`` tokens for the wheel's Q4_1 GGUF and its dequantised f32 / bf16
    exports (written once into the cache folder, :func:`.llama_peer.peer_files`). Returns {kind: {file,
    median_ms, min_ms, load_s}}, or {"skipped_reason": why} when llama.cpp or the GGUF file is missing."""
    from .llama_peer import llama_cpp_status, peer_files, time_llama_prefill

    ok, reason = llama_cpp_status()
    if not ok:
        return {"skipped_reason": reason}
    try:
        files = peer_files(log=lambda line: chan.send({"type": "progress", "line": line}))
    except FileNotFoundError as e:
        return {"skipped_reason": str(e)}
    out = {}
    for kind, path in files.items():
        out[kind] = {"file": str(path), **time_llama_prefill(path, tokens, threads, repeats=repeats,
                                                             min_sample_s=min_sample_s, clock=clock)}
        chan.send({"type": "progress", "line": f"  peer: llama.cpp {kind}: {out[kind]['median_ms']:.1f} ms"})
    return out


def run_peer(*, cores, threads: int, tokens: int, dtypes=("bf16",), backends=("eager", "openvino"),
             cache_dir: str, repeats: int = 5, clock: str = "wall", log=print) -> dict:
    """The llama.cpp peer (see :mod:`.llama_peer`): this package's 30 ``smol`` blocks and llama.cpp's prefill of
    SmolLM2-135M at the same token count on the same cores, each in its own pinned worker. Returns the JSON
    section: {tokens, threads, ours: [...], llama_cpp: {kind: {median_ms, ...}} | None, skipped_reason,
    ratios: {"<kind>_over_<dtype>_<backend>": llama.cpp ms / ours ms}, best_ours}."""
    from .common import Worker

    with Worker("peer_ours", {"tokens": tokens, "threads": threads, "dtypes": list(dtypes),
                              "backends": list(backends), "repeats": repeats, "cache_dir": cache_dir,
                              "clock": clock},
                cores=list(cores)) as w:
        ours = w.result(1800, log=log)["results"]
    section = {"tokens": tokens, "threads": threads, "ours": ours, "llama_cpp": None, "skipped_reason": "",
               "ratios": {}, "best_ours": None}
    timed = [r for r in ours if "time_ms" in r]
    if timed:
        best = min(timed, key=lambda r: r["time_ms"])
        section["best_ours"] = {"dtype": best["dtype"], "backend": best["backend"], "time_ms": best["time_ms"]}
    with Worker("peer_llama", {"tokens": tokens, "threads": threads, "repeats": repeats, "clock": clock},
                cores=list(cores)) as w:
        llama = w.result(1800, log=log)
    if "skipped_reason" in llama:
        section["skipped_reason"] = llama["skipped_reason"]
        log(f"  peer: llama.cpp skipped: {llama['skipped_reason']}")
        return section
    section["llama_cpp"] = llama
    for kind, lr in llama.items():
        for r in timed:
            section["ratios"][f"{kind}_over_{r['dtype']}_{r['backend']}"] = lr["median_ms"] / r["time_ms"]
    return section


def run_flops_part(presets, *, dtypes=("fp32", "bf16"), cores=(1,), blocks: int = 4, repeats: int = 5,
                   min_sample_s: float = 0.05, goal: float = 0.6, backends=("eager", "openvino"),
                   peer: bool = True, log=print) -> dict:
    """The whole FLOP/s part: one pinned worker for the FLOP/s of every preset, dtype and backend (compiled
    backends built cold into a temporary cache folder), one fresh worker per compiled case for its restart
    from that folder, and the llama.cpp peer (``peer``); returns its JSON section."""
    import shutil
    import tempfile

    from .common import Worker

    specs = [{"name": p, "blocks": blocks} for p in presets]
    backends = list(dict.fromkeys(["eager", *backends]))
    clock = "cpu" if len(cores) == 1 else "wall"  # one thread: CPU time leaves out other processes' turns
    log(f"suffix FLOP/s: {', '.join(presets)} x {', '.join(dtypes)} x {', '.join(backends)} on cores "
        f"{list(cores)}, last {blocks} blocks")
    cache_dir = tempfile.mkdtemp(prefix="hybrid_vla_bench_backend_")
    try:
        with Worker("suffix_flops", {"presets": specs, "dtypes": list(dtypes), "threads": len(cores),
                                     "repeats": repeats, "min_sample_s": min_sample_s, "backends": backends,
                                     "cache_dir": cache_dir, "clock": clock}, cores=list(cores)) as w:
            data = w.result(3600, log=log)
        restarts = []
        for r in data["results"]:
            if r["backend"] == "eager":
                continue
            with Worker("suffix_restart", {"preset_name": r["preset"], "blocks": blocks, "dtype": r["dtype"],
                                           "threads": len(cores), "cache_dir": cache_dir,
                                           "backend": r["backend"]}, cores=list(cores)) as w:
                x = w.result(600, log=log)
            r["restart"] = x
            restarts.append(x)
            log(f"  {r['preset']} {r['dtype']} {r['backend']} restart: +{x['backend_extra_s']:.2f} s over eager "
                f"(cache hit {x['cache_hit']}; cold build was {r['build_cold_s']:.1f} s)")
        peer_section = None
        if peer and "smol" in presets:
            from ...model.config import preset

            peer_section = run_peer(cores=cores, threads=len(cores), tokens=preset("smol").num_tokens,
                                    backends=[b for b in backends if b in ("eager", "openvino")],
                                    cache_dir=cache_dir, repeats=repeats, clock=clock, log=log)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    return {"cores": list(cores), "threads": data["threads"], "clock": clock, "goal_ratio": goal,
            "goal_ratio_best": dict(GOAL_RATIO_BEST), "goal_restart_s": GOAL_RESTART_S, "backends": backends,
            "skipped": data.get("skipped", []),
            "flop_counting": "2 x MACs of every Linear + QK^T and AV with causal attention counted as half "
                             "(T(T+1)/2 pairs); heads on the last token; elementwise ops not counted",
            "peak": "best of torch.mm(out=) and F.linear over the block's GEMM shapes and 2048^3, same dtype, cores "
                    "and threads",
            "results": data["results"], "peer": peer_section}
