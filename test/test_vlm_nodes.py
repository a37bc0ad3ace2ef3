"""Driving checkpoints composed on transformers VLMs (`hybrid-vla init-model --vlm DIR`) through the real node
processes: `hybrid-vla replay` of the embedded bag, K moved live, every trajectory checked against transformers.

Reference: the VLM directory loaded by transformers' ``<Family>ForConditionalGeneration.from_pretrained``, run on
the same processor outputs of the same camera images (the frame the trajectory's stamp names, through the
family's processor with the planning token appended, as the prefix node feeds it), its text model's final
hidden state of the planning token through the composed checkpoint's planning head (this package's own tensor).
Qwen3-VL sends multimodal positions and DeepStack features with h_K (Qwen3-VL-MoE too, its text blocks mixtures
of experts), Gemma 3 its image blocks (its images attend both ways), Mllama the vision states and masks its
cross-attention blocks read, InternVL nothing but h_K: the kinds of ring contract a VLM has (Qwen2.5-VL's
positions alone are the first half of Qwen3-VL's; every family's split at every K is checked against transformers
in test_vlm_models.py).
"""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from replay_check import assert_trajectory_matches, published_and_odometry, stamp_ns
from vlm_builders import VLM_BUILDERS
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, resize_rgb

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "gemma3", "internvl", "mllama"]


def _cli(*argv, timeout=400):
    return subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    from hybrid_vla_ros.tools.cli import main

    root = tmp_path_factory.mktemp("vlm_nodes")
    out = {}
    for family in FAMILIES:
        builder, kw = VLM_BUILDERS[family]
        vlm = builder(root / family, **kw)
        assert main(["init-model", "--preset", "tiny", "--vlm", str(vlm), str(root / f"drive_{family}")]) == 0
        out[family] = (vlm, root / f"drive_{family}")
    return out


def _modes_from_transformers(vlm_dir, drive, images):
    from hybrid_vla_ros.model.vlm import frame_inputs, load_processor, vlm_family

    ck = open_checkpoint(drive)
    cfg = ck.cfg
    family = vlm_family(cfg.vlm_type)
    inputs = frame_inputs(load_processor(vlm_dir, cfg.vlm_type), cfg,
                          [resize_rgb(im, cfg.camera_size) for im in images])
    with torch.inference_mode():
        ref = family.generation_class.from_pretrained(str(vlm_dir)).eval()
        final = ref.model(input_ids=inputs.input_ids, **inputs.images).last_hidden_state[0]
        return ck.load("suffix", ck.num_layers).head(final[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_through_the_nodes_equals_transformers(composed, family, frames, embedded_bag, tmp_path):
    vlm_dir, drive = composed[family]
    out = tmp_path / "replay"
    run = _cli("replay", "--model-path", str(drive), "--bag", str(embedded_bag), "--loops", "1", "--split-layer",
               "1", "--resplit", "1:3", "--namespace", f"/vn_{uuid.uuid4().hex[:8]}", "--output", str(out), "--quiet")
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}, report
    assert "re-split K 1 -> 3" in logs
    cfg = open_checkpoint(drive).cfg
    assert f"of a {cfg.vlm_type} VLM" in logs, "the prefix says how h_K reaches the ring"
    if cfg.side:
        assert all(name in logs for name in cfg.side), "the side tensors are named"
    published, odometry = published_and_odometry(out, embedded_bag)
    assert len(published) == 3
    by_stamp = dict(frames)
    for traj in published:
        images = [compressed_msg_to_rgb(m) for _, m in by_stamp[stamp_ns(traj)]]
        waypoints = _modes_from_transformers(vlm_dir, drive, images)[3].double().numpy()  # LANE_FOLLOW
        assert_trajectory_matches(traj, waypoints, cfg.waypoint_dt_s, odometry)


def test_a_suffix_whose_side_tensors_differ_is_refused_at_attach(composed, tmp_path):
    """A prefix of the Qwen3-VL composition and a suffix that expects other side tensors: the suffix refuses the
    ring when it attaches, naming each difference (a contract error, as for a dtype or model mismatch)."""
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    _, drive = composed["qwen3_vl"]
    ns = f"/sd_{uuid.uuid4().hex[:8]}"
    prefix = PrefixRunner(str(drive), PrefixRunnerSettings(1, device="cpu", namespace=ns))
    try:
        suffix = SuffixRunner(str(drive), SuffixRunnerSettings(1, namespace=ns))
        suffix.cfg.vlm_view["side_shapes"]["deepstack"][1] += 1  # as a checkpoint written for other cameras
        try:
            assert suffix.poll(0.1) is None and not suffix.attached
            assert suffix.attach_failure == "contract"
            assert "deepstack" in suffix.contract_error and "this suffix expects" in suffix.contract_error
        finally:
            suffix.close()
    finally:
        prefix.close()
