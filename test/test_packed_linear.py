"""bf16 linear layers and mixture-of-experts experts packed once for oneDNN (runtime/packed_linear.py): the CPU suffix
computes the same bits with its weights packed as without, in a prefill, a decode (blocks and LM head) and after a
re-split loads more blocks, for every MoE family transformers runs with its ``grouped_mm`` experts.

The packed path runs only where oneDNN computes bf16 natively (AVX512-BF16 / AMX); elsewhere these tests are
skipped with that reason, and the runner reports its suffix as not packed (the last test checks that report
wherever it runs)."""
import pytest
import torch

from hf_builders import GENERIC_FAMILIES, HYBRID_FAMILIES, LLM, perturb_, write_generic_lm, write_qwen2
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.decode import DecodeSettings, SideCache, SuffixDecoding, decode_in_process
from hybrid_vla_ros.runtime.packed_linear import (PackedExperts, PackedLinear, pack_experts_, pack_linears_,
                                                  pack_lm_head_, packing_supported)
from hybrid_vla_ros.split.resplit import StageSplit
from hybrid_vla_ros.split.verify import BagFrames

SUPPORTED, WHY = packing_supported()
needs_packing = pytest.mark.skipif(not SUPPORTED, reason=f"no native oneDNN bf16 here: {WHY}")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("packed") / "qwen2")


def _packed_count(module, kind=PackedLinear) -> int:
    return sum(isinstance(m, kind) for m in module.modules())


#: The mixture-of-experts families of the generic-decoder tests (test/hf_builders.py), hybrids among them.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3", "llama4_text",
                "jamba", "qwen3_next")


@needs_packing
@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_packed_experts_give_transformers_own_bits_in_its_model(name):
    """Inside transformers' own bf16 ``<Family>ForCausalLM`` (routers drawn so tokens reach most experts), the
    blocks' experts and linear layers packed: the logits of a 24-token prompt and a 4-token greedy ``generate``
    (decode steps of one row) equal the unpacked model's to the bit. Every MoE block whose experts transformers
    runs in ``grouped_mm`` is packed and lets its unpacked expert weights go; Llama 4's experts (``eager``, which
    adds each expert's rows in bf16) stay as they are. Jamba's state-space mixer reads ``dt_proj.weight`` itself:
    that layer stays a plain ``nn.Linear`` and the model still runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = GENERIC_FAMILIES[name] if name in GENERIC_FAMILIES else HYBRID_FAMILIES[name]
    config = AutoConfig.for_model(name, **{**LLM, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                           **overrides})
    torch.manual_seed(4)
    model = perturb_(AutoModelForCausalLM.from_config(config), 4).eval().to(BF16)
    grouped = config._experts_implementation == "grouped_mm"
    moe_blocks = sum(isinstance(getattr(m, "down_proj", None), torch.nn.Parameter) and m.down_proj.dim() == 3
                     for m in model.model.layers.modules())  # fused experts: (E, H, I) or (E, I, H)
    ids = torch.tensor([[(7 + 131 * i) % LLM["vocab_size"] for i in range(24)]])
    with torch.inference_mode():
        logits, tokens = model(ids).logits, model.generate(ids, max_new_tokens=4, do_sample=False)
        assert pack_linears_(model.model.layers) > 0
        packed = pack_experts_(model.model.layers)
        assert (packed == moe_blocks > 0) if grouped else packed == 0, (packed, moe_blocks)
        assert torch.equal(model(ids).logits, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)
    for experts in (m for m in model.modules() if isinstance(m, PackedExperts)):
        assert not any(p.dim() == 3 for p in experts.parameters())  # the packed copies replaced them
    if name == "jamba":
        assert all(type(m.dt_proj) is torch.nn.Linear for m in model.modules() if hasattr(m, "dt_proj"))


@needs_packing
def test_a_moe_suffix_packs_its_experts_and_those_a_re_split_loads(tmp_path):
    """The bf16 suffix runner of a composed Qwen3-MoE VLA packs its blocks' experts and says so; its loader packs
    the blocks a move of K down loads, and the stage then computes the unpacked stage's bits at the new K."""
    from hybrid_vla_ros.runtime.settings import SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner
    from hybrid_vla_ros.tools.cli import main as cli

    composed = tmp_path / "composed"
    llm = write_generic_lm(tmp_path / "qwen3_moe", "qwen3_moe")
    assert cli(["init-model", "--preset", "tiny", "--llm", str(llm), str(composed)]) == 0
    ck = open_checkpoint(composed)
    runner = SuffixRunner(str(composed), SuffixRunnerSettings(2, namespace="/pe", dtype="bf16",
                                                                   inference_precision="dtype"))
    try:
        stage = runner.stage
        assert "the experts of 1 MoE block(s)" in runner.linear_packing, runner.linear_packing
        assert _packed_count(stage, PackedExperts) == len(stage.layers) == ck.num_layers - 2
        event = runner.split.for_frame(0)
        assert event is not None and stage.split_layer == 0
        assert _packed_count(stage, PackedExperts) == ck.num_layers
        plain = ck.load("suffix", 0, dtype=BF16)
        h = torch.randn(stage.cfg.prefix_state_shape, generator=torch.Generator().manual_seed(5)).to(BF16)
        with torch.inference_mode():
            assert torch.equal(stage.final_hidden_states(h), plain.final_hidden_states(h))
    finally:
        runner.close()


