"""The read-outs driving VLAs use, on the suffix, checked against transformers: learned query tokens
(SimLingo's shape), the LM head's rows at a position (MindDrive's decision, one pass), and a team's own head
module (a flow-matching planner from the team's own package, test/fixtures/drive_heads) through the real nodes.

References: transformers' own forward (``AutoModelForCausalLM.from_pretrained`` of the referred directory on the
composition's h_0, or the VLM's ``ForConditionalGeneration`` with the learned query rows put into its embedding
output by a hook), the read-out head applied to its final hidden states.
"""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from hf_builders import write_text_lm
from vlm_builders import VLM_BUILDERS
from hybrid_vla_ros.model.checkpoint import open_checkpoint

REPO = Path(__file__).resolve().parent.parent
HEADS = Path(__file__).resolve().parent / "fixtures" / "drive_heads"
FLOW = {"type": "module", "class": "flow_head:FlowPlanner", "config": {"width": 16, "steps": 3}}


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return write_text_lm(tmp_path_factory.mktemp("readouts") / "qwen3", "qwen3")


@pytest.fixture
def trusted_heads(monkeypatch):
    """The team's head package on sys.path and the model-code opt-in, as a user sets them."""
    monkeypatch.syspath_prepend(str(HEADS))
    monkeypatch.setenv("HYBRID_VLA_TRUST_MODEL_CODE", "1")


def _compose(src, out, *extra, kind="--llm"):
    from hybrid_vla_ros.tools.cli import main

    assert main(["init-model", "--preset", "tiny", kind, str(src), *extra, str(out)]) == 0
    return out


def test_query_tokens_read_out_verifies_and_the_queries_matter(llm_dir, tmp_path, capsys):
    """A queries read-out (6 learned query tokens in the planning token's place, one waypoint step each):
    verify-split exits 0 with the waypoints compared at every K; T grows by count - 1; changing a query
    embedding changes the waypoints (they are read from the queries' own states)."""
    from hybrid_vla_ros.tools.cli import main

    drive = _compose(llm_dir, tmp_path / "q", "--set", 'readout={"type": "queries", "count": 6}')
    plain = _compose(llm_dir, tmp_path / "p")
    ck, base = open_checkpoint(drive), open_checkpoint(plain)
    assert ck.cfg.num_tokens == base.cfg.num_tokens + 5
    capsys.readouterr()
    assert main(["verify-split", "--model", str(drive), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "OK: 4 of 4" in out and "waypoints" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("0 |", "1 |", "2 |", "3 |"))]
    assert all(line.split("|")[3].strip() != "-" for line in rows), "waypoints compared at every K"
    from hybrid_vla_ros.split.verify import bag_pixels

    with torch.inference_mode():
        prefix, suffix = ck.load("prefix", 1), ck.load("suffix", 1)
        pixels = bag_pixels(ck.cfg)
        modes = suffix.plan_all(prefix(pixels)).modes
        prefix.query_tokens[2] += 1.0
        assert (suffix.plan_all(prefix(pixels)).modes - modes).abs().max() > 1e-4


def test_lm_head_rows_read_the_decision_on_one_pass(llm_dir, tmp_path):
    """decision_token_ids on a one-pass composition: the decision head holds the referred LM's own LM-head rows
    of those tokens, and the decision logits at decision_position equal transformers' logits of those tokens
    there (its ForCausalLM on the composition's h_0), at every K."""
    from transformers import AutoModelForCausalLM

    from hybrid_vla_ros.split.verify import bag_pixels

    ids = [5, 17, 42, 300]
    drive = _compose(llm_dir, tmp_path / "d", "--set", f"decision_token_ids={json.dumps(ids)}")
    ck = open_checkpoint(drive)
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(str(llm_dir)).eval()
        assert torch.equal(ck.load("suffix", 3).decision_head.weight, ref.lm_head.weight[ids])
        h0 = ck.load("prefix", 0)(bag_pixels(ck.cfg))
        want = ref(inputs_embeds=h0[None]).logits[0, ck.cfg.decision_position, ids]
        for k in range(ck.num_layers + 1):
            out = ck.load("suffix", k).plan_all(ck.load("prefix", k)(bag_pixels(ck.cfg)))
            assert (out.decision_logits - want).abs().max().item() <= 1e-4, k
            assert out.speed_mode == int(want.argmax())


def test_query_tokens_on_a_vlm_composition_verify(tmp_path, capsys):
    """A Qwen2.5-VL composition with a queries read-out: the reference is the VLM's own forward with the
    composition's query embeddings put in the planning-token copies' rows; verify-split exits 0."""
    from hybrid_vla_ros.tools.cli import main

    builder, kw = VLM_BUILDERS["qwen2_5_vl"]
    vlm = builder(tmp_path / "vlm", **kw)
    drive = _compose(vlm, tmp_path / "dq", "--set", 'readout={"type": "queries", "count": 6}', kind="--vlm")
    capsys.readouterr()
    assert main(["verify-split", "--model", str(drive), "--quiet"]) == 0
    assert "OK: 4 of 4" in capsys.readouterr().out


