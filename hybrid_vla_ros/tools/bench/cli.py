"""``hybrid-vla bench [--json OUT] [--plots DIR] [--only PARTS] [--quick] ...``

Register with ``add_arguments(subparser)`` and ``run(args) -> exit code``; also runs as
``python -m hybrid_vla_ros.tools.bench``. The parent process imports neither torch nor rclpy: every measurement runs in
pinned worker processes (:mod:`hybrid_vla_ros.tools.bench.worker`). Exit code 0 when every part ran (goals met or
not: the figures are reported, not asserted), 1 when a part failed (its error is in the JSON), 2 for bad
arguments.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from ...util.cores import cpu_model, parse_core_list
from ...util.precision import CpuFeatures
from ...util.paths import output_dir_problem, output_file_problem
from .common import DEFAULT_BAG, NUSCENES_DIR, REPO_ROOT, NoiseMeter, read_bandwidth_gbs

PARTS = ("handoff", "pipeline", "loadstep", "flops", "preprocess", "families", "decode", "moe")
#: One-line description for the ``bench`` subcommand's help.
DESCRIPTION = ("side-by-side measurements of the split pipeline (JSON, Markdown, PNG): hand-off ring vs rclpy vs "
               "memcpy, pipeline efficiency and latency, CPU suffix FLOP/s, camera preprocessing share")
DEFAULT_JSON = REPO_ROOT / "out" / "benchmark" / "bench.json"
DEFAULT_PRESETS = ("tiny", "smol", "minddrive-0.5b")
#: hybrid_vla_ros.runtime.suffix_backend.BACKENDS, spelled out: this process imports no torch.
FLOPS_BACKENDS = ("eager", "openvino")

#: What --quick changes (unless the option is given explicitly).
QUICK = {"presets": ["tiny"], "flops_presets": ["tiny", "smol"], "sizes_mib": [1.0, 8.0], "count": 30,
         "rclpy_count": 10, "rclpy_variants": ["default", "large_data", "shm_profile"], "frames": 10,
         "sequential": ["1core"], "flops_repeats": 3, "flops_blocks": 2, "preprocess_frames": 3,
         "preprocess_seconds": 0.5, "gap_count": 10, "suffix_bound": None, "load_step": "3:8:5",
         "load_step_presets": ["tiny"], "decode_tokens": 16, "decode_prompt": 32, "decode_steps": 300,
         "overlap_tokens": 4, "overlap_frames": 3, "decode_inductor": "split_fp32", "moe_blocks": 1,
         "moe_tokens": [128], "moe_experts": 16}
FULL = {"presets": list(DEFAULT_PRESETS), "flops_presets": list(DEFAULT_PRESETS), "sizes_mib": [1.0, 4.0, 8.0, 32.0],
        "count": 200, "rclpy_count": 50, "rclpy_variants": ["default", "large_data", "shm_profile"], "frames": None,
        "sequential": ["1core", "2core"], "flops_repeats": 5, "flops_blocks": 4, "preprocess_frames": 5,
        "preprocess_seconds": 2.0, "gap_count": 40, "suffix_bound": "tiny:2:400", "load_step": "6:16:10",
        "load_step_presets": ["smol"], "decode_tokens": 64, "decode_prompt": 128, "decode_steps": 2000,
        "overlap_tokens": 16, "overlap_frames": 8, "decode_inductor": "all", "moe_blocks": 2,
        "moe_tokens": [256, 1024], "moe_experts": None}


def _list(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip() and t.strip().lower() != "none"]


def _name_values(text: str, cast=int) -> dict:
    """'tiny=0,smol=12' -> {'tiny': 0, 'smol': 12}."""
    out = {}
    for item in _list(text):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=VALUE")
        try:
            out[name.strip()] = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: bad value") from None
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``hybrid-vla bench``."""
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="OUT", default=str(DEFAULT_JSON),
                   help=f"JSON file (default {DEFAULT_JSON.relative_to(REPO_ROOT)})")
    g.add_argument("--markdown", metavar="OUT", default=None, help="Markdown tables (default: the JSON path with .md)")
    g.add_argument("--plots", metavar="DIR", default=None, help="also write PNG plots into DIR")
    g.add_argument("--quiet", action="store_true", help="no progress lines (the tables are still printed)")
    g = p.add_argument_group("what to run")
    g.add_argument("--only", type=_list, default=list(PARTS),
                   help=f"comma-separated parts: {','.join(PARTS)} (default: all)")
    g.add_argument("--quick", action="store_true",
                   help="short run (about a minute): tiny preset, 1 and 8 MiB, few messages and frames")
    g.add_argument("--presets", type=_list, default=None,
                   help=f"presets for pipeline, flops and preprocess (default {','.join(DEFAULT_PRESETS)}; "
                        "quick: tiny, and tiny,smol for flops)")
    g = p.add_argument_group("hand-off")
    g.add_argument("--sizes-mib", type=float, nargs="+", default=None, help="payload sizes in MiB (default 1 4 8 32)")
    g.add_argument("--count", type=int, default=None, help="measured ring and memcpy messages per size (default 200)")
    g.add_argument("--warmup", type=int, default=5, help="unmeasured messages first, per size and method")
    g.add_argument("--rclpy-count", type=int, default=None,
                   help="measured rclpy messages per size and variant (default 50)")
    g.add_argument("--rclpy-variants", type=_list, default=None,
                   help="rclpy variants: default,large_data,shm_profile ('none' for no rclpy)")
    g.add_argument("--rclpy-max-seconds", type=float, default=90.0,
                   help="stop an rclpy size early (after 10 messages) when it takes longer than this")
    g.add_argument("--gaps-ms", type=float, nargs="+", default=[0.0, 20.0, 100.0],
                   help="frame gaps of the zero-copy hand-off runs, ms (0: back to back; default 0 20 100)")
    g.add_argument("--gap-count", type=int, default=None,
                   help="measured zero-copy messages per size at each non-zero gap (default 40, quick 10)")
    g.add_argument("--block-gaps-ms", type=float, nargs="*", default=[20.0],
                   help="gaps of the spin-off (block only) ring run (default 20)")
    g.add_argument("--no-zero-copy", action="store_true", help="leave out the zero-copy and iceoryx2 runs")
    g.add_argument("--rt-priority", type=int, default=0,
                   help="run both ends of the zero-copy runs SCHED_FIFO at this priority (0: off), to emulate "
                        "reserved cores on a machine other work shares; needs CAP_SYS_NICE")
    g = p.add_argument_group("pipeline and preprocessing")
    g.add_argument("--frames", type=int, default=None,
                   help="measured frames per preset (default: tiny 40, smol 30, minddrive-0.5b 8, others 10)")
    g.add_argument("--warmup-frames", type=int, default=2, help="unmeasured frames first")
    g.add_argument("--sequential", type=_list, default=None, help="sequential baselines: 1core,2core (default both)")
    g.add_argument("--split", type=lambda t: _name_values(t, int), default={},
                   help="split layer per preset, e.g. tiny=0,smol=12 (default: chosen from a profile)")
    g.add_argument("--image-size", type=lambda t: _name_values(t, int), default={},
                   help="camera input size per preset, e.g. minddrive-0.5b=224 (default 112 px for minddrive-0.5b, "
                        "minddrive-3b and orion; the others as the preset has it)")
    g.add_argument("--k-margin", type=float, default=0.05,
                   help="K = smallest K with prefix >= (1 + margin) x (hand-off + suffix) (default 0.05)")
    g.add_argument("--dtype", default="bf16", help="model dtype of the pipeline and preprocessing runs (default bf16; "
                   "fp32 on a CPU without native units for it, as the suffix node's inference_precision: auto)")
    g.add_argument("--suffix-bound", default=None,
                   help="suffix-bound pipeline case PRESET:K:MS (the preset's suffix made MS slower; FIFO, newest "
                        "and newest + paced prefix), 'none' to skip (default tiny:2:400; quick: none)")
    g.add_argument("--load-step", default=None,
                   help="load-step part BEFORE:DURING:AFTER measured frames around a co-tenant on the suffix's, then "
                        "the prefix's cores (default 6:16:10; quick 3:8:5)")
    g.add_argument("--load-step-presets", type=_list, default=None,
                   help="presets of the load-step part, among --presets (default smol; quick: tiny); each runs four "
                        "pipelines, so minddrive-0.5b adds many minutes")
    g.add_argument("--preprocess-frames", type=int, default=None, help="minimum frames per preprocessing case")
    g.add_argument("--model-cache", default=None, help="folder for the cached benchmark checkpoints")
    g.add_argument("--bag", default=str(DEFAULT_BAG), help="rosbag2 folder with the camera frames")
    g.add_argument("--camera-dir", default=str(NUSCENES_DIR), help="folder with six 1600x900 nuScenes CAM_* JPEGs")
    g = p.add_argument_group("VLM families")
    g.add_argument("--families", type=_list, default=None,
                   help="VLM families of the families part (default: all of tools/bench/families.py PUBLISHED)")
    g = p.add_argument_group("suffix FLOP/s")
    g.add_argument("--flops-dtypes", type=_list, default=["fp32", "bf16"], help="dtypes (default fp32,bf16)")
    g.add_argument("--flops-blocks", type=int, default=None,
                   help="decoder blocks in the measured suffix (default 4; per-frame costs weigh more in a short "
                        "suffix: give the number of blocks a chosen K leaves to measure that suffix)")
    g.add_argument("--flops-repeats", type=int, default=None, help="timed samples (default 5)")
    g.add_argument("--flops-backends", type=_list, default=["eager", "openvino"],
                   help="suffix backends measured (default eager,openvino; eager always runs)")
    g.add_argument("--no-peer", action="store_true",
                   help="skip the llama.cpp peer (all 30 smol blocks against llama.cpp's prefill; runs when smol is "
                        "among the presets)")
    g.add_argument("--build-llama-cpp", action="store_true",
                   help="build llama-cpp-python from source into the cache first when it is not there (once, several "
                        "minutes; the JSON records how long), so the peer runs")
    g = p.add_argument_group("decode")
    g.add_argument("--decode-split-layer", type=int, default=None,
                   help="K of the decode part's SmolLM2-135M (default: the K `make demo` planned, from "
                        "out/demo/plan_smol.json, else 15)")
    g = p.add_argument_group("cores")
    g.add_argument("--prefix-cores", default="0", help="cores of the prefix process (default 0)")
    g.add_argument("--suffix-cores", default="1", help="cores of the suffix process (default 1)")
    g.add_argument("--flops-cores", default=None, help="cores of the FLOP/s worker (default: the suffix cores)")


