"""The suffix's decode step compiled by TorchInductor (``decode_step: inductor``, issue 40): the tokens and logits of
the eager step, in the cache the graph owns, at the K of each frame, and a clear refusal where it cannot run.

Tiny checkpoints written by transformers' ``save_pretrained``; the eager step (checked against transformers'
``generate`` in test_decode.py) is the reference. fp32 only: the compiled kernels sum in another order, so the
logits agree to rounding (a few ulp of their scale), not bit for bit; bf16 rounds by bf16's step and is measured by
the bench, not asserted here."""
import pytest
import torch
from torch._inductor.utils import run_and_get_code

from hf_builders import write_llama, write_text_lm
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.decode import DecodeSettings, PrefixDecoding, SideCache, SuffixDecoding
from hybrid_vla_ros.runtime.compiled_step import (CompiledDecodeStep, DecodeStepBuilder, DecodeStepStatus,
                                                   compile_support)

PROMPT, TOKENS = 16, 12


def _decode(sm, prefix, back, inputs, frame_seq=0):
    """One frame through ``prefix`` (its K) and ``back`` at that K -> the DecodeResult."""
    front = PrefixDecoding(sm, prefix, SideCache(sm.text_config(), back._own_cache.max_len, 0))
    with torch.inference_mode():
        back.begin(frame_seq, prefix.split_layer)
        ids = back.take(front.prefill(inputs))
        while not back.result.ended:
            ids = back.take(front.step(ids))
    return back.result


