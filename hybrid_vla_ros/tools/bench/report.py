"""Bench output: goal evaluation, the JSON document, PNG plots (matplotlib, Agg) and Markdown tables.

JSON document (``kind`` "hybrid_vla_bench", ``format_version`` 1)::

    created_utc, wall_s, quick, parts, options   when and how it ran (options: the parsed command line)
    host        {cpu_model, logical_cpus, cpu_flags, platform}
    software    {python, torch, numpy, opencv}
    noise       {part: {wall_s, foreign_cpu_share, steal_share, loadavg_1min}}  other load while each part ran
    settings    the effective options (sizes, counts, presets, cores, dtype, image sizes, split layers)
    prepare     {preset: checkpoint path, split_layer, split_reason, per-block profile, predicted P(K), H + S(K)}
    handoff     (hybrid_vla_ros.tools.bench.handoff.run_handoff)    sizes[]: memcpy, memcpy_after_wait {latency_ms,
                wait_ms}, ring, rclpy{variant}, ratios;
                and the zero-copy hand-off (tools.bench.zero_copy), see below
    pipeline    (hybrid_vla_ros.tools.bench.pipeline.run_pipeline_part)  presets[]: split, pipeline, sequential;
                suffix_bound: {preset, split_layer, suffix_extra_ms, warmup_frames, variants: {fifo, newest,
                newest_paced}: the pipeline figures (latency.overhead_p50_ms, allowed_ms, met, fps, stages_ms,
                ring_stats), error (only when a variant was not suffix-bound: the goal is then not met)} or null
    suffix_flops (hybrid_vla_ros.tools.bench.suffix_flops.run_flops_part) results[]: achieved / peak GFLOP/s,
                one entry per preset, dtype and backend (see below), peer: the llama.cpp comparison
    preprocess  (hybrid_vla_ros.tools.bench.preprocess.run_preprocess_part) results[]: preprocess / prefix ms, share,
                decoder / resize of the case, one-pass limit_ms and ratio_to_limit
    goals       [{id, part, what, value, target, met}]
    errors      {part: message} for parts that failed
    notes       [str]

Zero-copy hand-off keys (fixed; present unless the run had --no-zero-copy). ``handoff``: ``gaps_ms`` (frame gaps,
0 = back to back), ``gap_keys`` (``gap_<g>ms``), ``gap_count``, ``block_gaps_ms``, ``spin`` {lead_ms, max_ms},
``rt_priority``, ``iceoryx2`` {available, version | skipped}, ``zero_copy_definition``. Each ``handoff.sizes[]``
row: ``zero_copy`` (the ring, the frame produced in the slot, the suffix's spin-then-block wake-up),
``zero_copy_block`` (same, spin off, at ``block_gaps_ms``) and ``iceoryx2`` (loan + event wait; or
{"skipped": reason}), each {gap_key: {gap_ms, handoff_ms (percentiles, with p99), n, lost, cpu_ms_per_msg
{producer, consumer, total}, spin_ms_per_msg, found {found_ready, found_spinning, found_after_block}, outliers
{over_ms, n, causes {page_faults, preempted, spin_window, wake_up, spin, ready}}}} (tools.bench.zero_copy), and
``ratio_iceoryx2_over_zero_copy`` {gap_key: {p50, p99}}. Goals on them (when all of 1, 4, 8 and 32 MiB and
the gaps 0, 20 and 100 ms ran): ``handoff_zero_copy_p50`` (largest p50 <= 0.05 ms), ``handoff_zero_copy_p99``
(largest p99 <= 0.2 ms), ``handoff_zero_copy_vs_iceoryx2`` (smallest iceoryx2 / ring ratio of p50 and p99
> 1); and ``pipeline_latency_suffix_bound`` (newest_paced: median overhead <= 5 % + 2 ms).


``suffix_flops`` in detail (fixed keys; the goals read them)::

    cores, threads, clock ("cpu": process CPU time, used with one thread; "wall" with more), backends [str],
    goal_ratio (eager rows, legacy 0.6), goal_ratio_best {dtype: ratio} and
    goal_restart_s (issue #16), skipped [{backend, preset, dtype, reason}] (a backend that could not be built)
    results[]   preset, dtype, backend ("eager" | "openvino"), split_layer, blocks, tokens, passes, gflop,
                time_ms, achieved_gflops, peak_gflops (best torch GEMM of the dtype computed in), ratio (achieved /
                peak), eager rows also precision (the dtype computed in: ``inference_precision: auto`` widens bf16 /
                fp16 to fp32 on a CPU without native units), precision_reason, asked_peak_gflops (the best GEMM of
                the dtype asked, emulated where widened),
                fp32_peak_gflops, ratio_vs_fp32_peak, best_peak_gflops (max of the two), ratio_vs_best_peak,
                block_peak_gflops (the best GEMM at the block's own shapes, M = B T, without 2048^3; informative:
                at T = 81 these run below the large product), ratio_vs_block_peak, speedup_vs_eager, gemm[]
                (a shape not timed has null rates and ``skipped``), ops (eager: torch.profiler shares {gemm_share,
                attention_share, other_share, top_ops}; a compiled backend: the plugin's node counters, the same
                three shares of the measured time plus outside_share, gemm_ms, attention_ms, other_ms and
                gemm_gflops_in_graph, the rate its FullyConnected nodes reach)
      compiled backends also: gflop and gflop_linear of what their graph computes (less than eager's when
                last_block_rows, the rows block L-1 computes after attention, is set), precision (what the CPU
                plugin computes in: "f32" | "bf16"), build_cold_s
                (convert + save + compile into an empty cache), artifact_bytes, accuracy
                {rel_l2_last_hidden_vs_eager, waypoints_max_abs_vs_eager_m, and for bf16
                rel_l2_last_hidden_vs_fp32, eager_rel_l2_last_hidden_vs_fp32}, restart {eager_ready_s,
                eager_first_frame_ms, import_s, backend_build_s, backend_ready_s, cache_hit, first_frame_ms,
                steady_frame_ms, backend_extra_s = import + build + first compiled frame - first eager frame, s:
                how much later than eager a restarted suffix returns its first frame through the compiled path}
    peer        (or null) tokens, threads, ours [{dtype, backend, time_ms, build_s}] (all 30 ``smol`` blocks),
                llama_cpp {q4_1 | f32 | bf16: {file, median_ms, min_ms, load_s}} or null, skipped_reason,
                llama_cpp_build {path, built, seconds} or {error} (only with ``--build-llama-cpp``),
                ratios {"<kind>_over_<dtype>_<backend>": llama.cpp ms / ours ms}, best_ours {dtype, backend,
                time_ms}

Goals (:func:`evaluate_goals`): ``suffix_flops_<preset>_<dtype>`` (eager ratio >= goal_ratio),
``suffix_flops_best_<preset>_<dtype>`` (the best backend's ratio_vs_best_peak >= goal_ratio_best[dtype], smol
and minddrive-0.5b: against the faster of the dtype's and the fp32 GEMM, because on a CPU without bf16
instructions torch's bf16 GEMM is an emulation that any backend computing in f32 beats several times),
``suffix_restart_<preset>_<dtype>_<backend>`` (backend_extra_s <= goal_restart_s and the artifact was reused),
``suffix_peer_llama_cpp_<kind>`` (llama.cpp ms / our best bf16 ms > 1: faster than llama.cpp),
``preprocess_rgb8_<preset>_<resize>`` (6 raw 1600x900 cameras: preprocess / one-pass limit <= 2, per filter).

Times are ms unless the key says otherwise; percentiles are dicts {n, p50, p90, p99, mean, min, max}. Non-finite
numbers are written as null.
"""
from __future__ import annotations

