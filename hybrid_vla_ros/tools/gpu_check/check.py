"""One run of the GPU check (:class:`Check`): the options, the sizes, the cores and dtypes of the two stages,
the global time budget, and the loop over the sections (each in its own module, each in its own try/except)."""
from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

from . import camera_decode, handoff, live_resplit, memory_plan, memory_pressure, numerics, paper_table
from .common import SECTIONS, TITLES, core_split, runs, sizes_for, torch_device
from .inputs import ensure_checkpoint
from .report import machine_info


class Check:
    """One run of the check: options, sizes, the report being built and the global time budget.

    ``args``: :func:`~hybrid_vla_ros.tools.gpu_check.build_parser`'s options (``--out`` is created here;
    ValueError for a ``--device`` this machine lacks). The prefix runs in bf16 where the device can, else fp32;
    the suffix (CPU) in bf16 where the prefix does and the CPU can, else fp32. Section ``name`` is
    ``section_<name>()``: a dict of its figures (JSON-ready), with its ``status``.
    """

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.device = torch_device(args.device)
        self.cuda = self.device.type == "cuda"
        self.sizes = sizes_for(args.small, self.cuda)
        self.cache = Path(args.cache) if args.cache else self.out / "models"
        self.t0 = time.monotonic()
        cores = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else list(range(os.cpu_count() or 1)))
        self.prefix_cores, self.suffix_cores = core_split(cores)
        self.prefix_dtype = "bf16" if runs(self.device, "bf16") else "fp32"
        self.suffix_dtype = "bf16" if runs("cpu", "bf16") else "fp32"
        # a bf16 prefix with an fp32 suffix is fine (bf16 -> fp32 is an exact ring conversion); not the reverse
        if self.prefix_dtype == "fp32" and self.suffix_dtype == "bf16":
            self.suffix_dtype = "fp32"
        self.report = {"machine": machine_info(self.device), "options": {
            "device": str(self.device), "small": bool(args.small), "budget_s": args.budget_s,
            "prefix_cores": self.prefix_cores, "suffix_cores": self.suffix_cores,
            "prefix_dtype": self.prefix_dtype, "suffix_dtype": self.suffix_dtype}, "sections": {}}
        self.plots: list[str] = []
        self.notes: list[str] = []

    def left_s(self) -> float:
        """Seconds left of ``--budget-s`` (negative once spent)."""
        return self.args.budget_s - (time.monotonic() - self.t0)

    def log(self, text: str) -> None:
        """A progress line on stdout."""
        print(text, flush=True)

    def checkpoint(self, name: str, overrides: dict, dtype: str = "fp16") -> Path:
        """The cached random-init checkpoint of preset ``name`` (:func:`~.inputs.ensure_checkpoint`)."""
        return ensure_checkpoint(self.cache, name, overrides, dtype, log=self.log)

    def run(self) -> dict:
        """Run the sections asked for (``--sections``, default all) in order while the budget lasts; returns the
        report (machine, options, sections by name, total_s, plots, notes). A failing section is reported with
        its error and traceback and the next one runs."""
        wanted = [s for s in SECTIONS if not self.args.sections or s in self.args.sections]
        for name in SECTIONS:
            if name not in wanted:
                self.report["sections"][name] = {"status": "not requested"}
                continue
            if self.left_s() <= 0:
                self.report["sections"][name] = {"status": "skipped",
                                                 "reason": f"the {self.args.budget_s:.0f} s budget was spent"}
                self.log(f"[{name}] skipped: time budget spent")
                continue
            self.log(f"[{name}] {TITLES[name]} ...")
            t = time.monotonic()
            try:
                data = getattr(self, f"section_{name}")()
                data.setdefault("status", "ok")
            except Exception as e:  # noqa: BLE001 - one failing section must not stop the others
                data = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                self.log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            data["seconds"] = round(time.monotonic() - t, 2)
            self.report["sections"][name] = data
            self.log(f"[{name}] {data['status']} in {data['seconds']:.1f} s")
        self.report["total_s"] = round(time.monotonic() - self.t0, 2)
        self.report["plots"] = self.plots
        self.report["notes"] = self.notes
        return self.report

    # the sections, in SECTIONS' order (each module's docstring says what it measures)
    def section_memory_plan(self) -> dict:
        return memory_plan.run(self)

    def section_paper_table(self) -> dict:
        return paper_table.run(self)

    def section_live_resplit(self) -> dict:
        return live_resplit.run(self)

    def section_memory_pressure(self) -> dict:
        return memory_pressure.run(self)

    def section_handoff(self) -> dict:
        return handoff.run(self)

    def section_camera_decode(self) -> dict:
        return camera_decode.run(self)

    def section_numerics(self) -> dict:
        return numerics.run(self)
