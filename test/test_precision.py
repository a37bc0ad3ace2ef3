"""The precision a CPU suffix computes in (``inference_precision``): the CPU's units read from /proc/cpuinfo text as
three host classes write it, the rule per dtype, and a suffix runner that widens a bf16 checkpoint on a CPU without
bf16 units computing exactly what an fp32 suffix computes on the same weights, closer to float64 than bf16 is."""
from __future__ import annotations

import uuid

import pytest
import torch

from hybrid_vla_ros.model.checkpoint import load_stage
from hybrid_vla_ros.runtime.prefix import PrefixRunner
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
from hybrid_vla_ros.runtime.suffix import SuffixRunner
from hybrid_vla_ros.util.precision import CpuFeatures, inference_precision

# the first processor's lines as each kernel prints them (flags shortened to the ones that matter plus neighbours)
AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
AVX2 = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 fma avx f16c avx2 bmi2
"""
AVX512 = """processor\t: 0
model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz
flags\t\t: fpu sse2 avx2 fma avx512f avx512dq avx512_vnni
"""
ARM_BF16 = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes crc32 atomics fphp asimdhp asimddp sve bf16 i8mm
CPU implementer\t: 0x41
"""
ARM_PLAIN = """processor\t: 0
Features\t: fp asimd evtstrm crc32
"""


def _cpu(tmp_path, text: str) -> CpuFeatures:
    path = tmp_path / f"cpuinfo_{uuid.uuid4().hex[:6]}"
    path.write_text(text)
    return CpuFeatures.read(path)


@pytest.mark.parametrize("text, level, bf16, fp16", [
    (AMX, "AMX", torch.bfloat16, torch.float16),
    (AVX512, "AVX-512", torch.float32, torch.float32),
    (AVX2, "AVX2", torch.float32, torch.float32),
    (ARM_BF16, "NEON", torch.bfloat16, torch.float16),
    (ARM_PLAIN, "NEON", torch.float32, torch.float32),
    ("", "baseline", torch.float32, torch.float32),
])
def test_each_host_class_computes_a_reduced_dtype_only_with_native_units(tmp_path, text, level, bf16, fp16):
    cpu = _cpu(tmp_path, text)
    assert cpu.isa_level == level
    assert inference_precision(torch.bfloat16, "auto", cpu).dtype == bf16
    assert inference_precision(torch.float16, "auto", cpu).dtype == fp16
    assert inference_precision(torch.float32, "auto", cpu).dtype == torch.float32
    for asked in (torch.bfloat16, torch.float16):  # 'dtype' keeps it, and says when it is emulated
        kept = inference_precision(asked, "dtype", cpu)
        widened = inference_precision(asked, "auto", cpu).widened
        assert kept.dtype == asked and kept.emulated == widened and not kept.widened
        if widened:
            assert "emulated" in kept.reason and level in kept.reason


def test_the_reason_names_the_unit_or_what_is_missing(tmp_path):
    amx, avx2 = _cpu(tmp_path, AMX), _cpu(tmp_path, AVX2)
    assert amx.model.startswith("Intel(R) Xeon(R) Platinum") and avx2.model == "AMD EPYC"
    assert "amx_bf16" in inference_precision(torch.bfloat16, cpu=amx).reason
    p = inference_precision(torch.bfloat16, cpu=avx2)
    assert p.widened and p.name == "fp32" and not p.emulated
    assert "AVX2" in p.reason and "(amx_bf16 / avx512_bf16)" in p.reason and "2x" in p.reason
    arm = _cpu(tmp_path, ARM_PLAIN)
    assert arm.arch == "arm" and "(bf16)" in inference_precision(torch.bfloat16, cpu=arm).reason
    # an x86 CPU listing an Arm feature name is not taken for an Arm CPU with bf16
    odd = _cpu(tmp_path, AVX2.replace("bmi2", "bmi2 bf16 asimdhp"))
    assert odd.arch == "x86" and inference_precision(torch.bfloat16, cpu=odd).widened
    garbled = tmp_path / "garbled"
    garbled.write_bytes(b"model name\t: \xff\xfe\nflags\t: avx2 amx_bf16\n")
    assert CpuFeatures.read(garbled).native_flag(torch.bfloat16) == "amx_bf16"
    assert amx.reported_flags[:2] == ["amx_bf16", "amx_int8"] and "avx2" in avx2.reported_flags
    assert CpuFeatures.read(tmp_path / "missing").flags == frozenset()


