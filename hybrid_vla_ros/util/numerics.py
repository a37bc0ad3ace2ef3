"""Run-to-run reproducible CPU arithmetic: oneMKL's conditional numerical reproducibility (CNR).

torch's CPU build calls oneMKL for float32 GEMMs and vector math (``sin``, ``cos``, ``exp``). Outside CNR mode
oneMKL may pick cache sizes, schedule threads and order reductions at run time, so two identical runs can differ
in the last bits (or more, through a model's largest activations). ``MKL_CBWR=AUTO`` keeps oneMKL's choice of
instruction set and fixes the rest ("fixed cache sizes, deterministic reductions, and static scheduling": oneMKL
Developer Guide, "Specifying Code Branches"). The package sets it, where unset, at its import (:mod:`hybrid_vla_ros`),
so every process of the package runs in CNR mode; on an Intel Xeon with AMX it was faster, not slower
(docs/models.md, "Exactness on every host").
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
