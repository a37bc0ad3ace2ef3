"""The ring's protocol under faults and other users, with real processes: a producer SIGKILLed inside publish,
newest-first delivery to a slow consumer, another uid squatting the wake-up channel, a consumer in another
network namespace, and the bounded spin before a predicted frame."""
from __future__ import annotations

import ctypes
import errno
import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from hybrid_vla_ros.transport import wake
from hybrid_vla_ros.transport.ring import RingConsumer, RingError, RingProducer, SpinPolicy, segment_name

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CTX = mp.get_context("spawn")
WAIT_S = 60.0
NOBODY = 65534
CLONE_NEWNET = 0x40000000


@pytest.fixture
def name():
    seg = segment_name("p_" + uuid.uuid4().hex[:12])
    yield seg
    path = Path("/dev/shm", seg)
    if path.exists():
        with RingProducer(seg, 3, 64, model_id=0):  # replaces a dead producer's leftover, removed at exit
            pass


def _run_faults(mode: str, name: str, count: int, seed: int = 0, publish: str = "in_order") -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(HERE / "ring_faults.py"), mode, name, str(count), str(seed), publish],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------- kill inside publish

@pytest.mark.parametrize("publish", ["in_order", "locked"])
def test_a_producer_killed_at_any_store_of_acquire_or_publish_never_shows_a_mixed_frame(name, publish):
    """84 producers, the k-th SIGKILLed right after its k-th field store into the segment (three frames'
    worth of stores, overwriting READY slots included): every READY frame a consumer then finds is one whole
    frame (stamp, shape, split, timings and payload of one seq), none is rejected. ``in_order``: publish
    without the mutex (x86-TSO, this machine); ``locked``: under it (CPUs without in-order stores)."""
    s = _run_faults("points", name, 84, publish=publish)
    print(f"\nkill at every store: {s['iterations']} kills, {s['frames']} frames checked, "
          f"{s['left_writing']} left a WRITING slot, {s['struct_objects']} Struct objects counted")
    assert s["iterations"] == 84 and s["struct_objects"] > 0
    assert s["bad"] == [] and s["bad_count"] == 0 and s["rejected"] == 0
    assert s["frames"] >= 84 * 3  # the three frames before the counted stores are always there
    assert s["left_writing"] > 0  # some kills did land between acquire and READY


def test_a_producer_sigkilled_at_random_moments_1500_times_never_shows_a_mixed_frame(name):
    seed = int.from_bytes(os.urandom(4), "little")
    s = _run_faults("random", name, 1500, seed)
    print(f"\nrandom kills (seed {seed}): {s['iterations']} kills, {s['frames']} frames checked, "
          f"{s['left_writing']} kills left a WRITING slot")
    assert s["iterations"] == 1500
    assert s["bad"] == [] and s["bad_count"] == 0 and s["rejected"] == 0, s["bad"]
    assert s["left_writing"] > 0 and s["frames"] > 0


# ------------------------------------------------------------------------------------- newest first

def _burst_producer(name, created, go, burst, done):
    """Publishes frame 1, then (on ``burst``) frames 2..5, each filled with its seq."""
    with RingProducer(name, 5, 4096, model_id=1) as prod:
        created.set()
        go.wait(WAIT_S)
        for seq in range(1, 6):
            if seq == 2:
                burst.wait(WAIT_S)
            slot = prod.acquire((8,), torch.float32)
            slot.tensor.fill_(float(seq))
            prod.publish(slot, stamp_ns=seq, split_layer=0)
        done.wait(WAIT_S)


