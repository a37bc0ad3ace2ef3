"""The report of one ``hybrid-vla replay`` run: this run's node counters, drops by cause, stage percentiles,
the cost of each live re-split, the printed table and the hints at what went wrong. Pure functions of what the
replay recorded."""
from __future__ import annotations

import math
import statistics

from ..ros.status import FrameTiming, PrefixStatus, SuffixStatus
from ..util.stats import percentiles
from .evaluate import print_open_loop


def frame_of(frames: dict[int, float], stamp: int, tolerance_ns: float) -> int | None:
    """The published frame (key of ``frames``) a trajectory stamp belongs to, or None (not this replay's)."""
    key = min(frames, key=lambda f: abs(f - stamp)) if frames else None
    return None if key is None or abs(key - stamp) > tolerance_ns else key


def drops_by_cause(prefix: PrefixStatus | None, suffix: SuffixStatus | None) -> dict[str, int]:
    """Drops by cause ('<side>.<cause>') in two statuses of the nodes (ros/status.py; e.g. their counts of one
    run, ``status.since(baseline)``), and the frames the ring overwrote unread (``ring.dropped_oldest``)."""
    drops = {}
    for side, status in (("prefix", prefix), ("suffix", suffix)):
        if status is not None:
            drops.update({f"{side}.{cause}": n for cause, n in status.drops.items() if n})
    if prefix is not None and prefix.ring_dropped_oldest:  # frames the suffix was too slow to read
        drops["ring.dropped_oldest"] = prefix.ring_dropped_oldest
    return drops


def run_report(rec, frames, published, k, cfg, bag_path, tolerance_ms, prefix: PrefixStatus | None,
               suffix: SuffixStatus | None) -> dict:
    """The report of one run; ``prefix`` and ``suffix``: the nodes' statuses at the end with their counters of
    this run (``final.since(baseline)``, ros/status.py; None for a node not heard from)."""
    with rec.lock:
        trajectories = dict(rec.trajectories)
        timings = dict(rec.timings)
        reasoning = dict(rec.reasoning)
    e2e, foreign = [], 0
    for stamp, t_recv in trajectories.items():
        key = frame_of(frames, stamp, tolerance_ms * 1e6)
        if key is None:
            foreign += 1  # a trajectory for a frame this replay did not publish
        else:
            e2e.append((t_recv - frames[key]) * 1e3)
    stages = {s: percentiles([t.stage_ms()[s] for t in timings.values()], finite_only=True)
              for s in FrameTiming.STAGES}
    stages["end_to_end"] = percentiles(e2e)
    drops = drops_by_cause(prefix, suffix)
    overhead = pipeline_overhead(trajectories, timings, frames, tolerance_ms)
    return {
        "cpu_affinity": {side: list(st.cpu_affinity) if st is not None and st.cpu_affinity else None
                         for side, st in (("prefix", prefix), ("suffix", suffix))},
        "use_sim_time": {side: st is not None and st.use_sim_time
                         for side, st in (("prefix", prefix), ("suffix", suffix))},
        "split_layer": k, "num_layers": cfg.num_layers, "random_init": cfg.random_init,
        "camera_messages_in": prefix.frames_in if prefix is not None else 0,
        "frames_published": len(frames),
        "frames_synchronized": prefix.frames_synchronized if prefix is not None else 0,
        "frames_through_prefix": prefix.frames_out if prefix is not None else 0,
        "trajectories_out": len(trajectories) - foreign,
        "foreign_trajectories": foreign,
        "drops": drops,
        "stages_ms": stages,
        "pipeline_overhead": overhead,
        "suffix_backend": suffix_backend_report(suffix),
        "decode": decode_report(timings, reasoning, suffix) if getattr(cfg, "decode", None) else None,
        "messages_played": published["messages"],
        "playback_wall_s": round(published["wall_s"], 3),
        "interrupted": published["interrupted"],
        "output_bag": str(bag_path),
    }