import math
from pathlib import Path

from ...transport.stats import ConsumerStats

FORMAT_VERSION = 1
KIND = "hybrid_vla_bench"
PARTS = ("handoff", "pipeline", "loadstep", "suffix_flops", "preprocess", "families", "moe")

#: Keys each part's section must have (and, for list entries, each entry), checked by :func:`validate`.
REQUIRED = {
    "top": ("kind", "format_version", "created_utc", "wall_s", "quick", "host", "software", "noise", "goals",
            "errors", "notes"),
    "handoff": ("count", "warmup", "rclpy_count", "variants", "producer_cores", "consumer_cores", "sizes"),
    "handoff.sizes": ("size_mib", "bytes", "memcpy", "ring", "rclpy", "ratio_ring_over_memcpy_p50", "best_rclpy",
                      "ratio_best_rclpy_over_ring_p50"),
    "handoff.ring": ("latency_ms", "copy_ms", "publish_to_view_ms", "cpu_ms_per_msg", "n"),
    "handoff.zero_copy": ("gap_ms", "handoff_ms", "n", "lost", "cpu_ms_per_msg", "spin_ms_per_msg", "found",
                          "outliers"),
    "pipeline": ("bag", "warmup_frames", "presets"),
    "pipeline.presets": ("preset", "dtype", "split_layer", "split_reason", "num_layers", "num_tokens", "image_size",
                         "note", "pipeline", "sequential"),
    "pipeline.pipeline": ("fps", "ideal_fps", "efficiency", "latency", "stages_ms", "prefix_side_ms",
                          "handoff_suffix_side_ms", "frames_measured", "timeline"),
    "loadstep": ("presets",),
    "loadstep.presets": ("preset", "split_layer", "before", "during", "after", "warmup", "runs"),
    "loadstep.runs": ("phases", "moves", "frames"),
    "suffix_flops": ("cores", "threads", "goal_ratio", "goal_ratio_best", "goal_restart_s", "backends", "skipped",
                     "results", "peer"),
    "suffix_flops.results": ("preset", "dtype", "backend", "split_layer", "gflop", "time_ms", "achieved_gflops",
                             "peak_gflops", "ratio", "fp32_peak_gflops", "ratio_vs_fp32_peak", "best_peak_gflops",
                             "ratio_vs_best_peak", "speedup_vs_eager", "gemm", "ops"),
    "suffix_flops.compiled": ("precision", "build_cold_s", "accuracy", "restart"),
    "suffix_flops.peer": ("tokens", "threads", "ours", "llama_cpp", "skipped_reason", "ratios", "best_ours"),
    "preprocess": ("source", "cores", "results"),
    "preprocess.results": ("preset", "input", "image_size", "decode_ms", "preprocess_ms", "prefix_ms", "share"),
}


def _missing(obj: dict, keys, where: str) -> list[str]:
    return [f"{where}.{k}" for k in keys if not isinstance(obj, dict) or k not in obj]


def validate(doc: dict) -> list[str]:
    """Missing fields of a bench document (empty when complete); parts listed in ``errors`` or not run are
    skipped."""
    out = _missing(doc, REQUIRED["top"], "doc")
    h = doc.get("handoff")
    if h:
        out += _missing(h, REQUIRED["handoff"], "handoff")
        for i, row in enumerate(h.get("sizes", [])):
            out += _missing(row, REQUIRED["handoff.sizes"], f"handoff.sizes[{i}]")
            out += _missing(row.get("ring", {}), REQUIRED["handoff.ring"], f"handoff.sizes[{i}].ring")
            if "gaps_ms" in h:
                for m in ("zero_copy", "zero_copy_block", "iceoryx2"):
                    if m not in row:
                        out.append(f"handoff.sizes[{i}].{m}")
                        continue
                    for gap, e in row[m].items():
                        if gap != "skipped":
                            out += _missing(e, REQUIRED["handoff.zero_copy"], f"handoff.sizes[{i}].{m}.{gap}")
    p = doc.get("pipeline")
    if p:
        out += _missing(p, REQUIRED["pipeline"], "pipeline")
        for i, e in enumerate(p.get("presets", [])):
            out += _missing(e, REQUIRED["pipeline.presets"], f"pipeline.presets[{i}]")
            out += _missing(e.get("pipeline", {}), REQUIRED["pipeline.pipeline"], f"pipeline.presets[{i}].pipeline")
    ls = doc.get("loadstep")
    if ls:
        out += _missing(ls, REQUIRED["loadstep"], "loadstep")
        for i, e in enumerate(ls.get("presets", [])):
            out += _missing(e, REQUIRED["loadstep.presets"], f"loadstep.presets[{i}]")
            for name, r in e.get("runs", {}).items():
                out += _missing(r, REQUIRED["loadstep.runs"], f"loadstep.presets[{i}].runs.{name}")
    f = doc.get("suffix_flops")
    if f:
        out += _missing(f, REQUIRED["suffix_flops"], "suffix_flops")
        for i, r in enumerate(f.get("results", [])):
            out += _missing(r, REQUIRED["suffix_flops.results"], f"suffix_flops.results[{i}]")
            if r.get("backend", "eager") != "eager":
                out += _missing(r, REQUIRED["suffix_flops.compiled"], f"suffix_flops.results[{i}]")
        if f.get("peer"):
            out += _missing(f["peer"], REQUIRED["suffix_flops.peer"], "suffix_flops.peer")
    q = doc.get("preprocess")
    if q:
        out += _missing(q, REQUIRED["preprocess"], "preprocess")
        for i, r in enumerate(q.get("results", [])):
            out += _missing(r, REQUIRED["preprocess.results"], f"preprocess.results[{i}]")
    return out


# ------------------------------------------------------------------------------------------ goals

