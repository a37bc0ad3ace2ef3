"""Section 8, ``vehicle``: the paper's question on a vehicle computer, not on a GPU of its own. The VLA shares the
GPU with a co-tenant (standing in for Autoware's perception: a process that holds device memory and runs kernels
at a duty cycle), gets a GPU budget, and the suffix gets a stated number of spare cores. Under those conditions,
per preset: GPU-only (K = L, where the plan says it fits the budget) against the hybrid at the planned K and its
two neighbours: mean and p99 camera-to-trajectory latency, frames/s, frames lost, and peak GPU memory measured
against the plan's row. (The drift between a bf16 / fp16 GPU prefix and the CPU suffix is section 7's.)

The conditions are options (:data:`DEFAULTS`). Their defaults: a 16 GB budget for the VLA and 8 GB held by the
co-tenant, the issue's example of a 24 GB vehicle GPU shared with Autoware; the co-tenant busy half the time in
50 ms periods (a 20 Hz perception stack; an assumption, stated as such in the report, since no public figure for
Autoware's GPU duty cycle was found); the suffix on 4 spare cores. On the CPU (``--small``) the co-tenant busy-loops
at its duty cycle on the prefix's cores (the device stand-in) and holds host memory, and the budget is the plan's
bytes at L/2, so the planned K is L/2 and GPU-only does not fit: the same code end to end, no GPU figures.
"""
from __future__ import annotations

import time

from .common import GB, NEEDS_CUDA
from .pair import Pair, pipeline_figures

#: The vehicle conditions (option name -> default; see the module docstring for where each comes from).
DEFAULTS = {"vla_budget_gb": 16.0, "cotenant_gb": 8.0, "cotenant_duty": 0.5, "cotenant_period_ms": 50.0,
            "spare_cores": 4}


def cotenant_process(conn, device_name: str, hold_bytes: int, duty: float, period_s: float, cores) -> None:
    """Child process: the co-tenant. Holds ``hold_bytes`` (device memory on CUDA, host memory on the CPU) and, in
    each period of ``period_s``, runs matrix products for ``duty`` of it and sleeps the rest, until told to stop
    (anything on ``conn``). Sends ``{"ready": True, "held": bytes}`` once it holds its memory (``{"error": ...}``
    when it cannot), then ``{"busy_s": ..., "periods": ...}`` when it stops. ``cores``: CPU affinity (the CPU
    stand-in runs on the prefix's cores)."""
    import os

    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except (AttributeError, OSError):
            pass
    try:
        import torch

        dev = torch.device(device_name)
        torch.set_num_threads(max(1, len(cores or [0])))
        held = torch.empty(int(hold_bytes), dtype=torch.uint8, device=dev)
        a = torch.randn(1024, 1024, device=dev)
        conn.send({"ready": True, "held": held.numel()})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which reports it
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    busy, periods = 0.0, 0
    while not conn.poll(0):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * period_s:
            a = torch.tanh(a @ a * 1e-3)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        busy += time.perf_counter() - t0
        periods += 1
        rest = period_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
    conn.send({"busy_s": round(busy, 3), "periods": periods})


class Cotenant:
    """The co-tenant as a process (started at construction; :meth:`close` stops it and returns its figures)."""

    def __init__(self, device_name: str, hold_bytes: int, duty: float, period_s: float, cores):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=cotenant_process, args=(child, device_name, hold_bytes, duty, period_s,
                                                                list(cores or [])), daemon=True)
        self.proc.start()
        self.t0 = time.monotonic()
        msg = self.conn.recv() if self.conn.poll(120) else {"error": "the co-tenant did not start within 120 s"}
        if "error" in msg:
            self.close()
            raise RuntimeError(f"co-tenant: {msg['error']}")
        self.held = msg["held"]

    def close(self) -> dict:
        """Stop the co-tenant; its busy seconds, periods and measured duty cycle ({} when it gave none)."""
        out = {}
        try:
            self.conn.send("stop")
            if self.conn.poll(30):
                out = self.conn.recv()
                wall = time.monotonic() - self.t0
                out["measured_duty"] = round(out["busy_s"] / wall, 3) if wall > 0 else None
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
        return out


def conditions(check) -> dict:
    """The vehicle conditions of this run: the options (:data:`DEFAULTS`), on the CPU scaled to the ``tiny``
    preset (the co-tenant holds 64 MiB; the budget is set per preset in :func:`run`)."""
    opts = {k: getattr(check.args, k, None) for k in DEFAULTS}
    c = {k: (DEFAULTS[k] if v is None else v) for k, v in opts.items()}
    spare = int(c["spare_cores"])
    cores = list(check.prefix_cores) + list(check.suffix_cores)
    c["suffix_cores"] = cores[-spare:] if 0 < spare < len(cores) else list(check.suffix_cores)
    if spare != len(c["suffix_cores"]):
        c["spare_cores_note"] = (f"--spare-cores {spare}: this machine has {len(cores)} usable cores and the prefix "
                                 f"keeps one at least, so the suffix runs on {len(c['suffix_cores'])}")
    c["prefix_cores"] = [x for x in cores if x not in c["suffix_cores"]] or list(check.prefix_cores)
    c["cotenant_bytes"] = int(c["cotenant_gb"] * GB) if check.cuda else 64 * 2**20
    c["budget"] = (f"{c['vla_budget_gb']:g} GB" if check.cuda else
                   "the plan's bytes at L/2 (CPU stand-in: --vla-budget-gb and --cotenant-gb apply on CUDA)")
    c["sources"] = {"vla_budget_gb / cotenant_gb": "issue 24's example: 16 GB of a 24 GB vehicle GPU",
                    "cotenant_duty / cotenant_period_ms": "assumption: perception busy half of each 50 ms "
                                                          "(20 Hz) period; no public figure found",
                    "spare_cores": "issue 24: the suffix on a stated number of spare cores"}
    return c


