"""Split planner and profiler: exact weight bytes, hand-off bytes, the activation estimate against a measured
peak, the choice of K on handcrafted profiles, planning a 7B preset on the meta device, profile files and the CLI."""
import copy
import json
import uuid

import psutil
import pytest
import torch

from hybrid_vla_ros.model.checkpoint import load_stage
from hybrid_vla_ros.model.config import preset
from hybrid_vla_ros.model.modeling import PrefixStage, SuffixStage
from hybrid_vla_ros.split.planner import (
    GB,
    PlanRow,
    activation_peak,
    activation_phases,
    choose_split_layer,
    format_table,
    handoff_bytes,
    plan_for_checkpoint,
    plan_for_preset,
    plan_split,
    stage_weights,
)
from hybrid_vla_ros.split.profiler import (
    PROFILE_FORMAT_VERSION,
    load_profile,
    measure_peak_cpu_bytes,
    profile_model,
    validate_profile,
    write_profile,
)
from hybrid_vla_ros.tools.cli import main
from hybrid_vla_ros.transport.ring import RingConsumer, RingProducer, segment_name, slot_bytes_for


def _stage_bytes(stage):
    """Measured bytes of a loaded stage: (parameters + persistent buffers, non-persistent buffers)."""
    persistent = set(stage.state_dict())
    weights = sum(p.numel() * p.element_size() for p in stage.parameters())
    weights += sum(b.numel() * b.element_size() for n, b in stage.named_buffers() if n in persistent)
    other = sum(b.numel() * b.element_size() for n, b in stage.named_buffers() if n not in persistent)
    return weights, other


# ------------------------------------------------------------------------------------------ bytes

