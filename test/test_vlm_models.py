"""Transformers VLM directories split at K: every family against transformers' own forward.

Each directory is written by transformers' ``save_pretrained`` (sharded) with its family's own processor
(test/vlm_builders.py). The reference is transformers' ``<Family>ForConditionalGeneration.from_pretrained`` on
the same processor outputs, run in this file with forward pre-hooks on its text blocks (the input of block K is
what crosses the split at K) -- no code of the split path on the reference side. The input: real camera frames
of the embedded bag through the family's processor.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from vlm_builders import VLM_BUILDERS
from hybrid_vla_ros.model.checkpoint import open_checkpoint

TOL = 1e-5
CAMERAS = 2


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {name: builder(root / name, **kw) for name, (builder, kw) in VLM_BUILDERS.items()}


def _camera_images(size):
    from hybrid_vla_ros.split.verify import bag_images

    return bag_images(CAMERAS, size)


def _reference(path, inputs):
    """transformers' own forward: each text block's input (L entries) and last_hidden_state, batch dropped."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    text = getattr(model.model, "language_model", None) or model.model.text_model
    states = []
    for layer in text.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: states.append((a[0] if a else kw["hidden_states"])[0]),
                                        with_kwargs=True)
    last = model.model(input_ids=inputs.input_ids, **inputs.images).last_hidden_state[0]
    return states + [last]


@pytest.mark.parametrize("family", sorted(VLM_BUILDERS))
def test_every_family_splits_exactly_at_every_k(vlm_dirs, family):
    """For every K: the prefix's h_K equals the input of transformers' text block K, and the suffix's final
    hidden states equal transformers' last_hidden_state, fp32 max abs diff <= 1e-5 -- with the side tensors the
    family needs (Qwen-VL: multimodal positions; Qwen3-VL: DeepStack features too) crossing with h_K."""
    from hybrid_vla_ros.model.vlm import load_processor, run_processor

    path = vlm_dirs[family]
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 3, "sharded"
    ck = open_checkpoint(path, cameras=CAMERAS)
    cfg = ck.model
    inputs = run_processor(load_processor(path, cfg.vlm_type), _camera_images(cfg.camera_size), cfg.prompt)
    assert inputs.tokens == cfg.num_tokens
    with torch.inference_mode():
        ref = _reference(path, inputs)
        L = ck.num_layers
        assert len(ref) == L + 1
        for k in range(L + 1):
            state = ck.load("prefix", k)(inputs)
            assert state.hidden_states.shape == (cfg.num_tokens, cfg.hidden_size)
            assert set(state.side()) == set(cfg.side), "the side tensors the spec declares, and only those"
            if k < L:
                assert (state.hidden_states - ref[k]).abs().max().item() <= TOL, f"h_{k} differs"
            final = ck.load("suffix", k).final_hidden_states(state)
            assert (final - ref[L]).abs().max().item() <= TOL, f"split at {k}: final hidden states differ"
        assert ref[1].abs().max() > 1 and (ref[L] - ref[0]).abs().max() > 0.5, "O(1) states; the blocks act"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_the_side_tensors_are_needed(vlm_dirs, family):
    """Negative control: the suffix run without the multimodal positions (plain 0..T-1) or, for Qwen3-VL, without
    the DeepStack features the prefix did not add yet (K = 0) differs from transformers far beyond the tolerance;
    a suffix asked to run without a declared side tensor refuses, naming it."""
    from hybrid_vla_ros.model.contract import SplitState
    from hybrid_vla_ros.model.vlm import load_processor, run_processor

    path = vlm_dirs[family]
    ck = open_checkpoint(path, cameras=CAMERAS)
    cfg = ck.model
    inputs = run_processor(load_processor(path, cfg.vlm_type), _camera_images(cfg.camera_size), cfg.prompt)
    with torch.inference_mode():
        ref = _reference(path, inputs)
        state = ck.load("prefix", 0)(inputs)
        suffix = ck.load("suffix", 0)
        assert (suffix.final_hidden_states(state) - ref[-1]).abs().max().item() <= TOL
        with pytest.raises(ValueError, match="position_ids"):
            suffix.final_hidden_states(SplitState(state.hidden_states))
        suffix.cfg.side = ()  # let it run without: the plain positions give other states
        assert (suffix.final_hidden_states(SplitState(state.hidden_states)) - ref[-1]).abs().max().item() > 1e-2
        if family == "qwen3_vl":
            no_deep = SplitState(state.hidden_states, state.position_ids)
            assert (suffix.final_hidden_states(no_deep) - ref[-1]).abs().max().item() > 1e-2