def _flops_goals(f: dict, add) -> None:
    """The CPU suffix's goals: eager ratio to the GEMM peak, the best backend's, restart time, the llama.cpp peer."""
    rows = f["results"]
    for r in rows:
        if r.get("backend", "eager") == "eager":
            add(f"suffix_flops_{r['preset']}_{r['dtype']}", "suffix_flops",
                f"{r['preset']} {r['dtype']} eager: achieved / GEMM peak FLOP/s", r["ratio"],
                f">= {f['goal_ratio']}", r["ratio"] >= f["goal_ratio"])
    for name in ("smol", "minddrive-0.5b"):
        for dtype, target in (f.get("goal_ratio_best") or {}).items():
            cands = [r for r in rows if r["preset"] == name and r["dtype"] == dtype]
            if not cands:
                continue
            best = max(cands, key=lambda r: r.get("ratio_vs_best_peak", r["ratio"]))
            v = best.get("ratio_vs_best_peak", best["ratio"])
            add(f"suffix_flops_best_{name}_{dtype}", "suffix_flops",
                f"{name} {dtype}, best backend ({best['backend']}): achieved / same run's best GEMM "
                f"(max of {dtype} and fp32)", v, f">= {target}", v >= target)
    for r in rows:
        x = r.get("restart")
        if x:
            add(f"suffix_restart_{r['preset']}_{r['dtype']}_{r['backend']}", "suffix_flops",
                f"{r['preset']} {r['dtype']} {r['backend']}: restart from the cached artifact, s beyond eager"
                + ("" if x.get("cache_hit") else " (artifact NOT reused)"), x["backend_extra_s"],
                f"<= {f['goal_restart_s']}", x["backend_extra_s"] <= f["goal_restart_s"] and x.get("cache_hit"))
    peer = f.get("peer") or {}
    timed = sorted((r for r in peer.get("ours", []) if "time_ms" in r and r["dtype"] == "bf16"),
                   key=lambda r: r["time_ms"])
    for kind, lr in (peer.get("llama_cpp") or {}).items():
        if timed:
            v = lr["median_ms"] / timed[0]["time_ms"]
            add(f"suffix_peer_llama_cpp_{kind}", "suffix_flops",
                f"llama.cpp {kind} prefill ms / ours ({timed[0]['backend']} bf16, all 30 smol blocks) ms at "
                f"T={peer['tokens']}", v, "> 1", v > 1)


#: The copy hand-off's goal (issue 42): ring p50 / the same run's memcpy p50 of the same bytes (the memcpy after the
#: ring producer's acknowledgement wait, as its copies are made), from this size up.
HANDOFF_MEMCPY_RATIO, HANDOFF_MEMCPY_FROM_MIB = 1.3, 4.0  # ratio, MiB


def _copy_handoff_goal(row: dict, add) -> None:
    """The copy hand-off's goal of one ``handoff.sizes`` row, from :data:`HANDOFF_MEMCPY_FROM_MIB` up. The copy the
    ring makes follows the producer's wait for an acknowledgement: its limit is a memcpy after the same wait
    (``memcpy_after_wait``, handoff.py); a document without it is judged against the back-to-back memcpy."""
    waited = row.get("memcpy_after_wait")
    v = row.get("ratio_ring_over_memcpy_after_wait_p50" if waited else "ratio_ring_over_memcpy_p50")
    if row["size_mib"] < HANDOFF_MEMCPY_FROM_MIB or v is None:
        return
    limit = (f"memcpy after the same {_f(waited['wait_ms'], 3)} ms wait p50 {_f(waited['latency_ms']['p50'], 3)} "
             "ms; back to back " if waited else "memcpy p50 ") + f"{_f(row['memcpy']['latency_ms']['p50'], 3)} ms"
    add(f"handoff_vs_memcpy_{row['size_mib']:g}mib", "handoff", f"ring p50 / memcpy p50 at {row['size_mib']:g} MiB "
        f"(ring {_f(row['ring']['latency_ms']['p50'], 3)} ms; {limit})", v, f"<= {HANDOFF_MEMCPY_RATIO}",
        v <= HANDOFF_MEMCPY_RATIO)


def evaluate_goals(doc: dict, *, handoff_size_mib: float = 8.0, handoff_ratio: float = 40.0) -> list[dict]:
    """The issue's goals against the measured figures: [{id, part, what, value, target, met}]. The copy hand-off
    is judged against the same run's memcpy of the same bytes (:data:`HANDOFF_MEMCPY_RATIO` from
    :data:`HANDOFF_MEMCPY_FROM_MIB` up: a host whose memcpy is slower cannot meet an absolute time), against rclpy
    at ``handoff_size_mib``."""
    goals = []

    def add(gid, part, what, value, target, met):
        ok = None if value is None or (isinstance(value, float) and not math.isfinite(value)) else bool(met)
        goals.append({"id": gid, "part": part, "what": what, "value": value, "target": target, "met": ok})

    h = doc.get("handoff")
    if h:
        for row in h["sizes"]:
            _copy_handoff_goal(row, add)
        row = next((r for r in h["sizes"] if r["size_mib"] == handoff_size_mib), None)
        if row is not None:
            r = row["ratio_best_rclpy_over_ring_p50"]
            if r is not None:
                add(f"handoff_vs_rclpy_{handoff_size_mib:g}mib", "handoff",
                    f"best rclpy ({row['best_rclpy']}) p50 / ring p50 at {handoff_size_mib:g} MiB", r,
                    f">= {handoff_ratio}", r >= handoff_ratio)
        _zero_copy_goals(h, add)
    p = doc.get("pipeline")
    if p:
        sb = p.get("suffix_bound")
        if sb and "newest_paced" in sb.get("variants", {}):
            lat = sb["variants"]["newest_paced"]["latency"]
            add("pipeline_latency_suffix_bound", "pipeline",
                f"suffix-bound {sb['preset']} K={sb['split_layer']} (+{sb['suffix_extra_ms']:g} ms suffix), newest + "
                "paced: e2e - stage sum, p50 (ms)"
                + (f" -- NOT suffix-bound: {sb['error']}" if sb.get("error") else ""),
                lat["overhead_p50_ms"], f"<= {lat['allowed_ms']:.2f} (5 % + 2 ms)",
                lat["met"] and not sb.get("error"))
        for e in p["presets"]:
            pl = e["pipeline"]
            add(f"pipeline_efficiency_{e['preset']}", "pipeline", f"{e['preset']} (K={e['split_layer']}): fps / "
                f"ideal fps", pl["efficiency"], f">= {p.get('efficiency_goal', 0.9)}",
                pl["efficiency"] >= p.get("efficiency_goal", 0.9))
            lat = pl["latency"]
            add(f"pipeline_latency_{e['preset']}", "pipeline", f"{e['preset']}: e2e - stage sum, p50 (ms)",
                lat["overhead_p50_ms"], f"<= {lat['allowed_ms']:.2f} (5 % + 2 ms)", lat["met"])
            if e.get("plan_checks"):
                c, first = e["plan_checks"][-1], e["plan_checks"][0]
                moved = f" (first K={first['split_layer']} ran suffix-bound)" if len(e["plan_checks"]) > 1 else ""
                add(f"pipeline_plan_{e['preset']}", "pipeline",
                    f"{e['preset']} at the planned K={c['split_layer']}{moved}: measured prefix / (hand-off + suffix) "
                    f"({_f(c['measured_prefix_ms'], 1)} / {_f(c['measured_handoff_suffix_ms'], 1)} ms; predicted "
                    f"{_f(c['predicted_prefix_ms'], 1)} / {_f(c['predicted_handoff_suffix_ms'], 1)})",
                    c["measured_prefix_ms"] / c["measured_handoff_suffix_ms"], ">= 1 (prefix-bound)",
                    c["prefix_bound"])
    ls = doc.get("loadstep")
    for e in (ls or {}).get("presets", []):
        for where in ("suffix", "prefix"):
            run = e["runs"].get(f"{where}_rebalance")
            if not run:
                continue
            during = run["phases"]["during"]
            add(f"loadstep_latency_{e['preset']}_{where}", "loadstep",
                f"{e['preset']}, co-tenant on the {where}'s cores, live rebalancing: e2e - stage sum during the "
                "step, p50 (ms)", during["overhead_p50_ms"],
                f"<= {_f(during['allowed_ms'], 2)} (5 % + 2 ms)", during["met"])
            add(f"loadstep_settle_{e['preset']}_{where}", "loadstep",
                f"{e['preset']}, co-tenant on the {where}'s cores, live rebalancing: frames from the step until the "
                "latency settles", during["settle_frames"], "<= 10",
                during["settle_frames"] is not None and during["settle_frames"] <= 10)
            fixed = (e["runs"].get(f"{where}_fixed") or {}).get("phases", {}).get("during", {})
            if fixed.get("e2e_p50_ms") and during.get("e2e_p50_ms"):
                ratio = during["e2e_p50_ms"] / fixed["e2e_p50_ms"]
                add(f"loadstep_gain_{e['preset']}_{where}", "loadstep",
                    f"{e['preset']}, co-tenant on the {where}'s cores: e2e p50 during the step, rebalanced / fixed K",
                    ratio, "<= 1 (not slower than a fixed K)", ratio <= 1.0)
    f = doc.get("suffix_flops")
    if f:
        _flops_goals(f, add)
    if doc.get("decode"):
        from .decode import decode_goals

        decode_goals(doc["decode"], add)
    if doc.get("moe"):
        from .moe import goals as moe_goals

        moe_goals(doc["moe"], add)
    q = doc.get("preprocess")
    for r in (q or {}).get("results", []):
        if r["input"] == "rgb8" and r.get("ratio_to_limit") is not None:
            add(f"preprocess_rgb8_{r['preset']}_{r['resize']}", "preprocess",
                f"{r['preset']}: 6 raw rgb8 1600x900 cameras, resize {r['resize']}: preprocess / one-pass limit "
                f"({_f(r['preprocess_ms']['p50'], 1)} / {_f(r['limit_ms'], 1)} ms)", r["ratio_to_limit"], "<= 2",
                r["ratio_to_limit"] <= 2)
    return goals