@needs_packing
def test_a_packed_suffix_computes_the_unpacked_ones_bits(qwen2):
    ck = open_checkpoint(qwen2, tokens=24)
    plain, packed = ck.load("suffix", 1, dtype=BF16), ck.load("suffix", 1, dtype=BF16)
    n = pack_linears_(packed)
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert n == linears == _packed_count(packed) and n > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    h = torch.randn(24, ck.model.hidden_size, generator=torch.Generator().manual_seed(3)).to(BF16)
    with torch.inference_mode():
        assert torch.equal(packed.final_hidden_states(h), plain.final_hidden_states(h))
    assert pack_linears_(packed) == 0  # already packed: nothing more


@needs_packing
def test_a_packed_decode_chooses_the_same_tokens_with_the_same_logits(qwen2):
    """Blocks [K, L) and the LM head packed: a greedy decode of 8 tokens equals the unpacked one, logits to the
    bit; the packed head lets its unpacked weight go."""
    ck = open_checkpoint(qwen2, tokens=16)
    sm = ck.split_model()
    config = sm.text_config()
    settings = DecodeSettings(max_new_tokens=8)
    k = 1
    with torch.inference_mode():
        inputs = sm.example_inputs(BagFrames(), dtype=BF16)
        bound = SuffixDecoding.bound(sm.prompt_tokens(inputs), settings)

        def run(pack: bool):
            suffix, head = ck.load("suffix", k, dtype=BF16), ck.load("lm_head", dtype=BF16)
            if pack:
                assert pack_linears_(suffix) > 0 and pack_lm_head_(head) and head.weight is None
            return decode_in_process(sm, ck.load("prefix", k, dtype=BF16), suffix, head, SideCache(config, bound, 0),
                                     SideCache(config, bound, k), inputs, settings)

        plain, packed = run(False), run(True)
    assert packed.tokens == plain.tokens and len(plain.tokens) == 8
    assert all(torch.equal(a, b) for a, b in zip(packed.logits, plain.logits))


@needs_packing
def test_blocks_a_re_split_loads_are_packed_as_they_load(qwen2):
    """The suffix's loader packs the blocks it loads for a move of K down (on its thread, off the frame): after
    the move every block is packed and the stage computes the unpacked stage's bits at the new K."""
    ck = open_checkpoint(qwen2, tokens=24)
    stage = ck.load("suffix", 2, dtype=BF16)
    pack_linears_(stage)
    split = StageSplit(stage, "suffix", model_path=str(qwen2), device=torch.device("cpu"), dtype=BF16,
                       model_id=ck.model_id())
    split.prefetcher.prepare = pack_linears_
    try:
        event = split.for_frame(0)
        assert event is not None and stage.split_layer == 0 and len(stage.layers) == ck.num_layers
        assert not any(isinstance(m, torch.nn.Linear) for m in stage.modules())
        assert event.stage_bytes_after > event.stage_bytes_before  # the packed weights count as its bytes
    finally:
        split.close()
    plain = ck.load("suffix", 0, dtype=BF16)
    h = torch.randn(24, ck.model.hidden_size, generator=torch.Generator().manual_seed(5)).to(BF16)
    with torch.inference_mode():
        assert torch.equal(stage.final_hidden_states(h), plain.final_hidden_states(h))


def test_the_runner_says_how_its_bf16_linears_compute(tiny_checkpoint):
    """A bf16 eager suffix packs its linear layers where this CPU can (and says so); an fp32 one says nothing."""
    from hybrid_vla_ros.runtime.settings import SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    def packing(**kw):
        runner = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(1, namespace="/pl", **kw))
        try:
            return runner.linear_packing, _packed_count(runner.stage)
        finally:
            runner.close()

    said, n = packing(dtype="bf16", inference_precision="dtype")  # bf16 on every CPU, emulated or not
    if SUPPORTED:
        assert said.startswith("packed ") and n > 0, said
    else:
        assert said == f"not packed: {WHY}" and n == 0
    assert packing(dtype="fp32") == ("", 0)
