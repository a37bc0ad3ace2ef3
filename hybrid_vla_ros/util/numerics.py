"""Run-to-run reproducible CPU arithmetic: oneMKL's conditional numerical reproducibility (CNR).

torch's CPU build calls oneMKL for float32 GEMMs and vector math (``sin``, ``cos``, ``exp``). Outside CNR mode
oneMKL may pick cache sizes, schedule threads and order reductions at run time, so two identical runs can differ
in the last bits (or more, through a model's largest activations). ``MKL_CBWR=AUTO`` keeps oneMKL's choice of
instruction set and fixes the rest ("fixed cache sizes, deterministic reductions, and static scheduling": oneMKL
Developer Guide, "Specifying Code Branches"). The package sets it, where unset, at its import (:mod:`hybrid_vla_ros`),
so every process of the package runs in CNR mode; on an Intel Xeon with AMX it was faster, not slower
(docs/models.md, "Exactness on every host").

oneMKL's vector math (VML) also needs one call on a single thread before any call spread over threads:
:func:`warm_vector_math`, run when :mod:`hybrid_vla_ros.model.contract` is imported.
"""
from __future__ import annotations

import os

#: oneMKL's CNR branch the package asks for when ``MKL_CBWR`` is unset: the CPU's own instruction set, in CNR mode.
MKL_CBWR_DEFAULT = "AUTO"
#: oneMKL's named constants for ``mkl_cbwr_get(MKL_CBWR_BRANCH)`` (mkl_service.h), the ones a report names.
_BRANCHES = {1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
             10: "AVX2", 12: "AVX512", 14: "AVX512_E1"}


def request_reproducible_mkl() -> None:
    """Set ``MKL_CBWR`` to :data:`MKL_CBWR_DEFAULT` and ``MKL_DYNAMIC`` to FALSE (CNR needs a fixed thread count)
    where unset. Effective only before oneMKL's first call in this process; child processes inherit it."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR_DEFAULT)
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")


#: The float ops torch's CPU build hands to oneMKL's vector math (``at::vml``, aten/src/ATen/cpu/vml.h).
VML_OPS = ("sin", "cos", "tan", "asin", "acos", "atan", "exp", "expm1", "log", "log10", "log1p", "log2", "sqrt",
           "tanh", "erf", "erfc", "trunc")


_warmed = False


def warm_vector_math() -> None:
    """Once per process: call each of :data:`VML_OPS` once, in float32 and float64, on 8 elements (under torch's
    2048-element grain, so on this thread alone). Imports torch.

    Why: torch splits a float ``cos`` of more than 2048 elements over its threads, and each thread calls oneMKL's
    ``vmsCos`` on its part. When oneMKL's first vector-math call in a process comes from two threads at once, the
    second thread's part was sometimes computed about 13 bits exact instead of to the last bit (Intel Xeon with AMX,
    2 threads: a (360, 2, 4) ``cos``, elements 1440-2879 off by up to 1.5e-4 relative, in 5 of 80 fresh processes;
    the second call always exact). Qwen2.5-VL's vision rotary table is such a call, so the first frame of a process
    differed from every later one. After one call on one thread, 0 of 160 processes differed, whichever op was
    warmed, so the choice is made once per process; calling every op is cheap insurance (about 2 ms)."""
    global _warmed
    if _warmed:
        return
    import torch

    _warmed = True
    for dtype in (torch.float32, torch.float64):
        x = torch.full((8,), 0.5, dtype=dtype)
        for op in VML_OPS:
            getattr(torch, op)(x)


def mkl_reproducibility() -> str | None:
    """oneMKL's CNR branch in this process ("AUTO", "AVX512", ..., "off"), from torch's oneMKL
    (``mkl_serv_cbwr_get``); None when torch has no oneMKL or does not export it. Imports torch."""
    import ctypes

    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        get = ctypes.CDLL(lib).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    branch = get(1)  # MKL_CBWR_BRANCH
    return _BRANCHES.get(branch, f"branch {branch}")