@pytest.mark.parametrize("delivery", ["newest", "fifo"])
def test_a_slow_consumer_gets_the_newest_frame_and_older_ones_are_superseded(name, delivery):
    """While the consumer computes frame 1, the producer publishes 2..5. Newest first: the next read gives 5
    and frees 2..4 unread (``superseded``, and ReadSlot.superseded == 3); FIFO gives 2, 3, 4, 5."""
    created, go, burst, done = CTX.Event(), CTX.Event(), CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_burst_producer, args=(name, created, go, burst, done), daemon=True)
    proc.start()
    try:
        assert created.wait(WAIT_S)
        with RingConsumer(name, delivery=delivery) as cons:
            go.set()
            with cons.read(WAIT_S) as first:
                assert first.meta.seq == 1 and first.superseded == 0
                burst.set()  # frames 2..5 arrive while frame 1 is "computed"
                deadline = time.monotonic() + WAIT_S
                while cons.slot_states().count("READY") < 4:
                    assert time.monotonic() < deadline and proc.is_alive()
                    time.sleep(0.01)
            got = []
            while (slot := cons.read(0)) is not None:
                with slot:
                    assert bool((slot.tensor == float(slot.meta.seq)).all())
                    got.append((slot.meta.seq, slot.superseded))
            if delivery == "newest":
                assert got == [(5, 3)]
                assert cons.stats.superseded == 3 and cons.stats.read == 2
                assert "READY" not in cons.slot_states()
            else:
                assert got == [(2, 0), (3, 0), (4, 0), (5, 0)]
                assert cons.stats.superseded == 0 and cons.stats.read == 5
    finally:
        done.set()
        proc.join(WAIT_S)


# ------------------------------------------------------------------------------------- another uid

def _squatter(name: str, wake_dir: str, result_q, hold) -> None:
    """As uid/gid nobody: every way to take, reach or learn the wake-up channel; reports each outcome, then
    keeps what it holds (its abstract socket) until ``hold`` is set."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    out = {}
    squat = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:  # the abstract name the ring used to bind: anyone could take it first
        squat.bind(b"\0" + (name + ".wake").encode())
        out["abstract_bind"] = "bound"
    except OSError as e:
        out["abstract_bind"] = errno.errorcode[e.errno]
    path = os.path.join(wake.SHM_DIR, wake_dir, wake.SOCKET_NAME)
    for what in ("bind_in_dir", "connect", "sendto", "open_segment", "list_dir"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if what == "bind_in_dir":
                s.bind(os.path.join(wake.SHM_DIR, wake_dir, "squat"))
            elif what == "connect":
                s.connect(path)
            elif what == "sendto":
                s.sendto(b"x", path)
            elif what == "open_segment":
                os.close(os.open(os.path.join(wake.SHM_DIR, name), os.O_RDWR))
            else:
                os.listdir(os.path.join(wake.SHM_DIR, wake_dir))
            out[what] = "ok"
        except OSError as e:
            out[what] = errno.errorcode[e.errno]
        finally:
            s.close()
    result_q.put(out)
    hold.wait(WAIT_S)
    squat.close()


def test_another_uid_cannot_squat_or_reach_the_wake_up_channel(name):
    """A process of uid nobody binds the old abstract wake name first and tries to bind, connect and send in
    the wake-up directory (given its name, which it could not read from the 0600 segment): each is refused
    with EACCES, and the real consumer still attaches and is woken by the producer's publishes."""
    with RingProducer(name, 3, 4096, model_id=1) as prod:
        result_q, hold = CTX.Queue(), CTX.Event()
        proc = CTX.Process(target=_squatter, args=(name, prod.wake_dir, result_q, hold), daemon=True)
        proc.start()
        try:
            out = result_q.get(timeout=WAIT_S)
            print(f"\nsquatter (uid {NOBODY}): {out}")
            assert out["abstract_bind"] == "bound"  # harmless now: the ring no longer uses that name
            for what in ("bind_in_dir", "connect", "sendto", "open_segment", "list_dir"):
                assert out[what] == "EACCES", (what, out[what])
            with RingConsumer(name) as cons:  # the squatter still holds its socket
                for seq in (1, 2):
                    t_pub = []

                    def publish_later(seq=seq):
                        time.sleep(0.2)  # the consumer is blocked on its socket by then
                        slot = prod.acquire((4,), torch.float32)
                        slot.tensor.fill_(float(seq))
                        t_pub.append(prod.publish(slot, stamp_ns=seq, split_layer=0))

                    import threading

                    t = threading.Thread(target=publish_later)
                    t.start()
                    slot = cons.read(WAIT_S)
                    t.join()
                    assert slot is not None and slot.meta.seq == seq and bool((slot.tensor == float(seq)).all())
                    slot.release()
                assert cons.stats.found_after_block == 2  # woken through the socket (no spin policy)
                assert prod.stats.wake_errors == 0
        finally:
            hold.set()
            proc.join(WAIT_S)