ZERO_COPY_GOAL_SIZES = (1.0, 4.0, 8.0, 32.0)
ZERO_COPY_GOAL_GAPS = ("gap_0ms", "gap_20ms", "gap_100ms")


def _zero_copy_goals(h: dict, add, p50_ms: float = 0.05, p99_ms: float = 0.2) -> None:
    """The zero-copy goals, when every goal size and gap was measured (else none is added)."""
    rows = {r["size_mib"]: r for r in h.get("sizes", [])}
    if "gaps_ms" not in h or not all(s in rows for s in ZERO_COPY_GOAL_SIZES):
        return
    cells = [(s, g, rows[s]["zero_copy"].get(g)) for s in ZERO_COPY_GOAL_SIZES for g in ZERO_COPY_GOAL_GAPS]
    if any(c is None or not c["handoff_ms"]["n"] for _, _, c in cells):
        return
    worst50 = max(cells, key=lambda c: c[2]["handoff_ms"]["p50"])
    worst99 = max(cells, key=lambda c: c[2]["handoff_ms"]["p99"])
    v50, v99 = worst50[2]["handoff_ms"]["p50"], worst99[2]["handoff_ms"]["p99"]
    add("handoff_zero_copy_p50", "handoff", f"zero-copy hand-off, largest p50 over 1-32 MiB x gaps 0/20/100 ms "
        f"(ms; at {worst50[0]:g} MiB {worst50[1]})", v50, f"<= {p50_ms}", v50 <= p50_ms)
    add("handoff_zero_copy_p99", "handoff", f"zero-copy hand-off, largest p99 (ms; at {worst99[0]:g} MiB "
        f"{worst99[1]}; {_outlier_text([c for _, _, c in cells])})", v99, f"<= {p99_ms}", v99 <= p99_ms)
    ratios = [r for s in ZERO_COPY_GOAL_SIZES for g in ZERO_COPY_GOAL_GAPS
              for r in rows[s].get("ratio_iceoryx2_over_zero_copy", {}).get(g, {}).values()]
    if len(ratios) == 2 * len(cells):
        add("handoff_zero_copy_vs_iceoryx2", "handoff", "smallest iceoryx2 / ring ratio of p50 and p99 over sizes "
            "and gaps", min(ratios), "> 1", min(ratios) > 1)


def _outlier_text(cells: list) -> str:
    """'hand-offs over 0.5 ms: 3 (wake_up 2, preempted 1)' over zero-copy summaries with ``outliers``."""
    cells = [c for c in cells if c and "outliers" in c]
    if not cells:
        return "outliers not attributed"
    causes: dict = {}
    for c in cells:
        for name, n in c["outliers"]["causes"].items():
            causes[name] = causes.get(name, 0) + n
    total = sum(causes.values())
    named = ", ".join(f"{k} {n}" for k, n in sorted(causes.items(), key=lambda kv: -kv[1]) if n)
    return f"hand-offs over {cells[0]['outliers']['over_ms']:g} ms: {total}" + (f" ({named})" if total else "")


# ------------------------------------------------------------------------------------------ JSON

def write_json(doc: dict, path: str | Path) -> Path:
    """Write ``doc`` as strict JSON (NaN / inf as null), creating the folder (:func:`~..harness.write_report`)."""
    from ..harness import write_report

    return write_report(doc, path)


# ------------------------------------------------------------------------------------------ Markdown

def _f(x, nd: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, float):
        if abs(x) >= 1000:
            return f"{x:.0f}"
        if abs(x) >= 100:
            return f"{x:.1f}"
        return f"{x:.{nd}f}"
    return str(x)


def _pp(p: dict, nd: int = 3) -> str:
    return f"{_f(p['p50'], nd)} / {_f(p['p90'], nd)}" if p and p.get("n") else "-"


