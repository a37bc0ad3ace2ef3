"""What both ends of the ring share: :class:`RingEnd`, the base of :class:`~.producer.RingProducer` and
:class:`~.consumer.RingConsumer`, and the one place that writes and reads the global header's fields.
"""
from __future__ import annotations

import time
import weakref

from . import slots
from .contract import CODE_DTYPES, DEVICE_KINDS, DTYPE_CODES, SIDE_DTYPES, Contract, TensorSpec
from .errors import RingContractError, RingError
from .decode_channel import decode_region_bytes
from .layout import GLOBAL, GLOBAL_HEADER_BYTES, MAX_DECODE_ROWS, MAX_SIDE_TENSORS, SLOT_HEADER_BYTES
from .segment import (
    GLOBAL_MAGIC, LAYOUT_VERSION, MAX_SLOTS, MIN_SLOTS, PAYLOAD_ALIGN, SegmentLock, segment_path,
    validate_segment_name,
)
from .slots import MAX_NDIM, side_layout

__all__ = ["RingEnd"]


class RingEnd:
    """Base of the two ring ends; not used on its own. ``name``: segment name (ValueError for an unsafe one).

    Geometry and owner attributes: ``n_slots``, ``slot_bytes``, ``slot_stride``, ``total_bytes``, ``state_bytes``
    (the hidden states' capacity per payload), ``side_offsets`` (contract order), all in bytes; ``model_id``,
    ``owner_pid``, ``owner_start_time`` (clock ticks), ``instance_id``. A subclass sets them (the consumer by
    :meth:`_read_global_header`), maps the segment into ``_mm``, calls :meth:`_opened` with its handles (whose
    ``close()`` runs once: by :meth:`_shut` or at garbage collection / interpreter exit), then clears ``_closed``;
    its ``close()`` ends with :meth:`_shut`. ``_ROLE`` names the end in RingError messages.
    """

    _ROLE = "ring end"

    def __init__(self, name: str):
        self.name = validate_segment_name(name)
        self.path = segment_path(name)
        self._closed, self._mm = True, None

    def _write_global_header(self, mm, contract: Contract) -> None:
        """Write this end's geometry, owner, creation instant and ``contract`` (model id and layout version:
        this end's) into the global header of ``mm``."""
        GLOBAL.identity.write(mm, GLOBAL_MAGIC, LAYOUT_VERSION, GLOBAL_HEADER_BYTES, self.owner_pid,
                              self.owner_start_time, self.instance_id)
        GLOBAL.geometry.write(mm, self.n_slots, SLOT_HEADER_BYTES, self.slot_bytes, self.slot_stride,
                              self.total_bytes, self.model_id, time.monotonic_ns())
        shape = contract.state_shape or ()
        ndim = -1 if contract.state_shape is None else len(shape)
        GLOBAL.contract.write(mm, DTYPE_CODES.get(contract.dtype, 0), DEVICE_KINDS[contract.device_kind], ndim,
                              *(shape + (0,) * (MAX_NDIM - len(shape))))
        GLOBAL.domain.write(mm, -1 if contract.domain_id is None else contract.domain_id)
        GLOBAL.side_head.write(mm, len(contract.side), self.state_bytes)
        GLOBAL.decode.write(mm, contract.decode_rows, contract.decode_positions, self.decode_offset,
                            self.decode_row_bytes)
        for k, (spec, off) in enumerate(zip(contract.side, self.side_offsets)):
            dims = spec.shape + (0,) * (MAX_NDIM - len(spec.shape))
            GLOBAL.entry(k).write(mm, spec.name.encode("ascii"), DTYPE_CODES[spec.dtype], len(spec.shape), *dims,
                                  off)

    def _read_side_table(self, head: bytes) -> tuple[TensorSpec, ...]:
        """Parse the side-tensor table of ``head`` against ``slot_bytes``: sets ``state_bytes`` and ``side_offsets``,
        returns the side tensors. RingContractError for a dtype code no side tensor can have, RingError for any
        other inconsistency (offsets other than :func:`.slots.side_layout` gives included)."""
        count, state_bytes = GLOBAL.side_head.read(head)
        if count > MAX_SIDE_TENSORS:
            raise RingError(f"{self.path} has an inconsistent global header ({count} side tensors)")
        side, offsets = [], []
        for k in range(count):
            raw, code, ndim, *rest = GLOBAL.entry(k).read(head)
            dims, off = rest[:MAX_NDIM], rest[MAX_NDIM]
            name = raw.rstrip(b"\0").decode("ascii", "replace")
            dtype = CODE_DTYPES.get(code)
            if dtype not in SIDE_DTYPES:
                raise RingContractError(f"the producer declared side tensor {name!r} with dtype code {code}, "
                                        "which no side tensor can have")
            if ndim > MAX_NDIM:
                raise RingError(f"{self.path} has an inconsistent global header (side tensor {name!r}: {ndim} dims)")
            try:
                side.append(TensorSpec(name, tuple(dims[:ndim]), dtype))
            except ValueError as e:
                raise RingError(f"{self.path} has an inconsistent global header ({e})") from None
            offsets.append(off)
        if len({spec.name for spec in side}) != len(side):
            raise RingError(f"{self.path} has an inconsistent global header (a side tensor name twice)")
        try:
            layout = side_layout(tuple(side), self.slot_bytes)
        except ValueError as e:
            raise RingError(f"{self.path} has an inconsistent global header ({e})") from None
        if layout != (state_bytes, tuple(offsets)):
            raise RingError(f"{self.path} has an inconsistent global header (side tensors at payload offsets "
                            f"{offsets} after {state_bytes} state bytes, not {list(layout[1])} after {layout[0]})")
        self.state_bytes, self.side_offsets = state_bytes, tuple(offsets)
        return tuple(side)

    def _read_global_header(self, head: bytes, file_size: int) -> tuple[Contract, str]:
        """Parse and judge the global header ``head`` of a file of ``file_size`` bytes: sets the geometry and owner
        attributes, returns (contract, wake-up directory name). RingError for a file that is not a ring of this
        layout version or has an inconsistent geometry, RingContractError for an unknown dtype code."""
        if len(head) < GLOBAL_HEADER_BYTES:
            raise RingError(f"{self.path} is too small to be a ring")
        magic, version, header_bytes, self.owner_pid, self.owner_start_time, self.instance_id = \
            GLOBAL.identity.read(head)
        n_slots, slot_header_bytes, slot_bytes, stride, total, self.model_id, _created = GLOBAL.geometry.read(head)
        if magic != GLOBAL_MAGIC:
            raise RingError(f"{self.path} is not a hybrid_vla ring (bad magic)")
        if version != LAYOUT_VERSION:
            raise RingError(f"{self.path} has layout version {version}, this code reads {LAYOUT_VERSION} "
                            "(prefix and suffix from different versions of hybrid_vla_ros?)")
        rows, positions, decode_offset, row_bytes = GLOBAL.decode.read(head)
        slots_end = GLOBAL_HEADER_BYTES + n_slots * stride
        if (header_bytes != GLOBAL_HEADER_BYTES or slot_header_bytes != SLOT_HEADER_BYTES
                or not MIN_SLOTS <= n_slots <= MAX_SLOTS or stride != SLOT_HEADER_BYTES + slot_bytes
                or slot_bytes % PAYLOAD_ALIGN or rows > MAX_DECODE_ROWS
                or (rows and decode_offset != slots_end)
                or total != slots_end + decode_region_bytes(rows, row_bytes, positions)
                or file_size < total):
            raise RingError(f"{self.path} has an inconsistent global header")
        self.n_slots, self.slot_bytes, self.slot_stride, self.total_bytes = n_slots, slot_bytes, stride, total
        self.decode_offset, self.decode_row_bytes = decode_offset, row_bytes
        code, device, ndim, *dims = GLOBAL.contract.read(head)
        side = self._read_side_table(head)
        contract = Contract.from_wire(self.model_id, code, device, ndim, dims, version, GLOBAL.domain.one(head), side,
                                      (rows, positions))
        return contract, GLOBAL.wake_name.one(head).rstrip(b"\0").decode("ascii", "replace")

    def _opened(self, fd: int, handles) -> None:
        """Keep ``handles`` (closed by :meth:`_shut` or a finalizer) and make the segment mutex on ``fd``."""
        self._handles = handles
        self._finalizer = weakref.finalize(self, handles.close)
        self._lock = SegmentLock(fd)

    def _check_open(self) -> None:
        """Raise RingError ('<role> is closed') after close()."""
        if self._closed:
            raise RingError(f"{self._ROLE} is closed")

    def slot_states(self) -> list[str]:
        """Diagnostic snapshot of every slot's state name. Raises RingError after close()."""
        if self._closed:
            raise RingError("ring end is closed")
        with self._lock:
            return slots.state_names(self._mm, self.n_slots, self.slot_stride)

    def _shut(self) -> None:
        """Mark this end closed, close its handles once and drop the mapping (views keep it mapped). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
