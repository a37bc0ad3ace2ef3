"""Process-level settings of a runner: the torch device it computes on and how glibc keeps frame buffers."""
from __future__ import annotations

import torch

#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_frame_buffers(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 128 * 2**20) -> bool:
    """Make glibc malloc keep the memory of freed camera frames for the next frame (process-wide).

    By default glibc serves blocks over its dynamic mmap threshold (a decoded 1936 x 1216 RGB image is
    7 MB) with ``mmap`` and gives them back with ``munmap`` when freed, so every frame pays for unmapping
    six images after publishing and for page-faulting six fresh ones while decoding (the cost per frame:
    docs/performance.md). Raising ``M_MMAP_THRESHOLD`` (bytes; glibc's
    maximum on 64-bit is 32 MiB) keeps such blocks in the heap, and ``M_TRIM_THRESHOLD`` (bytes) stops the
    heap top from being returned after each frame. Returns False (nothing changed) where ``mallopt`` is not
    glibc's. Same effect as the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment variables.
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
    """Check a device string against what the machine has (pure: no CUDA call); return the canonical name.

    ``name``: ``auto`` (-> ``cuda:0`` when CUDA is available, else ``cpu``), ``cpu``, ``cuda`` (-> ``cuda:0``)
    or ``cuda:N``. ``cuda_available`` / ``device_count``: ``torch.cuda.is_available()`` /
    ``torch.cuda.device_count()``. Returns ``"cpu"`` or ``"cuda:N"``. Raises ValueError for another device
    type, a malformed index, CUDA asked for where it is absent, or an index >= ``device_count`` (the message
    names the devices there are).
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
    """'auto' -> cuda:0 when available else cpu; 'cpu', 'cuda' (= cuda:0), 'cuda:N' checked against
    ``torch.cuda.device_count()`` (:func:`parse_device`).

    A CUDA device is made the process's current device (``torch.cuda.set_device``), so allocations and kernels
    that do not name a device (torch's defaults, safetensors, transformers' buffers) land on it too. Raises
    ValueError when CUDA is asked for and not available, or for an index the machine does not have.
    """
    available = torch.cuda.is_available()
    device = torch.device(parse_device(name, available, torch.cuda.device_count() if available else 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def cuda_memory(device: torch.device | str | None = None) -> dict:
    """Memory figures of a CUDA device, bytes: ``allocated`` (tensors alive, ``torch.cuda.memory_allocated``),
    ``reserved`` (held by this process's caching allocator, ``memory_reserved``), ``peak_allocated`` /
    ``peak_reserved`` (since the last ``torch.cuda.reset_peak_memory_stats``), and driver-level ``free`` /
    ``total`` / ``used`` = total - free (``torch.cuda.mem_get_info``: every process and context on the device,
    the figure another process sees). Returns {} where CUDA is not available or ``device`` is a CPU device.
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
    """The fraction of a device's ``total_bytes`` that a ``budget_bytes`` cap is, for
    ``torch.cuda.set_per_process_memory_fraction`` (pure). Raises ValueError for a budget <= 0 or a total <= 0;
    a budget over the total gives 1.0 (no cap beyond the device itself)."""
    if budget_bytes <= 0 or total_bytes <= 0:
        raise ValueError(f"GPU budget {budget_bytes} bytes of a {total_bytes}-byte device: both must be > 0")
    return min(1.0, budget_bytes / total_bytes)


def cap_device_memory(device: torch.device, budget_bytes: int) -> float:
    """Cap this process's CUDA caching allocator on ``device`` at ``budget_bytes`` (an allocation past it raises
    ``torch.OutOfMemoryError`` instead of taking memory other processes need). Returns the fraction set; 1.0 and
    nothing set on a CPU device. Raises ValueError as :func:`budget_fraction`."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1.0
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = budget_fraction(int(budget_bytes), int(total))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
