"""`hybrid-vla convert`: published Orion / MindDrive `.pth` checkpoints (PEFT-wrapped LLM, LoRA adapters).

The `.pth` files are written here from small random transformers models wrapped by peft itself
(`get_peft_model`, `add_adapter`) with the published key layouts (`lm_head.` + peft's state dict names, plus
stand-ins for the vision backbone and query heads). References: peft's own `merge_and_unload()` and the
unmerged peft model's forward (transformers' modules with peft's LoRA layers), never the converter's code.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_builders import LLM, perturb_
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.published import convert
from hybrid_vla_ros.model.sources import CheckpointError

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
DECISION_IDS = [11, 23, 35, 47, 59, 71, 83]  # 7 stand-in meta-action tokens


def _cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _randomise_lora_(model, seed):
    """peft initialises lora_B to zero (the adapted model would equal the base): draw every A and B."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name:  # as kaiming-uniform would scale it: ~ 1 / sqrt(in)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _published_state(peft_model, old_peft=False):
    """The published layout: `lm_head.` + peft's names; old PEFT versions had no `base_layer` level."""
    state = {}
    for k, v in peft_model.state_dict().items():
        if old_peft:
            k = k.replace(".base_layer.", ".")
        state["lm_head." + k] = v.detach().clone()
    g = torch.Generator().manual_seed(7)
    state["img_backbone.blocks.0.attn.qkv.weight"] = torch.randn(96, 32, generator=g)
    state["img_backbone.patch_embed.proj.weight"] = torch.randn(32, 3, 16, 16, generator=g)
    state["pts_bbox_head.query_embedding.weight"] = torch.randn(10, 64, generator=g)
    state["map_head.query_embedding.weight"] = torch.randn(10, 64, generator=g)
    state["ego_fut_decoder.0.weight"] = torch.randn(64, 64, generator=g)
    return state


