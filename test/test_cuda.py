"""CUDA paths, tested wherever CUDA exists (skipped with the reason elsewhere): device placement, the budget,
uploads in the target dtype, background loads on their own stream, memory returned after a re-split, and the
GPU check's sections 1, 3, 4, 5 and 7 at small sizes (``--device cuda --small``).

Run them alone with ``pytest -m cuda``. No timing is asserted.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is "
                                 "False here): these run on a machine with an NVIDIA GPU")]

MIB = 2**20


def test_cuda_n_is_checked_and_made_current():
    from hybrid_vla_ros.runtime.device import resolve_device

    n = torch.cuda.device_count()
    last = resolve_device(f"cuda:{n - 1}")
    assert last == torch.device("cuda", n - 1) and torch.cuda.current_device() == n - 1
    with pytest.raises(ValueError, match=f"has {n} CUDA device"):
        resolve_device(f"cuda:{n}")
    assert resolve_device("cuda") == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    assert resolve_device("auto") == torch.device("cuda", 0)


def test_cuda_memory_reports_driver_level_figures():
    from hybrid_vla_ros.runtime.device import cuda_memory

    x = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    m = cuda_memory("cuda:0")
    assert m["allocated"] >= x.numel() and m["reserved"] >= m["allocated"]
    assert m["used"] == m["total"] - m["free"] and m["used"] >= m["reserved"]
    del x


def test_upload_is_in_the_target_dtype_and_exact(tiny_checkpoint):
    from hybrid_vla_ros.model.checkpoint import load_stage

    cpu = load_stage(tiny_checkpoint, "prefix", 2, device="cpu", dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    gpu = load_stage(tiny_checkpoint, "prefix", 2, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in gpu.parameters())
    largest_fp32 = max(p.numel() * 4 for p in gpu.parameters())
    # no transient fp32 copy on the device: the peak stays under the fp16 stage plus one fp32 tensor
    assert torch.cuda.max_memory_allocated() - before < weights + largest_fp32
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert b.device.type == "cuda" and b.dtype == a.dtype and torch.equal(a, b.cpu()), name


def test_background_load_runs_on_its_own_stream_and_is_ready_for_the_inference_stream(tiny_checkpoint):
    from hybrid_vla_ros.model.checkpoint import load_blocks, model_id
    from hybrid_vla_ros.split.resplit import BlockPrefetcher

    pf = BlockPrefetcher(str(tiny_checkpoint), torch.device("cuda", 0), torch.float16, model_id(tiny_checkpoint))
    try:
        assert pf.load_stream is not None and pf.load_stream != torch.cuda.current_stream()
        pf.prefetch(1, 3)
        blocks, load_ms = pf.take(1, 3, timeout=None)
        assert blocks.ready_event is None  # taken: the current stream waited for it
        want = load_blocks(tiny_checkpoint, 1, 3, device="cpu", dtype=torch.float16)
        for a, b in zip(want.state_dict().values(), blocks.state_dict().values()):
            assert torch.equal(a, b.cpu())
    finally:
        pf.close()


def test_budget_is_enforced_at_configure(tiny_checkpoint):
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings
    from hybrid_vla_ros.split.planner import plan_for_checkpoint

    plan = plan_for_checkpoint(tiny_checkpoint, None, None, "fp32")
    settings = PrefixRunnerSettings(4, device="cuda", ring_name=f"cuda_budget_{os.getpid()}")
    with pytest.raises(ValueError, match="gpu_budget_gb"):
        PrefixRunner(str(tiny_checkpoint), replace(settings, gpu_budget_bytes=plan.row(4).gpu_total_bytes - 1))
    budget = plan.row(4).gpu_total_bytes
    runner = PrefixRunner(str(tiny_checkpoint), replace(settings, ring_name=f"cuda_budget2_{os.getpid()}",
                                                        gpu_budget_bytes=budget))
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        assert runner.memory_fraction == pytest.approx(min(1.0, budget / total))
    finally:
        runner.close()
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_resplit_down_returns_memory_to_the_driver(tmp_path):
    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings
    from hybrid_vla_ros.tools.gpu_check import raw_items, wide_tiny_llm

    path = tmp_path / "wide"
    init_model("tiny", path, overrides={"llm": wide_tiny_llm()}, dtype="fp16")
    runner = PrefixRunner(str(path), PrefixRunnerSettings(4, device="cuda", dtype="fp16",
                                                          ring_name=f"cuda_resplit_{os.getpid()}"))
    try:
        items = raw_items(runner.cfg.n_cameras, (64, 48))
        runner.run(items, 1)
        runner.request_split_layer(1)
        r = runner.run(items, 2)
        e = r.resplit
        assert e is not None and (e.old_split_layer, e.new_split_layer) == (4, 1)
        assert e.device_bytes_after < e.device_bytes_before
        assert e.reserved_bytes_after < e.reserved_bytes_before
        assert e.returned_to_driver_bytes > 0
    finally:
        runner.close()


def _section(tmp_path, name):
    from hybrid_vla_ros.tools import gpu_check

    gpu_check.main(["--device", "cuda", "--small", "--out", str(tmp_path), "--sections", name])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    s = report["sections"][name]
    assert s["status"] in ("ok", "check"), (s.get("error"), s.get("traceback"))
    return s


def test_section_1_memory_plan(tmp_path):
    s = _section(tmp_path, "memory_plan")
    rows = s["presets"]["tiny"]["rows"]
    assert len(rows) == 5
    for r in rows:
        assert r["peak_allocated"] >= r["weight_bytes"] and r["peak_reserved"] >= r["peak_allocated"]
        assert r["driver_used"] >= r["peak_reserved"] and "driver_vs_plan" in r
    print(json.dumps(rows, indent=1))


def test_section_3_live_resplit(tmp_path):
    s = _section(tmp_path, "live_resplit")
    assert [(m["from"], m["to"]) for m in s["moves"]] == [(4, 1), (1, 4)]
    assert s["lost"] == 0 and s["mismatched_k"] == 0
    assert s["memory_returned"] is True and s["returned_to_driver_bytes"] > 0


def test_section_4_memory_pressure(tmp_path):
    s = _section(tmp_path, "memory_pressure")
    assert s["moved_down"] and s["moved_up"], s["timeline"]
    assert s["prefix_out_of_memory"] == 0 and not s["ballast_errors"]
    assert s["mismatched_k"] == 0 and s["lost"] == 0


def test_section_5_handoff(tmp_path):
    s = _section(tmp_path, "handoff")
    modes = s["modes"]
    assert {"pageable_tensor", "registered_slot", "pinned_staging", "pageable_slot"} <= set(modes)
    assert modes["pinned_staging"]["mode"] == "staging" and modes["pageable_slot"]["mode"] == "pageable"
    assert all(m.get("exact", True) for m in modes.values())
    print(json.dumps({k: v["ms_p50"] for k, v in modes.items()}))


def test_section_7_numerics(tmp_path):
    s = _section(tmp_path, "numerics")
    pairs = [p for p in s["pairs"] if "drift_3s_cm" in p]
    assert {p["prefix"].split()[0] for p in pairs} >= {"fp16"}
    assert all("cuda" in p["prefix"] for p in pairs)
    print(json.dumps(pairs, indent=1))
