"""The compiled suffix backend (hybrid_vla_ros.runtime.suffix_backend): its waypoints against eager on the real
SmolLM2 blocks and real frames' hidden states, the artifact cache key, the fallback to eager, and a live re-split
with the backend on. Nothing here asserts a time: speed lives in the bench."""
import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, load_stage, model_id
from hybrid_vla_ros.model.config import VLAConfig
from hybrid_vla_ros.model.modeling import run_blocks
from hybrid_vla_ros.runtime import suffix_backend
from hybrid_vla_ros.model import traced
from hybrid_vla_ros.runtime.suffix_backend import SuffixBackend, artifact_key, build_openvino, weights_digest
from hybrid_vla_ros.vehicle.image import decode_compressed, preprocess


def _require_openvino():
    """openvino is pinned in requirements.txt, so CI has it: there a missing one fails instead of skipping."""
    if os.environ.get("CI"):
        import openvino  # noqa: F401
    else:
        pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def camera_frames(frames):
    """The embedded bag's frames with all 6 cameras: [[rgb (H, W, 3) uint8] * 6], camera order."""
    return [[decode_compressed(msg.format, msg.data) for _, msg in cams] for _, cams in frames]


# ------------------------------------------------------------------------------------------ numerics

#: Bounds of the compiled path against eager (waypoints in metres; planning heads are random, waypoints reach
#: about 1.5 m). fp32: the same arithmetic in another order (measured about 1e-6 m). bf16: eager rounds every
#: activation to bf16, OpenVINO computes in f32 from the bf16 weights (AVX2) or in bf16 with its own fused
#: kernels (AVX512_BF16 / AMX), so both move from the fp32 result: the compiled path may drift from fp32 at
#: most as far as eager bf16 does plus 1 cm, and from eager bf16 by at most 5 cm.
FP32_WAYPOINT_BOUND_M = 1e-3
BF16_EXTRA_DRIFT_M = 0.01
BF16_VS_EAGER_BOUND_M = 0.05


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_openvino_waypoints_match_eager_on_real_smol_blocks_and_frames(smol_checkpoint, camera_frames, tmp_path,
                                                                       dtype):
    """The last 4 real SmolLM2 blocks (K = 26) on the hidden states the real prefix (SmolLM2 blocks 0..25 over
    the embedded bag's camera tokens) computes for each frame."""
    _require_openvino()
    cfg = VLAConfig.load(smol_checkpoint)
    k = cfg.num_layers - 4
    prefix = load_stage(smol_checkpoint, "prefix", k, dtype=dtype)
    stage = load_stage(smol_checkpoint, "suffix", k, dtype=dtype)
    ref32 = load_stage(smol_checkpoint, "suffix", k, dtype="fp32") if dtype == "bf16" else stage
    backend = SuffixBackend("openvino", stage, model_id=model_id(smol_checkpoint), cache_dir=tmp_path,
                            background=False)
    backend.prepare(stage, k)
    assert backend.in_use == "openvino" and backend.compiled_k == k, backend.status()
    worst = {"vs_eager": 0.0, "vs_fp32": 0.0, "eager_vs_fp32": 0.0}
    with torch.inference_mode():
        for images in camera_frames:
            dt = prefix.layers[0].mlp.up_proj.weight.dtype
            pixels = preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std).to(dt)
            hidden = prefix(pixels, torch.tensor([5.0, 0.3, 0.02]))  # speed m/s, accel m/s^2, yaw rate rad/s
            eager = stage.plan_all(hidden, 3, k)
            ours = backend.plan_all(stage, hidden, 3, k)
            fp32 = ref32.plan_all(hidden.float(), 3, k)
            assert ours.modes.shape == eager.modes.shape and ours.waypoints.dtype == torch.float32
            worst["vs_eager"] = max(worst["vs_eager"], float((ours.modes - eager.modes).abs().max()))
            worst["vs_fp32"] = max(worst["vs_fp32"], float((ours.modes - fp32.modes).abs().max()))
            worst["eager_vs_fp32"] = max(worst["eager_vs_fp32"], float((eager.modes - fp32.modes).abs().max()))
            last = run_blocks(stage, stage.layers, hidden)[..., -1:, :].float()
            rel = float((backend._compiled.run(hidden)[..., -1:, :].float() - last).norm() / last.norm())
            assert rel < (1e-4 if dtype == "fp32" else 0.05), rel
    assert backend.frames_compiled == len(camera_frames) and backend.frames_eager == 0
    if dtype == "fp32":
        assert worst["vs_eager"] <= FP32_WAYPOINT_BOUND_M, worst
    else:
        assert worst["vs_eager"] <= BF16_VS_EAGER_BOUND_M, worst
        assert worst["vs_fp32"] <= worst["eager_vs_fp32"] + BF16_EXTRA_DRIFT_M, worst
    backend.close()