def test_a_team_head_module_needs_the_opt_in(llm_dir, tmp_path, monkeypatch, capsys):
    """Without the model-code opt-in the team's head is not imported: init-model refuses, naming the opt-in."""
    from hybrid_vla_ros.tools.cli import main

    monkeypatch.syspath_prepend(str(HEADS))
    monkeypatch.delenv("HYBRID_VLA_TRUST_MODEL_CODE", raising=False)
    capsys.readouterr()
    code = main(["init-model", "--preset", "tiny", "--llm", str(llm_dir), "--set", f"readout={json.dumps(FLOW)}",
                 str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code != 0 and "HYBRID_VLA_TRUST_MODEL_CODE" in err and "flow_head:FlowPlanner" in err, err
    assert not (tmp_path / "m" / "config.json").exists()


def test_a_team_head_module_verifies_plans_and_drives_the_nodes(llm_dir, tmp_path, trusted_heads, capsys,
                                                                 embedded_bag):
    """The team's flow-matching planner as the read-out: verify-split exits 0 (its waypoints on transformers'
    final states at every K), the plan counts its weights on the suffix, and `hybrid-vla replay` runs it on the
    suffix node (the package on PYTHONPATH and the opt-in in the environment, as a deployment sets them)."""
    from hybrid_vla_ros.tools.cli import main

    drive = _compose(llm_dir, tmp_path / "f", "--set", f"readout={json.dumps(FLOW)}")
    capsys.readouterr()
    assert main(["verify-split", "--model", str(drive), "--quiet"]) == 0
    assert "OK: 4 of 4" in capsys.readouterr().out
    assert main(["plan", "--model", str(drive), "--dtype", "fp32", "--json", str(tmp_path / "plan.json")]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    head = open_checkpoint(drive).load("suffix", 3).head
    head_bytes = sum(p.numel() * 4 for p in head.parameters())
    assert type(head).__name__ == "FlowPlanner" and rows[-1]["cpu_weight_bytes"] >= head_bytes
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HEADS)]),
           "HYBRID_VLA_TRUST_MODEL_CODE": "1"}
    out = tmp_path / "replay"
    run = subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", "replay", "--model-path", str(drive),
                          "--bag", str(embedded_bag), "--loops", "1", "--split-layer", "2",
                          "--namespace", f"/rh_{uuid.uuid4().hex[:8]}", "--output", str(out), "--quiet"],
                         capture_output=True, text=True, timeout=400, cwd=REPO, env=env)
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}, report


def test_pass_prompts_read_each_pass_where_its_own_tokens_are(tmp_path):
    """Each LLM pass on its own prompt after the vision tokens (`pass_prompt_token_ids`, MindDrive's two
    conversations; the published ones: test_published.py::test_minddrive_passes_run_the_published_prompts): the
    shorter pass is padded at its end, and the read-outs never see that padding. With this package's 6-way decision
    head (no decision_token_ids) the decision pass is read at its own last token: rewriting the padding's hidden
    states changes neither the decision nor the plan (the blocks are causal), while rewriting the real last token
    does. The config refuses prompts that do not fit the read-out."""
    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.model.config import VLAConfig, preset

    prompts = [[7, 8], [12, 13, 250, 14]]
    path = tmp_path / "two_prompts"
    cfg = init_model("tiny", path, overrides=dict(llm_passes=2, planning_token_id=250, pass_prompt_token_ids=prompts))
    at = cfg.readout_positions
    assert (at.planning, at.path, at.decision) == (-2, None, -3)  # pass 0 padded by 2 tokens
    assert VLAConfig.from_dict(cfg.to_dict()) == cfg
    assert "pass_prompt_token_ids" not in preset("tiny").to_dict()  # written only when set
    ck = open_checkpoint(path)
    prefix, suffix = ck.load("prefix", 2, dtype="fp32"), ck.load("suffix", 2, dtype="fp32")
    pixels = torch.randn(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = prefix(pixels)
        assert h.shape == (2, cfg.num_tokens, cfg.hidden_size)
        base = suffix.plan_all(h)
        padded = h.clone()
        padded[0, -2:] = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        same = suffix.plan_all(padded)
        assert torch.equal(same.decision_logits, base.decision_logits) and torch.equal(same.modes, base.modes)
        real = h.clone()
        real[0, -3] += 1.0
        assert (suffix.plan_all(real).decision_logits - base.decision_logits).abs().max() > 1e-4
    bad = {"a read-out token twice": [[7], [250, 5, 250]], "no planning token": [[7], [12, 13]],
           "one prompt for two passes": [[12, 250]], "an empty prompt": [[], [250]]}
    for wrong in bad.values():  # keyed by what is wrong
        with pytest.raises(ValueError, match="pass_prompt_token_ids|read-out token"):
            preset("tiny", llm_passes=2, planning_token_id=250, pass_prompt_token_ids=wrong)
    speed_path = {"type": "vae_speed_path", "path_token_id": 251, "path_points": 20}
    with pytest.raises(ValueError, match="before the path token"):
        preset("tiny", llm_passes=2, planning_token_id=250, readout=speed_path,
               decision_token_ids=[11, 23, 35, 47, 59, 71, 83], pass_prompt_token_ids=[[7], [251, 250]])
    with pytest.raises(ValueError, match="decision_position .* of the decision pass"):
        preset("tiny", llm_passes=2, planning_token_id=250, decision_token_ids=[11, 23], decision_position=-1000,
               pass_prompt_token_ids=[[7], [250]])