def run(check) -> dict:
    """The section: the co-tenant started, then per preset (``check.sizes.pipeline_presets``) the plan under the
    budget and one pipeline run per K (:func:`_rows`), the co-tenant stopped; its measured duty cycle reported."""
    from ...model.config import preset
    from ...split.planner import plan_split

    c = conditions(check)
    out = {"conditions": dict(c), "presets": {}}
    cotenant = Cotenant(str(check.device), c["cotenant_bytes"], float(c["cotenant_duty"]),
                        float(c["cotenant_period_ms"]) / 1e3, c["prefix_cores"] if not check.cuda else [])
    try:
        presets = list(check.sizes.pipeline_presets)
        for n_done, name in enumerate(presets):
            share_end = time.monotonic() + check.left_s() / (len(presets) - n_done)
            overrides = check.sizes.overrides.get(name, {})
            cfg = preset(name, **overrides)
            dtype = check.prefix_dtype
            unbounded = plan_split(cfg, dtype, cuda_overhead_bytes=None if check.cuda else 0, model_name=name)
            L = cfg.num_layers
            budget = c["vla_budget_gb"] * GB if check.cuda else unbounded.row(L // 2).gpu_total_bytes
            plan = plan_split(cfg, dtype, gpu_budget_bytes=budget, cuda_overhead_bytes=None if check.cuda else 0,
                              model_name=name)
            k0 = plan.chosen_k
            fits_all = unbounded.row(L).gpu_total_bytes <= budget
            near = (k0 - 1, k0, k0 + 1) if check.sizes.vehicle_neighbours else (k0,)
            ks = sorted({k for k in near if 0 <= k <= L} | ({L} if fits_all else set()), reverse=True)
            entry = {"budget_bytes": int(budget), "planned_k": k0, "num_layers": L, "plan_reason": plan.reason,
                     "gpu_only": "fits the budget" if fits_all else
                     f"does not fit: the plan's {unbounded.row(L).gpu_total_bytes / GB:.3g} GB at K = L > the "
                     f"{budget / GB:.3g} GB budget (native {name} cannot run here)", "rows": []}
            out["presets"][name] = entry
            path = check.checkpoint(name, overrides)
            for k in ks:
                if unbounded.row(k).gpu_total_bytes > budget:
                    entry["rows"].append({"k": k, "status": f"does not fit the budget (plan "
                                                            f"{unbounded.row(k).gpu_total_bytes / GB:.2f} GB)"})
                    continue
                left = min(check.left_s(), share_end - time.monotonic())
                if left <= 10:
                    entry["rows"].append({"k": k,
                                          "status": "skipped: this section's share of the time budget is spent"})
                    continue
                row = _row(check, c, path, k, L, budget, unbounded.row(k).gpu_total_bytes, max_s=max(30.0, left))
                entry["rows"].append(row)
                e2e = row["e2e_ms"]
                check.log(f"  vehicle {name} K={k}: e2e mean {e2e['mean'] or float('nan'):.1f} ms, p99 "
                          f"{e2e['p99'] or float('nan'):.1f} ms, {row['fps']:.2f} fps, lost {row['lost']}")
    finally:
        out["cotenant"] = {"held_bytes": cotenant.held, **cotenant.close()}
    out["budget_note"] = ("the budget caps the prefix's caching allocator (as the node's gpu_budget_gb does) and "
                          "chooses K with the plan's CUDA-context allowance; the context itself is outside any "
                          "allocator cap, so the driver-level use (gpu_used) can exceed the budget by about it")
    if not check.cuda:
        out["note"] = (f"the prefix and the co-tenant run on the CPU: GPU memory and the co-tenant's GPU kernels "
                       f"{NEEDS_CUDA}; the budget is the plan's bytes at L/2")
    return out


def _row(check, c: dict, path, k: int, num_layers: int, budget: float, plan_bytes: int, max_s: float) -> dict:
    """One pipeline run at split layer ``k`` under the conditions ``c``: the prefix with the budget (refused at
    start when its plan row does not fit), the suffix on the spare cores; latency mean / percentiles, frames/s,
    frames lost, and the prefix's peak reserved GPU memory against the plan's row."""
    pair = Pair(path, k, device=str(check.device), prefix_dtype=check.prefix_dtype, suffix_dtype=check.suffix_dtype,
                frames=check.sizes.frames + check.sizes.warmup, camera_wh=check.sizes.camera_wh,
                prefix_cores=c["prefix_cores"], suffix_cores=c["suffix_cores"], max_s=max_s,
                gpu_budget_bytes=int(budget) if check.cuda else 0)
    pre, suf = pair.results()
    row = {"k": k, "label": "GPU-only (K = L)" if k == num_layers else "hybrid"}
    row.update(pipeline_figures(pre, suf, check.sizes.warmup))
    row["e2e_mean_ms"] = row["e2e_ms"]["mean"]
    mem = pre.get("mem_end") or {}
    row["gpu_peak_reserved"] = mem.get("peak_reserved")
    row["gpu_used"] = mem.get("used")  # driver level: the CUDA context as well, which no allocator cap limits
    if row["gpu_used"] is not None and check.cuda:
        row["used_over_budget_bytes"] = int(row["gpu_used"] - budget)
    row["plan_bytes"] = plan_bytes
    if row["gpu_peak_reserved"] is not None:
        row["peak_vs_plan"] = row["gpu_peak_reserved"] / max(1, plan_bytes)
    return row