def _settings(args) -> dict:
    base = QUICK if args.quick else FULL
    s = dict(base)
    if args.presets:
        s["presets"] = s["flops_presets"] = list(args.presets)
        if args.load_step_presets is None:  # the default ones that run, else the first preset
            s["load_step_presets"] = [n for n in s["load_step_presets"] if n in s["presets"]] or s["presets"][:1]
    for key in ("sizes_mib", "count", "rclpy_count", "rclpy_variants", "frames", "sequential", "flops_repeats",
                "flops_blocks", "preprocess_frames", "gap_count", "suffix_bound", "load_step", "load_step_presets"):
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    return s


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name, dists in (("torch", ("torch",)), ("numpy", ("numpy",)),
                        ("opencv", ("opencv-python-headless", "opencv-python", "opencv-contrib-python")),
                        ("rclpy", ("ros-rclpy",)), ("transformers", ("transformers",))):
        for d in dists:
            try:
                out[name] = version(d)
                break
            except PackageNotFoundError:
                continue
    return out


def _setting_problems(args: argparse.Namespace, s: dict, parts: list[str]) -> list[str]:
    """Bad option values, found before anything is measured (one line each)."""
    from ...model.config import PRESETS
    from ...model.config import preset as preset_config
    from .handoff import RCLPY_VARIANTS

    problems = []
    if not parts:
        problems.append("--only names no part")
    unknown = [v for v in s["rclpy_variants"] if v not in RCLPY_VARIANTS]
    if unknown:
        problems.append(f"--rclpy-variants {unknown}: use {', '.join(RCLPY_VARIANTS)} or none")
    bad = [v for v in s["sequential"] if v not in ("1core", "2core")]
    if bad:
        problems.append(f"--sequential {bad}: use 1core, 2core")
    bad = [v for v in set(s["presets"]) | set(s["flops_presets"]) if v not in PRESETS]
    if bad:
        problems.append(f"--presets {sorted(bad)}: use {', '.join(PRESETS)}")
    bad = [v for v in [args.dtype, *args.flops_dtypes] if v not in ("fp32", "bf16", "fp16")]
    if bad:
        problems.append(f"dtype {bad}: use fp32, bf16, fp16")
    bad = [v for v in args.flops_backends if v not in FLOPS_BACKENDS]
    if bad:
        problems.append(f"--flops-backends {bad}: use {', '.join(FLOPS_BACKENDS)}")
    if any(not (x > 0) for x in s["sizes_mib"]):
        problems.append(f"--sizes-mib {s['sizes_mib']}: sizes must be > 0")
    for key in ("count", "rclpy_count", "frames", "flops_repeats", "flops_blocks", "preprocess_frames"):
        if s.get(key) is not None and s[key] < 1:
            problems.append(f"--{key.replace('_', '-')} must be >= 1, got {s[key]}")
    bad = {k: v for k, v in args.image_size.items() if v < 1}
    if bad:
        problems.append(f"--image-size {bad}: sizes must be >= 1 pixel")
    bad = {k: v for k, v in args.split.items() if v < 0}
    if bad:
        problems.append(f"--split {bad}: split layers must be >= 0")
    if s.get("suffix_bound") and s["suffix_bound"] != "none":
        parts_sb = str(s["suffix_bound"]).split(":")
        if len(parts_sb) != 3 or not parts_sb[1].isdigit() or not _is_number(parts_sb[2]):
            problems.append(f"--suffix-bound {s['suffix_bound']!r}: use PRESET:K:MS (K a whole number >= 0, MS a "
                            "busy wait in ms >= 0), e.g. tiny:2:400, or none")
        elif "pipeline" in parts and args.suffix_bound is not None and parts_sb[0] not in s["presets"]:
            # (the default case, tiny:2:400, is left out when --presets leaves tiny out)
            problems.append(f"--suffix-bound {s['suffix_bound']!r}: preset {parts_sb[0]!r} is not among --presets "
                            f"{s['presets']} (the case runs on a preset the pipeline part prepares)")
        elif parts_sb[0] in PRESETS and int(parts_sb[1]) > preset_config(parts_sb[0]).num_layers:
            problems.append(f"--suffix-bound {s['suffix_bound']!r}: K {parts_sb[1]} out of range "
                            f"[0, {preset_config(parts_sb[0]).num_layers}] for {parts_sb[0]}")
    phases = str(s.get("load_step") or "").split(":")
    if len(phases) != 3 or not all(x.isascii() and x.isdigit() and int(x) >= 1 for x in phases):
        problems.append(f"--load-step {s.get('load_step')!r}: use BEFORE:DURING:AFTER frames, each >= 1, e.g. 6:16:10")
    if "loadstep" in parts:
        bad = [v for v in s["load_step_presets"] if v not in s["presets"]]
        if bad:
            problems.append(f"--load-step-presets {bad}: not among --presets {s['presets']}")
        if not s["load_step_presets"]:
            problems.append("--load-step-presets names no preset")
        given = sorted(set(s["load_step_presets"]) & set(args.split))
        if given:
            problems.append(f"--split {given}: the load step needs the profile's per-K times; leave K to the profile")
    if any(not (g >= 0) for g in args.gaps_ms + list(args.block_gaps_ms)):
        problems.append("--gaps-ms / --block-gaps-ms must be >= 0")
    for option, path, why in (("--json", args.json, output_file_problem(args.json, create_parents=True)),
                              ("--markdown", args.markdown,
                               args.markdown and output_file_problem(args.markdown, create_parents=True)),
                              ("--plots", args.plots, args.plots and output_dir_problem(args.plots))):
        if why:
            problems.append(f"{option} {path}: {why}")
    return problems


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def _suffix_bound(text) -> dict | None:
    """'tiny:2:400' -> {preset, split_layer, suffix_extra_ms, frames}; None for none / unset."""
    if not text or text == "none":
        return None
    preset, k, ms = str(text).split(":")
    return {"preset": preset, "split_layer": int(k), "suffix_extra_ms": float(ms), "frames": 10}


