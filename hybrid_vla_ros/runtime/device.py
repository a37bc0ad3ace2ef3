"""Process-level settings of a runner: the torch device it computes on and how glibc keeps frame buffers."""
from __future__ import annotations

import torch

#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_frame_buffers(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 128 * 2**20) -> bool:
    """Make glibc keep freed camera frames' memory for the next frame (process-wide ``mallopt``).

    A decoded 1936 x 1216 RGB image (7 MB) is over the mmap threshold, so each frame would pay ``munmap`` and page
    faults (docs/performance.md). Thresholds in bytes (mmap: 32 MiB is glibc's 64-bit maximum), as
    ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``. Returns False (nothing changed) without glibc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def parse_device(name: str, cuda_available: bool, device_count: int) -> str:
    """Check ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` against the machine (pure); return ``"cpu"`` or ``"cuda:N"``.

    ``auto`` is ``cuda:0`` when CUDA is available, else ``cpu``. Raises ValueError for another device type, a
    malformed index, CUDA where it is absent, or an index >= ``device_count``.
    """
    text = str(name).strip().lower()
    if text == "auto":
        return "cuda:0" if cuda_available and device_count > 0 else "cpu"
    if text == "cpu":
        return "cpu"
    kind, sep, index = text.partition(":")
    if kind != "cuda" or (sep and not index.isdigit()):
        raise ValueError(f"device {name!r}: use auto, cpu, cuda or cuda:N")
    n = int(index) if sep else 0
    if not cuda_available or device_count <= 0:
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if n >= device_count:
        raise ValueError(f"device {name!r} requested but this machine has {device_count} CUDA device(s) "
                         f"(cuda:0 .. cuda:{device_count - 1})")
    return f"cuda:{n}"


def resolve_device(name: str) -> torch.device:
    """:func:`parse_device` on this machine; a CUDA device becomes current, so unplaced allocations land on it."""
    available = torch.cuda.is_available()
    device = torch.device(parse_device(name, available, torch.cuda.device_count() if available else 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def cuda_memory(device: torch.device | str | None = None) -> dict:
    """Memory figures of a CUDA device (bytes); {} without CUDA or for a CPU device.

    ``allocated`` / ``reserved`` / ``peak_*`` are this process's caching allocator; ``free`` / ``total`` /
    ``used`` come from ``torch.cuda.mem_get_info`` (every process on the device, what another process sees).
    """
    if not torch.cuda.is_available():
        return {}
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": int(torch.cuda.memory_allocated(device)), "reserved": int(torch.cuda.memory_reserved(device)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device)),
            "free": int(free), "total": int(total), "used": int(total - free)}


def budget_fraction(budget_bytes: int, total_bytes: int) -> float:
    """``budget_bytes / total_bytes`` for ``torch.cuda.set_per_process_memory_fraction``, at most 1.0.

    Raises ValueError for a budget or total <= 0."""
    if budget_bytes <= 0 or total_bytes <= 0:
        raise ValueError(f"GPU budget {budget_bytes} bytes of a {total_bytes}-byte device: both must be > 0")
    return min(1.0, budget_bytes / total_bytes)


def cap_device_memory(device: torch.device, budget_bytes: int) -> float:
    """Cap this process's caching allocator on ``device`` at ``budget_bytes`` (past it: ``torch.OutOfMemoryError``).

    Returns the fraction set (1.0, nothing set, on a CPU device); raises as :func:`budget_fraction`."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1.0
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = budget_fraction(int(budget_bytes), int(total))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
