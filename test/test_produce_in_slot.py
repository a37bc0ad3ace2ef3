"""The prefix produces its hidden states in the ring slot (no copy), exactly; non-finite ones are aborted, never
published; the CUDA device-to-host path picks page-locking, a staging buffer or a plain copy."""
from __future__ import annotations

import mmap
import multiprocessing as mp
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, init_model, load_stage
from hybrid_vla_ros.model.config import VLAConfig
from hybrid_vla_ros.runtime import prefix as prefix_module
from hybrid_vla_ros.runtime.prefix import PrefixRunner
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings
from hybrid_vla_ros.transport.pinned import CUDA_HOST_REGISTER_PORTABLE, SlotCopier
from hybrid_vla_ros.transport.ring import RingConsumer, RingProducer, segment_name
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess

CTX = mp.get_context("spawn")
WAIT_S = 60.0
#: A two-pass Qwen2 model with a query projector and the ego token: (2, T, H) crosses the split.
TWO_PASS = dict(
    llm=dict(model_type="qwen2", hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=1e6,
             tie_word_embeddings=True),
    projector={"type": "query", "num_queries": 20, "num_layers": 2, "num_heads": 2}, ego_state_input=True,
    llm_passes=2)
EGO = (8.3, -0.4, 0.05)


def _first_frame(bag):
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(bag):
        if m.topic.endswith("/image_raw/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    msgs = [first[t] for t in sorted(first)]
    return msgs[0].header.stamp.sec * 10**9 + msgs[0].header.stamp.nanosec, [("compressed", m) for m in msgs]


def _producer_process(model, ks, dtype, ns, bag, ego, conn):
    """A PrefixRunner per K publishing the bag's first frame; counts every Tensor.copy_ whose destination lies
    in the ring's mapping (a copy into the slot) and reports (K, produce_in_slot, copies) after each frame."""
    stamp, items = _first_frame(bag)
    real_copy = torch.Tensor.copy_
    region = {}

    def counting_copy(self, src, *args, **kwargs):
        lo, hi = region.get("span", (0, 0))
        if self.numel() and lo <= self.data_ptr() < hi:
            region["copies"] = region.get("copies", 0) + 1
        return real_copy(self, src, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    for k in ks:
        runner = PrefixRunner(model, PrefixRunnerSettings(k, device="cpu", dtype=dtype, namespace=ns))
        try:
            base = torch.frombuffer(runner.ring.mapping(), dtype=torch.uint8, count=1).data_ptr()
            region.update(span=(base, base + runner.ring.total_bytes), copies=0)
            conn.send("ready")
            assert conn.recv() == "go"
            runner.run(items, stamp, ego)
            conn.send((k, runner.produce_in_slot, region["copies"], runner.ring.stats))
            assert conn.recv() == "next"
        finally:
            runner.close()
    conn.send("done")


@pytest.mark.parametrize("variant, dtype", [("tiny", "fp32"), ("tiny", "bf16"), ("two_pass", "fp32")])
def test_hidden_states_are_produced_in_the_slot_bit_for_bit(tmp_path, tiny_checkpoint, embedded_bag, variant, dtype):
    """A prefix process at every K writes its output straight into the slot (no copy_ into the mapping); the
    consumer process's zero-copy view equals, bit for bit, the prefix stage's own output without ``out``."""
    if variant == "tiny":
        model = tiny_checkpoint
    else:
        model = tmp_path / variant
        init_model("tiny", model, overrides=TWO_PASS)
    cfg = VLAConfig.load(model)
    ego = EGO if cfg.ego_state_input else None
    stamp, items = _first_frame(embedded_bag)
    d = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    pixels = preprocess([compressed_msg_to_rgb(m) for _, m in items], cfg.image_size, cfg.image_mean, cfg.image_std)
    ns = f"/pis_{uuid.uuid4().hex[:6]}"
    ks = list(range(cfg.num_layers + 1))
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=_producer_process, args=(str(model), ks, dtype, ns, str(embedded_bag), ego, child),
                       daemon=True)
    proc.start()
    try:
        for k in ks:
            assert conn.poll(WAIT_S * 2) and conn.recv() == "ready"
            with torch.inference_mode():
                ego_t = None if ego is None else torch.tensor(ego)
                expected = load_stage(model, "prefix", k, dtype=dtype)(pixels.to(d), ego_t)
            with RingConsumer(segment_name("prefix_states", ns), compute_dtype=d,
                              expected_shape=cfg.prefix_state_shape) as cons:
                conn.send("go")
                assert conn.poll(WAIT_S)
                got_k, in_slot, copies, stats = conn.recv()
                with cons.read(WAIT_S) as slot:
                    assert got_k == k and slot.meta.split_layer == k and slot.meta.stamp_ns == stamp
                    assert in_slot and copies == 0, f"K={k}: {copies} copies into the slot"
                    assert slot.tensor.dtype == d and torch.equal(slot.tensor, expected), f"K={k} differs"
                    assert slot.meta.t_publish_ns - slot.meta.t_write_start_ns >= 0
                assert stats.published == 1 and stats.aborted == 0
            conn.send("next")
        assert conn.poll(WAIT_S) and conn.recv() == "done"
    finally:
        proc.join(WAIT_S)


def _poisoned(tmp_path, checkpoint, prefix: str):
    out = tmp_path / f"nan_{prefix.strip('.').replace('.', '_')}"
    out.mkdir()
    (out / "config.json").write_text((checkpoint / "config.json").read_text())
    state = load_file(str(checkpoint / WEIGHTS_FILE))
    state = {k: torch.full_like(v, float("nan")) if k.startswith(prefix) else v for k, v in state.items()}
    save_file(state, str(out / WEIGHTS_FILE))
    return out


@pytest.mark.parametrize("k, poison", [(0, "embed_tokens."), (2, "layers.1.mlp.")])
def test_non_finite_hidden_states_produced_in_the_slot_are_aborted_not_published(tmp_path, tiny_checkpoint,
                                                                                 embedded_bag, k, poison):
    stamp, items = _first_frame(embedded_bag)
    ns = f"/pis_{uuid.uuid4().hex[:6]}"
    runner = PrefixRunner(str(_poisoned(tmp_path, tiny_checkpoint, poison)),
                          PrefixRunnerSettings(k, device="cpu", namespace=ns))
    try:
        assert runner.produce_in_slot
        with RingConsumer(runner.ring.name) as cons:
            for _ in range(2):
                with pytest.raises(FloatingPointError, match="non-finite hidden states"):
                    runner.run(items, stamp)
            assert runner.ring.stats.published == 0 and runner.ring.stats.aborted == 2
            assert set(cons.slot_states()) == {"FREE"} and cons.read(0) is None
    finally:
        runner.close()


def test_without_an_exact_output_path_the_prefix_copies(monkeypatch, tiny_checkpoint, embedded_bag):
    """If the installed transformers' decoder block no longer matches the in-slot replica, the prefix falls
    back to computing into its own tensor and copying it into the slot: still exact."""
    monkeypatch.setattr(prefix_module, "output_into_is_exact", lambda stage: False)
    stamp, items = _first_frame(embedded_bag)
    ns = f"/pis_{uuid.uuid4().hex[:6]}"
    runner = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", namespace=ns))
    try:
        assert not runner.produce_in_slot
        with RingConsumer(runner.ring.name) as cons:
            runner.run(items, stamp)
            cfg = runner.cfg
            pixels = preprocess([compressed_msg_to_rgb(m) for _, m in items], cfg.image_size, cfg.image_mean,
                                cfg.image_std)
            with torch.inference_mode(), cons.read(WAIT_S) as slot:
                assert torch.equal(slot.tensor, load_stage(tiny_checkpoint, "prefix", 2)(pixels))
    finally:
        runner.close()


# ------------------------------------------------------------------------------------- CUDA path selection

class FakeCudart:
    """Stands in for torch.cuda.cudart(): records calls, answers with a given cudaError code (or raises)."""

    def __init__(self, code=0, raises=None):
        self.code, self.raises, self.calls = code, raises, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        if self.raises:
            raise self.raises
        return self.code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def producer():
    with RingProducer(segment_name("pin_" + uuid.uuid4().hex[:8]), 3, 4096 * 3 + 64, model_id=1) as prod:
        yield prod


def _roundtrip(copier, prod):
    src = torch.randn(7, 33)
    slot = prod.acquire((7, 33), torch.float32)
    copier.copy(src, slot.tensor)
    assert torch.equal(slot.tensor, src)
    prod.abort(slot)


def test_slot_copier_registers_the_whole_mapping_page_locked(producer):
    cudart = FakeCudart(0)
    copier = SlotCopier(producer, "cuda", cudart=cudart)
    assert copier.mode == "registered" and copier.reason == ""
    (_, ptr, size, flags), = cudart.calls
    base = torch.frombuffer(producer.mapping(), dtype=torch.uint8, count=1).data_ptr()
    assert ptr == base and ptr % mmap.PAGESIZE == 0 and flags == CUDA_HOST_REGISTER_PORTABLE
    assert size % mmap.PAGESIZE == 0 and producer.total_bytes <= size < producer.total_bytes + mmap.PAGESIZE
    _roundtrip(copier, producer)
    copier.close()
    copier.close()
    assert cudart.calls[1:] == [("unregister", ptr)]


@pytest.mark.parametrize("cudart, why", [(FakeCudart(712), "returned error 712"),
                                        (FakeCudart(raises=RuntimeError("no driver")), "raised RuntimeError"),
                                        (None, "no CUDA runtime binding")])
def test_slot_copier_falls_back_to_a_pinned_staging_buffer(producer, cudart, why):
    staged = []

    def fake_pinned(nbytes):
        staged.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    copier = SlotCopier(producer, torch.device("cuda", 0), cudart=cudart, pinned_alloc=fake_pinned)
    assert copier.mode == "staging" and why in copier.reason and staged == [producer.slot_bytes]
    _roundtrip(copier, producer)
    copier.close()
    assert not [c for c in (cudart.calls if cudart else []) if c[0] == "unregister"]


def test_slot_copier_falls_back_to_a_plain_copy(producer):
    def no_pinning(nbytes):
        raise RuntimeError("cannot pin memory")

    copier = SlotCopier(producer, "cuda", cudart=FakeCudart(2), pinned_alloc=no_pinning)
    assert copier.mode == "pageable" and "no pinned staging buffer either (cannot pin memory)" in copier.reason
    _roundtrip(copier, producer)
    cpu = SlotCopier(producer, "cpu", cudart=FakeCudart(0))
    assert cpu.mode == "pageable" and "on cpu" in cpu.reason
    _roundtrip(cpu, producer)


class StickyCudart(FakeCudart):
    """A runtime binding whose failed call leaves its error pending for the thread until ``cudaGetLastError``
    reads and resets it, as the CUDA runtime does; the next CUDA call (here: the staging buffer's pinned
    allocation) then fails with that error."""

    def __init__(self, code):
        super().__init__(code)
        self.pending = 0

    def cudaHostRegister(self, ptr, size, flags):
        err = super().cudaHostRegister(ptr, size, flags)
        self.pending = err
        return err

    def cudaGetLastError(self):
        self.calls.append(("get_last_error",))
        err, self.pending = self.pending, 0
        return err

    def pinned(self, nbytes):
        if self.pending:
            raise RuntimeError(f"CUDA error: {self.pending} (raised by an unrelated call)")
        return torch.empty(nbytes, dtype=torch.uint8)


def test_a_refused_registration_leaves_no_cuda_error_pending(producer):
    """Issue 24.6: after cudaHostRegister is refused, the copier reads (and so clears) the runtime's last error,
    so the staging fallback's pinned allocation, the next CUDA call, does not fail with the registration's
    error; the fallback then works."""
    cudart = StickyCudart(712)
    copier = SlotCopier(producer, "cuda", cudart=cudart, pinned_alloc=cudart.pinned)
    assert [c[0] for c in cudart.calls] == ["register", "get_last_error"] and cudart.pending == 0
    assert copier.mode == "staging" and "returned error 712" in copier.reason, copier.reason
    _roundtrip(copier, producer)
    copier.close()
