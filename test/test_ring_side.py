"""Side tensors carried with each frame of the shared-memory ring (layout 4): typed, declared in the contract,
written into every slot after the hidden states, read back zero-copy by a consumer in another process."""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import struct
import time
import uuid

import pytest
import torch

from hybrid_vla_ros.transport import segment as sg
from hybrid_vla_ros.transport.contract import DTYPE_CODES, check_contract
from hybrid_vla_ros.transport.ring import (
    Contract,
    RingConsumer,
    RingContractError,
    RingError,
    RingProducer,
    TensorSpec,
    segment_name,
    segment_path,
    side_differences,
    slot_bytes_for,
)

CTX = mp.get_context("spawn")
WAIT_S = 60.0  # generous bound for cross-process hand-shakes; only hit if something is broken
T, V, H = 11, 5, 16
STATE = ((T, 24), torch.bfloat16)  # 528 bytes: rounded up to 576
SIDE = (TensorSpec("positions", (3, 1, T), torch.int64), TensorSpec("mask", (T,), torch.bool),
        TensorSpec("feat", (V, H), torch.float16))
N_FRAMES = 6


@pytest.fixture
def name():
    seg = segment_name("s_" + uuid.uuid4().hex[:12])
    yield seg
    for entry in os.listdir(sg.SHM_DIR):
        if entry == seg or entry.startswith(seg + ".init-"):
            os.unlink(os.path.join(sg.SHM_DIR, entry))


def _wait(evt, proc: mp.Process) -> None:
    """Wait for a helper's event; fail at once (not after WAIT_S) if the helper died instead."""
    deadline = time.monotonic() + WAIT_S
    while not evt.wait(0.2):
        if not proc.is_alive() and not evt.is_set():
            raise AssertionError(f"helper process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise AssertionError("helper process did not answer")


# ---------------------------------------------------------------- what frame ``seq`` carries

def _state(seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seq)
    return torch.randn(STATE[0], generator=g).to(STATE[1])


def _side(seq: int) -> dict[str, torch.Tensor]:
    """Frame-dependent side values: int64 positions beyond 2**32 (a 32-bit truncation would show), a mask whose
    pattern shifts with the seq, float16 features of a per-seq seed."""
    pos = torch.arange(3 * T, dtype=torch.int64).view(3, 1, T) + seq * (1 << 40) - 7 * seq
    mask = (torch.arange(T) + seq) % 3 == 0
    g = torch.Generator().manual_seed(seq)
    feat = (torch.randn((V, H), generator=g) * 100).to(torch.float16)
    return {"positions": pos, "mask": mask, "feat": feat}


def _producer(name, with_side, created, go, done):
    """Publishes N_FRAMES frames (hidden states and, ``with_side``, every side tensor) once the consumer is in."""
    side = SIDE if with_side else ()
    torch.set_num_threads(1)
    with RingProducer(name, N_FRAMES + 1, slot_bytes_for(*STATE, side), model_id=21, dtype=STATE[1],
                      state_shape=STATE[0], device="cpu", side=side) as prod:  # room for all: nothing dropped
        created.set()
        if not go.wait(WAIT_S):
            return
        for _ in range(N_FRAMES):
            slot = prod.acquire(*STATE)
            assert sorted(slot.side) == (sorted(s.name for s in SIDE) if with_side else [])
            slot.tensor.copy_(_state(slot.seq))
            for key, value in (_side(slot.seq).items() if with_side else ()):
                slot.side[key].copy_(value)
            prod.publish(slot, stamp_ns=slot.seq, split_layer=3)
        done.wait(WAIT_S)


# ---------------------------------------------------------------- between processes

@pytest.mark.parametrize("with_side", [True, False], ids=["side", "no_side"])
def test_side_tensors_cross_between_processes_exactly_for_every_frame(name, with_side):
    created, go, done = CTX.Event(), CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_producer, args=(name, with_side, created, go, done), daemon=True)
    proc.start()
    try:
        _wait(created, proc)
        expected = SIDE if with_side else ()
        with RingConsumer(name, expected_model_id=21, expected_shape=STATE[0], compute_dtype=torch.bfloat16,
                          expected_side=tuple(reversed(expected))) as cons:  # order not significant
            assert cons.contract.side == expected  # in the producer's order, as it declared them
            assert cons.contract.layout_version == sg.LAYOUT_VERSION == 9  # 7: decode; 8: turn; 9: ended copy
            old_bytes = slot_bytes_for(*STATE)
            assert old_bytes == 576  # 11 * 24 * 2 = 528 bytes, rounded up to 64
            if with_side:
                assert cons.slot_bytes == old_bytes + 320 + 64 + 192  # 264, 11 and 160 bytes, each rounded to 64
                assert cons.state_bytes == old_bytes and cons.side_offsets == (576, 896, 960)
                assert cons.contract.describe().endswith(
                    ", layout 9, side positions int64 (3, 1, 11), mask bool (11,), feat float16 (5, 16)")
            else:  # a ring without side tensors is the ring it was: same slot size, nothing after the states
                assert cons.slot_bytes == cons.state_bytes == old_bytes and cons.side_offsets == ()
                assert cons.slot_stride == sg.SLOT_HEADER_BYTES + old_bytes
                assert "side" not in cons.contract.describe()
            go.set()
            for seq in range(1, N_FRAMES + 1):
                slot = cons.read(WAIT_S)
                assert slot is not None, f"frame {seq} did not arrive"
                with slot:
                    assert slot.meta.seq == seq and slot.meta.split_layer == 3
                    assert torch.equal(slot.tensor, _state(seq)) and slot.tensor.dtype == STATE[1]
                    if not with_side:
                        assert slot.side == {}
                        continue
                    assert sorted(slot.side) == ["feat", "mask", "positions"]
                    for spec, off in zip(SIDE, cons.side_offsets):
                        got, want = slot.side[spec.name], _side(seq)[spec.name]
                        assert got.dtype == spec.dtype and tuple(got.shape) == spec.shape
                        assert torch.equal(got, want), (seq, spec.name)
                        # zero-copy, at its documented payload offset in the slot
                        assert got.data_ptr() - slot.tensor.data_ptr() == off and off % 64 == 0
            assert cons.read(0) is None
            assert cons.stats.read == N_FRAMES
    finally:
        done.set()
        proc.join(WAIT_S)


