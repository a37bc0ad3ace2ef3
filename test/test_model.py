"""Model partition: exactness of suffix(prefix(x)) for every split layer, partial loading, contracts."""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, init_model, load_stage, model_id
from hybrid_vla_ros.model.config import VLAConfig
from hybrid_vla_ros.model.modeling import VLAModel
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.image import decode_compressed, preprocess


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
    from hybrid_vla_ros.model.config import preset

    d = preset("tiny").to_dict()
    d["planning_token_id"] = 10_000
    with pytest.raises(ValueError, match="vocabulary"):
        VLAConfig.from_dict(d)
    d = preset("tiny").to_dict()
    d["image_size"] = 70
    with pytest.raises(ValueError, match="image_size"):
        VLAConfig.from_dict(d)


# ------------------------------------------------------------------------------------ model families
#: Published parameter counts (model cards / papers): Vicuna-7B (LLaMA-7B shape, with its LM head)
#: 6.74 B, Qwen2-0.5B 0.49 B, Qwen2.5-3B 3.09 B (tied embeddings), EVA-02-L 0.30 B (304 M).
PUBLISHED_LLM = {"orion": 6.74e9, "minddrive-0.5b": 0.494e9, "minddrive-3b": 3.09e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_LLM))
def test_published_presets_match_parameter_counts_on_meta(name):
    from hybrid_vla_ros.model.config import preset
    from hybrid_vla_ros.model.modeling import parameter_counts

    counts = parameter_counts(preset(name))
    assert counts["llm_published"] == pytest.approx(PUBLISHED_LLM[name], rel=0.02)
    assert counts["vision"] == pytest.approx(0.304e9, rel=0.02)
    cfg = preset(name)
    # the published query heads: 256 + 16 + 1 object tokens and 256 map tokens (MindDrive); Orion without the
    # 16 scene-history tokens; MindDrive-0.5B's map head as published (10.8 M: the published module's parameters
    # at the LLM width 896)
    assert cfg.n_cameras == 6 and cfg.image_size == 640
    assert cfg.num_vision_tokens == (513 if name == "orion" else 529)
    assert cfg.n_modes == 6 and not cfg.ego_state_input  # the can-bus token carries the motion
    with torch.device("meta"):
        heads = VLAModel(cfg).projector
    if name == "minddrive-0.5b":
        assert sum(p.numel() for p in heads.map_head.parameters()) == pytest.approx(10.77e6, rel=0.01)


def test_published_architectures():
    from hybrid_vla_ros.model.config import preset

    orion = preset("orion")
    assert (orion.num_layers, orion.hidden_size, orion.llm["num_attention_heads"], orion.llm["intermediate_size"]) \
        == (32, 4096, 32, 11008)
    assert orion.prefix_state_shape == (8 + 513 + 1, 4096)
    m05 = preset("minddrive-0.5b")
    assert (m05.llm_type, m05.num_layers, m05.hidden_size, m05.llm["num_attention_heads"],
            m05.llm["num_key_value_heads"], m05.llm["intermediate_size"]) == ("qwen2", 24, 896, 14, 2, 4864)
    # 8 prompt + 529 scene tokens + <waypoint_ego> + <path_waypoint_ego>; two LLM passes (decision, action) cross
    # the split
    assert m05.prefix_state_shape == (2, 539, 896)
    assert preset("minddrive-0.5b", llm_passes=1).prefix_state_shape == (539, 896)
    m3 = preset("minddrive-3b")
    assert (m3.num_layers, m3.hidden_size, m3.llm["num_attention_heads"], m3.llm["intermediate_size"]) \
        == (36, 2048, 16, 11008)
    with pytest.raises(ValueError, match="unknown preset option"):
        preset("orion", n_gpus=2)
    with pytest.raises(ValueError, match="llm_passes"):
        preset("orion", llm_passes=3)


#: Small variants of every architectural option, exercised end to end on real pixels.
VARIANTS = {
    "qwen2_query_ego_two_passes": dict(
        llm=dict(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                 num_attention_heads=6, num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-6,
                 max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=True),
        projector={"type": "query", "num_queries": 20, "num_layers": 2, "num_heads": 2},
        ego_state_input=True, llm_passes=2),
    "llama_mlp_ego": dict(ego_state_input=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_split_is_exact_for_every_variant_and_layer(tmp_path, real_pixels, variant):
    from hybrid_vla_ros.model.config import NAV_COMMANDS

    path = tmp_path / variant
    cfg = init_model("tiny", path, overrides=VARIANTS[variant])
    ego = torch.tensor([8.3, -0.4, 0.05])
    full = load_stage(path, "full")
    with torch.inference_mode():
        reference = {c: full(real_pixels, ego, c) for c in range(len(NAV_COMMANDS))}
        assert not torch.equal(reference[0], reference[3]), "the navigation command selects another mode"
        assert not torch.equal(full(real_pixels, ego * 2), reference[3]), "the ego state reaches the output"
        for k in range(cfg.num_layers + 1):
            hidden = load_stage(path, "prefix", k)(real_pixels, ego)
            assert hidden.shape == cfg.prefix_state_shape
            suffix = load_stage(path, "suffix", k)
            for c in (0, 3):
                assert (suffix(hidden, c) - reference[c]).abs().max().item() <= 1e-5, f"split {k} differs"
        with pytest.raises(ValueError, match="ego state"):
            full(real_pixels, None)
        with pytest.raises(ValueError, match="ego state"):
            full(real_pixels, torch.tensor([1.0, float("nan"), 0.0]))
        with pytest.raises(ValueError, match="navigation command"):
            full(real_pixels, ego, 6)
    if cfg.llm_passes == 2:
        out = load_stage(path, "suffix", 1).plan_all(load_stage(path, "prefix", 1)(real_pixels, ego))
        assert out.decision_logits.shape == (len(NAV_COMMANDS),) and out.modes.shape == (6, cfg.n_waypoints, 2)


def test_image_resize_is_part_of_the_checkpoint_contract():
    """``image_resize`` in config.json: checked against the filters, written only when not the default (a
    checkpoint without it reads as before, ``area``), and the same check for own code's ``driving`` dict."""
    from hybrid_vla_ros.model.config import RESIZE_FILTERS, VLAConfig
    from hybrid_vla_ros.model.extension import _driving
    from hybrid_vla_ros.model.sources import CheckpointError

    base = VLAConfig(llm={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                          "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64},
                     vision={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "intermediate_size": 64, "patch_size": 16, "image_size": 64})
    assert base.image_resize == "area" and "image_resize" not in base.to_dict()
    for name in RESIZE_FILTERS[1:]:
        d = VLAConfig(**{**_plain(base), "image_resize": name}).to_dict()
        assert d["image_resize"] == name and VLAConfig.from_dict(d).image_resize == name
    with pytest.raises(ValueError,
                       match="image_resize must be one of area, bilinear, bicubic, orion_crop, got 'nearest'"):
        VLAConfig(**{**_plain(base), "image_resize": "nearest"})
    io = {"cameras": 6, "image_size": 64, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "n_waypoints": 6,
          "waypoint_dt_s": 0.5, "n_modes": 1}
    model = torch.nn.Module()
    model.driving = {**io, "image_resize": "bicubic"}
    assert _driving(model, Path("x"), "m:M")["image_resize"] == "bicubic"
    model.driving = {**io, "image_resize": "box"}
    with pytest.raises(CheckpointError, match="image_resize must be one of"):
        _driving(model, Path("x"), "m:M")


def _plain(cfg) -> dict:
    d = cfg.to_dict()
    d.pop("model_type"), d.pop("format_version")
    return d
