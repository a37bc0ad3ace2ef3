"""Zero-copy hand-off with realistic frame gaps: the ring as the prefix uses it on the CPU against iceoryx2.

The producer *produces* each frame in the transport's memory (a ring slot, an iceoryx2 loan): one
``copy_`` of a precomputed bf16 tensor into it stands in for the prefix's last op (the last block's residual
add writes every byte of the slot the same way). **Hand-off** = from the output being complete there (``t0``:
the ring's ``FrameMeta.t_publish_ns``, taken on entry to ``publish``; for iceoryx2 the instant before
``send``) to the consumer holding a zero-copy tensor view of it (``t_view``, right after ``read`` /
``receive`` + ``torch.frombuffer``), CLOCK_MONOTONIC in both processes. It is what the prefix's output waits
for before the suffix can start: header, lock, notification, the consumer's wake-up, validation, the view.

Frame gaps: after each acknowledgement (an 8-byte AF_UNIX SEQPACKET datagram, as in :mod:`.handoff`) the
producer sleeps ``gap_ms`` (0: back to back) before it produces the next frame, so with a gap the consumer
is idle and waiting, as a suffix waiting for the next camera frame is. Consumers:

* ``zero_copy``: :class:`~hybrid_vla_ros.transport.ring.RingConsumer` with the suffix node's default wake-up
  (spin from ``spin_lead_ms`` before the predicted frame, at most ``spin_max_ms``, then block on the socket);
* ``zero_copy_block``: the same consumer with the spin off (only the socket): what a wake-up costs;
* ``iceoryx2``: an iceoryx2 ``Slice[c_uint8]`` publish-subscribe service (``loan_slice_uninit``, zero-copy on
  both sides) with an event service for the blocking wake-up (``Listener.timed_wait``), the way its Python
  binding gives zero-copy; skipped, with the reason, when ``import iceoryx2`` fails.

CPU per message: producer = CPU time of its ``publish`` (ring) or ``send`` + ``notify`` (iceoryx2) calls,
consumer = CPU time of its whole process over the measured messages (waiting, spinning, reading, the
acknowledgement), both ``time.process_time_ns``; ``spin_ms_per_msg`` = the ring consumer's ``spin_ms``.

Where a slow hand-off came from (``outliers``: every message over :data:`OUTLIER_MS`, each given the first cause
that holds, in this order): ``page_faults`` (the consumer's thread faulted between its acknowledgement of the last
message and its view of this one: ``getrusage(RUSAGE_THREAD)`` minor + major faults), ``preempted`` (the consumer's
thread or the producer's in its publish waited on a run queue for more than :data:`RUN_DELAY_MS`, or was switched
out involuntarily: ``/proc/thread-self/schedstat``'s run delay, ``ru_nivcsw``), ``spin_window`` (the ring's spin
ran and missed the message: the window the period predicted closed before the publish, and the consumer blocked),
``wake_up`` (found after blocking on the socket: the kernel's wake-up of a sleeping thread), ``spin`` (found by
polling, none of the above) and ``ready`` (there on the first look). ``spin`` and ``ready`` outliers are what the
guest's own counters cannot explain: on a virtual machine a vCPU the hypervisor did not run is not in them (its
steal time is counted per CPU in 10 ms ticks, too coarse for one message), and CPU frequency is not read (a virtual
machine has no cpufreq).
"""
from __future__ import annotations

import ctypes
import socket
import time
import uuid
from typing import NamedTuple

from .common import Worker, attach_consumer, percentiles

HIDDEN = 4096
ATTACH_TIMEOUT_S = 120.0
ACK_TIMEOUT_S = 30.0
SPIN = {"lead_ms": 1.0, "max_ms": 5.0}  # the suffix node's defaults (schema ring.spin_lead_ms / spin_max_ms)
METHODS = ("zero_copy", "zero_copy_block", "iceoryx2")
#: A hand-off slower than this (ms) is an outlier whose cause is reported (the issue's p99 bound).
OUTLIER_MS = 0.5
#: Run-queue wait (ms) over which a message counts as preempted.
RUN_DELAY_MS = 0.05
#: The causes, in the order they are tried (module docstring).
CAUSES = ("page_faults", "preempted", "spin_window", "wake_up", "spin", "ready")


