"""Kill a ring producer inside publish, over and over, and check every frame a consumer then finds.

Helpers only (no tests): ``test_ring_protocol.py`` runs this file as a script, ``python ring_faults.py MODE
NAME COUNT [SEED [locked]]`` (``locked``: publish under the mutex, as on CPUs without in-order stores), which
imports torch once and then, COUNT times, forks a child that creates the producer of
segment NAME and publishes frames until it is SIGKILLed; after each death it attaches a consumer to the
dead producer's segment and checks every READY frame against what that seq must carry (:func:`expected`:
stamp, shape, split layer, timings and every payload element derive from the seq, and the shape changes
from frame to frame). Modes:

* ``points``: the child counts the *field stores* into the segment that the ring code makes through its
  ``struct.Struct`` objects (every ``Struct`` of the ring's modules is replaced by :class:`StoreCounter`,
  which writes the fields one by one in format order, as CPython's ``pack_into`` does, and SIGKILLs its own
  process after store number ``k``); iteration ``k`` kills at store ``k`` after three normal frames, so
  COUNT iterations cover every point between two field writes of acquire and publish for the first frames.
* ``random``: the parent SIGKILLs the child at a random moment 0-2 ms into its publish loop (a 256-byte frame
  takes a few microseconds of ring code, so most kills land inside acquire / publish).

The last stdout line is a JSON summary: iterations, frames checked, inconsistent frames (the first 10),
how many, rejected slots, iterations whose kill left a WRITING slot.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import sys
import time

N_SLOTS = 4
COLS = 16


def expected(seq: int) -> dict:
    """What frame ``seq`` carries: shape (1 + seq % 4, 16) float32 filled with seq, stamp 1000 seq + 7, split
    layer seq % 5, timings (preprocess seq ms, prefix seq + 0.5 ms, started at 10**18 + seq ns)."""
    from hybrid_vla_ros.transport.slots import SlotTimings

    return {"shape": (1 + seq % 4, COLS), "stamp": 1000 * seq + 7, "split": seq % 5,
            "timings": SlotTimings(float(seq), seq + 0.5, 10**18 + seq), "value": float(seq)}


def publish_one(prod, torch) -> int:
    seq = prod._next_seq
    e = expected(seq)
    slot = prod.acquire(e["shape"], torch.float32)
    slot.tensor.fill_(e["value"])
    return prod.publish(slot, stamp_ns=e["stamp"], split_layer=e["split"], timings=e["timings"])


class StoreCounter:
    """Stands in for a ``struct.Struct``: reads pass through; ``pack_into`` writes field by field in format
    order and SIGKILLs this process after the ``kill_at``-th field store (counted over every instance)."""

    count = 0
    kill_at = 0
    _TOKEN = re.compile(r"(\d*)([xcbB?hHiIlLqQnNefdspP])")

    def __init__(self, real: struct.Struct):
        self._real = real
        self.format, self.size = real.format, real.size
        order = real.format[0] if real.format[0] in "<>!=@" else "@"
        self._fields = []  # (offset, single-field format, value count)
        offset = 0
        for count, code in self._TOKEN.findall(real.format.lstrip("<>!=@")):
            n = int(count) if count else 1
            if code == "x":
                offset += n
            elif code in "sp":
                self._fields.append((offset, f"{order}{n}{code}", 1))
                offset += n
            else:
                for _ in range(n):
                    self._fields.append((offset, order + code, 1))
                    offset += struct.calcsize(order + code)

    def pack_into(self, buf, offset: int, *values) -> None:
        for (field_offset, fmt, _), value in zip(self._fields, values):
            struct.pack_into(fmt, buf, offset + field_offset, value)
            StoreCounter.count += 1
            if StoreCounter.count == StoreCounter.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name):
        return getattr(self._real, name)


def install_store_counters(kill_at: int) -> int:
    """Replace every ``struct.Struct`` the ring writes the segment with: those of the header layouts' field groups
    (``transport.layout``) and any module-level one of the loaded ``hybrid_vla_ros.transport`` modules; returns
    how many were replaced."""
    from hybrid_vla_ros.transport import layout

    StoreCounter.count, StoreCounter.kill_at = 0, kill_at
    n = 0
    for header in (layout.GLOBAL, layout.SLOT):
        for group in header.groups.values():
            if isinstance(group.struct, struct.Struct):
                group.struct = StoreCounter(group.struct)
                n += 1
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("hybrid_vla_ros.transport"):
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, struct.Struct):
                setattr(mod, attr, StoreCounter(value))
                n += 1
    return n


def check_segment(name: str, torch, ring) -> dict:
    """Attach to the (dead) producer's segment and check every READY frame; detaches."""
    out = {"frames": 0, "bad": [], "rejected": 0, "writing": 0}
    try:
        cons = ring.RingConsumer(name)
    except FileNotFoundError:
        return out
    with cons:
        out["writing"] = cons.slot_states().count("WRITING")
        while True:
            try:
                slot = cons.read(0)
            except ring.SlotRejected as e:
                out["rejected"] += 1
                out["bad"].append(f"rejected {e.cause}")
                continue
            if slot is None:
                break
            with slot:
                m, e = slot.meta, expected(slot.meta.seq)
                got = {"shape": m.shape, "stamp": m.stamp_ns, "split": m.split_layer, "timings": m.timings}
                ok = all(got[k] == e[k] for k in got) and bool((slot.tensor == e["value"]).all()) \
                    and m.t_write_start_ns <= m.t_publish_ns
                if not ok:
                    out["bad"].append(f"seq {m.seq}: {got} != {e}")
                out["frames"] += 1
    return out


