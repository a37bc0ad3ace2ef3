"""Driving checkpoints composed on every text family (`hybrid-vla init-model --llm DIR`), verified against
transformers, and one of them (Gemma 3: alternating sliding / global layers with their own rotary bases, scaled
embeddings, a block layout the prefix cannot produce in place) through the real node processes.

Reference: the referred directory loaded by transformers' ``AutoModelForCausalLM.from_pretrained`` and run on
``inputs_embeds`` = this package's own vision side's h_0 (K = 0); the planning head (this package's own tensor)
applied to its final hidden state. Nothing of the split path is on the reference side.
"""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from hf_builders import TEXT_FAMILIES, write_text_lm
from replay_check import assert_trajectory_matches, published_and_odometry, stamp_ns
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess

REPO = Path(__file__).resolve().parent.parent


def _cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """Per family: (transformers directory, `hybrid-vla init-model --preset tiny --llm DIR OUT`)."""
    from hybrid_vla_ros.tools.cli import main

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in TEXT_FAMILIES:
        llm = write_text_lm(root / family, family)
        assert main(["init-model", "--preset", "tiny", "--llm", str(llm), str(root / f"drive_{family}")]) == 0
        out[family] = (llm, root / f"drive_{family}")
    return out


@pytest.mark.parametrize("family", sorted(TEXT_FAMILIES))
def test_a_composed_checkpoint_of_every_family_verifies_and_plans(composed, family, tmp_path, capsys):
    """verify-split exits 0 at every K (fp32, <= 1e-5) and plan lists L + 1 rows, for a driving checkpoint whose
    LLM is the family's transformers directory (the CLI's own entry point, in this process)."""
    from hybrid_vla_ros.tools.cli import main

    _, drive = composed[family]
    capsys.readouterr()
    assert main(["verify-split", "--model", str(drive), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "OK: 4 of 4 split layers within the allowed difference" in out and "from_pretrained" in out, out
    assert main(["plan", "--model", str(drive), "--dtype", "fp32", "--json", str(tmp_path / "plan.json")]) == 0
    assert [r["k"] for r in json.loads((tmp_path / "plan.json").read_text())["rows"]] == [0, 1, 2, 3]


def _modes_from_transformers(llm_dir, drive, pixels):
    """The planning head's modes on transformers' final hidden state of the composed checkpoint's frame."""
    from transformers import AutoModelForCausalLM

    ck = open_checkpoint(drive)
    with torch.inference_mode():
        h0 = ck.load("prefix", 0)(pixels)
        ref = AutoModelForCausalLM.from_pretrained(str(llm_dir)).eval()
        final = ref.model(inputs_embeds=h0[None]).last_hidden_state[0]
        return ck.load("suffix", ck.num_layers).head(final[-1])


def test_the_nodes_run_a_composed_gemma3_with_a_live_resplit(composed, frames, embedded_bag, tmp_path):
    """`hybrid-vla replay` on the composed Gemma 3 checkpoint, K moved 1 -> 3 live: every trajectory equals the
    one from transformers' forward; the prefix says how h_K reaches the ring (copied: Gemma's block has norms
    the produced-in-slot path does not reproduce)."""
    llm_dir, drive = composed["gemma3_text"]
    out = tmp_path / "replay"
    run = _cli("replay", "--model-path", str(drive), "--bag", str(embedded_bag), "--loops", "1", "--split-layer",
               "1", "--resplit", "1:3", "--namespace", f"/tf_{uuid.uuid4().hex[:8]}", "--output", str(out), "--quiet",
               timeout=400)
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}, report
    assert "re-split K 1 -> 3" in logs
    assert "copied into slot (Gemma3DecoderLayer" in logs, logs
    published, odometry = published_and_odometry(out, embedded_bag)
    assert len(published) == 3
    cfg = open_checkpoint(drive).cfg
    by_stamp = dict(frames)
    for traj in published:
        pixels = preprocess([compressed_msg_to_rgb(m) for _, m in by_stamp[stamp_ns(traj)]], cfg.image_size,
                            cfg.image_mean, cfg.image_std)
        waypoints = _modes_from_transformers(llm_dir, drive, pixels)[3].double().numpy()  # LANE_FOLLOW
        assert_trajectory_matches(traj, waypoints, cfg.waypoint_dt_s, odometry)
