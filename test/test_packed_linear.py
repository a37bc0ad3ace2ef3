"""bf16 linear layers packed once for oneDNN (runtime/packed_linear.py): the CPU suffix computes the same bits with
its weights packed as without, in a prefill, a decode (blocks and LM head) and after a re-split loads more blocks.

The packed path runs only where oneDNN computes bf16 natively (AVX512-BF16 / AMX); elsewhere these tests are
skipped with that reason, and the runner reports its suffix as not packed (the last test checks that report
wherever it runs)."""
import pytest
import torch

from hf_builders import write_qwen2
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.decode import DecodeSettings, SideCache, SuffixDecoding, decode_in_process
from hybrid_vla_ros.runtime.packed_linear import PackedLinear, pack_linears_, pack_lm_head_, packing_supported
from hybrid_vla_ros.split.resplit import StageSplit
from hybrid_vla_ros.split.verify import BagFrames

SUPPORTED, WHY = packing_supported()
needs_packing = pytest.mark.skipif(not SUPPORTED, reason=f"no native oneDNN bf16 here: {WHY}")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return write_qwen2(tmp_path_factory.mktemp("packed") / "qwen2")


def _packed_count(module) -> int:
    return sum(isinstance(m, PackedLinear) for m in module.modules())


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

    said, n = packing(dtype="bf16")
    if SUPPORTED:
        assert said.startswith("packed ") and n > 0, said
    else:
        assert said == f"not packed: {WHY}" and n == 0
    assert packing(dtype="fp32") == ("", 0)