class ThreadCounters(NamedTuple):
    """A thread's counters since it started, or the change between two readings (:meth:`since`): ``faults`` (minor +
    major page faults), ``switched`` (involuntary context switches), ``run_delay_ns`` (time runnable but waiting on a
    run queue, ns)."""

    faults: int
    switched: int
    run_delay_ns: int

    def since(self, before: "ThreadCounters") -> "ThreadCounters":
        """The change from ``before`` to these counters."""
        return ThreadCounters(*(a - b for a, b in zip(self, before)))


class ZeroCopyRecord(NamedTuple):
    """One measured zero-copy message as a consumer worker records it (a list once through the worker's JSON):
    ``t_publish_ns`` (ring: FrameMeta.t_publish_ns; None for iceoryx2, whose t0 the producer keeps), ``t_view_ns``
    (CLOCK_MONOTONIC), ``found`` (:attr:`~hybrid_vla_ros.transport.stats.ConsumerStats.FOUND`), the consumer
    thread's :class:`ThreadCounters` over its wait, flattened, and ``spin_missed`` (spins that missed in it)."""

    seq: int
    t_publish_ns: int | None
    t_view_ns: int
    found: str
    faults: int
    switched: int
    run_delay_ns: int
    spin_missed: int


def thread_counters() -> ThreadCounters:
    """The calling thread's :class:`ThreadCounters`: ``getrusage(RUSAGE_THREAD)`` minor + major faults and
    ``ru_nivcsw``, ``/proc/thread-self/schedstat``'s second field (0 where the kernel has no schedstat)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_THREAD)
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            delay = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        delay = 0
    return ThreadCounters(r.ru_minflt + r.ru_majflt, r.ru_nivcsw, delay)


def gap_key(gap_ms: float) -> str:
    """JSON key of a frame gap: 'gap_0ms', 'gap_20ms', 'gap_100ms'."""
    return f"gap_{gap_ms:g}ms"


def _shape(size_mib: float) -> tuple[int, int]:
    return (max(1, round(size_mib * 2**20 / (HIDDEN * 2))), HIDDEN)


def iceoryx2_status() -> tuple[bool, str]:
    """(available, version or why not) of the iceoryx2 Python binding."""
    try:
        import iceoryx2  # noqa: F401
        from importlib.metadata import version

        return True, version("iceoryx2")
    except Exception as e:  # noqa: BLE001 - any import failure means: skip the peer, say why
        return False, f"{type(e).__name__}: {e}"


def _realtime(priority: int) -> None:
    """SCHED_FIFO at ``priority`` for this process (0: leave it): an end on a core nothing else may take, as the
    suffix's reserved cores (and the prefix's) are, on a machine where other work shares the cores. Needs
    CAP_SYS_NICE; the kernel's RT throttling (sched_rt_runtime_us) still leaves other tasks 5 %."""
    if priority > 0:
        import os

        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))


def _wait_ack(ack: socket.socket, seq: int) -> bool:
    deadline = time.monotonic() + ACK_TIMEOUT_S
    while (remaining := deadline - time.monotonic()) > 0:
        ack.settimeout(remaining)
        try:
            if int.from_bytes(ack.recv(16), "little") == seq:
                return True
        except TimeoutError:
            return False
    return False


def _produce(entries, ack, produce_and_publish) -> list[dict]:
    """The producer loop shared by both transports: per entry, warm-up + measured frames with the gap.
    ``produce_and_publish(src)`` returns (seq, t0 or None, CPU ns of the publish, the :class:`ThreadCounters` change
    over the publish)."""
    import torch

    out = []
    for e in entries:
        src = torch.randn(_shape(e["size_mib"])).to(torch.bfloat16)
        cpu_ns, lost, sent, held = 0, 0, {}, {}
        for i in range(e["warmup"] + e["count"]):
            if e["gap_ms"]:
                time.sleep(e["gap_ms"] / 1e3)
            seq, t0, cpu, publish = produce_and_publish(src)
            ok = _wait_ack(ack, seq)
            if i >= e["warmup"]:
                cpu_ns += cpu
                sent[seq] = t0
                held[seq] = [publish.switched, publish.run_delay_ns]  # the publish's (send + notify's)
                lost += not ok
        out.append({**e, "sent": sent, "held": held, "producer_cpu_ms": cpu_ns / 1e6, "lost": lost})
    return out