def _side_tensors_are_needed(suffix, state, final, named: str) -> None:
    """The suffix on ``state`` equals transformers' ``final`` hidden states; without the side tensors it refuses,
    naming ``named``; told it needs none, it runs and differs far beyond the tolerance."""
    from hybrid_vla_ros.model.contract import SplitState

    assert (suffix.final_hidden_states(state) - final).abs().max().item() <= TOL
    with pytest.raises(ValueError, match=named):
        suffix.final_hidden_states(SplitState(state.hidden_states))
    suffix.cfg.side = ()
    assert (suffix.final_hidden_states(SplitState(state.hidden_states)) - final).abs().max().item() > 1e-2


def test_gemma3s_image_blocks_are_needed(vlm_dirs):
    """Gemma 3's image tokens attend to each other both ways: its image blocks cross with h_K, and a suffix run
    without them (causal masks only) differs from transformers far beyond the tolerance; one that lacks the
    declared side tensor refuses, naming it. A decode is refused in one line (its masks against a split KV cache
    are not built)."""
    from hybrid_vla_ros.model.vlm import load_processor, run_processor
    from hybrid_vla_ros.split.verify_decode import CannotDecode, verify_decode

    path = vlm_dirs["gemma3"]
    ck = open_checkpoint(path, cameras=CAMERAS)
    cfg = ck.model
    assert cfg.side == ("image_blocks",)
    inputs = run_processor(load_processor(path, cfg.vlm_type), _camera_images(cfg.camera_size), cfg.prompt)
    with torch.inference_mode():
        ref = _reference(path, inputs)
        state = ck.load("prefix", 1)(inputs)
        blocks = state.image_blocks
        assert sorted(set(blocks.tolist())) == [-1, 0, 1] and int((blocks >= 0).sum()) == 2 * 4
        _side_tensors_are_needed(ck.load("suffix", 1), state, ref[-1], "image_blocks")
    with pytest.raises(CannotDecode, match="both ways"):
        verify_decode(path, 2)


def test_paligemmas_prefix_attends_both_ways_by_its_own_rule(vlm_dirs):
    """PaliGemma's images and prompt (its prefix) attend to each other both ways, and its sliding layers OR the
    prefix into the window (not Gemma 3's window AND): the prefix block and the positions (counted from 1) cross
    with h_K; a suffix that combines them by Gemma 3's rule, or runs causal masks only, differs from transformers
    far beyond the tolerance."""
    from hybrid_vla_ros.model.contract import BlockMaskRule, SplitState
    from hybrid_vla_ros.model.vlm import _BLOCK_MASK_RULES, load_processor, run_processor

    path = vlm_dirs["paligemma"]
    ck = open_checkpoint(path, cameras=CAMERAS)
    cfg = ck.model
    assert cfg.side == ("position_ids", "image_blocks")
    inputs = run_processor(load_processor(path, cfg.vlm_type), _camera_images(cfg.camera_size), cfg.prompt)
    with torch.inference_mode():
        ref = _reference(path, inputs)
        state = ck.load("prefix", 1)(inputs)
        assert state.image_blocks.tolist() == [0] * cfg.num_tokens, "the whole prompt is PaliGemma's prefix"
        assert state.position_ids.reshape(-1).tolist() == list(range(1, cfg.num_tokens + 1))
        assert cfg.num_tokens > 2 * 6, "longer than the sliding window, so the rules differ"
        suffix = ck.load("suffix", 1)
        assert (suffix.final_hidden_states(state) - ref[-1]).abs().max().item() <= TOL
        try:
            _BLOCK_MASK_RULES["paligemma"] = BlockMaskRule.WINDOW_OF_BLOCKS
            assert (suffix.final_hidden_states(state) - ref[-1]).abs().max().item() > 1e-2, "Gemma 3's rule"
        finally:
            _BLOCK_MASK_RULES["paligemma"] = BlockMaskRule.EACH_KIND
        suffix.cfg.side = ("position_ids",)
        causal = SplitState(state.hidden_states, state.position_ids)
        assert (suffix.final_hidden_states(causal) - ref[-1]).abs().max().item() > 1e-2, "causal masks only"


