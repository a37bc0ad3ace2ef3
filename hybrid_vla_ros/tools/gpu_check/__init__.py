"""``hybrid-vla gpu-check`` / ``python scripts/gpu_check.py``: the GPU half of the pipeline, measured in one go.

ROS-free: it imports torch, numpy, safetensors, transformers, the standard library and this package's layers
below ``ros/`` (cv2 through :mod:`hybrid_vla_ros.vehicle.image` for the sections that run the prefix runner;
matplotlib, torchvision only where present). The prefix and suffix runners
(:class:`~hybrid_vla_ros.runtime.prefix.PrefixRunner`, :class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner`)
run in two processes (``multiprocessing`` spawn) joined by the real shared-memory ring.

Sections (each in its own try/except: a failure is reported and the rest still run; after ``--budget-s`` seconds
the remaining sections are skipped and the report says so):

1. ``memory_plan``: the prefix at K in {0, L/4, L/2, 3L/4, L} with random weights made on the device
   (:func:`~hybrid_vla_ros.model.checkpoint.random_stage`), one forward: peak allocated, peak reserved and
   driver-level used memory (``torch.cuda.mem_get_info``: total - free) against ``hybrid-vla plan``'s bytes.
   Goal: within 10 %. CPU: the weights' bytes against the plan's; the allocator figures need CUDA.
2. ``paper_table``: end-to-end latency (camera frame -> waypoints, ms) and pipelined frames/s of K = L (every
   block on the device) against the hybrid at the other K, suffix pinned to up to 14 cores in bf16, with the
   prefix's device memory per row.
3. ``live_resplit``: K moved down then up while frames flow: memory returned to the driver (reserved and
   driver-level used before / after the move), frames lost (published - computed - superseded) = 0, frames
   computed at a K other than their slot header's = 0.
4. ``memory_pressure``: a ballast process takes device memory while frames flow; with the auto re-split policy
   (:class:`~hybrid_vla_ros.split.planner.AutoResplitPolicy`, the node's ``auto_resplit_free_mb`` /
   ``auto_resplit_recover_mb``) the prefix moves K down before an allocation fails, and back up once the
   ballast is gone. CPU: the same policy and re-split with the free memory simulated (plan bytes of the
   current K plus the ballast's bytes taken from a device of fixed size).
5. ``handoff``: the device-to-host copy of ``orion``'s hidden states into a ring slot: pageable vs page-locked
   (registered mapping; pinned staging). CPU: a host copy into the slot (the device paths need CUDA).
6. ``camera_decode``: 6 JPEG cameras of 1936 x 1216: nvJPEG (``torchvision.io.decode_jpeg`` on CUDA) against
   the CPU path of the prefix (:func:`~hybrid_vla_ros.vehicle.image.compressed_msg_to_rgb`).
7. ``numerics``: fp16 / bf16 prefix on the device -> CPU suffix (fp32 and bf16) against the fp32 CPU
   monolithic model: trajectory drift at 3 s (cm; goal <= 1 cm). The weights are random: the drift of a
   random-weight head says how the arithmetic differs, not how a trained planner would drift.
8. ``vehicle``: the paper's question on a vehicle computer: a co-tenant on the same GPU (memory held, kernels at a
   duty cycle), a GPU budget for the VLA and the suffix on spare cores (:mod:`.vehicle`); GPU-only where it fits
   against the hybrid at the planned K and its neighbours: mean and p99 latency, frames/s, peak memory vs the plan.

Output under ``--out``: ``gpu_check.json`` (everything), ``gpu_check.md`` (tables), PNGs when matplotlib is
installed (else a note), and a summary on stdout. ``--small`` runs reduced sizes (the ``tiny`` preset, few
frames) so ``--device cpu --small`` finishes in about a minute on two cores.

Modules: ``common`` (section names, sizes, pure helpers), ``inputs`` (checkpoints, camera frames), ``workers``
and ``pair`` (the prefix and suffix processes of a pipeline run), one module per section (``memory_plan``,
``paper_table``, ``live_resplit``, ``memory_pressure``, ``handoff``, ``camera_decode``, ``numerics``),
``check`` (the run over the sections and its budget), ``report`` (JSON, Markdown, summary), ``plots``; here the
command line (options, preflight, :func:`main`). Every module imports only the standard library at import time.
"""
from __future__ import annotations

