"""Section 2, ``paper_table``: end-to-end latency (camera frame -> waypoints, ms) and pipelined frames/s of K = L
(every block on the device) against the hybrid at the other K, the suffix pinned to up to 14 cores, with the
prefix's device memory per row."""
from __future__ import annotations

import time
import traceback

from .common import NEEDS_CUDA, split_points
from .pair import Pair, pipeline_figures
from .plots import plot_paper


def run(check) -> dict:
    """Per preset (``check.sizes.pipeline_presets``): one row per K (:func:`_row`), K = L first. The section takes
    its own limit (:meth:`~.check.Check.section_limit_s`), shared equally among the presets; what does not fit is
    said skipped."""
    out = {"presets": {}, "prefix_dtype": check.prefix_dtype, "suffix_dtype": check.suffix_dtype,
           "suffix_cores": check.suffix_cores, "prefix_cores": check.prefix_cores,
           "paper": {"orion": "521 -> 408 ms, 45 -> 29 GB", "minddrive-0.5b": "443 -> 306 ms"}}
    if check.prefix_dtype != "fp16":
        out["dtype_note"] = ("the prefix runs in " + check.prefix_dtype + ": fp16 -> bf16 is not an allowed ring "
                             "conversion (transport.contract.CONVERSIONS), and bf16 has fp16's bytes")
    # the section's own limit (Check.section_limit_s: its part of what is left), so the sections after it still run
    t_end = time.monotonic() + check.left_s()
    out["share_s"] = round(t_end - time.monotonic(), 1)

    def left() -> float:
        return min(check.left_s(), t_end - time.monotonic())

    presets = list(check.sizes.pipeline_presets)
    for n_done, name in enumerate(presets):
        rows = []
        out["presets"][name] = {"rows": rows}
        # each preset gets an equal part of what is left of the share, so the last one still runs
        p_end = time.monotonic() + left() / (len(presets) - n_done)

        def row_left() -> float:
            return min(left(), p_end - time.monotonic())

        try:
            # orion: writing its 14 GB checkpoint here (when the preparation has not) takes about a minute
            ready = check.prepared(name, check.sizes.overrides.get(name, {}))
            if row_left() <= (90 if name == "orion" and not ready else 20):
                out["presets"][name]["status"] = "skipped: this section's share of the time budget is spent"
                continue
            if check.left_s() <= 30:
                out["presets"][name]["status"] = "skipped: time budget spent"
                continue
            from ...model.config import preset

            cfg = preset(name, **check.sizes.overrides.get(name, {}))
            path = check.checkpoint(name, check.sizes.overrides.get(name, {}))
            ks = (split_points(cfg.num_layers) if check.sizes.pipeline_ks is None
                  else {int(f * cfg.num_layers) for f in check.sizes.pipeline_ks})
            for k in sorted(ks, reverse=True):
                if row_left() <= 10:
                    rows.append({"k": k, "status": "skipped: this section's share of the time budget is spent"})
                    continue
                rows.append(_row(check, name, path, k, cfg.num_layers, max_s=max(30.0, row_left())))
            out["presets"][name]["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - the next preset still runs
            out["presets"][name]["status"] = f"failed: {type(e).__name__}: {e}"
            out["presets"][name]["traceback"] = traceback.format_exc()
    if not check.cuda:
        out["note"] = "the prefix runs on the CPU: GPU memory per row " + NEEDS_CUDA
    plot_paper(check, out)
    return out


def _row(check, name: str, path, k: int, num_layers: int, max_s: float) -> dict:
    """One pipeline run of preset ``name`` (checkpoint ``path``) at split layer ``k`` for ``max_s`` s at most:
    :func:`~hybrid_vla_ros.tools.gpu_check.pair.pipeline_figures` (ms, frames/s, frame counts) plus the
    prefix's device memory and stage bytes, the suffix's peak resident bytes and the hand-off copier's mode."""
    pair = Pair(path, k, device=str(check.device), prefix_dtype=check.prefix_dtype,
                suffix_dtype=check.suffix_dtype, frames=check.sizes.frames + check.sizes.warmup,
                camera_wh=check.sizes.camera_wh, prefix_cores=check.prefix_cores,
                suffix_cores=check.suffix_cores, max_s=max_s)
    pre, suf = pair.results()
    row = {"k": k, "label": "GPU-only (K = L)" if k == num_layers else "hybrid"}
    row.update(pipeline_figures(pre, suf, check.sizes.warmup))
    mem = pre.get("mem_end") or {}
    row["gpu_peak_reserved"] = mem.get("peak_reserved")
    row["gpu_used"] = mem.get("used")
    row["prefix_stage_bytes"] = pre["stage_bytes"]
    row["suffix_rss_peak"] = suf["rss_peak"]
    row["copier"] = pre.get("copier")
    check.log(f"  {name} K={k}: e2e p50 {row['e2e_ms'].get('p50', float('nan')):.1f} ms, "
              f"{row['fps']:.2f} fps, lost {row['lost']}")
    return row
