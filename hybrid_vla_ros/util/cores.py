"""CPU cores: core lists as users write them, pinning a whole process, and what the CPU is.

``os.sched_setaffinity(0, cores)`` on Linux pins only the calling thread; threads created *after* it
inherit the mask, threads that already exist keep theirs. torch (OpenMP pool) and rclpy (DDS threads)
start threads when imported / initialised, so a process that must stay on its cores pins before
importing either, and :func:`pin_process` pins every existing thread as well. Both nodes start that way,
through :func:`pin_then_import`.
"""
from __future__ import annotations

import importlib
import os
import platform
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable

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
                raise ValueError(f"{value!r} is not a comma-separated list of core indices "
                                 "(e.g. '6,7', '[6, 7]' or '4-7')")
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


#: Environment variables that size a library's thread pool when it starts it (at import or first use):
#: OpenMP (torch's intra-op pool, and MKL's), MKL, OpenBLAS (numpy, at import) and OpenCV's own pool
#: (``OPENCV_FOR_THREADS_NUM``, read when cv2 starts its pool). :func:`pin_then_import` sets each, where unset.
THREAD_COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENCV_FOR_THREADS_NUM")
#: Top-level modules that start (or size) thread pools when imported or initialised: none of them may be
#: imported before :func:`pin_then_import` has pinned (test/test_params_affinity.py checks both nodes).
POOL_MODULES = ("torch", "cv2", "numpy", "rclpy")


def pin_then_import(read_cores: Callable[[], list[int] | None], module: str) -> tuple[list[int] | None, ModuleType]:
    """Pin this process, size the thread pools to come, and only then import ``module``: how both nodes start.

    ``read_cores()`` gives the node's ``cpu_affinity`` from its command line (the ROS arguments and parameter
    files: :func:`hybrid_vla_ros.ros.params_file.cpu_affinity_from_ros_args`); None when not given, [] when
    given empty. It must import nothing of :data:`POOL_MODULES`. With cores, every thread of the process is
    pinned to them (:func:`pin_process`) and each of :data:`THREAD_COUNT_VARS` not already set is set to their
    number; then ``module`` (the node's module, which imports torch, OpenCV and rclpy) is imported.

    Why in this order: a thread pool is sized from the affinity and these variables as they are when the
    library reads them (OpenMP when torch loads it, OpenBLAS at numpy's import, OpenCV and torch when their
    pools first run), and every new thread inherits the affinity of the thread that starts it. So the pools,
    and the DDS threads ``rclpy.init`` starts later, run on the node's cores with one thread per core; a pin
    after the imports can move the threads that exist, but does not resize a pool sized for every core of
    the machine. A variable the user set is kept. Pinning with one of :data:`POOL_MODULES` imported already
    (a start-up that imported the node first) still pins, with a RuntimeWarning naming them.

    Returns (the cores, the imported module). Raises ValueError (``read_cores``' errors, e.g. a
    ParamsFileError, or :func:`pin_process`'s for cores this process may not use) before importing anything;
    ImportError from ``module``.
    """
    cores = read_cores()
    if cores:
        early = [m for m in POOL_MODULES if m in sys.modules]
        if early:
            warnings.warn(f"pinning to cores {sorted(set(cores))} with {', '.join(early)} imported already: "
                          f"their thread pools may be sized for every core", RuntimeWarning, stacklevel=2)
        pin_process(cores)
        for var in THREAD_COUNT_VARS:
            os.environ.setdefault(var, str(len(cores)))
    return cores, importlib.import_module(module)


def thread_affinities() -> dict[int, set[int]]:
    """Current core set of every thread of this process, by thread id."""
    out = {}
    for entry in Path("/proc/self/task").iterdir():
        try:
            out[int(entry.name)] = os.sched_getaffinity(int(entry.name))
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out