def test_a_consumer_expecting_other_side_tensors_is_refused_at_attach_naming_each_difference(name):
    created, go, done = CTX.Event(), CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_producer, args=(name, True, created, go, done), daemon=True)
    proc.start()
    try:
        _wait(created, proc)
        other = (TensorSpec("positions", (3, 1, T + 1), torch.int64),  # shape
                 TensorSpec("feat", (V, H), torch.bfloat16),  # dtype
                 TensorSpec("deepstack", (3, 4, H), torch.float16))  # missing; and mask is extra
        with pytest.raises(RingContractError) as info:
            RingConsumer(name, expected_side=other)
        words = str(info.value)
        assert words.startswith("ring contract does not fit: ")
        for sentence in ("the prefix sends side tensor positions int64 (3, 1, 11), this suffix expects (3, 1, 12)",
                         "the prefix sends side tensor feat float16 (5, 16), this suffix expects bfloat16",
                         "the prefix sends no side tensor deepstack, which this suffix needs (float16 (3, 4, 16))",
                         "the prefix sends side tensor mask bool (11,), which this suffix does not take"):
            assert sentence in words, words
        with pytest.raises(RingContractError, match=r"sends side tensor positions int64 \(3, 1, 11\), which this "
                                                    r"suffix does not take"):
            RingConsumer(name, expected_side=())  # a suffix that takes none
        # refused attempts changed nothing: the right consumer attaches and gets every frame
        with RingConsumer(name, expected_side=SIDE) as cons:
            go.set()
            for seq in range(1, N_FRAMES + 1):
                with cons.read(WAIT_S) as slot:
                    assert slot.meta.seq == seq and torch.equal(slot.side["feat"], _side(seq)["feat"])
    finally:
        done.set()
        proc.join(WAIT_S)


# ---------------------------------------------------------------- the contract, one process

def _contract(side) -> Contract:
    return Contract(5, torch.float16, "cuda", (4, 8), 4, 0, side)