def ring_producer_task(chan, *, segment: str, entries: list[dict], ack_fd: int, threads: int = 1,
                       rt_priority: int = 0) -> dict:
    """Worker: the ring producer, producing each frame in its slot."""
    import torch

    from ...transport.ring import RingProducer, slot_bytes_for

    torch.set_num_threads(threads)
    _realtime(rt_priority)
    ack = socket.socket(fileno=ack_fd)
    biggest = max((_shape(e["size_mib"]) for e in entries), key=lambda s: s[0])
    with RingProducer(segment, 3, slot_bytes_for(biggest, torch.bfloat16), model_id=1, dtype=torch.bfloat16,
                      device="cpu") as prod:
        def produce_and_publish(src):
            slot = prod.acquire(tuple(src.shape), torch.bfloat16)
            slot.tensor.copy_(src)  # the prefix's last op writes its output into the slot
            slot.t_write_start_ns = time.monotonic_ns()
            c0, counters = time.process_time_ns(), thread_counters()
            seq = prod.publish(slot, stamp_ns=0, split_layer=0)
            return seq, None, time.process_time_ns() - c0, thread_counters().since(counters)

        chan.send({"type": "ready"})
        chan.recv(ATTACH_TIMEOUT_S)
        return {"entries": _produce(entries, ack, produce_and_publish), "stats": prod.stats.as_dict()}


def ring_consumer_task(chan, *, segment: str, entries: list[dict], ack_fd: int, threads: int = 1,
                       rt_priority: int = 0) -> dict:
    """Worker: the ring consumer (spin per entry's ``spin``); a :class:`ZeroCopyRecord` per measured message (its
    counters from its acknowledgement of the message before)."""
    import torch

    from ...transport.ring import SpinPolicy

    torch.set_num_threads(threads)
    _realtime(rt_priority)
    ack = socket.socket(fileno=ack_fd)
    cons = attach_consumer(segment, ATTACH_TIMEOUT_S, delivery="fifo")
    out = []
    with cons:
        chan.send({"type": "ready"})
        for e in entries:
            cons.spin = SpinPolicy(SPIN["lead_ms"], SPIN["max_ms"]) if e["spin"] else None
            recs, cpu0, spin0 = [], time.process_time_ns(), cons.stats.spin_ms
            for i in range(e["warmup"] + e["count"]):
                if i == e["warmup"]:
                    cpu0, spin0 = time.process_time_ns(), cons.stats.spin_ms
                before, counters = cons.stats, thread_counters()
                slot = cons.read(ACK_TIMEOUT_S)
                if slot is None:
                    raise TimeoutError(f"no ring frame within {ACK_TIMEOUT_S} s")
                view = slot.tensor  # the zero-copy view the suffix computes on
                t_view = time.monotonic_ns()
                counters = thread_counters().since(counters)
                after = cons.stats
                found = after.found_by(before)
                m = slot.meta
                del view
                slot.release()
                ack.send(m.seq.to_bytes(8, "little"))
                if i >= e["warmup"]:
                    recs.append(ZeroCopyRecord(m.seq, m.t_publish_ns, t_view, found, *counters,
                                               after.spin_misses - before.spin_misses))
            out.append({**e, "records": recs, "consumer_cpu_ms": (time.process_time_ns() - cpu0) / 1e6,
                        "spin_ms": cons.stats.spin_ms - spin0})
    return {"entries": out}


def iox_producer_task(chan, *, service: str, entries: list[dict], ack_fd: int, threads: int = 1,
                      rt_priority: int = 0) -> dict:
    """Worker: an iceoryx2 publisher + notifier, producing each frame in its loan; t0 and seq travel in the
    producer's records (the seq also in the payload's first 8 bytes)."""
    import iceoryx2 as iox2
    import torch

    torch.set_num_threads(threads)
    _realtime(rt_priority)
    iox2.set_log_level(iox2.LogLevel.Warn)
    ack = socket.socket(fileno=ack_fd)
    biggest = max(_shape(e["size_mib"])[0] for e in entries) * HIDDEN * 2
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    svc = (node.service_builder(iox2.ServiceName.new(service)).publish_subscribe(iox2.Slice[ctypes.c_uint8])
           .subscriber_max_buffer_size(2).history_size(0).open_or_create())
    pub = svc.publisher_builder().initial_max_slice_len(biggest).create()
    ev = node.service_builder(iox2.ServiceName.new(service + ".event")).event().open_or_create()
    notifier = ev.notifier_builder().create()
    counter = [0]

    def produce_and_publish(src):
        nbytes = src.numel() * 2
        sample = pub.loan_slice_uninit(nbytes)
        view = torch.frombuffer(sample.payload().as_memory_view(), dtype=torch.bfloat16).view(src.shape)
        view.copy_(src)  # the prefix's last op writes its output into the loan
        counter[0] += 1
        seq = counter[0]
        ctypes.memmove(sample.payload_ptr, seq.to_bytes(8, "little"), 8)
        del view
        counters = thread_counters()
        t0 = time.monotonic_ns()
        c0 = time.process_time_ns()
        sample.assume_init().send()
        notifier.notify()
        return seq, t0, time.process_time_ns() - c0, thread_counters().since(counters)

    chan.send({"type": "ready"})
    chan.recv(ATTACH_TIMEOUT_S)
    res = _produce(entries, ack, produce_and_publish)
    return {"entries": res}


