"""A load step under the two-process pipeline: fixed K against live rebalancing, side by side in one run.

On a vehicle the CPU load beside the suffix changes (Autoware's planning and perception come and go), and so does
the K with the lowest camera-to-trajectory latency. Per preset (its profile gives the per-K times) this part runs the
pipeline of :mod:`.pipeline` four times on the embedded bag: a co-tenant (:class:`~.cotenant.CoTenant`: one busy
process per core) starts on the suffix's cores after ``before`` measured frames and stops ``during`` frames later, then
``after`` frames follow; once with K fixed at the profile's choice and once with the prefix rebalancing live
(:class:`~hybrid_vla_ros.split.rebalance.LatencyBalancer` after every frame, as the prefix node's ``split_layer:
auto`` does); then the same with the co-tenant on the prefix's cores.

Figures per run (:func:`summarize_load_step`), over the frames the suffix computed, by phase (before / during /
after the co-tenant): end-to-end p50 (``t_suffix_end - t_prefix_start``, ms), the stage sum p50 (preprocess + prefix
+ suffix) and the overhead (e2e - stage sum) against the goal of 5 % of the stage sum + 2 ms; the frames from the
step until the latency settles (``settle_frames``: the first frame of the phase from which the rolling median of 3
stays within 10 % of the phase's last-third median); and the moves of K made.
"""
from __future__ import annotations

import statistics

from .common import DEFAULT_BAG, percentiles



def _median(values: list[float]) -> float | None:
    """The upper median (statistics.median_high, the runners' convention), None for no value."""
    v = [x for x in values if x is not None]
    return statistics.median_high(v) if v else None


def summarize_load_step(suffix_records: list[dict], prefix_records: list[dict], moves: list, *, warmup: int,
                        start: int, stop: int) -> dict:
    """Figures of one load-step run (see the module docstring). ``suffix_records`` / ``prefix_records``: the
    pipeline workers' per-frame records (frame index = seq - 1); ``start`` / ``stop``: the frame indices at which the
    co-tenant started and stopped."""
    pre = {r["seq"]: r for r in prefix_records}
    rows = []
    for r in suffix_records:
        i = r["seq"] - 1
        if i < warmup or r["seq"] not in pre:
            continue
        e2e = (r["t_suffix_end_ns"] - r["t_prefix_start_ns"]) / 1e6
        stages = pre[r["seq"]]["preprocess_ms"] + pre[r["seq"]]["prefix_ms"] + r["suffix_ms"]
        rows.append({"frame": i, "k": r["split_layer"], "e2e_ms": e2e, "stage_sum_ms": stages,
                     "phase": "before" if i < start else ("during" if i < stop else "after")})
    phases = {}
    for name in ("before", "during", "after"):
        sel = [x for x in rows if x["phase"] == name]
        e2e, st = _median([x["e2e_ms"] for x in sel]), _median([x["stage_sum_ms"] for x in sel])
        over = _median([x["e2e_ms"] - x["stage_sum_ms"] for x in sel])
        allowed = None if st is None else 0.05 * st + 2.0
        tail = sel[len(sel) * 2 // 3:]
        phases[name] = {"n": len(sel), "e2e_p50_ms": e2e, "stage_sum_p50_ms": st, "overhead_p50_ms": over,
                        "allowed_ms": allowed, "met": None if over is None else over <= allowed,
                        "e2e_ms": percentiles([x["e2e_ms"] for x in sel]),
                        "k": sorted({x["k"] for x in sel}), "k_last": sel[-1]["k"] if sel else None,
                        "settle_frames": _settle(sel, _median([x["e2e_ms"] for x in tail]))}
    return {"phases": phases, "moves": moves, "frames": rows}


def _settle(sel: list[dict], level: float | None) -> int | None:
    """Frames from the phase's first until the rolling median of 3 e2e stays within 10 % of ``level``."""
    if not sel or level is None:
        return None
    e2e = [x["e2e_ms"] for x in sel]
    rolling = [_median(e2e[max(0, i - 2):i + 1]) for i in range(len(e2e))]
    for i in range(len(rolling)):
        if all(v <= 1.1 * level for v in rolling[i:]):
            return i
    return None


def run_load_step(plan: dict, *, before: int, during: int, after: int, warmup: int, prefix_cores, suffix_cores,
                  bag=DEFAULT_BAG, log=print) -> dict:
    """The four runs of one prepared preset (:func:`~.pipeline.prepare_preset`, with its profile): co-tenant on the
    suffix's then the prefix's cores, each with K fixed at the profile's choice and with live rebalancing. Returns
    {preset, split_layer, runs: {"<suffix|prefix>_<fixed|rebalance>": figures}}. Raises ValueError for a plan
    without a profile (a K given on the command line)."""
    from pathlib import Path

    from .pipeline import run_pipeline_once

    choice = plan.get("choice")
    if not choice:
        raise ValueError(f"{plan['preset']}: the load step needs the profile's per-K times (do not give --split)")
    # StageTimes' fields per K (this process imports no torch: the worker builds the class); the hand-off is inside
    # H + S in the table
    times = [{"prefix_ms": p, "handoff_ms": 0.0, "suffix_ms": hs} for _, p, hs in choice["table"]]
    k = plan["split_layer"]
    total = before + during + after
    out = {"preset": plan["preset"], "split_layer": k, "before": before, "during": during, "after": after,
           "warmup": warmup, "runs": {}}
    expected = max(choice["predicted_prefix_ms"], choice["predicted_handoff_suffix_ms"]) / 1e3
    for where, cores in (("suffix", suffix_cores), ("prefix", prefix_cores)):
        step = {"start": warmup + before, "stop": warmup + before + during, "cores": list(cores)}
        for mode in ("fixed", "rebalance"):
            log(f"  load step {plan['preset']}: co-tenant on the {where}'s cores {list(cores)}, K {mode} "
                f"(from {k}); {before}/{during}/{after} frames")
            extra = {"load_step": step, "rebalance_times": times if mode == "rebalance" else None}
            raw = run_pipeline_once(Path(plan["model_path"]), k, plan["dtype"], prefix_cores=prefix_cores,
                                    suffix_cores=suffix_cores, frames=total, warmup=warmup, bag=bag,
                                    expected_frame_s=3 * expected, pace=True, prefix_extra=extra, log=log)
            fig = summarize_load_step(raw["suffix"]["records"], raw["prefix"]["records"],
                                      raw["prefix"].get("moves", []), warmup=warmup, start=step["start"],
                                      stop=step["stop"])
            out["runs"][f"{where}_{mode}"] = fig
            ph = fig["phases"]
            log("    e2e p50 before / during / after: " + " / ".join(
                f"{ph[n]['e2e_p50_ms']:.0f}" if ph[n]["e2e_p50_ms"] is not None else "-"
                for n in ("before", "during", "after"))
                + f" ms; K during {ph['during']['k']}; {len(fig['moves'])} moves")
    return out


def run_load_step_part(plans: dict, *, before: int, during: int, after: int, warmup: int, prefix_cores,
                       suffix_cores, bag=DEFAULT_BAG, log=print) -> dict:
    """The load-step part for prepared presets with a profile; returns its JSON section {presets: [...]}."""
    return {"presets": [run_load_step(plan, before=before, during=during, after=after, warmup=warmup,
                                      prefix_cores=prefix_cores, suffix_cores=suffix_cores, bag=bag, log=log)
                        for plan in plans.values()]}
