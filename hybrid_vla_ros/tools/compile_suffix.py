"""``hybrid-vla compile-suffix``: build the compiled suffix (``suffix_backend: openvino``) of a checkpoint for a range
of split layers into the cache the suffix node reads, before the node runs.

A node computes a K it has no compiled model for eagerly while it builds that K in the background; with
``split_layer: auto`` K moves with the load, so on a car the builds would come exactly when the CPU is busy.
Building the K range beforehand (on the car's computer: the artifact is compiled for its CPU) leaves the node
only compiling the saved model (about a second for ``smol``) instead of converting it. The builds go through the
node's own :class:`~hybrid_vla_ros.runtime.suffix_backend.SuffixBackend`, so the checks, the cache key and the
folder are the node's (the same checkpoint, dtype and cache folder give the same artifact).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SuffixBuild:
    """One split layer of :func:`compile_suffix`: ``k``; ``cached`` (the artifact was there already) or built in
    ``seconds`` (s, conversion and compile, or the compile of a cached one); ``folder`` (the artifact); ``error``
    ('' when it is ready; else why the node would compute this K eagerly)."""

    k: int
    cached: bool
    seconds: float
    folder: str
    error: str


def compile_suffix(model_path: str, split_layers: list[int], dtype: str = "fp32", cache_dir: str | None = None,
                   threads: int = 0, log=None, inference_precision: str = "auto") -> list[SuffixBuild]:
    """Build (or find) the compiled suffix of ``model_path`` for each K of ``split_layers`` in ``cache_dir`` (None:
    the node's default, ``$HYBRID_VLA_CACHE`` or ``~/.cache/hybrid_vla_ros``), in the stage ``dtype`` ("fp32",
    "bf16", "fp16": the suffix node's ``dtype``) as the node computes it with ``inference_precision`` (its
    parameter: with ``auto`` a bf16 / fp16 stage is built in fp32 on a CPU without native units, as the node
    loads it, so the node finds the artifact). ``threads``: the CPU plugin's threads for the compile (0: its
    default; the artifact does not depend on it). ``log(level, message)``: the backend's lines (default: none).

    Returns one :class:`SuffixBuild` per K, in ascending K. Raises ValueError for a K outside [0, L) (K = L has
    no blocks to compile) or a model whose suffix cannot be compiled at all (own model code, side tensors,
    openvino missing: the reason the node would log), and what loading the checkpoint raises."""
    import torch

    from ..model.checkpoint import load_stage, model_id, parse_dtype
    from ..model.config import VLAConfig
    from ..runtime.suffix_backend import SuffixBackend
    from ..util.precision import inference_precision as precision_of

    ks = sorted(set(int(k) for k in split_layers))
    n = VLAConfig.load(model_path).num_layers
    bad = [k for k in ks if not 0 <= k < n]
    if not ks or bad:
        raise ValueError(f"split layers must be in [0, {n}) for this model (K = {n} leaves no blocks to compile), "
                         f"got {bad or 'none'}")
    if threads > 0:
        torch.set_num_threads(threads)
    computed = precision_of(parse_dtype(dtype), inference_precision).dtype
    stage = load_stage(model_path, "suffix", ks[0], device="cpu", dtype=computed)
    backend = SuffixBackend("openvino", stage, model_id=model_id(model_path), cache_dir=cache_dir,
                            threads=threads, log=log or (lambda level, message: None), background=False,
                            temporary_fallback=False)
    try:
        if not backend.active:
            raise ValueError(f"this model's suffix cannot be compiled: {backend.error}")
        out = []
        for k in ks:
            before = len(backend.builds)
            backend.prepare(stage, k)
            if len(backend.builds) > before:
                b = backend.builds[-1]
                out.append(SuffixBuild(k, b.cache_hit, b.seconds, b.folder, ""))
            else:
                out.append(SuffixBuild(k, False, 0.0, "", backend.failed.get(k, "not built")))
        return out
    finally:
        backend.close()