def iox_consumer_task(chan, *, service: str, entries: list[dict], ack_fd: int, threads: int = 1,
                      rt_priority: int = 0) -> dict:
    """Worker: an iceoryx2 subscriber + listener; blocks in ``timed_wait`` when no sample is there."""
    import iceoryx2 as iox2
    import torch

    torch.set_num_threads(threads)
    _realtime(rt_priority)
    iox2.set_log_level(iox2.LogLevel.Warn)
    ack = socket.socket(fileno=ack_fd)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    svc = (node.service_builder(iox2.ServiceName.new(service)).publish_subscribe(iox2.Slice[ctypes.c_uint8])
           .subscriber_max_buffer_size(2).history_size(0).open_or_create())
    sub = svc.subscriber_builder().create()
    ev = node.service_builder(iox2.ServiceName.new(service + ".event")).event().open_or_create()
    listener = ev.listener_builder().create()
    wait = iox2.Duration.from_millis(int(ACK_TIMEOUT_S * 1000))
    chan.send({"type": "ready"})
    out = []
    for e in entries:
        recs, cpu0 = [], time.process_time_ns()
        for i in range(e["warmup"] + e["count"]):
            if i == e["warmup"]:
                cpu0 = time.process_time_ns()
            found, counters = "found_ready", thread_counters()
            sample = sub.receive()
            while sample is None:
                listener.timed_wait(wait)
                found = "found_after_block"
                sample = sub.receive()
            view = torch.frombuffer(sample.payload().as_memory_view(), dtype=torch.uint8)
            t_view = time.monotonic_ns()
            counters = thread_counters().since(counters)
            seq = int.from_bytes(bytes(view[:8]), "little")
            del view
            sample.delete()
            ack.send(seq.to_bytes(8, "little"))
            if i >= e["warmup"]:
                recs.append(ZeroCopyRecord(seq, None, t_view, found, *counters, 0))
        out.append({**e, "records": recs, "consumer_cpu_ms": (time.process_time_ns() - cpu0) / 1e6, "spin_ms": 0.0})
    return {"entries": out}


def _ack_pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.set_inheritable(True)
    b.set_inheritable(True)
    return a, b


def _run_pair(tasks: tuple[str, str], args: dict, entries: list[dict], producer_cores, consumer_cores,
              rt_priority: int = 0) -> tuple:
    a, b = _ack_pair()
    try:
        with Worker(tasks[0], {**args, "entries": entries, "ack_fd": a.fileno(), "rt_priority": rt_priority},
                    cores=list(producer_cores), extra_fds=(a.fileno(),)) as prod, \
                Worker(tasks[1], {**args, "entries": entries, "ack_fd": b.fileno(), "rt_priority": rt_priority},
                       cores=list(consumer_cores), extra_fds=(b.fileno(),)) as cons:
            prod.recv(ATTACH_TIMEOUT_S, expect="ready")
            cons.recv(ATTACH_TIMEOUT_S, expect="ready")
            prod.send({"type": "go"})
            budget = 120 + sum((e["warmup"] + e["count"]) * (e["gap_ms"] / 1e3 + 0.2) for e in entries)
            return prod.result(budget), cons.result(60)
    finally:
        a.close()
        b.close()


def cause_of(found: str, faults: int, switched: int, delay_ns: int, spin_missed: int = 0,
             producer: tuple[int, int] = (0, 0)) -> str:
    """The cause (:data:`CAUSES`) given to one slow hand-off: ``found`` is how the consumer found the message
    (``found_ready`` / ``found_spinning`` / ``found_after_block``), ``faults``, ``switched``, ``delay_ns`` the
    consumer thread's counters over its wait (:func:`thread_counters`), ``spin_missed`` the spins that missed in
    it, ``producer`` the publish's (involuntary switches, run-queue wait ns)."""
    if faults > 0:
        return "page_faults"
    if switched > 0 or producer[0] > 0 or max(delay_ns, producer[1]) > RUN_DELAY_MS * 1e6:
        return "preempted"
    if found == "found_after_block":
        return "spin_window" if spin_missed else "wake_up"
    return "spin" if found == "found_spinning" else "ready"


