"""Hand-off of the prefix hidden states between two processes: ring vs rclpy topic vs one memcpy, and the
zero-copy hand-off (the prefix producing in the slot) with realistic frame gaps against iceoryx2
(:mod:`.zero_copy`).

For each payload size S MiB the payload is a bf16 tensor (S * 2**20 / 8192, 4096), i.e. exactly S MiB (the shape
of Orion's 4096-wide hidden states). Every message waits for the receiver's acknowledgement (an 8-byte
datagram on a private AF_UNIX SOCK_SEQPACKET pair, the same for every method) before the next one is sent, so
the figures are latencies of isolated messages, not throughput. The producer side runs on ``producer_cores``
and the consumer side on ``consumer_cores`` (each process pinned before it imports anything that starts
threads), torch with ``threads`` intra-op threads.

Methods (latency = producer write start -> consumer holds a zero-copy view, CLOCK_MONOTONIC, comparable
between processes):

* ``ring``: ``RingProducer.acquire`` -> ``slot.tensor.copy_(src)`` -> ``publish`` ... ``RingConsumer.read``
  returns the slot's view; 3 slots of the largest size; the consumer waits as the suffix node does by default
  (spin from 1 ms before the predicted frame, at most 5 ms, then block: ``ring.spin_lead_ms`` / ``spin_max_ms``).
  Latency = ``t_view - FrameMeta.t_write_start_ns``, split into ``copy_ms`` (``t_publish - t_write_start``: the
  copy into the slot) and ``publish_to_view_ms`` (``t_view - t_publish``: header, lock, wake-up datagram, consumer
  wake-up, slot validation, view).
* ``rclpy`` variants, each in fresh publisher and subscriber processes with the variant's environment for both
  ends and nothing else of Fast DDS inherited (:func:`.common.ros_env`): ``t0`` is taken before
  ``tensor -> bytes`` (the copy that corresponds to the ring's copy into the slot), the bytes go into
  ``sensor_msgs/Image.data`` and are published; the subscriber's callback takes a ``torch.frombuffer`` view of
  ``msg.data``; latency = ``t_view - t0`` (``t0`` travels in ``header.stamp``). Default QoS (reliable, keep
  last 10). Variants: ``default`` (Fast DDS built-in transports), ``large_data``
  (``FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA``: shared memory + TCP for user data, UDP only for discovery; Fast
  DDS documentation, "Large Data mode"), ``shm_profile`` (this project's ``config/fastdds_shm_large.xml``: a
  32 MiB shared-memory segment, the profile ``hybrid-vla replay`` runs the nodes with).
* ``memcpy``: one ``dst.copy_(src)`` of the same tensor into a preallocated tensor in the producer process
  (same core, same thread count): the floor for the ring, whose one unavoidable cost is that copy. Timed twice:
  back to back, and (``memcpy_after_wait``) each copy after the thread slept as long as the ring's producer waits
  for an acknowledgement (the median of that size's waits), as the ring's copies are made: on a 2-vCPU VM a copy
  after 0.3-2 ms idle took 1.4-2.4x the back-to-back one (8 MiB: 0.55 -> 0.74-1.29 ms), into a /dev/shm slot and
  into private memory alike. The goal judges the ring against the copy after the wait.

CPU time per message = (user + system CPU time of the producer process + that of the consumer process, all
their threads, ``time.process_time_ns``) over the measured messages / messages. Each side's window starts before
its first measured message and ends after the last acknowledgement, so both windows cover exactly the measured
messages; the acknowledgement (one small datagram each way) is inside it for every method alike.
"""
from __future__ import annotations

import random
import socket
import time
import uuid

from ...transport.stats import ProducerStats
from .common import SHM_PROFILE, Worker, attach_consumer, percentiles, ros_env

HIDDEN = 4096
BYTES_PER_ELEMENT = 2  # bf16
ACK_TIMEOUT_S = 30.0
WARMUP_ACK_TIMEOUT_S = 5.0
ATTACH_TIMEOUT_S = 120.0

