"""Tests of the shared-memory hand-off (hybrid_vla_ros.transport.ring) with real separate processes."""
from __future__ import annotations

import math
import mmap
import multiprocessing as mp
import os
import queue
import signal
import stat
import struct
import time
import uuid

import pytest
import torch

from hybrid_vla_ros.transport import ring as sr
from hybrid_vla_ros.transport import segment as sg
from hybrid_vla_ros.transport.layout import GLOBAL, SLOT
from hybrid_vla_ros.transport import slots as sl
from hybrid_vla_ros.transport.ring import (
    NO_TIMINGS,
    FrameMeta,
    RingConsumer,
    RingError,
    RingNameConflict,
    RingProducer,
    SlotRejected,
    SlotTimings,
    segment_name,
    segment_path,
    slot_bytes_for,
)

CTX = mp.get_context("spawn")
WAIT_S = 60.0  # generous bound for cross-process hand-shakes; only hit if something is broken
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture
def name():
    seg = segment_name("t_" + uuid.uuid4().hex[:12])
    yield seg
    for entry in os.listdir(sg.SHM_DIR):
        if entry == seg or entry.startswith(seg + ".init-"):
            os.unlink(os.path.join(sg.SHM_DIR, entry))


class _Children:
    """Spawned helper processes, killed at the end of the test whatever happens."""

    def __init__(self):
        self.procs = []

    def start(self, target, *args) -> mp.Process:
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def kill_all(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(WAIT_S)


@pytest.fixture
def children():
    c = _Children()
    yield c
    c.kill_all()


def _frame(seed: int, shape, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _wait(evt, proc: mp.Process | None = None) -> None:
    """Wait for a helper's event; fail at once (not after WAIT_S) if the helper ``proc`` died instead."""
    deadline = time.monotonic() + WAIT_S
    while not evt.wait(0.2 if proc is not None else WAIT_S):
        if proc is None or time.monotonic() > deadline:
            raise AssertionError("helper process did not answer")
        if not proc.is_alive() and not evt.is_set():
            raise AssertionError(f"helper process exited with code {proc.exitcode}")


def _get(q, proc: mp.Process):
    """Get a helper's result; fail at once if the helper died without sending it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                try:
                    return q.get(timeout=1.0)  # sent just before exiting
                except queue.Empty:
                    raise AssertionError(f"helper process exited with code {proc.exitcode}") from None
            assert time.monotonic() < deadline, "helper process did not answer"


# ---------------------------------------------------------------- helper processes (top level for spawn)

def _roundtrip_producer(name, frames, created, go, done):
    """Publishes ``frames`` = [(seed, shape, dtype name, stamp, split, timings)] once the consumer is attached."""
    cap = max(slot_bytes_for(shape, DTYPES[d]) for _, shape, d, *_ in frames)
    with RingProducer(name, len(frames) + 1, cap, model_id=42) as prod:  # room for all: nothing dropped
        created.set()
        _wait(go)
        for seed, shape, d, stamp, split, timings in frames:
            slot = prod.acquire(shape, DTYPES[d])
            slot.tensor.copy_(_frame(seed, shape, DTYPES[d]))
            prod.publish(slot, stamp_ns=stamp, split_layer=split, timings=timings)
        _wait(done)


def _drop_producer(name, n_slots, n_frames, created, go, step2, stats_q, done):
    """Publishes frame 1, then (while the consumer holds it) frames 2..n_frames, and reports its stats."""
    with RingProducer(name, n_slots, slot_bytes_for((256,), torch.float32), model_id=1) as prod:
        created.set()
        _wait(go)
        for seq in range(1, n_frames + 1):
            if seq == 2:
                _wait(step2)
            slot = prod.acquire((256,), torch.float32)
            assert slot.seq == seq
            slot.tensor.fill_(seq)
            prod.publish(slot, stamp_ns=seq, split_layer=0)
        stats_q.put(prod.stats)
        _wait(done)


def _torn_writer(name, n_frames, numel, created, go, stats_q):
    """Fills every frame with its seq value, as fast as it can."""
    torch.set_num_threads(1)  # two processes on two cores: no OpenMP oversubscription
    with RingProducer(name, 4, slot_bytes_for((numel,), torch.float32), model_id=3) as prod:
        created.set()
        _wait(go)
        for _ in range(n_frames):
            slot = prod.acquire((numel,), torch.float32)
            slot.tensor.fill_(float(slot.seq))
            prod.publish(slot, stamp_ns=slot.seq, split_layer=5)
        stats_q.put(prod.stats)  # the reader keeps its mapping: unlinking at exit loses no READY frame


def _torn_reader(name, n_frames, attached, result_q):
    """Reads until seq == n_frames; checks every element equals meta.seq when taken and before release."""
    torch.set_num_threads(1)
    reads, bad, out_of_order, last = 0, 0, 0, 0
    with RingConsumer(name, expected_model_id=3, expected_split_layer=5) as cons:
        attached.set()
        while last < n_frames:
            slot = cons.read(WAIT_S)
            if slot is None:
                break
            with slot:
                seq = slot.meta.seq
                if not bool((slot.tensor == float(seq)).all()):
                    bad += 1
                if seq <= last:
                    out_of_order += 1
                last = seq
                reads += 1
                for _ in range(3):  # hold it a while, like a model would: the producer must not touch it
                    if not bool((slot.tensor == float(seq)).all()):
                        bad += 1
        result_q.put({"reads": reads, "bad": bad, "out_of_order": out_of_order, "last": last,
                      "stats": cons.stats})


def _idle_producer(name, created, stop):
    """Owns the segment until ``stop`` is set (or it is killed)."""
    prod = RingProducer(name, 3, 4096, model_id=9)
    slot = prod.acquire((4,), torch.float32)
    slot.tensor.fill_(1.0)
    prod.publish(slot, stamp_ns=1, split_layer=0)
    created.set()
    stop.wait(WAIT_S)
    prod.close()


def _reading_consumer(name, read_done, result_q, crash):
    """Attaches, reads one frame; then exits normally without closing or releasing, or is SIGKILLed."""
    cons = RingConsumer(name)
    slot = cons.read(WAIT_S)
    result_q.put(None if slot is None else slot.meta.seq)
    read_done.set()
    if crash:
        time.sleep(WAIT_S)  # stays READING until the parent kills it


# ---------------------------------------------------------------- pure functions

def test_segment_name_format_and_rejections(monkeypatch):
    uid = os.getuid()
    assert segment_name("hidden", "/", 0) == f"hybrid_vla.{uid}.d0.-.hidden"
    assert segment_name("hidden", "/car1/front/", 7) == f"hybrid_vla.{uid}.d7.-car1-front.hidden"
    assert segment_name("hidden", "car1", 232) == f"hybrid_vla.{uid}.d232.-car1.hidden"
    assert segment_name("h", "/a_b") != segment_name("h", "/a/b")
    # the ROS domain scopes the ring: the same namespace in two domains never shares one
    assert segment_name("h", "/car", 77) != segment_name("h", "/car", 78)
    # no domain given: ROS_DOMAIN_ID, as rcl reads it (unset or empty: 0)
    monkeypatch.setenv("ROS_DOMAIN_ID", "42")
    assert segment_name("h", "/car") == segment_name("h", "/car", 42)
    for unset in ("", " "):
        monkeypatch.setenv("ROS_DOMAIN_ID", unset)
        assert segment_name("h", "/car") == segment_name("h", "/car", 0)
    monkeypatch.delenv("ROS_DOMAIN_ID")
    assert segment_name("h", "/car") == segment_name("h", "/car", 0)
    for bad_env in ("x", "-1", "1.5", "233"):
        monkeypatch.setenv("ROS_DOMAIN_ID", bad_env)
        with pytest.raises(ValueError, match="ROS_DOMAIN_ID"):
            segment_name("h", "/car")
    for bad_domain in (-1, 233, 1.0, True, "3"):
        with pytest.raises(ValueError, match="domain"):
            segment_name("h", "/car", bad_domain)
    for bad in ("a/b", "", "..", "a b", "x\0", "ü", "a.b"):
        with pytest.raises(ValueError):
            segment_name(bad)
    for bad_ns in ("/a//b", "/a.b", "/a-b", "/a b"):
        with pytest.raises(ValueError):
            segment_name("x", bad_ns)
    with pytest.raises(ValueError):
        segment_name("x" * 100)
    for bad in ("../etc", "a/b", ".hidden", "x" * 101):
        with pytest.raises(ValueError):
            segment_path(bad)


def test_slot_bytes_for():
    assert slot_bytes_for((2, 3), torch.float32) == 64
    assert slot_bytes_for((513, 4096), torch.bfloat16) == 513 * 4096 * 2
    assert slot_bytes_for((1, 5, 7), torch.float16) % 64 == 0
    with pytest.raises(ValueError):
        slot_bytes_for((1, 2, 3, 4, 5), torch.float32)
    with pytest.raises(ValueError):
        slot_bytes_for((-1, 2), torch.float32)
    with pytest.raises(TypeError):
        slot_bytes_for((2,), torch.complex64)


#: The slot header as docs/design.md and earlier releases state it (slot version 3): field -> (offset, struct code).
DOCUMENTED_SLOT = {
    "magic": (0, "I"), "version": (4, "H"), "state": (6, "H"), "seq": (8, "Q"), "stamp_ns": (16, "q"),
    "t_write_start_ns": (24, "q"), "t_publish_ns": (32, "q"), "payload_nbytes": (40, "Q"), "model_id": (48, "q"),
    "split_layer": (56, "i"), "dtype": (60, "I"), "ndim": (64, "I"), "shape": (72, "4q"), "preprocess_ms": (104, "d"),
    "prefix_ms": (112, "d"), "prefix_start_ns": (120, "q"), "ego_wait_ms": (128, "d"),
}


def test_header_layout_matches_documented_offsets():
    for name, (offset, code) in DOCUMENTED_SLOT.items():
        assert SLOT.offset_of(name) == offset, name
        assert next(f.code for g in SLOT.groups.values() for f in g.fields if f.name == name) == code, name
    assert sl.SLOT_VERSION == 3 and SLOT.body.offset + SLOT.body.size == 136 <= sg.SLOT_HEADER_BYTES
    assert (sg.GLOBAL_HEADER_BYTES + sg.SLOT_HEADER_BYTES) % sg.PAYLOAD_ALIGN == 0
    # the global header's fields the producer and consumer share while the ring runs (layouts 2-6)
    assert [GLOBAL.offset_of(n) for n in ("publish_count", "last_publish_ns", "producer_state", "producer_cycle_ns",
                                          "last_take_ns", "next_read_ns", "consumer_pid", "consumer_state",
                                          "stage_ns", "stage_k", "frame_age_limit_ns", "side_count")] == \
        [256, 264, 272, 280, 320, 328, 336, 352, 360, 368, 376, 384]


# ---------------------------------------------------------------- between processes

def test_round_trip_values_and_meta_between_processes(name, children):
    frames = [
        # an instant no float of ms holds exactly (1.7e18 ns): it arrives to the ns
        (1, (1, 37, 64), "bf16", 1_000_000_001, 12, SlotTimings(1.5, 2.25, 1_700_000_000_123_456_789, 17.5)),
        (2, (5, 16), "fp16", 2, 12, NO_TIMINGS),  # a producer that sent none
        (3, (2, 3, 4, 5), "fp32", -7, 13, SlotTimings(0.0, 1e300, (1 << 63) - 1)),
        (4, (), "fp32", 4, 12, SlotTimings(prefix_ms=0.125)),  # some sent, the others NaN / 0
    ]
    created, go, done = CTX.Event(), CTX.Event(), CTX.Event()
    proc = children.start(_roundtrip_producer, name, frames, created, go, done)
    _wait(created, proc)
    with RingConsumer(name, expected_model_id=42) as cons:
        go.set()  # the consumer now waits inside read(): each frame arrives through the wake socket
        for k, (seed, shape, d, stamp, split, timings) in enumerate(frames, start=1):
            with cons.read(WAIT_S) as slot:
                now = time.monotonic_ns()
                m = slot.meta
                assert isinstance(m, FrameMeta)
                assert (m.seq, m.stamp_ns, m.shape, m.dtype, m.split_layer, m.model_id, m.timings) == (
                    k, stamp, shape, DTYPES[d], split, 42, timings)
                t = m.timings
                assert isinstance(t, SlotTimings) and type(t.prefix_start_ns) is int
                for field in ("preprocess_ms", "prefix_ms"):  # each sent value exactly, each one not sent NaN
                    sent, got = getattr(timings, field), getattr(t, field)
                    assert got == sent or (math.isnan(got) and math.isnan(sent)), (field, got, sent)
                assert t.prefix_start_ns == timings.prefix_start_ns
                assert m.t_write_start_ns <= m.t_publish_ns <= now
                assert slot.tensor.shape == shape and slot.tensor.dtype == DTYPES[d]
                assert torch.equal(slot.tensor, _frame(seed, shape, DTYPES[d]))
        assert cons.read(0) is None
        assert cons.stats.read == len(frames)
    done.set()


def test_drop_oldest_when_consumer_is_slow(name, children):
    n_slots, n_frames = 4, 50
    created, go, step2, done = CTX.Event(), CTX.Event(), CTX.Event(), CTX.Event()
    stats_q = CTX.Queue()
    proc = children.start(_drop_producer, name, n_slots, n_frames, created, go, step2, stats_q, done)
    _wait(created, proc)
    with RingConsumer(name) as cons:
        go.set()
        held = cons.read(WAIT_S)  # frame 1, kept READING while the producer publishes 2..50
        assert held.meta.seq == 1
        step2.set()
        stats = _get(stats_q, proc)
        assert stats.published == n_frames
        # three slots cycle while one is READING: frames 2..47 were overwritten, 48..50 are READY
        assert stats.dropped_oldest == n_frames - 1 - (n_slots - 1)
        assert bool((held.tensor == 1.0).all()), "a READING slot was overwritten"
        assert sorted(cons.slot_states()) == ["READING", "READY", "READY", "READY"]
        held.release()
        got = []
        while (slot := cons.read(0)) is not None:
            with slot:
                assert bool((slot.tensor == float(slot.meta.seq)).all())
                got.append(slot.meta.seq)
        assert got == [48, 49, 50]
        assert cons.stats.read + stats.dropped_oldest == n_frames
    done.set()


def test_no_torn_reads_concurrent_writer_and_reader_processes(name, children):
    n_frames, numel = 20000, 65536
    created, attached, go = CTX.Event(), CTX.Event(), CTX.Event()
    stats_q, result_q = CTX.Queue(), CTX.Queue()
    writer = children.start(_torn_writer, name, n_frames, numel, created, go, stats_q)
    _wait(created, writer)
    reader = children.start(_torn_reader, name, n_frames, attached, result_q)
    _wait(attached, reader)
    go.set()
    stats = _get(stats_q, writer)
    result = _get(result_q, reader)
    print(stats, result)
    assert result["bad"] == 0 and result["out_of_order"] == 0
    assert result["last"] == n_frames
    assert stats.published == n_frames
    assert result["reads"] + stats.dropped_oldest == n_frames
    assert result["reads"] > 1 and result["stats"].read == result["reads"]


def test_stale_segment_of_sigkilled_producer_is_replaced(name, children):
    created, stop = CTX.Event(), CTX.Event()
    proc = children.start(_idle_producer, name, created, stop)
    _wait(created, proc)
    old_cons = RingConsumer(name)
    old_ino = os.stat(segment_path(name)).st_ino
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(WAIT_S)
    assert os.path.exists(segment_path(name)), "a killed producer cannot clean up"
    assert not old_cons.owner_alive
    assert not old_cons.producer_gone
    with RingProducer(name, 3, 4096, model_id=10) as prod:
        assert os.stat(segment_path(name)).st_ino != old_ino
        assert old_cons.producer_gone  # the name now points at another segment
        old_cons.close()
        with RingConsumer(name, expected_model_id=10) as cons:
            assert cons.owner_alive and cons.read(0) is None  # the dead producer's frame is gone
            slot = prod.acquire((4,), torch.float32)
            slot.tensor.fill_(2.0)
            prod.publish(slot, stamp_ns=0, split_layer=0)
            with cons.read(WAIT_S) as r:
                assert r.meta.model_id == 10 and r.meta.seq == 1 and bool((r.tensor == 2.0).all())


def test_live_owner_gives_name_conflict(name, children):
    created, stop = CTX.Event(), CTX.Event()
    proc = children.start(_idle_producer, name, created, stop)
    _wait(created, proc)
    ino = os.stat(segment_path(name)).st_ino
    with pytest.raises(RingNameConflict):
        RingProducer(name, 3, 4096, model_id=1)
    assert os.stat(segment_path(name)).st_ino == ino, "the live owner's segment must stay"
    with RingConsumer(name) as cons:  # and it is still fully usable
        with cons.read(WAIT_S) as r:
            assert r.meta.model_id == 9
    stop.set()
    proc.join(WAIT_S)
    assert proc.exitcode == 0
    assert not os.path.exists(segment_path(name))
    with RingProducer(name, 3, 4096, model_id=1):
        pass


@pytest.mark.parametrize("crash", [False, True], ids=["exit", "sigkill"])
def test_consumer_process_exit_keeps_segment_and_frees_reading_slot(name, children, crash):
    with RingProducer(name, 3, 4096, model_id=1) as prod:
        for v in (1.0, 2.0):
            slot = prod.acquire((8,), torch.float32)
            slot.tensor.fill_(v)
            prod.publish(slot, stamp_ns=0, split_layer=0)
        read_done, result_q = CTX.Event(), CTX.Queue()
        proc = children.start(_reading_consumer, name, read_done, result_q, crash)
        _wait(read_done, proc)
        assert _get(result_q, proc) == 1
        if crash:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(WAIT_S)
        assert prod.slot_states().count("READING") == 1  # left behind either way: nobody released it
        assert os.path.exists(segment_path(name)), "an exiting consumer must not unlink the segment"
        with RingConsumer(name) as cons:  # the predecessor is gone: its wake socket and READING slot are free
            assert "READING" not in cons.slot_states()
            assert cons.stats.reclaimed_reading == 1
            with cons.read(0) as r:
                assert r.meta.seq == 2 and bool((r.tensor == 2.0).all())
            assert cons.read(0) is None
            for _ in range(3):  # all three slots are usable again: three frames fit without a drop
                slot = prod.acquire((8,), torch.float32)
                prod.publish(slot, stamp_ns=0, split_layer=0)
            assert prod.stats.dropped_oldest == 0
            for seq in (3, 4, 5):
                with cons.read(0) as r:
                    assert r.meta.seq == seq


# ---------------------------------------------------------------- one process (header surgery, API rules)

def _publish(prod, value=1.0, shape=(4, 8), dtype=torch.float32, split=0, stamp=0):
    slot = prod.acquire(shape, dtype)
    slot.tensor.fill_(value)
    prod.publish(slot, stamp_ns=stamp, split_layer=split)
    return slot.index


def _patch(mapping, prod, index, field, fmt, *values):
    struct.pack_into("<" + fmt, mapping, sg.GLOBAL_HEADER_BYTES + index * prod.slot_stride
                     + SLOT.offset_of(field), *values)


def test_header_validation_rejects_each_cause_then_reads_next_good_frame(name):
    cap = slot_bytes_for((4, 8), torch.float32)
    with RingProducer(name, 4, cap, model_id=5) as prod, \
            RingConsumer(name, expected_model_id=5, expected_split_layer=2) as cons:
        fd = os.open(segment_path(name), os.O_RDWR)
        mapping = mmap.mmap(fd, prod.total_bytes)
        os.close(fd)
        corruptions = [
            ("bad_magic", lambda i: _patch(mapping, prod, i, "magic", "I", 0xDEADBEEF)),
            ("bad_version", lambda i: _patch(mapping, prod, i, "version", "H", 99)),
            ("bad_dtype", lambda i: _patch(mapping, prod, i, "dtype", "I", 77)),
            ("bad_shape", lambda i: _patch(mapping, prod, i, "shape", "q", 1 << 20)),  # nbytes disagrees
            ("bad_shape", lambda i: (_patch(mapping, prod, i, "shape", "q", 1 << 20),  # bigger than the slot
                                     _patch(mapping, prod, i, "payload_nbytes", "Q", (1 << 20) * 8 * 4))),
            ("bad_shape", lambda i: _patch(mapping, prod, i, "ndim", "I", 7)),
            ("bad_shape", lambda i: _patch(mapping, prod, i, "shape", "qq", -4, -8)),
            ("split_mismatch", lambda i: _patch(mapping, prod, i, "split_layer", "i", 3)),
            ("model_mismatch", lambda i: _patch(mapping, prod, i, "model_id", "q", 6)),
        ]
        for k, (cause, corrupt) in enumerate(corruptions):
            corrupt(_publish(prod, value=-1.0, split=2))
            good_stamp = 1000 + k
            _publish(prod, value=float(k), split=2, stamp=good_stamp)
            with pytest.raises(SlotRejected) as info:
                cons.read(WAIT_S)
            assert info.value.cause == cause
            if cause.endswith("_mismatch"):
                assert info.value.meta is not None and info.value.meta.shape == (4, 8)
            else:
                assert info.value.meta is None
            with cons.read(WAIT_S) as r:
                assert r.meta.stamp_ns == good_stamp and bool((r.tensor == float(k)).all())
            assert cons.read(0) is None
        st = cons.stats
        assert st.read == len(corruptions)
        for cause in sr.REJECT_CAUSES:
            assert st.rejected[cause] == sum(c == cause for c, _ in corruptions)
        assert "READING" not in prod.slot_states()

        cons.expected_split_layer = 4  # settable: K reconfigured
        _publish(prod, split=2)
        with pytest.raises(SlotRejected) as info:
            cons.read(0)
        assert info.value.cause == "split_mismatch" and info.value.meta.split_layer == 2
        _publish(prod, split=4)
        with cons.read(0) as r:
            assert r.meta.split_layer == 4
        mapping.close()


#: Slot version 1's header (positional timings: n timings u32 at 68, f64[8] ms at 104), for the refusal test.
_SLOT_V1 = struct.Struct("<IHHQqqqQqiIII4q8d")


def _open_mapping(name, prod):
    fd = os.open(segment_path(name), os.O_RDWR)
    try:
        return mmap.mmap(fd, prod.total_bytes)
    finally:
        os.close(fd)


def test_every_header_field_round_trips_through_a_slot_at_its_documented_offset(name):
    """One frame through a real slot: each header field the consumer reads equals what was published, and sits
    in the segment at its documented offset in its documented type (DOCUMENTED_SLOT)."""
    timings = SlotTimings(preprocess_ms=3.5, prefix_ms=7.25, prefix_start_ns=1_234_567_890_123_456_789,
                          ego_wait_ms=21.125)
    cap = slot_bytes_for((2, 3, 4), torch.float16)
    with RingProducer(name, 3, cap, model_id=-77) as prod, RingConsumer(name, expected_model_id=-77) as cons:
        mapping = _open_mapping(name, prod)
        slot = prod.acquire((2, 3, 4), torch.float16)
        slot.tensor.fill_(1.5)
        seq = prod.publish(slot, stamp_ns=-(1 << 63), split_layer=(1 << 31) - 1, timings=timings)
        base = sg.GLOBAL_HEADER_BYTES + slot.index * prod.slot_stride

        def at(field, fmt):
            return struct.unpack_from("<" + fmt, mapping, base + DOCUMENTED_SLOT[field][0])

        with cons.read(WAIT_S) as r:
            m = r.meta
            assert (m.seq, m.stamp_ns, m.split_layer, m.model_id, m.shape, m.dtype) == (
                seq, -(1 << 63), (1 << 31) - 1, -77, (2, 3, 4), torch.float16)
            assert m.timings == timings and m.t_write_start_ns <= m.t_publish_ns
            assert at("magic", "I") == (sl.SLOT_MAGIC,) and at("version", "H") == (3,)
            assert at("state", "H") == (sl.READING,) and at("seq", "Q") == (seq,)
            assert at("stamp_ns", "q") == (m.stamp_ns,) and at("t_write_start_ns", "q") == (m.t_write_start_ns,)
            assert at("t_publish_ns", "q") == (m.t_publish_ns,) and at("payload_nbytes", "Q") == (m.nbytes,)
            assert at("model_id", "q") == (-77,) and at("split_layer", "i") == ((1 << 31) - 1,)
            assert at("ndim", "I") == (3,) and at("shape", "4q") == (2, 3, 4, 0)
            assert at("preprocess_ms", "d") == (3.5,) and at("prefix_ms", "d") == (7.25,)
            assert at("prefix_start_ns", "q") == (1_234_567_890_123_456_789,) and at("ego_wait_ms", "d") == (21.125,)
        index = _publish(prod, shape=(2, 3, 4), dtype=torch.float16)  # no timings sent: NaN, NaN, 0 in the header
        base = sg.GLOBAL_HEADER_BYTES + index * prod.slot_stride
        assert math.isnan(at("preprocess_ms", "d")[0]) and math.isnan(at("prefix_ms", "d")[0])
        assert at("prefix_start_ns", "q") == (0,) and math.isnan(at("ego_wait_ms", "d")[0])
        with cons.read(WAIT_S) as r:
            assert r.meta.timings == NO_TIMINGS and math.isnan(r.meta.timings.prefix_ms)
        mapping.close()


def test_a_slot_of_the_old_version_is_refused_naming_both_versions(name):
    """A READY slot whose header a slot-version-1 producer wrote (positional timings) is refused as bad_version,
    its message naming both versions, none of its fields read; the next frame of this version is taken."""
    cap = slot_bytes_for((4, 8), torch.float32)
    with RingProducer(name, 4, cap, model_id=5) as prod, RingConsumer(name, expected_model_id=5) as cons:
        mapping = _open_mapping(name, prod)
        index = _publish(prod, value=-1.0, stamp=11)
        base = sg.GLOBAL_HEADER_BYTES + index * prod.slot_stride
        head = sl.read_header(mapping, base)
        _SLOT_V1.pack_into(mapping, base, sl.SLOT_MAGIC, 1, sl.READY, head[3], 11, head[5], head[6], head[7], 5, 0,
                           head[10], 2, 3, 4, 8, 0, 0, 2.0, 3.0, 1.5e6, 0.0, 0.0, 0.0, 0.0, 0.0)
        _publish(prod, value=2.0, stamp=12)
        with pytest.raises(SlotRejected) as info:
            cons.read(WAIT_S)
        assert info.value.cause == "bad_version" and info.value.meta is None
        message = str(info.value)
        assert "slot header version 1" in message and f"reads version {sl.SLOT_VERSION} only" in message
        with cons.read(WAIT_S) as r:
            assert r.meta.stamp_ns == 12 and r.meta.timings == NO_TIMINGS and bool((r.tensor == 2.0).all())
        assert cons.stats.rejected["bad_version"] == 1 and cons.stats.read == 1
        mapping.close()


def test_slot_timings_are_typed_and_checked():
    """SlotTimings: named fields with their 'not sent' defaults (NaN ms, instant 0); NaN equals NaN; wrong types
    and an instant outside int64 are refused when made, a tuple of timings when published."""
    t = SlotTimings(1, 2.5, 3)
    assert (t.preprocess_ms, t.prefix_ms, t.prefix_start_ns) == (1.0, 2.5, 3) and type(t.preprocess_ms) is float
    assert NO_TIMINGS == SlotTimings() == SlotTimings(float("nan"), float("nan"), 0)
    assert hash(SlotTimings()) == hash(SlotTimings(math.nan)) and SlotTimings(prefix_ms=1.0) != NO_TIMINGS
    assert SlotTimings(prefix_start_ns=-(1 << 63)).prefix_start_ns == -(1 << 63)
    for bad in ({"preprocess_ms": "1"}, {"prefix_ms": None}, {"preprocess_ms": True}, {"prefix_start_ns": 1.0}):
        with pytest.raises(TypeError, match="SlotTimings"):
            SlotTimings(**bad)
    with pytest.raises(ValueError, match="int64"):
        SlotTimings(prefix_start_ns=1 << 63)
    with pytest.raises(Exception):  # frozen
        t.prefix_ms = 1.0
    with pytest.raises(TypeError, match="SlotTimings"):
        sl.check_frame_fields(0, 0, (1.0, 2.0))


def test_wrap_around_many_more_frames_than_slots(name):
    shape = (3, 5)
    with RingProducer(name, 3, slot_bytes_for(shape, torch.bfloat16), model_id=0) as prod, RingConsumer(name) as cons:
        for seq in range(1, 301):
            slot = prod.acquire(shape, torch.bfloat16)
            slot.tensor.copy_(_frame(seq, shape, torch.bfloat16))
            assert prod.publish(slot, stamp_ns=seq, split_layer=1) == seq
            if seq % 2 == 0:  # read two at a time: oldest first
                for want in (seq - 1, seq):
                    with cons.read(0) as r:
                        assert r.meta.seq == want and torch.equal(r.tensor, _frame(want, shape, torch.bfloat16))
        assert prod.stats == sr.ProducerStats(published=300, dropped_oldest=0, aborted=0, wake_errors=0)
        assert cons.stats.read == 300


def test_segment_mode_is_0600_regardless_of_umask(name):
    old = os.umask(0)
    try:
        with RingProducer(name, 3, 64, model_id=0):
            st = os.stat(segment_path(name))
            assert stat.S_IMODE(st.st_mode) == 0o600
            assert st.st_uid == os.getuid()
    finally:
        os.umask(old)


def test_global_header_records_owner(name):
    with RingProducer(name, 3, 100, model_id=-3) as prod:
        with open(segment_path(name), "rb") as f:
            head = f.read(sg.GLOBAL_HEADER_BYTES)
        magic, version, hdr, pid, start, inst = GLOBAL.identity.read(head)
        n, shb, cap, stride, total, model, _created = GLOBAL.geometry.read(head)
        assert (magic, version, hdr, pid, n, shb, cap, model) == (
            sg.GLOBAL_MAGIC, sg.LAYOUT_VERSION, sg.GLOBAL_HEADER_BYTES, os.getpid(), 3, sg.SLOT_HEADER_BYTES, 128, -3)
        assert start == sg.proc_identity(os.getpid())[1] and inst == prod.instance_id
        assert total == os.stat(segment_path(name)).st_size == hdr + 3 * stride


def test_same_process_recreate_replaces_and_old_close_keeps_new(name):
    first = RingProducer(name, 3, 64, model_id=1)
    second = RingProducer(name, 3, 64, model_id=2)  # the owner is this process: not a conflict
    first.close()  # must not unlink the successor's segment
    with RingConsumer(name) as cons:
        assert not cons.producer_gone and cons.model_id == 2
    second.close()
    assert not os.path.exists(segment_path(name))


def test_clean_close_removes_segment_and_is_idempotent(name):
    prod = RingProducer(name, 3, 64, model_id=0)
    assert os.path.exists(segment_path(name))
    prod.close()
    assert not os.path.exists(segment_path(name))
    prod.close()
    with pytest.raises(RingError):
        prod.acquire((1,), torch.float32)
    with RingProducer(name, 3, 64, model_id=0):
        assert os.path.exists(segment_path(name))
    assert not os.path.exists(segment_path(name))
    assert not [e for e in os.listdir(sg.SHM_DIR) if e.startswith(name)]


def test_producer_gone_after_producer_close(name):
    prod = RingProducer(name, 3, 64, model_id=0)
    cons = RingConsumer(name)
    _publish(prod, shape=(2,))
    assert not cons.producer_gone
    prod.close()
    assert cons.producer_gone
    with cons.read(0) as r:  # frames published before close stay readable
        assert r.meta.seq == 1
    t0 = time.monotonic()
    assert cons.read(30) is None  # returns early: nothing ready and the producer is gone
    assert time.monotonic() - t0 < 25
    cons.close()
    assert cons.producer_gone
    cons.close()


def test_read_timeout_returns_none(name):
    with RingProducer(name, 3, 64, model_id=0) as prod, RingConsumer(name) as cons:
        assert cons.read(0) is None
        t0 = time.monotonic()
        assert cons.read(0.05) is None
        assert time.monotonic() - t0 >= 0.05  # it did wait, and then gave up
        for _ in range(5):  # five wake-ups queued, frames read without waiting; stale wake-ups drained
            _publish(prod, shape=(2,))
        for seq in range(1, 4):
            with cons.read(0) as r:
                assert r.meta.seq == seq + 2  # two of five dropped: three slots, nobody reading
        assert cons.read(0.01) is None
        assert prod.stats.dropped_oldest == 2


def test_api_misuse_errors(name):
    with pytest.raises(ValueError):
        RingProducer(name, 2, 64, model_id=0)
    with pytest.raises(FileNotFoundError):
        RingConsumer(name)
    with RingProducer(name, 3, 64, model_id=0) as prod:
        with pytest.raises(ValueError):
            prod.acquire((17,), torch.float32)  # 68 bytes > 64
        with pytest.raises(TypeError):
            prod.acquire((2,), torch.complex64)
        slot = prod.acquire((2,), torch.float16)
        with pytest.raises(RingError):
            prod.acquire((2,), torch.float16)
        prod.abort(slot)
        with pytest.raises(RingError):
            prod.publish(slot, stamp_ns=0, split_layer=0)
        slot = prod.acquire((2,), torch.float16)
        assert slot.seq == 1  # an aborted frame does not use up a seq
        with pytest.raises(TypeError, match="SlotTimings"):
            prod.publish(slot, stamp_ns=0, split_layer=0, timings=(1.0, 2.0, 3.0))  # slot version 1's form
        prod.publish(slot, stamp_ns=0, split_layer=0)
        prod.acquire((2,), torch.float16)  # dropped unpublished: the next acquire takes it back
        _publish(prod, shape=(2,))
        assert prod.stats.aborted == 2 and prod.stats.published == 2

        with RingConsumer(name) as cons:
            with pytest.raises(RingError):
                RingConsumer(name)  # single consumer
            held = cons.read(0)
            with pytest.raises(RingError):
                cons.read(0)  # previous ReadSlot still held
            held.release()
            held.release()
            cons.read(0)  # dropped unreleased: released by the next read
            assert cons.read(0) is None
            assert "READING" not in cons.slot_states()


def test_init_leftovers_of_dead_or_reused_pids_are_removed_live_ones_kept():
    """A producer killed while creating its segment leaves <name>.init-<pid>-<start>-<rand>; the next
    producer removes it when that process is gone, even if its pid now belongs to another process."""
    name = sr.segment_name(f"init_{uuid.uuid4().hex[:8]}", "/")
    base = os.path.join(sg.SHM_DIR, name)
    start = sg.proc_identity(os.getppid())[1]
    reused = f"{base}.init-{os.getppid()}-{start + 12345}-dead"  # live pid, other start time: a reused pid
    live = f"{base}.init-{os.getppid()}-{start}-live"  # the parent really is alive with that start time
    for path in (reused, live):
        with open(path, "w"):
            pass
    try:
        with RingProducer(name, 3, 1024, 1):
            assert not os.path.exists(reused)
            assert os.path.exists(live)
    finally:
        for path in (reused, live):
            if os.path.exists(path):
                os.unlink(path)
