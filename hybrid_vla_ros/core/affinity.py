"""Pin a whole process (every thread) to a core set, early enough that no thread escapes.

``os.sched_setaffinity(0, cores)`` on Linux pins only the calling thread; threads created *after*
it inherit the mask, threads that already exist keep theirs. torch (OpenMP pool) and rclpy (DDS
threads) start threads when imported / initialised, so the suffix node reads ``cpu_affinity`` from
its command line and pins *before* importing either (:func:`affinity_from_ros_args`), then pins
every existing thread again at configure time (:func:`pin_process`) in case the parameter came
from somewhere the early parse could not see.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform``'s guess where that has none)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _parse_core_list(text: str) -> list[int]:
    """'[1, 2]' or '1,2' or '3' -> [1, 2] / [3]. Raises ValueError on anything else."""
    value = yaml.safe_load(text)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"cpu_affinity must be a list of core indices, got {text!r}")
    return value


def _from_params_file(path: str, node_names: set[str], param: str) -> list[int] | None:
    data = yaml.safe_load(Path(path).read_text()) or {}
    found = None
    for key, section in data.items():
        if not isinstance(section, dict):
            continue
        # Keys: '/**', 'node', '/node', '/ns/node', '/**/node'; nested namespaces are not flattened here.
        name = key.rsplit("/", 1)[-1]
        if key == "/**" or name in node_names:
            params = section.get("ros__parameters", {})
            if isinstance(params, dict) and param in params:
                value = params[param]
                found = _parse_core_list(str(value)) if not isinstance(value, list) else list(value)
    return found


def affinity_from_ros_args(argv: list[str], node_names: set[str], param: str = "cpu_affinity") -> list[int] | None:
    """Find ``param`` in ROS command-line arguments before rclpy is initialised.

    Reads ``-p name:=value`` / ``--param name:=value`` (also ``node:name:=value``) and
    ``--params-file FILE`` entries after ``--ros-args``, last one winning as in rcl. Returns the core
    list, or None when the parameter is not given. Raises ValueError on a malformed value.
    """
    result = None
    in_ros = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--ros-args":
            in_ros = True
        elif arg == "--":
            in_ros = False
        elif in_ros and arg in ("-p", "--param") and i + 1 < len(argv):
            i += 1
            name, sep, value = argv[i].partition(":=")
            node, _, pname = name.rpartition(":")
            if sep and pname == param and (not node or node in node_names):
                result = _parse_core_list(value)
        elif in_ros and arg == "--params-file" and i + 1 < len(argv):
            i += 1
            value = _from_params_file(argv[i], node_names, param)
            if value is not None:
                result = value
        i += 1
    return result


def pin_process(cores: list[int]) -> list[int]:
    """Pin the calling thread, every existing thread of this process and all future ones to ``cores``.

    Returns the thread ids that were pinned. Raises ValueError for an empty list or a core this
    process may not use (OSError from the kernel is turned into ValueError with the core set).
    """
    if not cores:
        raise ValueError("cpu_affinity is empty")
    mask = set(cores)
    try:
        os.sched_setaffinity(0, mask)
    except OSError as e:
        raise ValueError(f"cannot pin to cores {sorted(mask)}: {e}") from e
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