def _time_shares(ops: dict, peak_gflops: float) -> str:
    """The suffix table's time column: shares of GEMM / attention / other (eager: torch.profiler's aten ops; a
    compiled backend: the plugin's node counters, then the share outside the graph and the rate its GEMM nodes
    reach against the GEMM peak)."""
    if not ops:
        return "-"
    text = " / ".join(f"{ops.get(k, float('nan')):.0%}" for k in ("gemm_share", "attention_share", "other_share"))
    if "outside_share" in ops:
        text += f" / {ops['outside_share']:.0%}" + (" (counted run longer than timed)"
                                                    if ops.get("counted_exceeds_timed") else "")
        if ops.get("gemm_gflops_in_graph") and peak_gflops:
            text += f" (GEMMs at {ops['gemm_gflops_in_graph'] / peak_gflops:.2f})"
    return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """Markdown tables of every part that ran, plus the goals (for the README's Performance section)."""
    out = []
    host = doc.get("host", {})
    out.append(f"Measured with `hybrid-vla bench{' --quick' if doc.get('quick') else ''}` on {host.get('cpu_model')} "
               f"(host class {host.get('isa_level', '-')}; {host.get('logical_cpus')} logical CPUs; "
               f"{', '.join(host.get('cpu_flags', []))}; memory read {_f(host.get('read_gbs_per_core'), 1)} GB/s "
               "on one core), "
               f"torch {doc.get('software', {}).get('torch')}, {doc.get('created_utc')}. "
               "All figures come from one run; ratios compare quantities measured side by side.")
    st = doc.get("settings", {})
    if st.get("dtype_asked") and st.get("dtype") != st["dtype_asked"]:
        out.append(f"The pipeline, load-step and preprocessing parts ran in {st['dtype']}, not --dtype "
                   f"{st['dtype_asked']}: {st.get('dtype_reason')}.")
    noise = doc.get("noise", {})
    if noise:
        out.append("Other load on the machine while each part ran (share of all CPUs used by other processes): "
                   + ", ".join(f"{k} {v['foreign_cpu_share']:.0%}" for k, v in noise.items()) + ".")
    h = doc.get("handoff")
    if h:
        out += _handoff_markdown(h)
    p = doc.get("pipeline")
    if p:
        out += _pipeline_markdown(p)
    ls = doc.get("loadstep")
    for e in (ls or {}).get("presets", []):
        out.append(f"\n**Load step** ({e['preset']}, K = {e['split_layer']} from the profile; {e['before']} frames, "
                   f"then a co-tenant (one busy process per core) for {e['during']}, then {e['after']} more): e2e p50 "
                   "ms by phase, the overhead (e2e - stage sum) during the step against 5 % + 2 ms, frames until the "
                   "latency settles, the K used and the moves made.")
        rows = []
        for name, r in e["runs"].items():
            ph = r["phases"]
            d = ph["during"]
            rows.append([name.replace("_", ", "), _f(ph["before"]["e2e_p50_ms"], 0), _f(d["e2e_p50_ms"], 0),
                         _f(ph["after"]["e2e_p50_ms"], 0),
                         f"{_f(d['overhead_p50_ms'], 1)} (<= {_f(d['allowed_ms'], 1)})", str(d["settle_frames"]),
                         ",".join(str(k) for k in d["k"]), str(len(r["moves"]))])
        out.append(_table(["co-tenant, K", "before", "during", "after", "overhead during", "settle frames",
                           "K during", "moves"], rows))
    f = doc.get("suffix_flops")
    if f:
        out += _flops_markdown(f)
    q = doc.get("preprocess")
    if q:
        out += _preprocess_markdown(q)
    if doc.get("decode"):
        from .decode import markdown as decode_markdown

        out.append(decode_markdown(doc["decode"]))
    if doc.get("families"):
        from .families import markdown as families_markdown

        out.append(families_markdown(doc["families"]))
    if doc.get("moe"):
        from .moe import markdown as moe_markdown

        out.append(moe_markdown(doc["moe"]))
    goals = doc.get("goals") or []
    if goals:
        out.append("\n**Goals**")
        out.append(_table(["goal", "value", "target", "met"],
                          [[g["what"], _f(g["value"], 3), g["target"],
                            "yes" if g["met"] else ("no" if g["met"] is False else "-")] for g in goals]))
    if doc.get("errors"):
        out.append("\n**Errors**: " + "; ".join(f"{k}: {v.splitlines()[0]}" for k, v in doc["errors"].items()))
    return "\n".join(out) + "\n"


def _handoff_markdown(h: dict) -> list[str]:
    """The hand-off table (ring, memcpy, rclpy per size) and the zero-copy one."""
    out = []
    out.append(f"\n**Hand-off** of bf16 hidden states between two processes (producer cores "
               f"{h['producer_cores']}, consumer cores {h['consumer_cores']}); p50 / p90 ms, CPU ms per message "
               f"(producer + consumer); ring/memcpy {h['count']} messages, rclpy {h['rclpy_count']} per size.")
    variants = list(h["variants"])
    header = ["size", "memcpy (floor)", "ring", "ring copy / wake p50", "ring CPU"]
    for v in variants:
        header += [f"rclpy {v}", f"{v} CPU"]
    header += ["best rclpy / ring", "ring / memcpy"]
    rows = []
    for r in h["sizes"]:
        ring = r["ring"]
        row = [f"{r['size_mib']:g} MiB", _pp(r["memcpy"]["latency_ms"]), f"**{_pp(ring['latency_ms'])}**",
               f"{_f(ring['copy_ms']['p50'], 3)} / {_f(ring['publish_to_view_ms']['p50'], 3)}",
               _f(ring["cpu_ms_per_msg"]["total"], 3)]
        for v in variants:
            x = r["rclpy"][v]
            row += [_pp(x["latency_ms"], 2) + (f" ({x['lost']} lost)" if x.get("lost") else ""),
                    _f(x["cpu_ms_per_msg"]["total"], 2)]
        row += [f"{_f(r['ratio_best_rclpy_over_ring_p50'], 1)}x" if r["ratio_best_rclpy_over_ring_p50"] else "-",
                f"{_f(r['ratio_ring_over_memcpy_p50'], 2)}x"
                + (f" ({_f(r['ratio_ring_over_memcpy_after_wait_p50'], 2)}x after the wait)"
                   if r.get("memcpy_after_wait") else "")]
        rows.append(row)
    out.append(_table(header, rows))
    if "gaps_ms" in h:
        out.append(_zero_copy_markdown(h))
    return out


