"""hybrid_vla_ros.tools.bench: the arithmetic (FLOP counts, split choice, pipeline figures) and the plumbing (a quick
run writes a complete JSON document and PNGs). No test asserts a timing: the bench reports figures, the goals
are evaluated in its output."""
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from hybrid_vla_ros.model.config import preset
from hybrid_vla_ros.tools.bench import report
from hybrid_vla_ros.tools.bench.cli import main as bench_main
from hybrid_vla_ros.tools.bench.common import percentiles, time_call
from hybrid_vla_ros.tools.bench.handoff import payload_bytes, payload_shape, run_handoff
from hybrid_vla_ros.tools.bench.pipeline import choose_split, frame_rows, summarize_pipeline
from hybrid_vla_ros.tools.harness import sized
from hybrid_vla_ros.tools.bench.suffix_flops import (block_flops, gemm_shapes, head_flops, mlp_rows_flops,
                                                     suffix_flops, vae_planner_flops)

# ------------------------------------------------------------------------------------------ FLOP counts

def test_block_flops_of_tiny_equal_a_hand_count():
    cfg = preset("tiny")  # H 128, 4 heads of 32, 2 KV heads, MLP 344, T = 8 + 96 + 1 = 105
    T = 105
    assert cfg.num_tokens == T
    q = o = 2 * T * 128 * 128
    k = v = 2 * T * 128 * 64
    mlp = 3 * 2 * T * 128 * 344
    pairs = T * (T + 1) // 2  # causal attention counted as half
    attn = 2 * (2 * 4 * 32 * pairs)  # QK^T and AV, 4 heads of 32
    got = block_flops(cfg, T)
    assert sum(got["linear"].values()) == q + o + k + v + mlp == 38_062_080
    assert got["attention"]["qk"] + got["attention"]["av"] == attn == 2_849_280
    assert got["attention_full"] == 2 * 2 * 4 * 32 * T * T
    assert got["total"] == 38_062_080 + 2_849_280
    assert head_flops(cfg) == 2 * 128 * 128 + 2 * 128 * 6 * 6 * 2
    s = suffix_flops(cfg, 1)
    assert s["blocks"] == 3 and s["total"] == 3 * got["total"] + head_flops(cfg)


def test_two_passes_count_twice_and_add_the_decision_head():
    cfg = preset("minddrive-0.5b")
    assert cfg.llm_passes == 2 and cfg.num_tokens == 539  # <waypoint_ego> and <path_waypoint_ego> end it
    one, two = block_flops(cfg, 539, 1), block_flops(cfg, 539, 2)
    assert two["total"] == 2 * one["total"]
    h = cfg.hidden_size
    assert len(cfg.decision_token_ids) == 7  # MindDrive's read-out: the LM-head rows of 7 meta-action tokens
    # the speed planner (7 modes x 6 steps) and the path planner (6 modes x 20 points), then the decision rows
    assert head_flops(cfg) == vae_planner_flops(h, 6, 7) + vae_planner_flops(h, 20, 6) + 2 * h * 7
    assert gemm_shapes(cfg)[0] == (2 * 539, 896, 4864)
    mlp = preset("minddrive-0.5b", readout={"type": "mlp"})
    assert head_flops(mlp) == 2 * h * h + 2 * h * 6 * 6 * 2 + 2 * h * 7