def _cores_and_settings(args: argparse.Namespace, parts: list[str]):
    """(prefix cores, suffix cores, FLOP/s cores, settings) of the command line, or the problems (lines) that stop
    it."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        return [f"unknown part(s) {unknown}; use {','.join(PARTS)}"]
    try:
        prefix_cores, suffix_cores = parse_core_list(args.prefix_cores), parse_core_list(args.suffix_cores)
        flops_cores = parse_core_list(args.flops_cores) if args.flops_cores else suffix_cores
    except ValueError as e:
        return [str(e)]
    allowed = os.sched_getaffinity(0)
    bad = sorted(set(prefix_cores + suffix_cores + flops_cores) - allowed)
    if bad:
        return [f"cores {bad} are not available to this process (it may use {sorted(allowed)})"]
    s = _settings(args)
    return _setting_problems(args, s, parts) or (prefix_cores, suffix_cores, flops_cores, s)


def _header(args: argparse.Namespace, parts: list[str], s: dict, cores: tuple, image_sizes: dict) -> dict:
    """The report's fields before any part runs: host, software, settings."""
    from . import report

    cpu = CpuFeatures.read()
    precision = pipeline_precision(args.dtype)
    doc = {
        "kind": report.KIND, "format_version": report.FORMAT_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": None, "quick": bool(args.quick), "parts": parts,
        "options": {k: v for k, v in vars(args).items()
                    if isinstance(v, (str, int, float, bool, list, dict, type(None)))},
        "host": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(), "cpu_flags": cpu.reported_flags,
                 "isa_level": cpu.isa_level, "read_gbs_per_core": read_bandwidth_gbs(),
                 "platform": platform.platform()},
        "software": _versions(), "settings": {k: v for k, v in s.items()}, "noise": {}, "errors": {},
        "notes": ["Figures are ratios measured side by side in one run; none is a timing test. "
                  "See 'noise' for how busy the machine was with other work during each part."],
    }
    prefix_cores, suffix_cores, flops_cores = cores
    doc["settings"].update(prefix_cores=prefix_cores, suffix_cores=suffix_cores, flops_cores=flops_cores,
                           dtype=precision.name, dtype_asked=args.dtype,
                           dtype_reason=precision.reason, image_sizes=image_sizes,
                           split=args.split, k_margin=args.k_margin)
    return doc


