"""Any transformers decoder built as embedding -> decoder blocks -> norm splits without a per-family entry (issue 41):
dense families of the usual shape, mixture-of-experts ones (their per-expert tensors merged by transformers' own
conversion as a stage loads) and latent attention, each checked against transformers' own forward and
``generate`` at every split layer; what cannot be split is refused naming the feature. Checkpoints are written by
transformers' ``save_pretrained`` (test/hf_builders.py)."""
from __future__ import annotations

import json

import pytest
import torch

from hf_builders import GENERIC_FAMILIES, HYBRID_FAMILIES, LLM, perturb_, write_generic_lm
from hybrid_vla_ros.model import family_check, text
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.sources import CheckpointError
from hybrid_vla_ros.split.verify import verify_split
from hybrid_vla_ros.split.verify_decode import verify_decode

MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3")


def _written(tmp_path_factory, label: str, names) -> dict:
    root = tmp_path_factory.mktemp(label)
    return {name: write_generic_lm(root / name, name) for name in names}


@pytest.fixture(scope="module")
def generic_dirs(tmp_path_factory):
    return _written(tmp_path_factory, "generic", GENERIC_FAMILIES)


@pytest.mark.parametrize("name", sorted(GENERIC_FAMILIES))
def test_every_split_layer_equals_transformers_forward_and_generate(generic_dirs, name):
    """verify-split (prefix hidden states and final states against transformers' ``ForCausalLM`` loaded by
    ``from_pretrained``, at K = 0..3) and a 4-token greedy decode against transformers' ``generate``, per family."""
    assert name not in text.TESTED_TEXT_TYPES  # the generic path, not a listed family
    report = verify_split(generic_dirs[name])
    assert report.ok and [r.k for r in report.rows] == [0, 1, 2, 3], report
    assert report.worst <= 1e-5
    decoded = verify_decode(generic_dirs[name], 4)
    assert decoded.ok and all(r.tokens_equal and r.logits <= 1e-5 for r in decoded.rows), decoded


@pytest.mark.parametrize("name", MOE)
def test_a_moe_stage_holds_transformers_merged_experts_and_routing_uses_several(generic_dirs, name):
    """The suffix at K = 2 holds block 2 exactly as transformers' ``from_pretrained`` builds it from the per-expert
    tensors (the fused expert tensors included), and the test's routers send the tokens to most of the 8 experts
    (so the exactness above covers real routing, not one expert)."""
    from transformers import AutoModelForCausalLM

    path = generic_dirs[name]
    stored = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    # per expert, as published MoE checkpoints are stored; gpt-oss publishes its experts fused, and so saves them;
    # Granite-MoE stores them fused under names transformers renames (input_linear, output_linear)
    assert any(".experts.0." in k for k in stored) == (name not in ("gpt_oss", "granitemoe"))
    if name == "granitemoe":
        assert any(".input_linear." in k for k in stored)
    ref = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    suffix = open_checkpoint(path).load("suffix", 2)
    ours, theirs = suffix.layers[0].state_dict(), ref.model.layers[2].state_dict()
    assert sorted(ours) == sorted(theirs)
    assert any("experts" in k and v.dim() == 3 for k, v in theirs.items()), "fused expert tensors"
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    seen, routers = [], [m for n, m in ref.named_modules()
                         if n.endswith(("mlp.gate", "mlp.router", "block_sparse_moe.router"))]
    hooks = [r.register_forward_hook(lambda m, args, out: seen.append((getattr(m, "weight", None)
                                                                        if hasattr(m, "weight") else m.layer.weight,
                                                                        args[0]))) for r in routers]
    with torch.inference_mode():
        ref(torch.tensor([[(7 + 131 * i) % LLM["vocab_size"] for i in range(16)]]))
    for h in hooks:
        h.remove()
    assert seen
    with torch.inference_mode():
        for weight, x in seen:
            chosen = (x.reshape(-1, x.shape[-1]) @ weight.T).topk(2, dim=-1).indices
            assert len(chosen.unique()) >= 5, f"routing picks only {chosen.unique().tolist()}"