def test_bad_modes_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="inference_precision must be one of auto, dtype"):
        inference_precision(torch.bfloat16, "fast")
    with pytest.raises(ValueError, match="float64"):
        inference_precision(torch.float64)


def test_a_widened_bf16_suffix_computes_what_an_fp32_suffix_computes_and_is_closer_to_float64(tmp_path,
                                                                                              tiny_checkpoint,
                                                                                              frames):
    """A bf16 prefix through the real ring to three suffixes of the same bf16-valued weights: ``auto`` on an AVX2
    CPU (widened), ``dtype`` fp32 and ``dtype`` bf16. The widened one equals the fp32 one bit for bit (weights
    widened exactly, the ring's bf16 converted exactly) and is nearer a float64 computation of the same blocks
    than bf16 arithmetic is; on an AMX CPU ``auto`` keeps bf16."""
    k = 2
    avx2, amx = _cpu(tmp_path, AVX2), _cpu(tmp_path, AMX)
    ns = f"/pr_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(k, device="cpu", dtype="bf16", namespace=ns))
    suffixes = {
        "auto_avx2": SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(k, dtype="bf16", namespace=ns,
                                                                             delivery="fifo"), cpu=avx2),
        "fp32": SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(k, dtype="fp32", namespace=ns,
                                                                        delivery="fifo")),
    }
    try:
        assert suffixes["auto_avx2"].precision.widened and suffixes["auto_avx2"].dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in suffixes["auto_avx2"].stage.parameters())
        kept = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(k, dtype="bf16", namespace=f"{ns}_x"), cpu=amx)
        try:
            assert not kept.precision.widened and kept.stage.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
        finally:
            kept.close()
        hidden = {}
        for name, runner in suffixes.items():  # one consumer at a time holds the ring
            runner.poll(0)
            stamp, items = frames[0]
            prefix.run(items, stamp + len(hidden))
            r = runner.poll(60.0)
            assert r is not None and runner.ring.conversion == "exact", name
            hidden[name] = r.waypoints
            runner.close()
        assert (hidden["auto_avx2"] == hidden["fp32"]).all()
    finally:
        for runner in suffixes.values():
            runner.close()
        prefix.close()
    # the blocks [K, L) on one bf16 hidden state: float64, fp32 (= the widened suffix) and bf16 arithmetic
    stage = load_stage(tiny_checkpoint, "suffix", k, dtype="bf16")
    h = torch.randn(stage.cfg.prefix_state_shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        out = {dt: stage.to(dt).final_hidden_states(h.to(dt)).double() for dt in (torch.bfloat16, torch.float32,
                                                                                   torch.float64)}
    ref = out[torch.float64]
    err32, err16 = ((out[dt] - ref).norm() / ref.norm() for dt in (torch.float32, torch.bfloat16))
    assert err32 < err16 / 100, (float(err32), float(err16))


def test_a_pair_refused_elsewhere_is_refused_on_a_cpu_that_widens(tmp_path, tiny_checkpoint, frames):
    """An fp32 prefix and an fp16 suffix: refused at attach on a CPU with fp16 units (fp32 -> fp16 could overflow),
    so also on an AVX2 CPU where the suffix would compute in fp32 and could take the ring exactly: a launch file must
    not pass on the development machine and fail on the car. An fp16 suffix beside an fp16 prefix is taken."""
    avx2 = _cpu(tmp_path, AVX2)
    for prefix_dtype, refused in (("fp32", True), ("fp16", False)):
        ns = f"/pp_{uuid.uuid4().hex[:6]}"
        prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", dtype=prefix_dtype,
                                                                         namespace=ns))
        suffix = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, dtype="fp16", namespace=ns,
                                                                         delivery="fifo"), cpu=avx2)
        try:
            assert suffix.precision.widened
            assert suffix.poll(0.05) is None
            if refused:
                assert not suffix.attached and suffix.attach_failure == "contract"
                assert "sends float32 hidden states and this suffix computes in float16" in suffix.contract_error
                assert "refused on every CPU" in suffix.contract_error
            else:
                stamp, items = frames[0]
                prefix.run(items, stamp)
                r = suffix.poll(60.0)
                assert r is not None and suffix.ring.conversion == "exact" and suffix.contract_error == ""
        finally:
            suffix.close()
            prefix.close()
