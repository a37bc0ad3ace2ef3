"""What `hybrid-vla verify-split` compares, and that its verdict means it (issue 37).

Two claims per split layer K (split/verify.py): bit-exact against the same code unsplit (0 and nothing else), and
within the referee's own rounding of transformers' forward (allowed = 8 x the referee's own float32 error against
its float64 run, at least 16 ulp of the tensor's largest value). A real error on the split side -- a wrong mask, a
missing bias, a wrong rotary table -- must fail; a referee that rounds differently (less precise sin / cos, as a
host's vector-math library can pick at run time) must not; and the figures must be the same from run to run.
Checkpoints are written by transformers' own save_pretrained (test/hf_builders.py).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_builders import write_qwen2
from hybrid_vla_ros.model import text
from hybrid_vla_ros.split import verify


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny Qwen2ForCausalLM (q/k/v biases, grouped KV, 3 blocks), hidden states O(1)."""
    return write_qwen2(tmp_path_factory.mktemp("verify") / "qwen2")


def test_a_clean_split_is_bit_exact_against_the_unsplit_model_and_within_the_referees_rounding(qwen2_dir):
    report = verify.verify_split(qwen2_dir)
    assert report.ok and [r.k for r in report.rows] == [0, 1, 2, 3]
    assert all(r.unsplit == 0.0 for r in report.rows)
    # the allowed difference is the referee's rounding: far below a real error, above zero
    allowed = [a for r in report.rows for a in (r.allowed_prefix, r.allowed_final) if a is not None]
    assert 0 < max(allowed) < 1e-4, allowed
    assert "bit-exact against the same code unsplit" in verify.format_report(report)


def _band_mask(real):
    """block_inputs with every mask replaced by a 2-token window (each token sees itself and the one before)."""
    def wrong(config, rotary, x, kinds, position_ids=None, **kw):
        inputs = real(config, rotary, x, kinds, position_ids, **kw)
        t = x.shape[1]
        i = torch.arange(t)
        band = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2))[None, None]
        inputs.masks = {kind: band for kind in inputs.masks}
        return inputs
    return wrong


def _doubled_rotary(real):
    """block_inputs with rotary tables at twice the frequencies (positions 0, 2, 4, ...: a wrong rope theta; a
    uniform shift of every position would not do, rotary attention sees only the distances)."""
    def wrong(config, rotary, x, kinds, position_ids=None, **kw):
        doubled = (2 * torch.arange(x.shape[1])).unsqueeze(0)
        inputs = real(config, rotary, x, kinds, position_ids, **kw)
        inputs.cos_sin = {kind: rotary(x, doubled) for kind in inputs.cos_sin}
        return inputs
    return wrong


@pytest.mark.parametrize("error", ["wrong mask", "wrong rotary table", "missing bias"])
def test_a_real_error_on_the_split_side_fails(qwen2_dir, monkeypatch, error):
    if error == "wrong mask":
        monkeypatch.setattr(text, "block_inputs", _band_mask(text.block_inputs))
    elif error == "wrong rotary table":
        monkeypatch.setattr(text, "block_inputs", _doubled_rotary(text.block_inputs))
    else:  # the suffix's q_proj biases dropped: every K < L runs at least one block without them
        from hybrid_vla_ros.model.checkpoint import Checkpoint

        load = Checkpoint.load

        def without_bias(self, role, *args, **kwargs):
            stage = load(self, role, *args, **kwargs)
            if role == "suffix":
                for layer in stage.layers:
                    layer.self_attn.q_proj.bias.data.zero_()
            return stage
        monkeypatch.setattr(Checkpoint, "load", without_bias)
    report = verify.verify_split(qwen2_dir)
    assert not report.ok
    bad = [r for r in report.rows if not r.ok]
    assert bad and all(r.fraction > 100 for r in bad), [(r.k, r.fraction) for r in report.rows]
    assert "FAILED" in verify.format_report(report)


def test_a_referee_with_less_precise_sin_and_cos_still_passes(qwen2_dir, monkeypatch):
    """The referee's rotary tables rounded to 13 significant bits in its float32 run only (a vector-math library
    in a low-precision mode): its own run is further from its float64 run, and the split is judged by that."""
    from transformers.models.qwen2 import modeling_qwen2

    from hybrid_vla_ros.model.kinds import TextLM

    rotary, referee = modeling_qwen2.Qwen2RotaryEmbedding.forward, TextLM.referee

    def coarse(self, x, position_ids=None, **kwargs):
        cos, sin = rotary(self, x, position_ids=position_ids, **kwargs)
        if cos.dtype == torch.float32:
            return (cos * 8192).round() / 8192, (sin * 8192).round() / 8192
        return cos, sin

    def coarse_referee(*args, **kwargs):  # the referee's runs only: the split uses the same rotary class
        with monkeypatch.context() as m:
            m.setattr(modeling_qwen2.Qwen2RotaryEmbedding, "forward", coarse)
            return referee(*args, **kwargs)
    monkeypatch.setattr(TextLM, "referee", coarse_referee)
    report = verify.verify_split(qwen2_dir)
    assert report.ok, verify.format_report(report)
    assert report.worst > 1e-5  # the old fixed 1e-5 would have failed it


def test_the_same_checkpoint_gives_the_same_figures_in_every_run(qwen2_dir, tmp_path):
    """Three processes (each its own hash seed, allocation addresses and oneMKL start-up): identical JSON."""
    reports = []
    for i in range(3):
        out = tmp_path / f"v{i}.json"
        done = subprocess.run([sys.executable, "-m", "hybrid_vla_ros", "verify-split", "--model", str(qwen2_dir),
                               "--quiet", "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        reports.append(json.loads(out.read_text()))
    assert reports[0] == reports[1] == reports[2]


def test_a_fixed_tolerance_replaces_the_rounding_basis(qwen2_dir):
    report = verify.verify_split(qwen2_dir, tolerance=1e-3, layers=[1])
    assert report.ok and report.rows[0].allowed_prefix == report.rows[0].allowed_final == 1e-3
    assert "fixed max abs difference of 0.001" in report.basis
