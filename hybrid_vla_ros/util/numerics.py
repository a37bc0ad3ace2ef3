"""Run-to-run reproducible CPU arithmetic: oneMKL's conditional numerical reproducibility (CNR).

torch's CPU build calls oneMKL for float32 GEMMs and for vector math (``sin``, ``cos``, ``exp``: the rotary
tables). Outside CNR mode oneMKL may pick cache sizes at run time, schedule threads dynamically and reduce in a
run-dependent order, so two processes on the same machine, inputs and thread count can differ in the last bits
(or more, through a model's largest activations), and a bit-for-bit check that passed once fails the next time.
``MKL_CBWR=AUTO`` keeps oneMKL's own choice of instruction set for the CPU and fixes the rest ("fixed cache sizes,
deterministic reductions, and static scheduling": oneMKL Developer Guide, "Specifying Code Branches").

The package sets ``MKL_CBWR=AUTO`` when the variable is unset, at its import (:mod:`hybrid_vla_ros`), before
oneMKL's first call reads it: every process of the package (nodes, ``hybrid-vla``, tests) runs in CNR mode. A value
the user set is kept. Its cost was measured before taking it: on an Intel Xeon with AMX (2026-12-06) CNR was faster,
not slower (docs/models.md, "Exactness on every host").
"""
from __future__ import annotations

import os

#: oneMKL's CNR branch the package asks for when ``MKL_CBWR`` is unset: the CPU's own instruction set, in CNR mode.
MKL_CBWR_DEFAULT = "AUTO"
#: oneMKL's named constants for ``mkl_cbwr_get(MKL_CBWR_BRANCH)`` (mkl_service.h), the ones a report names.
_BRANCHES = {1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
             10: "AVX2", 12: "AVX512", 14: "AVX512_E1"}


def request_reproducible_mkl() -> None:
    """Set ``MKL_CBWR`` to :data:`MKL_CBWR_DEFAULT` and ``MKL_DYNAMIC`` to FALSE where unset (module docstring;
    CNR also needs a fixed thread count, and oneMKL's dynamic mode may use fewer threads on a busy machine). It
    takes effect when oneMKL has not run yet in this process; child processes inherit it."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR_DEFAULT)
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")


def mkl_reproducibility() -> str | None:
    """oneMKL's CNR branch in this process as a name ("AUTO", "AVX512", ..., "off" when CNR is off), read from the
    oneMKL that torch carries (its service function ``mkl_serv_cbwr_get``); None when torch has no oneMKL or the
    function is not exported. Imports torch."""
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