def test_a_moe_stage_reads_only_its_own_blocks_experts(generic_dirs, monkeypatch):
    """The suffix at K = 2 of Qwen3-MoE reads block 2's stored tensors (its 8 experts' among them) and the final
    norm, nothing of blocks 0 and 1."""
    from hybrid_vla_ros.model import sources

    path = generic_dirs["qwen3_moe"]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    read = []
    real = sources._read_range
    monkeypatch.setattr(sources, "_read_range",
                        lambda f, size, info, *a: read.append(info.stored_name) or real(f, size, info, *a))
    open_checkpoint(path).load("suffix", 2)
    wanted = sorted(k for k in index if k.startswith("model.layers.2.") or k == "model.norm.weight")
    assert sorted(read) == wanted and sum(".experts." in k for k in wanted) == 8 * 3


def _write(path, model_type, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**LLM, **overrides})
    perturb_(AutoModelForCausalLM.from_config(cfg), 0).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    return _written(tmp_path_factory, "hybrid", HYBRID_FAMILIES)


@pytest.mark.parametrize("name", sorted(HYBRID_FAMILIES))
def test_hybrid_blocks_split_exactly_with_what_their_own_forward_hands_them(hybrid_dirs, name):
    """LFM2 (convolution blocks, its final norm ``embedding_norm``), Falcon-H1 (attention and state-space mixers in
    each block, its own state-space mask), Jamba (state-space and attention blocks, MoE, no rotary), Qwen3-Next
    (gated linear-attention blocks): every K equals transformers' forward (each side runs its blocks with what the
    family's own forward hands them, recorded), blocks of a kind that is not attention alone are among the 3, and
    a decode across the split is refused in one line (their state is not carried yet). fp32 and bf16 both 0.0."""
    from hybrid_vla_ros.split.verify_decode import CannotDecode

    family = text.text_family(name)
    assert family.captured
    ck = open_checkpoint(hybrid_dirs[name])
    for dtype in ("fp32", "bf16"):  # bf16 as exact: buffers its base model makes are in the stage's dtype
        report = verify_split(hybrid_dirs[name], dtype)
        assert report.ok and [r.k for r in report.rows] == list(range(ck.num_layers + 1)), report
        assert report.worst == 0.0, (dtype, report.worst)
    kinds = text.attention_kinds(ck.split_model().text_config())
    assert set(kinds) - set(text.ATTENTION_KINDS), f"blocks of a kind that is not attention alone: {kinds}"
    with pytest.raises(CannotDecode, match="recurrent, convolution or linear-attention state"):
        verify_decode(hybrid_dirs[name], 2)