def test_vae_planner_flops_equal_torch_flop_counter():
    """The VAE planner's FLOP count equals torch's FlopCounterMode on the module (its convolutions, GRU and
    linears), for Orion's shape and MindDrive's two at a small width."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybrid_vla_ros.model.vae_planner import VAEPlanner

    for steps, modes in ((6, 6), (6, 7), (20, 6)):
        p = VAEPlanner(64, steps, modes).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            p(torch.randn(64))
        assert counter.get_total_flops() == vae_planner_flops(64, steps, modes)


@pytest.mark.parametrize("name", ["tiny", "smol", "minddrive-0.5b"])
def test_linear_and_attention_flops_equal_torch_flop_counter(name):
    """torch's FlopCounterMode on the meta device (no compute) counts the real module's matmuls: its mm + addmm
    (+ convolution) must equal our Linear count of one block + heads (minddrive-0.5b: its two VAE planners), its
    bmm (SDPA's math decomposition on meta) our full (non-causal) attention count."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybrid_vla_ros.model.modeling import SuffixStage

    cfg = preset(name)
    k = cfg.num_layers - 1
    with torch.device("meta"):
        stage = SuffixStage(cfg, k)
        h = torch.empty(cfg.prefix_state_shape)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        stage(h, 3, k)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    ours = suffix_flops(cfg, k)
    # (the VAE planners' 1 x 1 convolutions are linear maps too: counted with them)
    assert counts.get("aten.mm", 0) + counts.get("aten.addmm", 0) + counts.get("aten.convolution", 0) \
        == ours["linear_total"]
    if "aten.bmm" in counts:
        assert counts["aten.bmm"] == ours["per_block"]["attention_full"]


# ------------------------------------------------------------------------------------------ split choice

def _profile(pre, blocks, handoff=0.5, head=0.2, rotary=0.1):
    return {"preprocess_ms": pre, "parts_ms": {"vision_embeddings": 1.0, "vision_post": 0.0, "projector_embed": 1.0,
                                               "rotary": rotary, "head": head},
            "vision_blocks_ms": [2.0, 2.0], "llm_blocks_ms": blocks, "handoff_ms": handoff}


def test_choose_split_takes_the_smallest_prefix_bound_k():
    # front = pre 10 + 1 + 4 + 0 + 1 = 16 ms; blocks of 4 ms, 8 of them
    c = choose_split(_profile(10.0, [4.0] * 8), margin=0.05)
    table = {k: (p, s) for k, p, s in c["table"]}
    assert table[0] == pytest.approx((16.0, 0.5 + 0.1 + 32 + 0.2))
    assert table[8] == pytest.approx((16.0 + 0.1 + 32, 0.5 + 0.2))
    k = c["split_layer"]
    p, s = table[k]
    assert p >= 1.05 * s and table[k - 1][0] < 1.05 * table[k - 1][1]
    assert k == 3  # P(3) = 28.1 >= 1.05 x 20.8; P(2) = 24.1 < 1.05 x 24.8
    assert c["balanced_split_layer"] == 2  # max(24.1, 24.8) = 24.8 < max(28.1, 20.8) = 28.1


def test_a_plan_that_ran_suffix_bound_is_chosen_again_with_a_margin_sized_by_its_error():
    """The profile predicted K = 2 prefix-bound (30 vs 25 ms); the run measured the suffix 1.4x slower than
    predicted (35 ms) and the prefix as predicted: the margin that error needs is 1.05 x 1.4 - 1 = 0.47, and the rule
    with it takes K = 3, where the measured errors leave the prefix the slower side (40 vs 21 ms). A run that met
    its prediction keeps its K and its margin."""
    from hybrid_vla_ros.tools.bench.pipeline import plan_check

    table = [[k, 10.0 * (k + 1), 45.0 - 10.0 * k] for k in range(5)]
    choice = {"split_layer": 2, "margin": 0.05, "table": table, "predicted_prefix_ms": 30.0,
              "predicted_handoff_suffix_ms": 25.0}
    assert choose_split({"parts_ms": {"vision_embeddings": 0.0, "vision_post": 0.0, "projector_embed": 0.0,
                                      "rotary": 0.0, "head": 5.0}, "llm_blocks_ms": [10.0] * 4,
                         "preprocess_ms": 10.0, "vision_blocks_ms": [], "handoff_ms": 0.0})["table"] == table

    def stages(prefix, handoff, suffix):  # the gross hand-off holds a frame's wait in the ring: not counted
        return {"preprocess_ms": {"p50": 0.0}, "prefix_ms": {"p50": prefix}, "handoff_ms": {"p50": handoff + 40.0},
                "handoff_net_ms": {"p50": handoff}, "suffix_ms": {"p50": suffix}}

    c = plan_check(choice, stages(30.0, 1.0, 34.0))
    assert not c["prefix_bound"] and c["prefix_error"] == 1.0 and c["suffix_error"] == pytest.approx(1.4)
    assert c["margin_needed"] == pytest.approx(0.47) and c["corrected_split_layer"] == 3
    assert 1.0 * table[3][1] >= 1.4 * table[3][2]
    kept = plan_check(choice, stages(33.0, 0.0, 27.5))  # both 10 % slower than predicted
    assert kept["prefix_bound"] and kept["margin_needed"] == pytest.approx(0.05)
    assert kept["corrected_split_layer"] == 2


def test_choose_split_is_zero_when_the_prefix_dominates():
    assert choose_split(_profile(70.0, [0.5] * 4))["split_layer"] == 0


def test_model_overrides_keep_the_llm_side():
    o = sized("minddrive-0.5b", 112)
    cfg = preset("minddrive-0.5b", **o)
    assert cfg.image_size == cfg.vision["image_size"] == 112 and cfg.num_tokens == 539
    assert sized("tiny", 64) == {} and sized("tiny", None) == {}


# ------------------------------------------------------------------------------------------ pipeline figures

def _rec(seq, start, pre, pfx, write, publish, ready, end):
    ms = 1_000_000
    return {"seq": seq, "preprocess_ms": pre, "prefix_ms": pfx, "handoff_ms": (ready - write),
            "suffix_ms": end - ready, "t_prefix_start_ns": start * ms, "t_write_start_ns": write * ms,
            "t_publish_ns": publish * ms, "t_ready_ns": ready * ms, "t_suffix_end_ns": end * ms}


def test_summarize_pipeline_prefix_bound():
    """Prefix 10 ms a frame (9 + 1), copy 1 ms, wake 1 ms, suffix 4 ms: a frame every 12 ms (prefix + copy and
    a 1 ms gap), ideal = 1 / 10 ms."""
    suffix, prefix = [], []
    for i in range(1, 7):
        t = (i - 1) * 12
        suffix.append(_rec(i, t, 9, 1, t + 10, t + 11, t + 12, t + 16))
        prefix.append({"seq": i, "preprocess_ms": 9, "prefix_ms": 1, "t_call_ns": t * 10**6,
                       "t_return_ns": (t + 11) * 10**6})
    s = summarize_pipeline(suffix, prefix, warmup=1, total=6)
    assert s["frames_measured"] == 5 and s["frames_dropped"] == 0
    assert s["fps"] == pytest.approx(1000 / 12)
    assert s["ideal_fps"] == pytest.approx(100.0)  # max(9 + 1, (ready - write) 2 + suffix 4) = 10 ms
    assert s["efficiency"] == pytest.approx(10 / 12)
    assert s["bottleneck"] == "prefix"
    assert s["stages_ms"]["queue_wait_ms"]["p50"] == 0
    assert (s["stages_ms"]["copy_ms"]["p50"] == pytest.approx(1)
            and s["stages_ms"]["wake_ms"]["p50"] == pytest.approx(1))
    lat = s["latency"]
    assert lat["e2e_p50_ms"] == pytest.approx(16) and lat["stage_sum_p50_ms"] == pytest.approx(14)
    assert lat["overhead_p50_ms"] == pytest.approx(2) and lat["met"]  # 2 <= 0.05 x 14 + 2
    assert len(s["timeline"]) == 5


def test_efficiency_uses_mean_stage_times_so_a_stalled_frame_does_not_count_against_the_pipeline():
    """Frames with a 10 ms prefix and one of 30 ms (e.g. preempted by other work), 2 ms of copy and gap each:
    the four periods the rate spans (frames 3..6) last 32 + 12 + 12 + 12 ms, their prefix stages 30 + 10 + 10 +
    10 ms, so efficiency = 15 / 17; the median-based figure would blame the stall on the pipeline (10 / 17)."""
    suffix, prefix, start = [], [], 0
    for seq, p in enumerate([10, 10, 30, 10, 10, 10], start=1):
        w = start + p
        suffix.append(_rec(seq, start, 1, p - 1, w, w + 1, w + 2, w + 6))
        prefix.append({"seq": seq, "preprocess_ms": 1, "prefix_ms": p - 1, "t_call_ns": start * 10**6,
                       "t_return_ns": (w + 1) * 10**6})
        start += p + 2
    s = summarize_pipeline(suffix, prefix, warmup=1, total=6)
    assert s["fps"] == pytest.approx(4 / 0.068)
    assert s["efficiency"] == pytest.approx(15 / 17)
    assert s["efficiency_p50"] == pytest.approx(10 / 17)


def test_queue_wait_is_split_from_the_handoff():
    """A suffix of 20 ms behind a 10 ms prefix: frame 2 is published at 21 ms while frame 1's suffix runs until
    32 ms, so it waits 11 ms in the ring; its net hand-off is the rest."""
    rows = frame_rows([_rec(1, 0, 9, 1, 10, 11, 12, 32), _rec(2, 11, 9, 1, 20, 21, 32, 52)])
    assert rows[1]["queue_wait_ms"] == pytest.approx(11)
    assert rows[1]["handoff_net_ms"] == pytest.approx(12 - 11)
    assert rows[1]["overhead_ms"] == pytest.approx((52 - 11) - (9 + 1 + 20))


def test_percentiles_and_time_call():
    p = percentiles([1, 2, 3, 4, 5])
    assert (p["n"], p["p50"], p["min"], p["max"]) == (5, 3, 1, 5) and p["p90"] == pytest.approx(4.6)
    assert percentiles([])["n"] == 0
    t = time_call(lambda: sum(range(100)), repeats=3, min_sample_s=0.001)
    assert len(t["samples"]) == 3 and t["median"] > 0 and t["calls_per_sample"] >= 1


def test_payload_is_exactly_the_size():
    for mib in (1, 4, 8, 32):
        assert payload_bytes(mib) == mib * 2**20
        assert payload_shape(mib)[1] == 4096


# ------------------------------------------------------------------------------------------ plumbing

def test_handoff_with_a_tiny_count_gives_sane_figures():
    r = run_handoff([1], count=4, warmup=1, rclpy_count=2, rclpy_warmup=1, variants=("default",), gap_count=3,
                    log=lambda s: None)
    row = r["sizes"][0]
    # the zero-copy hand-off: ring (spin then block, and block only at 20 ms) and iceoryx2 at every gap
    assert r["gap_keys"] == ["gap_0ms", "gap_20ms", "gap_100ms"] and r["zero_copy_definition"]
    for gap, n in (("gap_0ms", 4), ("gap_20ms", 3), ("gap_100ms", 3)):
        z = row["zero_copy"][gap]
        assert z["n"] == n and z["lost"] == 0 and z["handoff_ms"]["p50"] > 0 and z["handoff_ms"]["p99"] > 0
        assert sum(z["found"].values()) == n and z["cpu_ms_per_msg"]["consumer"] > 0
        o = z["outliers"]  # every message over 0.5 ms is given one cause
        assert o["over_ms"] == 0.5 and sum(o["causes"].values()) == o["n"] <= n
        assert (o["n"] > 0) == (z["handoff_ms"]["max"] > 0.5)
        if r["iceoryx2"]["available"]:
            assert row["iceoryx2"][gap]["n"] == n and row["ratio_iceoryx2_over_zero_copy"][gap]["p50"] > 0
    assert row["zero_copy_block"]["gap_20ms"]["found"]["found_spinning"] == 0
    if not r["iceoryx2"]["available"]:
        assert row["iceoryx2"] == {"skipped": r["iceoryx2"]["skipped"]}
    assert report.validate({"kind": report.KIND, "handoff": r}) == [f"doc.{k}" for k in report.REQUIRED["top"]
                                                                    if k != "kind"]
    ring = row["ring"]
    assert ring["n"] == 4 and ring["lost"] == 0
    assert ring["latency_ms"]["p50"] > 0 and ring["copy_ms"]["p50"] > 0 and ring["publish_to_view_ms"]["p50"] > 0
    assert ring["cpu_ms_per_msg"]["total"] > 0
    assert row["memcpy"]["latency_ms"]["p50"] > 0 and row["memcpy"]["bandwidth_gb_s"] > 0
    waited = row["memcpy_after_wait"]  # each copy after the ring producer's median acknowledgement wait
    assert waited["latency_ms"]["n"] == 4 and waited["wait_ms"] > 0
    assert row["ratio_ring_over_memcpy_after_wait_p50"] == pytest.approx(
        ring["latency_ms"]["p50"] / waited["latency_ms"]["p50"])
    rc = row["rclpy"]["default"]
    assert rc["n"] + rc["lost"] == 2 and (rc["n"] == 0 or rc["latency_ms"]["p50"] > 0)
    assert row["best_rclpy"] == "default" and row["ratio_best_rclpy_over_ring_p50"] > 0


def test_a_slow_hand_off_is_given_the_first_cause_that_held_from_the_threads_own_counters():
    """The outlier causes of the zero-copy part: the thread counters they are read from move as the kernel says
    (touching fresh pages faults; two busy threads on one core wait on its run queue), and a cause is the first
    that held, in the documented order."""
    import threading

    from hybrid_vla_ros.tools.bench.zero_copy import CAUSES, RUN_DELAY_MS, cause_of, thread_counters

    faults0, _, _ = thread_counters()
    block = bytearray(32 * 2**20)  # zero pages mapped on first write
    block[::4096] = b"x" * len(block[::4096])
    assert thread_counters()[0] - faults0 >= 32 * 2**20 // 4096 // 2
    core = sorted(os.sched_getaffinity(0))[:1]
    waited = []

    def busy():
        os.sched_setaffinity(0, core)
        before = thread_counters()
        t = time.monotonic() + 0.3
        while time.monotonic() < t:
            pass
        waited.append([a - b for a, b in zip(thread_counters()[1:], before[1:])])

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # two threads spinning 0.3 s on one core: each is switched out and waits its turn (schedstat where it exists)
    assert max(w[0] for w in waited) > 0
    assert max(w[1] for w in waited) > RUN_DELAY_MS * 1e6 or not os.path.exists("/proc/thread-self/schedstat")
    slow = RUN_DELAY_MS * 1e6 + 1
    assert cause_of("found_after_block", 1, 1, slow, 1) == "page_faults"
    assert cause_of("found_after_block", 0, 1, 0, 1) == cause_of("found_spinning", 0, 0, slow) == "preempted"
    assert cause_of("found_ready", 0, 0, 0, 0, (0, slow)) == "preempted"  # the producer waited inside publish
    assert cause_of("found_after_block", 0, 0, 0, 1) == "spin_window"
    assert cause_of("found_after_block", 0, 0, 0, 0) == "wake_up"
    assert [cause_of("found_spinning", 0, 0, 0), cause_of("found_ready", 0, 0, 0)] == ["spin", "ready"]
    assert CAUSES == ("page_faults", "preempted", "spin_window", "wake_up", "spin", "ready")


def test_quick_run_writes_complete_json_markdown_and_pngs(tmp_path):
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    rc = bench_main(["--quick", "--only", "handoff,flops", "--presets", "tiny", "--sizes-mib", "1", "--count", "3",
                     "--warmup", "1", "--rclpy-variants", "none", "--flops-dtypes", "fp32", "--flops-repeats", "1",
                     "--flops-blocks", "1", "--json", str(out), "--plots", str(plots), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    assert doc["errors"] == {} and set(doc["noise"]) == {"handoff", "suffix_flops"}
    f = doc["suffix_flops"]
    assert f["results"][0]["backend"] == "eager" and f["results"][0]["ratio"] > 0
    if importlib.util.find_spec("openvino") is None and not os.environ.get("CI"):
        assert [sk["backend"] for sk in f["skipped"]] == ["openvino"]
        assert [g["id"] for g in doc["goals"]] == ["suffix_flops_tiny_fp32"]
    else:  # openvino is pinned in requirements.txt: CI has it
        ov = f["results"][1]
        assert ov["backend"] == "openvino" and ov["time_ms"] > 0 and ov["build_cold_s"] > 0
        assert ov["accuracy"]["rel_l2_last_hidden_vs_eager"] < 1e-4, "fp32: the same arithmetic"
        assert ov["restart"]["cache_hit"], "the restart worker reused the artifact the FLOP/s worker built"
        ops = ov["ops"]  # the plugin's own node counters: the Linears are FullyConnected nodes, the attention one
        shares = [ops[k] for k in ("gemm_share", "attention_share", "other_share", "outside_share")]
        assert all(0 <= v <= 1 for v in shares) and abs(sum(shares) - 1) < 1e-9
        assert ops["gemm_ms"] > 0 and ops["attention_ms"] > 0 and ops["gemm_gflops_in_graph"] > 0
        # its last block runs the MLP on the read-out row only, and the row counts the FLOPs its graph computes
        cfg = preset("tiny")
        assert ov["last_block_rows"] == 1
        assert ov["gflop"] == pytest.approx(f["results"][0]["gflop"] - mlp_rows_flops(cfg, cfg.num_tokens - 1) / 1e9)
        assert [g["id"] for g in doc["goals"]] == ["suffix_flops_tiny_fp32", "suffix_restart_tiny_fp32_openvino"]
    assert (plots / "handoff.png").stat().st_size > 1000 and (plots / "suffix_flops.png").stat().st_size > 1000
    md = out.with_suffix(".md").read_text()
    assert "| 1 MiB |" in md and "| tiny | fp32 |" in md


def test_quick_moe_part_times_qwen3_30b_a3b_blocks_against_the_gemm_peak_and_eager_experts(tmp_path):
    """`bench --quick --only moe`: one decoder block of Qwen3-30B-A3B's width (16 of its 128 experts, 8 active), per
    dtype: the suffix's time, transformers' own (``grouped_mm``) and eager experts' on the same weights, the active
    FLOPs counted from the block's own parameters, the same run's GEMM peak and memory bandwidth, the floor they
    set (the weights the tokens reach, all 16 experts at T = 128), the goals, the GPU memory a block frees (its
    16-bit parameters), and the markdown table. bf16 packs the experts where oneDNN computes bf16 natively; on a CPU
    without native bf16 it is computed in fp32 as a suffix node computes it, so it is not measured twice but named
    in ``computed_as``. Figures are reported, not asserted."""
    from hybrid_vla_ros.runtime.packed_linear import packing_supported
    from hybrid_vla_ros.util.precision import inference_precision

    bf16 = inference_precision(torch.bfloat16)

    out = tmp_path / "bench.json"
    assert bench_main(["--quick", "--only", "moe", "--json", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert report.validate(doc) == [] and doc["errors"] == {}
    m = doc["moe"]
    hidden, heads, head_dim, width = 2048, 32, 128, 768
    attention = hidden * heads * head_dim * 2 + hidden * 4 * head_dim * 2 + 2 * head_dim
    expert = 3 * hidden * width
    assert m["params_per_block"] == attention + 16 * expert + 16 * hidden + 2 * hidden
    assert m["active_params_per_block"] == m["params_per_block"] - 8 * expert
    assert m["gpu_bytes_per_block"] == 2 * m["params_per_block"]
    if bf16.widened:
        assert [(r["dtype"], r["tokens"]) for r in m["results"]] == [("fp32", 128)]
        assert m["computed_as"] == {"bf16": {"precision": "fp32", "reason": bf16.reason}}
    else:
        assert [(r["dtype"], r["tokens"]) for r in m["results"]] == [("fp32", 128), ("bf16", 128)]
        assert m["computed_as"] == {}
    assert all(r["precision"] == r["dtype"] for r in m["results"])
    packs = packing_supported()[0]
    for r in m["results"]:
        assert r["suffix_ms"] > 0 and r["eager_ms"] > 0 and r["grouped_ms"] > 0 and r["gemm_gflops"] > 0
        assert r["active_gflop"] == pytest.approx((2 * m["active_params_per_block"] * 128
                                                   + 2 * 128 * 128 * heads * head_dim) / 1e9)
        assert r["ratio_to_gemm_peak"] == pytest.approx(r["active_gflop"] / r["suffix_ms"] * 1e3 / r["gemm_gflops"])
        element = 4 if r["dtype"] == "fp32" else 2
        assert r["read_gb"] == pytest.approx(element * m["params_per_block"] / 1e9, rel=1e-6)  # 16 of 16 reached
        assert r["floor_ms"] == pytest.approx(max(r["active_gflop"] / r["gemm_gflops"] * 1e3,
                                                  r["read_gb"] / m["stream_gbs"] * 1e3))
        assert r["experts_implementation"] == "grouped_mm"
        assert r["packed_experts"] == (1 if r["dtype"] == "bf16" and packs else 0)
    ids = {"moe_fp32_vs_gemm_peak", "moe_fp32_vs_eager"}
    if not bf16.widened:
        ids |= {"moe_bf16_vs_gemm_peak", "moe_bf16_vs_eager"} | ({"moe_bf16_vs_transformers"} if packs else set())
    assert {g["id"] for g in doc["goals"]} == ids
    assert all(isinstance(g["met"], bool) for g in doc["goals"])
    md = out.with_suffix(".md").read_text()
    assert "**MoE suffix**" in md and ("bf16 is not measured apart" in md) == bf16.widened


def test_suffix_bound_warm_up_covers_the_suffix_first_frame_at_the_prefix_rate():
    """One suffix frame (hand-off + suffix + the busy wait) at the prefix rate, plus 3: from the profile's row at the
    case's K, else from the preset's measured pipeline, else 3."""
    from hybrid_vla_ros.tools.bench.pipeline import _suffix_bound_warmup

    plan = {"choice": {"table": [[0, 80.0, 10.0], [2, 82.0, 4.0]]}}
    assert _suffix_bound_warmup(plan, 2, 2000) == math.ceil(2004 / 82) + 3 == 28
    measured = {"prefix_side_ms": {"p50": 50.0}, "handoff_suffix_side_ms": {"p50": 5.0}}
    assert _suffix_bound_warmup({"choice": None}, 2, 150, measured) == math.ceil(155 / 50) + 3 == 7
    assert _suffix_bound_warmup({}, 2, 150) == 3


def test_quick_pipeline_and_preprocess_run(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_main(["--quick", "--only", "pipeline,preprocess", "--presets", "tiny", "--split", "tiny=2",
                     "--frames", "3", "--warmup-frames", "1", "--sequential", "1core", "--preprocess-frames", "1",
                     "--suffix-bound", "tiny:2:250",  # a margin over the prefix, which a loaded machine slows
                     "--model-cache", str(tmp_path / "models"), "--json", str(out), "--plots", str(tmp_path / "p"),
                     "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert report.validate(doc) == []
    e = doc["pipeline"]["presets"][0]
    assert e["split_layer"] == 2 and e["pipeline"]["frames_measured"] == 3
    assert e["pipeline"]["fps"] > 0 and e["sequential"]["1core"]["fps"] > 0
    bound = doc["pipeline"]["suffix_bound"]
    assert set(bound["variants"]) == {"fifo", "newest", "newest_paced"}
    assert "error" not in bound, bound.get("error")
    for v in bound["variants"].values():  # the busy wait reached the frames' suffix stage (it once did not)
        assert v["frames_measured"] > 0 and v["stages_ms"]["suffix_ms"]["min"] >= 250
    rows = doc["preprocess"]["results"]
    cases = {(r["preset"], r["input"], r["decoder"], r["resize"]) for r in rows}
    assert cases == {("tiny", "jpeg", "opencv", "area"), ("tiny", "jpeg", "simplejpeg", "area"),
                     ("tiny", "jpeg_fast", "opencv", "area"), ("tiny", "jpeg_fast", "simplejpeg", "area"),
                     ("tiny", "rgb8", None, "area"), ("tiny", "rgb8", None, "bilinear"),
                     ("tiny", "rgb8", None, "bicubic"), ("tiny", "rgb8", None, "orion_crop")}
    assert all(0 < r["share"] < 1 and r["limit_ms"] > 0 for r in rows)
    assert all(r["ratio_to_limit"] == r["preprocess_ms"]["p50"] / r["limit_ms"] for r in rows)
    assert {g["id"] for g in doc["goals"]} == {
        "pipeline_efficiency_tiny", "pipeline_latency_tiny", "pipeline_latency_suffix_bound",
        "preprocess_rgb8_tiny_area", "preprocess_rgb8_tiny_bilinear", "preprocess_rgb8_tiny_bicubic",
        "preprocess_rgb8_tiny_orion_crop"}
    assert all(Path(tmp_path / "p" / f).is_file() for f in ("pipeline.png", "pipeline_timeline.png", "preprocess.png"))


def test_a_query_head_model_runs_the_preprocessing_part_with_the_bags_calibration(tmp_path):
    """A model with the published query heads (each frame needs its camera geometry and ego frame), at a small size:
    the preprocessing part completes, every case measured (it once dropped every frame of minddrive-0.5b for want of
    SceneInputs), with the scene made from the embedded bag's CameraInfo, /tf_static and odometry as a prefix node
    makes it (:func:`bag_scene`, which the pipeline part uses the same way). The part's worker is the one ``bench
    --only preprocess`` starts; a preset's full size only makes each frame slower (minddrive-0.5b: 10 s here)."""
    from test_pipeline import SCENE_QUERY_OVERRIDES

    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.tools.bench.preprocess import run_preprocess_part

    path = tmp_path / "heads"
    cfg = init_model("tiny", path, overrides=dict(SCENE_QUERY_OVERRIDES))
    assert cfg.projector["type"] == "scene_queries"
    lines = []
    part = run_preprocess_part({"tiny-heads": {"model_path": str(path), "split_layer": 2}}, dtype="fp32",
                               min_frames=1, min_seconds=0.0, log=lines.append)
    rows = part["results"]
    assert len(rows) >= 6 and all(r["preset"] == "tiny-heads" and r["frames"] >= 1 for r in rows)
    assert all(r["prefix_ms"]["p50"] > 0 and r["preprocess_ms"]["p50"] > 0 for r in rows)


def test_the_bench_scene_projects_what_lies_ahead_of_the_car_into_a_camera():
    """:func:`bag_scene` on the embedded bag: the model frame sits at the node's default origin (its pose in the
    odometry frame is the first odometry message's, as the node's is at that stamp), and a point 10 m ahead of the
    car at 1 m height falls inside some camera's image in front of it, and behind every camera that looks back."""
    from hybrid_vla_ros.model.config import takes_scene
    from hybrid_vla_ros.tools.bench.pipeline import bag_scene

    cfg = preset("minddrive-0.5b")
    assert takes_scene(cfg) and bag_scene(preset("tiny")) is None
    scene = bag_scene(cfg)
    scene.frame.check()
    lidar2img = scene.lidar2img.double()
    assert lidar2img.shape == (cfg.n_cameras, 4, 4) and torch.isfinite(lidar2img).all()
    # the model frame: x = -y_base_link, y = x_base_link (forward), z up; its origin 1.84 m up at the default origin
    ahead = torch.tensor([0.0, 10.0, 1.0 - 1.84, 1.0], dtype=torch.float64)
    seen = []
    for cam in lidar2img:
        u, v, depth = (cam @ ahead)[:3]
        if depth > 0 and 0 <= u / depth < cfg.image_size and 0 <= v / depth < cfg.image_size:
            seen.append(float(depth))
    assert seen and min(seen) > 5, seen
    assert len(seen) < cfg.n_cameras  # the cameras looking back do not see it


def test_quick_load_step_runs_fixed_and_rebalancing_side_by_side(tmp_path):
    """The load-step part on tiny: four pipelines (co-tenant on the suffix's, then the prefix's core; K fixed and
    rebalanced live), every phase measured; K never moves in a fixed run, and a rebalancing run moves it within
    [0, L] with a reason (predicted or measured), each frame computed at the K in its slot (the K recorded by the
    suffix is the one the prefix used)."""
    out = tmp_path / "bench.json"
    rc = bench_main(["--quick", "--only", "loadstep", "--presets", "tiny", "--load-step", "2:6:3",
                     "--warmup-frames", "1", "--model-cache", str(tmp_path / "models"), "--json", str(out),
                     "--plots", str(tmp_path / "p"), "--quiet"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert report.validate(doc) == [] and doc["errors"] == {}
    e = doc["loadstep"]["presets"][0]
    assert set(e["runs"]) == {"suffix_fixed", "suffix_rebalance", "prefix_fixed", "prefix_rebalance"}
    for name, run in e["runs"].items():
        ph = run["phases"]
        assert ph["before"]["n"] >= 1 and ph["during"]["n"] >= 1 and ph["after"]["n"] >= 1, (name, ph)
        assert all(x["e2e_ms"] > 0 and x["stage_sum_ms"] > 0 for x in run["frames"])
        if name.endswith("fixed"):
            assert run["moves"] == [] and {x["k"] for x in run["frames"]} == {e["split_layer"]}
        for m in run["moves"]:
            assert m["to_k"] != m["from_k"] and 0 <= m["to_k"] <= 4 and "predicted" in m["reason"]
    ids = {g["id"] for g in doc["goals"]}
    assert {"loadstep_latency_tiny_suffix", "loadstep_settle_tiny_prefix", "loadstep_gain_tiny_suffix"} <= ids
    assert (tmp_path / "p" / "loadstep.png").stat().st_size > 1000
    assert "**Load step** (tiny" in out.with_suffix(".md").read_text()


def test_markdown_and_goals_of_a_synthetic_document(tmp_path):
    pct = {"n": 3, "p50": 0.4, "p90": 0.5, "mean": 0.4, "min": 0.3, "max": 0.5}
    rpct = {**pct, "p50": 20.0, "p90": 25.0}
    doc = {"kind": report.KIND, "host": {}, "software": {}, "noise": {}, "errors": {}, "goals": [],
           "handoff": {"producer_cores": [0], "consumer_cores": [1], "count": 3, "rclpy_count": 3,
                       "variants": {"default": "x"},
                       "sizes": [{"size_mib": 8.0, "memcpy": {"latency_ms": pct},
                                  "ring": {"latency_ms": pct, "copy_ms": pct, "publish_to_view_ms": pct,
                                           "cpu_ms_per_msg": {"total": 0.5}},
                                  "rclpy": {"default": {"latency_ms": rpct, "cpu_ms_per_msg": {"total": 9.0},
                                                        "lost": 0}},
                                  "best_rclpy": "default", "ratio_best_rclpy_over_ring_p50": 50.0,
                                  "ratio_ring_over_memcpy_p50": 1.0}]}}
    goals = report.evaluate_goals(doc)
    assert [(g["id"], g["met"]) for g in goals] == [("handoff_vs_memcpy_8mib", True), ("handoff_vs_rclpy_8mib", True)]
    doc["handoff"]["sizes"][0]["ratio_ring_over_memcpy_p50"] = 1.31  # 1.3x the same run's memcpy at most
    assert report.evaluate_goals(doc)[0]["met"] is False
    # a document with the memcpy after the producer's wait is judged against that one
    doc["handoff"]["sizes"][0].update(memcpy_after_wait={"latency_ms": {**pct, "p50": 0.35}, "wait_ms": 0.2},
                                      ratio_ring_over_memcpy_after_wait_p50=1.14)
    first = report.evaluate_goals(doc)[0]
    assert first["met"] is True and first["value"] == 1.14 and "after the same 0.200 ms wait" in first["what"]
    doc["goals"] = goals
    md = report.markdown(doc)
    assert "| 8 MiB |" in md and "50.0x" in md and "| yes |" in md
    assert json.loads(report.write_json({"x": float("nan")}, tmp_path / "a.json").read_text()) == {"x": None}


# ------------------------------------------------------------------------------------------ suffix goals, peer

def _flops_row(preset_name, dtype, backend, ratio, best_ratio, restart=None):
    row = {"preset": preset_name, "dtype": dtype, "backend": backend, "ratio": ratio, "ratio_vs_best_peak": best_ratio}
    if restart is not None:
        row["restart"] = restart
    return row


def test_suffix_goals_take_the_best_backend_against_the_faster_gemm_and_need_a_reused_artifact():
    """bf16 on a CPU without bf16 instructions: torch's bf16 GEMM is slow, so a backend computing in f32 has a
    ratio of several against it; the goal compares it with the faster (fp32) GEMM instead."""
    rows = [_flops_row("smol", "bf16", "eager", 0.95, 0.11),
            _flops_row("smol", "bf16", "openvino", 6.7, 0.86, {"backend_extra_s": 1.2, "cache_hit": True}),
            _flops_row("smol", "fp32", "eager", 0.6, 0.6),
            _flops_row("smol", "fp32", "openvino", 0.88, 0.88, {"backend_extra_s": 0.8, "cache_hit": False})]
    peer = {"tokens": 81, "ours": [{"dtype": "bf16", "backend": "eager", "time_ms": 900.0},
                                   {"dtype": "bf16", "backend": "openvino", "time_ms": 200.0}],
            "llama_cpp": {"q4_1": {"median_ms": 300.0}, "f32": {"median_ms": 150.0}}}
    doc = {"suffix_flops": {"results": rows, "goal_ratio": 0.6, "goal_ratio_best": {"bf16": 0.85, "fp32": 0.9},
                            "goal_restart_s": 3.0, "peer": peer}}
    goals = {g["id"]: g for g in report.evaluate_goals(doc)}
    assert goals["suffix_flops_smol_bf16"]["met"] and goals["suffix_flops_smol_fp32"]["met"]  # 0.6 >= 0.6
    best16 = goals["suffix_flops_best_smol_bf16"]
    assert best16["value"] == 0.86 and best16["met"] and "openvino" in best16["what"]
    best32 = goals["suffix_flops_best_smol_fp32"]
    assert best32["value"] == 0.88 and best32["met"] is False
    assert goals["suffix_restart_smol_bf16_openvino"]["met"]
    assert goals["suffix_restart_smol_fp32_openvino"]["met"] is False, "fast, but the artifact was not reused"
    assert goals["suffix_peer_llama_cpp_q4_1"]["value"] == 1.5 and goals["suffix_peer_llama_cpp_q4_1"]["met"]
    assert goals["suffix_peer_llama_cpp_f32"]["value"] == 0.75 and goals["suffix_peer_llama_cpp_f32"]["met"] is False
    assert "suffix_flops_best_minddrive-0.5b_bf16" not in goals  # not measured: no goal


def test_dequantised_gguf_export_keeps_the_fields_and_the_dequantised_values(tmp_path):
    """A small GGUF with a Q8_0 matrix and an F32 norm gain, written and exported with the gguf package."""
    import gguf
    import numpy as np

    from hybrid_vla_ros.tools.bench.llama_peer import export_dequantised_gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    g = rng.standard_normal(64).astype(np.float32)
    src = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_block_count(1)
    writer.add_string("general.name", "tiny test")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_file_type(7)  # MOSTLY_Q8_0
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", g)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    expected = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                      gguf.GGMLQuantizationType.Q8_0)
    for kind, ftype, qtype in (("f32", 0, gguf.GGMLQuantizationType.F32),
                               ("bf16", 32, gguf.GGMLQuantizationType.BF16)):
        out = gguf.GGUFReader(str(export_dequantised_gguf(src, tmp_path / f"{kind}.gguf", kind)))
        assert out.fields["general.name"].contents() == "tiny test"
        assert out.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
        assert out.fields["general.file_type"].contents() == ftype and "general.quantization_version" not in out.fields
        t = {x.name: x for x in out.tensors}
        q = t["blk.0.attn_q.weight"]
        assert q.tensor_type == qtype and list(reversed(q.shape.tolist())) == [8, 64]
        got = gguf.quants.dequantize(q.data, q.tensor_type).reshape(8, 64)
        np.testing.assert_allclose(got, expected, rtol=0 if kind == "f32" else 2**-8, atol=0)
        assert t["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(t["blk.0.attn_norm.weight"].data, g)
    with pytest.raises(ValueError, match="kind"):
        export_dequantised_gguf(src, tmp_path / "x.gguf", "q4")


def test_llama_cpp_build_is_found_reused_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    """``--build-llama-cpp``: the peer imports llama_cpp from the build folder in the cache (a package placed there
    stands in for the real build, which takes minutes); a folder that holds a build is reused without running pip;
    a failing pip, or one past its time limit, raises with the reason and removes the half-built folder. Each case
    in a child process, so this process never imports the stand-in."""
    import subprocess
    import sys

    monkeypatch.setenv("HYBRID_VLA_CACHE", str(tmp_path))
    script = r'''
import subprocess, sys
from hybrid_vla_ros.tools.bench import llama_peer as lp
d = lp.llama_cpp_build_dir()
ok, reason = lp.llama_cpp_status()
print("before", ok, "--build-llama-cpp" in reason)
(d / "llama_cpp").mkdir(parents=True)
(d / "llama_cpp" / "__init__.py").write_text("WHERE = 'cache'\n")
calls = []
lp.subprocess.run = lambda *a, **k: calls.append(a) or subprocess.CompletedProcess(a, 1, "", "cmake: not found")
print("reused", lp.build_llama_cpp(log=lambda line: None), calls == [])
ok, reason = lp.llama_cpp_status()
import llama_cpp
print("after", ok, llama_cpp.WHERE, str(d) in sys.path)
import shutil
shutil.rmtree(d)
try:
    lp.build_llama_cpp(log=lambda line: None)
except RuntimeError as e:
    print("failed", "cmake: not found" in str(e), d.exists(), d.with_name(d.name + ".building").exists(),
          len(calls))
def too_long(*a, **k):
    d.with_name(d.name + ".building").mkdir(parents=True, exist_ok=True)
    raise subprocess.TimeoutExpired(a[0], k["timeout"])
lp.subprocess.run = too_long
try:
    lp.build_llama_cpp(log=lambda line: None, timeout_s=5)
except RuntimeError as e:
    print("timeout", "longer than 5 s" in str(e), d.with_name(d.name + ".building").exists())
'''
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "before False True", lines
    assert lines[1].startswith("reused {") and "'built': False" in lines[1] and lines[1].endswith("True"), lines
    assert lines[2] == "after True cache True", lines
    assert lines[3] == "failed True False False 1", lines
    assert lines[4] == "timeout True False", lines


def test_quick_decode_part_measures_the_suffix_against_its_bandwidth_floor_and_the_round_trip(tmp_path):
    """Issue 40: the real SmolLM2-135M decoding at K = 20 and K = 0 in fp32 and bf16; the floor counts the suffix's
    weights, LM head and static KV cache (its ratio to the measured time is a fraction: a byte count off by a block
    or the head would show), and the round trip crosses between two processes. On a CPU without native bf16, bf16
    is computed in fp32 as a suffix node computes it: not measured twice, named in ``computed_as``."""
    from hybrid_vla_ros.util.precision import inference_precision

    bf16 = inference_precision(torch.bfloat16)
    out = tmp_path / "bench.json"
    rc = bench_main(["--quick", "--only", "decode", "--decode-split-layer", "20", "--json", str(out), "--quiet"])
    doc = json.loads(out.read_text())
    assert rc == 0, doc["errors"]
    d = doc["decode"]
    measured = [(0, "fp32", "eager"), (20, "fp32", "eager"), (20, "fp32", "inductor")]
    if bf16.widened:
        assert d["computed_as"] == {"bf16": {"precision": "fp32", "reason": bf16.reason}}
        assert "bf16 is not measured apart" in out.with_suffix(".md").read_text()
    else:
        measured += [(0, "bf16", "eager"), (20, "bf16", "eager")]
    # --quick: the compiled step at the split layer in fp32 only (one short build)
    assert sorted((r["k"], r["dtype"], r["step"]) for r in d["rows"]) == sorted(measured)
    assert all(r["precision"] == r["dtype"] for r in d["rows"])
    rows = {(r["k"], r["dtype"]): r for r in d["rows"] if r["step"] == "eager"}
    compiled = next(r for r in d["rows"] if r["step"] == "inductor")
    assert compiled["build_s"] > 0 and compiled["suffix_weight_bytes"] == rows[(20, "fp32")]["suffix_weight_bytes"]
    assert compiled["same_tokens_as_eager"]  # fp32: the compiled step decodes the eager tokens
    for r in d["rows"]:
        assert r["suffix_token_ms"]["n"] == 15 and 0.1 < r["bandwidth_ratio"] < 1.5, r
        # the floor is this row's bytes over the bandwidth measured next to it
        assert r["floor_ms"] == pytest.approx((r["suffix_weight_bytes"] + r["suffix_kv_bytes"])
                                              / (r["bandwidth_gbs"] * 1e9) * 1e3), r
    # the suffix at K = 20 reads 10 blocks, the final norm and the (tied) 49152 x 576 head; at K = 0 all 30 blocks
    block = (rows[(0, "fp32")]["suffix_weight_bytes"] - rows[(20, "fp32")]["suffix_weight_bytes"]) / 20
    assert rows[(20, "fp32")]["suffix_weight_bytes"] == pytest.approx(10 * block + 49152 * 576 * 4, rel=1e-3)
    if not bf16.widened:
        assert rows[(20, "bf16")]["suffix_weight_bytes"] * 2 == pytest.approx(
            rows[(20, "fp32")]["suffix_weight_bytes"], rel=1e-3)
    assert d["round_trip"]["n"] > 200 and 0 < d["round_trip"]["p50_us"] <= d["round_trip"]["p99_us"]
    o = d["overlap"]  # both orders ran every frame's decode to its end, and the overlap's chunks were measured
    for name in ("sequential", "overlap"):
        assert o[name]["ended"] == ["max_new_tokens"] * o["frames"], o[name]
        assert 0 < o[name]["ratio"] and o[name]["prefix_busy_ms"] > 0 and o[name]["suffix_busy_ms"] > 0
        # frames/s in steady state: frames out over the span of their decode ends, from the first frame's to the
        # one before the last's (the last decodes with no prefill beside it)
        ends = o[name]["decode_end_s"]
        assert len(ends) == o["frames"] == 3 and ends == sorted(ends)
        assert o[name]["frames_per_s_steady"] == pytest.approx(1 / (ends[1] - ends[0]))
        assert o[name]["frames_per_s_whole_run"] <= o["frames"] / ends[-1]  # the whole run holds every decode
    assert o["sequential"]["step_held_max_ms"] < 1.0 < o["overlap"]["step_held_max_ms"]
    seq = o["sequential"]
    assert o["overlap"]["ratio_vs_sequential_busy"] == pytest.approx(
        o["overlap"]["frames_per_s_steady"] * max(seq["prefix_busy_ms"], seq["suffix_busy_ms"]) / 1e3)
    wanted = {"decode_bandwidth_fp32", "decode_round_trip_p50", "decode_overlap"}
    assert wanted <= {g["id"] for g in doc["goals"]}
    assert ("decode_bandwidth_bf16" in {g["id"] for g in doc["goals"]}) != bf16.widened
    assert "**Decode**" in out.with_suffix(".md").read_text()


def test_the_decode_overlap_refuses_what_it_cannot_measure_and_a_decode_that_ended_early_misses_its_goal():
    """Fewer than 3 frames (no steady state between the first and the last) or no token are refused before any
    worker starts; a run where a decode met a stop token is not compared with the goal (it ran fewer steps)."""
    from hybrid_vla_ros.tools.bench.decode_overlap import check_overlap, overlap_goals

    for tokens, frames in ((16, 2), (0, 8)):
        with pytest.raises(ValueError, match="needs"):
            check_overlap(tokens, frames)
    check_overlap(16, 3)
    full = ["max_new_tokens"] * 3
    for ended, met in ((full, True), (["max_new_tokens", "stop_token", "max_new_tokens"], False)):
        goals = []
        o = {"goal_ratio": 0.9, "sequential": {"ended": full}, "overlap": {"ratio": 0.95, "ended": ended}}
        overlap_goals(o, lambda *goal: goals.append(goal))
        assert [(g[0], g[-1]) for g in goals] == [("decode_overlap", met)], goals