#: rclpy variants: name -> (environment for both ends, label).
RCLPY_VARIANTS = {
    "default": ({}, "rclpy sensor_msgs/Image, Fast DDS default transports"),
    "large_data": ({"FASTDDS_BUILTIN_TRANSPORTS": "LARGE_DATA"}, "rclpy Image, FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA"),
    "shm_profile": ({"FASTDDS_DEFAULT_PROFILES_FILE": str(SHM_PROFILE)},
                    "rclpy Image, config/fastdds_shm_large.xml (32 MiB SHM segment)"),
}


def payload_shape(size_mib: float) -> tuple[int, int]:
    """(tokens, 4096) bf16 tensor of ``size_mib`` MiB (rounded to whole tokens, at least one)."""
    return (max(1, round(size_mib * 2**20 / (HIDDEN * BYTES_PER_ELEMENT))), HIDDEN)


def payload_bytes(size_mib: float) -> int:
    """Bytes of the bf16 (tokens, hidden) payload used for ``size_mib`` MiB (:func:`payload_shape`)."""
    t, h = payload_shape(size_mib)
    return t * h * BYTES_PER_ELEMENT


def _schedule(sizes_mib, warmup: int, count: int) -> list[dict]:
    return [{"size_mib": float(s), "warmup": int(warmup), "count": int(count)} for s in sizes_mib]


def _ack_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.set_inheritable(True)
    b.set_inheritable(True)
    return a, b