def test_the_nodes_run_a_composed_hybrid_model_with_a_live_resplit(hybrid_dirs, frames, embedded_bag, tmp_path):
    """`hybrid-vla replay` of the embedded bag on a driving checkpoint composed on Falcon-H1 (hybrid blocks, an
    embedding multiplier its forward applies, a config holding an infinite float), K moved 1 -> 3 live: every
    trajectory equals the planning head on transformers' forward of the same embeddings; the prefix says h_K is
    copied into the slot, and why."""
    import os
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from replay_check import assert_trajectory_matches, published_and_odometry, stamp_ns
    from hybrid_vla_ros.model.modeling import embed
    from hybrid_vla_ros.tools.cli import main
    from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess

    llm_dir, drive, out = hybrid_dirs["falcon_h1"], tmp_path / "drive", tmp_path / "replay"
    assert main(["init-model", "--preset", "tiny", "--llm", str(llm_dir), str(drive)]) == 0
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", "replay", "--model-path", str(drive),
                          "--bag", str(embedded_bag), "--loops", "1", "--split-layer", "1", "--resplit", "1:3",
                          "--namespace", f"/hy_{uuid.uuid4().hex[:8]}", "--output", str(out), "--quiet"],
                         capture_output=True, text=True, timeout=400, cwd=repo,
                         env={**os.environ, "PYTHONPATH": str(repo)})
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}, report
    assert "re-split K 1 -> 3" in logs and "hybrid blocks run with the inputs" in logs, logs
    published, odometry = published_and_odometry(out, embedded_bag)
    ck = open_checkpoint(drive)
    cfg, by_stamp = ck.cfg, dict(frames)
    ref = AutoModelForCausalLM.from_pretrained(str(llm_dir)).eval()
    prefix, tail = ck.load("prefix", 0), ck.load("suffix", ck.num_layers)
    for traj in published:
        pixels = preprocess([compressed_msg_to_rgb(m) for _, m in by_stamp[stamp_ns(traj)]], cfg.image_size,
                            cfg.image_mean, cfg.image_std)
        with torch.inference_mode():
            final = ref.model(inputs_embeds=embed(prefix, pixels)[None]).last_hidden_state[0]
            waypoints = tail.head(final[-1])[3].double().numpy()  # LANE_FOLLOW
        assert_trajectory_matches(traj, waypoints, cfg.waypoint_dt_s, odometry)


def test_structures_that_cannot_be_split_are_refused_naming_the_feature(tmp_path):
    """Zamba2 (its hybrid blocks read the embeddings block 0 was given: another block's input, which the suffix
    does not have), GPT-2 (no decoder-block list of the standard kind): each refused at open
    with the feature named, not split wrong."""
    path = _write(tmp_path / "zamba2", "zamba2", mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8,
                  layer_types=["linear_attention", "hybrid", "linear_attention"], num_mem_blocks=1)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    assert "original_hidden_states" in str(e.value) and str(path / "config.json") in str(e.value), str(e.value)
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(str(tmp_path / "g"))
    with pytest.raises(CheckpointError, match=r"parts \['wte', 'wpe', 'drop', 'h', 'ln_f'\]"):
        open_checkpoint(tmp_path / "g")


def test_the_forward_check_refuses_what_the_loop_does_not_apply(generic_dirs, monkeypatch):
    """Negative controls of family_check.check_forward_matches on Granite: without its embedding multiplier the loop's
    hidden states differ from GraniteModel's and the checkpoint is refused; without its logits divisor the hidden
    states match but the logits do not, and it is refused for that (a decode would choose wrong tokens)."""
    from hybrid_vla_ros.model import decode

    path = generic_dirs["granite"]
    family_check._check_forward_cached.cache_clear()
    monkeypatch.setattr(text, "embed_scale", lambda family, config: None)
    with pytest.raises(CheckpointError, match="differs from transformers' GraniteModel.forward"):
        open_checkpoint(path)
    monkeypatch.undo()
    family_check._check_forward_cached.cache_clear()
    real_init = decode.LMHead.__init__

    def without_divisor(self, config, tied=None):
        real_init(self, config, tied)
        self.divided_by = None

    monkeypatch.setattr(decode.LMHead, "__init__", without_divisor)
    with pytest.raises(CheckpointError, match="logits differ from GraniteForCausalLM's"):
        open_checkpoint(path)
    monkeypatch.undo()
    family_check._check_forward_cached.cache_clear()
    assert open_checkpoint(path).num_layers == 3


def test_a_moe_suffix_is_never_traced_for_openvino(generic_dirs, tmp_path):
    """Tracing a MoE block would keep the example input's routing (the converted graph then failed on other inputs
    here, or would compute the example's experts): the OpenVINO build refuses it, naming the experts, so the
    suffix node runs such blocks eagerly (its backend falls back with that reason, as for sliding windows)."""
    from hybrid_vla_ros.runtime.suffix_backend import build_openvino

    composed = tmp_path / "composed"
    from hybrid_vla_ros.tools.cli import main as cli

    assert cli(["init-model", "--preset", "tiny", "--llm", str(generic_dirs["qwen3_moe"]), str(composed)]) == 0
    ck = open_checkpoint(composed)
    stage = ck.load("suffix", 1)
    with pytest.raises(ValueError, match=r"mixture-of-experts blocks \(Qwen3MoeSparseMoeBlock\).*runs eagerly"):
        build_openvino(stage, 1, tuple(stage.cfg.prefix_state_shape), model_id=ck.model_id(),
                       cache_dir=tmp_path / "cache")


