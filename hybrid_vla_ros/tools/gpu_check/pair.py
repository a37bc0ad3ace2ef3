"""A pipeline run as the parent sees it: a prefix and a suffix process on one ring (:class:`Pair`), and the
latency / rate / frame-count figures of what they recorded (:func:`pipeline_figures`)."""
from __future__ import annotations

import os
import time
import uuid

from ...transport.stats import ProducerStats
from .common import frames_lost, pct
from .workers import prefix_process, suffix_process


class Pair:
    """A prefix and a suffix process on one ring (and the shared counters the parent watches), started at once.

    ``model``: checkpoint folder; ``k``: split layer; ``frames``: frames the prefix feeds (``camera_wh``: W, H
    px), past which it goes on while a requested move is pending or, with ``policy``, until ``shared['done']``;
    ``moves``: {frame index: K} to request; ``policy``: the auto re-split's thresholds (bytes,
    :func:`~hybrid_vla_ros.tools.gpu_check.workers.prefix_process`); ``pace``: the prefix waits its pacing delay;
    ``max_s``: the prefix's time limit (s); ``gpu_budget_bytes``: the prefix runner's GPU budget (0: none; a K whose
    plan row exceeds it is refused at start, on CUDA). Each process is pinned to its cores, one torch thread per
    core."""

    def __init__(self, model: str, k: int, *, device: str, prefix_dtype: str, suffix_dtype: str, frames: int,
                 camera_wh, prefix_cores, suffix_cores, moves: dict | None = None, policy: dict | None = None,
                 pace: bool = True, max_s: float = 300, gpu_budget_bytes: int = 0):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        ring = f"gpucheck_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.shared = {name: self.ctx.Value("q", 0) for name in
                       ("k", "frames", "free", "ballast", "done", "prefix_done", "suffix_done")}
        self.ev = self.ctx.Event()
        self.pconn, pchild = self.ctx.Pipe()
        self.sconn, schild = self.ctx.Pipe()
        pspec = dict(model=str(model), k=k, device=device, dtype=prefix_dtype, ring=ring, frames=frames,
                     camera_wh=list(camera_wh), cores=prefix_cores, threads=len(prefix_cores),
                     moves={str(a): b for a, b in (moves or {}).items()}, policy=policy, pace=pace, max_s=max_s,
                     gpu_budget_bytes=int(gpu_budget_bytes))
        sspec = dict(model=str(model), k=k, dtype=suffix_dtype, ring=ring, cores=suffix_cores,
                     threads=len(suffix_cores))
        self.suffix = self.ctx.Process(target=suffix_process, args=(schild, self.ev, self.shared, sspec), daemon=True)
        self.prefix = self.ctx.Process(target=prefix_process, args=(pchild, self.ev, self.shared, pspec), daemon=True)
        self.prefix.start()
        self.suffix.start()
        self.max_s = max_s
        self.plan_msg = None

    def results(self) -> tuple[dict, dict]:
        """Wait for both processes, watching both at once; (prefix result, suffix result). Raises RuntimeError
        naming the child: with its error (and traceback) as soon as either reports one, when either exits without
        a result, or when the run overruns its limit (``max_s`` + 120 s). Both processes are stopped first. (A
        suffix that cannot attach used to leave the parent waiting on the prefix, which waits up to 300 s for the
        attach, and the failure was then blamed on the prefix.)"""
        deadline = time.monotonic() + self.max_s + 120
        children = {"prefix": (self.pconn, self.prefix), "suffix": (self.sconn, self.suffix)}
        out = {}
        while len(out) < 2:
            waiting = [name for name in children if name not in out]
            for name in waiting:
                conn, proc = children[name]
                if conn.poll(0.1):
                    msg = conn.recv()
                    if msg["type"] == "plan":
                        self.plan_msg = msg
                    elif msg["type"] == "error":
                        self.kill()
                        raise RuntimeError(f"{name} process: {msg['error']}\n{msg.get('traceback', '')}")
                    else:
                        out[name] = msg
                elif not proc.is_alive() and not conn.poll(0.5):
                    self.kill()
                    raise RuntimeError(f"the {name} process exited without a result (exit code {proc.exitcode})")
            if len(out) < 2 and time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the {', '.join(n for n in children if n not in out)} process gave no result "
                                   f"within {self.max_s + 120:.0f} s")
        for proc in (self.prefix, self.suffix):
            proc.join(30)
        return out["prefix"], out["suffix"]

    def kill(self) -> None:
        """Terminate both processes where still alive."""
        for proc in (self.prefix, self.suffix):
            if proc.is_alive():
                proc.terminate()
                proc.join(5)


def pipeline_figures(prefix: dict, suffix: dict, warmup: int) -> dict:
    """Latency / rate figures of one pipeline run: e2e (camera frame -> waypoints) percentiles over the frames
    after ``warmup``, fps (output rate over those frames), stage times, frames published / computed /
    superseded / lost, and frames whose suffix K differs from the prefix's record of the same seq."""
    prec = {r["seq"]: r for r in prefix["records"]}
    srec = suffix["records"]
    measured = [r for r in srec if r["stamp"] > warmup]
    ends = [r["t_end_ns"] for r in measured]
    fps = (len(ends) - 1) / ((ends[-1] - ends[0]) / 1e9) if len(ends) > 1 and ends[-1] > ends[0] else float("nan")
    mismatched = sum(1 for r in srec if r["seq"] in prec and prec[r["seq"]]["k"] != r["k"])
    computed_below_held = sum(1 for r in srec if r["suffix_k_held"] > r["k"])
    superseded = suffix.get("superseded", 0)
    overwritten = ProducerStats.from_dict(prefix.get("ring_stats", {})).dropped_oldest
    return {
        "e2e_ms": pct([r["e2e_ms"] for r in measured if r["e2e_ms"] is not None]),
        "fps": fps,
        "prefix_ms": pct([prec[r["seq"]]["prefix_ms"] for r in measured if r["seq"] in prec]),
        "preprocess_ms": pct([prec[r["seq"]]["preprocess_ms"] for r in measured if r["seq"] in prec]),
        "suffix_ms": pct([r["suffix_ms"] for r in measured]),
        "handoff_ms": pct([r["handoff_ms"] for r in measured]),
        "published": len(prefix["records"]), "computed": len(srec), "superseded": superseded,
        "overwritten": overwritten, "lost": frames_lost(len(prefix["records"]), len(srec), superseded, overwritten),
        "mismatched_k": mismatched + computed_below_held,
        "errors": prefix.get("errors", []) + suffix.get("errors", []),
    }