def _wait_ack(ack: socket.socket, seq: int, timeout: float) -> bool:
    """Wait for the acknowledgement of ``seq`` (older ones are skipped); False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        ack.settimeout(remaining)
        try:
            got = int.from_bytes(ack.recv(16), "little")
        except TimeoutError:
            return False
        if got == seq:
            return True


# ------------------------------------------------------------------------------------------ worker tasks

def _timed_copies(src, warmup: int, count: int, wait_s: float = 0.0) -> list[float]:
    """ms of ``count`` copies of ``src`` into one tensor allocated here, after ``warmup`` untimed ones, each after
    sleeping ``wait_s`` s (0: back to back)."""
    import torch

    dst, out = torch.empty_like(src), []
    for i in range(warmup + count):
        if wait_s:
            time.sleep(wait_s)
        t0 = time.perf_counter_ns()
        dst.copy_(src)
        t1 = time.perf_counter_ns()
        if i >= warmup:
            out.append((t1 - t0) / 1e6)
    return out


def ring_producer_task(chan, *, segment: str, schedule: list[dict], ack_fd: int, threads: int = 1,
                       memcpy_count: int = 100) -> dict:
    """Producer end of the ring (and the memcpy floor). Returns per size: memcpy samples (ms), CPU ms of the
    measured ring messages, messages lost (acknowledgement timeouts)."""
    import torch

    from ...transport.ring import RingProducer, slot_bytes_for

    torch.set_num_threads(threads)
    ack = socket.socket(fileno=ack_fd)
    dtype = torch.bfloat16
    shapes = [payload_shape(e["size_mib"]) for e in schedule]
    biggest = max(shapes, key=lambda s: s[0] * s[1])
    out = []
    with RingProducer(segment, 3, slot_bytes_for(biggest, dtype), model_id=1) as prod:
        chan.send({"type": "ready"})
        chan.recv(ATTACH_TIMEOUT_S)  # "go": the consumer is attached
        for entry, shape in zip(schedule, shapes):
            src = torch.randn(shape).to(dtype)
            memcpy_ms = _timed_copies(src, entry["warmup"], memcpy_count)
            lost, cpu0, waits = 0, time.process_time_ns(), []
            for i in range(entry["warmup"] + entry["count"]):
                if i == entry["warmup"]:
                    cpu0 = time.process_time_ns()
                slot = prod.acquire(shape, dtype)
                slot.tensor.copy_(src)
                seq = prod.publish(slot, stamp_ns=i, split_layer=0)
                t_wait = time.perf_counter_ns()
                if not _wait_ack(ack, seq, ACK_TIMEOUT_S):
                    lost += 1
                waits.append(time.perf_counter_ns() - t_wait)
            cpu_ms = (time.process_time_ns() - cpu0) / 1e6
            wait_s = sorted(waits)[len(waits) // 2] / 1e9  # the producer idles this long before each copy
            after_wait = _timed_copies(src, entry["warmup"], memcpy_count, wait_s)
            out.append({"size_mib": entry["size_mib"], "memcpy_ms": memcpy_ms, "memcpy_after_wait_ms": after_wait,
                        "wait_ms": wait_s * 1e3, "cpu_ms": cpu_ms, "lost": lost})
        stats = prod.stats
    return {"sizes": out, "ring_stats": stats.as_dict()}


def ring_consumer_task(chan, *, segment: str, schedule: list[dict], ack_fd: int, threads: int = 1) -> dict:
    """Consumer end of the ring. Returns per size the measured messages as [seq, t_write_start_ns, t_publish_ns,
    t_view_ns] and the CPU ms of the measured messages."""
    import torch

    from ...transport.ring import SpinPolicy
    from .zero_copy import SPIN

    torch.set_num_threads(threads)
    ack = socket.socket(fileno=ack_fd)
    # the suffix node's default wake-up: spin from just before the predicted frame, then block
    cons = attach_consumer(segment, ATTACH_TIMEOUT_S, spin=SpinPolicy(SPIN["lead_ms"], SPIN["max_ms"]))
    out = []
    with cons:
        chan.send({"type": "ready"})
        for entry in schedule:
            recs, cpu0 = [], time.process_time_ns()
            for i in range(entry["warmup"] + entry["count"]):
                if i == entry["warmup"]:
                    cpu0 = time.process_time_ns()
                slot = cons.read(ACK_TIMEOUT_S)
                if slot is None:
                    raise TimeoutError(f"no ring message within {ACK_TIMEOUT_S} s")
                t_view = time.monotonic_ns()  # read() returned: slot.tensor is a zero-copy view of the slot
                m = slot.meta
                slot.release()
                ack.send(m.seq.to_bytes(8, "little"))
                if i >= entry["warmup"]:
                    recs.append([m.seq, m.t_write_start_ns, m.t_publish_ns, t_view])
            out.append({"size_mib": entry["size_mib"], "records": recs,
                        "cpu_ms": (time.process_time_ns() - cpu0) / 1e6})
    return {"sizes": out}


def rclpy_publisher_task(chan, *, topic: str, schedule: list[dict], ack_fd: int, threads: int = 1,
                         discovery_timeout_s: float = 60.0, max_seconds_per_size: float = 90.0) -> dict:
    """Publisher end of an rclpy variant (environment set by the parent). Stops a size early, after at least
    10 measured messages, once it has taken ``max_seconds_per_size``. Returns per size the send instants
    {seq: t0_ns} of measured messages, CPU ms over them, lost messages and the measured count."""
    import torch

    torch.set_num_threads(threads)
    import rclpy
    from sensor_msgs.msg import Image

    ack = socket.socket(fileno=ack_fd)
    rclpy.init()
    node = rclpy.create_node("bench_handoff_pub_" + uuid.uuid4().hex[:8])
    try:
        pub = node.create_publisher(Image, topic, 10)
        deadline = time.monotonic() + discovery_timeout_s
        while pub.get_subscription_count() < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("rclpy subscriber not discovered")
            time.sleep(0.01)
        chan.send({"type": "ready"})
        chan.recv(ATTACH_TIMEOUT_S)  # "go"
        seq, out = 0, []
        for entry in schedule:
            src = torch.randn(payload_shape(entry["size_mib"])).to(torch.bfloat16)
            msg = Image()
            msg.height, msg.encoding, msg.is_bigendian = 1, "mono8", 0
            lost, sent, cpu0, t_start = 0, {}, time.process_time_ns(), time.monotonic()
            n_meas = 0
            for i in range(entry["warmup"] + entry["count"]):
                measured = i >= entry["warmup"]
                if i == entry["warmup"]:
                    cpu0, t_start = time.process_time_ns(), time.monotonic()
                elif measured and n_meas >= 10 and time.monotonic() - t_start > max_seconds_per_size:
                    break
                seq += 1
                t0 = time.monotonic_ns()
                data = src.view(torch.uint8).numpy().tobytes()  # the one copy out of the tensor
                msg.data = data  # bytes: rclpy stores them as array('B') in one C copy
                msg.width = msg.step = len(data)
                msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(t0, 1_000_000_000)
                msg.header.frame_id = str(seq)
                pub.publish(msg)
                ok = _wait_ack(ack, seq, ACK_TIMEOUT_S if measured else WARMUP_ACK_TIMEOUT_S)
                if measured:
                    n_meas += 1
                    if ok:
                        sent[seq] = t0
                    else:
                        lost += 1
            out.append({"size_mib": entry["size_mib"], "sent": sent, "lost": lost, "measured": n_meas,
                        "requested": entry["count"], "cpu_ms": (time.process_time_ns() - cpu0) / 1e6})
            time.sleep(0.05)  # let the subscriber finish its bookkeeping for this size
        return {"sizes": out}
    finally:
        node.destroy_node()
        rclpy.shutdown()


def rclpy_subscriber_task(chan, *, topic: str, ack_fd: int, threads: int = 1,
                          discovery_timeout_s: float = 60.0) -> dict:
    """Subscriber end of an rclpy variant. Acknowledges every message; records [seq, t_view_ns, nbytes] and the
    process CPU time after each acknowledgement, until the parent sends ``stop``."""
    import torch

    torch.set_num_threads(threads)
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import Image

    ack = socket.socket(fileno=ack_fd)
    rclpy.init()
    node = rclpy.create_node("bench_handoff_sub_" + uuid.uuid4().hex[:8])
    records = []  # [seq, t_view_ns, nbytes, cpu_ns after the acknowledgement]

    def on_msg(msg) -> None:
        view = torch.frombuffer(msg.data, dtype=torch.uint8)  # zero-copy view of the received bytes
        t_view = time.monotonic_ns()
        seq = int(msg.header.frame_id)
        ack.send(seq.to_bytes(8, "little"))
        records.append([seq, t_view, int(view.numel()), time.process_time_ns()])

    try:
        sub = node.create_subscription(Image, topic, on_msg, 10)
        deadline = time.monotonic() + discovery_timeout_s
        while sub.get_publisher_count() < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("rclpy publisher not discovered")
            time.sleep(0.01)
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        cpu_start = time.process_time_ns()
        chan.send({"type": "ready"})
        while not chan.poll():
            executor.spin_once(timeout_sec=0.05)
        chan.recv(1.0)  # "stop"
        executor.remove_node(node)
        return {"records": records, "cpu_start_ns": cpu_start}
    finally:
        node.destroy_node()
        rclpy.shutdown()


#: What the zero-copy figures measure (also in the JSON, ``zero_copy_definition``).
ZERO_COPY_DEFINITION = (
    "hand-off = from the prefix's output being complete in the transport's memory (the ring slot / the iceoryx2 "
    "loan it was produced in; ring: FrameMeta.t_publish_ns, taken on entry to publish) to the consumer holding a "
    "zero-copy tensor view of it (CLOCK_MONOTONIC); frame gap = producer sleep after each acknowledgement")


def _add_zero_copy(row: dict, size: float, zc: dict) -> None:
    """Put the zero-copy figures of one size into its row: ``zero_copy``, ``zero_copy_block``, ``iceoryx2``
    ({gap_key: summary} or {"skipped": reason}), and the ratios iceoryx2 / ring (p50 and p99) per gap."""
    methods = zc["methods"]
    for m in ("zero_copy", "zero_copy_block"):
        row[m] = methods[m].get(size, {})
    if "iceoryx2" in methods:
        row["iceoryx2"] = methods["iceoryx2"].get(size, {})
        ratios = {}
        for gap, ours in row["zero_copy"].items():
            theirs = row["iceoryx2"].get(gap)
            if theirs and ours["handoff_ms"]["n"] and theirs["handoff_ms"]["n"]:
                ratios[gap] = {q: theirs["handoff_ms"][q] / ours["handoff_ms"][q] for q in ("p50", "p99")}
        row["ratio_iceoryx2_over_zero_copy"] = ratios
    else:
        row["iceoryx2"] = {"skipped": zc["iceoryx2"].get("skipped", "not run")}
        row["ratio_iceoryx2_over_zero_copy"] = {}


# ------------------------------------------------------------------------------------------ orchestration

def run_ring(schedule: list[dict], producer_cores, consumer_cores, *, threads: int = 1, memcpy_count: int = 100,
             log=print) -> tuple[dict, dict]:
    """Run the ring producer and consumer workers; returns (producer result, consumer result)."""
    from ...transport.ring import segment_name

    segment = segment_name(f"bench_{uuid.uuid4().hex[:10]}")
    a, b = _ack_pair()
    try:
        with Worker("ring_producer", {"segment": segment, "schedule": schedule, "ack_fd": a.fileno(),
                                      "threads": threads, "memcpy_count": memcpy_count},
                    cores=producer_cores, extra_fds=(a.fileno(),)) as prod, \
                Worker("ring_consumer", {"segment": segment, "schedule": schedule, "ack_fd": b.fileno(),
                                         "threads": threads}, cores=consumer_cores, extra_fds=(b.fileno(),)) as cons:
            prod.recv(ATTACH_TIMEOUT_S, expect="ready")
            cons.recv(ATTACH_TIMEOUT_S, expect="ready")
            prod.send({"type": "go"})
            budget = 60 + sum(e["warmup"] + e["count"] for e in schedule) * 1.0
            p = prod.result(budget)
            c = cons.result(60)
            log(f"  ring: {len(schedule)} sizes done")
            return p, c
    finally:
        a.close()
        b.close()


def run_rclpy(variant: str, schedule: list[dict], publisher_cores, subscriber_cores, *, threads: int = 1,
              max_seconds_per_size: float = 90.0, log=print) -> tuple[dict, dict]:
    """Run one rclpy variant in a fresh publisher and subscriber process; returns (publisher, subscriber)."""
    env_extra, _label = RCLPY_VARIANTS[variant]
    env = ros_env(random.randint(1, 100), env_extra)
    topic = f"bench_handoff_{uuid.uuid4().hex[:10]}"
    a, b = _ack_pair()
    try:
        with Worker("rclpy_publisher", {"topic": topic, "schedule": schedule, "ack_fd": a.fileno(),
                                        "threads": threads, "max_seconds_per_size": max_seconds_per_size},
                    cores=publisher_cores, env=env, extra_fds=(a.fileno(),)) as pub, \
                Worker("rclpy_subscriber", {"topic": topic, "ack_fd": b.fileno(), "threads": threads},
                       cores=subscriber_cores, env=env, extra_fds=(b.fileno(),)) as sub:
            pub.recv(ATTACH_TIMEOUT_S, expect="ready")
            sub.recv(ATTACH_TIMEOUT_S, expect="ready")
            pub.send({"type": "go"})
            budget = 120 + len(schedule) * (max_seconds_per_size + 2 * ACK_TIMEOUT_S)
            p = pub.result(budget)
            sub.send({"type": "stop"})
            s = sub.result(60)
            log(f"  rclpy {variant}: {len(schedule)} sizes done")
            return p, s
    finally:
        a.close()
        b.close()


def _cpu(producer_ms: float, consumer_ms: float, n: int) -> dict:
    n = max(n, 1)
    return {"producer": producer_ms / n, "consumer": consumer_ms / n, "total": (producer_ms + consumer_ms) / n}


def summarize_ring(prod: dict, cons: dict) -> dict[float, dict]:
    """Per size (MiB): ``memcpy`` and ``ring`` summaries (ms) from the two workers' raw results."""
    out = {}
    for p, c in zip(prod["sizes"], cons["sizes"]):
        recs = c["records"]
        lat = [(r[3] - r[1]) / 1e6 for r in recs]
        n = len(recs)
        nbytes = payload_bytes(p["size_mib"])
        mem = percentiles(p["memcpy_ms"])
        out[p["size_mib"]] = {
            "memcpy": {"latency_ms": mem, "bandwidth_gb_s": nbytes / (mem["p50"] * 1e-3) / 1e9 if mem["n"] else None},
            "memcpy_after_wait": {"latency_ms": percentiles(p["memcpy_after_wait_ms"]), "wait_ms": p["wait_ms"]},
            "ring": {"latency_ms": percentiles(lat),
                     "copy_ms": percentiles([(r[2] - r[1]) / 1e6 for r in recs]),
                     "publish_to_view_ms": percentiles([(r[3] - r[2]) / 1e6 for r in recs]),
                     "cpu_ms_per_msg": _cpu(p["cpu_ms"], c["cpu_ms"], n), "n": n, "lost": p["lost"],
                     "dropped": ProducerStats.from_dict(prod["ring_stats"]).dropped_oldest},
        }
    return out