def _flops(args: argparse.Namespace, s: dict, cores: list[int], log) -> dict:
    """The FLOP/s part, with the llama.cpp peer built first when asked."""
    from .suffix_flops import run_flops_part

    build = None
    if args.build_llama_cpp and not args.no_peer and "smol" in s["flops_presets"]:  # the peer's preset
        from .llama_peer import build_llama_cpp

        try:
            build = build_llama_cpp(log=log)
        except RuntimeError as e:  # the peer is then skipped with the reason; the FLOP/s rows still run
            build = {"error": str(e)}
            log(f"  peer: building llama-cpp-python failed: {e}")
    out = run_flops_part(s["flops_presets"], dtypes=tuple(args.flops_dtypes), cores=cores, blocks=s["flops_blocks"],
                         repeats=s["flops_repeats"], backends=tuple(args.flops_backends), peer=not args.no_peer,
                         log=log)
    if build is not None and out.get("peer") is not None:
        out["peer"]["llama_cpp_build"] = build
    return out


def _decode(args: argparse.Namespace, s: dict, prefix_cores, suffix_cores, log) -> dict:
    """The decode part at the demo's K (or ``--decode-split-layer``), llama.cpp built first when asked."""
    import json

    from .decode import run_decode_part

    k, source = args.decode_split_layer, "--decode-split-layer"
    plan = REPO_ROOT / "out" / "demo" / "plan_smol.json"
    if k is None and plan.is_file():
        k, source = int(json.loads(plan.read_text())["chosen_k"]), str(plan.relative_to(REPO_ROOT))
    if k is None:
        k, source = 15, "default (no demo plan)"
    if args.build_llama_cpp:
        from .llama_peer import build_llama_cpp

        try:
            build_llama_cpp(log=log)
        except RuntimeError as e:
            log(f"  decode: building llama-cpp-python failed: {e}")
    out = run_decode_part(split_layer=k, prefix_cores=prefix_cores, suffix_cores=suffix_cores,
                          new_tokens=s["decode_tokens"], prompt=s["decode_prompt"], steps=s["decode_steps"],
                          overlap=(s["overlap_tokens"], s["overlap_frames"]), inductor=s["decode_inductor"], log=log)
    out["split_layer_from"] = source
    return out


