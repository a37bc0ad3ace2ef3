"""The GPU check's pure pieces (device strings, budget, hysteresis, report helpers) and its CPU run end to end.

``--device cpu --small`` runs every section of ``scripts/gpu_check.py`` here at reduced sizes; the test checks
the report's structure and that its figures are real (plan rows for each K, drift computed, frames counted).
No timing is asserted: the run's figures are printed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_vla_ros.model.config import preset
from hybrid_vla_ros.runtime.device import budget_fraction, parse_device, resolve_device
from hybrid_vla_ros.split.planner import AutoResplitPolicy, check_budget, plan_split
from hybrid_vla_ros.tools import gpu_check

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


# ------------------------------------------------------------------------------------------ device strings

@pytest.mark.parametrize("name, available, count, want", [
    ("auto", True, 2, "cuda:0"), ("auto", False, 0, "cpu"), ("cpu", True, 1, "cpu"), ("cuda", True, 1, "cuda:0"),
    ("cuda:1", True, 2, "cuda:1"), (" CUDA:0 ", True, 1, "cuda:0"),
])
def test_parse_device_accepts(name, available, count, want):
    assert parse_device(name, available, count) == want


@pytest.mark.parametrize("name, available, count, message", [
    ("cuda:2", True, 2, "has 2 CUDA device(s) (cuda:0 .. cuda:1)"),
    ("cuda:0", False, 0, "CUDA is not available"),
    ("cuda", True, 0, "CUDA is not available"),
    ("cuda:x", True, 1, "use auto, cpu, cuda or cuda:N"),
    ("mps", True, 1, "use auto, cpu, cuda or cuda:N"),
    ("cuda:-1", True, 1, "use auto, cpu, cuda or cuda:N"),
])
def test_parse_device_refuses(name, available, count, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        parse_device(name, available, count)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_resolve_device_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="not available"):
        resolve_device("cuda:0")


def test_budget_fraction():
    assert budget_fraction(40, 80) == 0.5
    assert budget_fraction(100, 80) == 1.0
    for bad in ((0, 80), (-1, 80), (10, 0)):
        with pytest.raises(ValueError, match="must be > 0"):
            budget_fraction(*bad)


# ------------------------------------------------------------------------------------------ budget check

def test_check_budget_against_the_plan():
    plan = plan_split(preset("orion"), "fp16")
    need = plan.row(32).gpu_total_bytes
    check_budget(plan, 32, need)  # fits exactly
    check_budget(plan, 32, None)
    check_budget(plan, 32, 0)  # 0: no budget
    with pytest.raises(ValueError, match=r"split layer 32 needs .* GB .* gpu_budget_gb: the largest K that fits is "):
        check_budget(plan, 32, need - 1)
    with pytest.raises(ValueError, match="no K fits"):
        check_budget(plan, 0, 1)


def test_prefix_runner_checks_the_budget_only_on_cuda(tiny_checkpoint):
    """A CPU prefix has no device budget: the runner starts whatever gpu_budget_bytes says."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA case is in test_cuda.py")
    from hybrid_vla_ros.runtime.prefix import PrefixRunner

    runner = PrefixRunner(str(tiny_checkpoint), 1, device="cpu", ring_name=f"gpuchk_budget_{os.getpid()}",
                          gpu_budget_bytes=1)
    try:
        assert runner.memory_fraction == 1.0
    finally:
        runner.close()


# ------------------------------------------------------------------------------------------ hysteresis

def _policy(**kw):
    plan = plan_split(preset("tiny"), "fp32", cuda_overhead_bytes=0)
    block = plan.row(4).gpu_total_bytes - plan.row(3).gpu_total_bytes
    low, high = 4 * block, 8 * block
    return plan, block, AutoResplitPolicy(plan, low, high, **kw)


def test_policy_moves_down_at_once_under_the_low_threshold():
    plan, block, pol = _policy()
    k, why = pol.decide(4, pol.low_bytes - 1)
    assert k is not None and k < 4 and "down to" in why


def test_policy_moves_up_only_after_enough_calm_readings_and_not_past_the_plan():
    plan, block, pol = _policy(up_after=3)
    lots = pol.high_bytes + 10 * block
    assert pol.decide(1, lots)[0] is None
    assert pol.decide(1, lots)[0] is None
    k, why = pol.decide(1, lots)
    assert k == plan.chosen_k == 4 and "up to K=4" in why
    assert pol.calm == 0