def main(argv: list[str]) -> int:
    mode, name, count = argv[1], argv[2], int(argv[3])
    import torch

    torch.set_num_threads(1)
    from hybrid_vla_ros.transport import ring

    if len(argv) > 5 and argv[5] == "locked":  # the publish of CPUs without in-order stores, under the mutex
        from hybrid_vla_ros.transport import slots

        slots.STORES_VISIBLE_IN_ORDER = False
    cap = ring.slot_bytes_for((4, COLS), torch.float32)
    rng = random.Random(int(argv[4]) if len(argv) > 4 else 0)
    summary = {"mode": mode, "iterations": 0, "frames": 0, "bad": [], "bad_count": 0, "rejected": 0,
               "left_writing": 0, "struct_objects": 0}
    for k in range(1, count + 1):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the producer child: never returns
            os.close(r)
            try:
                prod = ring.RingProducer(name, N_SLOTS, cap, model_id=11)
                if mode == "points":
                    for _ in range(3):
                        publish_one(prod, torch)
                    os.write(w, install_store_counters(k).to_bytes(4, "little"))
                else:
                    os.write(w, b"\0\0\0\0")
                while True:
                    publish_one(prod, torch)
            finally:
                os._exit(3)  # only reached on an error: a kill never returns
        os.close(w)
        got = os.read(r, 4)
        os.close(r)
        summary["struct_objects"] = max(summary["struct_objects"], int.from_bytes(got or b"\0\0\0\0", "little"))
        if mode == "random":
            time.sleep(rng.uniform(0.0, 0.002))
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            summary["bad"].append(f"iteration {k}: the producer ended with status {status}, not SIGKILL")
            continue
        res = check_segment(name, torch, ring)
        summary["iterations"] += 1
        summary["frames"] += res["frames"]
        summary["rejected"] += res["rejected"]
        summary["left_writing"] += res["writing"] > 0
        summary["bad_count"] += len(res["bad"])
        summary["bad"] += res["bad"][: max(0, 10 - len(summary["bad"]))]
    with ring.RingProducer(name, N_SLOTS, cap, model_id=11):  # replaces the last dead segment, removed at exit
        pass
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
