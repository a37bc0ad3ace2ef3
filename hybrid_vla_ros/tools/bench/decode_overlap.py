"""The cross-frame pipeline with decode (issue 40 item 4), in ``hybrid-vla bench --only decode``.

A driving composition on a Qwen2.5-VL of its published widths (vision tower 1280 wide, text 2048 wide; a few blocks
of each, random init: timing only) that decodes ``tokens`` tokens a frame, split at K, runs as it does in the nodes:
a :class:`~hybrid_vla_ros.runtime.prefix.PrefixRunner` in one pinned worker (the prefix's cores) is handed the
embedded bag's frames back to back (it never waits for a camera), a
:class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner` in another (the suffix's cores) answers them. Both orders are
measured in the same run:

* **one frame at a time** (``decode_overlap`` off): a frame's decode ends before the prefix starts the next;
* **overlap**: the prefix prefills frame t+1 between frame t's decode steps (a step waits for at most one block).

Figures: frames/s of each in steady state (frames out from the first frame's decode end to the one before the
last's: the first frame runs alone, the last decodes with no prefill beside it; over the whole run too, where that
fill and drain count), and the ideal of the slower side: 1 / max(the prefix's busy time per frame, the
suffix's), busy being compute only (prefix: preprocess, prefill less its waits, every step; suffix: blocks [K, L)
over the prefill, every token, the read-out), medians of the same run's frames after the first. Goal: overlap
frames/s >= 0.9 of that ideal. Also reported: the decode's own chain (the suffix's prefill, then token, step, token,
... strictly alternating, as the suffix lives it), which bounds frames/s below that ideal whenever it is longer than
either side's busy time.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

#: The issue's goal: the overlapped pipeline's frames/s against the ideal of its slower side.
GOAL_OVERLAP_RATIO = 0.9
#: The composition: vision blocks, text blocks, split layer, camera size (W, H).
VISION_BLOCKS, TEXT_BLOCKS, SPLIT_LAYER, CAMERA_SIZE = 1, 4, 2, (224, 126)


def build_reasoner(root: Path, tokens: int, log=print) -> Path:
    """The benchmark's decoding composition under ``root``; returns its checkpoint directory."""
    import json

    from ..cli import main as cli
    from .families import _build

    vlm, _ = _build("qwen2_5_vl", root, VISION_BLOCKS, TEXT_BLOCKS)
    drive = root / "reasoner"
    rc = cli(["init-model", "--preset", "tiny", "--vlm", str(vlm), "--camera-size",
              f"{CAMERA_SIZE[0]}x{CAMERA_SIZE[1]}", "--set", f"decode={json.dumps({'max_new_tokens': tokens})}",
              str(drive)])
    if rc != 0:
        raise RuntimeError(f"init-model of the benchmark's decoding composition failed ({rc})")
    return drive