def pipeline_precision(asked: str):
    """The dtype the model parts run both CPU stages in (:class:`~hybrid_vla_ros.util.precision.InferencePrecision`):
    ``--dtype``, or fp32 for bf16 / fp16 on a CPU without native units for it, as a suffix node computes it."""
    from ...model.checkpoint import parse_dtype
    from ...util.precision import inference_precision

    return inference_precision(parse_dtype(asked))


def _run_model_parts(args, parts, s, part, prefix_cores, suffix_cores, image_sizes, log) -> None:
    """The parts on prepared presets (checkpoints and split layers first): pipeline, load step, preprocessing."""
    from .pipeline import DEFAULT_CACHE, DEFAULT_FRAMES, prepare_preset

    plans = {}
    precision = pipeline_precision(args.dtype)
    dtype = precision.name

    def prepare():
        log(f"preparing {', '.join(s['presets'])}: checkpoints and split layers ({dtype}"
            + (f"; {precision.reason}" if precision.widened else "") + ")")
        for name in s["presets"]:
            plans[name] = prepare_preset(
                name, dtype=dtype, image_size=image_sizes.get(name), split_layer=args.split.get(name),
                cache=Path(args.model_cache) if args.model_cache else DEFAULT_CACHE, prefix_cores=prefix_cores,
                bag=Path(args.bag), margin=args.k_margin, log=log)
            log(f"  {name}: K = {plans[name]['split_layer']} ({plans[name]['split_reason']})")
        return dict(plans)

    part("prepare", prepare)
    if "pipeline" in parts and plans:
        from .pipeline import run_pipeline_part

        frames = {n: s["frames"] or DEFAULT_FRAMES.get(n, 10) for n in plans}
        part("pipeline", lambda: run_pipeline_part(
            plans, frames=frames, warmup=args.warmup_frames, prefix_cores=prefix_cores, suffix_cores=suffix_cores,
            sequential=tuple(s["sequential"]), bag=Path(args.bag), suffix_bound=_suffix_bound(s["suffix_bound"]),
            log=log))
    if "loadstep" in parts and plans:
        from .loadstep import run_load_step_part

        before, during, after = (int(x) for x in str(s["load_step"]).split(":"))
        chosen = {n: plans[n] for n in s["load_step_presets"] if n in plans}
        part("loadstep", lambda: run_load_step_part(
            chosen, before=before, during=during, after=after, warmup=args.warmup_frames, prefix_cores=prefix_cores,
            suffix_cores=suffix_cores, bag=Path(args.bag), log=log))
    if "preprocess" in parts and plans:
        from .preprocess import run_preprocess_part

        part("preprocess", lambda: run_preprocess_part(
            plans, dtype=dtype, cores=prefix_cores, camera_dir=args.camera_dir or None, bag=Path(args.bag),
            min_frames=s["preprocess_frames"], min_seconds=s["preprocess_seconds"], log=log))


