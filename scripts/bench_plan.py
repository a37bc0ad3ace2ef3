#!/usr/bin/env python3
"""Predicted vs measured latency per split layer K, and how good the planner's automatic choice is.

For each model (default: ``smol`` and ``minddrive-0.5b``):

1. profile it with :func:`hybrid_vla_ros.split.profiler.profile_model` on CPU core 0 with one torch
   thread (``smol``: its real checkpoint written by ``init_model("smol", dir)``, SmolLM2-135M LLM from
   the GGUF file; ``minddrive-0.5b``: random weights, one representative vision block);
2. predict prefix / hand-off / suffix / end-to-end ms for every K with the planner;
3. measure the real thing for a set of K on this machine: both stages on the CPU, the prefix pinned to
   core 0 and the suffix to core 1 (one torch thread each), running the same functions as
   PrefixStage.forward / SuffixStage.plan_all (``embed``, ``run_blocks``, ``plan``) on one model in
   memory. The vision encoder + projector + embeddings do not depend on K; they are measured once
   and their output is reused for every K (for minddrive-0.5b its 640x640 EVA-02-L-sized ViT over 6
   cameras takes about a minute a frame on one core). Hand-off = the ring's acquire -> copy -> publish
   -> consumer view, measured once (producer and consumer in this process);
4. print predicted vs measured per K with their ratio, and compare the planner's choice under a GPU
   budget (chosen among the measured K) with the measured best K.

This is a benchmark that prints figures, not a test. Usage:
    PYTHONPATH=. .venv/bin/python scripts/bench_plan.py [--models smol minddrive-0.5b] [--repeats 2]
        [--budget-fraction 0.4] [--json OUT]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybrid_vla_ros.model.checkpoint import load_stage
from hybrid_vla_ros.model.config import VLAConfig
from hybrid_vla_ros.tools.harness import ensure_checkpoint, write_report
from hybrid_vla_ros.model.config import preset
from hybrid_vla_ros.model.modeling import VLAModel, embed, plan, run_blocks
from hybrid_vla_ros.split.planner import GB, choose_split_layer, plan_split
from hybrid_vla_ros.model.timing_parts import random_init_
from hybrid_vla_ros.split.profiler import measure_handoff, profile_model

PREFIX_CORE, SUFFIX_CORE = 0, 1


def _pin(core: int) -> None:
    """Pin the calling thread (the one doing the work with a single torch thread) to one core."""
    os.sched_setaffinity(0, {core})
    if os.sched_getaffinity(0) != {core}:
        raise RuntimeError(f"could not pin to core {core}")


def _median_ms(fn, repeats: int):
    """(median ms over ``repeats`` calls of fn, the last call's result)."""
    samples, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        out = fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(samples), out


def _ks(num_layers: int, n: int) -> list[int]:
    return sorted({round(i * num_layers / (n - 1)) for i in range(n)})


def bench_model(name: str, workdir: Path, repeats: int, n_ks: int, budget_fraction: float) -> dict:
    t_model = time.monotonic()
    cfg = preset(name)
    vision_blocks = "1" if cfg.image_size >= 640 else "all"
    if name == "smol":
        path = ensure_checkpoint(workdir, name, dtype="fp32")
        cfg = VLAConfig.load(path)
        print(f"[{name}] the smol checkpoint (SmolLM2-135M LLM from GGUF) in {time.monotonic() - t_model:.1f} s")
        prof = profile_model(model_path=path, dtype="fp32", cores=[PREFIX_CORE], threads=1, device="cpu",
                             repeats=repeats + 1, warmup=1, vision_blocks=vision_blocks)
        model = load_stage(path, "full")
    else:
        prof = profile_model(preset_name=name, dtype="fp32", cores=[PREFIX_CORE], threads=1, device="cpu",
                             repeats=repeats + 1, warmup=1, vision_blocks=vision_blocks)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = VLAModel(cfg)
        random_init_(model, "cpu", torch.float32)
    t_prof = time.monotonic() - t_model
    print(f"[{name}] profiled (vision blocks: {vision_blocks}) in {t_prof:.1f} s")

    # Budget: a fraction of the way from the smallest to the largest fp32 GPU need, so it excludes some K.
    # The measured side below runs the stages on ready pixel tensors (no camera decoding), so the
    # prediction leaves camera preprocessing out too: model compute against model compute.
    free_plan = plan_split(cfg, "fp32", profile=prof, preprocess_ms=0.0)
    lo, hi = free_plan.rows[0].gpu_total_bytes, free_plan.rows[-1].gpu_total_bytes
    budget = int(lo + budget_fraction * (hi - lo))
    predicted = plan_split(cfg, "fp32", profile=prof, gpu_budget_bytes=budget, preprocess_ms=0.0)

    # ---- measure
    pixels = torch.rand(cfg.n_cameras, 3, cfg.image_size, cfg.image_size)
    ego = torch.tensor([5.0, 0.0, 0.0]) if cfg.ego_state_input else None
    _pin(PREFIX_CORE)
    with torch.inference_mode():
        t0 = time.perf_counter_ns()
        h0 = embed(model, pixels, ego)
        embed_ms = (time.perf_counter_ns() - t0) / 1e6
        if embed_ms < 2000:  # cheap enough to take a median
            embed_ms = statistics.median([embed_ms, *(_median_ms(lambda: embed(model, pixels, ego), 1)[0]
                                                      for _ in range(repeats))])
    print(f"[{name}] vision + projector + embeddings measured once: {embed_ms:.1f} ms (reused for every K)")
    handoff = measure_handoff(tuple(cfg.prefix_state_shape), torch.float32, torch.device("cpu"), 2, 20, scales=(1.0,))
    handoff_ms = handoff["ring"][0]["ms"]
    L = cfg.num_layers
    ks = _ks(L, n_ks)
    layers = model.layers
    measured = {}
    with torch.inference_mode():
        _pin(PREFIX_CORE)
        run_blocks(model, layers[:1], h0)  # warm-up
        for k in ks:
            _pin(PREFIX_CORE)
            pre_ms, hk = _median_ms(lambda: run_blocks(model, layers[:k], h0), repeats)
            _pin(SUFFIX_CORE)
            suf_ms, _ = _median_ms(lambda: plan(model, run_blocks(model, layers[k:], hk)), repeats)
            measured[k] = {"prefix_ms": embed_ms + pre_ms, "handoff_ms": handoff_ms, "suffix_ms": suf_ms}
            m = measured[k]
            m["e2e_ms"] = m["prefix_ms"] + handoff_ms + suf_ms
            m["throughput_fps"] = 1000.0 / max(m["prefix_ms"], handoff_ms + suf_ms)
    os.sched_setaffinity(0, set(range(os.cpu_count())))

    # ---- report
    print(f"\n[{name}] {L} decoder blocks, hidden states {cfg.prefix_state_shape} fp32; prefix on core {PREFIX_CORE}, "
          f"suffix on core {SUFFIX_CORE}, 1 torch thread each; {repeats} repeats, medians")
    hdr = (f"{'K':>3} | {'pred pre':>9} {'meas pre':>9} | {'pred h/o':>8} {'meas h/o':>8} | {'pred suf':>9} "
           f"{'meas suf':>9} | {'pred e2e':>9} {'meas e2e':>9} {'ratio':>6} | {'pred fps':>8} {'meas fps':>8}")
    print(hdr)
    print("-" * len(hdr))
    for k in ks:
        r, m = predicted.row(k), measured[k]
        print(f"{k:>3} | {r.prefix_ms:9.1f} {m['prefix_ms']:9.1f} | {r.handoff_ms:8.3f} {m['handoff_ms']:8.3f} | "
              f"{r.suffix_ms:9.1f} {m['suffix_ms']:9.1f} | {r.e2e_ms:9.1f} {m['e2e_ms']:9.1f} "
              f"{r.e2e_ms / m['e2e_ms']:6.3f} | {r.throughput_fps:8.3f} {m['throughput_fps']:8.3f}")
    ratios = [predicted.row(k).e2e_ms / measured[k]["e2e_ms"] for k in ks]
    pre_ratios = [predicted.row(k).prefix_ms / measured[k]["prefix_ms"] for k in ks]
    suf_ratios = [predicted.row(k).suffix_ms / measured[k]["suffix_ms"] for k in ks]
    print(f"predicted / measured: e2e {min(ratios):.3f}..{max(ratios):.3f}, prefix {min(pre_ratios):.3f}.."
          f"{max(pre_ratios):.3f}, suffix {min(suf_ratios):.3f}..{max(suf_ratios):.3f}")

    # Auto choice among the measured K (same candidates on both sides), with and without the budget.
    rows = [predicted.row(k) for k in ks]
    summary = {}
    for label, b in (("no budget", None), (f"budget {budget / GB:.3f} GB", budget)):
        k_auto, reason = choose_split_layer(rows, b)
        fit = [k for k in ks if b is None or predicted.row(k).gpu_total_bytes <= b]
        k_best = min(fit, key=lambda k: measured[k]["e2e_ms"])
        k_best_fps = max(fit, key=lambda k: measured[k]["throughput_fps"])
        gap = measured[k_auto]["e2e_ms"] - measured[k_best]["e2e_ms"]
        fps_gap = measured[k_best_fps]["throughput_fps"] - measured[k_auto]["throughput_fps"]
        print(f"{label}: auto K={k_auto} (measured e2e {measured[k_auto]['e2e_ms']:.1f} ms, "
              f"{measured[k_auto]['throughput_fps']:.3f} fps); measured best e2e K={k_best} "
              f"({measured[k_best]['e2e_ms']:.1f} ms): auto is {gap:+.1f} ms "
              f"({100 * gap / measured[k_best]['e2e_ms']:+.2f}%) off; measured best throughput K={k_best_fps} "
              f"({measured[k_best_fps]['throughput_fps']:.3f} fps, auto {fps_gap:+.3f} fps below)")
        print(f"  reason: {reason}")
        summary[label] = {"auto_k": k_auto, "best_e2e_k": k_best, "best_fps_k": k_best_fps, "e2e_gap_ms": gap,
                          "fps_gap": fps_gap}
    t_total = time.monotonic() - t_model
    print(f"[{name}] done in {t_total:.1f} s")
    return {"model": name, "ks": ks, "embed_ms": embed_ms, "budget_bytes": budget,
            "predicted": {k: {"prefix_ms": predicted.row(k).prefix_ms, "handoff_ms": predicted.row(k).handoff_ms,
                              "suffix_ms": predicted.row(k).suffix_ms, "e2e_ms": predicted.row(k).e2e_ms,
                              "throughput_fps": predicted.row(k).throughput_fps} for k in ks},
            "measured": measured, "choice": summary, "seconds": t_total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smol", "minddrive-0.5b"])
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per measurement (median); the profile uses one more")
    ap.add_argument("--ks", type=int, default=7, help="how many split layers to measure, evenly spread over [0, L]")
    ap.add_argument("--budget-fraction", type=float, default=0.4,
                    help="GPU budget = smallest + this fraction of (largest - smallest) fp32 GPU need")
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        print("needs 2 CPU cores (prefix on 0, suffix on 1)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    t0 = time.monotonic()
    print(f"bench_plan: torch {torch.__version__}, {os.cpu_count()} CPUs, 1 torch thread")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            results.append(bench_model(name, Path(tmp), args.repeats, args.ks, args.budget_fraction))
    print(f"\ntotal runtime {time.monotonic() - t0:.1f} s")
    if args.json:
        write_report(results, args.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
