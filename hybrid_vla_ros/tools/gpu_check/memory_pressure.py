"""Section 4, ``memory_pressure``: a ballast process takes device memory while frames flow; with the auto re-split
policy (:class:`~hybrid_vla_ros.split.planner.AutoResplitPolicy`) the prefix moves K down before an allocation
fails, and back up once the ballast is gone. On the CPU the free memory is simulated (a device of fixed size minus
the plan total of the current K minus the ballast's bytes); the policy and the re-split are the real ones."""
from __future__ import annotations

import time

from .common import MIB, NEEDS_CUDA
from .pair import Pair, pipeline_figures


def ballast_process(conn, device_name: str) -> None:
    """Child process: takes device memory on command (``{"take": bytes}`` in chunks, ``{"free": True}``,
    ``{"exit": True}``), answering each command with what it holds and any allocation failure."""
    import torch

    dev = torch.device(device_name)
    held = []
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)  # the context exists before the measurement starts
    conn.send({"ready": True})
    while True:
        cmd = conn.recv()
        if cmd.get("exit"):
            break
        if cmd.get("free"):
            held.clear()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            conn.send({"held": 0})
            continue
        n = int(cmd.get("take", 0))
        err = ""
        try:
            if n > 0 and dev.type == "cuda":
                held.append(torch.empty(n, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError as e:
            err = str(e).splitlines()[0]
        conn.send({"held": sum(t.numel() for t in held), "error": err})


class _Ballast:
    """The parent's end of a :func:`ballast_process` on ``device_name``, started and ready (RuntimeError when it
    does not say so within 120 s)."""

    def __init__(self, device_name: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=ballast_process, args=(child, device_name), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the ballast process did not start")
        self.conn.recv()

    def ask(self, cmd: dict) -> dict:
        """Send one command, return the answer (``held`` bytes, ``error``)."""
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self) -> None:
        """Tell the process to exit and wait up to 10 s for it."""
        try:
            self.conn.send({"exit": True})
        except OSError:
            pass
        self.proc.join(10)


def _thresholds(plan, num_layers: int, cuda: bool) -> tuple[int, int, int, int]:
    """(block, shortfall, low, high) in bytes: one block's plan bytes; how far under the low threshold the
    ballast takes the free memory (about half the blocks above L/2); the policy's low and high thresholds."""
    L = num_layers
    block = max(1, plan.row(L).gpu_total_bytes - plan.row(L - 1).gpu_total_bytes)
    # the ballast leaves free memory `shortfall` under the low threshold: about half the blocks above L/2
    shortfall = max(block, (plan.row(L).gpu_total_bytes - plan.row(L // 2).gpu_total_bytes) // 2)
    low = max(512 * MIB, 2 * shortfall) if cuda else 2 * shortfall
    high = low + 2 * shortfall + block
    return block, shortfall, low, high


def _press_and_release(check, pair: Pair, plan, policy: dict, ballast: _Ballast | None, want_free: int):
    """While the pair runs: take memory until free falls to ``want_free`` bytes (on the CPU: the simulated
    ballast), wait for K to move down, release it, wait for K to move back up. Returns (timeline, ballast
    errors, moved down, moved up); the timeline's ``t`` is seconds since the check started."""
    timeline, ballast_errors = [], []
    sh = pair.shared
    L = plan.num_layers
    limit = time.monotonic() + max(20.0, min(150.0, check.left_s()))

    def wait(cond, seconds):
        end = min(limit, time.monotonic() + seconds)
        while time.monotonic() < end and not cond() and pair.prefix.is_alive():
            time.sleep(0.02)
        return cond()

    wait(lambda: sh["frames"].value >= 3, 120)
    k0 = sh["k"].value
    # take memory so free falls under the low threshold by about half the blocks above L/2
    take = max(0, sh["free"].value - want_free) if check.cuda else 0
    if check.cuda:
        steps = 8
        for _ in range(steps):
            msg = ballast.ask({"take": take // steps})
            if msg.get("error"):
                ballast_errors.append(msg["error"])
            timeline.append({"t": round(time.monotonic() - check.t0, 2), "ballast": msg["held"],
                             "k": sh["k"].value, "free": sh["free"].value})
            time.sleep(policy["period_s"] * 2)
    else:
        sim_total = plan.row(L).gpu_total_bytes + policy["high"] + policy["margin"]
        sh["ballast"].value = int(sim_total - plan.row(L).gpu_total_bytes - want_free)
        timeline.append({"t": round(time.monotonic() - check.t0, 2), "ballast": sh["ballast"].value,
                         "k": sh["k"].value})
    moved_down = wait(lambda: sh["k"].value < k0, 30)
    k_low = sh["k"].value
    timeline.append({"t": round(time.monotonic() - check.t0, 2), "event": "after pressure", "k": k_low,
                     "free": sh["free"].value})
    wait(lambda: False, 1.0)  # frames at the lower K
    if check.cuda:
        ballast.ask({"free": True})
    else:
        sh["ballast"].value = 0
    timeline.append({"t": round(time.monotonic() - check.t0, 2), "event": "ballast released"})
    moved_up = wait(lambda: sh["k"].value > k_low, 30)
    timeline.append({"t": round(time.monotonic() - check.t0, 2), "event": "after release", "k": sh["k"].value,
                     "free": sh["free"].value})
    wait(lambda: False, 0.5)
    return timeline, ballast_errors, moved_down, moved_up


def run(check) -> dict:
    """The section's figures: thresholds (bytes), the policy's decisions, the timeline, whether K moved down and
    back up, the prefix's out-of-memory errors and the frame counts (status ``check`` unless all is as it
    should be)."""
    from ...model.config import preset
    from ...split.planner import plan_split

    name = check.sizes.resplit_preset
    overrides = check.sizes.overrides.get(name, {})
    cfg = preset(name, **overrides)
    path = check.checkpoint(name, overrides)
    L = cfg.num_layers
    plan = plan_split(cfg, check.prefix_dtype, cuda_overhead_bytes=None if check.cuda else 0)
    block, shortfall, low, high = _thresholds(plan, L, check.cuda)
    policy = {"low": low, "high": high, "margin": block, "up_after": 3, "period_s": 0.2 if check.cuda else 0.05}
    ballast = _Ballast(str(check.device)) if check.cuda else None
    pair = Pair(path, L, device=str(check.device), prefix_dtype=check.prefix_dtype, suffix_dtype=check.suffix_dtype,
                frames=0, camera_wh=check.sizes.camera_wh, prefix_cores=check.prefix_cores,
                suffix_cores=check.suffix_cores, policy=policy, max_s=max(30.0, min(180.0, check.left_s())))
    try:
        timeline, ballast_errors, moved_down, moved_up = _press_and_release(check, pair, plan, policy, ballast,
                                                                            low - shortfall)
    finally:
        pair.shared["done"].value = 1
        if ballast is not None:
            ballast.close()
    pre, suf = pair.results()
    fig = pipeline_figures(pre, suf, 0)
    ooms = [e for e in pre["errors"] if "out of memory" in e]
    out = {"preset": name, "num_layers": L, "low_threshold": low, "high_threshold": high,
           "free_source": "torch.cuda.mem_get_info" if check.cuda else
           "simulated: a device of fixed size minus the plan total at the current K minus the ballast",
           "decisions": pre["decisions"], "timeline": timeline, "moved_down": moved_down, "moved_up": moved_up,
           "prefix_out_of_memory": len(ooms), "ballast_errors": ballast_errors, "published": fig["published"],
           "computed": fig["computed"], "superseded": fig["superseded"], "overwritten": fig["overwritten"],
           "lost": fig["lost"],
           "mismatched_k": fig["mismatched_k"], "errors": fig["errors"]}
    if not check.cuda:
        out["note"] = (f"a real ballast on the device {NEEDS_CUDA}; the policy and the live re-split are the "
                       "real ones")
    out["status"] = "ok" if moved_down and moved_up and not ooms and fig["mismatched_k"] == 0 else "check"
    return out