# ------------------------------------------------------------------------------------------ cache key

def _same_header_other_weights(src, dst):
    """Copy the checkpoint at ``src`` to ``dst`` with every decoder weight scaled by 1.01: the safetensors header
    (names, dtypes, shapes, offsets, metadata) stays byte for byte, so the model id is the same."""
    shutil.copytree(src, dst)
    with safe_open(str(src / WEIGHTS_FILE), framework="pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    state = {k: (v * 1.01 if k.startswith("layers.") and v.dim() == 2 else v) for k, v in state.items()}
    save_file(state, str(dst / WEIGHTS_FILE), metadata=meta)


def test_cache_key_never_reuses_an_artifact_for_other_weights_k_or_dtype(tiny_checkpoint, tmp_path):
    _require_openvino()
    cache = tmp_path / "cache"
    other = tmp_path / "other"
    _same_header_other_weights(tiny_checkpoint, other)
    assert model_id(other) == model_id(tiny_checkpoint), "same header: model_id alone cannot tell them apart"
    mid = model_id(tiny_checkpoint)

    def build(path, k, dtype):
        stage = load_stage(path, "suffix", k, dtype=dtype)
        c = build_openvino(stage, k, stage.cfg.prefix_state_shape, model_id=model_id(path), cache_dir=cache)
        dt = stage.layers[0].mlp.up_proj.weight.dtype
        h = torch.randn(stage.cfg.prefix_state_shape, generator=torch.Generator().manual_seed(k)).to(dt)
        with torch.inference_mode():
            err = float((c.run(h)[..., -1:, :].float()
                         - run_blocks(stage, stage.layers, h)[..., -1:, :].float()).abs().max())
        return c, err

    first, err = build(tiny_checkpoint, 2, "fp32")
    assert not first.cache_hit and err < 1e-4
    again, _ = build(tiny_checkpoint, 2, "fp32")
    assert again.cache_hit and again.folder == first.folder, "the same key reuses its artifact"
    folders = {first.folder}
    for path, k, dtype in ((other, 2, "fp32"), (tiny_checkpoint, 1, "fp32"), (tiny_checkpoint, 2, "bf16")):
        c, err = build(path, k, dtype)
        assert not c.cache_hit and c.folder not in folders, (path, k, dtype)
        assert err < (1e-4 if dtype == "fp32" else 0.05), "each artifact computes its own weights"
        folders.add(c.folder)
    # The key itself: every field that shapes the compiled model is in it.
    stage = load_stage(tiny_checkpoint, "suffix", 2)
    key = artifact_key(stage, 2, (1, *stage.cfg.prefix_state_shape), model_id=mid)
    assert key.weights == weights_digest(stage.layers) and key.split_layer == 2 and key.dtype == "fp32"
    for change in ({"model_id": mid + 1}, {"split_layer": 3}, {"dtype": "bf16"}, {"shape": (2, 105, 128)},
                   {"backend_version": "other"}, {"weights": "0" * 64}, {"torch_version": "0"}):
        changed = type(key)(**{**key.__dict__, **change})
        assert changed.digest() != key.digest() and changed.folder(cache) != key.folder(cache), change
    # A tampered key.json (e.g. an artifact copied from elsewhere) is never trusted: rebuilt.
    (first.folder / "key.json").write_text('{"weights": "forged"}')
    c, _ = build(tiny_checkpoint, 2, "fp32")
    assert not c.cache_hit


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRID_VLA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert suffix_backend.default_cache_dir() == tmp_path / "xdg" / "hybrid_vla_ros"
    monkeypatch.setenv("HYBRID_VLA_CACHE", str(tmp_path / "mine"))
    assert suffix_backend.default_cache_dir() == tmp_path / "mine"


# ------------------------------------------------------------------------------------------ fallback

def test_backend_falls_back_to_eager_with_a_log_line_when_openvino_cannot_be_imported(tiny_checkpoint, tmp_path,
                                                                                      monkeypatch):
    from hybrid_vla_ros.runtime.settings import SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    monkeypatch.setitem(sys.modules, "openvino", None)  # import openvino now raises ImportError
    lines = []
    settings = SuffixRunnerSettings(2, namespace=f"/sb_{uuid.uuid4().hex[:6]}", backend="openvino",
                                    backend_cache_dir=str(tmp_path))
    runner = SuffixRunner(str(tiny_checkpoint), settings, log=lambda level, msg: lines.append((level, msg)))
    try:
        assert runner.backend.in_use == "eager" and not runner.backend.active
        assert [lv for lv, _ in lines] == ["warning"]
        assert "suffix_backend openvino cannot be used, falling back to eager" in lines[0][1]
        assert "openvino" in runner.backend.status().error
        h = torch.randn(runner.cfg.prefix_state_shape)
        with torch.inference_mode():
            assert torch.equal(runner.backend(runner.stage, h, 3, 2), runner.stage(h, 3, 2))
        assert not any(tmp_path.iterdir()), "nothing built"
    finally:
        runner.close()


def test_a_failed_build_logs_serves_eagerly_and_is_not_retried(tiny_checkpoint, tmp_path, monkeypatch):
    _require_openvino()
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("conversion exploded")

    monkeypatch.setattr(suffix_backend, "build_openvino", broken)
    lines = []
    stage = load_stage(tiny_checkpoint, "suffix", 2)
    b = SuffixBackend("openvino", stage, model_id=model_id(tiny_checkpoint), cache_dir=tmp_path, background=False,
                      log=lambda level, msg: lines.append((level, msg)))
    h = torch.randn(stage.cfg.prefix_state_shape)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(b(stage, h, 3, 2), stage(h, 3, 2))
    assert len(calls) == 1 and b.in_use == "eager" and b.frames_eager == 3
    assert lines == [("error", ("suffix_backend openvino: build for K=2 failed: RuntimeError: conversion exploded; "
                                "frames at K=2 run eagerly"))]
    assert "conversion exploded" in b.status().error


def test_unknown_backend_is_refused(tiny_checkpoint):
    stage = load_stage(tiny_checkpoint, "suffix", 2)
    with pytest.raises(ValueError, match="unknown suffix backend"):
        SuffixBackend("tensorrt", stage, model_id=0)


# ------------------------------------------------------------------------------------------ live re-split

def test_live_resplit_with_openvino_gives_the_eager_outputs_at_each_k(tiny_checkpoint, frames, tmp_path):
    """Frames flow through a real ring while the prefix moves K 2 -> 1 -> 3. At each new K the first frames run
    eagerly while the backend builds for that K in the background; once it is ready the frames at that K run
    compiled. Every frame equals the monolithic eager model's output."""
    _require_openvino()
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    full = load_stage(tiny_checkpoint, "full")
    cfg = full.cfg
    refs = {}
    with torch.inference_mode():
        for stamp, items in frames:
            pixels = preprocess([decode_compressed(m.format, m.data) for _, m in items], cfg.image_size,
                                cfg.image_mean, cfg.image_std)
            refs[stamp] = full(pixels).double().numpy()
    ns = f"/sbr_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", namespace=ns, ring_slots=8))
    suffix = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, namespace=ns, backend="openvino",
                                                                     backend_cache_dir=str(tmp_path)))
    try:
        assert suffix.poll(0.05) is None  # attach
        seen = []
        i = 0
        for k in (2, 1, 3):
            if k != prefix.split_layer:
                prefix.request_split_layer(k)
                prefix.apply_split_request(timeout=None)
            for step in range(4):
                if step == 1:
                    assert suffix.backend.wait(120), "the background build finished"
                stamp, items = frames[i % len(frames)]
                i += 1
                published = prefix.run(items, stamp)
                compiled_before = suffix.backend.frames_compiled
                result = suffix.poll(5.0)
                assert result.meta.split_layer == published.split_layer == k
                assert abs(result.waypoints - refs[stamp]).max() <= 1e-5, f"frame at K={k} step {step}"
                seen.append((k, step, suffix.backend.frames_compiled > compiled_before))
            assert suffix.backend.compiled_k == k
        assert suffix.backend.failed == {}
        for k in (1, 3):  # a new K: its first frame ran eagerly (no artifact for it yet), the later ones compiled
            assert [c for kk, _, c in seen if kk == k] == [False, True, True, True], seen
        assert all(c for kk, step, c in seen if kk == 2 and step > 0), seen
        assert sorted(b.k for b in suffix.backend.builds) == [1, 2, 3]
    finally:
        suffix.close()
        prefix.close()


