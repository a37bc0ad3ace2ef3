"""Section 5, ``handoff``: the device-to-host copy of ``orion``'s hidden states into a ring slot, pageable vs
page-locked (registered mapping; pinned staging). On the CPU a host copy into the slot (the device paths need
CUDA)."""
from __future__ import annotations

import math
import os
import time
import uuid

from .common import GB, NEEDS_CUDA, pct, sync


def run(check) -> dict:
    """The section: :func:`handoff_figures` on the check's device, ``check.sizes.reps`` copies per mode."""
    return handoff_figures(str(check.device), reps=check.sizes.reps)


def handoff_figures(device_name: str, reps: int = 20) -> dict:
    """The hand-off of ``orion``'s hidden states (its ``prefix_state_shape``, fp16) into a ring slot, ms per
    copy (median of ``reps``) and GB/s: on CUDA pageable (a plain tensor), the slot with the registered
    (page-locked) mapping, the pinned staging fallback and an unregistered slot; on the CPU a host copy into
    the slot (the device modes need CUDA)."""
    import torch

    from ...model.config import preset
    from ...runtime.device import resolve_device
    from ...transport.pinned import SlotCopier
    from ...transport.ring import RingProducer, segment_name, slot_bytes_for

    cfg = preset("orion")
    shape, dtype = tuple(cfg.prefix_state_shape), torch.float16
    device = resolve_device(device_name)
    nbytes = math.prod(shape) * 2
    out = {"state_shape": list(shape), "dtype": "fp16", "bytes": nbytes, "modes": {}}
    ring = RingProducer(segment_name(f"gpucheck_ho_{os.getpid()}_{uuid.uuid4().hex[:6]}", "/"), 3,
                        slot_bytes_for(shape, dtype), 1,
                        dtype=dtype, state_shape=shape, device=device)

    def timed(fn) -> dict:
        fn()
        sync(device)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        med = sorted(times)[len(times) // 2]
        return {"ms_p50": round(med, 4), "gb_per_s": round(nbytes / (med / 1e3) / GB, 2), "ms": pct(times)}

    try:
        src = torch.randn(shape, device=device).to(dtype)
        slot = ring.acquire(shape, dtype)
        try:
            if device.type != "cuda":
                out["modes"]["cpu_copy_into_slot"] = timed(lambda: slot.tensor.copy_(src))
                out["note"] = (f"pageable vs page-locked device-to-host copies {NEEDS_CUDA}; this is the CPU "
                               "prefix's host copy into the slot (a CPU prefix normally writes in the slot: no copy)")
                return out
            pageable = torch.empty(shape, dtype=dtype)
            out["modes"]["pageable_tensor"] = timed(lambda: pageable.copy_(src))

            class _Refuse:
                @staticmethod
                def cudaHostRegister(ptr, size, flags):
                    return 1  # cudaErrorInvalidValue: forces the fallback

            for label, kwargs in (("registered_slot", {}), ("pinned_staging", {"cudart": _Refuse()}),
                                  ("pageable_slot", {"cudart": _Refuse(), "pinned_alloc": _no_pin})):
                copier = SlotCopier(ring, device, **kwargs)
                try:
                    row = timed(lambda: copier.copy(src, slot.tensor))
                    row["mode"] = copier.mode
                    row["exact"] = bool(torch.equal(slot.tensor, src.cpu()))
                    out["modes"][label] = row
                finally:
                    copier.close()
        finally:
            ring.abort(slot)
    finally:
        ring.close()
    return out


def _no_pin(nbytes: int):
    """A pinned allocator that always fails: the copier's pageable fallback."""
    raise RuntimeError("no pinned memory (forced by the check)")