def test_mllamas_cross_attention_blocks_read_the_vision_states_that_cross(vlm_dirs):
    """Mllama's block 1 is a cross-attention block: the text tokens are not image tokens, the vision states reach
    the text model only there. They cross with h_K (with the prepared cross-attention mask and rows) when the block
    is on the suffix's side; a suffix run without them (the block skipped, as transformers skips it for text alone)
    differs from transformers far beyond the tolerance, one that lacks them refuses naming them, and a decode is
    refused in one line (its cross-attention cache is not built across the split)."""
    from hybrid_vla_ros.model.vlm import load_processor, run_processor
    from hybrid_vla_ros.split.verify_decode import CannotDecode, verify_decode

    path = vlm_dirs["mllama"]
    ck = open_checkpoint(path, cameras=CAMERAS)
    cfg = ck.model
    assert cfg.side == ("cross_states", "cross_mask", "cross_rows")
    inputs = run_processor(load_processor(path, cfg.vlm_type), _camera_images(cfg.camera_size), cfg.prompt)
    with torch.inference_mode():
        ref = _reference(path, inputs)
        state = ck.load("prefix", 1)(inputs)
        tiles, patches, width = state.cross_states.shape
        assert (tiles, width) == (CAMERAS * 2, cfg.hidden_size) and patches == 17, "2 tiles a camera, 16 + 1 patches"
        assert state.cross_mask.shape == (1, 1, cfg.num_tokens, tiles * patches)
        _side_tensors_are_needed(ck.load("suffix", 1), state, ref[-1], "cross_states")
    with pytest.raises(CannotDecode, match="cross-attention"):
        verify_decode(path, 2)