def test_openvino_gives_the_decision_read_out_of_a_two_pass_checkpoint(tmp_path, camera_frames):
    """A two-pass checkpoint with MindDrive's decision read-out (the LM-head rows of the meta-action tokens at
    position -2 of the decision pass): the compiled model gives the last two tokens, so the decision logits,
    the speed mode and the waypoints equal eager's (fp32)."""
    _require_openvino()
    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.model.traced import read_out_tokens

    path = tmp_path / "two_pass"
    init_model("tiny", path, overrides={"llm_passes": 2, "decision_token_ids": [3, 5, 7, 11, 13, 17, 19]})
    cfg = VLAConfig.load(path)
    assert read_out_tokens(cfg) == 2
    k = cfg.num_layers // 2
    prefix = load_stage(path, "prefix", k)
    stage = load_stage(path, "suffix", k)
    backend = SuffixBackend("openvino", stage, model_id=model_id(path), cache_dir=tmp_path / "cache",
                            background=False)
    backend.prepare(stage, k)
    assert backend.in_use == "openvino" and backend.compiled_k == k, backend.status()
    with torch.inference_mode():
        for images in camera_frames:
            pixels = preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std)
            hidden = prefix(pixels, torch.tensor([5.0, 0.3, 0.02])) if cfg.ego_state_input else prefix(pixels)
            assert hidden.dim() == 3 and hidden.shape[0] == 2  # (passes, T, H)
            eager = stage.plan_all(hidden, 3, k)
            ours = backend.plan_all(stage, hidden, 3, k)
            assert eager.speed_mode is not None and ours.speed_mode == eager.speed_mode
            assert float((ours.decision_logits - eager.decision_logits).abs().max()) < 1e-4
            assert float((ours.modes - eager.modes).abs().max()) <= FP32_WAYPOINT_BOUND_M
    assert backend.frames_compiled == len(camera_frames) and backend.frames_eager == 0
    backend.close()


