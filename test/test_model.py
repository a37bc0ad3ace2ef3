"""Model partition: exactness of suffix(prefix(x)) for every split layer, partial loading, contracts."""
import json

import pytest
import torch
from safetensors import safe_open

from hybrid_vla_ros.core.checkpoint import WEIGHTS_FILE, init_model, load_stage, model_id
from hybrid_vla_ros.core.config import VLAConfig
from hybrid_vla_ros.core.image import decode_compressed, preprocess
from hybrid_vla_ros.replay import read_bag


@pytest.fixture(scope="module")
def real_pixels(embedded_bag, tiny_checkpoint):
    """The first frame of the embedded bag's 6 cameras, preprocessed for the tiny model."""
    cfg = VLAConfig.load(tiny_checkpoint)
    msgs = read_bag(embedded_bag)
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in msgs:
        if m.topic.endswith("/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    images = [decode_compressed(first[t].format, first[t].data) for t in sorted(first)]
    assert len(images) == cfg.n_cameras
    return preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std)


def test_split_is_exact_for_every_layer(tiny_checkpoint, real_pixels):
    full = load_stage(tiny_checkpoint, "full")
    cfg = full.cfg
    with torch.inference_mode():
        reference = full(real_pixels)
        assert reference.shape == (cfg.n_waypoints, 2) and reference.dtype == torch.float32
        for k in range(cfg.num_layers + 1):
            prefix = load_stage(tiny_checkpoint, "prefix", k)
            suffix = load_stage(tiny_checkpoint, "suffix", k)
            hidden = prefix(real_pixels)
            assert hidden.shape == cfg.prefix_state_shape
            out = suffix(hidden)
            assert (out - reference).abs().max().item() <= 1e-5, f"split layer {k} differs"


def test_stages_load_only_their_own_weights(tiny_checkpoint):
    cfg = VLAConfig.load(tiny_checkpoint)
    with safe_open(str(tiny_checkpoint / WEIGHTS_FILE), framework="pt") as f:
        total = sum(f.get_tensor(k).numel() for k in f.keys())
    sizes = []
    for k in range(cfg.num_layers + 1):
        prefix = load_stage(tiny_checkpoint, "prefix", k)
        suffix = load_stage(tiny_checkpoint, "suffix", k)
        n_pre = sum(p.numel() for p in prefix.parameters())
        n_suf = sum(p.numel() for p in suffix.parameters())
        assert n_pre + n_suf == total, "prefix and suffix together hold each weight exactly once"
        assert len(prefix.layers) == k and len(suffix.layers) == cfg.num_layers - k
        assert not hasattr(prefix, "head") and not hasattr(suffix, "vision")
        sizes.append(n_pre)
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1], "moving K up moves weights into the prefix"


def test_decoder_blocks_are_causal(tiny_checkpoint):
    """Only the planning token (last) may see every token; changing it must not change earlier states."""
    cfg = VLAConfig.load(tiny_checkpoint)
    suffix = load_stage(tiny_checkpoint, "suffix", 0)
    h = torch.randn(cfg.prefix_state_shape)
    h2 = h.clone()
    h2[-1] += 1.0
    with torch.inference_mode():
        a = suffix.layers[0](h.unsqueeze(0), position_ids=torch.arange(h.shape[0])[None],
                             position_embeddings=suffix.rotary_emb(h[None], torch.arange(h.shape[0])[None]))
        b = suffix.layers[0](h2.unsqueeze(0), position_ids=torch.arange(h.shape[0])[None],
                             position_embeddings=suffix.rotary_emb(h2[None], torch.arange(h.shape[0])[None]))
    assert torch.equal(a[0, :-1], b[0, :-1])
    assert not torch.equal(a[0, -1], b[0, -1])


def test_bf16_stages_stay_close(tiny_checkpoint, real_pixels):
    full = load_stage(tiny_checkpoint, "full")
    prefix = load_stage(tiny_checkpoint, "prefix", 2, dtype="bf16")
    suffix = load_stage(tiny_checkpoint, "suffix", 2, dtype="bf16")
    with torch.inference_mode():
        hidden = prefix(real_pixels.bfloat16())
        assert hidden.dtype == torch.bfloat16
        drift = (suffix(hidden) - full(real_pixels)).abs().max().item()
    assert drift < 0.05, f"bf16 drift {drift:.4f} m"


def test_model_id_is_stable_and_distinguishes_checkpoints(tmp_path, tiny_checkpoint):
    assert model_id(tiny_checkpoint) == model_id(tiny_checkpoint)
    init_model("tiny", tmp_path / "other", seed=1)
    assert model_id(tmp_path / "other") != model_id(tiny_checkpoint)


def test_split_layer_out_of_range_and_bad_inputs(tiny_checkpoint):
    cfg = VLAConfig.load(tiny_checkpoint)
    for bad in (-1, cfg.num_layers + 1, True, 1.5):
        with pytest.raises(ValueError, match="split_layer"):
            load_stage(tiny_checkpoint, "prefix", bad)
    with pytest.raises(ValueError, match="role"):
        load_stage(tiny_checkpoint, "middle", 1)
    with pytest.raises(ValueError, match="dtype"):
        load_stage(tiny_checkpoint, "suffix", 1, dtype="int8")
    suffix = load_stage(tiny_checkpoint, "suffix", 1)
    with pytest.raises(ValueError, match="hidden states shape"):
        suffix(torch.zeros(3, cfg.hidden_size))
    prefix = load_stage(tiny_checkpoint, "prefix", 1)
    with pytest.raises(ValueError, match="pixel_values shape"):
        prefix(torch.zeros(5, 3, cfg.image_size, cfg.image_size))


def test_checkpoint_errors(tmp_path, tiny_checkpoint):
    with pytest.raises(FileNotFoundError):
        load_stage(tmp_path / "nothing", "full")
    with pytest.raises(FileExistsError):
        init_model("tiny", tiny_checkpoint)
    with pytest.raises(ValueError, match="unknown preset"):
        init_model("gigantic", tmp_path / "g")
    broken = tmp_path / "broken"
    init_model("tiny", broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["llm"]["num_hidden_layers"] = 6  # config claims more blocks than the weights hold
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks"):
        load_stage(broken, "suffix", 2)
    cfg["format_version"] = 99
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="format_version"):
        VLAConfig.load(broken)


def test_config_rejects_inconsistent_values():
    from hybrid_vla_ros.core.config import preset

    d = preset("tiny").to_dict()
    d["planning_token_id"] = 10_000
    with pytest.raises(ValueError, match="vocabulary"):
        VLAConfig.from_dict(d)
    d = preset("tiny").to_dict()
    d["image_size"] = 70
    with pytest.raises(ValueError, match="image_size"):
        VLAConfig.from_dict(d)
