"""CPU cores: core lists as users write them, pinning a whole process, and what the CPU is.

``os.sched_setaffinity(0, cores)`` on Linux pins only the calling thread (and threads it creates later), so
:func:`pin_process` pins every existing thread too, and :func:`pin_then_import` pins before torch and rclpy start
their threads.
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
    """Core indices, sorted and unique, from an int, a list or tuple of ints (a YAML or ROS parameter), or a
    string (``"1,2"``, ``"[1, 2]"``, ranges ``"0-3"`` as in ``taskset -c``). Raises ValueError, naming the value,
    for anything else, a negative index or an empty list."""
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
    """Pin every existing and future thread of this process to ``cores``; returns the pinned thread ids. Raises
    ValueError for an empty list or a core this process may not use."""
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


#: Environment variables that size a library's thread pool when it starts it: OpenMP (torch's intra-op pool,
#: MKL's), MKL, OpenBLAS (numpy, at import) and OpenCV (when cv2 starts its pool).
THREAD_COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENCV_FOR_THREADS_NUM")
#: Modules that start or size thread pools when imported or initialised: none may be imported before
#: :func:`pin_then_import` has pinned (test/test_params_affinity.py checks both nodes).
POOL_MODULES = ("torch", "cv2", "numpy", "rclpy")


def pin_then_import(read_cores: Callable[[], list[int] | None], module: str) -> tuple[list[int] | None, ModuleType]:
    """Pin this process, size the thread pools to come, and only then import ``module``: how both nodes start.

    ``read_cores()`` (importing nothing of :data:`POOL_MODULES`) gives the node's ``cpu_affinity``
    (:func:`hybrid_vla_ros.ros.params_file.cpu_affinity_from_ros_args`; None: not given). With cores, every thread
    is pinned (:func:`pin_process`) and each unset :data:`THREAD_COUNT_VARS` set to their number. A pool is sized
    from the affinity and these variables when the library first reads them, and new threads (DDS ones too)
    inherit the affinity, so this gives one thread per node core; a later pin moves threads but cannot resize a
    pool. With a :data:`POOL_MODULES` module already imported it still pins, with a RuntimeWarning.

    Returns (the cores, the module). Raises ValueError (from ``read_cores``, e.g. a ParamsFileError, or
    :func:`pin_process`) before importing anything; ImportError from ``module``.
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
