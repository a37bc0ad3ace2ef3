"""One run of the GPU check (:class:`Check`): the options, the sizes, the cores and dtypes of the two stages,
the global time budget, and the loop over the sections (each in its own module, each in its own try/except)."""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from . import (camera_decode, decode, handoff, live_resplit, memory_plan, memory_pressure, numerics, paper_table,
               vehicle)
from .common import (SECTION_SHARES, SECTIONS, TITLES, core_split, numerics_overrides, runs, sizes_for,
                     torch_device)
from .inputs import ensure_checkpoint, prepare_checkpoints, spec_key
from .report import machine_info, write_report


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
        self._prep = self._prep_conn = None  # the checkpoint-writing process (prepare) and its reports
        self._prep_index: dict = {}
        self._prep_done: set[int] = set()
        self._prep_eof = False
        self._section_end: float | None = None  # monotonic end of the running section's limit

    def left_s(self) -> float:
        """Seconds left of ``--budget-s`` (negative once spent); while a section runs, at most what is left of that
        section's own limit (:meth:`section_limit_s`), which every section's waits and child processes use."""
        left = self.args.budget_s - (time.monotonic() - self.t0)
        if self._section_end is not None:
            left = min(left, self._section_end - time.monotonic())
        return left

    def section_limit_s(self, name: str, still_to_run: list[str]) -> float:
        """Time limit of section ``name`` (s): what is left of the budget times its part (:data:`SECTION_SHARES`)
        over the parts of ``still_to_run`` (``name`` and the wanted sections after it)."""
        left = self.args.budget_s - (time.monotonic() - self.t0)
        return max(0.0, left) * SECTION_SHARES[name] / sum(SECTION_SHARES[s] for s in still_to_run)

    def log(self, text: str) -> None:
        """A progress line on stdout."""
        print(text, flush=True)

    def checkpoint(self, name: str, overrides: dict, dtype: str = "fp16") -> Path:
        """The cached random-init checkpoint of preset ``name`` (:func:`~.inputs.ensure_checkpoint`). One that
        :meth:`prepare` is writing is waited for (until the budget is spent), not written a second time."""
        spec = spec_key(name, overrides, dtype)
        if self._prep is not None and spec in self._prep_index:
            i = self._prep_index[spec]
            while i not in self._prep_done and self._prep_alive() and self.left_s() > 0:
                self._prep_poll(1.0)
        return ensure_checkpoint(self.cache, name, overrides, dtype, log=self.log)

    def prepared(self, name: str, overrides: dict, dtype: str = "fp16") -> bool:
        """Whether :meth:`prepare` has written that checkpoint (so reading it costs no write)."""
        if self._prep is not None:
            self._prep_poll(0)
        i = self._prep_index.get(spec_key(name, overrides, dtype))
        return i is not None and self.report["checkpoints"][i].get("status") == "written"

    def wanted_checkpoints(self, wanted: list[str]) -> list:
        """(preset name, overrides, dtype) of the checkpoints the ``wanted`` sections read, in the order they read
        them, without repeats (memory_plan needs none: it makes its stages on the device)."""
        z = self.sizes
        specs = []
        if "paper_table" in wanted or "vehicle" in wanted:
            specs += [(n, z.overrides.get(n, {}), "fp16") for n in z.pipeline_presets]
        if "live_resplit" in wanted or "memory_pressure" in wanted:
            specs.append((z.resplit_preset, z.overrides.get(z.resplit_preset, {}), "fp16"))
        if "numerics" in wanted:
            specs.append((z.numerics_preset, numerics_overrides(z), "fp32"))
        out, seen = [], set()
        for name, overrides, dtype in specs:
            key = spec_key(name, overrides, dtype)
            if key not in seen:
                seen.add(key)
                out.append((name, overrides, dtype))
        return out

    def prepare(self, wanted: list[str]) -> None:
        """Start writing the checkpoints the ``wanted`` sections need (:meth:`wanted_checkpoints`) in a child
        process (:func:`~.inputs.prepare_checkpoints`), so they are ready when those sections start; what it did
        goes into the report's ``checkpoints``. Nothing to write: no process."""
        import multiprocessing as mp

        specs = self.wanted_checkpoints(wanted)
        self.report["checkpoints"] = [{"preset": n, "dtype": d, "status": "pending"} for n, _, d in specs]
        if not specs:
            return
        ctx = mp.get_context("spawn")
        self._prep_conn, child = ctx.Pipe(duplex=False)
        self._prep_index = {spec_key(n, o, d): i for i, (n, o, d) in enumerate(specs)}
        self._prep = ctx.Process(target=prepare_checkpoints, args=(str(self.cache), specs, child), daemon=True)
        self._prep.start()
        child.close()

    def _prep_alive(self) -> bool:
        """Whether the preparation process may still report (running, or reports unread; not after its end)."""
        if self._prep is None or self._prep_eof:
            return False
        return self._prep.is_alive() or self._prep_conn.poll()

    def _prep_poll(self, timeout_s: float) -> None:
        """Take the preparation process's reports that arrive within ``timeout_s``."""
        try:
            while self._prep_conn.poll(timeout_s):
                r = self._prep_conn.recv()
                self._prep_done.add(r.index)
                self.report["checkpoints"][r.index].update(status="failed" if r.error else "written",
                                                           seconds=r.seconds, done_at_s=round(r.done_at - self.t0, 2),
                                                           **({"error": r.error} if r.error else {}))
                timeout_s = 0
        except (EOFError, OSError):  # the process ended: what it did not report, the sections write themselves
            self._prep_eof = True

    def save(self) -> None:
        """Write the report as it stands (``gpu_check.json`` / ``.md``, :func:`~.report.write_report`): done before
        the first section and after each one, so a run killed at a time limit (the GPU machine's 10 minutes per
        command) leaves every section finished so far on disk, the rest marked ``pending`` (or ``running``)."""
        self.report["total_s"] = round(time.monotonic() - self.t0, 2)
        self.report["plots"] = self.plots
        self.report["notes"] = self.notes
        write_report(self.report, self.out)

    def _earlier_sections(self) -> dict:
        """The finished sections of a report already under ``--out`` (a run that was killed, or failed in some
        sections), for a rerun with ``--only``: those it does not run keep their results, marked
        ``earlier_run: true``. {} when there is none (or it cannot be read)."""
        try:
            doc = json.loads((self.out / "gpu_check.json").read_text())
        except (OSError, ValueError):
            return {}
        done = {}
        for name, data in (doc.get("sections") or {}).items():
            if name in SECTIONS and data.get("status") not in ("pending", "running", "not requested", None):
                done[name] = dict(data, earlier_run=True)
        return done

    def run(self) -> dict:
        """Run the sections asked for (``--sections`` / ``--only``, default all) in order while the budget lasts;
        returns the report (machine, options, sections by name, total_s, plots, notes), also written after each
        section (:meth:`save`). A failing section is reported with its error and traceback and the next one
        runs."""
        wanted = [s for s in SECTIONS if not self.args.sections or s in self.args.sections]
        earlier = self._earlier_sections() if self.args.sections else {}
        for name in SECTIONS:
            if name in wanted:
                self.report["sections"][name] = {"status": "pending"}
            else:
                self.report["sections"][name] = earlier.get(name, {"status": "not requested"})
        if self.args.budget_s > 0:
            self.prepare(wanted)
        self.save()
        for name in SECTIONS:
            if name not in wanted:
                continue
            if self.left_s() <= 0:
                self.report["sections"][name] = {"status": "skipped",
                                                 "reason": f"the {self.args.budget_s:.0f} s budget was spent"}
                self.log(f"[{name}] skipped: time budget spent")
                continue
            limit = self.section_limit_s(name, [s for s in wanted if wanted.index(s) >= wanted.index(name)])
            self.log(f"[{name}] {TITLES[name]} (limit {limit:.0f} s) ...")
            self.report["sections"][name] = {"status": "running", "started_s": round(time.monotonic() - self.t0, 2),
                                             "limit_s": round(limit, 1)}
            self.save()
            t = time.monotonic()
            self._section_end = t + limit
            try:
                data = getattr(self, f"section_{name}")()
                data.setdefault("status", "ok")
            except Exception as e:  # noqa: BLE001 - one failing section must not stop the others
                data = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                self.log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            self._section_end = None
            data["seconds"] = round(time.monotonic() - t, 2)
            data["started_s"] = round(t - self.t0, 2)
            data["limit_s"] = round(limit, 1)
            if self._prep is not None:
                self._prep_poll(0)
            self.report["sections"][name] = data
            self.log(f"[{name}] {data['status']} in {data['seconds']:.1f} s")
            self.save()
        if self._prep is not None:  # a budget spent before it finished: it stops with the run
            self._prep_poll(0)
            if self._prep.is_alive():
                self._prep.terminate()
            self._prep.join(10)
        self.report["total_s"] = round(time.monotonic() - self.t0, 2)
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

    def section_vehicle(self) -> dict:
        return vehicle.run(self)

    def section_decode(self) -> dict:
        return decode.run(self)
