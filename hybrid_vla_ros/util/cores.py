"""CPU cores: core lists as users write them, pinning a whole process, and what the CPU is.

``os.sched_setaffinity(0, cores)`` on Linux pins only the calling thread; threads created *after* it
inherit the mask, threads that already exist keep theirs. torch (OpenMP pool) and rclpy (DDS threads)
start threads when imported / initialised, so a process that must stay on its cores pins before
importing either, and :func:`pin_process` pins every existing thread as well.
"""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_core_list(value) -> list[int]:
    """Core indices from what a user writes, sorted and without repeats.

    Accepts an int (``3``), a list or tuple of ints (``[6, 7]``, what a YAML or ROS parameter gives), or a
    string: ``"1,2"``, ``"[1, 2]"``, ``"3"``, with ranges ``"0-3"`` as in ``taskset -c``. Raises ValueError
    for anything else, a negative index or an empty list, naming the value.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a list of core indices")
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{value!r} is not a list of core indices")
        items = list(value)
    elif isinstance(value, str):
        items = []
        for part in value.strip().strip("[]").split(","):
            if not part.strip():
                continue
            span = _RANGE.match(part)
            if span:
                lo, hi = int(span.group(1)), int(span.group(2))
                if hi < lo:
                    raise ValueError(f"{value!r}: range {part.strip()!r} runs backwards")
                items.extend(range(lo, hi + 1))
            elif part.strip().isdigit():
                items.append(int(part))
            else:
                raise ValueError(f"{value!r} is not a comma-separated list of core indices (e.g. '6,7', '[6, 7]' or '4-7')")
    else:
        raise ValueError(f"{value!r} is not a list of core indices")
    if not items:
        raise ValueError(f"{value!r}: no core given")
    if min(items) < 0:
        raise ValueError(f"{value!r}: core indices are >= 0")
    return sorted(set(items))


def usable_cores() -> list[int]:
    """The cores this process may run on (``sched_getaffinity``), sorted."""
    return sorted(os.sched_getaffinity(0))


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from ``cpuinfo`` (Linux's /proc/cpuinfo; ``platform``'s guess where that has none)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pin_process(cores: list[int]) -> list[int]:
    """Pin the calling thread, every existing thread of this process and all future ones to ``cores``.

    Returns the thread ids that were pinned. Raises ValueError for an empty list or a core this
    process may not use (OSError from the kernel is turned into ValueError with the core set).
    """
    if not cores:
        raise ValueError("cpu_affinity is empty")
    mask = set(cores)
    usable = sorted(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, mask)
    except OSError as e:
        missing = sorted(mask - set(usable))
        why = (f"cores {missing} do not exist or are not available to this process (it may use {usable})"
               if missing else str(e))
        raise ValueError(f"cannot pin to cores {sorted(mask)}: {why}") from e
    pinned = []
    for entry in Path("/proc/self/task").iterdir():
        tid = int(entry.name)
        try:
            os.sched_setaffinity(tid, mask)
            pinned.append(tid)
        except (ProcessLookupError, FileNotFoundError):  # thread ended meanwhile
            continue
    return pinned


def thread_affinities() -> dict[int, set[int]]:
    """Current core set of every thread of this process, by thread id."""
    out = {}
    for entry in Path("/proc/self/task").iterdir():
        try:
            out[int(entry.name)] = os.sched_getaffinity(int(entry.name))
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out