# ------------------------------------------------------------------------------------------ the last block

class _ParallelBlock(torch.nn.Module):
    """A decoder block of another layout (GPT-J / Cohere style: attention and MLP both on one norm of the input,
    x + attn(norm(x)) + mlp(norm(x))) built from a LLaMA block's parts: the pre-norm composition does not give its
    output, so the compiled suffix must not leave any of its rows out."""

    def __init__(self, block):
        super().__init__()
        self.input_layernorm, self.self_attn = block.input_layernorm, block.self_attn
        self.post_attention_layernorm, self.mlp = block.post_attention_layernorm, block.mlp

    def forward(self, x, attention_mask=None, position_ids=None, position_embeddings=None, **kwargs):
        h = self.input_layernorm(x)
        attn = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=position_embeddings)[0]
        return x + attn + self.mlp(h)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_last_block_computes_only_the_read_out_rows_and_gives_the_eager_states(family, tiny_checkpoint,
                                                                                   tmp_path):
    """Block L-1 of the compiled suffix runs its residual, norm and MLP on the read-out rows only (build.json says
    so), and the compiled model still gives eager's last-token hidden states (fp32, 1e-5 relative) on the tiny
    preset's LLaMA blocks and on a transformers Qwen3 (q/k norms inside its attention) composed into a driving
    checkpoint. The check that decides it passes the family's block and refuses the same parts composed
    otherwise (a build traces the family's own block class, so that refusal is what a family of another layout
    would meet)."""
    _require_openvino()
    from hf_builders import write_text_lm

    from hybrid_vla_ros.tools.cli import main

    path = tiny_checkpoint
    if family != "llama":
        llm = write_text_lm(tmp_path / family, family)
        path = tmp_path / "drive"
        assert main(["init-model", "--preset", "tiny", "--llm", str(llm), str(path)]) == 0
    stage = load_stage(path, "suffix", 1)
    k, shape = 1, (1, *stage.cfg.prefix_state_shape)
    h = torch.randn(stage.cfg.prefix_state_shape, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        eager = run_blocks(stage, stage.layers, h)[-1:, :]
        c = build_openvino(stage, k, shape, model_id=model_id(path), cache_dir=tmp_path / "cache")
        assert c.last_block_rows == 1 and not c.cache_hit
        rel = float((c.run(h)[-1:, :] - eager).norm() / eager.norm())
        assert rel < 1e-5, rel
        again = build_openvino(stage, k, shape, model_id=model_id(path), cache_dir=tmp_path / "cache")
        assert again.cache_hit and again.last_block_rows == 1, "a restart reads what the build found"
        # A damaged artifact under its matching key.json (weights file and the plugin's blob gone): built again
        (again.folder / "model.bin").unlink()
        shutil.rmtree(again.folder / "ov_cache")
        rebuilt = build_openvino(stage, k, shape, model_id=model_id(path), cache_dir=tmp_path / "cache")
        assert not rebuilt.cache_hit and (rebuilt.folder / "model.bin").is_file()
        assert float((rebuilt.run(h)[-1:, :] - eager).norm() / eager.norm()) < 1e-5
        # The same weights in a block of another layout: the check refuses to leave rows out, eager agrees.
        blocks = traced.traced_blocks(stage.cfg, list(stage.layers), torch.float32)
        parallel = _ParallelBlock(blocks[-1])
        assert traced.prunable(blocks[-1], shape, 1, stage.rotary_emb)
        assert not traced.prunable(parallel, shape, 1, stage.rotary_emb)
        # bf16 (what a build traces on a CPU with bf16 instructions): the check runs on an fp32 copy, so the
        # rounding does not hide the parallel layout's difference
        blocks16 = traced.traced_blocks(stage.cfg, list(stage.layers), torch.bfloat16)
        assert traced.prunable(blocks16[-1], shape, 1, stage.rotary_emb)
        assert not traced.prunable(_ParallelBlock(blocks16[-1]), shape, 1, stage.rotary_emb)
        assert not traced.prunable(blocks[-1], shape, shape[1], stage.rotary_emb), "no row to leave out"


# ------------------------------------------------------------------------------------------ the cache folder

def test_a_cache_folder_that_cannot_be_written_builds_in_a_temporary_one_removed_at_close(tiny_checkpoint,
                                                                                          tmp_path):
    """A cache folder that is a file (or read-only, or missing its parent's permission) cannot take an artifact:
    the compiled suffix is built in a temporary folder instead, with a warning naming both, serves the frames
    with eager's waypoints, and the folder is removed at close."""
    _require_openvino()
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file where the cache folder should be")
    lines = []
    stage = load_stage(tiny_checkpoint, "suffix", 2)
    b = SuffixBackend("openvino", stage, model_id=model_id(tiny_checkpoint), cache_dir=not_a_folder,
                      background=False, log=lambda level, msg: lines.append((level, msg)))
    b.prepare(stage, 2)
    st = b.status()
    assert b.in_use == "openvino" and b.compiled_k == 2 and st.error == "", st
    temp = Path(st.cache_dir)
    assert temp != not_a_folder and any(temp.iterdir())
    assert lines[0][0] == "warning" and str(not_a_folder) in lines[0][1] and str(temp) in lines[0][1]
    h = torch.randn(stage.cfg.prefix_state_shape)
    with torch.inference_mode():
        assert (b(stage, h, 3, 2) - stage(h, 3, 2)).abs().max() <= FP32_WAYPOINT_BOUND_M
    assert b.frames_compiled == 1
    b.close()
    assert not temp.exists() and not_a_folder.read_text().startswith("a file")


def test_at_k_equal_l_the_status_says_why_nothing_is_compiled(tiny_checkpoint, tmp_path):
    _require_openvino()
    stage = load_stage(tiny_checkpoint, "suffix", 4)
    b = SuffixBackend("openvino", stage, model_id=model_id(tiny_checkpoint), cache_dir=tmp_path, background=False)
    with torch.inference_mode():
        b(stage, torch.randn(stage.cfg.prefix_state_shape), 3, 4)
    st = b.status()
    assert st.in_use == "eager" and st.frames_eager == 1 and "K = L = 4: no decoder blocks" in st.error, st
    assert not any(tmp_path.iterdir())
    b.close()


def test_compile_suffix_builds_the_artifacts_a_node_then_finds_in_its_cache(tiny_checkpoint, tmp_path):
    """``hybrid-vla compile-suffix`` builds a K range into the cache; a node's backend (a stage loaded at its own K,
    holding the blocks of every K above) then finds each of them there instead of converting."""
    _require_openvino()
    from hybrid_vla_ros.runtime.settings import SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner
    from hybrid_vla_ros.tools.cli import main

    assert main(["compile-suffix", "--model", str(tiny_checkpoint), "--split-layers", "1-2",
                 "--cache-dir", str(tmp_path)]) == 0
    stage = load_stage(tiny_checkpoint, "suffix", 1)
    b = SuffixBackend("openvino", stage, model_id=model_id(tiny_checkpoint), cache_dir=tmp_path, background=False)
    for k in (1, 2):
        b.prepare(stage, k)
        assert b.compiled_k == k and b.builds[-1].cache_hit, b.status()
    b.close()
    # a bf16 node finds what compile-suffix --dtype bf16 built, on any CPU (fp32 where it has no bf16 units)
    assert main(["compile-suffix", "--model", str(tiny_checkpoint), "--split-layers", "2", "--dtype", "bf16",
                 "--cache-dir", str(tmp_path / "bf16")]) == 0
    runner = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, dtype="bf16", backend="openvino",
                                                                     backend_cache_dir=str(tmp_path / "bf16"),
                                                                     background_build=False, namespace="/csb"))
    try:
        assert runner.backend.builds[-1].cache_hit, (runner.precision, runner.backend.status())
    finally:
        runner.close()
    assert main(["compile-suffix", "--model", str(tiny_checkpoint), "--split-layers", "3-4",
                 "--cache-dir", str(tmp_path)]) == 1  # K = L = 4: no blocks to compile, refused before building
    assert not list((tmp_path).glob("*/openvino-k3-*"))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main(["compile-suffix", "--model", str(tiny_checkpoint), "--split-layers", "3",
                 "--cache-dir", str(not_a_folder)]) == 1  # what it builds must be kept: no temporary folder