def test_policy_between_the_thresholds_stays_and_resets_the_count():
    plan, block, pol = _policy(up_after=2)
    lots = pol.high_bytes + 10 * block
    assert pol.decide(2, lots) == (None, "free memory recovered (1/2 readings)")
    between = (pol.low_bytes + pol.high_bytes) // 2
    assert pol.decide(2, between)[0] is None  # above low: no move down; a move up would leave < high
    assert pol.calm == 0
    assert pol.decide(2, lots)[0] is None  # counting starts again


def test_policy_moves_up_only_as_far_as_leaves_the_high_threshold_free():
    plan, block, pol = _policy(up_after=1)
    free = pol.high_bytes + (plan.row(2).gpu_total_bytes - plan.row(1).gpu_total_bytes)
    assert pol.decide(1, free)[0] == 2


def test_policy_does_not_oscillate_after_a_move_up():
    """After moving up the free memory is >= high > low: the next reading never moves K back down."""
    plan, block, pol = _policy(up_after=1)
    total = plan.row(4).gpu_total_bytes + pol.high_bytes  # a device where K=4 leaves exactly `high` free
    k = 1
    for _ in range(6):
        new, _why = pol.decide(k, total - plan.row(k).gpu_total_bytes)
        k = new if new is not None else k
    assert k == 4
    assert pol.decide(4, total - plan.row(4).gpu_total_bytes)[0] is None


def test_policy_parameters_are_checked():
    plan = plan_split(preset("tiny"), "fp32")
    with pytest.raises(ValueError, match="above the low one"):
        AutoResplitPolicy(plan, 10 * MIB, 10 * MIB)
    with pytest.raises(ValueError, match="> 0 bytes"):
        AutoResplitPolicy(plan, 0, 10)
    with pytest.raises(ValueError, match="up_after"):
        AutoResplitPolicy(plan, 1, 2, up_after=0)
    assert AutoResplitPolicy.thresholds(100, 0) == (100 * MIB, 200 * MIB)
    assert AutoResplitPolicy.thresholds(100, 150) == (100 * MIB, 150 * MIB)


# ------------------------------------------------------------------------------------------ report helpers

def test_report_helpers():
    assert gpu_check.split_points(32) == [0, 8, 16, 24, 32]
    assert gpu_check.split_points(4) == [0, 1, 2, 3, 4]
    assert gpu_check.split_points(1) == [0, 1]
    assert gpu_check.core_split(list(range(16))) == ([0, 1], list(range(2, 16)))
    assert gpu_check.core_split([0, 1]) == ([0], [1])
    assert gpu_check.core_split([3]) == ([3], [3])
    assert gpu_check.frames_lost(10, 7, 2, 1) == 0
    assert gpu_check.frames_lost(10, 7, 1) == 2
    a = [[0.0, 0.5 * i] for i in range(1, 7)]
    b = [[0.03, 0.5 * i] for i in range(1, 7)]
    assert gpu_check.drift_at(a, b, 0.5) == pytest.approx(0.03)
    assert gpu_check.within(105, 100) and not gpu_check.within(111, 100)


def test_the_module_imports_no_ros():
    code = ("import sys, hybrid_vla_ros.tools.gpu_check, hybrid_vla_ros.runtime.prefix, hybrid_vla_ros.runtime.suffix; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rclpy', 'rosidl_runtime_py', 'launch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ the CPU run

@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the script finds the package itself, as on the GPU machine
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--device", "cpu", "--small",
                           "--out", str(out)], capture_output=True, text=True, env=env, cwd=out, timeout=600)
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / "gpu_check.json").read_text()), out, proc.stdout


def test_cpu_run_writes_every_section(cpu_report):
    report, out, stdout = cpu_report
    assert set(report["sections"]) == set(gpu_check.SECTIONS)
    for name, s in report["sections"].items():
        assert s["status"] in ("ok", "check"), (name, s.get("error"), s.get("traceback"))
    assert (out / "gpu_check.md").read_text().count("## ") == len(gpu_check.SECTIONS)
    assert "gpu-check on cpu" in stdout
    assert report["machine"]["device"] == "cpu"


