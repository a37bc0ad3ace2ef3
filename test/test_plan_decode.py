"""Plan and profile with a decode (issue 40): per-token steps per decoder block measured against a KV cache,
both KV caches in the memory of every K, the frame's decode in its latency, and a decode-heavy model choosing
another K than its prefill-only twin."""
import copy
import json

import pytest

from hf_builders import write_qwen2
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.config import preset
from hybrid_vla_ros.split.planner import plan_split
from hybrid_vla_ros.split.profiler import load_profile, profile_model, validate_profile, write_profile
from hybrid_vla_ros.tools.cli import main

T = 32


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = write_qwen2(tmp_path_factory.mktemp("q") / "qwen2")
    doc = profile_model(model_path=path, dtype="fp32", device="cpu", tokens=T, repeats=3, warmup=1, decode=True)
    profile = tmp_path_factory.mktemp("p") / "profile.json"
    write_profile(doc, profile)
    return path, profile


def test_the_profile_times_a_decode_step_of_every_block_and_the_lm_head(qwen2):
    _, profile = qwen2
    dec = load_profile(profile)["devices"]["cpu"]["decode"]
    assert dec["context_tokens"] == T and len(dec["llm_block_step_ms"]) == 3
    assert all(t > 0 for t in dec["llm_block_step_ms"]) and dec["lm_head_step_ms"] > 0


def test_the_plan_counts_both_kv_caches_and_the_decode_in_every_row(qwen2, tmp_path, capsys):
    path, profile = qwen2
    cfg = open_checkpoint(path, tokens=T).model
    text = open_checkpoint(path, tokens=T).split_model().text_config()
    doc = load_profile(profile)
    n = 8
    base = plan_split(cfg, "fp32", profile=doc)
    plan = plan_split(cfg, "fp32", profile=doc, decode_tokens=n)
    per_layer = 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * (T + n - 1) * 4
    steps = doc["devices"]["cpu"]["decode"]
    for r, b in zip(plan.rows, base.rows):
        # the prefix's two caches: the decoding frame's and the next prefill's (decode_overlap)
        assert r.gpu_kv_bytes == 2 * r.k * per_layer and r.cpu_kv_bytes == (3 - r.k) * per_layer
        assert r.gpu_total_bytes == b.gpu_total_bytes + r.gpu_kv_bytes
        assert r.cpu_total_bytes == b.cpu_total_bytes + r.cpu_kv_bytes
        assert r.prefix_token_ms == pytest.approx(sum(steps["llm_block_step_ms"][:r.k]))
        assert r.suffix_token_ms == pytest.approx(sum(steps["llm_block_step_ms"][r.k:]) + steps["lm_head_step_ms"])
        assert r.decode_ms == pytest.approx(steps["lm_head_step_ms"] + (n - 1) * (
            r.prefix_token_ms + r.round_trip_ms + r.suffix_token_ms))
        assert r.e2e_ms == pytest.approx(b.e2e_ms + r.decode_ms)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(path), "--tokens", str(T), "--dtype", "fp32", "--profile", str(profile),
                 "--decode-tokens", str(n), "--json", str(out), "--plot", str(tmp_path / "plan.png")]) == 0
    assert "decode ms" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][1]["decode_tokens"] == n
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_a_profile_without_decode_steps_is_refused_for_a_decode_plan(tmp_path):
    cfg = preset("tiny")
    doc = profile_model(preset_name="tiny", dtype="fp32", device="cpu", repeats=1, warmup=0, llm_blocks="1",
                        vision_blocks="1")
    assert "decode" not in doc["devices"]["cpu"]
    with pytest.raises(ValueError, match="profile --decode"):
        plan_split(cfg, "fp32", profile=doc, decode_tokens=4)
    with pytest.raises(ValueError, match="decode_tokens must be an integer >= 0"):
        plan_split(cfg, "fp32", profile=doc, decode_tokens=-1)


def test_a_decode_heavy_model_chooses_another_split_layer_than_its_prefill_only_twin(qwen2):
    """The measured CPU profile (its prefill times fixed at 5 ms a block, nothing else), and a GPU beside it that
    prefills each block as fast as the CPU but steps a token through it 10x faster (a decode step reads every
    weight once: the GPU's memory bandwidth). Prefill-only, every K costs about the same and the pipelined
    throughput picks a balanced split; with 64 tokens a frame the decode
    term falls with every block moved to the GPU and the plan moves K up to L. With a GPU budget, the prefix's KV
    cache takes memory, and a decode-heavy model fits fewer blocks."""
    path, profile = qwen2
    cfg = open_checkpoint(path, tokens=T).model
    doc = copy.deepcopy(load_profile(profile))
    cpu = doc["devices"]["cpu"]
    # every prefill time fixed (measured ones move with the machine's load): only the blocks cost, 5 ms each
    cpu["parts_ms"] = {part: 0.0 for part in cpu["parts_ms"]}
    cpu["vision_blocks_ms"] = [0.0] * len(cpu["vision_blocks_ms"])
    cpu["llm_blocks_ms"] = [5.0, 5.0, 5.0]
    for line in cpu["handoff"]["ring"]:
        line["ms"] = 0.05
    doc.pop("preprocess", None)
    gpu = copy.deepcopy(cpu)
    gpu.update(kind="cuda", name="cuda:0", description="synthetic")
    gpu["decode"]["llm_block_step_ms"] = [t / 10 for t in cpu["decode"]["llm_block_step_ms"]]
    doc["devices"]["cuda"] = gpu
    doc = validate_profile(doc)
    prefill_only = plan_split(cfg, "fp32", profile=doc)
    heavy = plan_split(cfg, "fp32", profile=doc, decode_tokens=64)
    assert 0 < prefill_only.chosen_k < cfg.num_layers
    assert heavy.chosen_k == cfg.num_layers
    decode = [r.decode_ms for r in heavy.rows]
    assert all(a > b for a, b in zip(decode, decode[1:])), decode
    budget = prefill_only.row(2).gpu_total_bytes  # K = 2 fits without a KV cache, not with the prefix's
    assert heavy.row(2).gpu_total_bytes > budget and heavy.row(2).gpu_kv_bytes > 0
    assert plan_split(cfg, "fp32", profile=doc, gpu_budget_bytes=budget).rows[2].fits
    assert plan_split(cfg, "fp32", profile=doc, decode_tokens=64, gpu_budget_bytes=budget).chosen_k == 1