def _pipeline_markdown(p: dict) -> list[str]:
    """The pipeline table per preset, its notes, and the suffix-bound run."""
    out = []
    out.append(f"\n**Pipeline** on the embedded bag ({p['frames']}; {p['warmup_frames']} warm-up frames); prefix "
               "and suffix in two processes pinned to one core each, one torch thread each. Ideal fps = 1 / "
               "max(mean(preprocess + prefix), mean(hand-off + suffix)) from the same run's per-frame stage times "
               "(those two columns are means); e2e, stage sum (preprocess + prefix + suffix) and overhead "
               "(e2e - stage sum, per frame) are p50, ms.")
    header = ["preset (K / L, dtype)", "preprocess + prefix", "hand-off + suffix", "fps / ideal", "efficiency",
              "e2e", "stage sum", "overhead"]
    modes = p.get("sequential_modes", [])
    header += [f"sequential {m}: fps / e2e" for m in modes]
    rows = []
    for e in p["presets"]:
        pl = e["pipeline"]
        lat = pl["latency"]
        row = [f"{e['preset']} ({e['split_layer']} / {e['num_layers']}, {e['dtype']}"
               + (f", {e['image_size']} px" if e.get("image_size_overridden") else "") + ")",
               _f(pl["prefix_side_ms"]["mean"], 1), _f(pl["handoff_suffix_side_ms"]["mean"], 1),
               f"{_f(pl['fps'], 2)} / {_f(pl['ideal_fps'], 2)}", f"**{_f(pl['efficiency'], 3)}**",
               _f(lat["e2e_p50_ms"], 1), _f(lat["stage_sum_p50_ms"], 1), f"{_f(lat['overhead_p50_ms'], 2)}"]
        for m in modes:
            s = e["sequential"].get(m)
            row.append(f"{_f(s['fps'], 2)} / {_f(s['stages_ms']['e2e_ms']['p50'], 1)}" if s else "-")
        rows.append(row)
    out.append(_table(header, rows))
    notes = [f"{e['preset']}: K = {e['split_layer']}: {e['split_reason']}" for e in p["presets"]]
    notes += [f"{e['preset']}: {e['note']}" for e in p["presets"] if e.get("note")]
    for e in p["presets"]:
        pl, c = e["pipeline"], e.get("contention")
        st = pl["stages_ms"]
        extra = [f"bottleneck {pl['bottleneck']}", f"frames dropped {pl['frames_dropped']}",
                 f"prefix process cycle (incl. copy, publish, freeing) {_f(pl['prefix_cycle_ms']['p50'], 1)} ms",
                 f"hand-off {_f(st['handoff_net_ms']['p50'], 3)} ms (copy {_f(st['copy_ms']['p50'], 3)}, "
                 f"wake {_f(st['wake_ms']['p50'], 3)}, queue wait {_f(st['queue_wait_ms']['p50'], 3)})"]
        if c:
            extra.append(f"stage time in the pipeline / alone on one core: prefix {_f(c['prefix'], 2)}x, "
                         f"suffix {_f(c['suffix'], 2)}x")
        notes.append(f"{e['preset']}: " + "; ".join(extra))
    out.append("\n".join(f"- {n}" for n in notes))
    sb = p.get("suffix_bound")
    if sb:
        out.append(f"\n**Suffix-bound pipeline**: {sb['preset']} at K={sb['split_layer']}, its suffix made "
                   f"{sb['suffix_extra_ms']:g} ms slower (busy wait); {sb.get('warmup_frames', '?')} warm-up "
                   "frames; p50 ms." + (f" **Error**: {sb['error']}." if sb.get("error") else ""))
        rows = []
        for name, v in sb["variants"].items():
            lat, st = v["latency"], v["stages_ms"]
            rows.append([name, _f(v["prefix_side_ms"]["p50"], 1), _f(st["suffix_ms"]["p50"], 1),
                         _f(st["queue_wait_ms"]["p50"], 1), _f(lat["e2e_p50_ms"], 1),
                         _f(lat["stage_sum_p50_ms"], 1),
                         f"**{_f(lat['overhead_p50_ms'], 1)}** (<= {_f(lat['allowed_ms'], 1)})", _f(v["fps"], 2),
                         str(ConsumerStats.from_dict(v["ring_stats"]["consumer"]).superseded)])
        out.append(_table(["variant", "preprocess + prefix", "suffix", "queue wait", "e2e", "stage sum",
                           "overhead (allowed)", "fps", "superseded"], rows))
    return out


def _flops_markdown(f: dict) -> list[str]:
    """The CPU suffix FLOP/s table, the compiled backends' and the llama.cpp peer."""
    out = []
    out.append(f"\n**CPU suffix FLOP/s** (cores {f['cores']}, {f['threads']} thread(s), {f.get('clock', 'wall')} "
               "clock): the last blocks of the "
               "LLM + norm + heads at the preset's token count against the best torch GEMM on the same cores and "
               "dtype. FLOPs: 2 x MACs of every Linear + causal attention counted as half; a compiled row "
               "counts what its graph computes (its last block's MLP on the read-out rows only).")
    header = ["preset", "dtype", "backend (computes in)", "blocks x T (passes)", "GFLOP", "ms", "GFLOP/s",
              "GEMM peak", "ratio", "vs best peak", "vs block-shape GEMM", "x eager",
              "time in GEMM / attention / other (/ outside the graph; GEMMs' own rate / peak)"]
    rows = []
    for r in f["results"]:
        ops = r.get("ops") or {}
        backend = r.get("backend", "eager") + (f" ({r['precision']})" if r.get("precision") else "")
        rows.append([r["preset"], r["dtype"], backend, f"{r['blocks']} x {r['tokens']} ({r['passes']})",
                     _f(r["gflop"], 3), _f(r["time_ms"], 2), _f(r["achieved_gflops"], 1), _f(r["peak_gflops"], 1),
                     f"**{_f(r['ratio'], 2)}**", _f(r.get("ratio_vs_best_peak"), 2),
                     _f(r.get("ratio_vs_block_peak"), 2),
                     _f(r.get("speedup_vs_eager"), 2),
                     _time_shares(ops, r["peak_gflops"])])
    out.append(_table(header, rows))
    compiled = [r for r in f["results"] if r.get("backend", "eager") != "eager"]
    if compiled:
        out.append("\nCompiled backends: cold build (convert + save + compile into an empty cache), restart in a "
                   "fresh process from the cached artifact (s beyond the eager path: import, weights digest, "
                   "read, compile and the first compiled frame, less the first eager frame), and drift from "
                   "eager (relative L2 of the last token's hidden state; waypoints in m; bf16 also against fp32 "
                   "weights of the same values).")
        header = ["preset", "dtype", "backend", "cold build s", "restart + s (cache hit)", "artifact MiB",
                  "rel L2 vs eager", "waypoints vs eager m", "rel L2 vs fp32 (eager's)"]
        rows = []
        for r in compiled:
            x, a = r.get("restart") or {}, r.get("accuracy") or {}
            vs32 = (f"{_f(a['rel_l2_last_hidden_vs_fp32'], 4)} ({_f(a['eager_rel_l2_last_hidden_vs_fp32'], 4)})"
                    if "rel_l2_last_hidden_vs_fp32" in a else "-")
            rows.append([r["preset"], r["dtype"], r["backend"], _f(r.get("build_cold_s"), 1),
                         f"{_f(x.get('backend_extra_s'), 2)} ({x.get('cache_hit')})" if x else "-",
                         _f(r.get("artifact_bytes", 0) / 2**20, 1),
                         f"{a.get('rel_l2_last_hidden_vs_eager', float('nan')):.2e}",
                         f"{a.get('waypoints_max_abs_vs_eager_m', float('nan')):.1e}", vs32])
        out.append(_table(header, rows))
    for sk in f.get("skipped") or []:
        out.append(f"- {sk['backend']} skipped for {sk['preset']} {sk['dtype']}: {sk['reason']}")
    peer = f.get("peer")
    if peer:
        line = (f"\n**llama.cpp peer**: prefill of SmolLM2-135M, T = {peer['tokens']}, {peer['threads']} "
                "thread(s), same cores; ours = all 30 `smol` blocks + norm + heads. ")
        line += "Ours: " + ", ".join(f"{r['backend']} {r['dtype']} {_f(r['time_ms'], 1)} ms"
                                     for r in peer["ours"] if "time_ms" in r) + ". "
        if peer.get("llama_cpp"):
            line += "llama.cpp: " + ", ".join(f"{k} {_f(v['median_ms'], 1)} ms"
                                              for k, v in peer["llama_cpp"].items()) + ". "
            line += "Ratios (llama.cpp ms / ours ms, > 1: ours faster): " + ", ".join(
                f"{k} {_f(v, 2)}" for k, v in peer["ratios"].items()) + "."
        else:
            line += f"llama.cpp skipped: {peer.get('skipped_reason')}"
        build = peer.get("llama_cpp_build")
        if build and "error" in build:
            line += f" Building llama-cpp-python failed: {build['error'].splitlines()[0]}"
        elif build:
            line += (f" llama-cpp-python built from source in {build['seconds']:.0f} s ({build['path']})."
                     if build["built"] else f" llama-cpp-python: the build in {build['path']}.")
        out.append(line)
    return out