def decode_report(timings: dict, reasoning: dict[int, str], suffix: SuffixStatus | None) -> dict:
    """A decoding model's run: frames the suffix decoded (its counter; published or dropped after the decode), of
    them those with a frame timing (published), their tokens per frame (min / p50 / max), the per-token medians of
    each published frame summarised as percentiles (ms: ``prefix_token_ms`` embedding + blocks [0, K),
    ``suffix_token_ms`` blocks [K, L) + norm + LM head, ``round_trip_ms`` both crossings), the reasoning texts
    received and the first one, the suffix's count of decodes that ended at ``max_new_tokens``, and its decode step at
    the end (``decode_step``: the node's ``suffix_decode_step``, e.g. ``inductor at K=1`` or ``eager``)."""
    decoded = [t for t in timings.values() if t.decode_tokens > 0]
    tokens = sorted(t.decode_tokens for t in decoded)
    first = reasoning[min(reasoning)] if reasoning else ""
    return {
        "frames": suffix.decode_frames if suffix is not None else len(decoded),
        "frames_timed": len(decoded),
        "tokens_per_frame": {"min": tokens[0], "p50": tokens[len(tokens) // 2], "max": tokens[-1]} if tokens else {},
        "prefix_token_ms": percentiles([t.prefix_token_ms for t in decoded], finite_only=True),
        "suffix_token_ms": percentiles([t.suffix_token_ms for t in decoded], finite_only=True),
        "round_trip_ms": percentiles([t.decode_round_trip_ms for t in decoded], finite_only=True),
        "reasoning_messages": len(reasoning),
        "first_reasoning": first[:500],
        "ended_at_max_new_tokens": suffix.decode_max_tokens if suffix is not None else None,
        "decode_step": suffix.suffix_decode_step if suffix is not None else None,
    }


def suffix_backend_report(suffix: SuffixStatus | None) -> dict | None:
    """How the suffix computed this run's frames, from its status at the end with this run's counts (None for a
    suffix not heard from): the backend asked for (``requested``, the ``suffix_backend`` parameter) and the one in
    use at the end, the K the compiled model covers (None without one), its precision, why the asked-for backend
    is not in use ('' when it is), and the frames each path computed in this run."""
    if suffix is None:
        return None
    return {"requested": suffix.suffix_backend, "in_use": suffix.suffix_backend_in_use,
            "compiled_k": suffix.suffix_backend_k, "precision": suffix.suffix_backend_precision,
            "error": suffix.suffix_backend_error, "frames_compiled": suffix.suffix_backend_frames_compiled,
            "frames_eager": suffix.suffix_backend_frames_eager}


def pipeline_overhead(trajectories: dict[int, float], timings: dict, frames: dict[int, float],
                      tolerance_ms: float) -> dict:
    """What end to end costs beyond the stages, per frame that has both a trajectory and a timing (ms, p50 over
    those frames): ``overhead`` = end to end (the last camera message's publish call begun to trajectory received,
    CLOCK_MONOTONIC) minus the stage sum (ego wait + preprocess + prefix + hand-off + suffix + odometry wait,
    the suffix's ``~/debug/frame_timing``; an untimed stage counts 0), against the goal of 5 % of the stage sum
    + 2 ms (issue 23's); where it goes: ``before_prefix`` (that call begun to the prefix's start,
    less the ego wait, which is a stage: image transport, synchronization, a busy or paced prefix) and
    ``after_suffix`` (the suffix's end to the trajectory received: guard, message, transport). Medians over
    frames: the overhead is the median of each frame's difference, not the difference of the stages' medians.
    {n, e2e_p50_ms, stage_sum_p50_ms, overhead_p50_ms, allowed_ms, met, before_prefix_p50_ms,
    after_suffix_p50_ms}; the values None (and ``met`` None) with no such frame."""
    rows = []
    for stamp, t_recv in trajectories.items():
        t = timings.get(stamp)
        key = frame_of(frames, stamp, tolerance_ms * 1e6)
        if t is None or key is None:
            continue
        parts = [t.stage_ms()[s] for s in FrameTiming.STAGES]
        parts = [x for x in parts if not math.isnan(x)]
        e2e = (t_recv - frames[key]) * 1e3
        ego = 0.0 if math.isnan(t.ego_wait_ms) else t.ego_wait_ms
        before = (t.t_prefix_start_ns / 1e9 - frames[key]) * 1e3 - ego if t.t_prefix_start_ns else None
        rows.append((e2e, sum(parts), before, (t_recv - t.t_suffix_end_ns / 1e9) * 1e3 if t.t_suffix_end_ns else None))

    def p50(i):
        v = [r[i] for r in rows if r[i] is not None]
        return round(statistics.median(v), 3) if v else None

    over = [r[0] - r[1] for r in rows]
    out = {"n": len(rows), "e2e_p50_ms": p50(0), "stage_sum_p50_ms": p50(1),
           "overhead_p50_ms": round(statistics.median(over), 3) if over else None,
           "before_prefix_p50_ms": p50(2), "after_suffix_p50_ms": p50(3)}
    out["allowed_ms"] = None if out["stage_sum_p50_ms"] is None else round(0.05 * out["stage_sum_p50_ms"] + 2.0, 3)
    out["met"] = None if out["overhead_p50_ms"] is None else out["overhead_p50_ms"] <= out["allowed_ms"]
    return out


def run_details(args, baseline, resplit_log: list[dict], frames: dict[int, float], rec) -> dict:
    """The report's keys beside :func:`run_report`'s: ``settings`` (the options ``args`` that shape the run),
    ``node_counters_at_start`` (each node's counters in ``baseline``, the nodes' statuses before playback,
    replay_recorder.Statuses), ``resplits`` (:func:`resplit_report` of ``resplit_log``, the --resplit events
    applied) and ``resplits_not_reached`` (``FRAME:K`` of those playback ended before)."""
    details = {"settings": {"dtype": args.dtype, "device": args.device, "rate": args.rate, "loops": args.loops,
                            "transport": args.transport, "fast_jpeg_decode": args.fast_jpeg_decode}}
    # the counters the nodes had before this run's playback (subtracted from this run's counts)
    details["node_counters_at_start"] = {
        f"{side}_node": st.counters() if st is not None else {}
        for side, st in (("prefix", baseline.prefix), ("suffix", baseline.suffix))}
    details["resplits"] = resplit_report(resplit_log, frames, rec, args.sync_tolerance_ms)
    applied = {(e["frame"], e["split_layer"]) for e in resplit_log}
    details["resplits_not_reached"] = [f"{f}:{k}" for f, k in args.resplit if (f, k) not in applied]
    return details


def resplit_report(events: list[dict], frames: dict[int, float], rec, tolerance_ms: float) -> list[dict]:
    """Per ``--resplit`` event: the frames from the event's frame to the next event (or the end) that got no
    trajectory (what the re-split cost, in frames) and the end-to-end latency of the event's frame (ms)."""
    order = sorted(frames)
    with rec.lock:
        answered = {frame_of(frames, stamp, tolerance_ms * 1e6): t for stamp, t in rec.trajectories.items()}
    out = []
    for i, e in enumerate(events):
        end = events[i + 1]["frame"] if i + 1 < len(events) else len(order)
        window = range(e["frame"], min(end, len(order)))
        lost = [j for j in window if order[j] not in answered]
        first = order[e["frame"]] if e["frame"] < len(order) else None
        e2e = (answered[first] - frames[first]) * 1e3 if first in answered else None
        out.append({**e, "frames_without_trajectory": lost,
                    "first_frame_e2e_ms": None if e2e is None else round(e2e, 2)})
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_report(r: dict) -> None:
    print()
    print("hybrid-vla replay report" + ("  (random-init model: not driving advice)" if r["random_init"] else ""))
    moves = [str(e["split_layer"]) for e in r.get("resplits", []) if e["accepted"]]
    print(f"  split layer            {r['split_layer']} of {r['num_layers']}"
          + (f" at the start, then {', '.join(moves)} (--resplit)" if moves else ""))
    print(f"  camera messages in     {r['camera_messages_in']}")
    print(f"  frames published       {r['frames_published']}")
    print(f"  frames synchronized    {r['frames_synchronized']}")
    print(f"  frames through prefix  {r['frames_through_prefix']}")
    print(f"  trajectories out       {r['trajectories_out']}")
    if r.get("foreign_trajectories"):
        print(f"  foreign trajectories   {r['foreign_trajectories']} "
              "(not from this replay's frames: another publisher?)")
    print(f"  drops by cause         {r['drops'] or 'none'}")
    b = r.get("suffix_backend")
    if b and b["requested"] == "eager":
        print(f"  suffix backend         eager: {b['frames_eager']} frame(s)")
    elif b:
        print(f"  suffix backend         {b['requested']}: {b['frames_compiled']} frame(s) compiled, "
              f"{b['frames_eager']} eager"
              + (f"; at the end blocks [{b['compiled_k']}, {r['num_layers']}) compiled, {b['precision']}"
                 if b["compiled_k"] is not None else "")
              + (f"; not in use: {b['error']}" if b["error"] else ""))
    d = r.get("decode")
    if d:
        tpf = d["tokens_per_frame"]
        print(f"  decode                 {d['frames']} frame(s) decoded, tokens per frame "
              + (f"{tpf['min']}-{tpf['max']} (p50 {tpf['p50']})" if tpf else "-")
              + f", {d['ended_at_max_new_tokens']} ended at max_new_tokens; {d['reasoning_messages']} reasoning "
              "message(s)")
        if d.get("decode_step"):
            print(f"  decode step            {d['decode_step']}")
        for name, key in (("prefix per token", "prefix_token_ms"), ("suffix per token", "suffix_token_ms"),
                          ("round trip", "round_trip_ms")):
            v = d[key]
            if v["n"]:
                print(f"    {name:<20} p50 {v['p50']:.3f} ms, p90 {v['p90']:.3f} ms (per-frame medians)")
        if d["first_reasoning"]:
            print(f"    first reasoning      {d['first_reasoning'][:100]!r}")
    cores = r.get("cpu_affinity") or {}
    if cores.get("prefix") or cores.get("suffix"):
        print(f"  cores                  prefix {cores.get('prefix')}, suffix {cores.get('suffix')}")
    print(f"  {'stage':<22} {'n':>5} {'p50 ms':>9} {'p90 ms':>9}")
    for stage, s in r["stages_ms"].items():
        if s["n"]:
            print(f"  {stage:<22} {s['n']:>5} {s['p50']:>9.2f} {s['p90']:>9.2f}")
        else:
            print(f"  {stage:<22} {0:>5} {'-':>9} {'-':>9}")
    o = r.get("pipeline_overhead") or {}
    if o.get("n"):
        print(f"  e2e - stage sum        {o['overhead_p50_ms']:.2f} ms (median per frame, {o['n']} frames; goal <= "
              f"5 % of {o['stage_sum_p50_ms']:.1f} ms + 2 ms = {o['allowed_ms']:.2f} ms: "
              f"{'met' if o['met'] else 'not met'})")
        print(f"    of which             before the prefix {_ms(o['before_prefix_p50_ms'])} ms (camera transport, "
              f"synchronization), after the suffix {_ms(o['after_suffix_p50_ms'])} ms (p50)")
    for e in r.get("resplits", []):
        cost = (f"{len(e['frames_without_trajectory'])} frame(s) without a trajectory"
                + (f" ({e['frames_without_trajectory']})" if e["frames_without_trajectory"] else ""))
        e2e = "-" if e["first_frame_e2e_ms"] is None else f"{e['first_frame_e2e_ms']:.1f} ms"
        print(f"  re-split before frame {e['frame']:<3} K -> {e['split_layer']}: "
              + (f"{cost}; that frame end to end {e2e}" if e["accepted"] else "refused"))
    if r.get("open_loop"):
        print_open_loop(r["open_loop"], indent="  ")
    print(f"  output bag             {r['output_bag']}")


def _age_drop_hint(report: dict, rate: float, attach: bool) -> str:
    """Why the suffix's output guard may have dropped trajectories for their age (``guard_too_old`` /
    ``guard_future_stamp``), from the report's ``use_sim_time`` of each node."""
    sim = report.get("use_sim_time") or {}
    if not sim.get("suffix"):
        return ("the suffix node's output guard dropped trajectories for their stamps, and it does not run on "
                "the bag's clock: the replay plays the bag's recorded stamps and publishes the bag's time on "
                "/clock, so the nodes must run with use_sim_time:=true (the params.yaml a replay writes has it"
                + ("; start attached nodes so, e.g. `ros2 launch ... use_sim_time:=true`)" if attach else ")"))
    head = "the suffix node's output guard dropped trajectories older than guard.max_age_s by the bag's clock. "
    if rate > 1.0:
        return (head + f"At --rate {rate:g} the replay scales guard.max_age_s by {rate:g}, so the limit is still the "
                "same wall time from the camera stamp to publication (1 s as shipped); those frames took longer "
                "than that (is the machine busy with other work?): replay on a quieter machine, or at a lower "
                "--rate, where frames do not wait for the prefix")
    return (head + f"At --rate {rate:g} the bag's clock runs {rate:g}x the wall clock, so the limit (1 s of bag time "
            f"as shipped) is {1.0 / rate:g} s of wall time from the camera stamp to publication; those frames took "
            "longer than that (the report's end_to_end stage, ego_wait included): replay at a lower --rate or on "
            "a quieter machine")


def hints(report: dict, first_camera: str, rate: float, attach: bool) -> list[str]:
    """What may have gone wrong, from a report of :func:`run_report` (one line each, for ``hint: `` lines):
    no camera message reached the prefix (``first_camera``: the first topic played of them), the suffix's
    output guard dropped trajectories for their age (at ``--rate`` ``rate``; ``attach``: the nodes were not
    started by the replay), the suffix's clock read 0, or an ego-state prefix got no odometry. [] when none
    applies."""
    out = []
    if report["frames_published"] and not report["camera_messages_in"]:
        out.append("the prefix received no camera messages: do its camera_topics / camera_transports match "
                   f"the played topics ({first_camera}, ...)?")
    if report["drops"].get("suffix.guard_too_old") or report["drops"].get("suffix.guard_future_stamp"):
        out.append(_age_drop_hint(report, rate, attach))
    if report["drops"].get("prefix.no_ego_state"):
        out.append("the prefix got no odometry for this checkpoint's ego-state input (prefix.no_ego_state): its "
                   "~/input/kinematic_state must be remapped onto /localization/kinematic_state (the launch file "
                   "and the nodes a replay starts do it; with `ros2 run` add "
                   "-r '~/input/kinematic_state:=/localization/kinematic_state')")
    if report["drops"].get("suffix.guard_no_clock"):
        out.append("the suffix node's clock read 0 (use_sim_time without /clock): is this replay's /clock "
                   "reaching it (same ROS_DOMAIN_ID, discovery range)?")
    return out
