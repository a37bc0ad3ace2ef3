"""Run code written for float32 in float64, to see its algorithm without float32's rounding (test helper).

Both this package's query heads and the published MindDrive code ask for float32 in places (``.float()``,
``.to(torch.float32)``, factories with ``dtype=torch.float32``; the heads also keep their parameters float32 on a
dtype conversion). Inside :func:`float64_everywhere` each of those gives float64 instead, and :func:`as_float64` casts
a module's floating parameters and buffers to float64. Nothing of the arithmetic is replaced: the same operations run
with 53 significant bits, so two implementations of one algorithm agree to ~1e-12 where float32 leaves them ~1e-3
apart on an ill-conditioned step (test_query_heads: the second decoder layer's self-attention over the memory).
"""
from __future__ import annotations

import contextlib

import torch

_FACTORIES = ("arange", "empty", "eye", "full", "full_like", "linspace", "ones", "ones_like", "tensor", "zeros",
              "zeros_like")


def _lifted(dtype):
    return torch.float64 if dtype is torch.float32 else dtype


@contextlib.contextmanager
def float64_everywhere():
    """Within: float32 asked for anywhere is float64 (module docstring); the default dtype is float64."""
    tensor, saved = torch.Tensor, {}
    to = tensor.to

    def lifted_to(self, *args, **kwargs):
        args = tuple(_lifted(a) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _lifted(kwargs["dtype"])
        return to(self, *args, **kwargs)

    def factory(original):
        def made(*args, **kwargs):
            if "dtype" in kwargs:
                kwargs["dtype"] = _lifted(kwargs["dtype"])
            return original(*args, **kwargs)
        return made

    saved_float, saved_default = tensor.float, torch.get_default_dtype()
    tensor.to, tensor.float = lifted_to, lambda self, *a, **k: to(self, torch.float64)
    for name in _FACTORIES:
        saved[name] = getattr(torch, name)
        setattr(torch, name, factory(saved[name]))
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        tensor.to, tensor.float = to, saved_float
        for name, original in saved.items():
            setattr(torch, name, original)
        torch.set_default_dtype(saved_default)


def as_float64(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every floating parameter and buffer cast to float64 in place (past a module's own
    ``_apply``, which the query heads use to stay float32)."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_floating_point():
                p.data = p.data.double()
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.double()
    return module