class _PixtralPrompt:
    """Stand-in for transformers' ``PixtralProcessor``, which cannot be imported on this host (its module imports
    torchvision, whose wheels do not load with the CPU build of torch here): transformers' own
    ``PixtralImageProcessorPil`` for the pixels and image sizes, and each ``[IMG]`` of the prompt expanded as
    PixtralProcessor documents it (per row of merged patches: one ``[IMG]`` each, then ``[IMG_BREAK]``; the last
    break is ``[IMG_END]``). It models the processor only; the split and the referee are the real ones."""

    image_token = "[IMG]"

    def __init__(self, path):
        from transformers import AutoTokenizer, PixtralImageProcessorPil

        self.images = PixtralImageProcessorPil.from_pretrained(str(path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))

    def __call__(self, images, text, return_tensors="pt"):
        out = self.images(images=images, return_tensors="pt")
        step = 8 * 2  # patch 8, merge 2 (write_mistral3)
        pieces = text.split(self.image_token)
        words = [pieces[0]]
        for (h, w), rest in zip(out["image_sizes"].tolist(), pieces[1:]):
            rows = [" ".join(["[IMG]"] * (w // step)) + " [IMG_BREAK]" for _ in range(h // step)]
            words.append(" " + " ".join(rows)[:-len("[IMG_BREAK]")] + "[IMG_END] " + rest)
        ids = self.tokenizer("".join(words), return_tensors="pt")
        return {"input_ids": ids["input_ids"], "pixel_values": out["pixel_values"],
                "image_sizes": out["image_sizes"]}


def test_mistral3_needs_torchvision_here_and_splits_exactly_with_pixtral_inputs(tmp_path, monkeypatch):
    """Mistral 3 (Pixtral tower with 2-D rotary positions and image sizes, patch merger, Mistral text): on this host
    its directory is refused in one line naming torchvision (its processor's dependency). With the processor
    modelled (:class:`_PixtralPrompt`), the split is exact at every K against transformers' own forward on the same
    inputs: h_K, the final hidden states, and the image tokens' count per camera."""
    import hybrid_vla_ros.model.vlm as vlm
    from vlm_builders import write_mistral3
    from hybrid_vla_ros.model.sources import MissingFileError
    from hybrid_vla_ros.model.vlm import load_processor, run_processor

    path = write_mistral3(tmp_path / "mistral3")
    with pytest.raises(MissingFileError, match="PixtralProcessor.*needs torchvision"):
        load_processor(path, "mistral3")
    monkeypatch.setattr(vlm, "load_processor", lambda p, t: _PixtralPrompt(p))
    ck = open_checkpoint(path, cameras=CAMERAS)
    cfg = ck.model
    inputs = run_processor(_PixtralPrompt(path), _camera_images(cfg.camera_size), cfg.prompt)
    assert inputs.tokens == cfg.num_tokens
    image_id = _PixtralPrompt(path).tokenizer.convert_tokens_to_ids("[IMG]")
    assert int((inputs.input_ids == image_id).sum()) > 0
    with torch.inference_mode():
        ref = _reference(path, inputs)
        L = ck.num_layers
        for k in range(L + 1):
            state = ck.load("prefix", k)(inputs)
            if k < L:
                assert (state.hidden_states - ref[k]).abs().max().item() <= TOL, f"h_{k} differs"
            final = ck.load("suffix", k).final_hidden_states(state)
            assert (final - ref[L]).abs().max().item() <= TOL, f"split at {k}: final hidden states differ"
        assert (ref[L] - ref[0]).abs().max() > 0.5


def test_the_processor_sees_the_camera_images_in_rgb(vlm_dirs):
    """The images the processor gets are the cameras' RGB (the bag's JPEGs decoded as RGB, resized): swapping to
    BGR changes the pixel values the family's processor produces, so a colour-order slip cannot pass unseen."""
    from hybrid_vla_ros.model.vlm import load_processor, run_processor

    path = vlm_dirs["qwen2_5_vl"]
    cfg = open_checkpoint(path, cameras=CAMERAS).model
    processor = load_processor(path, cfg.vlm_type)
    images = _camera_images(cfg.camera_size)
    assert all(im.shape == (cfg.camera_size[1], cfg.camera_size[0], 3) for im in images)
    rgb = run_processor(processor, images, cfg.prompt).images["pixel_values"]
    bgr = run_processor(processor, [im[..., ::-1].copy() for im in images], cfg.prompt).images["pixel_values"]
    assert (rgb - bgr).abs().max() > 0.1
    red = np.zeros_like(images[0])
    red[..., 0] = 255
    out = run_processor(processor, [red] * CAMERAS, cfg.prompt).images["pixel_values"]
    # Qwen-VL's flattened patches are (channel, temporal, patch, patch): the red channel is the first third
    mean = processor.image_processor.image_mean
    std = processor.image_processor.image_std
    third = out.shape[1] // 3
    assert torch.allclose(out[:, :third], torch.full_like(out[:, :third], (1 - mean[0]) / std[0]), atol=1e-3)


@pytest.mark.parametrize("family", ["internvl", "qwen2_5_vl", "qwen3_vl", "paligemma", "mllama"])
def test_cli_verify_split_and_plan_on_a_vlm_directory(vlm_dirs, family, tmp_path, capsys):
    """`hybrid-vla verify-split --model DIR` exits 0 at every K; `hybrid-vla profile` times every block (Mllama's
    cross-attention block reading the vision states the prefix made) and `hybrid-vla plan --model DIR --profile`
    lists L + 1 rows, its hand-off bytes the hidden states plus the declared side tensors (none, positions,
    positions + DeepStack, positions + PaliGemma's prefix, Mllama's vision states and masks; every family's
    directory is checked at every K above, and through the CLI on its composition below)."""
    from hybrid_vla_ros.model.contract import side_bytes
    from hybrid_vla_ros.tools.cli import main

    path = vlm_dirs[family]
    capsys.readouterr()
    assert main(["verify-split", "--model", str(path), "--quiet", "--cameras", str(CAMERAS)]) == 0
    out = capsys.readouterr().out
    assert "OK: 4 of 4 split layers within the allowed difference" in out, out
    assert "through the family's processor" in out, out
    assert main(["profile", "--model", str(path), "--cameras", str(CAMERAS), "--warmup", "0", "--quiet",
                 "--out", str(tmp_path / "profile.json")]) == 0
    assert main(["plan", "--model", str(path), "--dtype", "fp32", "--cameras", str(CAMERAS), "--json",
                 str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json")]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert [r["k"] for r in rows] == [0, 1, 2, 3]
    assert all(r["suffix_ms"] is not None and r["suffix_ms"] >= 0 for r in rows), rows
    cfg = open_checkpoint(path, cameras=CAMERAS).model
    want = cfg.num_tokens * cfg.hidden_size * 4 + side_bytes(cfg, torch.float32)
    assert all(r["handoff_bytes"] == want for r in rows), (rows[0]["handoff_bytes"], want)
    assert (side_bytes(cfg, torch.float32) > 0) == bool(cfg.side)


def test_a_prompt_without_one_placeholder_per_camera_is_refused(vlm_dirs, capsys):
    from hybrid_vla_ros.tools.cli import main

    path = vlm_dirs["internvl"]
    capsys.readouterr()
    code = main(["plan", "--model", str(path), "--cameras", "2", "--prompt", "camera 1 <IMG_CONTEXT> plan"])
    err = capsys.readouterr().err
    assert code == 1 and "one per camera" in err and "1 image placeholder" in err, err


def test_both_stored_layouts_read_the_same(vlm_dirs, tmp_path):
    """A Qwen2.5-VL saved in transformers' default (legacy checkpoint) layout and in its 5.x in-memory layout
    (``save_original_format=False``) give the same split."""
    from transformers import AutoModelForImageTextToText

    from hybrid_vla_ros.model.vlm import load_processor, run_processor

    path = vlm_dirs["qwen2_5_vl"]
    other = tmp_path / "v5"
    AutoModelForImageTextToText.from_pretrained(str(path)).save_pretrained(str(other), max_shard_size="100KB",
                                                                           save_original_format=False)
    for f in path.iterdir():
        if not f.name.startswith("model") and f.name != "config.json":
            shutil.copy(f, other / f.name)
    stored = set(json.loads((other / "model.safetensors.index.json").read_text())["weight_map"])
    legacy = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    assert stored != legacy, "the two layouts name the tensors differently"
    a, b = open_checkpoint(path, cameras=CAMERAS), open_checkpoint(other, cameras=CAMERAS)
    inputs = run_processor(load_processor(path, a.model.vlm_type), _camera_images(a.model.camera_size), a.model.prompt)
    with torch.inference_mode():
        assert torch.equal(a.load("prefix", 2)(inputs).hidden_states, b.load("prefix", 2)(inputs).hidden_states)


@pytest.mark.parametrize("family", sorted(VLM_BUILDERS))
def test_a_composition_on_every_family_verifies(vlm_dirs, family, tmp_path, capsys):
    """`hybrid-vla init-model --preset tiny --vlm DIR OUT` on every family, then `verify-split --model OUT`: the
    planning head's waypoints on transformers' final state of the planning token agree at every K."""
    from hybrid_vla_ros.tools.cli import main

    out = tmp_path / "drive"
    assert main(["init-model", "--preset", "tiny", "--vlm", str(vlm_dirs[family]), str(out)]) == 0
    capsys.readouterr()
    assert main(["verify-split", "--model", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "OK: 4 of 4 split layers within the allowed difference" in text, text
    rows = [line for line in text.splitlines() if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 4 and all(line.split("|")[3].strip() != "-" for line in rows), "waypoints at every K"


def test_profile_and_split_layer_auto_on_a_vlm_composition(vlm_dirs, tmp_path):
    """`hybrid-vla profile --model OUT` times the VLM front (the family's processor outputs through its own base
    model) and every text block; `plan --profile` then chooses K with latencies, as `split_layer: auto` does."""
    from hybrid_vla_ros.split.planner import plan_for_checkpoint
    from hybrid_vla_ros.tools.cli import main

    out = tmp_path / "drive"
    assert main(["init-model", "--preset", "tiny", "--vlm", str(vlm_dirs["qwen3_vl"]), str(out)]) == 0
    assert main(["profile", "--model", str(out), "--device", "cpu", "--repeats", "1", "--quiet", "--out",
                 str(tmp_path / "p.json")]) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    cpu = doc["devices"]["cpu"]
    assert len(cpu["llm_blocks_ms"]) == 3 and all(ms > 0 for ms in cpu["llm_blocks_ms"])
    assert cpu["parts_ms"]["vision_embeddings"] > 0 and cpu["parts_ms"]["head"] > 0
    plan = plan_for_checkpoint(out, tmp_path / "p.json", None, "fp32")
    assert plan.chosen_k in range(4) and all(r.e2e_ms is not None for r in plan.rows), plan.reason
