"""Transformers checkpoints split at K: the primary exactness test against transformers' own forward.

Every checkpoint here is written by transformers' ``save_pretrained`` (sharded, test/hf_builders.py) and the
reference is transformers' ``from_pretrained`` + ``forward(output_hidden_states=True)`` on the same inputs,
computed in this file: no code of the split path (no embed / run_blocks / plan, no loader of this package) is
on the reference side. For every K in [0, L]: the prefix's h_K equals transformers' ``hidden_states[K]`` and the
suffix's final-norm state equals ``hidden_states[L]``, fp32 max abs diff <= 1e-5.
"""
import json

import pytest
import torch

from hf_builders import LLM, TEXT_FAMILIES, shard_files, write_llama, write_llava, write_qwen2, write_text_lm
from hybrid_vla_ros.model.checkpoint import check_device_dtype, load_stage, model_id, open_checkpoint
from hybrid_vla_ros.model.config import VLAConfig
from hybrid_vla_ros.model.sources import CheckpointError, MissingFileError
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.image import decode_compressed, preprocess

TOL = 1e-5
IDS = [5, 17, 250, 3, 99, 42, 7, 128, 64, 1, 300, 11]
#: (builder, kwargs, image tokens per image as transformers' LLaVA produces them: CLIP 16 patches + class token,
#: 'default' drops one; SigLIP 4 patches, 'full' keeps all)
KINDS = {
    "llama": (write_llama, {}, None),
    "qwen2": (write_qwen2, {}, None),
    "llava_clip_llama": (write_llava, dict(vision="clip", text="llama"), 16),
    "llava_siglip_qwen2_v5_layout": (write_llava, dict(vision="siglip", text="qwen2", original_format=False), 4),
    # every other text family, each with what sets it apart (hf_builders.TEXT_FAMILIES): sliding windows shorter
    # than the 12 tokens, Gemma's alternating layer kinds, soft-capping and scaled embeddings, Qwen3's q/k norms
    **{family: (write_text_lm, dict(model_type=family), None) for family in TEXT_FAMILIES},
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: builder(root / name, **kw) for name, (builder, kw, _) in KINDS.items()}