def _summary(p: dict, c: dict) -> dict:
    recs = [ZeroCopyRecord._make(r) for r in c["records"]]
    lat, causes = [], dict.fromkeys(CAUSES, 0)
    for r in recs:
        t0 = r.t_publish_ns if r.t_publish_ns is not None else p["sent"].get(r.seq, p["sent"].get(str(r.seq)))
        if t0 is not None:
            lat.append((r.t_view_ns - t0) / 1e6)
            if lat[-1] > OUTLIER_MS:
                held = p["held"].get(r.seq, p["held"].get(str(r.seq), (0, 0)))
                causes[cause_of(r.found, r.faults, r.switched, r.run_delay_ns, r.spin_missed, tuple(held))] += 1
    n = max(len(recs), 1)
    found = {k: sum(r.found == k for r in recs) for k in ("found_ready", "found_spinning", "found_after_block")}
    return {"gap_ms": p["gap_ms"], "handoff_ms": percentiles(lat), "n": len(lat), "lost": p["lost"],
            "cpu_ms_per_msg": {"producer": p["producer_cpu_ms"] / n, "consumer": c["consumer_cpu_ms"] / n,
                               "total": (p["producer_cpu_ms"] + c["consumer_cpu_ms"]) / n},
            "spin_ms_per_msg": c["spin_ms"] / n, "found": found,
            "outliers": {"over_ms": OUTLIER_MS, "n": sum(causes.values()), "causes": causes}}


def run_zero_copy(sizes_mib, *, gaps_ms=(0.0, 20.0, 100.0), count: int = 200, gap_count: int = 60, warmup: int = 10,
                  block_gaps_ms=(20.0,), producer_cores=(0,), consumer_cores=(1,), threads: int = 1,
                  rt_priority: int = 0, log=print) -> dict:
    """Both transports at every size and gap; returns {"methods": {method: {size: {gap_key: summary}}},
    "iceoryx2": {"available", "version" | "skipped"}} (see :func:`.handoff.run_handoff` for where it goes)."""
    sizes = [float(s) for s in sizes_mib]
    warm = max(int(warmup), 6)  # the spin's period estimate needs a few frames at a new gap

    def entries(gaps, spin):
        return [{"size_mib": s, "gap_ms": float(g), "spin": spin, "warmup": warm,
                 "count": int(count if not g else gap_count)} for s in sizes for g in gaps]

    ring_entries = entries(gaps_ms, True) + entries(block_gaps_ms, False)
    p, c = _run_pair(("zc_ring_producer", "zc_ring_consumer"), {"segment": _segment(), "threads": threads},
                     ring_entries, producer_cores, consumer_cores, rt_priority)
    methods = {"zero_copy": {}, "zero_copy_block": {}}
    for pe, ce in zip(p["entries"], c["entries"]):
        m = "zero_copy" if pe["spin"] else "zero_copy_block"
        methods[m].setdefault(pe["size_mib"], {})[gap_key(pe["gap_ms"])] = _summary(pe, ce)
    log(f"  ring produced in the slot: {len(sizes)} sizes x gaps {list(gaps_ms)} ms (+ block only at "
        f"{list(block_gaps_ms)} ms) done")
    ok, version = iceoryx2_status()
    iox = {"available": ok, "version" if ok else "skipped": version}
    if ok:
        p, c = _run_pair(("zc_iox_producer", "zc_iox_consumer"),
                         {"service": f"hvla_bench_{uuid.uuid4().hex[:10]}", "threads": threads},
                         entries(gaps_ms, False), producer_cores, consumer_cores, rt_priority)
        methods["iceoryx2"] = {}
        for pe, ce in zip(p["entries"], c["entries"]):
            methods["iceoryx2"].setdefault(pe["size_mib"], {})[gap_key(pe["gap_ms"])] = _summary(pe, ce)
        log(f"  iceoryx2 {version}: {len(sizes)} sizes x gaps {list(gaps_ms)} ms done")
    else:
        log(f"  iceoryx2 skipped: {version}")
    return {"methods": methods, "iceoryx2": iox}


def _segment() -> str:
    from ...transport.ring import segment_name

    return segment_name(f"bench_zc_{uuid.uuid4().hex[:10]}")