def _preprocess_markdown(q: dict) -> list[str]:
    """The camera preprocessing table."""
    out = []
    out.append(f"\n**Camera preprocessing**, 6 cameras of 1600x900 per frame ({q['source']}), prefix cores "
               f"{q['cores']}: decode + convert + resize + normalise (PrefixResult.preprocess_ms) against the "
               "prefix model time; share = preprocess / (preprocess + prefix); one-pass limit: one copy of the "
               "six cameras' rgb8 pixels (26 MB) into buffers allocated beforehand; ms are p50.")
    header = ["preset (input px, K)", "input", "JPEG decoder", "resize", "decode / convert", "resize + normalise",
              "preprocess", "one-pass limit", "preprocess / limit", "prefix", "share"]
    rows = [[f"{r['preset']} ({r['image_size']}, {r['split_layer']})", r["input"], r.get("decoder") or "-",
             r.get("resize", "area"), _f(r["decode_ms"], 1), _f(r["resize_normalize_ms"], 1),
             _f(r["preprocess_ms"]["p50"], 1), _f(r.get("limit_ms"), 1), _f(r.get("ratio_to_limit"), 2),
             _f(r["prefix_ms"]["p50"], 1), f"**{_f(r['share'], 2)}**"] for r in q["results"]]
    out.append(_table(header, rows))
    return out

def _zero_copy_markdown(h: dict) -> str:
    """The zero-copy table: p50 / p99 ms per size and gap for the ring (spin then block), ring block only and
    iceoryx2, and the ring's spin CPU per message."""
    keys = h["gap_keys"]
    iox = h.get("iceoryx2", {})
    head = (f"\n**Zero-copy hand-off** ({h['zero_copy_definition']}); p50 / p99 ms; ring spin "
            f"{h['spin']['lead_ms']} ms lead, <= {h['spin']['max_ms']} ms; iceoryx2 "
            + (iox.get("version", "") if iox.get("available") else f"skipped: {iox.get('skipped')}")
            + (f"; both ends SCHED_FIFO {h['rt_priority']}" if h.get("rt_priority") else "") + ".")
    header = ["size"]
    for k in keys:
        header += [f"ring {k}", f"iceoryx2 {k}", f"spin ms/msg {k}"]
    header += [f"ring block only {k}" for k in (f"gap_{g:g}ms" for g in h.get("block_gaps_ms", []))]
    rows = []
    for r in h["sizes"]:
        row = [f"{r['size_mib']:g} MiB"]
        for k in keys:
            z, i = r["zero_copy"].get(k), r.get("iceoryx2", {}).get(k)
            row += [f"**{_f(z['handoff_ms']['p50'], 3)} / {_f(z['handoff_ms']['p99'], 3)}**" if z else "-",
                    f"{_f(i['handoff_ms']['p50'], 3)} / {_f(i['handoff_ms']['p99'], 3)}" if i else "-",
                    _f(z["spin_ms_per_msg"], 2) if z else "-"]
        for g in h.get("block_gaps_ms", []):
            b = r["zero_copy_block"].get(f"gap_{g:g}ms")
            row.append(f"{_f(b['handoff_ms']['p50'], 3)} / {_f(b['handoff_ms']['p99'], 3)}" if b else "-")
        rows.append(row)
    causes = [f"{m}: {_outlier_text([c for r in h['sizes'] for c in r.get(m, {}).values() if isinstance(c, dict)])}"
              for m in ("zero_copy", "zero_copy_block", "iceoryx2")]
    return (head + "\n" + _table(header, rows) + "\nWhere the slow hand-offs came from (the first cause that held: "
            "page faults, preemption, a missed spin window, a wake-up from the socket; tools/bench/zero_copy.py): "
            + "; ".join(causes) + ".")