def test_check_contract_and_side_differences():
    ours = SIDE
    assert side_differences(SIDE, tuple(reversed(ours))) == []
    assert check_contract(_contract(SIDE), expected_side=ours) == "none"
    assert check_contract(_contract(SIDE)) == "none"  # no expectation: anything goes
    assert check_contract(_contract(()), expected_side=()) == "none"
    cases = [
        ((TensorSpec("positions", (2, 1, T), torch.int64),) + SIDE[1:],
         ["the prefix sends side tensor positions int64 (3, 1, 11), this suffix expects (2, 1, 11)"]),
        (SIDE[:2] + (TensorSpec("feat", (V, H), torch.float32),),
         ["the prefix sends side tensor feat float16 (5, 16), this suffix expects float32"]),
        (SIDE[:2] + (TensorSpec("feat", (V, 2 * H), torch.float32),),
         ["the prefix sends side tensor feat float16 (5, 16), this suffix expects float32 (5, 32)"]),
        (SIDE + (TensorSpec("deepstack", (3, 256, 64), torch.float16),),
         ["the prefix sends no side tensor deepstack, which this suffix needs (float16 (3, 256, 64))"]),
        (SIDE[1:], ["the prefix sends side tensor positions int64 (3, 1, 11), which this suffix does not take"]),
        ((), [f"the prefix sends side tensor {s.describe()}, which this suffix does not take" for s in SIDE]),
    ]
    for expected, differences in cases:
        assert side_differences(SIDE, expected) == differences
        with pytest.raises(RingContractError) as info:
            check_contract(_contract(SIDE), expected_side=expected)
        msg = str(info.value)
        assert all(d in msg for d in differences) and msg.count("side tensor") == len(differences)
    # every problem in one message: side differences beside another model id
    with pytest.raises(RingContractError) as info:
        check_contract(_contract(SIDE), expected_model_id=6, expected_side=SIDE[:1])
    msg = str(info.value)
    assert "runs model 0000000000000005, this suffix model 0000000000000006" in msg
    assert "side tensor mask bool (11,), which this suffix does not take" in msg
    assert "side tensor feat float16 (5, 16), which this suffix does not take" in msg
    assert _contract(SIDE).describe() == ("model 0000000000000005, float16 hidden states (4, 8) from cuda in ROS "
                                          "domain 0, layout 4, side positions int64 (3, 1, 11), mask bool (11,), "
                                          "feat float16 (5, 16)")
    with pytest.raises(ValueError, match="unique"):
        side_differences(SIDE, SIDE[:1] * 2)
    with pytest.raises(ValueError, match="TensorSpec"):
        check_contract(_contract(SIDE), expected_side=("positions",))


def test_tensor_spec_validation():
    spec = TensorSpec("a" * 31, [3, 1, 902], torch.int64)
    assert spec.shape == (3, 1, 902) and spec.nbytes == 3 * 902 * 8
    assert TensorSpec("m", (7,), torch.bool).nbytes == 7 and TensorSpec("s", (), torch.float32).nbytes == 4
    assert TensorSpec("z", (0, 4), torch.float16).nbytes == 0
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool):
        TensorSpec("ok", (2,), dt)
    bad = [
        (("a" * 32, (1,), torch.int64), "name"),
        (("", (1,), torch.int64), "name"),
        (("1st", (1,), torch.int64), "name"),
        (("a-b", (1,), torch.int64), "name"),
        (("pos\u00e9", (1,), torch.int64), "name"),
        ((3, (1,), torch.int64), "name"),
        (("u", (1,), torch.uint8), "unsupported dtype"),
        (("c", (1,), torch.complex64), "unsupported dtype"),
        (("i", (1,), torch.int16), "unsupported dtype"),
        (("s", (1,), "float32"), "unsupported dtype"),
        (("n", (3, -1), torch.float16), "negative"),
        (("d", (1, 2, 3, 4, 5), torch.float16), "more than 4 dims"),
        (("f", (1.5,), torch.float16), "not a sequence of ints"),
        (("b", (True,), torch.float16), "not a sequence of ints"),
        (("x", 5, torch.float16), "not a sequence of ints"),
    ]
    for args, words in bad:
        with pytest.raises(ValueError, match=words):
            TensorSpec(*args)


def test_producer_rejects_bad_side_declarations(name):
    with pytest.raises(ValueError, match="unique"):
        RingProducer(name, 3, 4096, 0, side=(SIDE[0], SIDE[0]))
    with pytest.raises(ValueError, match="TensorSpec"):
        RingProducer(name, 3, 4096, 0, side=("positions",))
    with pytest.raises(ValueError, match="at most 32"):
        RingProducer(name, 3, 1 << 16, 0, side=tuple(TensorSpec(f"t{i}", (1,), torch.int32) for i in range(33)))
    with pytest.raises(ValueError, match=r"no room for the hidden states .* slot_bytes_for\(shape, dtype, side\)"):
        RingProducer(name, 3, 576, 0, side=SIDE)  # just the side tensors' 576 bytes
    with pytest.raises(ValueError, match=r"leaves 192 bytes for the hidden states .* slot_bytes_for\(shape, dtype"):
        RingProducer(name, 3, 768, 0, dtype=STATE[1], state_shape=STATE[0], side=SIDE)  # 528 state bytes needed
    assert not os.path.exists(segment_path(name))
    with pytest.raises(ValueError, match="unique"):
        slot_bytes_for(*STATE, (SIDE[1], SIDE[1]))
    assert slot_bytes_for((2, 3), torch.float32, ()) == slot_bytes_for((2, 3), torch.float32) == 64
    assert slot_bytes_for((2, 3), torch.float32, (TensorSpec("z", (0,), torch.int64),)) == 64


