"""Section 1, ``memory_plan``: the prefix at K in {0, L/4, L/2, 3L/4, L} with random weights made on the device,
one forward: peak allocated, peak reserved and driver-level used memory (``torch.cuda.mem_get_info``: total -
free) against ``hybrid-vla plan``'s bytes (goal: within 10 %). On the CPU the weights' bytes against the plan's;
the allocator figures need CUDA."""
from __future__ import annotations

import time

from .common import EGO_STATE, NEEDS_CUDA, nvidia_smi_used, runs, split_points, sync, within
from .plots import plot_memory


def run(check) -> dict:
    """Per preset (``check.sizes.memory_presets``), at each K of
    :func:`~hybrid_vla_ros.tools.gpu_check.common.split_points`: the plan's bytes against those measured by
    :func:`memory_rows`, with the ratios and whether each is within 10 %."""
    from ...model.config import preset
    from ...split.planner import plan_split

    out = {"presets": {}}
    for name in check.sizes.memory_presets:
        if check.left_s() <= 0:
            out["presets"][name] = {"status": "skipped", "reason": "time budget spent"}
            continue
        cfg = preset(name, **check.sizes.overrides.get(name, {}))
        dtype = "fp16" if runs(check.device, "fp16") else "fp32"
        plan = plan_split(cfg, dtype, cuda_overhead_bytes=None if check.cuda else 0, model_name=name)
        ks = split_points(cfg.num_layers)
        rows = _memory_rows(check, name, ks, dtype)
        for row in rows:
            p = plan.row(row["k"])
            row["plan_total"] = p.gpu_total_bytes
            row["plan_weights"] = p.gpu_weight_bytes
            row["plan_without_overhead"] = p.gpu_total_bytes - p.gpu_overhead_bytes
            row["weights_within_10pct"] = within(row["weight_bytes"], p.gpu_weight_bytes)
            if check.cuda:
                row["reserved_vs_plan"] = row["peak_reserved"] / max(1, row["plan_without_overhead"])
                row["reserved_within_10pct"] = within(row["peak_reserved"], row["plan_without_overhead"])
                if row.get("driver_total") is not None:
                    row["driver_vs_plan"] = row["driver_total"] / max(1, p.gpu_total_bytes)
                    row["driver_within_10pct"] = within(row["driver_total"], p.gpu_total_bytes)
        out["presets"][name] = {"dtype": dtype, "num_layers": cfg.num_layers, "cuda_overhead_allowance":
                                plan.cuda_overhead_bytes, "rows": rows}
    if not check.cuda:
        out["note"] = (f"peak allocated / reserved and driver-level used memory: {NEEDS_CUDA}; on the CPU the "
                       "weights' bytes of the stage made on the device are compared with the plan's")
    plot_memory(check, out)
    return out


def _memory_rows(check, name: str, ks: list[int], dtype: str, worker=None) -> list[dict]:
    """Per K: the prefix made with random weights on the device, one forward; figures in bytes. On CUDA each
    preset runs in a fresh process (``worker``: :func:`memory_rows`, or a stand-in with its arguments, importable
    by a spawned process) so the driver-level figure starts from an empty device; that process gets what is left
    of the check's budget (at least 5 s): TimeoutError when it has not answered by then (a worker that died, e.g.
    killed for memory, never answers a ``Pool.apply``)."""
    worker = worker or memory_rows
    if not check.cuda:
        return worker(name, check.sizes.overrides.get(name, {}), ks, dtype, str(check.device))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    limit_s = max(5.0, check.left_s())
    with ctx.Pool(1) as pool:
        job = pool.apply_async(worker, (name, check.sizes.overrides.get(name, {}), ks, dtype, str(check.device)))
        try:
            return job.get(timeout=limit_s)  # a worker that died (killed, out of memory) never answers
        except mp.TimeoutError:
            raise TimeoutError(f"the memory worker for {name} gave no rows within {limit_s:.0f} s (it died or hangs)"
                               ) from None



def memory_rows(name: str, overrides: dict, ks: list[int], dtype: str, device_name: str,
                smi_used_before: int | None = None) -> list[dict]:
    """Per K: the prefix of preset ``name`` with random weights made on ``device_name`` in ``dtype`` and one
    forward on random pixels. Bytes: ``weight_bytes`` (parameters), and on CUDA ``peak_allocated``,
    ``peak_reserved``, ``driver_used`` (total - free after the forward, the allocator's cache still held),
    ``driver_delta`` (that minus the figure before the stage was made), ``cuda_context`` (this process's context:
    used after it was created minus nvidia-smi's reading before; without nvidia-smi the whole used figure at
    start, other processes included) and ``driver_total`` = delta + context. ``smi_used_before``: ignored on
    CUDA (read here, before this process creates its context)."""
    import gc

    import torch

    from ...model.checkpoint import parse_dtype, random_stage
    from ...model.config import preset
    from ...model.modeling import example_scene
    from ...runtime.device import resolve_device

    cfg = preset(name, **overrides)
    if device_name.startswith("cuda") or device_name == "auto":
        # this process's own context is told apart by nvidia-smi's reading before it exists (the parent's
        # context, if any, is then counted as another process's memory, not this one's)
        index = int(device_name.partition(":")[2] or 0) if device_name.startswith("cuda") else 0
        smi_used_before = nvidia_smi_used(index)
    device = resolve_device(device_name)
    dt = parse_dtype(dtype)
    cuda = device.type == "cuda"
    if cuda:
        torch.zeros(1, device=device)
        load_kernels(device, dt)
    base_used = int(torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0]) if cuda else 0
    rows = []
    for k in ks:
        row = {"k": k}
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = int(torch.cuda.mem_get_info(device)[1] - torch.cuda.mem_get_info(device)[0])
        t0 = time.perf_counter()
        stage = random_stage(cfg, "prefix", k, device=device, dtype=dt)
        row["make_s"] = round(time.perf_counter() - t0, 3)
        row["weight_bytes"] = sum(p.numel() * p.element_size() for p in stage.parameters())
        pixels = torch.randn(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, device=device).to(dt)
        ego = torch.tensor(EGO_STATE, dtype=torch.float32, device=device) if cfg.ego_state_input else None
        with torch.inference_mode():
            t0 = time.perf_counter()
            hidden = stage(pixels, ego, scene=example_scene(cfg))
            sync(device)
            row["forward_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        row["finite"] = bool(torch.isfinite(hidden).all())
        if cuda:
            free, total = torch.cuda.mem_get_info(device)
            row["peak_allocated"] = int(torch.cuda.max_memory_allocated(device))
            row["peak_reserved"] = int(torch.cuda.max_memory_reserved(device))
            row["driver_used"] = int(total - free)
            row["driver_delta"] = row["driver_used"] - before
            context = (base_used - smi_used_before) if smi_used_before is not None else base_used
            row["cuda_context"] = context
            row["driver_total"] = row["driver_delta"] + context
        del stage, hidden, pixels
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def load_kernels(device, dtype) -> None:
    """Run one small matrix product and one scaled-dot-product attention on ``device`` in ``dtype``, so the
    libraries' own memory (cuBLAS handle and workspace, attention kernels' modules) is there before the baseline
    is read: it then counts as the process's CUDA context, not as the first row's (K = 0) stage memory."""
    import torch
    import torch.nn.functional as F

    a = torch.randn(256, 256, device=device).to(dtype)
    q = torch.randn(1, 4, 64, 64, device=device).to(dtype)
    with torch.inference_mode():
        (a @ a).sum()
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()
    sync(device)
    del a, q
