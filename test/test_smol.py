"""The `smol` preset: a real pretrained LLM (SmolLM2-135M) in the loop, split exactly at every K."""
import pytest
import torch
from safetensors import safe_open

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, load_stage
from hybrid_vla_ros.model.config import SMOL_PROMPT, SMOL_PROMPT_IDS, VLAConfig
from hybrid_vla_ros.model.modeling import run_blocks
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.image import decode_compressed, preprocess


@pytest.fixture(scope="module")
def smol_pixels(embedded_bag, smol_checkpoint):
    """The embedded bag's first frame, 6 real cameras, preprocessed for smol (128x128)."""
    from rosbags.typesys import Stores, get_typestore

    cfg = VLAConfig.load(smol_checkpoint)
    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(embedded_bag):
        if m.topic.endswith("/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    images = [decode_compressed(first[t].format, first[t].data) for t in sorted(first)]
    return preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std)


def test_prompt_ids_are_the_smollm2_tokenisation_of_the_prompt():
    from hybrid_vla_ros.model.gguf_llm import tokenize

    assert tokenize(SMOL_PROMPT) == SMOL_PROMPT_IDS


def test_checkpoint_holds_the_pretrained_llm(smol_checkpoint):
    from hybrid_vla_ros.model.gguf_llm import load_gguf_llm

    _, gguf = load_gguf_llm()
    with safe_open(str(smol_checkpoint / WEIGHTS_FILE), framework="pt") as f:
        for key in ("embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.29.mlp.down_proj.weight",
                    "norm.weight"):
            assert torch.equal(f.get_tensor(key), gguf[key]), key
        assert f.metadata()["pretrained_llm"].startswith("SmolLM2-135M")


def test_llm_blocks_of_the_checkpoint_still_speak_english(smol_checkpoint):
    """Run the checkpoint's own embeddings, 30 blocks and norm as a language model (tied head): the
    greedy continuation of 'The capital of France is' is ' Paris'. Proves the blocks the prefix and
    suffix split are the pretrained ones, in order, with the right rotary positions."""
    from hybrid_vla_ros.model.gguf_llm import load_gguf_tokenizer, tokenize

    full = load_stage(smol_checkpoint, "full")
    ids = torch.tensor(tokenize("The capital of France is"))
    with torch.inference_mode():
        h = run_blocks(full, full.layers, full.embed_tokens(ids))
        logits = full.norm(h[-1]) @ full.embed_tokens.weight.T
    assert load_gguf_tokenizer().decode([int(logits.argmax())]) == " Paris"


def test_split_is_exact_for_every_layer(smol_checkpoint, smol_pixels):
    cfg = VLAConfig.load(smol_checkpoint)
    ego = torch.tensor([6.0, 0.3, -0.02])
    full = load_stage(smol_checkpoint, "full")
    with torch.inference_mode():
        reference = full(smol_pixels, ego)
        for k in range(cfg.num_layers + 1):
            hidden = load_stage(smol_checkpoint, "prefix", k)(smol_pixels, ego)
            assert hidden.shape == cfg.prefix_state_shape == (15 + 64 + 1 + 1, 576)
            out = load_stage(smol_checkpoint, "suffix", k)(hidden)
            assert (out - reference).abs().max().item() <= 1e-5, f"split layer {k} differs"