def test_global_header_side_table_layout_and_a_corrupt_table_is_refused(name):
    sb = slot_bytes_for(*STATE, SIDE)
    with RingProducer(name, 3, sb, model_id=2, side=SIDE) as prod:
        with open(segment_path(name), "rb") as f:
            head = f.read(sg.GLOBAL_HEADER_BYTES)
        assert struct.unpack_from("<I", head, 8)[0] == sg.LAYOUT_VERSION == 9
        assert struct.unpack_from("<qi", head, 360) == (0, 0)  # layout 5: no stage time announced yet
        assert struct.unpack_from("<I4xQ", head, 384) == (3, 576)
        rows = [struct.unpack_from("<32sII4qQ", head, 448 + 80 * k) for k in range(4)]
        assert rows[0] == (b"positions".ljust(32, b"\0"), DTYPE_CODES[torch.int64], 3, 3, 1, T, 0, 576)
        assert rows[1] == (b"mask".ljust(32, b"\0"), DTYPE_CODES[torch.bool], 1, T, 0, 0, 0, 896)
        assert rows[2] == (b"feat".ljust(32, b"\0"), DTYPE_CODES[torch.float16], 2, V, H, 0, 0, 960)
        assert rows[3] == (b"\0" * 32, 0, 0, 0, 0, 0, 0, 0)
        assert prod.side_offsets == (576, 896, 960) and prod.state_bytes == 576 and sb == 1152
        with pytest.raises(ValueError, match="exceeds slot capacity 576"):  # the states may not spill over
            prod.acquire((T + 2, 24), torch.bfloat16)

        fd = os.open(segment_path(name), os.O_RDWR)
        mapping = mmap.mmap(fd, sg.GLOBAL_HEADER_BYTES)
        os.close(fd)
        try:
            for offset, fmt, bad, error, words in (
                    (448 + 80 + 72, "<Q", 1024, RingError, "inconsistent global header"),  # mask moved
                    (384 + 8, "<Q", 512, RingError, "inconsistent global header"),  # state bytes
                    (384, "<I", 33, RingError, "33 side tensors"),
                    (448 + 160 + 32, "<I", DTYPE_CODES[torch.uint8], RingContractError, "dtype code 5"),
                    (448 + 160 + 36, "<I", 5, RingError, "5 dims"),
                    (448 + 160 + 40, "<q", -5, RingError, "negative"),
                    (448 + 160, "<4s", b"mask", RingError, "twice")):
                good = bytes(mapping[offset:offset + struct.calcsize(fmt)])
                struct.pack_into(fmt, mapping, offset, bad)
                with pytest.raises(error, match=words):
                    RingConsumer(name)
                mapping[offset:offset + len(good)] = good
            with RingConsumer(name) as cons:  # restored: attaches
                assert cons.contract.side == SIDE
        finally:
            mapping.close()


def test_an_unwritten_side_tensor_holds_the_stale_bytes_of_an_earlier_frame(name):
    """Publish does not check that the side tensors were written (documented): one left alone keeps what the
    slot held before; the hidden states and the written ones are this frame's."""
    side = SIDE[:2]
    with RingProducer(name, 3, slot_bytes_for(*STATE, side), model_id=1, side=side) as prod, \
            RingConsumer(name, expected_side=side) as cons:
        slot = prod.acquire(*STATE)
        slot.tensor.fill_(1.0)
        slot.side["positions"].fill_(41)
        slot.side["mask"].fill_(True)
        prod.publish(slot, stamp_ns=1, split_layer=0)
        with cons.read(0) as r:
            first = r.index
            assert bool((r.side["positions"] == 41).all()) and bool(r.side["mask"].all())
        slot = prod.acquire(*STATE)  # the slot just freed (warm in the cache): the same memory
        assert slot.index == first
        slot.tensor.fill_(2.0)
        slot.side["mask"].fill_(False)
        prod.publish(slot, stamp_ns=2, split_layer=0)
        with cons.read(0) as r:
            assert r.meta.seq == 2 and bool((r.tensor == 2.0).all()) and not bool(r.side["mask"].any())
            assert bool((r.side["positions"] == 41).all())  # stale: frame 1's
