"""The check's report: what machine and code measured (:func:`machine_info`), the Markdown tables
(``gpu_check.md``, :func:`markdown`), strict JSON (``gpu_check.json``, :func:`write_report`) and the few lines
printed at the end (:func:`summary`)."""
from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

from ...util.cores import cpu_model
from .common import GB, SECTIONS, TITLES


def machine_info(device) -> dict:
    """Host, Python, library versions and the device."""
    import numpy
    import torch

    info = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__, "cpus": os.cpu_count(),
            "cpu_model": cpu_model(), "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "device": str(device), "cuda_available": torch.cuda.is_available()}
    for mod in ("transformers", "safetensors", "torchvision", "cv2", "matplotlib"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            info[mod] = None
    try:  # which code measured: the repository's commit, when it is a git checkout
        import subprocess

        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    if torch.cuda.is_available() and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory=props.total_memory, cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    return info


def _fmt_bytes(v) -> str:
    """Bytes as MB (1e6 bytes), 'n/a' for None."""
    return "n/a" if v is None else f"{v / 1e6:.1f}"


def _p50(d) -> str:
    v = d.get("p50") if isinstance(d, dict) else None
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def markdown(report: dict) -> str:
    """The report as Markdown: machine, one table or list per section, skips and failures said as such."""
    m = report["machine"]
    lines = ["# GPU check", "", f"Device: {m['device']}" + (f" ({m.get('gpu')}, {m.get('gpu_memory', 0) / GB:.0f} GB, "
                                                          f"CUDA {m.get('cuda')})" if m.get("gpu") else ""),
             f"Host {m['host']}: {m['cpus']} CPUs ({m.get('cpu_model')}, {m.get('cpus_usable')} usable here), "
             f"Python {m['python']}, torch {m['torch']}, transformers "
             f"{m.get('transformers')}, torchvision {m.get('torchvision')}, cv2 {m.get('cv2')}",
             f"Code: commit {m.get('commit')}", f"Options: {json.dumps(report['options'])}",
             f"Total: {report.get('total_s', 0):.1f} s"]
    if report.get("checkpoints"):  # written beside the first section (Check.prepare)
        lines.append("Checkpoints: " + "; ".join(
            f"{c['preset']} {c['dtype']} {c['status']}" + (f" in {c['seconds']:.1f} s (done at {c['done_at_s']:.1f} s)"
                                                          if "done_at_s" in c else "") for c in report["checkpoints"]))
    lines.append("")
    for name in SECTIONS:
        s = report["sections"].get(name, {"status": "missing"})
        lines += [f"## {TITLES[name]}", "", f"status: **{s.get('status')}**"
                  + (f" ({s['seconds']:.1f} s)" if "seconds" in s else "")
                  + (" (from an earlier run into this folder)" if s.get("earlier_run") else ""), ""]
        if s.get("status") == "failed":
            lines += [f"error: `{s.get('error')}`", ""]
            continue
        if s.get("status") in ("skipped", "not requested"):
            lines += [s.get("reason", ""), ""]
            continue
        if s.get("status") in ("pending", "running"):  # a report written while the run goes on (or was killed)
            lines += ["not finished when this report was written", ""]
            continue
        lines += _section_md(name, s)
        for key in ("note", "dtype_note", "random_note", "budget_note"):
            if s.get(key):
                lines += [f"note: {s[key]}", ""]
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    for plot in report.get("plots", []):
        lines.append(f"![{plot}]({plot})")
    return "\n".join(lines) + "\n"


def _md_memory_plan(s: dict) -> list[str]:
    out = []
    for preset_name, d in s.get("presets", {}).items():
        out += [f"**{preset_name}** ({d.get('dtype')}, L = {d.get('num_layers')}), MB:", "",
                "| K | plan total | plan weights | weights | peak allocated | peak reserved | driver used (+ctx) "
                "| driver / plan |", "|---|---|---|---|---|---|---|---|"]
        for r in d.get("rows", []):
            ratio = r.get("driver_vs_plan")
            out.append(f"| {r['k']} | {_fmt_bytes(r.get('plan_total'))} | {_fmt_bytes(r.get('plan_weights'))} | "
                       f"{_fmt_bytes(r.get('weight_bytes'))} | {_fmt_bytes(r.get('peak_allocated'))} | "
                       f"{_fmt_bytes(r.get('peak_reserved'))} | {_fmt_bytes(r.get('driver_total'))} | "
                       + ("n/a" if ratio is None else f"{ratio:.2f}") + " |")
        out.append("")
    return out


def _rows_table(header: list[str], rows: list[dict], cells) -> list[str]:
    """A Markdown table of pipeline rows: ``header``, then ``cells(row)`` per measured row, or K and its status for
    a row that was not run (no ``e2e_ms``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if "e2e_ms" not in r:
            out.append(f"| {r['k']} | {r.get('status')} |" + " |" * (len(header) - 2))
        else:
            out.append("| " + " | ".join(str(c) for c in cells(r)) + " |")
    return out


def _md_paper_table(s: dict) -> list[str]:
    out = []
    header = ["K", "e2e p50 ms", "fps", "prefix p50 ms", "hand-off p50 ms", "suffix p50 ms", "GPU reserved MB",
              "published", "lost"]
    for preset_name, d in s.get("presets", {}).items():
        out += [f"**{preset_name}** ({d.get('status')}); paper: {s.get('paper', {}).get(preset_name, '-')}", ""]
        out += _rows_table(header, d.get("rows", []), lambda r: (
            r["k"], _p50(r["e2e_ms"]), f"{r['fps']:.2f}", _p50(r["prefix_ms"]), _p50(r["handoff_ms"]),
            _p50(r["suffix_ms"]), _fmt_bytes(r.get("gpu_peak_reserved")), r["published"], r["lost"]))
        out.append("")
    return out


def _md_resplit(s: dict) -> list[str]:
    """Sections 3 and 4 (live re-split, memory pressure): counts, moves and decisions as a list."""
    keys = ("published", "computed", "superseded", "overwritten", "lost", "mismatched_k", "memory_returned",
            "returned_to_driver_bytes", "moved_down", "moved_up", "prefix_out_of_memory")
    out = [f"- {k}: {s[k]}" for k in keys if k in s]
    for mv in s.get("moves", []):
        out.append(f"- move K {mv['from']} -> {mv['to']} at frame {mv['frame']}: {mv['ms']:.1f} ms, reserved "
                   f"{_fmt_bytes(mv['reserved_before'])} -> {_fmt_bytes(mv['reserved_after'])} MB, driver used "
                   f"{_fmt_bytes(mv['used_before'])} -> {_fmt_bytes(mv['used_after'])} MB")
    for d in s.get("decisions", []):
        out.append(f"- decision at frame {d['frame']}: K {d['from']} -> {d['to']} ({d['why']})")
    out.append("")
    return out


def _md_handoff(s: dict) -> list[str]:
    out = [f"state {s.get('state_shape')} {s.get('dtype')} ({s.get('bytes', 0) / 1e6:.2f} MB)", "",
           "| mode | ms p50 | GB/s |", "|---|---|---|"]
    for mode, r in s.get("modes", {}).items():
        out.append(f"| {mode} | {r['ms_p50']} | {r['gb_per_s']} |")
    out.append("")
    return out


def _md_camera_decode(s: dict) -> list[str]:
    out = [f"{s.get('cameras')} cameras {s.get('width')}x{s.get('height')}, {s.get('jpeg_bytes', 0) / 1e6:.2f} MB "
           f"of JPEG ({s.get('encoder')})", "", "| path | ms p50 per frame |", "|---|---|"]
    for p, r in s.get("paths", {}).items():
        out.append(f"| {p} | {r.get('ms_p50', r.get('status'))} |")
    out.append("")
    return out


def _md_numerics(s: dict) -> list[str]:
    out = [f"K = {s.get('split_layer')} of {s.get('num_layers')}, cameras at {s.get('image_size')} px, against the "
           f"{s.get('reference')}", "",
           "| prefix | suffix | drift at 3 s, cm | max drift, cm | <= 1 cm |", "|---|---|---|---|---|"]
    for p in s.get("pairs", []):
        if "drift_3s_cm" in p:
            out.append(f"| {p['prefix']} | {p['suffix']} | {p['drift_3s_cm']} | {p['max_drift_cm']} | "
                       f"{'yes' if p['within_goal'] else 'no'} |")
        else:
            out.append(f"| {p['prefix']} | - | {p.get('status')} | | |")
    out.append("")
    return out


def _md_vehicle(s: dict) -> list[str]:
    c = s.get("conditions", {})
    t = s.get("cotenant", {})
    out = [f"VLA budget {c.get('budget')}; co-tenant holds {_fmt_bytes(t.get('held_bytes'))} MB, busy a fraction "
           f"{c.get('cotenant_duty')} of each {c.get('cotenant_period_ms')} ms period (measured "
           f"{t.get('measured_duty')}); prefix cores {c.get('prefix_cores')}, suffix on {c.get('suffix_cores')}"
           + (f" ({c['spare_cores_note']})" if c.get("spare_cores_note") else ""), ""]
    header = ["K", "frames", "e2e mean ms", "e2e p99 ms", "fps", "GPU peak reserved MB", "plan MB", "driver used MB",
              "used over budget MB", "lost"]
    ms = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    for preset_name, d in s.get("presets", {}).items():
        out += [f"**{preset_name}**: planned K = {d.get('planned_k')} of {d.get('num_layers')} under "
                f"{_fmt_bytes(d.get('budget_bytes'))} MB; GPU-only: {d.get('gpu_only')}", ""]
        out += _rows_table(header, d.get("rows", []), lambda r: (
            f"{r['k']} ({r['label']})", r["e2e_ms"].get("n"), ms(r["e2e_ms"].get("mean")), ms(r["e2e_ms"].get("p99")),
            f"{r['fps']:.2f}", _fmt_bytes(r.get("gpu_peak_reserved")), _fmt_bytes(r.get("plan_bytes")),
            _fmt_bytes(r.get("gpu_used")), _fmt_bytes(r.get("used_over_budget_bytes")), r["lost"]))
        out.append("")
    return out


def _md_decode(s: dict) -> list[str]:
    ms = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return [f"{s.get('model')}, K = {s.get('split_layer')}, prefix on {s.get('device')}, suffix on the CPU; "
            f"{s.get('new_tokens')} tokens after {s.get('prompt_tokens')}; tokens equal on both sides: "
            f"{s.get('tokens_equal_on_both_sides')}", "", "| per token, ms p50 | |", "|---|---|",
            f"| prefix step (device) | {ms(s.get('prefix_step_ms_p50'))} |",
            f"| suffix token (CPU) | {ms(s.get('suffix_token_ms_p50'))} |",
            f"| reply wait (suffix + crossings) | {ms(s.get('reply_wait_ms_p50'))} |",
            f"| crossings (wait - suffix) | {ms(s.get('crossings_ms_p50'))} |",
            f"| whole token | {ms(s.get('per_token_ms_p50'))} |", ""]


#: Section name -> its Markdown body (lines) from the section's figures.
_SECTION_MD = {"memory_plan": _md_memory_plan, "paper_table": _md_paper_table, "live_resplit": _md_resplit,
               "memory_pressure": _md_resplit, "handoff": _md_handoff, "camera_decode": _md_camera_decode,
               "numerics": _md_numerics, "vehicle": _md_vehicle, "decode": _md_decode}


def _section_md(name: str, s: dict) -> list[str]:
    md = _SECTION_MD.get(name)
    return md(s) if md is not None else []


def summary(report: dict) -> str:
    """A few lines for stdout: each section's status and headline figure."""
    lines = [f"gpu-check on {report['machine']['device']} in {report.get('total_s', 0):.0f} s:"]
    for name in SECTIONS:
        s = report["sections"].get(name, {})
        head = ""
        if name == "paper_table" and s.get("presets"):
            parts = []
            for p, d in s["presets"].items():
                rows = [r for r in d.get("rows", []) if "e2e_ms" in r]
                parts += [f"{p} K={r['k']}: {_p50(r['e2e_ms'])} ms {r['fps']:.2f} fps" for r in rows[:2]]
            head = "; ".join(parts)
        elif name == "vehicle" and s.get("presets"):
            head = "; ".join(f"{p}: planned K={d.get('planned_k')}, GPU-only "
                             + ("fits" if d.get("gpu_only") == "fits the budget" else "does not fit")
                             for p, d in s["presets"].items())
        elif name in ("live_resplit", "memory_pressure") and "lost" in s:
            head = f"lost {s['lost']}, mismatched K {s['mismatched_k']}"
        elif name == "numerics" and s.get("pairs"):
            head = ", ".join(f"{p['prefix'].split()[0]}->{p['suffix'].split()[0]} {p['drift_3s_cm']} cm"
                             for p in s["pairs"] if "drift_3s_cm" in p)
        elif s.get("status") == "failed":
            head = s.get("error", "")
        lines.append(f"  {TITLES[name]}: {s.get('status')}" + (f" -- {head}" if head else ""))
    return "\n".join(lines)


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    """Write ``gpu_check.json`` and ``gpu_check.md`` under ``out`` (:func:`~..harness.write_report`: a run killed
    while writing leaves the previous whole report); returns their paths."""
    from ..harness import write_report as write

    jpath = write(report, Path(out) / "gpu_check.json", markdown(report), indent=2, default=_json_default)
    return jpath, jpath.with_suffix(".md")