def run(args: argparse.Namespace) -> int:
    """Run the selected parts; write JSON, Markdown and (with --plots) PNGs; print the tables."""
    from . import report
    from .pipeline import DEFAULT_IMAGE_SIZES

    t_start = time.monotonic()

    def log(line: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t_start:6.1f} s] {line}", flush=True)

    parts = list(dict.fromkeys(args.only))
    checked = _cores_and_settings(args, parts)
    if isinstance(checked, list):
        for line in checked:
            print(f"hybrid-vla bench: {line}", file=sys.stderr)
        return 2
    prefix_cores, suffix_cores, flops_cores, s = checked
    image_sizes = {**DEFAULT_IMAGE_SIZES, **args.image_size}
    doc = _header(args, parts, s, (prefix_cores, suffix_cores, flops_cores), image_sizes)

    def part(name: str, fn):
        with NoiseMeter() as meter:
            try:
                doc[name] = fn()
            except Exception as e:  # noqa: BLE001 - keep going with the other parts; the error goes into the JSON
                doc["errors"][name] = f"{type(e).__name__}: {e}"
                log(f"{name} FAILED: {type(e).__name__}: {e}")
                if not args.quiet:
                    traceback.print_exc()
        doc["noise"][name] = meter.result
        log(f"{name}: {meter.result['wall_s']:.1f} s, other load {meter.result['foreign_cpu_share']:.0%} of the CPUs")

    if "handoff" in parts:
        from .handoff import run_handoff

        part("handoff", lambda: run_handoff(
            s["sizes_mib"], count=s["count"], warmup=args.warmup, rclpy_count=s["rclpy_count"],
            variants=tuple(s["rclpy_variants"]), producer_cores=prefix_cores, consumer_cores=suffix_cores,
            max_seconds_per_size=args.rclpy_max_seconds, gaps_ms=tuple(args.gaps_ms), gap_count=s["gap_count"],
            block_gaps_ms=tuple(args.block_gaps_ms), zero_copy=not args.no_zero_copy, rt_priority=args.rt_priority,
            log=log))
    if "flops" in parts:
        part("suffix_flops", lambda: _flops(args, s, flops_cores, log))
    if "pipeline" in parts or "preprocess" in parts or "loadstep" in parts:
        _run_model_parts(args, parts, s, part, prefix_cores, suffix_cores, image_sizes, log)
    if "decode" in parts:
        part("decode", lambda: _decode(args, s, prefix_cores, suffix_cores, log))
    if "families" in parts:
        from .families import PUBLISHED, run_families

        chosen = args.families or list(PUBLISHED)
        part("families", lambda: run_families(chosen, repeats=1 if args.quick else 3, log=log))
    if "moe" in parts:
        from .moe import run_moe

        part("moe", lambda: run_moe(s["moe_blocks"], tuple(s["moe_tokens"]), repeats=2 if args.quick else 3,
                                    threads=max(1, len(suffix_cores)), experts=s["moe_experts"], log=log))
    doc["goals"] = report.evaluate_goals(doc)
    doc["wall_s"] = time.monotonic() - t_start
    json_path = report.write_json(doc, args.json)
    md_path = Path(args.markdown) if args.markdown else json_path.with_suffix(".md")
    text = report.markdown(doc)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    if args.plots:
        for path in report.write_plots(doc, args.plots):
            log(f"wrote {path}")
    print(text)
    log(f"wrote {json_path} and {md_path}; total {doc['wall_s']:.0f} s")
    return 1 if doc["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybrid-vla bench", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