def summarize_rclpy(pub: dict, sub: dict) -> dict[float, dict]:
    """Per size (MiB): latency (ms), CPU per message (ms), delivered / lost counts of one rclpy variant.

    The subscriber's CPU window of a size runs from its acknowledgement of the message just before the first
    measured one (or its start) to its acknowledgement of the last measured one."""
    by_seq = {r[0]: r for r in sub["records"]}
    ordered = sorted(sub["records"])
    out = {}
    for p in pub["sizes"]:
        sent = {int(k): v for k, v in p["sent"].items()}
        lat = [(by_seq[s][1] - t0) / 1e6 for s, t0 in sorted(sent.items()) if s in by_seq]
        if sent:
            first, last = min(sent), max(sent)
            before = [r for r in ordered if r[0] < first]
            cpu_a = before[-1][3] if before else sub["cpu_start_ns"]
            cpu_b = by_seq[last][3] if last in by_seq else cpu_a
            sub_cpu_ms = (cpu_b - cpu_a) / 1e6
        else:
            sub_cpu_ms = 0.0
        n = len(lat)
        out[p["size_mib"]] = {"latency_ms": percentiles(lat), "cpu_ms_per_msg": _cpu(p["cpu_ms"], sub_cpu_ms, n),
                              "n": n, "lost": p["lost"],
                              "stopped_early": p["measured"] < p["requested"]}
    return out


