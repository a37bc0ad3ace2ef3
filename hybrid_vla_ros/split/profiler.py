"""Per-block timing profile of a split VLA on the devices at hand, read by the split planner.

:func:`profile_model` times each part (vision embedding, vision blocks, post-norm, projector + embeddings, rotary
tables, each decoder block, final norm + head, and the hand-off at a few payload sizes) on the CPU and on CUDA when
there is one, with real input shapes and dtypes: ``warmup`` untimed runs, then the median (and minimum) of
``repeats``; wall-clock, with ``torch.cuda.synchronize`` around each CUDA repeat. A preset's random weights are
materialised one part at a time (a 7B model never holds more than one block); a checkpoint's blocks are read one
by one from its safetensors file.

Profile file (JSON, :data:`PROFILE_SCHEMA`, checked by :func:`load_profile`)::

    format_version      1 (PROFILE_FORMAT_VERSION)
    kind                "hybrid_vla_profile"
    created_utc         ISO 8601 time of the measurement
    torch_version, python_version, platform   software and OS
    host                {"cpu_model": str, "logical_cpus": int}
    model               {"source": "preset" | "checkpoint", "preset": name | null, "path": str | null,
                         "config": the VLAConfig dict (config.json contents)}
    dtype               "fp32" | "fp16" | "bf16": dtype of weights and activations
    prefix_state_shape  [T, H] or [2, T, H]; handoff_bytes: its size in bytes
    settings            {"warmup": int, "repeats": int, "vision_blocks": "all" | "1", "llm_blocks": "all" | "1"}
    devices             {"cpu": DEVICE, "cuda": DEVICE (only when measured)}
    preprocess          {"ms", "min_ms": camera decode + resize + normalise of one frame on the CPU, ms;
                         "cameras": int; "source": str} (absent when the embedded bag was not found)
    DEVICE = {
      "kind": "cpu" | "cuda", "name": "cpu" | "cuda:0", "description": CPU model or GPU name,
      "dtype": what this device computed in (the top-level dtype, or fp32 on a CPU without native units for it:
               the suffix node's ``inference_precision: auto``; absent in profiles written before it),
      "cores": [int] (CPU cores the process was pinned to), "threads": int (torch intra-op threads),
      "total_memory_bytes": int (CUDA only),
      "parts_ms": {"vision_embeddings", "vision_post", "projector_embed", "rotary", "head": ms},
      "vision_blocks_ms": [ms per vision block], "vision_blocks_measured": how many were timed,
      "llm_blocks_ms": [ms per decoder block, L entries], "llm_blocks_measured": how many were timed,
      "min_ms": same keys as parts_ms plus "vision_blocks" / "llm_blocks" lists: the fastest repeat,
      "handoff": {"ring": [{"bytes": int, "ms": float, "min_ms": float}], "memcpy": [same]},
      "decode": (``profile --decode`` only) {"context_tokens": T, "llm_block_step_ms": [ms per decoder block: one
                token against a KV cache of T tokens], "lm_head_step_ms": the LM head on one row, or null for a
                model without one}
    }

When only one block of a kind is measured (``"1"``) its time is repeated for every block of that kind.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from ..model.checkpoint import Checkpoint, open_checkpoint, parse_dtype
from ..util.precision import inference_precision
from ..model.config import VLAConfig, preset
from ..model.kinds import profiled_shape, split_model
from ..model.timing_parts import FixedVision, VisionParts, free_, random_init_
from ..model import text
from ..model.modeling import (DEFAULT_COMMAND, PrefixStage, SuffixStage, embed, example_scene, llm_config, llm_family,
                              plan)
from ..util.cores import cpu_model, pin_process

PROFILE_FORMAT_VERSION = 1
PROFILE_KIND = "hybrid_vla_profile"
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
PART_KEYS = ("vision_embeddings", "vision_post", "projector_embed", "rotary", "head")

_MS = {"type": "number", "minimum": 0}
_HANDOFF = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["bytes", "ms", "min_ms"],
    "properties": {"bytes": {"type": "integer", "minimum": 1}, "ms": _MS, "min_ms": _MS}}}
_DEVICE = {
    "type": "object",
    "required": ["kind", "name", "description", "cores", "threads", "parts_ms", "vision_blocks_ms",
                 "vision_blocks_measured", "llm_blocks_ms", "llm_blocks_measured", "min_ms", "handoff"],
    "properties": {
        "kind": {"enum": ["cpu", "cuda"]},
        "name": {"type": "string"},
        "dtype": {"enum": ["fp32", "fp16", "bf16"]},
        "description": {"type": "string"},
        "cores": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "threads": {"type": "integer", "minimum": 1},
        "total_memory_bytes": {"type": "integer", "minimum": 0},
        "parts_ms": {"type": "object", "required": list(PART_KEYS),
                     "properties": {k: _MS for k in PART_KEYS}},
        "vision_blocks_ms": {"type": "array", "items": _MS, "minItems": 1},
        "vision_blocks_measured": {"type": "integer", "minimum": 1},
        "llm_blocks_ms": {"type": "array", "items": _MS},
        "llm_blocks_measured": {"type": "integer", "minimum": 0},
        "min_ms": {"type": "object"},
        "handoff": {"type": "object", "required": ["ring", "memcpy"],
                    "properties": {"ring": _HANDOFF, "memcpy": _HANDOFF}},
        "decode": {"type": "object", "required": ["context_tokens", "llm_block_step_ms", "lm_head_step_ms"],
                   "properties": {"context_tokens": {"type": "integer", "minimum": 1},
                                  "llm_block_step_ms": {"type": "array", "items": _MS},
                                  "lm_head_step_ms": {"anyOf": [_MS, {"type": "null"}]}}},
    },
}
#: JSON schema of a profile file (draft 2020-12).
PROFILE_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "hybrid_vla_ros per-block timing profile",
    "type": "object",
    "required": ["format_version", "kind", "created_utc", "torch_version", "python_version", "host", "model",
                 "dtype", "prefix_state_shape", "handoff_bytes", "settings", "devices"],
    "properties": {
        "format_version": {"const": PROFILE_FORMAT_VERSION},
        "kind": {"const": PROFILE_KIND},
        "created_utc": {"type": "string"},
        "torch_version": {"type": "string"},
        "python_version": {"type": "string"},
        "platform": {"type": "string"},
        "host": {"type": "object", "required": ["cpu_model", "logical_cpus"]},
        "model": {"type": "object", "required": ["source", "preset", "path", "config"],
                  "properties": {"source": {"enum": ["preset", "checkpoint"]},
                                 "preset": {"type": ["string", "null"]}, "path": {"type": ["string", "null"]},
                                 "config": {"type": "object"}}},
        "dtype": {"enum": ["fp32", "fp16", "bf16"]},
        "prefix_state_shape": {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 2,
                               "maxItems": 3},
        "handoff_bytes": {"type": "integer", "minimum": 1},
        "settings": {"type": "object", "required": ["warmup", "repeats", "vision_blocks", "llm_blocks"],
                     "properties": {"warmup": {"type": "integer", "minimum": 0},
                                    "repeats": {"type": "integer", "minimum": 1},
                                    "vision_blocks": {"enum": ["all", "1"]}, "llm_blocks": {"enum": ["all", "1"]}}},
        "devices": {"type": "object", "required": ["cpu"],
                    "properties": {"cpu": _DEVICE, "cuda": _DEVICE}, "additionalProperties": False},
        "preprocess": {"type": "object", "required": ["ms"],
                       "properties": {"ms": _MS, "min_ms": _MS, "cameras": {"type": "integer", "minimum": 1},
                                      "source": {"type": "string"}}},
    },
}


# ------------------------------------------------------------------------------------ file format

def _non_finite(node, path: str = "") -> str | None:
    """JSON path of the first NaN or infinite number in a parsed document, else None."""
    if isinstance(node, float) and not math.isfinite(node):
        return path or "(top level)"
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in children:
        found = _non_finite(value, f"{path}/{key}" if path else str(key))
        if found:
            return found
    return None


def validate_profile(doc: object, source: str = "profile") -> dict:
    """Check a parsed profile against :data:`PROFILE_SCHEMA` and its internal consistency; returns ``doc``.

    Raises ValueError naming the first problem and its JSON path.
    """
    import jsonschema

    if isinstance(doc, dict) and "format_version" in doc and doc["format_version"] != PROFILE_FORMAT_VERSION:
        raise ValueError(f"{source}: format_version {doc['format_version']!r}; this code reads "
                         f"{PROFILE_FORMAT_VERSION} (re-run hybrid-vla profile)")
    validator = jsonschema.Draft202012Validator(PROFILE_SCHEMA)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise ValueError(f"{source}: {where}: {err.message}{more}")
    bad = _non_finite(doc)
    if bad:
        raise ValueError(f"{source}: {bad}: not a finite number (NaN or Infinity): re-run hybrid-vla profile")
    try:
        shape = profiled_shape(doc)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    if shape.prefix_state_shape is not None and list(shape.prefix_state_shape) != list(doc["prefix_state_shape"]):
        raise ValueError(f"{source}: prefix_state_shape {doc['prefix_state_shape']} does not match the config's "
                         f"{list(shape.prefix_state_shape)}")
    for name, dev in doc["devices"].items():
        if len(dev["llm_blocks_ms"]) != shape.num_layers:
            raise ValueError(f"{source}: devices/{name}/llm_blocks_ms: has {len(dev['llm_blocks_ms'])} entries, "
                             f"the model has {shape.num_layers} decoder blocks")
        nv = shape.vision_layers
        if nv is not None and len(dev["vision_blocks_ms"]) != nv:
            raise ValueError(f"{source}: devices/{name}/vision_blocks_ms: has {len(dev['vision_blocks_ms'])} "
                             f"entries, the vision encoder has {nv} blocks")
        if dev["kind"] != name:
            raise ValueError(f"{source}: devices/{name}/kind is {dev['kind']!r}")
    return doc


def load_profile(path: str | Path) -> dict:
    """Read and validate a profile JSON file; raises FileNotFoundError, ValueError (not JSON, or invalid)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path}: not JSON ({e})") from None
    return validate_profile(doc, f"profile {path}")


