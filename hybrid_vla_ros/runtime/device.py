"""Process-level settings of a runner: the torch device it computes on and how glibc keeps frame buffers."""
from __future__ import annotations

import torch

#: glibc ``mallopt`` parameters (malloc.h): M_TRIM_THRESHOLD, M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_frame_buffers(mmap_threshold: int = 32 * 2**20, trim_threshold: int = 128 * 2**20) -> bool:
    """Make glibc malloc keep the memory of freed camera frames for the next frame (process-wide).

    By default glibc serves blocks over its dynamic mmap threshold (a decoded 1936 x 1216 RGB image is
    7 MB) with ``mmap`` and gives them back with ``munmap`` when freed, so every frame pays for unmapping
    six images after publishing and for page-faulting six fresh ones while decoding (measured here: 1.6 ms
    per frame after publishing, and decoding 24 % slower). Raising ``M_MMAP_THRESHOLD`` (bytes; glibc's
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


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cpu', 'cuda', 'cuda:N' as given.

    Raises ValueError when CUDA is asked for and not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device