def test_plan_counts_every_expert_in_memory_and_the_active_ones_per_token(generic_dirs):
    """`plan` on a MoE directory: its note gives the blocks' total and active parameters (counted here from
    transformers' own model: the expert tensors at 2 of 8, everything else whole) and the GPU memory one block
    frees; the memory columns count every expert. A dense model gets no such note."""
    from transformers import AutoModelForCausalLM

    from hybrid_vla_ros.split.planner import expert_counts, plan_for_checkpoint

    path = generic_dirs["deepseek_v3"]  # a dense first block, then MoE blocks with a shared expert
    layers = AutoModelForCausalLM.from_pretrained(str(path)).model.layers
    total = sum(p.numel() for p in layers.parameters())
    experts = sum(p.numel() for n, p in layers.named_parameters() if ".experts." in n)
    counts = expert_counts(open_checkpoint(path).model)
    assert (counts.total, counts.active) == (total, total - experts + experts * 2 // 8)
    assert (counts.moe_blocks, counts.blocks, counts.experts, counts.active_experts) == (2, 3, 8, 2)
    plan = plan_for_checkpoint(path, dtype="fp32")
    note = next(n for n in plan.notes if n.startswith("mixture of experts"))
    assert "2 of 3 decoder blocks route each token to 2 of 8 experts" in note
    block = sum(t.numel() for t in layers[2].state_dict().values()) * 4  # the router's bias buffer included
    assert plan.rows[3].gpu_weight_bytes - plan.rows[2].gpu_weight_bytes == block, "every expert in the memory"
    assert not any(n.startswith("mixture") for n in plan_for_checkpoint(generic_dirs["olmo2"]).notes)


def test_a_moe_checkpoint_missing_an_expert_or_mixing_dtypes_is_refused_naming_the_tensors(generic_dirs, tmp_path,
                                                                                          capsys):
    """Bad shards of a MoE checkpoint: an expert's tensor deleted leaves 7 up projections beside 8 gate ones, an
    expert stored in another dtype than its siblings: the stage that owns the block is refused naming the merged
    tensor and why, before anything is read; the other stage loads; `verify-split` says so in one line (exit 2)
    before transformers' own loader meets the checkpoint."""
    import shutil

    from hybrid_vla_ros.tools.cli import main as cli

    from safetensors.torch import load_file, save_file

    for case in ("missing", "dtype"):
        path = tmp_path / case
        shutil.copytree(generic_dirs["qwen3_moe"], path)
        index_file = path / "model.safetensors.index.json"
        doc = json.loads(index_file.read_text())
        name = "model.layers.1.mlp.experts.3.up_proj.weight"
        shard = path / doc["weight_map"][name]
        tensors = load_file(str(shard))
        if case == "missing":
            del tensors[name], doc["weight_map"][name]
            index_file.write_text(json.dumps(doc))
        else:
            tensors[name] = tensors[name].to(torch.float16)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(path).load("suffix", 1)
        msg = str(e.value)
        if case == "missing":
            assert "mlp.experts.gate_up_proj" in msg and "uneven" in msg and "7 of" in msg and "8 of" in msg, msg
        else:
            assert "mlp.experts.gate_up_proj" in msg and "several dtypes ['F16', 'F32']" in msg, msg
        open_checkpoint(path).load("prefix", 1)  # the prefix does not own block 1: it loads
        capsys.readouterr()
        assert cli(["verify-split", "--model", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "mlp.experts.gate_up_proj" in err and "Traceback" not in err, err