def write_profile(doc: dict, path: str | Path) -> Path:
    """Validate ``doc`` and write it as indented JSON to ``path``. Returns the path; raises ValueError / OSError."""
    validate_profile(doc, "profile to write")
    path = Path(path)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


# ------------------------------------------------------------------------------------ measurement

def measure_peak_cpu_bytes(fn):
    """Run ``fn()`` under ``torch.profiler`` with ``profile_memory=True``; return ``(result, peak bytes)``.

    The peak is the largest running sum of c10 CPU allocator events during ``fn``: storage allocated then and
    alive at the worst moment (returned tensors count, older ones do not). BLAS / oneDNN's own allocations are
    not seen.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return result, peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """(median ms, min ms) of ``fn()`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        _sync(device)
        samples = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter_ns()
            fn()
            _sync(device)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(samples), min(samples)


def _block_from_checkpoint(ck: Checkpoint, index: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Decoder block ``index`` of a checkpoint, read on its own."""
    return ck.load_blocks(index, index + 1, device=device, dtype=dtype)[0]


def block_step_ms(llm, family, block: nn.Module, index: int, context: int, device: torch.device,
                  dtype: torch.dtype, warmup: int, repeats: int) -> tuple[float, float]:
    """(median ms, min ms) of one decode step through decoder block ``index`` (``block``): one token against a KV
    cache holding ``context`` tokens (transformers' ``StaticCache`` of ``llm``, as a decode's; the attention reads
    its whole length), after a prefill of ``context`` random hidden states. ``llm``: the text config; ``family``:
    its :class:`~hybrid_vla_ros.model.text.TextFamily`."""
    from transformers.cache_utils import StaticCache

    kind = text.attention_kinds(llm)[index]
    with torch.device(device):
        rotary = text.make_rotary(family, llm)
    cache = StaticCache(config=llm, max_cache_len=context + 1 + warmup + repeats)
    first = {kind: index}
    x = torch.randn((1, context, llm.hidden_size), device=device, dtype=dtype)
    step = torch.randn((1, 1, llm.hidden_size), device=device, dtype=dtype)
    with torch.inference_mode():
        block(x, **text.block_inputs(llm, rotary, x, {kind}, cache=cache, first_layer=first).for_block(block, kind))
        inputs = text.block_inputs(llm, rotary, step, {kind}, cache=cache, first_layer=first).for_block(block, kind)
    # each call appends one token to the cache (room for all): the same attention length up to a few keys
    return _time_ms(lambda: block(step, **inputs), device, warmup, repeats)


def measure_handoff(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, warmup: int, repeats: int,
                    scales: tuple[float, ...] = (0.5, 1.0, 2.0), copier_factory=None) -> dict:
    """Hand-off time of hidden states of ``shape`` (token dim also scaled by ``scales``) from ``device``.

    ``ring``: acquire a slot -> copy as the prefix runner does (:class:`~hybrid_vla_ros.transport.pinned.SlotCopier`)
    -> publish -> the consumer holds the zero-copy view, both in this process (no cross-process wake-up).
    ``memcpy``: one ``copy_`` into a CPU tensor. Returns {"ring", "memcpy", "ring_path": the copier's mode}, entries
    as in the profile file. Raises RingError / OSError when /dev/shm is unusable.
    """
    from ..transport.pinned import SlotCopier
    from ..transport.ring import (
        RingConsumer,
        RingProducer,
        segment_name,
        slot_bytes_for,
    )

    tok_dim = len(shape) - 2
    shapes = []
    for s in scales:
        sh = list(shape)
        sh[tok_dim] = max(1, round(shape[tok_dim] * s))
        if tuple(sh) not in shapes:
            shapes.append(tuple(sh))
    biggest = max(shapes, key=lambda sh: torch.Size(sh).numel())
    name = segment_name(f"profile_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    out = {"ring": [], "memcpy": []}
    with RingProducer(name, 3, slot_bytes_for(biggest, dtype), model_id=0) as prod, RingConsumer(name) as cons:
        copier = (copier_factory or SlotCopier)(prod, device)
        out["ring_path"] = copier.mode
        try:
            _time_handoffs(prod, cons, copier, shapes, dtype, device, warmup, repeats, out)
        finally:
            copier.close()
    return out


def _time_handoffs(prod, cons, copier, shapes, dtype, device, warmup, repeats, out) -> None:
    """The timings of :func:`measure_handoff`, per shape, into ``out``."""
    for sh in shapes:
        src = torch.randn(sh, device=device).to(dtype)
        dst = torch.empty(sh, dtype=dtype)
        nbytes = src.numel() * src.element_size()

        def ring_once():
            slot = prod.acquire(sh, dtype)
            copier.copy(src, slot.tensor)
            prod.publish(slot, stamp_ns=0, split_layer=0)
            got = cons.read(5.0)
            if got is None:
                raise RuntimeError("ring hand-off timed out")
            got.release()

        ms, mn = _time_ms(ring_once, device, warmup, repeats)
        out["ring"].append({"bytes": nbytes, "ms": ms, "min_ms": mn})
        ms, mn = _time_ms(lambda: dst.copy_(src), device, warmup, repeats)
        out["memcpy"].append({"bytes": nbytes, "ms": ms, "min_ms": mn})


def _device_doc(device: torch.device, timing: dict, mins: dict, vis_ms, vis_min, n_vis, blk_ms, blk_min, n_llm,
                handoff, decode: dict | None = None) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        desc, extra = props.name, {"total_memory_bytes": int(props.total_memory)}
    else:
        desc, extra = cpu_model(), {}
    return {"kind": device.type, "name": str(device), "description": desc,
            "cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), **extra,
            "parts_ms": {k: timing[k] for k in PART_KEYS}, "vision_blocks_ms": vis_ms,
            "vision_blocks_measured": n_vis, "llm_blocks_ms": blk_ms, "llm_blocks_measured": n_llm,
            "min_ms": {**{k: mins[k] for k in PART_KEYS}, "vision_blocks": vis_min, "llm_blocks": blk_min},
            "handoff": handoff, **({"decode": decode} if decode is not None else {})}


def _decode_doc(context: int, step_ms: list[float], n_llm: int, L: int, head_ms: float | None) -> dict:
    """The device's ``decode`` entry (one measured block's time counted for all when only one was timed)."""
    return {"context_tokens": int(context), "llm_block_step_ms": step_ms * L if 0 < n_llm < L else step_ms,
            "lm_head_step_ms": head_ms}


def _lm_head_step_ms(ck: Checkpoint | None, sm, device, dtype, warmup: int, repeats: int) -> float | None:
    """The LM head on one final-norm row (ms), None for a model without one."""
    if ck is None or not sm.decodes:
        return None
    head = ck.load("lm_head", device=device, dtype=dtype)
    row = torch.randn((1, head.weight.shape[1]), device=device, dtype=dtype)
    return _time_ms(lambda: head(row), device, warmup, repeats)[0]


def _profile_device_generic(ck: Checkpoint, device: torch.device, dtype: torch.dtype, *, warmup: int, repeats: int,
                            llm_blocks: str, log, decode: bool = False) -> dict:
    """Per-block timing of a model without this package's SigLIP front: the prefix at K = 0 counts as
    ``vision_embeddings``, the suffix at K = L as ``head``, each block on its own."""
    from .verify import BagFrames

    timing, mins = {}, {}

    def timed(key, fn):
        timing[key], mins[key] = _time_ms(fn, device, warmup, repeats)
        log(f"  {device}: {key} {timing[key]:.3f} ms")

    sm, L = ck.split_model(), ck.num_layers
    front = ck.load("prefix", 0, device=device, dtype=dtype)
    inputs = sm.timing_inputs(BagFrames(), device, dtype)
    timed("vision_embeddings", lambda: sm.run_prefix(front, inputs))
    with torch.inference_mode():
        out = sm.run_prefix(front, inputs)
    for key in ("vision_post", "projector_embed", "rotary"):
        timing[key] = mins[key] = 0.0
    rotary, run_block = sm.block_driver(front, out, device)
    if rotary is not None:
        timed("rotary", rotary)
    blk_ms, blk_min, step_ms = [], [], []
    n_llm = L if llm_blocks == "all" else min(1, L)
    context = int(ck.model.prefix_state_shape[-2])
    for i in range(n_llm):
        block = _block_from_checkpoint(ck, i, device, dtype)
        ms, mn = _time_ms(lambda b=block, i=i: run_block(b, i), device, warmup, repeats)
        blk_ms.append(ms)
        blk_min.append(mn)
        if decode:
            step_ms.append(block_step_ms(sm.text_config(), llm_family(ck.model), block, i, context, device, dtype,
                                         warmup, repeats)[0])
        del block
        log(f"  {device}: block {i} {ms:.3f} ms" + (f", one decode step {step_ms[-1]:.3f} ms" if decode else ""))
    if 0 < n_llm < L:
        blk_ms, blk_min = blk_ms * L, blk_min * L
    tail = ck.load("suffix", L, device=device, dtype=dtype)
    timed("head", sm.profile_tail(tail, out))
    tail = front = None  # free them (rebound rather than deleted: the lambdas above name them)
    handoff = measure_handoff(tuple(ck.model.prefix_state_shape), dtype, device, warmup, max(repeats, 5))
    nv = sm.vision_layers()
    steps = (_decode_doc(context, step_ms, n_llm, L, _lm_head_step_ms(ck, sm, device, dtype, warmup, repeats))
             if decode else None)
    return _device_doc(device, timing, mins, [0.0] * nv, [0.0] * nv, nv, blk_ms, blk_min, n_llm, handoff, steps)


def _profile_device(cfg: VLAConfig, device: torch.device, dtype: torch.dtype, *, model_path: Checkpoint | None,
                    warmup: int, repeats: int, vision_blocks: str, llm_blocks: str, log, decode: bool = False) -> dict:
    timing = {}
    mins = {}

    def timed(key, fn):
        timing[key], mins[key] = _time_ms(fn, device, warmup, repeats)
        log(f"  {device}: {key} {timing[key]:.3f} ms")

    C, S = cfg.n_cameras, cfg.image_size
    pixels = torch.rand((C, 3, S, S), device=device, dtype=dtype)
    ego = torch.zeros(3, device=device) if cfg.ego_state_input else None
    scene = example_scene(cfg)
    # ---- vision side and projector/embeddings
    if model_path is not None:
        front = model_path.load("prefix", 0, device=device, dtype=dtype)
    else:
        with torch.device("meta"):
            front = PrefixStage(cfg, 0)
    Dv = int(cfg.vision["hidden_size"])
    feats = torch.randn((C, cfg.tokens_per_camera, Dv), device=device, dtype=dtype)
    parts = VisionParts.of(front.vision, pixels, feats, random=model_path is None)
    parts.prepare("stem")
    timed("vision_embeddings", parts.stem)
    groups = parts.groups
    measure = range(len(groups)) if vision_blocks == "all" else sorted({groups.index(g) for g in set(groups)})
    got = {}
    for i in measure:
        parts.prepare("block", i)
        got[i] = _time_ms(lambda: parts.block(i), device, warmup, repeats)
        parts.release(i)
        log(f"  {device}: vision block {i} ({groups[i]}) {got[i][0]:.3f} ms")
    per_block = [got.get(i, got[groups.index(groups[i])]) for i in range(len(groups))]
    vis_ms, vis_min, n_measure = [ms for ms, _ in per_block], [mn for _, mn in per_block], len(got)
    parts.prepare("post")
    timed("vision_post", parts.post)
    if model_path is None:
        free_(front.vision)
        for name, child in front.named_children():
            if name not in ("vision", "layers", "rotary_emb"):
                random_init_(child, device, dtype)
    parts = None
    front.vision = FixedVision(feats)
    timed("projector_embed", lambda: embed(front, pixels, ego, scene=scene))
    with torch.inference_mode():
        h = embed(front, pixels, ego, scene=scene)
    # free them (rebound rather than deleted: the lambdas above name them)
    front = None
    # ---- LLM blocks
    llm = llm_config(cfg)
    with torch.device(device):
        rotary = text.make_rotary(llm_family(cfg), llm)
    x = h if h.dim() == 3 else h.unsqueeze(0)
    kinds = text.attention_kinds(llm)
    family = llm_family(cfg)

    def rotary_once():  # position ids, masks and rotary tables, as run_blocks makes them once per forward (a
        # hybrid family: what its own forward hands each block, recorded)
        if family.captured:
            return text.captured_block_inputs(family, rotary, x).calls
        return text.block_inputs(llm, rotary, x, set(kinds))

    timed("rotary", rotary_once)
    with torch.inference_mode():
        block_in = rotary_once()

    def run_block(block, i):
        if family.captured:
            return block_in[i].run(block, x)
        return block(x, **block_in.for_block(block, kinds[i]))
    L = cfg.num_layers
    n_llm = L if llm_blocks == "all" else min(1, L)
    blk_ms, blk_min, step_ms = [], [], []
    for i in range(n_llm):
        if model_path is not None:
            block = _block_from_checkpoint(model_path, i, device, dtype)
        else:
            with torch.device("meta"):
                block = text.make_blocks(llm_family(cfg), llm, i, i + 1)[0]
            random_init_(block, device, dtype)
        ms, mn = _time_ms(lambda: run_block(block, i), device, warmup, repeats)
        blk_ms.append(ms)
        blk_min.append(mn)
        if decode:
            step_ms.append(block_step_ms(llm, llm_family(cfg), block, i, x.shape[-2], device, dtype, warmup,
                                         repeats)[0])
        free_(block)
        block = None  # rebound rather than deleted: the lambda above names it
        log(f"  {device}: LLM block {i} {ms:.3f} ms" + (f", one decode step {step_ms[-1]:.3f} ms" if decode else ""))
    if 0 < n_llm < L:
        blk_ms, blk_min = blk_ms * L, blk_min * L
    # ---- final norm + heads
    if model_path is not None:
        tail = model_path.load("suffix", L, device=device, dtype=dtype)
    else:
        with torch.device("meta"):
            tail = SuffixStage(cfg, L)
        for name, child in tail.named_children():
            if name not in ("layers", "rotary_emb"):
                random_init_(child, device, dtype)
    timed("head", lambda: plan(tail, h, DEFAULT_COMMAND))
    tail = None  # rebound rather than deleted: the lambda above names it
    # ---- hand-off from this device
    handoff = measure_handoff(tuple(cfg.prefix_state_shape), dtype, device, warmup, max(repeats, 5))
    log(f"  {device}: ring hand-off " + ", ".join(f"{m['bytes']} B {m['ms']:.3f} ms" for m in handoff["ring"]))
    steps = _decode_doc(x.shape[-2], step_ms, n_llm, L, None) if decode else None  # a planning head: no LM head
    return _device_doc(device, timing, mins, vis_ms, vis_min, n_measure, blk_ms, blk_min, n_llm, handoff, steps)


def measure_preprocess(cfg: VLAConfig, *, warmup: int = 1, repeats: int = 5, log=None) -> dict | None:
    """Camera preprocessing of one frame on the CPU, as the prefix node does it, on the embedded bag's 1936 x 1216
    JPEGs (cycling through its 6 cameras). Returns the profile's ``preprocess`` entry, None without the bag."""
    from ..util.bags import read_bag
    from ..util.paths import embedded_bag
    from ..vehicle.image import decode_compressed, preprocess

    try:
        from rosbags.typesys import Stores, get_typestore

        store = get_typestore(Stores.ROS2_KILTED)
        first = {}
        for m in read_bag(embedded_bag()):
            if m.topic.endswith("/compressed") and m.topic not in first:
                first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    except Exception as e:  # noqa: BLE001 - no bag (e.g. an install without data): no preprocessing figure
        if log:
            log(f"  camera preprocessing not measured: {type(e).__name__}: {e}")
        return None
    if not first:
        return None
    msgs = [first[t] for t in sorted(first)]
    cams = [msgs[i % len(msgs)] for i in range(cfg.n_cameras)]
    out = torch.empty((cfg.n_cameras, 3, cfg.image_size, cfg.image_size), dtype=torch.float32)

    def once() -> None:
        preprocess([decode_compressed(m.format, m.data) for m in cams], cfg.image_size, cfg.image_mean,
                   cfg.image_std, out=out, resize=cfg.image_resize)

    median, fastest = _time_ms(once, torch.device("cpu"), warmup, repeats)
    if log:
        log(f"  camera preprocessing: {median:.2f} ms ({cfg.n_cameras} JPEG cameras of the embedded bag)")
    return {"ms": median, "min_ms": fastest, "cameras": cfg.n_cameras,
            "source": f"{cfg.n_cameras} JPEG cameras (1936x1216) of the embedded DGP bag, decode + resize + normalise"}


def profile_model(*, preset_name: str | None = None, model_path: str | Path | None = None, dtype: str = "fp32",
                  cores: list[int] | None = None, threads: int | None = None, device: str = "auto",
                  repeats: int = 5, warmup: int = 1, vision_blocks: str = "all", llm_blocks: str = "all",
                  seed: int = 0, log=None, tokens: int = 512, cameras: int | None = None,
                  trust_model_code: bool | None = None, prompt: str | None = None,
                  camera_size: tuple[int, int] | None = None, decode: bool = False, cpu_precision: str = "auto",
                  **overrides) -> dict:
    """Measure a profile (the file format of the module docstring) and return it as a dict.

    Exactly one of ``preset_name`` (``overrides`` as :func:`hybrid_vla_ros.model.config.preset`) and
    ``model_path``. ``cores`` / ``threads``: pinning and torch threads while measuring (default: current;
    restored after). ``device``: "cpu", "cuda" (and CPU) or "auto"; the CPU is always measured (the suffix runs
    there). ``"1"`` for ``vision_blocks`` times one block per kind (EVA-02: one window, one global block).
    ``tokens`` / ``cameras`` / ``prompt`` / ``camera_size`` / ``trust_model_code``: as
    :func:`hybrid_vla_ros.model.checkpoint.open_checkpoint`. ``decode``: also time one decode step per block (and
    the LM head) against a KV cache of the frame's tokens. ``cpu_precision``: the CPU is timed in the dtype a suffix
    node with this ``inference_precision`` computes in (:func:`~hybrid_vla_ros.util.precision.inference_precision`:
    fp32 for bf16 / fp16 on a CPU without native units, with ``auto``). Raises ValueError for bad arguments (including
    cores this process may not use), RuntimeError when CUDA is requested but unavailable.
    """
    if (preset_name is None) == (model_path is None):
        raise ValueError("give exactly one of a preset name and a checkpoint path")
    if vision_blocks not in ("all", "1") or llm_blocks not in ("all", "1"):
        raise ValueError("vision_blocks / llm_blocks must be 'all' or '1'")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    if threads is not None and threads < 1:
        raise ValueError("threads must be >= 1")
    if device not in ("cpu", "cuda", "auto"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    tdtype = parse_dtype(dtype)
    cpu_dtype = inference_precision(tdtype, cpu_precision).dtype
    ck = None
    if model_path is not None:
        model_path = Path(model_path)
        ck = open_checkpoint(model_path, tokens=tokens, cameras=cameras, trust_model_code=trust_model_code,
                             prompt=prompt, camera_size=camera_size)
        cfg = ck.model
    else:
        cfg = preset(preset_name, **overrides)
    sm = ck.split_model() if ck is not None else split_model(cfg)
    detailed = sm.profile_detailed
    cuda_ok = torch.cuda.is_available()
    if device == "cuda" and not cuda_ok:
        raise RuntimeError("--device cuda: CUDA is not available on this machine")
    log = log or (lambda line: None)
    old_cores, old_threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    devices = {}
    try:
        if cores is not None:
            pin_process(list(cores))
        if threads is not None:
            torch.set_num_threads(threads)
        def run(dev: torch.device) -> dict:
            ddtype = cpu_dtype if dev.type == "cpu" else tdtype
            if detailed:
                doc = _profile_device(cfg, dev, ddtype, model_path=ck, warmup=warmup, repeats=repeats,
                                      vision_blocks=vision_blocks, llm_blocks=llm_blocks, log=log, decode=decode)
            else:
                doc = _profile_device_generic(ck, dev, ddtype, warmup=warmup, repeats=repeats, llm_blocks=llm_blocks,
                                              log=log, decode=decode)
            return {**doc, "dtype": DTYPE_NAMES[ddtype]}

        use_cuda = device in ("cuda", "auto") and cuda_ok
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if use_cuda else []):
            torch.manual_seed(seed)  # random weights and inputs; the caller's RNG state is restored
            if use_cuda:
                devices["cuda"] = run(torch.device("cuda", torch.cuda.current_device()))
            devices["cpu"] = run(torch.device("cpu"))
        pre_cfg = sm.preprocess_config
        preprocess_doc = measure_preprocess(pre_cfg, warmup=warmup, repeats=repeats, log=log) if pre_cfg else None
    finally:
        torch.set_num_threads(old_threads)
        if cores is not None:
            pin_process(old_cores)
    return {
        "format_version": PROFILE_FORMAT_VERSION, "kind": PROFILE_KIND,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__, "python_version": sys.version.split()[0], "platform": platform.platform(),
        "host": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count() or 1},
        "model": {"source": "checkpoint" if model_path is not None else "preset", "preset": cfg.preset or None,
                  "path": str(model_path) if model_path is not None else None, "config": cfg.to_dict()},
        "num_layers": cfg.num_layers,
        "dtype": DTYPE_NAMES[tdtype], "prefix_state_shape": list(cfg.prefix_state_shape),
        "handoff_bytes": torch.Size(cfg.prefix_state_shape).numel() * torch.empty((), dtype=tdtype).element_size(),
        "settings": {"warmup": warmup, "repeats": repeats, "vision_blocks": vision_blocks, "llm_blocks": llm_blocks},
        "devices": devices,
        **({"preprocess": preprocess_doc} if preprocess_doc else {}),
    }
