"""Decoding across the split (issue 40): a KV cache on each side, greedy and sampled choice, stop tokens, and the
decode against transformers' own ``generate`` on the unsplit model at every split layer K, for every text family
(tiny checkpoints written by transformers' ``save_pretrained``) and for the real SmolLM2-135M."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_builders import TEXT_FAMILIES, write_llama, write_qwen2, write_text_lm
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.decode import (MAX_TOKENS, STOP_TOKEN, DecodeSettings, SideCache, TokenChooser,
                                         decode_in_process)
from hybrid_vla_ros.split.verify_decode import CannotDecode, verify_decode

REPO = Path(__file__).resolve().parent.parent
FAMILIES = ["llama", "qwen2", *TEXT_FAMILIES]


def _write(path: Path, family: str) -> Path:
    if family == "llama":
        return write_llama(path)
    if family == "qwen2":
        return write_qwen2(path)
    return write_text_lm(path, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_equals_generate_at_every_split_layer(tmp_path, family):
    """12 tokens past a 16-token prompt: beyond the sliding windows (5, 7) of Mistral, Gemma 2 / 3 and Phi-3, and
    Gemma 2's logit soft-capping. Bit-exact against generate with the same static cache length."""
    path = _write(tmp_path / family, family)
    report = verify_decode(path, 12)
    assert [r.k for r in report.rows] == [0, 1, 2, 3]
    assert report.ok, [(r.k, r.tokens, r.first_mismatch, r.logits) for r in report.rows]
    assert all(r.tokens == report.reference_tokens and r.logits == 0.0 for r in report.rows)
    assert len(report.reference_tokens) == 12 or report.reference_tokens[-1] in _stop_ids(path)


def _stop_ids(path: Path) -> set:
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(path).eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


def _parts(path: Path, k: int):
    ck = open_checkpoint(path)
    sm = ck.split_model()
    config = sm.text_config()
    return (sm, ck.load("prefix", k), ck.load("suffix", k), ck.load("lm_head"), SideCache(config, 40, 0),
            SideCache(config, 40, k), sm.example_inputs(True))


def test_a_split_that_differs_is_caught(tmp_path):
    """Control: a suffix at K = 1 behind a prefix at K = 2 runs block 1 twice (and its cache holds block 1 twice
    over): the decode's logits part from the right split's by far more than the tolerance."""
    path = write_llama(tmp_path / "llama")
    ck = open_checkpoint(path)
    config = ck.split_model().text_config()
    sm, prefix, suffix, head, pc, sc, inputs = _parts(path, 2)
    with torch.inference_mode():
        good = decode_in_process(sm, prefix, suffix, head, pc, sc, inputs, DecodeSettings(max_new_tokens=6))
        bad = decode_in_process(sm, prefix, ck.load("suffix", 1), head, pc, SideCache(config, 40, 1), inputs,
                                DecodeSettings(max_new_tokens=6))
    assert max((a - b).abs().max().item() for a, b in zip(good.logits, bad.logits)) > 1e-2


def test_stop_token_ends_the_frame_and_max_tokens_is_said(tmp_path):
    path = write_qwen2(tmp_path / "qwen2")
    sm, prefix, suffix, head, pc, sc, inputs = _parts(path, 1)
    with torch.inference_mode():
        free = decode_in_process(sm, prefix, suffix, head, pc, sc, inputs, DecodeSettings(max_new_tokens=8))
        stop = free.tokens[3]
        first = free.tokens.index(stop)
        stopped = decode_in_process(sm, prefix, suffix, head, pc, sc, inputs,
                                    DecodeSettings(max_new_tokens=8, stop_token_ids=(stop,)))
    assert free.ended == MAX_TOKENS and len(free.tokens) == 8
    assert stopped.ended == STOP_TOKEN and stopped.tokens == free.tokens[:first + 1]


def test_sampling_with_a_seed_is_the_same_at_every_split_layer(tmp_path):
    path = write_llama(tmp_path / "llama")
    settings = DecodeSettings(max_new_tokens=10, temperature=1.5, top_p=0.95, seed=7)
    runs = {}
    with torch.inference_mode():
        for k in (0, 1, 3):
            sm, prefix, suffix, head, pc, sc, inputs = _parts(path, k)
            runs[k] = decode_in_process(sm, prefix, suffix, head, pc, sc, inputs, settings, frame_seq=4).tokens
        other = decode_in_process(sm, prefix, suffix, head, pc, sc, inputs, settings, frame_seq=5).tokens
        greedy = decode_in_process(sm, prefix, suffix, head, pc, sc, inputs,
                                   DecodeSettings(max_new_tokens=10)).tokens
    assert runs[0] == runs[1] == runs[3]
    assert other != runs[0] and greedy != runs[0], "another frame's seed, or greedy, chooses otherwise"


def test_top_p_keeps_the_smallest_set_reaching_p():
    """TopPLogitsWarper's rule: probabilities 0.5, 0.3, 0.15, 0.05 with top_p 0.8 keep the first two."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    chooser = TokenChooser(DecodeSettings(temperature=1.0, top_p=0.8, seed=0))
    chooser.start()
    draws = {chooser.choose(logits) for _ in range(400)}
    assert draws == {0, 1}
    with pytest.raises(ValueError, match="top_p"):
        DecodeSettings(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        DecodeSettings(max_new_tokens=0)


def test_a_model_without_a_language_model_head_is_refused_in_one_line(tiny_checkpoint):
    with pytest.raises(CannotDecode, match="no language-model head"):
        verify_decode(tiny_checkpoint, 4)
    run = subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", "verify-split", "--model",
                          str(tiny_checkpoint), "--decode-tokens", "4"], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "cannot decode" in run.stderr, run.stderr


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl", "qwen3_vl_moe", "internvl_qwen3_moe",
                                    "glm4v", "aya_vision"])
def test_a_vlm_decodes_as_its_own_generate_at_every_split_layer(tmp_path, family):
    """A camera frame of the embedded bag through the family's processor, then 8 greedy tokens: the decode steps'
    multimodal rotary positions continue after the prefill's largest (Qwen-VL's and GLM-4V's rope_deltas),
    InternVL's plain ones from the cache; the LM head is read where the directory stores it (InternVL ties it to
    the embeddings) and scaled as the VLM's own generation class does (Aya Vision: not by its Cohere 2 text
    model's logit_scale)."""
    from vlm_builders import VLM_BUILDERS

    builder, options = VLM_BUILDERS[family]
    path = builder(tmp_path / family, **options)
    report = verify_decode(path, 8)
    assert report.ok and len(report.rows) == 4, [(r.k, r.tokens, r.first_mismatch, r.logits) for r in report.rows]
    assert all(r.logits == 0.0 for r in report.rows) and report.prompt_tokens > 40