@pytest.fixture(scope="module")
def orion_like(tmp_path_factory):
    """A LLaMA (config vocab 320) whose embeddings grew by one row (<waypoint_ego>, as Orion's 32000 -> 32001),
    wrapped by peft with one adapter (r=4, alpha=8: not the defaults, so the options / adapter_config matter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("orion")
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**LLM, "rope_theta": 5e5, "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    hf_dir = root / "hf"
    cfg.save_pretrained(str(hf_dir))  # config.json only: vocab 320, as the published HF folder says
    base = perturb_(LlamaForCausalLM(cfg), 0)
    base.resize_token_embeddings(LLM["vocab_size"] + 1)
    perturb_(base, 1)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    _randomise_lora_(peft_model, 3)
    peft_model.eval()
    pth = root / "Orion.pth"
    torch.save({"state_dict": _published_state(peft_model), "meta": {"epoch": 6, "config": "orion.py"}}, pth)
    old = root / "Orion_oldpeft.pth"
    torch.save({"state_dict": _published_state(peft_model, old_peft=True), "meta": {}}, old)
    return root, hf_dir, pth, old, peft_model


@pytest.fixture(scope="module")
def orion_out(orion_like):
    root, hf_dir, pth, _, _ = orion_like
    out = root / "converted"
    made = _cli("convert", str(pth), "--llm-config", str(hf_dir), str(out), "--preset", "tiny",
                "--lora-r", "4", "--lora-alpha", "8")
    assert made.returncode == 0, made.stderr
    assert "orion layout" in made.stdout and "NOT placed: 5 tensors" in made.stdout
    return out


def _ids(vocab, n=12):
    return torch.tensor([[(5 + 37 * i) % vocab for i in range(n)] + [vocab - 1]])


def test_orion_llm_equals_peft_merge_and_unmerged_forward(orion_like, orion_out):
    from peft import LoraConfig, get_peft_model  # noqa: F401  (peft is the reference)
    from transformers import LlamaForCausalLM

    _, _, _, _, peft_model = orion_like
    ids = _ids(LLM["vocab_size"] + 1)
    converted = LlamaForCausalLM.from_pretrained(str(orion_out / "llm")).eval()
    assert converted.config.vocab_size == LLM["vocab_size"] + 1
    with torch.no_grad():
        got = converted.model(input_ids=ids, output_hidden_states=True).hidden_states
        unmerged = peft_model.base_model.model.model(input_ids=ids, output_hidden_states=True).hidden_states
        import copy

        merged_model = copy.deepcopy(peft_model).merge_and_unload()
        merged = merged_model.model(input_ids=ids, output_hidden_states=True).hidden_states
        base_only = None
        with peft_model.disable_adapter():
            base_only = peft_model.base_model.model.model(input_ids=ids).last_hidden_state
    assert len(got) == LLM["num_hidden_layers"] + 1
    for a, b, c in zip(got, unmerged, merged):
        assert (a - c).abs().max() < TOL  # peft's merge_and_unload
        # the unmerged peft forward computes W x + s B A x: the same up to fp32 rounding (relative 1e-6)
        assert (a - b).abs().max() < TOL * b.abs().max()
    # the adapters matter: without them the model differs (so the test can fail)
    assert (got[-1] - base_only).abs().max() > 1e-2


def _check_plan(out, tmp_path):
    """`hybrid-vla plan --model OUT` lists L + 1 rows, K = 0..L, the per-K weights growing with K."""
    doc = tmp_path / "plan.json"
    planned = _cli("plan", "--model", str(out), "--dtype", "fp32", "--json", str(doc))
    assert planned.returncode == 0, planned.stderr
    rows = json.loads(doc.read_text())["rows"]
    assert [r["k"] for r in rows] == list(range(LLM["num_hidden_layers"] + 1))
    # the plan's weights, prefix + suffix at every K, are the converted checkpoint's stored tensors (fp32 bytes,
    # counted from the safetensors headers: the LLM in OUT/llm, the deltas and own tensors in OUT) but the LM head,
    # which only a decode reads and a planning head does not
    src = open_checkpoint(out).source()
    stored = sum(4 * torch.Size(src.info(n).shape).numel() for n in src.names() if n != "lm_head.weight")
    assert all(r["gpu_weight_bytes"] + r["cpu_weight_bytes"] == stored for r in rows)
    assert rows[0]["gpu_weight_bytes"] < rows[-1]["gpu_weight_bytes"]


def test_orion_converted_config_report_and_verify_split(orion_like, orion_out, tmp_path):
    cfg = json.loads((orion_out / "config.json").read_text())
    assert cfg["llm_path"] == "llm" and cfg["llm"]["vocab_size"] == LLM["vocab_size"] + 1
    assert cfg["planning_token_id"] == LLM["vocab_size"]  # <waypoint_ego>: the added row
    report = json.loads((orion_out / "convert_report.json").read_text())
    assert report["adapters"]["default"]["r"] == 4 and report["adapters"]["default"]["scaling"] == 2.0
    assert set(report["not_placed"]) == {"img_backbone", "pts_bbox_head", "map_head", "ego_fut_decoder"}
    assert report["not_placed"]["img_backbone"]["count"] == 2
    assert "img_backbone.blocks.0.attn.qkv.weight" in report["not_placed"]["img_backbone"]["names"]
    ck = open_checkpoint(orion_out)
    assert ck.kind == "composed" and ck.num_layers == LLM["num_hidden_layers"]
    verified = _cli("verify-split", "--model", str(orion_out), "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    rows = [line for line in verified.stdout.splitlines() if line.strip().endswith("| ok")]
    assert len(rows) == LLM["num_hidden_layers"] + 1
    _check_plan(orion_out, tmp_path)


def test_old_peft_layout_without_base_layer_converts_the_same(orion_like, orion_out, tmp_path):
    _, hf_dir, _, old, _ = orion_like
    (hf_dir / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    try:
        convert(old, hf_dir, tmp_path / "old", preset_name="tiny")  # r / alpha from adapter_config.json
    finally:
        (hf_dir / "adapter_config.json").unlink()
    from safetensors.torch import load_file

    a = load_file(str(orion_out / "llm" / "model.safetensors"))
    b = load_file(str(tmp_path / "old" / "llm" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((tmp_path / "old" / "convert_report.json").read_text())
    assert report["adapters"]["default"]["hparams_from"].endswith("adapter_config.json")


def test_wrong_rank_option_is_an_error_not_a_silent_rescale(orion_like, tmp_path):
    _, hf_dir, pth, _, _ = orion_like
    with pytest.raises(CheckpointError, match="rank r = 16"):
        convert(pth, hf_dir, tmp_path / "x", preset_name="tiny")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pth_with_a_non_tensor_object_is_refused_and_not_run(orion_like, tmp_path):
    _, hf_dir, _, _, _ = orion_like
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pth"
    torch.save({"state_dict": {"lm_head.x": torch.zeros(1)}, "meta": _Payload(str(marker))}, bad)
    made = _cli("convert", str(bad), "--llm-config", str(hf_dir), str(tmp_path / "out"))
    assert made.returncode == 2  # a checkpoint it will not read
    assert "refused" in made.stderr and "other than tensors" in made.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ MindDrive

def _minddrive_peft(hf_dir: Path, vocab: int, seeds: tuple[int, int, int]):
    """A Qwen2 (tied embeddings, ``vocab`` rows; its config.json written to ``hf_dir``) wrapped by peft with
    MindDrive's two adapters on one base, both r=4 alpha=16 (scaling 4), every weight drawn from ``seeds``
    (torch's global seed, the base's, the adapters')."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seeds[0])
    cfg = Qwen2Config(**{**LLM, "vocab_size": vocab, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                         "tie_word_embeddings": True})
    cfg.save_pretrained(str(hf_dir))
    base = perturb_(Qwen2ForCausalLM(cfg), seeds[1])
    lcfg = dict(r=4, lora_alpha=16, target_modules=TARGETS)
    peft_model = get_peft_model(base, LoraConfig(**lcfg), adapter_name="decision_expert")
    peft_model.add_adapter("action_expert", LoraConfig(**lcfg))
    _randomise_lora_(peft_model, seeds[2])
    return peft_model.eval()


@pytest.fixture(scope="module")
def minddrive_like(tmp_path_factory):
    """A Qwen2 (tied embeddings) with MindDrive's two adapters on one base, both r=4 alpha=16 (scaling 4)."""
    root = tmp_path_factory.mktemp("minddrive")
    hf_dir = root / "hf"
    peft_model = _minddrive_peft(hf_dir, LLM["vocab_size"], seeds=(1, 4, 5))
    (hf_dir / "added_tokens.json").write_text(json.dumps({"<waypoint_ego>": 300, "<path_waypoint_ego>": 301}))
    pth = root / "minddrive_rltrain.pth"
    torch.save({"state_dict": _published_state(peft_model)}, pth)
    out = root / "converted"
    made = _cli("convert", str(pth), "--llm-config", str(hf_dir), str(out), "--preset", "tiny",
                "--lora-r", "4", "--lora-alpha", "16", "--decision-token-ids", ",".join(map(str, DECISION_IDS)),
                "--prompts", "preset")  # no tokenizer files here
    assert made.returncode == 0, made.stderr
    assert "minddrive layout" in made.stdout
    return root, out, peft_model


def _merged(peft_model, adapter):
    import copy

    m = copy.deepcopy(peft_model)
    m.set_adapter(adapter)
    return m.merge_and_unload(adapter_names=[adapter]).eval()


def test_minddrive_two_passes_match_peft_per_adapter(minddrive_like):
    root, out, peft_model = minddrive_like
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["llm_passes"] == 2 and cfg["pass_lora_rank"] == 4
    assert cfg["pass_adapters"] == ["decision_expert", "action_expert"] and cfg["planning_token_id"] == 300
    ck = open_checkpoint(out)
    prefix, suffix = ck.load("prefix", 1), ck.load("suffix", 1)
    assert not hasattr(prefix, "pass_embed")
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(ck.cfg.n_cameras, 3, ck.cfg.image_size, ck.cfg.image_size, generator=g)
    with torch.no_grad():
        h0 = ck.load("prefix", 0)(pixels)
        assert h0.shape == (2, ck.cfg.num_tokens, LLM["hidden_size"]) and torch.equal(h0[0], h0[1])
        h1 = prefix(pixels)
        final = suffix.final_hidden_states(h1)
        out_plan = suffix.plan_all(h1)
        for p, name in enumerate(["decision_expert", "action_expert"]):
            ref = _merged(peft_model, name)
            states = ref.model(inputs_embeds=h0[p:p + 1], output_hidden_states=True).hidden_states
            # W x + B A x (per-pass delta) vs (W + B A) x (peft's merge): equal up to fp32 rounding
            assert (h1[p] - states[1][0]).abs().max() < TOL * max(1.0, float(states[1].abs().max()))
            assert (final[p] - states[-1][0]).abs().max() < TOL * max(1.0, float(states[-1].abs().max()))
            if name == "decision_expert":
                logits = ref(inputs_embeds=h0[p:p + 1]).logits[0, -2, DECISION_IDS]
                assert (out_plan.decision_logits - logits).abs().max() < 1e-4
                assert out_plan.speed_mode == int(logits.argmax())
        # the passes really differ (the adapters differ), and differ from the base model
        assert (final[0] - final[1]).abs().max() > 1e-2
        # the prefix writes h_K straight into a ring slot (out=): bit for bit the same with per-pass deltas
        from hybrid_vla_ros.model.modeling import output_into_is_exact

        assert output_into_is_exact(prefix)
        slot = torch.empty_like(h1)
        prefix(pixels, out=slot)
        assert torch.equal(slot, h1)
        slot0 = torch.empty_like(h0)
        ck.load("prefix", 0)(pixels, out=slot0)
        assert torch.equal(slot0, h0)


def test_minddrive_verify_split_with_peft_reference_and_plan(minddrive_like, tmp_path):
    _, out, _ = minddrive_like
    verified = _cli("verify-split", "--model", str(out), "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "peft merging adapter decision_expert, action_expert" in verified.stdout
    rows = [line for line in verified.stdout.splitlines() if line.strip().endswith("| ok")]
    assert len(rows) == LLM["num_hidden_layers"] + 1
    _check_plan(out, tmp_path)
    report = json.loads((out / "convert_report.json").read_text())
    assert report["decision"]["rows_from"].startswith("model.embed_tokens")  # tied Qwen2: the embedding rows


def test_minddrive_needs_its_tokenizer_or_the_preset_prompt_with_decision_token_ids(minddrive_like, tmp_path):
    """Without tokenizer files beside the LLM config the published prompts cannot be made: an error that says so
    (not a silent fixed prompt); with --prompts preset the decision ids must be given. Both are refused before
    anything is written."""
    root, _, _ = minddrive_like
    for name, options, match in (("x", {}, "no tokenizer files"),
                                 ("y", {"prompts": "preset"}, "--prompts preset needs --decision-token-ids")):
        (tmp_path / name).mkdir()  # an empty OUT the user made: kept on failure, so what was written shows
        with pytest.raises(ValueError, match=match):
            convert(root / "minddrive_rltrain.pth", root / "hf", tmp_path / name, preset_name="tiny", lora_r=4,
                    **options)
        assert not any((tmp_path / name).iterdir())  # refused before OUT/llm was written


def test_layout_mismatch_and_unknown_adapters_are_clear_errors(orion_like, minddrive_like, tmp_path):
    _, hf_dir, pth, _, _ = orion_like
    with pytest.raises(CheckpointError, match="needs adapter"):
        convert(pth, hf_dir, tmp_path / "a", layout="minddrive", preset_name="tiny", lora_r=4,
                decision_token_ids=DECISION_IDS, prompts="preset")
    root, _, _ = minddrive_like
    with pytest.raises(CheckpointError, match="needs adapter"):
        convert(root / "minddrive_rltrain.pth", root / "hf", tmp_path / "b", layout="orion", preset_name="tiny",
                lora_r=4)
    # a state dict whose adapter names fit neither layout: auto refuses and says to pass --layout
    tensors = torch.load(pth, weights_only=True)["state_dict"]
    renamed = {k.replace(".default.", ".other."): v for k, v in tensors.items()}
    odd = tmp_path / "odd.pth"
    torch.save(renamed, odd)  # a bare state dict (no "state_dict" level) is read too
    with pytest.raises(CheckpointError, match="pass --layout"):
        convert(odd, hf_dir, tmp_path / "c", preset_name="tiny", lora_r=4)
    assert not any((tmp_path / n).exists() for n in "abc")


def test_an_extra_adapter_is_reported_not_merged(orion_like, tmp_path):
    _, hf_dir, pth, _, peft_model = orion_like
    tensors = torch.load(pth, weights_only=True)["state_dict"]
    extra = {k.replace(".default.", ".unused."): v * 0 + 1 for k, v in tensors.items() if ".lora_" in k}
    both = tmp_path / "both.pth"
    torch.save({"state_dict": {**tensors, **extra}}, both)
    report = convert(both, hf_dir, tmp_path / "out", preset_name="tiny", layout="orion", lora_r=4, lora_alpha=8)
    names = report["not_placed"]["lm_head"]["names"]
    assert len(names) == len(extra) and all(".unused." in n for n in names)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "out" / "llm" / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    merged = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    want = merged.base_layer.weight + merged.scaling["default"] * merged.lora_B["default"].weight @ \
        merged.lora_A["default"].weight  # peft's own modules and scaling
    assert (a[q] - want.detach()).abs().max() < 1e-6


def test_minddrive_hparams_from_peft_saved_adapter_configs(minddrive_like, tmp_path):
    """r / lora_alpha read from adapter_config.json as peft's own save_pretrained lays them out (one folder per
    named adapter), with no options: the same conversion as with --lora-r 4 --lora-alpha 16."""
    import shutil

    from safetensors.torch import load_file

    root, out, peft_model = minddrive_like
    hf_dir = tmp_path / "hf"
    peft_model.save_pretrained(str(hf_dir))
    for name in ("decision_expert", "action_expert"):
        found = list(hf_dir.rglob(f"{name}/adapter_config.json"))
        assert found, sorted(str(p) for p in hf_dir.rglob("*"))
        if found[0].parent != hf_dir / name:  # peft versions differ in where they nest named adapters
            shutil.copytree(found[0].parent, hf_dir / name, dirs_exist_ok=True)
    for f in (root / "hf").iterdir():
        shutil.copy2(f, hf_dir / f.name)
    report = convert(root / "minddrive_rltrain.pth", hf_dir, tmp_path / "out", preset_name="tiny",
                     decision_token_ids=DECISION_IDS, prompts="preset")
    assert all(a["hparams_from"].endswith("adapter_config.json") and a["scaling"] == 4.0
               for a in report["adapters"].values())
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    lora = [k for k in a if ".lora_" in k]
    assert lora and all(torch.equal(a[k], b[k]) for k in lora)


def test_orion_converts_to_bf16_and_loads(orion_like, tmp_path):
    _, hf_dir, pth, _, _ = orion_like
    convert(pth, hf_dir, tmp_path / "bf16", preset_name="tiny", lora_r=4, lora_alpha=8, dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "llm" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    suffix = open_checkpoint(tmp_path / "bf16").load("suffix", 1, dtype="bf16")
    assert next(suffix.parameters()).dtype == torch.bfloat16


def test_orion_llm_written_in_shards_is_the_same(orion_like, orion_out, tmp_path):
    """Small shards (a 7B conversion holds one shard at a time): transformers' index, the same tensors."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    _, hf_dir, pth, _, _ = orion_like
    out = tmp_path / "sharded"
    convert(pth, hf_dir, out, preset_name="tiny", lora_r=4, lora_alpha=8, max_shard_bytes=40_000)
    index = json.loads((out / "llm" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "llm" / "model.safetensors").exists()
    one = load_file(str(orion_out / "llm" / "model.safetensors"))
    many = {}
    for name in shards:
        many.update(load_file(str(out / "llm" / name)))
    assert one.keys() == many.keys() == index["weight_map"].keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    ids = _ids(LLM["vocab_size"] + 1)
    with torch.no_grad():
        a = LlamaForCausalLM.from_pretrained(str(out / "llm")).model(input_ids=ids).last_hidden_state
        b = LlamaForCausalLM.from_pretrained(str(orion_out / "llm")).model(input_ids=ids).last_hidden_state
    assert torch.equal(a, b)
    assert open_checkpoint(out).load("suffix", 2) is not None


def test_orion_backbone_from_the_published_code_is_placed_and_computes_the_same(orion_like, monkeypatch, tmp_path):
    """Issue 21: a `.pth` whose `img_backbone.*` is the published EVAViT's own state dict (its real key names,
    rotary tables included; reduced width and image size) converts with the backbone placed one to one and the
    tables checked, not left over; the converted prefix's vision side gives the published code's feature map on
    the same pixels (fp32, within 1e-4); every split layer still verifies against transformers; a checkpoint
    whose stored tables belong to another image size is refused with the table named."""
    from minddrive_reference import load_eva_vit

    ref_module = load_eva_vit(monkeypatch)
    torch.manual_seed(5)
    ref = ref_module.EVAViT(img_size=96, patch_size=16, embed_dim=64, depth=3, num_heads=4, mlp_ratio=8 / 3,
                            window_size=4, window_block_indexes=[0, 1], pretrain_img_size=64, flash_attn=False,
                            with_cp=False).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    root, hf_dir, _, _, peft_model = orion_like
    # the stand-in `ego_fut_decoder` of _published_state is left out: the orion preset's VAE planner would take it
    state = {k: v for k, v in _published_state(peft_model).items()
             if not k.startswith(("img_backbone.", "ego_fut_decoder."))}
    state.update({f"img_backbone.{k}": v.clone() for k, v in ref.state_dict().items()})
    pth = tmp_path / "Orion_eva.pth"
    torch.save({"state_dict": state}, pth)
    vision = dict(type="eva02", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=170,
                  patch_size=16, image_size=96, window_size=4, global_blocks=[2], pretrain_image_size=64)
    overrides = {"image_size": 96, "vision": vision,
                 "projector": {"type": "query", "num_queries": 8, "num_layers": 1, "num_heads": 4}}
    out = tmp_path / "converted"
    report = convert(pth, hf_dir, out, preset_name="orion", overrides=overrides, lora_r=4, lora_alpha=8)
    assert report["placed"]["vision (img_backbone.* -> vision.*, EVA-02)"] == len(
        [k for k in ref.state_dict() if "rope" not in k])
    tables = "img_backbone rotary tables (computed from the config, equal to the stored ones)"
    assert report["derived_checked"][tables] == 4 + 2 * 3
    assert "img_backbone" not in report["not_placed"]
    assert set(report["not_placed"]) == {"pts_bbox_head", "map_head"}
    prefix = open_checkpoint(out).load("prefix", 0, dtype="fp32")
    pixels = torch.randn(6, 3, 96, 96)
    with torch.no_grad():
        expected = ref(pixels)[0]
        got = prefix.vision.feature_map(pixels)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    verified = _cli("verify-split", "--model", str(out), "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # part of a backbone: refused, named
    partial = {k: v for k, v in state.items() if not k.startswith("img_backbone.blocks.2.mlp.")}
    torch.save({"state_dict": partial}, pth)
    with pytest.raises(CheckpointError, match=r"lacks 8 of its tensors.*img_backbone\.blocks\.2\.mlp"):
        convert(pth, hf_dir, tmp_path / "partial", preset_name="orion", overrides=overrides, lora_r=4, lora_alpha=8)
    # a table of another size: refused, named
    state["img_backbone.rope_glb.freqs_cos"] = state["img_backbone.rope_glb.freqs_cos"][:16].clone()
    torch.save({"state_dict": state}, pth)
    with pytest.raises(CheckpointError, match=r"img_backbone\.rope_glb\.freqs_cos: the stored rotary table"):
        convert(pth, hf_dir, tmp_path / "refused", preset_name="orion", overrides=overrides, lora_r=4, lora_alpha=8)
    assert not (tmp_path / "refused").exists()


def _pth_with_planners(peft_model, distributions, modes_of: dict, pth, seed: int) -> tuple:
    """A published-layout `.pth` (the LLM of ``peft_model``) with VAE planners made from the published classes at
    the test LLM's width: for each name prefix ("" speed / Orion, "pw_" path) and its mode count, the
    `present_distribution`, the training-only `future_distribution`, `predict_model` and `ego_fut_decoder`
    (Linear 2D -> 2D, ReLU, 2D -> 2D, ReLU, 2D -> 2M, as the published detector builds it). Returns (the file, the
    planner tensors by stored name)."""
    width = LLM["hidden_size"]
    torch.manual_seed(seed)
    planners = torch.nn.Module()
    for pre, modes in modes_of.items():
        for name, extra in (("present_distribution", 0), ("future_distribution", 40 if pre else 12)):
            setattr(planners, pre + name, distributions.DistributionModule(width + extra, 32, min_log_sigma=-5.0,
                                                                           max_log_sigma=5.0))
        setattr(planners, f"{pre}predict_model", distributions.PredictModel(
            in_channels=32, out_channels=width, hidden_channels=width // 4, num_layers=4))
        setattr(planners, f"{pre}ego_fut_decoder", torch.nn.Sequential(
            torch.nn.Linear(2 * width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, 2 * width),
            torch.nn.ReLU(), torch.nn.Linear(2 * width, 2 * modes)))
    state = {k: v for k, v in _published_state(peft_model).items() if not k.startswith("ego_fut_decoder.")}
    published = {k: v.detach().clone() for k, v in planners.state_dict().items()}
    state.update(published)
    torch.save({"state_dict": state}, pth)
    return pth, published


def test_orion_vae_planner_from_the_published_classes_is_placed(orion_like, monkeypatch, tmp_path):
    """Issue 21: Orion's VAE planner in the published layout (`present_distribution.*`, `predict_model.*`,
    `ego_fut_decoder.{0,2,4}.*`, made from the published DistributionModule / PredictModel at the test LLM's width)
    converts into the `vae` read-out's head one to one (every tensor equal after loading); the posterior
    `future_distribution.*` is reported as left out on purpose (training only), not as unplaced; the converted
    suffix plans with it (6 modes x 6 steps, the command's mode). The planner's arithmetic is checked against the
    published methods in test_vae_planner."""
    from minddrive_reference import load_detector

    _, distributions = load_detector(monkeypatch)
    width = LLM["hidden_size"]
    root, hf_dir, _, _, peft_model = orion_like
    pth, published = _pth_with_planners(peft_model, distributions, {"": 6}, tmp_path / "Orion_vae.pth", seed=9)
    out = tmp_path / "converted"
    report = convert(pth, hf_dir, out, preset_name="tiny", overrides={"readout": {"type": "vae"}}, lora_r=4,
                     lora_alpha=8)
    planned = [k for k in published if not k.startswith("future_distribution.")]
    assert report["placed"]["planner (present_distribution, predict_model, ego_fut_decoder -> head.*)"] == len(planned)
    assert set(report["left_out_training_only"]) == {"future_distribution"}
    assert not {"present_distribution", "predict_model", "ego_fut_decoder", "future_distribution"} & set(
        report["not_placed"])
    suffix = open_checkpoint(out).load("suffix", LLM["num_hidden_layers"], dtype="fp32")
    head = suffix.head.state_dict()
    assert all(torch.equal(head[k], published[k]) for k in planned) and len(head) == len(planned)
    from hybrid_vla_ros.model.modeling import plan

    h = torch.randn(open_checkpoint(out).model.num_tokens, width)
    with torch.no_grad():
        out_plan = plan(suffix, h, command=2)
    assert out_plan.modes.shape == (6, 6, 2) and out_plan.mode == 2 and torch.equal(out_plan.waypoints,
                                                                                   out_plan.modes[2])


def test_minddrive_speed_and_path_planners_are_placed(minddrive_like, monkeypatch, tmp_path):
    """Issue 21: MindDrive's two VAE planners in the published layout (speed: `present_distribution`,
    `predict_model`, `ego_fut_decoder` with 7 modes; path: the same with `pw_`, 6 modes x 20 points; made from the
    published classes) convert into the `vae_speed_path` read-out's `head.speed.*` / `head.path.*` one to one, the
    path token's id is read from the tokenizer files (<path_waypoint_ego>), both posteriors are reported as
    training-only, and the converted suffix plans with them (the command's path mode, the decision's speed mode)."""
    from minddrive_reference import load_detector

    _, distributions = load_detector(monkeypatch)
    width = LLM["hidden_size"]
    root, _, peft_model = minddrive_like
    pth, published = _pth_with_planners(peft_model, distributions, {"": 7, "pw_": 6},
                                         tmp_path / "minddrive_planners.pth", seed=4)
    out = tmp_path / "converted"
    readout = {"type": "vae_speed_path", "path_token_id": 255, "path_points": 20}
    report = convert(pth, root / "hf", out, preset_name="tiny", overrides={"readout": readout}, lora_r=4,
                     lora_alpha=16, decision_token_ids=DECISION_IDS, prompts="preset")
    assert set(report["left_out_training_only"]) == {"future_distribution", "pw_future_distribution"}
    assert not {"present_distribution", "pw_present_distribution", "ego_fut_decoder", "pw_ego_fut_decoder",
                "predict_model", "pw_predict_model"} & set(report["not_placed"])
    ck = open_checkpoint(out)
    assert ck.model.readout["path_token_id"] == 301 and ck.model.planning_token_id == 300  # added_tokens.json
    suffix = ck.load("suffix", LLM["num_hidden_layers"], dtype="fp32")
    head = suffix.head.state_dict()
    expected = {("speed." if not k.startswith("pw_") else "path.") + k.removeprefix("pw_"): v
                for k, v in published.items() if "future_distribution" not in k}
    assert head.keys() == expected.keys() and all(torch.equal(head[k], expected[k]) for k in head)
    from hybrid_vla_ros.model.modeling import plan

    with torch.no_grad():
        out_plan = plan(suffix, torch.randn(2, ck.model.num_tokens, width), command=0)  # LEFT: turn-left path
    assert out_plan.mode == 2 and out_plan.path.shape == (20, 2) and 0 <= out_plan.speed_mode < 7
    assert "head.*" not in report["stand_ins"] and "planner" not in report["stand_ins"]
    # a checkpoint with part of a planner is refused, not run part random
    state = torch.load(pth, weights_only=True)["state_dict"]
    del state["pw_ego_fut_decoder.4.weight"]
    torch.save({"state_dict": state}, pth)
    with pytest.raises(CheckpointError, match=r"planner lacks 1 of the tensors.*head\.path\.ego_fut_decoder\.4"):
        convert(pth, root / "hf", tmp_path / "partial", preset_name="tiny", overrides={"readout": readout}, lora_r=4,
                lora_alpha=16, decision_token_ids=DECISION_IDS, prompts="preset")


def test_minddrive_query_heads_from_the_published_classes_are_placed(minddrive_like, monkeypatch, tmp_path):
    """Issue 21: MindDrive's query heads in the published layout (MinddriveHead with its motion-prediction and
    traffic-light branches, MinddriveHeadM, the detector's shared encoders at the top and under each head, the 3-D
    position embedding's MLP with its stored depths and range; made from the published classes at reduced sizes)
    convert into the `scene_queries` projector: every inference tensor placed (the six copies of each per-level
    branch and the three of each shared encoder compared and placed once), the output-only branches and the loss
    weights named as left out, nothing of the heads left unplaced; the converted prefix's heads give the published
    heads' scene tokens on the same features and geometry (fp32, within 1e-4); every split layer verifies; a
    checkpoint with part of the heads is refused."""
    from minddrive_reference import published_heads_state, reference_heads

    from hybrid_vla_ros.model.camera_rays import RayEmbeddingConfig
    from hybrid_vla_ros.model.query_heads import QueryHeads, example_scene_inputs

    root, _, peft_model = minddrive_like
    heads_keys = dict(num_layers=1, feedforward_dims=64, num_extra=8, num_query=12, memory_len=16, topk_proposals=8,
                      num_propagated=8, num_memory=4, scene_memory_len=8, memory_ffn_dims=64, num_lane=20,
                      num_lanes_one2one=10, map_memory_len=16, map_topk=8)
    vision = dict(type="eva02", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=170,
                  patch_size=16, image_size=64, window_size=2, global_blocks=[2], pretrain_image_size=64)
    overrides = {"image_size": 64, "vision": vision, "projector": {"type": "scene_queries", **heads_keys}}
    from hybrid_vla_ros.model.config import preset

    cfg_heads = preset("tiny", **overrides, llm={**LLM, "model_type": "qwen2"}).scene_heads_config
    det, lanes, shared = reference_heads(monkeypatch, cfg_heads, motion=True, seed=3)
    rays = RayEmbeddingConfig(embed_dims=256, stride=16)
    torch.manual_seed(2)
    position_encoder = QueryHeads(cfg_heads, rays).rays.position_encoder
    state = {k: v for k, v in _published_state(peft_model).items()
             if not k.startswith(("img_backbone.", "pts_bbox_head.", "map_head."))}
    published = published_heads_state(det, lanes, shared, position_encoder, rays)
    state.update(published)
    pth = tmp_path / "minddrive_heads.pth"
    torch.save({"state_dict": state}, pth)
    out = tmp_path / "converted"
    report = convert(pth, root / "hf", out, preset_name="tiny", overrides=overrides, lora_r=4, lora_alpha=16,
                     decision_token_ids=DECISION_IDS, prompts="preset")
    with torch.device("meta"):
        wanted = QueryHeads(cfg_heads, rays).state_dict()
    group = "query heads (pts_bbox_head, map_head, shared encoders, position_encoder -> projector.*)"
    assert report["placed"][group] == len(wanted)
    leftover = {"pts_bbox_head", "map_head", "query_pos", "time_embedding", "ego_pose_pe", "position_encoder",
                "coords_d", "position_range"}
    assert not leftover & set(report["not_placed"]), report["not_placed"]
    output_only = set(report["left_out_output_only"])
    assert {"pts_bbox_head.motion_decoder", "pts_bbox_head.motion_map_decoder", "pts_bbox_head.lane_encoder",
            "pts_bbox_head.traj_branches", "pts_bbox_head.tl_branches"} <= output_only
    assert {"pts_bbox_head", "map_head"} <= set(report["left_out_training_only"])  # code_weights, match_costs
    assert "projector.*" not in report["stand_ins"]
    # the converted heads compute the published heads' tokens
    ck = open_checkpoint(out)
    prefix = ck.load("prefix", 0, dtype="fp32")
    scene = example_scene_inputs(6, 64, timestamp=5.0)
    feats = torch.randn(6, 64, 4, 4, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ours = prefix.projector(feats, scene.lidar2img, scene.frame).tokens
        pos_embed = prefix.projector.rays(scene.lidar2img, 4, 4, 64, 64).unsqueeze(0)
        f = scene.frame
        data = dict(img_feats=feats.unsqueeze(0), timestamp=torch.tensor([f.timestamp], dtype=torch.float64),
                    ego_pose=f.ego_pose.float().unsqueeze(0), ego_pose_inv=f.ego_pose.inverse().float().unsqueeze(0),
                    can_bus=f.can_bus.float().unsqueeze(0), command=torch.tensor([float(f.command)]))
        metas = [{"scene_token": "s"}]
        lane_outs, map_tokens = lanes(metas, pos_embed, **data)
        det.use_col_loss = False  # the motion branch (output only) reads map outputs this test does not make
        _, obj_tokens = det(metas, pos_embed, lane_outs, **data)
    expected = torch.cat([obj_tokens[0], map_tokens[0]])
    assert ours.shape == expected.shape == (cfg_heads.scene_tokens, LLM["hidden_size"])
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()
    verified = _cli("verify-split", "--model", str(out), "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # part of the heads: refused, named
    del state["map_head.transformer.query_decoder._layers.0.transformer_layers.2.attn.out_proj.weight"]
    torch.save({"state_dict": state}, pth)
    with pytest.raises(CheckpointError, match=r"query heads do not fit.*partial checkpoint"):
        convert(pth, root / "hf", tmp_path / "partial", preset_name="tiny", overrides=overrides, lora_r=4,
                lora_alpha=16, decision_token_ids=DECISION_IDS, prompts="preset")


# ------------------------------------------------------------------------- MindDrive's two published prompts

def _qwen2_tokenizer(path: Path):
    """A Qwen2 tokenizer as transformers writes one (its Qwen2Tokenizer: Qwen2's pre-tokenizer regex and byte-level
    BPE), with the 256 byte symbols as its vocabulary and Qwen2's chat markers as special tokens (a real Qwen2's
    151k-token vocabulary is not at hand; the token boundaries around the special tokens are Qwen2's)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(str(path))
    return tok


@pytest.fixture(scope="module")
def minddrive_tokenized(tmp_path_factory):
    """MindDrive as published with its tokenizer beside the LLM config: the embeddings have the tokenizer's rows
    after MindDrive's 15 added tokens (as its add_special_token resizes them), both adapters (r=4, alpha=16),
    converted with the speed and path planners' read-out (random planner weights: this test is about the LLM's
    token sequences and where they are read)."""
    root = tmp_path_factory.mktemp("minddrive_tok")
    hf_dir = root / "hf"
    tok = _qwen2_tokenizer(hf_dir)
    peft_model = _minddrive_peft(hf_dir, len(tok) + 15, seeds=(3, 6, 7))
    pth = root / "minddrive.pth"
    state = {k: v for k, v in _published_state(peft_model).items() if not k.startswith("ego_fut_decoder.")}
    torch.save({"state_dict": state}, pth)
    out = root / "converted"
    readout = {"type": "vae_speed_path", "path_token_id": 0, "path_points": 20}
    report = convert(pth, hf_dir, out, preset_name="tiny", overrides={"readout": readout}, lora_r=4, lora_alpha=16)
    return root, hf_dir, pth, out, report, peft_model


def _reference_input_ids(monkeypatch, hf_dir):
    """The input ids MindDrive's inference pipeline makes (its test pipeline's LoadAnnoatationMixCriticalVQATest
    options), one sequence per conversation, -200 where the scene tokens go, and its tokenizer after the additions."""
    from minddrive_reference import load_prompt_pipeline

    pipeline = load_prompt_pipeline(monkeypatch)
    step = pipeline.LoadAnnoatationMixCriticalVQATest(
        tokenizer=str(hf_dir), max_length=2048, load_type=["planning"], desc_qa=False, use_gen_token=True,
        conv_template="llava_qwen2", is_decoupling=True, use_meta_action=True, single=True)
    results = step({})
    return [ids.tolist() for ids in results["input_ids"]], step.tokenizer


def test_minddrive_passes_run_the_published_prompts(minddrive_tokenized, monkeypatch, tmp_path):
    """Issue 21: with the tokenizer beside the LLM config, `convert` writes MindDrive's two published prompts (the
    decision pass's and the action pass's own sequences, as its inference pipeline makes them: checked token for
    token against the reference pipeline run on the same tokenizer) and reads the meta-action, <waypoint_ego> and
    <path_waypoint_ego> ids from it. On the nodes' (2, T, H) hidden states (the decision pass padded at its end),
    the decision logits equal peft's decision adapter at position -2 of the reference's decision sequence alone,
    and the planner states equal peft's action adapter where the reference's sequence holds the two waypoint
    tokens; a contradicting id option or another tokenizer is refused."""
    from hybrid_vla_ros.model.modeling import speed_path_plan
    from hybrid_vla_ros.runtime.suffix_backend import read_out_tokens

    root, hf_dir, pth, out, report, peft_model = minddrive_tokenized
    ref_ids, ref_tok = _reference_input_ids(monkeypatch, hf_dir)
    ck = open_checkpoint(out)
    cfg = ck.cfg
    assert report["prompt"]["source"].startswith("MindDrive's published prompts")
    speed = ["<maintain_moderate_speed>", "<stop>", "<maintain_slow_speed>", "<speed_up>", "<slow_down>",
             "<maintain_fast_speed>", "<slow_down_rapidly>"]  # the reference's SPEED_MAPPING order
    speed_ids = ref_tok.convert_tokens_to_ids(speed)
    assert cfg.decision_token_ids == speed_ids
    wp, path = ref_tok.convert_tokens_to_ids(["<waypoint_ego>", "<path_waypoint_ego>"])
    assert cfg.planning_token_id == wp and cfg.readout["path_token_id"] == path
    # token for token the reference's sequences (its decision answer ends with a randomly drawn speed token)
    for p, ids in enumerate(ref_ids):
        ours = cfg.prompt_token_ids + [-200] + cfg.pass_prompt_token_ids[p]
        if p == 0:
            assert ours[:-1] == ids[:-1] and ids[-1] in speed_ids and ours[-1] in speed_ids
        else:
            assert ours == ids
    assert len(cfg.pass_prompt_token_ids[0]) != len(cfg.pass_prompt_token_ids[1])  # so one pass is padded
    at = cfg.readout_positions
    assert read_out_tokens(cfg) == max(-at.planning, -at.path, -at.decision)
    # the LLM on the published sequences (peft's model per adapter on the reference's ids) vs the split model
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, generator=g)
    prefix, suffix = ck.load("prefix", 1, dtype="fp32"), ck.load("suffix", 1, dtype="fp32")
    n_pre, V = len(cfg.prompt_token_ids), cfg.num_vision_tokens
    with torch.no_grad():
        h0 = ck.load("prefix", 0, dtype="fp32")(pixels)
        vis = h0[0, n_pre:n_pre + V]
        assert torch.equal(vis, h0[1, n_pre:n_pre + V])
        h1 = prefix(pixels)
        final = suffix.final_hidden_states(h1)
        got = suffix.plan_all(h1, command=2)
        ref_states = []
        for p, (ids, name) in enumerate(zip(ref_ids, ["decision_expert", "action_expert"])):
            ref = _merged(peft_model, name)
            cut = ids.index(-200)  # LLaVA's prepare_inputs_labels_for_multimodal: the scene tokens in its place
            emb = ref.get_input_embeddings()
            x = torch.cat([emb(torch.tensor(ids[:cut])), vis, emb(torch.tensor(ids[cut + 1:]))]).unsqueeze(0)
            states = ref(inputs_embeds=x, output_hidden_states=True)
            if p == 0:
                logits = states.logits[0, -2, speed_ids]  # inference_action_distribution's read-out
                assert (got.decision_logits - logits).abs().max() <= 1e-4 * max(1.0, float(logits.abs().max()))
                assert got.speed_mode == int(logits.argmax())
            else:
                seq = ids[:cut] + [-1] * V + ids[cut + 1:]
                where = [i for i, t in enumerate(seq) if t in (wp, path)]  # inference_waypoints' positions
                ref_states = states.hidden_states[-1][0, where]
                ours = final[1, [at.planning, at.path]]
                assert (ours - ref_states).abs().max() <= 1e-4 * float(ref_states.abs().max())
            # the pass's own tokens (the decision's drawn meta-action last left out): the padding never reaches them
            n = len(ids) - 1 + V - (p == 0)
            real = states.hidden_states[-1][0, :n]
            assert (final[p, :n] - real).abs().max() <= 1e-4 * float(real.abs().max())
        expected = speed_path_plan(suffix, ref_states, 2, logits, int(logits.argmax()))
        assert (got.modes - expected.modes).abs().max() <= 1e-4 * max(1.0, float(expected.modes.abs().max()))
        # reading the old places (the last two tokens of the action pass) would be another plan: the test can fail
        assert (final[1, -2:] - ref_states).abs().max() > 1e-2
    verified = _cli("verify-split", "--model", str(out), "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    with pytest.raises(ValueError, match="decision-token-ids"):
        convert(pth, hf_dir, tmp_path / "a", preset_name="tiny", lora_r=4, decision_token_ids=DECISION_IDS)
    other = tmp_path / "other"  # one token more than the tokenizer the checkpoint was trained with
    tok = _qwen2_tokenizer(other)
    tok.add_tokens(["<extra>"], special_tokens=True)
    tok.save_pretrained(str(other))
    (other / "config.json").write_text((hf_dir / "config.json").read_text())
    (tmp_path / "b").mkdir()  # an empty OUT the user made: kept on failure, so what was written shows
    with pytest.raises(CheckpointError, match="not the tokenizer it was trained with"):
        convert(pth, other, tmp_path / "b", preset_name="tiny", lora_r=4)
    assert not any((tmp_path / "b").iterdir())  # refused before OUT/llm was written
    with pytest.raises(ValueError, match="pass_prompt_token_ids: the published prompts come from"):
        convert(pth, hf_dir, tmp_path / "c", preset_name="tiny", lora_r=4, overrides={"pass_prompt_token_ids": [[1]]})
    # --prompts preset: the preset's fixed prompt, said so, and the ids then come from the options
    kept = convert(pth, hf_dir, tmp_path / "d", preset_name="tiny", lora_r=4, lora_alpha=16, prompts="preset",
                   decision_token_ids=speed_ids, waypoint_token_id=wp)
    assert "NOT the published conversation" in kept["prompt"]["source"]
    assert open_checkpoint(tmp_path / "d").cfg.pass_prompt_token_ids == []


def _vicuna_tokenizer(path: Path, size: int):
    """A LLaMA-style tokenizer of ``size`` ids as transformers saves one (SentencePiece's conventions through the
    tokenizers library: "▁" for spaces with one prepended, byte fallback, BOS added in front; ids 0-2 are <unk>,
    <s>, </s>), its vocabulary the 256 byte symbols and single characters (Vicuna's 32000-token one is not at hand;
    what matters here is where the BOS goes and that each piece around <image> is tokenized on its own)."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for ch in "▁" + string.ascii_letters + string.digits:
        if len(vocab) < size:
            vocab[ch] = len(vocab)
    assert len(vocab) == size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def test_orion_runs_its_published_closed_loop_conversation_with_its_tokenizer(orion_like, monkeypatch, tmp_path):
    """Issue 40 item 6: with the tokenizer beside the LLM config, `convert` writes Orion's closed-loop conversation
    (its agent config: the planning turn alone, desc_qa off) around the scene tokens, and the planning state is read
    at <waypoint_ego>, before the template's closing </s>. Referee: the published conversation machinery
    (conv_vicuna_v1 and preprocess, in ../shared/reference/minddrive's copy of Orion's data utils) on Orion's
    planning turn as its pipeline writes it (public copy: wzh506/CoT4AD mmcv/datasets/pipelines/transforms_3d.py,
    LoadAnnoatationCriticalVQATest), -200 where the scene tokens go."""
    from minddrive_reference import load_prompt_pipeline

    root, hf_dir, pth, _, _ = orion_like
    llm_dir = tmp_path / "llm"
    llm_dir.mkdir()
    (llm_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    tok = _vicuna_tokenizer(llm_dir, LLM["vocab_size"])
    out = tmp_path / "converted"
    report = convert(pth, llm_dir, out, preset_name="tiny", lora_r=4, lora_alpha=8)
    cfg = open_checkpoint(out).cfg
    pipeline = load_prompt_pipeline(monkeypatch)
    tok.add_tokens(["<waypoint_ego>"], special_tokens=True)
    sources = [[{"from": "human", "value": "<image>\nYou are driving a car.Please provide the planning trajectory "
                                           "for the ego car without reasons."},
                {"from": "gpt", "value": "Here is the planning trajectory <waypoint_ego>"}]]
    want = pipeline.preprocess(sources, tok, has_image=True, training_mode=False,
                               only_one_system_prompt=True)["input_ids"][0].tolist()
    assert cfg.prompt_token_ids + [-200] + cfg.pass_prompt_token_ids[0] == want
    waypoint = tok.convert_tokens_to_ids("<waypoint_ego>")
    assert cfg.planning_token_id == waypoint == LLM["vocab_size"] and want[-1] == tok.eos_token_id
    at = cfg.readout_positions.planning  # read at <waypoint_ego>, one before the closing </s>
    assert cfg.pass_prompt_token_ids[0][at] == waypoint and at == -2
    assert report["prompt"]["source"].startswith("Orion's closed-loop conversation")
    verified = _cli("verify-split", "--model", str(out), "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_orion_with_its_critical_qa_asks_its_questions_as_its_pipeline_tokenizes_them(orion_like, monkeypatch,
                                                                                       tmp_path):
    """Issue 40 item 6, the QA-then-plan conversation: `convert --prompts published-qa` writes Orion's chain-of-
    thought conversation (desc_qa on): the first question around the scene tokens before the decode, the two other
    questions as turns each answered by a decode, the planning turn placed after the last answer and the planning
    state read at its <waypoint_ego>; each turn equal to the published pipeline's own tokenization of the same
    sources (preprocess_v1 with only_one_system_prompt, one sequence per turn, -200 for the scene tokens), the
    stop token its </s> and its sampling (temperature 0.1, top-p 0.75). `verify-split --decode-tokens 3` then
    checks the three decodes and the read-out against transformers at every K."""
    from minddrive_reference import load_prompt_pipeline
    from hybrid_vla_ros.model.published_prompts import ORION_QA_QUESTIONS

    root, hf_dir, pth, _, _ = orion_like
    llm_dir = tmp_path / "llm"
    llm_dir.mkdir()
    # the test tokenizer spells most words letter by letter: the conversation needs more than the 512 positions
    doc = json.loads((hf_dir / "config.json").read_text())
    (llm_dir / "config.json").write_text(json.dumps({**doc, "max_position_embeddings": 2048}))
    tok = _vicuna_tokenizer(llm_dir, LLM["vocab_size"])
    out = tmp_path / "converted"
    report = convert(pth, llm_dir, out, preset_name="tiny", lora_r=4, lora_alpha=8, prompts="published-qa",
                     overrides={"decode": {"max_new_tokens": 24}})
    cfg = open_checkpoint(out).cfg
    spec = cfg.decode_spec
    pipeline = load_prompt_pipeline(monkeypatch)
    tok.add_tokens(["<waypoint_ego>"], special_tokens=True)
    first, second, third = ORION_QA_QUESTIONS
    sources = [[{"from": "human", "value": "<image>\nYou are driving a car." + first}, {"from": "gpt", "value": ""}],
               [{"from": "human", "value": second}, {"from": "gpt", "value": ""}],
               [{"from": "human", "value": third}, {"from": "gpt", "value": ""}],
               [{"from": "human", "value": "Please provide the planning trajectory for the ego car without reasons."},
                {"from": "gpt", "value": "Here is the planning trajectory <waypoint_ego>"}]]
    want = [ids.tolist() for ids in pipeline.preprocess(sources, tok, has_image=True, training_mode=False,
                                                          only_one_system_prompt=True)["input_ids"]]
    assert cfg.prompt_token_ids + [-200] + cfg.pass_prompt_token_ids[0] == want[0]
    assert [list(t) for t in spec.turns] == want[1:3] and all(t[0] == tok.bos_token_id for t in spec.turns)
    waypoint = tok.convert_tokens_to_ids("<waypoint_ego>")
    assert cfg.decode_placed_token_ids == want[3][:want[3].index(waypoint) + 1]
    assert spec.settings.stop_token_ids == (tok.eos_token_id,) and spec.settings.max_new_tokens == 24
    assert (spec.settings.temperature, spec.settings.top_p) == (0.1, 0.75)
    assert report["prompt"]["source"].startswith("Orion's conversation with its critical QA")
    assert report["prompt"]["turn_tokens"] == [len(want[1]), len(want[2])]
    verified = _cli("verify-split", "--model", str(out), "--decode-tokens", "3", "--quiet")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "9 tokens" in verified.stdout, verified.stdout  # three decodes of three tokens