# ------------------------------------------------------------------------------------- network namespaces

def _in_new_netns(name: str, action: str, result_q) -> None:
    """Enter a new network namespace, then try to attach as a consumer (and, for ``read``, wait for a frame)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        result_q.put({"unshare": errno.errorcode.get(ctypes.get_errno(), "?")})
        return
    out = {"unshare": "ok"}
    try:
        with RingConsumer(name) as cons:
            out["attach"] = "attached"
            result_q.put(dict(out))
            if action == "read":
                slot = cons.read(WAIT_S)
                out["seq"] = None if slot is None else slot.meta.seq
                out["found_after_block"] = cons.stats.found_after_block
                if slot is not None:
                    slot.release()
    except RingError as e:
        out["attach"] = f"refused: {e}"
    result_q.put(out)


def _netns_child(name, action):
    q = CTX.Queue()
    p = CTX.Process(target=_in_new_netns, args=(name, action, q), daemon=True)
    p.start()
    first = q.get(timeout=WAIT_S)
    if first.get("unshare") != "ok":
        p.join(WAIT_S)
        pytest.skip(f"cannot create a network namespace here (unshare: {first['unshare']})")
    return p, q, first


def test_single_consumer_and_wake_ups_hold_across_network_namespaces(name):
    with RingProducer(name, 3, 4096, model_id=1) as prod:
        with RingConsumer(name):  # attached here: a consumer in another network namespace is refused
            p, q, first = _netns_child(name, "attach")
            p.join(WAIT_S)
            refused = rf"refused: another consumer \(process {os.getpid()}\) is attached"
            assert re.match(refused, first["attach"]), first
        # alone, a consumer in another network namespace attaches and is woken through the filesystem socket
        p, q, first = _netns_child(name, "read")
        try:
            assert first["attach"] == "attached"
            time.sleep(0.3)  # it is blocked in read() by now
            slot = prod.acquire((4,), torch.float32)
            slot.tensor.fill_(3.0)
            seq = prod.publish(slot, stamp_ns=0, split_layer=0)
            out = q.get(timeout=WAIT_S)
            assert out["seq"] == seq and out["found_after_block"] == 1, out
        finally:
            p.join(WAIT_S)


# ------------------------------------------------------------------------------------- spin, then block

def test_spin_policy_predicts_the_next_frame_from_the_period():
    sp = SpinPolicy(lead_ms=1.0, max_ms=5.0)
    assert sp.window() is None
    for seq, t in ((1, 0), (2, 20_000_000), (3, 40_000_000)):  # a steady 20 ms period
        sp.observe(seq, t)
    assert sp.window() == (59_000_000, 64_000_000)  # from 1 ms before 60 ms, for 5 ms
    sp.observe(6, 100_000_000)  # seq 4 and 5 superseded: 3 periods of 20 ms in 60 ms
    assert sp.window() == (119_000_000, 124_000_000)
    for seq, t in ((7, 123_000_000), (8, 140_000_000), (9, 163_000_000)):  # jitter widens the lead
        sp.observe(seq, t)
    start, stop = sp.window()
    assert stop - start == 5_000_000 and 163_000_000 + 20_000_000 - start > 1_000_000
    for _ in range(SpinPolicy.OUTCOMES // 2):  # half the spins missing is still worth spinning
        sp.outcome(False)
        sp.outcome(True)
    assert sp.pauses == 0 and sp.window() is not None
    for _ in range(SpinPolicy.OUTCOMES):  # most of them missing: block only, for OUTCOMES frames
        sp.outcome(False)
    assert sp.pauses == 1 and sp.window() is None
    for seq in range(10, 10 + SpinPolicy.OUTCOMES):
        sp.observe(seq, 163_000_000 + (seq - 9) * 20_000_000)
    assert sp.window() is not None  # and then it tries again
    with pytest.raises(ValueError):
        SpinPolicy(lead_ms=-1)
    with pytest.raises(ValueError):
        SpinPolicy(max_ms=0)


def _periodic_producer(name, created, go, n, period_s):
    with RingProducer(name, 4, 4096, model_id=1) as prod:
        created.set()
        go.wait(WAIT_S)
        for _ in range(n):
            time.sleep(period_s)
            slot = prod.acquire((16,), torch.float32)
            slot.tensor.fill_(float(slot.seq))
            prod.publish(slot, stamp_ns=slot.seq, split_layer=0)
        time.sleep(1.0)


def test_a_spinning_consumer_gets_every_frame_of_a_periodic_producer(name):
    """Frames every 20 ms from another process, the consumer spinning before each predicted one: every frame
    arrives, in order, and each wait is accounted (spin hit, spin miss or blocked wait)."""
    n = 40
    created, go = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_periodic_producer, args=(name, created, go, n, 0.02), daemon=True)
    proc.start()
    try:
        assert created.wait(WAIT_S)
        with RingConsumer(name, spin=SpinPolicy(lead_ms=1.0, max_ms=5.0)) as cons:
            go.set()
            seqs = []
            for _ in range(n):
                with cons.read(WAIT_S) as slot:
                    assert bool((slot.tensor == float(slot.meta.seq)).all())
                    seqs.append(slot.meta.seq)
            st = cons.stats
        print(f"\nspin: found {st.found_ready} ready, {st.found_spinning} spinning, "
              f"{st.found_after_block} after a blocked wait; {st.spin_misses} spins missed, "
              f"{st.spin_ms:.1f} ms spun for {n} frames")
        assert seqs == list(range(1, n + 1))
        assert st.found_ready + st.found_spinning + st.found_after_block == n
        assert st.spin_ms > 0 and st.found_spinning + st.spin_misses > 0  # the spin did run
    finally:
        proc.join(WAIT_S)


def _sigkilled_producer(name, created):
    prod = RingProducer(name, 3, 4096, model_id=1)
    created.set()
    time.sleep(WAIT_S)
    prod.close()


def test_an_orphaned_wake_up_directory_is_removed_by_the_next_producer(name):
    """A SIGKILLed producer leaves its segment and wake-up directory; once the segment is gone (removed by
    hand), the next producer of any ring removes the directory too; while the segment is there, it stays."""
    created = CTX.Event()
    proc = CTX.Process(target=_sigkilled_producer, args=(name, created), daemon=True)
    proc.start()
    assert created.wait(WAIT_S)
    with RingConsumer(name) as cons:
        wake_dir = cons.wake_dir
    os.kill(proc.pid, 9)
    proc.join(WAIT_S)
    assert Path(wake.SHM_DIR, wake_dir).is_dir()
    other = segment_name("p_" + uuid.uuid4().hex[:12])
    with RingProducer(other, 3, 64, model_id=0):
        assert Path(wake.SHM_DIR, wake_dir).is_dir(), "its segment still names it"
    os.unlink(Path(wake.SHM_DIR, name))
    with RingProducer(other, 3, 64, model_id=0):
        assert not Path(wake.SHM_DIR, wake_dir).exists()