@pytest.fixture(scope="module")
def camera_images(embedded_bag):
    """Two real camera frames (cameras 0 and 1) of the embedded bag, decoded RGB."""
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(embedded_bag):
        if m.topic.endswith("/image_raw/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    return [decode_compressed(first[t].format, first[t].data) for t in sorted(first)[:2]]


def _reference(name, path, pixels=None, ids=None):
    """transformers' own hidden_states (L + 1 entries; the last after the final norm), batch dim dropped."""
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    if name.startswith("llava"):
        model = LlavaForConditionalGeneration.from_pretrained(str(path)).eval()
        out = model(input_ids=ids.unsqueeze(0), pixel_values=pixels, output_hidden_states=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        assert type(model).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
        out = model(input_ids=ids.unsqueeze(0), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_split_equals_transformers_forward_at_every_k(hf_dirs, camera_images, name):
    path = hf_dirs[name]
    assert len(shard_files(path)) > 3 and (path / "model.safetensors.index.json").is_file(), "sharded"
    tokens_per_image = KINDS[name][2]
    with torch.inference_mode():
        if tokens_per_image is None:
            ck = open_checkpoint(path)
            ids = torch.tensor(IDS)
            inputs, ref_ids = (ids,), ids
        else:
            image_token = LLM["vocab_size"] - 1
            prompt = [1, image_token, 12, 13, image_token, 14]  # two cameras, text around them
            ck = open_checkpoint(path, cameras=2, prompt_ids=prompt, planning_token_id=20)
            cfg = ck.model
            with open(path / "config.json") as f:
                size = json.load(f)["vision_config"]["image_size"]
            pixels = preprocess(camera_images, size, cfg.image_mean, cfg.image_std)
            expanded = [t for p in prompt for t in ([p] * tokens_per_image if p == image_token else [p])] + [20]
            inputs, ref_ids = (pixels,), torch.tensor(expanded)
        L = ck.num_layers
        ref = _reference(name, path, inputs[0] if tokens_per_image else None, ref_ids)
        assert len(ref) == L + 1 == 4
        for k in range(L + 1):
            h = ck.load("prefix", k)(*inputs)
            assert h.shape == (len(ref_ids), LLM["hidden_size"])
            if k < L:
                assert (h - ref[k]).abs().max().item() <= TOL, f"h_{k} differs"
            final = ck.load("suffix", k).final_hidden_states(h)
            assert (final - ref[L]).abs().max().item() <= TOL, f"split at {k}: final hidden states differ"
            assert (final[-1] - ref[L][-1]).abs().max().item() <= TOL
        assert ref[1].abs().max() > 1 and (ref[L] - ref[0]).abs().max() > 0.5, "O(1) states; the blocks act"


def test_a_wrong_position_or_mask_convention_is_caught(hf_dirs):
    """Negative control: block 0 of the loaded prefix run with other position spacing (every other position,
    as a layout that gives two tokens one position would), or with attention that lets tokens see the future
    (eager, no mask), differs from transformers' hidden_states[1] by far more than the tolerance: the comparison
    above does test those conventions. (A uniform offset of every position is invisible by construction: rotary
    attention depends on relative positions only.)"""
    from transformers import LlamaForCausalLM

    path = hf_dirs["llama"]
    ids = torch.tensor(IDS)
    with torch.inference_mode():
        ref = LlamaForCausalLM.from_pretrained(str(path))(ids[None], output_hidden_states=True).hidden_states
        prefix = open_checkpoint(path).load("prefix", 1)
        h0 = prefix.embed_tokens(ids)[None]
        block = prefix.layers[0]

        def run(offset, stride=1):
            positions = torch.arange(len(ids))[None] * stride + offset
            return block(h0, attention_mask=None, position_ids=positions,
                         position_embeddings=prefix.rotary_emb(h0, positions))[0]

        assert (run(0) - ref[1][0]).abs().max().item() <= TOL
        assert (run(7) - ref[1][0]).abs().max().item() <= 1e-4, "rotary: a uniform offset changes nothing"
        assert (run(0, stride=2) - ref[1][0]).abs().max().item() > 1e-2, "other position spacing"
        block.self_attn.config._attn_implementation = "eager"
        try:
            assert (run(0) - ref[1][0]).abs().max().item() > 1e-3, "not causal"
        finally:
            block.self_attn.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_a_sliding_window_shorter_than_the_frame_is_applied(hf_dirs, name):
    """Negative control for the sliding-window masks: the same blocks run with every block's attention full
    causal (the sliding window removed from the config) differ from transformers' forward far beyond the
    tolerance, so the exactness above does test the band mask (window 5 < T = 12)."""
    from transformers import AutoModelForCausalLM

    path = hf_dirs[name]
    ids = torch.tensor(IDS)
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(str(path))(ids[None], output_hidden_states=True).hidden_states
        prefix = open_checkpoint(path).load("prefix", 2)
        assert (prefix(ids) - ref[2][0]).abs().max().item() <= TOL
        config = prefix.rotary_emb.config
        config.sliding_window = 10**6  # a window longer than T: plain causal attention
        assert (prefix(ids) - ref[2][0]).abs().max().item() > 1e-2, "the window changes the result"


def test_a_stage_reads_only_its_own_tensors_from_only_its_shards(hf_dirs, monkeypatch):
    """Every tensor byte range read is recorded (and safetensors' mapping reader is disabled, so nothing else
    reads data): the suffix at K=2 reads block 2 and the final norm, from the shards the index names for them."""
    import safetensors

    from hybrid_vla_ros.model import sources

    path = hf_dirs["llama"]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    read = []
    real = sources._read_range

    def spy(f, size, info):
        read.append((info.file.name, info.stored_name))
        return real(f, size, info)

    def no_mapping(*a, **k):
        raise AssertionError("safe_open used to read data")

    monkeypatch.setattr(sources, "_read_range", spy)
    monkeypatch.setattr(safetensors, "safe_open", no_mapping)
    suffix = open_checkpoint(path).load("suffix", 2)
    wanted = sorted(k for k in index if k.startswith("model.layers.2.") or k == "model.norm.weight")
    assert sorted(name for _, name in read) == wanted
    assert all(index[name] == shard for shard, name in read), "each from the shard its index names"
    assert len(suffix.layers) == 1
    read.clear()
    blocks = open_checkpoint(path).load_blocks(0, 1)
    assert sorted(name for _, name in read) == sorted(k for k in index if k.startswith("model.layers.0."))
    assert blocks.first_block == 0 and len(blocks) == 1


def test_both_llava_layouts_are_read(hf_dirs):
    def weight_map(name):
        return json.loads((hf_dirs[name] / "model.safetensors.index.json").read_text())["weight_map"]

    legacy, v5 = weight_map("llava_clip_llama"), weight_map("llava_siglip_qwen2_v5_layout")
    assert any(k.startswith("language_model.model.layers.") for k in legacy)
    assert any(k.startswith("model.language_model.layers.") for k in v5)
    for path in (hf_dirs["llava_clip_llama"], hf_dirs["llava_siglip_qwen2_v5_layout"]):
        names = open_checkpoint(path).source().names()
        assert {"embed_tokens.weight", "norm.weight", "layers.2.mlp.down_proj.weight"} <= names
        assert any(n.startswith("vision_tower.encoder.layers.") for n in names)
        assert any(n.startswith("multi_modal_projector.linear_1.") for n in names)
        assert not any("lm_head" in n for n in names)


def test_dtype_conversion_on_load_and_model_id(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    path = hf_dirs["qwen2"]
    stage = open_checkpoint(path).load("suffix", 1, dtype="bf16")
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    # the id covers config.json and every shard's header (as the slot header check needs), not weight values
    copy = _copy(path, tmp_path / "q")
    assert model_id(copy) == model_id(path) != model_id(hf_dirs["llama"])
    shard = shard_files(copy)[-1]
    save_file(load_file(str(shard)), str(shard), metadata={"format": "pt", "note": "re-saved"})
    assert model_id(copy) != model_id(path)


def test_transformers_directories_cannot_drive_the_nodes(hf_dirs):
    for name, needle in (("llama", "--llm"), ("llava_clip_llama", "--vlm")):
        path = hf_dirs[name]
        for call in (lambda: VLAConfig.load(path), lambda: load_stage(path, "suffix", 1)):
            with pytest.raises(ValueError) as e:
                call()
            msg = str(e.value)
            assert "planning head" in msg and "hybrid-vla init-model" in msg and needle in msg
            assert str(path / "config.json") in msg


# ----------------------------------------------------------------------------------------- bad input

def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_missing_shard_names_the_shard_and_a_tensor(hf_dirs, tmp_path):
    path = _copy(hf_dirs["llama"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    victim = index["model.layers.1.mlp.up_proj.weight"]
    (path / victim).unlink()
    with pytest.raises(MissingFileError) as e:
        open_checkpoint(path).load("suffix", 1)
    assert victim in str(e.value) and "shard not found" in str(e.value) and "model.layers.1." in str(e.value)
    with pytest.raises(FileNotFoundError):
        model_id(path)


def test_a_truncated_shard_names_the_tensor_whose_bytes_are_missing(hf_dirs, tmp_path):
    path = _copy(hf_dirs["llama"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index["model.layers.2.mlp.up_proj.weight"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])  # the header intact, the last tensor cut short
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\..*(truncated|corrupt)") as e:
        open_checkpoint(path).load("suffix", 2)
    assert shard.name in str(e.value)


def test_an_index_naming_an_absent_tensor_is_refused(hf_dirs, tmp_path):
    path = _copy(hf_dirs["llama"], tmp_path / "m")
    doc = json.loads((path / "model.safetensors.index.json").read_text())
    shard = doc["weight_map"]["model.norm.weight"]
    doc["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).load("prefix", 1)
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_norm.weight" in msg and shard in msg and "model.safetensors.index.json" in msg


def test_an_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(str(tmp_path / "g"))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path / "g")
    assert "GPT2LMHeadModel" in str(e.value) and str(tmp_path / "g" / "config.json") in str(e.value)
    assert "LlamaForCausalLM" in str(e.value), "says what is supported"


def test_a_quantized_or_misshapen_tensor_is_refused_naming_file_and_tensor(hf_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(hf_dirs["llama"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index["model.layers.2.mlp.gate_proj.weight"]
    tensors = load_file(str(shard))
    tensors["model.layers.2.mlp.gate_proj.weight"] = torch.zeros(160, 64, dtype=torch.int8)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path).load("suffix", 2)
    assert "stored as I8" in str(e.value) and shard.name in str(e.value) and "gate_proj" in str(e.value)
    tensors["model.layers.2.mlp.gate_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"has shape \[7, 64\].*needs \[160, 64\]"):
        open_checkpoint(path).load("suffix", 2)
    open_checkpoint(path).load("prefix", 2)  # the prefix does not own block 2: it loads
    doc = json.loads((path / "config.json").read_text())
    doc["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="quantized checkpoint .gptq.*dequantize"):
        open_checkpoint(path)


def test_a_dtype_the_device_cannot_run_is_refused(hf_dirs, monkeypatch):
    from hybrid_vla_ros.model import checkpoint

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ValueError, match="cannot run bf16"):
        check_device_dtype("cuda", torch.bfloat16)
    monkeypatch.setattr(checkpoint, "_cpu_runs", lambda dtype: "no fp16 kernels" if dtype == torch.float16 else "")
    with pytest.raises(ValueError, match="CPU cannot run fp16"):
        open_checkpoint(hf_dirs["llama"]).load("prefix", 1, dtype="fp16")
    check_device_dtype("cpu", torch.float32)


def test_pickle_checkpoints_are_refused_with_how_to_convert(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    d = write_llama(tmp_path / "m")
    for f in list(d.glob("*.safetensors")) + [d / "model.safetensors.index.json"]:
        f.unlink()
    torch.save({"payload": Payload()}, d / "pytorch_model.bin")
    torch.save({"payload": Payload()}, tmp_path / "weights.pth")
    for target in (d, d / "pytorch_model.bin", tmp_path / "weights.pth"):
        with pytest.raises(FileNotFoundError) as e:
            load_stage(target, "prefix", 1) if target != d else open_checkpoint(target).load("prefix", 1)
        msg = str(e.value)
        assert "pickle" in msg and "save_pretrained" in msg and "safetensors" in msg, msg
    assert not marker.exists(), "nothing was unpickled"


def test_split_layer_outside_range_is_refused(hf_dirs):
    ck = open_checkpoint(hf_dirs["qwen2"])
    for bad in (-1, ck.num_layers + 1):
        with pytest.raises(ValueError, match="out of range"):
            ck.load("prefix", bad)
        with pytest.raises(ValueError, match="out of range"):
            ck.load("suffix", bad)
    with pytest.raises(ValueError, match="outside"):
        ck.load_blocks(2, ck.num_layers + 1)
    with pytest.raises(ValueError, match="split layer 0"):
        ck.load("suffix", 2).final_hidden_states(torch.zeros(4, LLM["hidden_size"]), 0)


# ------------------------------------------------------------------------------------ CLI, plan, re-split

@pytest.mark.parametrize("name", sorted(KINDS))
def test_cli_verify_split_and_plan_on_transformers_directories(hf_dirs, name, tmp_path, capsys, monkeypatch):
    """`hybrid-vla verify-split --model DIR` exits 0 with one row per K; `hybrid-vla plan --model DIR --json OUT`
    gives L + 1 rows without reading any tensor data (safetensors' reader is disabled meanwhile), and its
    weight bytes equal the stages loaded afterwards at every K."""
    import safetensors

    from hybrid_vla_ros.tools.cli import main

    path = hf_dirs[name]
    llava = KINDS[name][2] is not None
    assert main(["verify-split", "--model", str(path), "--quiet"] + (["--cameras", "2"] if llava else [])) == 0
    out = capsys.readouterr().out
    assert "OK: 4 of 4 split layers within the allowed difference" in out and "from_pretrained" in out
    assert ("camera frame of 2 camera(s) from the embedded bag" if llava else "16 token ids") in out

    def no_reading(*a, **k):
        raise AssertionError("plan read tensor data")

    monkeypatch.setattr(safetensors, "safe_open", no_reading)
    assert main(["plan", "--model", str(path), "--dtype", "fp32", "--tokens", "12", "--json",
                 str(tmp_path / "plan.json")]) == 0
    monkeypatch.undo()
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert [r["k"] for r in rows] == [0, 1, 2, 3]
    ck = open_checkpoint(path)
    for r in rows:
        for role, want in (("prefix", r["gpu_weight_bytes"]), ("suffix", r["cpu_weight_bytes"])):
            stage = ck.load(role, r["k"])
            assert sum(t.numel() * t.element_size() for t in stage.state_dict().values()) == want, (role, r["k"])


def test_cli_verify_split_exits_1_when_a_split_layer_differs(hf_dirs, capsys, monkeypatch):
    from hybrid_vla_ros.model import modeling
    from hybrid_vla_ros.tools.cli import main

    real = modeling.run_blocks

    def off_by_a_little(m, layers, h, **kw):
        out = real(m, layers, h, **kw)
        return out + 1e-3 if len(layers) == 2 else out  # wrong only where two blocks run together

    monkeypatch.setattr(modeling, "run_blocks", off_by_a_little)
    assert main(["verify-split", "--model", str(hf_dirs["llama"]), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS" in out and "FAILED: 2 of 4 split layers" in out


def test_live_resplit_of_a_transformers_llava_stays_exact(hf_dirs, camera_images):
    """Blocks moved between the stages with load_blocks (as the runners' background loader does)."""
    from hybrid_vla_ros.split.resplit import move_split

    ck = open_checkpoint(hf_dirs["llava_clip_llama"])
    cfg = ck.model
    pixels = preprocess(camera_images[:1], cfg.image_size, cfg.image_mean, cfg.image_std)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        expected = ck.load("suffix", 0).final_hidden_states(ck.load("prefix", 0)(pixels))
        prefix, suffix = ck.load("prefix", 1), ck.load("suffix", 1)
        for k, blocks in ((3, ck.load_blocks(1, 3)), (0, None)):
            move_split(prefix, k, cpu, blocks)
            if k < suffix.split_layer:
                move_split(suffix, k, cpu, ck.load_blocks(k, suffix.split_layer))
            final = suffix.final_hidden_states(prefix(pixels), k)
            assert (final - expected).abs().max().item() <= TOL, f"K={k}"
        assert len(prefix.layers) == 0 and len(suffix.layers) == 3


def test_a_loaded_stage_owns_its_weights_when_a_shard_is_rewritten_in_place(hf_dirs, tmp_path):
    """The loader copies each tensor out of the file mapping: a shard truncated / re-saved under a running
    stage changes nothing (with views of the mapping the process died of SIGBUS)."""
    path = _copy(hf_dirs["llama"], tmp_path / "m")
    suffix = open_checkpoint(path).load("suffix", 0)
    h = torch.randn(5, LLM["hidden_size"])
    with torch.inference_mode():
        before = suffix.final_hidden_states(h)
        for shard in shard_files(path):
            shard.write_bytes(b"")
        assert torch.equal(suffix.final_hidden_states(h), before)


def test_an_unsharded_directory_is_read_too(tmp_path, camera_images):
    """One model.safetensors, no index (save_pretrained below its shard size): same split, same exactness."""
    from transformers import Qwen2ForCausalLM

    path = write_qwen2(tmp_path / "q", shard="50MB")
    assert (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").exists()
    ck = open_checkpoint(path)
    assert "unsharded" in ck.description
    ids = torch.tensor(IDS)
    with torch.inference_mode():
        out = Qwen2ForCausalLM.from_pretrained(str(path))(ids[None], output_hidden_states=True)
        ref = [h[0] for h in out.hidden_states]
        for k in range(ck.num_layers + 1):
            h = ck.load("prefix", k)(ids)
            assert (ck.load("suffix", k).final_hidden_states(h) - ref[-1]).abs().max().item() <= TOL


@pytest.mark.parametrize("damage", ["missing", "truncated"])
@pytest.mark.parametrize("command", ["init-model", "verify-split", "plan"])
def test_the_cli_refuses_unreadable_weights_in_one_line_with_exit_2(hf_dirs, tmp_path, capsys, damage, command):
    """A shard deleted, or cut short with its header intact: `init-model --llm`, `verify-split` and `plan` each
    print one line naming the shard file and a tensor in it and exit 2, before transformers reads anything, and
    init-model writes nothing."""
    from hybrid_vla_ros.tools.cli import main

    path = _copy(hf_dirs["qwen3"], tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = path / index["model.layers.1.mlp.gate_proj.weight"]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-100])
    argv = {"init-model": ["init-model", "--preset", "tiny", "--llm", str(path), str(tmp_path / "out")],
            "verify-split": ["verify-split", "--model", str(path), "--quiet"],
            "plan": ["plan", "--model", str(path)]}[command]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"hybrid-vla {command}: "), err
    assert shard.name in err and "model.layers.1." in err, err
    assert ("shard not found" if damage == "missing" else "truncated") in err, err
    assert not (tmp_path / "out").exists()