def run_handoff(sizes_mib, *, count: int = 200, warmup: int = 5, rclpy_count: int = 50, rclpy_warmup: int = 3,
                variants=("default", "large_data", "shm_profile"), producer_cores=(0,), consumer_cores=(1,),
                threads: int = 1, max_seconds_per_size: float = 90.0, gaps_ms=(0.0, 20.0, 100.0),
                gap_count: int = 60, block_gaps_ms=(20.0,), zero_copy: bool = True, rt_priority: int = 0,
                log=print) -> dict:
    """The whole hand-off part; returns its JSON section (see :func:`hybrid_vla_ros.tools.bench.report.validate`;
    its keys are listed in :mod:`hybrid_vla_ros.tools.bench.report`). ``gaps_ms``: frame gaps of the
    zero-copy runs (0: back to back, ``count`` messages; others ``gap_count`` each); ``block_gaps_ms``: gaps of
    the spin-off run; ``zero_copy`` False leaves the zero-copy and iceoryx2 runs out."""
    sizes = [float(s) for s in sizes_mib]
    zc = None
    if zero_copy:
        from .zero_copy import run_zero_copy

        zc = run_zero_copy(sizes, gaps_ms=gaps_ms, count=count, gap_count=gap_count, warmup=warmup,
                           block_gaps_ms=block_gaps_ms, producer_cores=producer_cores,
                           consumer_cores=consumer_cores, threads=threads, rt_priority=rt_priority, log=log)
    log(f"hand-off: sizes {sizes} MiB; ring/memcpy {count} messages, rclpy {rclpy_count} (variants "
        f"{', '.join(variants) or 'none'}); producer cores {list(producer_cores)}, consumer {list(consumer_cores)}")
    p, c = run_ring(_schedule(sizes, warmup, count), list(producer_cores), list(consumer_cores), threads=threads,
                    memcpy_count=count, log=log)
    ring = summarize_ring(p, c)
    rclpy_res = {}
    for v in variants:
        pv, sv = run_rclpy(v, _schedule(sizes, rclpy_warmup, rclpy_count), list(producer_cores),
                           list(consumer_cores), threads=threads, max_seconds_per_size=max_seconds_per_size, log=log)
        rclpy_res[v] = summarize_rclpy(pv, sv)
    rows = []
    for s in sizes:
        row = {"size_mib": s, "bytes": payload_bytes(s), "shape": list(payload_shape(s)), "dtype": "bf16",
               **ring[s], "rclpy": {v: rclpy_res[v][s] for v in variants}}
        ring_p50 = row["ring"]["latency_ms"]["p50"]
        row["ratio_ring_over_memcpy_p50"] = ring_p50 / row["memcpy"]["latency_ms"]["p50"]
        row["ratio_ring_over_memcpy_after_wait_p50"] = ring_p50 / row["memcpy_after_wait"]["latency_ms"]["p50"]
        best = min(variants, key=lambda v: row["rclpy"][v]["latency_ms"]["p50"]) if variants else None
        row["best_rclpy"] = best
        row["ratio_best_rclpy_over_ring_p50"] = (row["rclpy"][best]["latency_ms"]["p50"] / ring_p50) if best else None
        row["ratio_rclpy_over_ring_p50"] = {v: row["rclpy"][v]["latency_ms"]["p50"] / ring_p50 for v in variants}
        if zc is not None:
            _add_zero_copy(row, s, zc)
        rows.append(row)
    extra = {}
    if zc is not None:
        from .zero_copy import SPIN, gap_key

        extra = {"gaps_ms": [float(g) for g in gaps_ms], "gap_count": gap_count,
                 "block_gaps_ms": [float(g) for g in block_gaps_ms], "spin": dict(SPIN),
                 "iceoryx2": zc["iceoryx2"], "gap_keys": [gap_key(g) for g in gaps_ms], "rt_priority": rt_priority,
                 "zero_copy_definition": ZERO_COPY_DEFINITION}
    return {
        **extra,
        "payload": "bf16 (S * 2**20 / 8192, 4096) tensor, exactly S MiB",
        "method": "ack per message (AF_UNIX SEQPACKET); latency = producer write start -> consumer view ready "
                  "(CLOCK_MONOTONIC); CPU/msg = (producer + consumer process CPU, user+sys, all threads) / messages",
        "count": count, "warmup": warmup, "rclpy_count": rclpy_count, "rclpy_warmup": rclpy_warmup,
        "variants": {v: RCLPY_VARIANTS[v][1] for v in variants},
        "producer_cores": list(producer_cores), "consumer_cores": list(consumer_cores), "torch_threads": threads,
        "sizes": rows,
    }