def test_the_cpu_suffix_is_counted_in_the_precision_a_suffix_node_computes_in():
    """A bf16 plan on a CPU without native bf16 (an AVX2 host's flags) counts the CPU suffix in the fp32 a suffix
    node with ``inference_precision: auto`` loads it in (2x the bf16 bytes), the GPU prefix in bf16, and says why;
    on a CPU with AMX, or with ``dtype``, the suffix stays bf16."""
    from hybrid_vla_ros.util.precision import CpuFeatures

    avx2 = CpuFeatures("AMD EPYC", "x86", frozenset({"sse2", "avx", "avx2", "fma", "f16c"}))
    amx = CpuFeatures("Intel Xeon", "x86", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
    cfg = preset("smol")
    fp32, bf16 = plan_split(cfg, "fp32"), plan_split(cfg, "bf16", cpu=amx)
    widened = plan_split(cfg, "bf16", cpu=avx2)
    kept = plan_split(cfg, "bf16", cpu=avx2, cpu_precision="dtype")
    assert (widened.dtype, widened.suffix_dtype, bf16.suffix_dtype, kept.suffix_dtype) == ("bf16", "fp32", "bf16",
                                                                                           "bf16")
    for w, f, b, k in zip(widened.rows, fp32.rows, bf16.rows, kept.rows):
        assert w.cpu_weight_bytes == f.cpu_weight_bytes == 2 * b.cpu_weight_bytes == 2 * k.cpu_weight_bytes
        assert w.cpu_total_bytes == f.cpu_total_bytes and b.cpu_total_bytes == k.cpu_total_bytes
        assert w.gpu_total_bytes == b.gpu_total_bytes < f.gpu_total_bytes or w.k == 0
    assert fp32.rows[0].cpu_weight_bytes > 0
    assert any("the CPU suffix's memory counts fp32: bf16 asked: computed in fp32" in n for n in widened.notes)
    assert not any("CPU suffix's memory" in n for n in bf16.notes + kept.notes)
    assert "(the CPU suffix in fp32)" in format_table(widened) and "CPU suffix in" not in format_table(bf16)
    with pytest.raises(ValueError, match="inference_precision must be one of"):
        plan_split(cfg, "bf16", cpu_precision="fast")


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_weight_bytes_equal_the_loaded_stages_for_every_k(tiny_checkpoint, dtype):
    plan = plan_for_checkpoint(tiny_checkpoint, dtype=dtype, cpu_precision="dtype")  # the suffix kept in dtype
    assert len(plan.rows) == plan.num_layers + 1 == 5
    for row in plan.rows:
        pre = load_stage(tiny_checkpoint, "prefix", row.k, dtype=dtype)
        suf = load_stage(tiny_checkpoint, "suffix", row.k, dtype=dtype)
        pre_w, pre_buf = _stage_bytes(pre)
        suf_w, suf_buf = _stage_bytes(suf)
        assert row.gpu_weight_bytes == pre_w, row.k
        assert row.gpu_buffer_bytes == pre_buf, row.k
        assert row.cpu_weight_bytes == suf_w, row.k
        assert row.cpu_total_bytes == suf_w + suf_buf + row.cpu_activation_bytes
        assert row.gpu_total_bytes == pre_w + pre_buf + row.gpu_activation_bytes + row.gpu_overhead_bytes


@pytest.mark.parametrize("name,dtype", [("tiny", torch.float32), ("tiny", torch.float16),
                                        ("minddrive-0.5b", torch.bfloat16)])
def test_handoff_bytes_equal_the_ring_slot_payload(name, dtype):
    cfg = preset(name)
    nbytes = handoff_bytes(cfg, dtype)
    row = plan_split(cfg, dtype).rows[0]
    assert row.handoff_bytes == nbytes
    assert row.ring_slot_bytes == slot_bytes_for(cfg.prefix_state_shape, dtype)
    ring = segment_name(f"test_plan_{uuid.uuid4().hex[:8]}")
    with RingProducer(ring, 3, row.ring_slot_bytes, model_id=1) as prod, RingConsumer(ring) as cons:
        slot = prod.acquire(cfg.prefix_state_shape, dtype)
        assert slot.tensor.numel() * slot.tensor.element_size() == nbytes
        prod.publish(slot, stamp_ns=1, split_layer=0)
        got = cons.read(1.0)
        assert got.meta.nbytes == nbytes and tuple(got.tensor.shape) == cfg.prefix_state_shape
        got.release()


def test_handoff_bytes_equal_the_real_prefix_output(tiny_checkpoint):
    pre = load_stage(tiny_checkpoint, "prefix", 2)
    cfg = pre.cfg
    with torch.inference_mode():
        h = pre(torch.rand(cfg.n_cameras, 3, cfg.image_size, cfg.image_size))
    assert h.numel() * h.element_size() == handoff_bytes(cfg, torch.float32)


# ------------------------------------------------------------------------------------ activations

def _pixels(cfg, dtype):
    return torch.rand(cfg.n_cameras, 3, cfg.image_size, cfg.image_size).to(dtype)


# The estimate counts every tensor the forward allocates through torch's CPU allocator; what it leaves out
# is O(tokens) or smaller (norm statistics, softmax log-sum-exp, position ids, rotary tables' sources: under
# 1 kB for tiny, i.e. < 0.2% of the peaks here). 2% covers that with margin, and a missed or doubled
# (T, H) tensor (53.8 kB = 8% of the LLM-phase peak) or a missed (C*P, Dv) tensor (24.6 kB = 5% of the
# vision-phase peak) still fails.
TOL = 0.02


def test_prefix_activation_estimate_matches_the_measured_cpu_peak_fp32(tiny_checkpoint):
    cfg = preset("tiny")
    for k in range(cfg.num_layers + 1):
        pre = load_stage(tiny_checkpoint, "prefix", k)
        pixels = _pixels(cfg, torch.float32)
        with torch.inference_mode():
            pre(pixels)
            # the pixels are allocated inside the measured call, as the estimate counts them
            _, measured = measure_peak_cpu_bytes(lambda: pre(pixels.clone()))
        estimate, phase = activation_peak(cfg, k, torch.float32, "prefix")
        assert measured > 0
        assert abs(estimate - measured) <= TOL * measured, (k, phase, estimate, measured)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llm_block_activation_estimate_matches_the_measured_cpu_peak(tiny_checkpoint, dtype, one_thread):
    """Suffix stages are LLM blocks only; with bf16 the RMSNorm's float32 working copies are exercised.

    One torch thread: with more, the CPU's bf16 matrix multiply takes per-thread packing buffers from the torch
    allocator (28 kB here), a backend workspace the estimate does not model (on CUDA such workspaces are in the
    overhead allowance). fp32 needs none, at any thread count.
    """
    cfg = preset("tiny")
    for k in range(cfg.num_layers):
        suf = load_stage(tiny_checkpoint, "suffix", k, dtype=dtype)
        h = torch.randn(cfg.prefix_state_shape).to(dtype)
        with torch.inference_mode():
            suf(h)
            _, measured = measure_peak_cpu_bytes(lambda: suf(h))
        estimate, phase = activation_peak(cfg, k, dtype, "suffix")
        assert phase.startswith("llm.block") and phase.endswith(".mlp")
        assert abs(estimate - measured) <= TOL * measured, (k, estimate, measured)


def test_activation_peak_is_the_largest_phase_not_a_sum():
    cfg = preset("orion")
    phases = activation_phases(cfg, 32, "fp16")
    peak, name = activation_peak(cfg, 32, "fp16")
    assert peak == max(p.total for p in phases) < sum(p.total for p in phases)
    assert name == max(phases, key=lambda p: p.total).name
    # two passes double the LLM-side tensors
    one = preset("minddrive-0.5b", llm_passes=1)
    two = preset("minddrive-0.5b")
    mlp1 = next(p for p in activation_phases(one, 0, "fp16", "suffix") if p.name.endswith("mlp"))
    mlp2 = next(p for p in activation_phases(two, 0, "fp16", "suffix") if p.name.endswith("mlp"))
    assert mlp2.live["act_up_product"] == 2 * mlp1.live["act_up_product"]


# ------------------------------------------------------------------------------ choosing K

def _profile_for(cfg, prefix_blocks_ms, suffix_blocks_ms, *, fixed_ms=5.0, handoff_ms=1.0, head_ms=0.0):
    """A valid profile with handcrafted times: prefix on 'cuda', suffix on 'cpu', no rotary cost, a hand-off
    of ``handoff_ms`` for the model's payload."""
    nv = int(cfg.vision["num_hidden_layers"])
    payload = handoff_bytes(cfg, "fp32")

    def dev(kind, blocks, fixed):
        return {"kind": kind, "name": kind, "description": "synthetic", "cores": [0], "threads": 1,
                "parts_ms": {"vision_embeddings": fixed, "vision_post": 0.0, "projector_embed": 0.0, "rotary": 0.0,
                             "head": head_ms},
                "vision_blocks_ms": [0.0] * nv, "vision_blocks_measured": nv, "llm_blocks_ms": list(blocks),
                "llm_blocks_measured": len(blocks), "min_ms": {},
                "handoff": {"ring": [{"bytes": payload, "ms": handoff_ms, "min_ms": handoff_ms}],
                            "memcpy": [{"bytes": payload, "ms": 0.1, "min_ms": 0.1}]}}

    doc = {"format_version": PROFILE_FORMAT_VERSION, "kind": "hybrid_vla_profile",
           "created_utc": "2025-01-01T00:00:00", "torch_version": "x", "python_version": "3",
           "host": {"cpu_model": "x", "logical_cpus": 2},
           "model": {"source": "preset", "preset": cfg.preset, "path": None, "config": cfg.to_dict()},
           "dtype": "fp32", "prefix_state_shape": list(cfg.prefix_state_shape), "handoff_bytes": payload,
           "settings": {"warmup": 0, "repeats": 1, "vision_blocks": "all", "llm_blocks": "all"},
           "devices": {"cuda": dev("cuda", prefix_blocks_ms, fixed_ms), "cpu": dev("cpu", suffix_blocks_ms, 50.0)}}
    return validate_profile(doc)


def test_choose_split_layer_picks_the_known_best_k_and_respects_the_budget():
    cfg = preset("tiny")
    # GPU block 2 is pathological (50 ms): e2e(K) = 5 + 1 + sum(gpu[:K]) + sum(cpu[K:])
    #   K=0: 40, K=1: 31, K=2: 22, K=3: 62, K=4: 53  -> best K=2
    prof = _profile_for(cfg, [1, 1, 50, 1], [10, 10, 10, 10])
    plan = plan_split(cfg, "fp32", profile=prof)
    assert [round(r.e2e_ms, 6) for r in plan.rows] == [46.0, 37.0, 28.0, 68.0, 59.0]  # + the 6 ms fixed + hand-off
    assert plan.chosen_k == 2 and "K=2" in plan.reason
    assert plan.row(2).prefix_ms == 7.0 and plan.row(2).suffix_ms == 20.0 and plan.row(2).handoff_ms == 1.0
    assert plan.row(2).throughput_fps == pytest.approx(1000 / 21.0)
    # a budget between the needs of K=1 and K=2 excludes the best: K=1 is the best that fits
    budget = (plan.row(1).gpu_total_bytes + plan.row(2).gpu_total_bytes) // 2
    constrained = plan_split(cfg, "fp32", profile=prof, gpu_budget_bytes=budget)
    assert constrained.chosen_k == 1
    assert "unconstrained best, K=2" in constrained.reason
    assert [r.fits for r in constrained.rows] == [True, True, False, False, False]
    # nothing fits: a clear error naming the smallest need
    with pytest.raises(ValueError, match=r"no split layer fits .* smallest need is .* at K=0"):
        plan_split(cfg, "fp32", profile=prof, gpu_budget_bytes=plan.row(0).gpu_total_bytes - 1)


def test_choose_split_layer_tie_breaks_on_throughput_then_gpu_memory():
    def row(k, e2e, fps, gpu):
        return PlanRow(k=k, gpu_weight_bytes=gpu, gpu_activation_bytes=0, gpu_buffer_bytes=0, gpu_overhead_bytes=0,
                       gpu_total_bytes=gpu, gpu_peak_phase="", cpu_weight_bytes=0, cpu_activation_bytes=0,
                       cpu_total_bytes=0, handoff_bytes=1, ring_slot_bytes=64, prefix_ms=0, handoff_ms=0,
                       suffix_ms=0, e2e_ms=e2e, throughput_fps=fps)

    rows = [row(0, 30.0, 40.0, 100), row(1, 20.0, 50.0, 200), row(2, 20.0, 60.0, 300), row(3, 25.0, 90.0, 400)]
    assert choose_split_layer(rows, None)[0] == 2  # equal e2e: higher throughput wins; K=3 is slower
    rows[2] = row(2, 20.0, 50.0, 300)
    assert choose_split_layer(rows, None)[0] == 1  # equal e2e and throughput: less GPU memory wins
    assert choose_split_layer(rows, 250)[0] == 1
    assert choose_split_layer(rows, 150)[0] == 0
    with pytest.raises(ValueError, match="smallest need is 0.000 GB at K=0"):
        choose_split_layer(rows, 50)
    with pytest.raises(ValueError):
        choose_split_layer([], None)


def test_without_a_profile_the_largest_fitting_k_is_chosen():
    cfg = preset("tiny")
    plan = plan_split(cfg, "fp32")
    assert plan.chosen_k == cfg.num_layers and all(r.e2e_ms is None for r in plan.rows)
    assert "no profile" in plan.reason
    budget = plan.row(2).gpu_total_bytes
    assert plan_split(cfg, "fp32", gpu_budget_bytes=budget).chosen_k == 2


# ------------------------------------------------------------------------------ 7B on meta

def test_planning_orion_fp16_uses_no_real_memory_and_counts_weights_exactly():
    plan_for_preset("tiny")  # imports and first-call caches out of the way
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    plan = plan_for_preset("orion", gpu_budget_gb=29, dtype="fp16", cpu_precision="dtype")
    grown = proc.memory_info().rss - rss0
    assert grown < 200e6, f"planning orion grew RSS by {grown / 1e6:.0f} MB"
    cfg = preset("orion")
    with torch.device("meta"):
        prefix = PrefixStage(cfg, 32)
        n_params = sum(p.numel() for p in prefix.parameters())
        n_heads = sum(p.numel() for p in prefix.projector.parameters())  # the query heads stay float32
        n_suffix = sum(p.numel() for p in SuffixStage(cfg, 0).parameters())
    row = plan.row(32)
    assert row.gpu_weight_bytes == 2 * (n_params - n_heads) + 4 * n_heads
    assert plan.row(0).cpu_weight_bytes == 2 * n_suffix
    assert 6.9e9 < n_params < 7.0e9  # Vicuna-7B blocks + embeddings + ViT-L + projector
    assert plan.chosen_k == 32  # no profile: the largest K that fits 29 GB
    w = stage_weights(cfg, "fp16")
    assert all(b == w.blocks[0] for b in w.blocks) and w.blocks[0] == 2 * 202_383_360


# ------------------------------------------------------------------------------ profiles

@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("prof") / "tiny.json"
    doc = profile_model(preset_name="tiny", dtype="fp32", cores=[0], threads=1, device="cpu", repeats=2, warmup=1)
    write_profile(doc, path)
    return path


def test_profiler_writes_a_valid_profile_that_plan_consumes(tiny_profile, tmp_path, capsys):
    doc = load_profile(tiny_profile)
    cpu = doc["devices"]["cpu"]
    assert doc["format_version"] == PROFILE_FORMAT_VERSION and doc["dtype"] == "fp32"
    assert cpu["cores"] == [0] and cpu["threads"] == 1 and len(cpu["llm_blocks_ms"]) == 4
    assert all(t > 0 for t in cpu["llm_blocks_ms"] + cpu["vision_blocks_ms"])
    assert doc["handoff_bytes"] == handoff_bytes(preset("tiny"), "fp32")
    assert doc["handoff_bytes"] in [m["bytes"] for m in cpu["handoff"]["ring"]]
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--preset", "tiny", "--dtype", "fp32", "--profile", str(tiny_profile),
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "chosen split layer: K=" in text and "n/a" not in text
    plan = json.loads(out_json.read_text())
    assert len(plan["rows"]) == 5 and 0 <= plan["chosen_k"] <= 4
    assert all(r["e2e_ms"] > 0 and r["throughput_fps"] > 0 for r in plan["rows"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profiler_reads_a_checkpoint_one_block_at_a_time(tiny_checkpoint, tmp_path):
    doc = profile_model(model_path=tiny_checkpoint, device="cpu", repeats=1, warmup=0, vision_blocks="1",
                        llm_blocks="1")
    assert doc["model"]["source"] == "checkpoint"
    cpu = doc["devices"]["cpu"]
    assert cpu["vision_blocks_measured"] == 1 and cpu["llm_blocks_measured"] == 1
    assert len(set(cpu["llm_blocks_ms"])) == 1 and len(cpu["llm_blocks_ms"]) == 4
    write_profile(doc, tmp_path / "p.json")
    plan = plan_for_checkpoint(tiny_checkpoint, tmp_path / "p.json", dtype="fp32")
    assert plan.rows[0].e2e_ms is not None
    assert plan.notes[0] == "the profile has no CUDA measurements: the prefix latency is its CPU time"
    assert plan.notes[1].startswith("camera preprocessing") and doc["preprocess"]["cameras"] == 6


def test_camera_preprocessing_counts_in_the_prefix_and_moves_the_choice(tiny_checkpoint, tmp_path):
    """The profile measures decoding and resizing the embedded bag's 6 JPEG cameras; the predicted prefix time
    includes it at every K, and --preprocess-ms replaces it. A prefix dominated by its cameras (here: a given
    preprocessing time far above the blocks') moves the choice to K=0. How much the measured decode
    outweighs tiny's blocks on a given machine is a figure for `hybrid-vla bench`, not a pass/fail check."""
    doc = profile_model(model_path=tiny_checkpoint, device="cpu", repeats=2, warmup=1, vision_blocks="1",
                        llm_blocks="1")
    pre_ms = doc["preprocess"]["ms"]
    assert pre_ms > 0 and doc["preprocess"]["cameras"] == 6
    write_profile(doc, tmp_path / "p.json")
    with_pre = plan_for_checkpoint(tiny_checkpoint, tmp_path / "p.json", dtype="fp32")
    without = plan_for_checkpoint(tiny_checkpoint, tmp_path / "p.json", dtype="fp32", preprocess_ms=0.0)
    given = plan_for_checkpoint(tiny_checkpoint, tmp_path / "p.json", dtype="fp32", preprocess_ms=10.0)
    for a, b, c in zip(with_pre.rows, without.rows, given.rows):
        assert a.prefix_ms - b.prefix_ms == pytest.approx(pre_ms)
        assert c.prefix_ms - b.prefix_ms == pytest.approx(10.0)
    # prefix-bound by the cameras: the highest throughput is with the fewest blocks on the prefix
    blocks_ms = sum(doc["devices"]["cpu"]["llm_blocks_ms"])
    camera_bound = plan_for_checkpoint(tiny_checkpoint, tmp_path / "p.json", dtype="fp32",
                                       preprocess_ms=1000 * blocks_ms)
    assert camera_bound.chosen_k == 0
    with pytest.raises(ValueError, match="preprocess_ms"):
        plan_for_checkpoint(tiny_checkpoint, tmp_path / "p.json", preprocess_ms=float("nan"))


def test_bad_profiles_are_rejected_with_clear_errors(tiny_profile, tmp_path):
    good = json.loads(tiny_profile.read_text())

    def broken(edit):
        doc = copy.deepcopy(good)
        edit(doc)
        path = tmp_path / f"bad_{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(doc))
        return path

    with pytest.raises(ValueError, match="format_version 99"):
        load_profile(broken(lambda d: d.update(format_version=99)))
    with pytest.raises(ValueError, match="devices/cpu/parts_ms: 'head' is a required property"):
        load_profile(broken(lambda d: d["devices"]["cpu"]["parts_ms"].pop("head")))
    with pytest.raises(ValueError, match="devices/cpu/llm_blocks_ms: has 3 entries, the model has 4"):
        load_profile(broken(lambda d: d["devices"]["cpu"]["llm_blocks_ms"].pop()))
    with pytest.raises(ValueError, match="devices/cpu/handoff/ring/0/ms: -1 is less than the minimum"):
        load_profile(broken(lambda d: d["devices"]["cpu"]["handoff"]["ring"][0].update(ms=-1)))
    bad = tmp_path / "notjson.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(bad)
    # a profile of another architecture is refused by the planner
    with pytest.raises(ValueError, match="another architecture"):
        plan_for_preset("smol", tiny_profile)


# ------------------------------------------------------------------------------ CLI

def test_cli_plan_orion_json_and_budget_error(tmp_path, capsys):
    out = tmp_path / "orion.json"
    assert main(["plan", "--preset", "orion", "--gpu-budget-gb", "29", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen split layer: K=32" in text and "n/a" in text
    plan = json.loads(out.read_text())
    assert plan["chosen_k"] == 32 and plan["dtype"] == "fp16" and len(plan["rows"]) == 33
    k32 = plan["rows"][32]
    assert k32["gpu_total_bytes"] == (k32["gpu_weight_bytes"] + k32["gpu_activation_bytes"] + k32["gpu_buffer_bytes"]
                                      + k32["gpu_overhead_bytes"])
    assert k32["gpu_overhead_bytes"] == 1 * GB
    assert main(["plan", "--preset", "orion", "--gpu-budget-gb", "1"]) == 1
    assert "no split layer fits the GPU budget of 1.000 GB: the smallest need is" in capsys.readouterr().err
    assert main(["plan", "--preset", "orion", "--cuda-overhead-gb", "0", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["gpu_overhead_bytes"] == 0


def test_cli_profile_and_argument_errors(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--preset", "tiny", "--cores", "0", "--threads", "1", "--device", "cpu",
                 "--repeats", "1", "--vision-blocks", "1", "--quiet", "--out", str(out)]) == 0
    assert load_profile(out)["devices"]["cpu"]["vision_blocks_measured"] == 1
    assert main(["profile", "--preset", "tiny", "--cores", "4096", "--quiet", "--out", str(out)]) == 1
    assert "cannot pin to cores [4096]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "--preset", "tiny", "--cores", "a,b", "--out", str(out)])
    if not torch.cuda.is_available():
        assert main(["profile", "--preset", "tiny", "--device", "cuda", "--out", str(out)]) == 1
        assert "CUDA is not available" in capsys.readouterr().err