import argparse
import sys

from .camera_decode import decode_figures
from .check import Check
from .common import (CAMERA_WH, EGO_STATE, GB, MIB, NEEDS_CUDA, SECTIONS, TITLES, Sizes, core_split, drift_at,
                     frames_lost, image_size_overrides, sizes_for, split_points, wide_tiny_llm, within)
from .handoff import handoff_figures
from .inputs import ensure_checkpoint, raw_items, synthetic_rgb
from .memory_plan import memory_rows
from .memory_pressure import ballast_process
from .numerics import numerics_figures
from .pair import Pair, pipeline_figures
from .report import machine_info, markdown, summary, write_report
from .vehicle import DEFAULTS as VEHICLE_DEFAULTS
from .workers import prefix_process, suffix_process

__all__ = ["CAMERA_WH", "EGO_STATE", "GB", "MIB", "NEEDS_CUDA", "NEEDS_CV2", "NO_CUDA_FULL", "REQUIREMENTS",
           "SECTIONS", "TITLES", "VEHICLE_DEFAULTS", "Check", "Pair", "Sizes", "ballast_process", "build_parser",
           "core_split", "decode_figures", "drift_at", "ensure_checkpoint", "frames_lost", "handoff_figures",
           "image_size_overrides", "machine_info", "main", "markdown", "memory_rows", "missing_requirements",
           "numerics_figures", "pipeline_figures", "prefix_process", "preflight", "raw_items", "sizes_for",
           "split_points", "suffix_process", "summary", "synthetic_rgb", "wide_tiny_llm", "within", "write_report"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The options of ``hybrid-vla gpu-check`` and ``scripts/gpu_check.py``."""
    p = parser or argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check_out", help="output folder (JSON, Markdown, PNGs, model cache)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--small", action="store_true", help="reduced sizes: tiny preset, few frames (CPU test run)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="time budget, s: sections not started by then are skipped (default 420)")
    p.add_argument("--only", "--sections", dest="sections", nargs="+", choices=SECTIONS, default=None,
                   help="run only these sections: a rerun of what a killed or failed run did not finish (into the "
                        "same --out, the sections it does not run keep that report's results)")
    p.add_argument("--cache", default="", help="checkpoint cache folder (default OUT/models; reused on a rerun)")
    v = VEHICLE_DEFAULTS
    p.add_argument("--vla-budget-gb", type=float, default=v["vla_budget_gb"],
                   help=f"vehicle section: the VLA's GPU budget, GB (default {v['vla_budget_gb']:g})")
    p.add_argument("--cotenant-gb", type=float, default=v["cotenant_gb"],
                   help=f"vehicle section: GPU memory the co-tenant holds, GB (default {v['cotenant_gb']:g})")
    p.add_argument("--cotenant-duty", type=float, default=v["cotenant_duty"],
                   help="vehicle section: the co-tenant's busy fraction of each period "
                        f"(default {v['cotenant_duty']:g})")
    p.add_argument("--cotenant-period-ms", type=float, default=v["cotenant_period_ms"],
                   help=f"vehicle section: the co-tenant's period, ms (default {v['cotenant_period_ms']:g})")
    p.add_argument("--spare-cores", type=int, default=v["spare_cores"],
                   help=f"vehicle section: CPU cores the suffix gets (default {v['spare_cores']})")
    return p


#: Modules the check imports when it runs (``import name`` -> what to install).
REQUIREMENTS = ("torch", "transformers", "safetensors", "numpy")
#: The sections that run the prefix runner, whose camera code imports cv2 (opencv-python-headless): without it they
#: would fail seconds into the run, so it is checked up front for them.
NEEDS_CV2 = ("paper_table", "live_resplit", "memory_pressure", "vehicle")
#: Refusal of a full-size run on a machine where ``--device auto`` finds no CUDA device.
NO_CUDA_FULL = ("no CUDA device: the full-size check is meant for a GPU machine (it writes about 20 GB of "
                "checkpoints and runs for a long time); use --device cpu --small here (or --device cpu for the "
                "full sizes on the CPU anyway)")


def missing_requirements(find=None, sections=None) -> list[str]:
    """Names in :data:`REQUIREMENTS` this Python cannot import (``importlib.util.find_spec`` is None, or ``find``
    standing in for it), and ``cv2`` when one of ``sections`` (None: every section) is in :data:`NEEDS_CV2`; an
    empty list when all are there. Nothing is imported."""
    import importlib.util

    find = find or importlib.util.find_spec
    wanted = SECTIONS if not sections else sections
    names = REQUIREMENTS + (("cv2",) if any(s in NEEDS_CV2 for s in wanted) else ())
    missing = []
    for name in names:
        try:
            if find(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def preflight(args: argparse.Namespace, cuda_available: bool | None = None, device_count: int | None = None) -> str:
    """Checks before anything is written: the requirements import, ``--device`` names a device this machine has,
    and ``auto`` resolving to the CPU is refused without ``--small`` (:data:`NO_CUDA_FULL`; ``--device cpu``
    given explicitly runs the full sizes), ``--budget-s`` >= 0 and ``--out`` usable as a folder.
    ``cuda_available`` / ``device_count`` default to torch's answers.
    Returns the error message, or ``""`` when the run may start."""
    missing = missing_requirements(sections=args.sections)
    if missing == ["cv2"]:
        wanted = [s for s in NEEDS_CV2 if not args.sections or s in args.sections]
        return (f"the sections {', '.join(wanted)} run the prefix's camera code, which needs cv2: it cannot be "
                f"imported by {sys.executable}; install opencv-python-headless, or leave those sections out "
                f"(--only {' '.join(s for s in SECTIONS if s not in NEEDS_CV2)})")
    if missing:
        return (f"gpu_check needs torch (and transformers, safetensors, numpy; cv2 for "
                f"{', '.join(NEEDS_CV2)}): {', '.join(missing)} cannot be imported by {sys.executable}; run it with "
                f"the Python that has them (e.g. the repository's .venv/bin/python)")
    from ...runtime.device import parse_device

    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
        device_count = torch.cuda.device_count() if cuda_available else 0
    try:
        name = parse_device(args.device, cuda_available, device_count or 0)
    except ValueError as e:
        return f"--device: {e}"
    if name == "cpu" and str(args.device).strip().lower() == "auto" and not args.small:
        return NO_CUDA_FULL
    if not 0 <= args.budget_s < float("inf"):  # (0: every section is skipped, the report still written)
        return f"--budget-s must be a finite number of seconds >= 0, got {args.budget_s}"
    if not (0.0 < getattr(args, "cotenant_duty", 0.5) <= 1.0):
        return f"--cotenant-duty must be in (0, 1], got {args.cotenant_duty}"
    for name in ("vla_budget_gb", "cotenant_gb", "cotenant_period_ms", "spare_cores"):
        if not getattr(args, name, 1) > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
    from ...util.paths import output_dir_problem

    for option, value in (("--out", args.out), ("--cache", getattr(args, "cache", "") or None)):
        if value is None:  # no --cache: under --out
            continue
        if not str(value).strip():
            return f"{option} must name a folder, got an empty string"
        problem = output_dir_problem(value)
        if problem:
            return f"{option}: {problem}"
    return ""


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    """Run the check; returns 0 when every section ran (ok or check), 1 when one failed, 2 when it cannot start
    (:func:`preflight`: a missing requirement, a device this machine lacks, a full-size run without CUDA, a
    negative budget, an ``--out`` that cannot be a folder)."""
    if args is None:
        args = build_parser().parse_args(argv)
    problem = preflight(args)
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    try:
        check = Check(args)
    except OSError as e:  # --out cannot be made after all (e.g. under /proc, or as root where access() says yes)
        print(f"gpu-check: --out: cannot create {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    report = check.run()
    jpath, mpath = write_report(report, check.out)
    print(summary(report))
    print(f"report: {jpath} and {mpath}")
    return 1 if any(s.get("status") == "failed" for s in report["sections"].values()) else 0