def bag_frames(n: int) -> list:
    """The embedded bag's first ``n`` frames of all six cameras: [(stamp ns, [("compressed", CompressedImage)] x 6)],
    cameras in topic order, as the prefix node's synchronizer hands them over."""
    from rosbags.typesys import Stores, get_typestore

    from ...util.bags import read_bag
    from ...util.paths import embedded_bag

    store = get_typestore(Stores.ROS2_KILTED)
    by_stamp: dict[int, dict] = {}
    for m in read_bag(embedded_bag()):
        if m.topic.endswith("/image_raw/compressed"):
            msg = store.deserialize_cdr(m.raw, m.msgtype)
            by_stamp.setdefault(msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec, {})[m.topic] = msg
    whole = [(s, [("compressed", cams[t]) for t in sorted(cams)]) for s, cams in sorted(by_stamp.items())
             if len(cams) == 6]
    return (whole * (n // len(whole) + 1))[:n]  # the bag's frames again when it has fewer


def overlap_prefix_task(chan, *, drive: str, namespace: str, overlap: bool, frames: int, threads: int) -> dict:
    """Worker (prefix cores): the embedded bag's first ``frames`` frames through a PrefixRunner, back to back.
    Returns per frame preprocess / prefill compute ms (its waits for steps left out), the decode's step compute
    (ms) and when its decode ended (s from the first frame's start)."""
    import torch

    from ...runtime.loops import PrefixLoop, counting_context
    from ...runtime.prefix import PrefixRunner
    from ...runtime.settings import PrefixRunnerSettings

    torch.set_num_threads(threads)
    runner = PrefixRunner(drive, PrefixRunnerSettings(SPLIT_LAYER, device="cpu", namespace=namespace,
                                                      decode_overlap=overlap))
    ctx, drops = counting_context(runner)
    followed, ended_at = {}, {}  # seq -> the frame's FollowedDecode, the instant its decode ended

    def decoded(seq, decode):
        ended_at[seq] = time.perf_counter()
        followed[seq] = decode

    loop = PrefixLoop(ctx, pace=False, on_decode=decoded)  # the node's loop; frames back to back: no pacing wait

    try:
        chan.send({"type": "ready"})
        chan.recv(120)  # "go": the suffix is attached
        items = bag_frames(frames)
        results = []
        t0 = time.perf_counter()
        for frame in items:
            result = loop.process(frame)
            if result is None:
                raise RuntimeError(f"the prefix dropped a frame: {dict(drops)} {drops.last}")
            results.append(result)
        if not runner.follower.wait_idle(600):
            raise TimeoutError("the last frame's decode did not end")
        wall = time.perf_counter() - t0
    finally:
        runner.close()
    return {"wall_s": wall, "decode_end_s": [ended_at[r.seq] - t0 for r in results],
            "preprocess_ms": [r.preprocess_ms - r.preprocess_wait_ms for r in results],
            "prefill_ms": [r.prefix_ms - r.prefill_wait_ms for r in results],  # compute: less its waits
            "steps_ms": [sum(followed[r.seq].prefix_step_ms) for r in results],
            "held_ms": [max(followed[r.seq].step_held_ms, default=0.0) for r in results],
            "ended": [followed[r.seq].ended for r in results]}


def overlap_suffix_task(chan, *, drive: str, namespace: str, frames: int, threads: int) -> dict:
    """Worker (suffix cores): answers ``frames`` frames; per frame its busy time (ms: every token, the read-out;
    the prefill is the first token) and its whole decode time."""
    import torch

    from ...runtime.loops import SuffixLoop, counting_context
    from ...runtime.settings import SuffixRunnerSettings
    from ...runtime.suffix import SuffixRunner

    torch.set_num_threads(threads)
    runner = SuffixRunner(drive, SuffixRunnerSettings(SPLIT_LAYER, namespace=namespace, backend="eager"))
    ctx, drops = counting_context(runner)
    got = []
    loop = SuffixLoop(ctx, publish=got.append)  # the node's loop
    try:
        runner.wait_attached(120)
        chan.send({"type": "ready"})
        while len(got) < frames:
            if loop.poll_once(600) is None:
                raise TimeoutError(f"no frame within 600 s: {dict(drops)} {drops.last}")
        busy = [sum(r.decode.suffix_token_ms) + r.decode.readout_ms for r in got]
        whole = [r.suffix_ms for r in got]
    finally:
        runner.close()
    return {"busy_ms": busy, "decode_ms": whole}


def check_overlap(tokens: int, frames: int) -> None:
    """Raises ValueError where the overlap cannot be measured: fewer than 3 frames (its steady state lies between
    the first frame and the last) or no token a frame."""
    if frames < 3:
        raise ValueError(f"the decode overlap needs 3 frames at least, got {frames}")
    if tokens < 1:
        raise ValueError(f"the decode overlap needs a token a frame at least, got {tokens}")


def run_overlap(tokens: int, frames: int, prefix_cores, suffix_cores, log=print) -> dict:
    """Both orders on the benchmark's composition, ``frames`` frames of ``tokens`` tokens each; returns the part's
    ``overlap`` section. Raises ValueError as :func:`check_overlap` does."""
    import uuid

    from .common import Worker

    check_overlap(tokens, frames)

    out = {"model": f"Qwen2.5-VL widths, {VISION_BLOCKS} vision / {TEXT_BLOCKS} text blocks, K = {SPLIT_LAYER}, "
                    f"{CAMERA_SIZE[0]} x {CAMERA_SIZE[1]} px cameras (random init)",
           "tokens": tokens, "frames": frames, "goal_ratio": GOAL_OVERLAP_RATIO}
    with tempfile.TemporaryDirectory() as tmp:
        drive = str(build_reasoner(Path(tmp), tokens, log))
        for name, overlap in (("sequential", False), ("overlap", True)):
            ns = f"/bench_ovl_{uuid.uuid4().hex[:8]}"
            args = {"drive": drive, "namespace": ns, "frames": frames}
            with Worker("overlap_prefix", {**args, "overlap": overlap, "threads": len(prefix_cores)},
                        cores=list(prefix_cores)) as p, \
                    Worker("overlap_suffix", {**args, "threads": len(suffix_cores)}, cores=list(suffix_cores)) as s:
                p.recv(300, expect="ready")
                s.recv(300, expect="ready")
                p.send({"type": "go"})
                pre = p.result(1800, log=log)
                suf = s.result(120, log=log)
            prefix_busy = [a + b + c for a, b, c in zip(pre["preprocess_ms"], pre["prefill_ms"], pre["steps_ms"])]
            # the first frame runs alone (nothing to overlap with): medians of the rest
            slower = max(statistics.median(prefix_busy[1:]), statistics.median(suf["busy_ms"][1:]))
            # the decode's own chain (the suffix's prefill, then token, step, token, ...: strictly alternating), as
            # the suffix lives it from taking the frame to its last reply
            chain = statistics.median(suf["decode_ms"][1:])
            # frames/s in steady state: frames out between the first frame's decode end and the one before the
            # last's; the first ran alone (the pipeline's fill) and the last decodes with no prefill beside it (its
            # drain: faster than the others). Over the whole run both count, a
            # share that shrinks with the frames.
            ends = sorted(pre["decode_end_s"])  # in frame order already: the follower decodes one frame at a time
            steady = ends[:-1]
            fps, ideal = (len(steady) - 1) / (steady[-1] - steady[0]), 1e3 / slower
            out[name] = {"frames_per_s_steady": fps, "frames_per_s_whole_run": frames / pre["wall_s"],
                         "decode_end_s": ends, "ideal_frames_per_s": ideal, "ratio": fps / ideal,
                         "decode_chain_ms": chain, "chain_bound_frames_per_s": 1e3 / chain,
                         "prefix_busy_ms": statistics.median(prefix_busy[1:]),
                         "suffix_busy_ms": statistics.median(suf["busy_ms"][1:]),
                         "step_held_max_ms": max(pre["held_ms"]), "prefill_ms": statistics.median(pre["prefill_ms"]),
                         "preprocess_ms": statistics.median(pre["preprocess_ms"]),
                         "steps_ms": statistics.median(pre["steps_ms"]),
                         "ended": pre["ended"]}
            log(f"  decode overlap ({name}): {fps:.2f} frames/s in steady state ({frames / pre['wall_s']:.2f} over "
                f"the whole run), ideal {ideal:.2f} ({fps / ideal:.2f}); prefix busy "
                f"{out[name]['prefix_busy_ms']:.0f} ms, suffix busy {out[name]['suffix_busy_ms']:.0f} ms a frame; "
                f"a step waited at most {out[name]['step_held_max_ms']:.1f} ms for the prefill")
    # the busy times above are each order's own: with overlap the prefill runs slower beside the steps on its core
    # than one frame at a time; against the ideal of the busy times without overlap it reads lower
    alone = max(out["sequential"]["prefix_busy_ms"], out["sequential"]["suffix_busy_ms"])
    out["overlap"]["ratio_vs_sequential_busy"] = out["overlap"]["frames_per_s_steady"] * alone / 1e3
    return out


def overlap_goals(o: dict, add) -> None:
    """The overlap's goal into ``add(id, part, what, value, target, met)``."""
    r = o["overlap"]["ratio"]
    # a decode that ended before max_new_tokens (a stop token) ran fewer steps than the frames it is compared with
    full = all(e == "max_new_tokens" for name in ("sequential", "overlap") for e in o[name]["ended"])
    add("decode_overlap", "decode", "decode pipeline with the next prefill between the steps: frames/s in steady "
        "state / ideal of the slower side" + ("" if full else " (a decode ended early: not comparable)"), r,
        f">= {o['goal_ratio']}", full and r >= o["goal_ratio"])


def markdown(o: dict) -> str:
    """The overlap's lines of the decode part's table."""
    lines = [f"\nCross-frame pipeline with decode ({o['model']}, {o['tokens']} tokens a frame, {o['frames']} frames "
             "handed back to back):", "", "| order | frames/s (steady state) | ideal of the slower side | ratio | "
             "frames/s over the whole run | prefix busy ms | suffix busy ms | decode chain ms | "
             "longest step wait for the prefill, ms |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("sequential", "overlap"):
        v = o[name]
        lines.append(f"| {name} | {v['frames_per_s_steady']:.2f} | {v['ideal_frames_per_s']:.2f} | "
                     f"{v['ratio']:.2f} | {v['frames_per_s_whole_run']:.2f} | "
                     f"{v['prefix_busy_ms']:.0f} | {v['suffix_busy_ms']:.0f} | {v['decode_chain_ms']:.0f} | "
                     f"{v['step_held_max_ms']:.1f} |")
    lines.append(f"\nAgainst the ideal of the busy times one frame at a time (the prefill not sharing its core "
                 f"with the steps): {o['overlap']['ratio_vs_sequential_busy']:.2f}.")
    return "\n".join(lines)