def test_cpu_run_memory_plan_rows_for_each_k(cpu_report):
    report, _, _ = cpu_report
    s = report["sections"]["memory_plan"]
    rows = s["presets"]["tiny"]["rows"]
    assert [r["k"] for r in rows] == gpu_check.split_points(preset("tiny").num_layers)
    for r in rows:
        assert r["plan_total"] > 0 and r["finite"]
        assert r["weights_within_10pct"], r  # parameters made on the device = the plan's weight bytes
    assert "needs CUDA" in s["note"]


def test_cpu_run_pipeline_counts_frames(cpu_report):
    report, _, _ = cpu_report
    rows = report["sections"]["paper_table"]["presets"]["tiny"]["rows"]
    assert rows and all("e2e_ms" in r for r in rows)
    for r in rows:
        assert r["published"] == 7 and r["computed"] >= 1 and r["lost"] == 0 and r["mismatched_k"] == 0
        assert r["e2e_ms"]["n"] >= 1
    assert rows[0]["label"].startswith("GPU-only")


def test_cpu_run_live_resplit_and_pressure(cpu_report):
    report, _, _ = cpu_report
    live = report["sections"]["live_resplit"]
    assert [(m["from"], m["to"]) for m in live["moves"]] == [(4, 1), (1, 4)]
    assert live["lost"] == 0 and live["mismatched_k"] == 0
    assert live["computed"] + live["superseded"] + live["overwritten"] == live["published"]
    assert live["memory_returned"] == "needs CUDA" and live["stage_bytes_freed"] > 0
    pressure = report["sections"]["memory_pressure"]
    assert pressure["moved_down"] and pressure["moved_up"]
    downs = [d for d in pressure["decisions"] if d["to"] < d["from"]]
    ups = [d for d in pressure["decisions"] if d["to"] > d["from"]]
    assert downs and ups and downs[0]["frame"] < ups[0]["frame"]
    assert pressure["prefix_out_of_memory"] == 0 and pressure["mismatched_k"] == 0 and pressure["lost"] == 0


def test_cpu_run_handoff_decode_numerics(cpu_report):
    report, _, _ = cpu_report
    handoff = report["sections"]["handoff"]
    assert handoff["state_shape"] == list(preset("orion").prefix_state_shape)
    assert handoff["modes"]["cpu_copy_into_slot"]["ms_p50"] > 0 and "needs CUDA" in handoff["note"]
    decode = report["sections"]["camera_decode"]
    assert decode["cameras"] == 6 and decode["paths"]["cpu_prefix_path"]["ms_p50"] > 0
    assert "needs CUDA" in json.dumps(decode["paths"]["nvjpeg_cuda"])
    num = report["sections"]["numerics"]
    computed = [p for p in num["pairs"] if "drift_3s_cm" in p]
    assert computed, num
    for p in computed:
        assert p["drift_3s_cm"] >= 0 and p["max_drift_cm"] >= p["drift_3s_cm"] - 1e-9
    assert num["random_weights"] and "random weights" in num["random_note"]


def test_budget_skips_the_remaining_sections(tmp_path):
    """A spent budget: every section is skipped and says so; the report is still written."""
    code = gpu_check.main(["--device", "cpu", "--small", "--budget-s", "0", "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(s["status"] == "skipped" and "budget" in s["reason"] for s in report["sections"].values())
    assert "budget was spent" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_section_is_reported_and_the_rest_run(tmp_path, monkeypatch):
    def boom(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(gpu_check.Check, "section_handoff", boom)
    code = gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path), "--sections", "handoff",
                           "camera_decode"])
    assert code == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["sections"]["handoff"]["status"] == "failed" and "injected" in report["sections"]["handoff"]["error"]
    assert report["sections"]["camera_decode"]["status"] == "ok"
    assert report["sections"]["numerics"]["status"] == "not requested"


# ------------------------------------------------------------------------------------------ uploads

def test_reads_onto_a_device_are_converted_on_the_host_first(tiny_checkpoint, monkeypatch):
    """Onto a non-CPU device every tensor reaches the uploader already in the stage dtype: the device never
    holds the stored (fp32) copy. A fake uploader stands in for the CUDA one (page-locked staging)."""
    from hybrid_vla_ros.model import sources
    from hybrid_vla_ros.model.checkpoint import open_checkpoint

    seen = []

    class FakeUploader:
        def __init__(self, device):
            self.device = device

        def __call__(self, t):
            seen.append((t.device.type, t.dtype))
            return t

        def close(self):
            seen.append("closed")

    monkeypatch.setattr(sources, "DeviceUploader", FakeUploader)
    src = open_checkpoint(tiny_checkpoint).source()
    names = sorted(n for n in src.names() if n.startswith("layers.0."))
    got = src.read(names, device="meta", float_dtype=torch.float16)
    assert set(got) == set(names) and seen[-1] == "closed"
    assert all(entry == ("cpu", torch.float16) for entry in seen[:-1]) and len(seen) == len(names) + 1
    want = src.read(names, device="cpu", float_dtype=torch.float16)
    assert all(torch.equal(got[n], want[n]) for n in names)


