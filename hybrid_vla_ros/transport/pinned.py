"""Device-to-host copy of the hidden states into a ring slot for a CUDA prefix.

A copy into pageable memory is staged by the CUDA driver through its own pinned buffer and is synchronous; into
page-locked memory it is one DMA on its own stream. So the whole mapping is registered as page-locked
(``cudaHostRegister``, CUDA Runtime API, via ``torch.cuda.cudart()``) and copied into with ``non_blocking=True`` on
a dedicated stream, synchronised before publish.

Modes (:attr:`SlotCopier.mode`): ``registered`` (DMA straight into the slot), ``staging`` (registration refused,
e.g. by RLIMIT_MEMLOCK: DMA into a pinned one-slot buffer, then a host copy), ``pageable`` (plain ``copy_``: CPU
source, or nothing better available).
"""
from __future__ import annotations

import mmap

import torch

__all__ = ["SlotCopier", "CUDA_HOST_REGISTER_PORTABLE"]

#: cudaHostRegisterPortable (cuda_runtime_api.h): the memory is page-locked for every CUDA context.
CUDA_HOST_REGISTER_PORTABLE = 1


def _default_cudart():
    try:
        return torch.cuda.cudart() if torch.cuda.is_available() else None
    except (AssertionError, RuntimeError, AttributeError):  # CPU build or no driver
        return None


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class SlotCopier:
    """Copies a prefix's hidden states (on ``device``; CPU: ``pageable``) into ``producer``'s slots, registering its
    mapping until :meth:`close`.

    ``cudart`` (default: ``torch.cuda.cudart()`` when available; its ``cudaHostRegister`` / ``cudaHostUnregister``
    return a cudaError code, 0: success) and ``pinned_alloc`` (``nbytes -> uint8 tensor`` in page-locked memory,
    for ``staging``) are injectable for tests. Attributes: ``mode`` (module docstring), ``reason`` (why not
    ``registered``). Never raises for a refused registration or pinning: it falls back and says why.
    """

    def __init__(self, producer, device, *, cudart=None, pinned_alloc=_pinned):
        self.device = torch.device(device)
        self.mode, self.reason = "pageable", ""
        self._cudart, self._ptr, self._keep, self._staging, self._stream = None, None, None, None, None
        if self.device.type != "cuda":
            self.reason = f"hidden states on {self.device.type}: a plain copy"
            return
        cudart = cudart if cudart is not None else _default_cudart()
        mm: mmap.mmap = producer.mapping()
        base = torch.frombuffer(mm, dtype=torch.uint8, count=1)  # the mapping's first byte: its address
        ptr, size = base.data_ptr(), -(-producer.total_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if cudart is None:
            self.reason = "no CUDA runtime binding"
        else:
            try:
                err = int(cudart.cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE))
            except Exception as e:  # noqa: BLE001 - any failure means: use the fallback
                err, self.reason = -1, f"cudaHostRegister raised {type(e).__name__}: {e}"
            if err == 0:
                self.mode, self._cudart, self._ptr, self._keep = "registered", cudart, ptr, base
            else:
                if not self.reason:
                    self.reason = f"cudaHostRegister of the shared mapping returned error {err}"
                self._clear_error(cudart)
        if self.mode != "registered":
            try:
                self._staging = pinned_alloc(producer.slot_bytes)
                self.mode = "staging"
            except (RuntimeError, AssertionError) as e:
                self.reason += f"; no pinned staging buffer either ({e})"
        if self.mode != "pageable" and torch.cuda.is_available():
            self._stream = torch.cuda.Stream(self.device)

    @staticmethod
    def _clear_error(cudart) -> None:
        """Reset the CUDA runtime's last error after a refused registration (``cudaGetLastError`` "returns the last
        error ... and resets it to cudaSuccess"); else torch's next CUDA call would raise it as its own."""
        get_last = getattr(cudart, "cudaGetLastError", None)
        if get_last is not None:
            try:
                get_last()
            except Exception:  # noqa: BLE001 - clearing is best effort; the fallback still runs
                pass

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` (device tensor) into ``dst`` (a slot's CPU view, same shape and dtype); complete on return."""
        if self.mode == "pageable":
            dst.copy_(src)
            return
        stream = self._stream
        if self.mode == "registered":
            target = dst
        else:
            nbytes = dst.numel() * dst.element_size()
            target = self._staging[:nbytes].view(dst.dtype).view(dst.shape)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # src is complete on the compute stream
            with torch.cuda.stream(stream):
                target.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            target.copy_(src)
        if target is not dst:
            dst.copy_(target)

    def close(self) -> None:
        """Unregister the mapping (idempotent). Call before the producer closes."""
        if self._cudart is not None and self._ptr is not None:
            try:
                self._cudart.cudaHostUnregister(self._ptr)
            finally:
                self._ptr, self._keep = None, None
        self._staging = None
