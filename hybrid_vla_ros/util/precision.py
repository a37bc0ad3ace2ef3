"""The CPU's arithmetic units and the precision a CPU stage computes in (``inference_precision``).

A bfloat16 or float16 model computed on a CPU without native units for that type runs an emulation: on an AMD EPYC
host with AVX2 only (2026-12-07, torch 2.13 / oneDNN), a bf16 ``linear`` of 81 x 576 x 1536 ran at 8.2 GFLOP/s
against 55.3 in fp32 (6.7x slower), and a 4-block SmolLM2 suffix at 8.1 GFLOP/s against 46.7. OpenVINO's CPU plugin
decides this per host with its ``INFERENCE_PRECISION_HINT``: bf16 only where the CPU has native bf16 arithmetic
(AVX512_BF16 or AMX), f32 otherwise (its docs, "Precision Control"). :func:`inference_precision` applies the same
rule to the eager suffix, so one checkpoint and one launch file are fast on either host:

============ =============================================== ==================================================
asked        computed in, where the CPU has                   else
============ =============================================== ==================================================
fp32         fp32                                             -
bf16         bf16: x86 ``amx_bf16`` or ``avx512_bf16``; Arm   fp32 (weights widened once at load: 2x their
             ``bf16`` (FEAT_BF16)                             memory; a bf16 ring converts exactly)
fp16         fp16: x86 ``avx512_fp16`` or ``amx_fp16``; Arm   fp32 (as above; fp16 -> fp32 is exact too)
             ``asimdhp``
============ =============================================== ==================================================

Widening is never less accurate: every bf16 / fp16 weight and hidden state is a float32 number, and the blocks then
round once per float32 operation instead of once per bf16 one. No ROS.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

#: Values of the suffix's ``inference_precision``: ``auto`` (the table of the module docstring) or ``dtype``
#: (always the configured ``dtype``, emulated or not).
PRECISION_MODES = ("auto", "dtype")

#: The flags that give native arithmetic per reduced type: x86 ``flags`` and Arm ``Features`` of /proc/cpuinfo.
NATIVE_FLAGS = {"x86": {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")},
                "arm": {torch.bfloat16: ("bf16",), torch.float16: ("asimdhp",)}}

#: The vector / matrix flags a report lists (the widest first).
REPORTED_FLAGS = ("amx_bf16", "amx_fp16", "amx_int8", "amx_tile", "avx512_fp16", "avx512_bf16", "avx512_vnni",
                  "avx512f", "avx_vnni", "avx2", "fma", "bf16", "asimdhp", "sve", "asimd")

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class CpuFeatures:
    """What a CPU offers for matrix arithmetic, from /proc/cpuinfo.

    ``model``: its model name ("" when not listed); ``arch``: ``"x86"`` (a ``flags`` line), ``"arm"`` (a
    ``Features`` line) or ``platform.machine()``; ``flags``: that line's words (empty where the file cannot be
    read)."""

    model: str
    arch: str
    flags: frozenset[str]

    @classmethod
    def read(cls, cpuinfo: str | Path = "/proc/cpuinfo") -> "CpuFeatures":
        """The features of this host's CPU (of the first processor listed in ``cpuinfo``)."""
        model, flags, arch = "", frozenset(), platform.machine()
        try:
            for line in Path(cpuinfo).read_text(errors="replace").splitlines():
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags, arch = frozenset(value.split()), "x86" if key == "flags" else "arm"
        except OSError:
            pass
        return cls(model, arch, flags)

    @property
    def isa_level(self) -> str:
        """The host class by its widest matrix / vector unit: ``AMX`` (amx_bf16), ``AVX-512`` (avx512f), ``AVX2``,
        ``NEON`` (Arm asimd) or ``baseline``."""
        for flag, level in (("amx_bf16", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")):
            if flag in self.flags:
                return level
        return "baseline"

    @property
    def reported_flags(self) -> list[str]:
        """The flags of :data:`REPORTED_FLAGS` this CPU has, widest first."""
        return [f for f in REPORTED_FLAGS if f in self.flags]

    def native_flag(self, dtype: torch.dtype) -> str | None:
        """The flag that gives this CPU native arithmetic in ``dtype`` (``"fp32"`` for float32), or None."""
        if dtype == torch.float32:
            return "fp32"
        return next((f for f in self.wanted_flags(dtype) if f in self.flags), None)

    def wanted_flags(self, dtype: torch.dtype) -> tuple[str, ...]:
        """The flags that would give this CPU's architecture native ``dtype`` arithmetic (both x86's and Arm's
        where the architecture is unknown)."""
        table = NATIVE_FLAGS.get(self.arch)
        if table is None:
            return tuple(f for t in NATIVE_FLAGS.values() for f in t.get(dtype, ()))
        return table.get(dtype, ())


@dataclass(frozen=True)
class InferencePrecision:
    """The dtype a CPU stage computes in, and why.

    ``requested``: the configured ``dtype``; ``dtype``: what the weights are loaded in and the blocks compute in
    (the ring's hidden states are converted to it on arrival); ``reason``: one line for the log and /diagnostics;
    ``emulated``: ``dtype`` is a reduced type this CPU has no native units for (kept by ``inference_precision:
    dtype``), worth a warning."""

    requested: torch.dtype
    dtype: torch.dtype
    reason: str
    emulated: bool = False

    @property
    def widened(self) -> bool:
        """True when the stage computes in fp32 although a reduced type was asked for."""
        return self.dtype != self.requested

    @property
    def name(self) -> str:
        """``fp32``, ``bf16`` or ``fp16``: the dtype computed in."""
        return _NAMES[self.dtype]


def inference_precision(dtype: torch.dtype, mode: str = "auto", cpu: CpuFeatures | None = None) -> InferencePrecision:
    """The precision a CPU stage configured with ``dtype`` computes in (the module docstring's table).

    ``mode``: ``auto`` or ``dtype`` (:data:`PRECISION_MODES`); ``cpu``: the host's features (read when None).
    Raises ValueError for another mode or a dtype other than float32 / bfloat16 / float16."""
    if mode not in PRECISION_MODES:
        raise ValueError(f"inference_precision must be one of {', '.join(PRECISION_MODES)}, got {mode!r}")
    if dtype not in _NAMES:
        raise ValueError(f"a CPU stage computes in float32, bfloat16 or float16, got {dtype}")
    asked = _NAMES[dtype]
    if dtype == torch.float32:
        return InferencePrecision(dtype, dtype, "fp32 asked: computed in fp32")
    cpu = CpuFeatures.read() if cpu is None else cpu
    flag = cpu.native_flag(dtype)
    if flag is not None:
        return InferencePrecision(dtype, dtype, f"{asked} asked: computed in {asked} (this CPU has {flag})")
    wanted = " / ".join(cpu.wanted_flags(dtype))
    if mode == "dtype":
        return InferencePrecision(dtype, dtype, f"{asked} asked, inference_precision 'dtype': computed in {asked}, "
                                                f"emulated on this CPU ({cpu.isa_level}: no {wanted}), several "
                                                f"times slower than fp32 ('auto' computes in fp32)", emulated=True)
    return InferencePrecision(dtype, torch.float32,
                              f"{asked} asked: computed in fp32, as this CPU ({cpu.isa_level}) has no native {asked} "
                              f"arithmetic ({wanted}) and emulating it is several times slower; weights take 2x "
                              f"their {asked} memory (inference_precision 'dtype' keeps {asked})")