def test_cli_subcommand(tmp_path, capsys):
    from hybrid_vla_ros.tools.cli import main

    with pytest.raises(SystemExit) as e:
        main(["gpu-check", "--help"])
    assert e.value.code == 0 and "--budget-s" in capsys.readouterr().out
    assert main(["gpu-check", "--device", "cpu", "--small", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "gpu_check.json").is_file() and (tmp_path / "gpu_check.md").is_file()


# ------------------------------------------------------------------------------------------ preflight

def test_missing_requirements_are_named_without_importing():
    assert gpu_check.missing_requirements(find=lambda name: object()) == []
    assert gpu_check.missing_requirements(find=lambda name: None if name in ("numpy", "torch") else object()) == [
        "torch", "numpy"]


def test_a_missing_requirement_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "missing_requirements", lambda find=None: ["torch"])
    assert gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "gpu_check needs torch (and transformers, safetensors, numpy): torch" in err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("device,small,cuda,needle", [
    ("cuda", False, False, "device 'cuda' requested but CUDA is not available"),
    ("cuda:3", True, False, "device 'cuda:3' requested but CUDA is not available"),
    ("cuda:3", False, True, "this machine has 1 CUDA device(s)"),
    ("auto", False, False, "no CUDA device: the full-size check is meant for a GPU machine"),
])
def test_preflight_refuses(device, small, cuda, needle):
    args = gpu_check.build_parser().parse_args(["--device", device] + (["--small"] if small else []))
    assert needle in gpu_check.preflight(args, cuda_available=cuda, device_count=1 if cuda else 0)


def test_preflight_refuses_a_budget_and_an_out_that_cannot_be(tmp_path):
    a_file = tmp_path / "report.md"
    a_file.write_text("x")
    for extra, needle in ((["--budget-s", "-5"], "--budget-s must be >= 0 s, got -5.0"),
                          (["--out", str(a_file)], f"--out: {a_file} is not a folder"),
                          (["--out", str(a_file / "sub")], f"--out: cannot create the folder {a_file / 'sub'}: "
                                                           f"{a_file} is not a folder")):
        args = gpu_check.build_parser().parse_args(["--device", "cpu", "--small", *extra])
        assert gpu_check.preflight(args, cuda_available=False, device_count=0) == needle
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("device,small,cuda", [("auto", True, False), ("cpu", False, False),
                                               ("auto", False, True), ("cuda", False, True)])
def test_preflight_accepts(device, small, cuda):
    args = gpu_check.build_parser().parse_args(["--device", device] + (["--small"] if small else []))
    assert gpu_check.preflight(args, cuda_available=cuda, device_count=1 if cuda else 0) == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are for a machine without CUDA")
@pytest.mark.parametrize("extra", [["--device", "cuda"], ["--device", "cuda:3"], []])
def test_cli_refuses_without_cuda_in_one_line(tmp_path, extra):
    out = subprocess.run([sys.executable, "-m", "hybrid_vla_ros", "gpu-check", "--out", str(tmp_path / "o"), *extra],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    assert ("use --device cpu --small here" in out.stderr) == (not extra)
    assert not (tmp_path / "o").exists()


def test_the_script_without_torch_says_so_in_one_line(tmp_path):
    """scripts/gpu_check.py on a Python where torch cannot be imported (sys.modules['torch'] = None)."""
    repo = Path(__file__).resolve().parent.parent
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            f"sys.argv = ['gpu_check.py', '--device', 'cpu', '--small', '--out', {str(tmp_path / 'o')!r}]; "
            f"runpy.run_path({str(repo / 'scripts' / 'gpu_check.py')!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 2, out.stderr
    assert "gpu_check needs torch (and transformers, safetensors, numpy): torch" in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "o").exists()