class _Counting(DecodeStepBuilder):
    """The builder with a count of the steps its compiled graph computed (so a test knows it ran)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compiled_steps = 0

    def for_frame(self, stage, k):
        step = super().for_frame(stage, k)
        if step is not None and not hasattr(step, "_counted"):
            inner, step._counted = step.logits, True

            def counted(row):
                self.compiled_steps += 1
                return inner(row)

            step.logits = counted
        return step


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_compiled_step_chooses_the_eager_tokens_with_the_eager_logits(tmp_path, family):
    """Greedy, 12 tokens after 16 at K = 1 (LLaMA; Qwen3 with its q / k norms and a tied head): every token of the
    eager decode, each step's logits within 1e-5 of their scale; every step after the prefill ran compiled (the
    graph never compiled again: that would have dropped the step, the state says not), in the step's own cache (the
    decoding's stays empty), and a second frame gives the same again (the cache emptied in place, the graph still
    bound to it)."""
    path = write_llama(tmp_path / family) if family == "llama" else write_text_lm(tmp_path / family, family)
    ck = open_checkpoint(path, tokens=PROMPT)
    sm, k = ck.split_model(), 1
    prefix, suffix, head = ck.load("prefix", k), ck.load("suffix", k), ck.load("lm_head")
    settings = DecodeSettings(max_new_tokens=TOKENS)
    bound = SuffixDecoding.bound(PROMPT, settings)
    inputs = sm.example_inputs(None)
    eager = _decode(sm, prefix, SuffixDecoding(sm, suffix, head, SideCache(sm.text_config(), bound, k), settings),
                    inputs)
    back = SuffixDecoding(sm, suffix, head, SideCache(sm.text_config(), bound, k), settings)
    back.compiled = builder = _Counting(sm, head, bound, background=False)
    for frame in range(2):
        if frame == 0:  # the build: the code inductor generates for the step kept
            got, code = run_and_get_code(_decode, sm, prefix, back, inputs, frame)
        else:
            got = _decode(sm, prefix, back, inputs, frame)
        assert got.tokens == eager.tokens, (frame, got.tokens, eager.tokens)
        for a, b in zip(got.logits, eager.logits):
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())
        assert back.cache is back._step.cache and back.cache.tokens == PROMPT + TOKENS - 1
        assert back._own_cache.tokens == 0
    assert builder.compiled_steps == 2 * (TOKENS - 1)  # the first token comes from the prefill's last row
    assert builder.status() == DecodeStepStatus("inductor", compiled_k=k, line=f"inductor at K={k}")
    with pytest.raises(ValueError, match="do not fit"):  # the cache is full: a further step is refused, untouched
        back._step.logits(torch.zeros(1, back._step.hidden_size))
    assert back._step.cache.tokens == PROMPT + TOKENS - 1
    # each cache length's step inputs computed once (and 0, the build's warm-up): the second frame reused them
    assert sorted(back._step._by_length) == [0, *range(PROMPT, PROMPT + TOKENS - 1)]
    # attention in the compiled step is SDPA's math kernel, fused into the graph: the generated code calls no flash
    # kernel, while the eager prefix step beside it still does (the build left the process's SDPA choice as it was)
    assert code and not any("flash_attention" in c for c in code)
    assert torch.backends.cuda.flash_sdp_enabled()
    with torch.inference_mode(), torch.profiler.profile() as eager_step:
        PrefixDecoding(sm, prefix, SideCache(sm.text_config(), bound, 0)).prefill(inputs)
    assert any("flash_attention" in e.name for e in eager_step.events())


def test_a_frame_at_another_split_layer_decodes_eagerly_until_its_step_is_built(tmp_path):
    """Built in the background: the first frame (and a frame at a new K) decodes eagerly, later ones compiled at
    their own K with the same tokens; a K met while another builds is not refused (it builds at its next frame),
    only one past the kept bound is, and a closed builder says so."""
    path = write_llama(tmp_path / "llama")
    ck = open_checkpoint(path, tokens=PROMPT)
    sm = ck.split_model()
    prefixes = {k: ck.load("prefix", k) for k in (1, 2)}
    suffix, head = ck.load("suffix", 1), ck.load("lm_head")
    settings = DecodeSettings(max_new_tokens=4)
    bound = SuffixDecoding.bound(PROMPT, settings)
    back = SuffixDecoding(sm, suffix, head, SideCache(sm.text_config(), bound, 1), settings)
    back.compiled = builder = DecodeStepBuilder(sm, head, bound, background=True)
    inputs = sm.example_inputs(None)
    eager = _decode(sm, prefixes[1], back, inputs).tokens  # asks for the build at K = 1, decodes eagerly
    assert back._step is None
    assert builder.for_frame(suffix, 2) is None  # a frame at K = 2 while K = 1 builds: no second build now
    assert builder.status().building == 1 and builder.status().error == ""
    assert builder.wait(300)
    st = builder.status()  # K = 2 not built, nothing building, one K kept: not refused, it builds at its next frame
    assert (st.compiled_k, st.building, st.error) == (None, None, "") and "builds at its next frame" in st.line
    assert _decode(sm, prefixes[1], back, inputs).tokens == eager and back._step.k == 1
    assert builder.state == "inductor at K=1"
    with torch.inference_mode():
        back.begin(0, 2)  # a frame at K = 2 is about to come: eager, and K = 2's build starts
    assert back._step is None and builder.state.startswith("building at K=2")
    st = builder.status()
    assert (st.compiled_k, st.building, st.error) == (None, 2, "")
    assert builder.wait(300) and builder.state == "inductor at K=2"
    assert _decode(sm, prefixes[2], back, inputs).tokens == eager and back._step.k == 2
    first = builder.for_frame(suffix, 1)
    assert _decode(sm, prefixes[1], back, inputs).tokens == eager and back._step is first  # kept, not rebuilt
    builder.MAX_SPLIT_LAYERS = 2
    with torch.inference_mode():
        back.begin(0, 3)  # a third K past the bound: eager, nothing built
    assert back._step is None and builder.wait(1) and builder.state.startswith("eager at K=3 (steps are kept for 2")
    st = builder.status()
    assert st.compiled_k is None and st.building is None and st.error.startswith("steps are kept for 2")
    builder.close()
    assert builder.status().error == "closed"


def test_a_step_that_would_compile_again_falls_back_to_the_eager_step_for_good(tmp_path):
    """After its build the graph never compiles again: a change its guards see (here the final norm's epsilon) makes
    the step raise before it touches the cache, the frame goes on eagerly in the same cache with the eager tokens,
    and the K decodes eagerly from then on, said in the state."""
    ck = open_checkpoint(write_llama(tmp_path / "llama"), tokens=PROMPT)
    sm, k = ck.split_model(), 1
    prefix, suffix, head = ck.load("prefix", k), ck.load("suffix", k), ck.load("lm_head")
    settings = DecodeSettings(max_new_tokens=6)
    bound = SuffixDecoding.bound(PROMPT, settings)
    inputs = sm.example_inputs(None)
    back = SuffixDecoding(sm, suffix, head, SideCache(sm.text_config(), bound, k), settings)
    back.compiled = builder = DecodeStepBuilder(sm, head, bound, background=False)
    _decode(sm, prefix, back, inputs)
    assert builder.state == "inductor at K=1"
    suffix.norm.variance_epsilon = 1e-2  # a guarded constant of the graph
    got = _decode(sm, prefix, back, inputs)
    eager = _decode(sm, prefix, SuffixDecoding(sm, suffix, head, SideCache(sm.text_config(), bound, k), settings),
                    inputs)
    assert got.tokens == eager.tokens and len(got.tokens) == 6
    assert builder.state.startswith("eager at K=1 (its step failed:") and "would compile again" in builder.state
    assert builder.status().compiled_k is None and "would compile again" in builder.status().error
    assert builder.for_frame(suffix, k) is None


def test_what_cannot_be_compiled_is_refused_naming_why(tmp_path):
    """A sliding window (Mistral on every block, Gemma 2 on every other; transformers' sliding static cache counts
    in Python, so the graph would be rebuilt every token), a packed LM head (oneDNN's own op), and an unknown step
    in the runner: each refused, naming why."""
    from hybrid_vla_ros.runtime.packed_linear import pack_lm_head_, packing_supported
    from hybrid_vla_ros.runtime.settings import SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    for family in ("mistral", "gemma2"):
        ck = open_checkpoint(write_text_lm(tmp_path / family, family), tokens=PROMPT)
        sm, suffix, head = ck.split_model(), ck.load("suffix", 1), ck.load("lm_head")
        assert "its blocks use sliding_attention" in compile_support(sm, suffix, head)
        with pytest.raises(ValueError, match="cannot be compiled: its blocks use sliding_attention"):
            CompiledDecodeStep(sm, suffix, head, 1, 32)
    llama = open_checkpoint(write_llama(tmp_path / "llama"), tokens=PROMPT)
    assert compile_support(llama.split_model(), llama.load("suffix", 1), llama.load("lm_head")) == ""
    lm_head = llama.load("lm_head", dtype=torch.bfloat16)
    if packing_supported()[0] and pack_lm_head_(lm_head):
        assert "packed for oneDNN" in compile_support(llama.split_model(), llama.load("suffix", 1), lm_head)
    with pytest.raises(ValueError, match="decode_step must be one of eager, inductor"):
        SuffixRunner(str(tmp_path / "llama"), SuffixRunnerSettings(1, decode_step="openvino"))