# ------------------------------------------------------------------------------------------ plots

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_handoff(h: dict, path: Path) -> Path:
    """Hand-off PNG at ``path``: latency p50 (bar to p90, ms) and CPU ms per message against payload MiB, log-log,
    one colour per method (memcpy, ring, each rclpy variant). ``h``: the document's ``handoff`` part."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = [r["size_mib"] for r in h["sizes"]]
    series = [("memcpy (floor)", lambda r: r["memcpy"]["latency_ms"], None),
              ("ring", lambda r: r["ring"]["latency_ms"], lambda r: r["ring"]["cpu_ms_per_msg"]["total"])]
    for v in h["variants"]:
        series.append((f"rclpy {v}", lambda r, v=v: r["rclpy"][v]["latency_ms"],
                       lambda r, v=v: r["rclpy"][v]["cpu_ms_per_msg"]["total"]))
    for i, (label, lat, cpu) in enumerate(series):
        color = f"C{i}"  # one colour per method in both panels
        p50 = [lat(r)["p50"] for r in h["sizes"]]
        p90 = [lat(r)["p90"] for r in h["sizes"]]
        ax1.errorbar(sizes, p50, yerr=[[0] * len(p50), [max(0.0, b - a) for a, b in zip(p50, p90)]], marker="o",
                     capsize=3, label=label, color=color)
        if cpu is not None:
            ax2.plot(sizes, [cpu(r) for r in h["sizes"]], marker="o", label=label, color=color)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("payload (MiB)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel("latency p50, bar to p90 (ms)")
    ax1.set_title("write start -> consumer view ready")
    ax2.set_ylabel("CPU ms per message (producer + consumer)")
    ax2.set_title("CPU time per message")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_LAT_PARTS = (("preprocess_ms", "preprocess"), ("prefix_ms", "prefix"), ("gap_ms", "check + acquire"),
              ("copy_ms", "copy into slot"), ("wake_ms", "notify + wake"), ("queue_wait_ms", "queue wait"),
              ("suffix_ms", "suffix"))


def plot_pipeline(p: dict, path: Path) -> Path:
    """Pipeline PNG at ``path``, per preset: frames/s of the pipeline, its ideal and the sequential baselines, and
    end-to-end ms against the stage times.
    ``p``: the document's ``pipeline`` part."""
    plt = _plt()
    presets = p["presets"]
    fig, axes = plt.subplots(len(presets), 2, figsize=(12, 3.2 * len(presets)), squeeze=False)
    for (ax1, ax2), e in zip(axes, presets):
        pl = e["pipeline"]
        names = ["pipeline", "ideal"] + [f"seq {m}" for m in e["sequential"]]
        vals = [pl["fps"], pl["ideal_fps"]] + [s["fps"] for s in e["sequential"].values()]
        bars = ax1.bar(names, vals, color=["C0", "C7"] + ["C1"] * len(e["sequential"]))
        ax1.bar_label(bars, fmt="%.2f", fontsize=8)
        ax1.set_ylabel("frames / s")
        ax1.set_title(f"{e['preset']} K={e['split_layer']}/{e['num_layers']}: efficiency {pl['efficiency']:.3f}")
        st = pl["stages_ms"]
        left = 0.0
        for key, label in _LAT_PARTS:
            w = max(0.0, st[key]["p50"] or 0.0)
            ax2.barh(["pipeline"], [w], left=left, label=label)
            left += w
        ax2.barh(["pipeline e2e"], [pl["latency"]["e2e_p50_ms"]], color="k", alpha=0.4)
        for m, s in e["sequential"].items():
            ax2.barh([f"seq {m} e2e"], [s["stages_ms"]["e2e_ms"]["p50"]], color="C1", alpha=0.6)
        ax2.set_xlabel("ms (p50 of each part)")
        ax2.set_title("latency: stages vs end to end")
    handles, labels = axes[0][1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.tight_layout(rect=(0, 0.6 / (3.2 * len(presets)), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(p: dict, path: Path, max_frames: int = 8) -> Path:
    """Gantt chart of the first measured frames of each preset: prefix, hand-off and suffix spans."""
    plt = _plt()
    presets = p["presets"]
    fig, axes = plt.subplots(len(presets), 1, figsize=(12, 2.2 * len(presets)), squeeze=False)
    for ax, e in zip(axes[:, 0], presets):
        tl = e["pipeline"]["timeline"][:max_frames]
        if not tl:
            continue
        t0 = tl[0]["t_prefix_start_ns"]
        for i, f in enumerate(tl):
            c = f"C{i % 10}"
            ms = lambda t: (t - t0) / 1e6  # noqa: E731
            ax.barh(2, ms(f["t_write_start_ns"]) - ms(f["t_prefix_start_ns"]), left=ms(f["t_prefix_start_ns"]),
                    color=c, alpha=0.8)
            ax.barh(1, ms(f["t_ready_ns"]) - ms(f["t_write_start_ns"]), left=ms(f["t_write_start_ns"]), color=c)
            ax.barh(0, ms(f["t_suffix_end_ns"]) - ms(f["t_ready_ns"]), left=ms(f["t_ready_ns"]), color=c, alpha=0.8)
        ax.set_yticks([0, 1, 2], ["suffix", "hand-off", "prefix"])
        ax.set_xlabel("ms since the first measured frame started")
        ax.set_title(f"{e['preset']}: one colour per frame")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_flops(f: dict, path: Path) -> Path:
    """FLOP/s PNG at ``path``: achieved suffix GFLOP/s per preset, dtype and backend against the best GEMM peak
    (the faster of the dtype's and fp32's, what the issue-16 goals compare with), each bar labelled with that
    ratio. ``f``: the document's ``suffix_flops`` part."""
    plt = _plt()
    res = f["results"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(res)), 4.5))
    labels = [f"{r['preset']}\n{r['dtype']} {r.get('backend', 'eager')}" for r in res]
    x = range(len(res))
    peaks = [r.get("best_peak_gflops", r["peak_gflops"]) for r in res]
    ax.bar([i - 0.2 for i in x], [r["achieved_gflops"] for r in res], width=0.4, label="suffix achieved")
    ax.bar([i + 0.2 for i in x], peaks, width=0.4, color="C7",
           label="best GEMM peak (same cores; the dtype's or fp32, the faster)")
    for i, r, peak in zip(x, res, peaks):
        ax.text(i, max(peak, r["achieved_gflops"]), f"{r.get('ratio_vs_best_peak', r['ratio']):.2f}", ha="center",
                va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GFLOP/s")
    goals = ", ".join(f"{k} >= {v}" for k, v in (f.get("goal_ratio_best") or {}).items())
    ax.set_title(f"CPU suffix: achieved / best GEMM peak (goals of the best backend: {goals or '-'})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_preprocess(q: dict, path: Path) -> Path:
    """Preprocessing PNG at ``path``: decode, resize + normalise and prefix model ms per preset and input kind.
    ``q``: the document's ``preprocess`` part."""
    plt = _plt()
    res = q["results"]
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(res) + 1.5))
    labels = [f"{r['preset']} {r['input']} {r.get('decoder') or r.get('resize', '')}" for r in res]
    dec = [r["decode_ms"] for r in res]
    rsz = [max(0.0, r["resize_normalize_ms"]) for r in res]
    pfx = [r["prefix_ms"]["p50"] for r in res]
    ax.barh(labels, dec, label="decode / convert")
    ax.barh(labels, rsz, left=dec, label="resize + normalise")
    ax.barh(labels, pfx, left=[a + b for a, b in zip(dec, rsz)], label="prefix model", color="C7")
    for i, r in enumerate(res):
        ax.text(dec[i] + rsz[i] + pfx[i], i, f" share {r['share']:.2f}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("ms per frame (6 cameras of 1600x900), log scale")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_load_step(ls: dict, path: Path) -> Path:
    """``loadstep.png``: per preset and co-tenant place, each frame's e2e (ms) with K fixed and with live
    rebalancing, the step shaded, and K over the frames on a second axis."""
    plt = _plt()
    entries = ls["presets"]
    fig, axes = plt.subplots(len(entries), 2, figsize=(12, 3.6 * len(entries)), squeeze=False)
    for row, e in zip(axes, entries):
        start = e["warmup"] + e["before"]
        stop = start + e["during"]
        for ax, where in zip(row, ("suffix", "prefix")):
            twin = ax.twinx()
            for mode, color in (("fixed", "tab:gray"), ("rebalance", "tab:blue")):
                r = e["runs"].get(f"{where}_{mode}")
                if not r:
                    continue
                fr = r["frames"]
                ax.plot([x["frame"] for x in fr], [x["e2e_ms"] for x in fr], "o-", ms=3, color=color,
                        label=f"e2e, K {mode}")
                twin.step([x["frame"] for x in fr], [x["k"] for x in fr], where="post", color=color, alpha=0.4,
                          ls="--", label=f"K {mode}")
            ax.axvspan(start - 0.5, stop - 0.5, color="tab:red", alpha=0.08, label="co-tenant")
            ax.set_title(f"{e['preset']}: co-tenant on the {where}'s cores")
            ax.set_xlabel("frame")
            ax.set_ylabel("end to end, ms")
            twin.set_ylabel("split layer K")
            ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(doc: dict, folder: str | Path) -> list[Path]:
    """One PNG per part that ran (and a pipeline timeline); returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    if doc.get("handoff"):
        out.append(plot_handoff(doc["handoff"], folder / "handoff.png"))
    if doc.get("pipeline"):
        out.append(plot_pipeline(doc["pipeline"], folder / "pipeline.png"))
        out.append(plot_timeline(doc["pipeline"], folder / "pipeline_timeline.png"))
    if doc.get("loadstep"):
        out.append(plot_load_step(doc["loadstep"], folder / "loadstep.png"))
    if doc.get("suffix_flops"):
        out.append(plot_flops(doc["suffix_flops"], folder / "suffix_flops.png"))
    if doc.get("preprocess"):
        out.append(plot_preprocess(doc["preprocess"], folder / "preprocess.png"))
    return out
