"""What both ends of the ring share: :class:`RingEnd`, the base of :class:`~.producer.RingProducer` and
:class:`~.consumer.RingConsumer`.

That is the segment's name and path; its geometry and owner as the global header states them (written by the
producer, read and judged by the consumer: the one place that knows the header's fields; their offsets and
structs are in :mod:`.segment`); the mapping, the segment mutex and the handles that a weakref finalizer
closes; the closed state; the slot-state snapshot; and the context-manager protocol.
"""
from __future__ import annotations

import time
import weakref

from . import slots
from .contract import DEVICE_KINDS, DTYPE_CODES, Contract
from .errors import RingError
from .segment import (
    _CONTRACT, _GLOBAL, _WAKE_NAME, CONTRACT_OFFSET, GLOBAL_HEADER_BYTES, GLOBAL_MAGIC, LAYOUT_VERSION, MAX_SLOTS,
    MIN_SLOTS, PAYLOAD_ALIGN, SLOT_HEADER_BYTES, WAKE_NAME_OFFSET, SegmentLock, segment_path, validate_segment_name,
)
from .slots import MAX_NDIM

__all__ = ["RingEnd"]


class RingEnd:
    """Base of the two ring ends; not used on its own.

    Args:
        name: segment name (validated: ValueError for an unsafe one); ``path`` is ``/dev/shm/<name>``.

    A subclass sets the geometry and owner attributes (``n_slots``, ``slot_bytes``, ``slot_stride``,
    ``total_bytes`` in bytes; ``model_id``, ``owner_pid``, ``owner_start_time`` in clock ticks, ``instance_id``:
    the producer from its arguments and its process, the consumer by :meth:`_read_global_header`), maps the
    segment into ``_mm``, calls :meth:`_opened` with its handles (an object whose ``close()`` releases them;
    it runs once, from :meth:`_shut` or at garbage collection / interpreter exit), then clears ``_closed``;
    its ``close()`` ends with :meth:`_shut`. ``_ROLE`` ('producer', 'consumer') names the end in RingError
    messages.
    """

    _ROLE = "ring end"

    def __init__(self, name: str):
        self.name = validate_segment_name(name)
        self.path = segment_path(name)
        self._closed, self._mm = True, None

    def _write_global_header(self, mm, contract: Contract) -> None:
        """Write this end's geometry and owner, the creation instant and ``contract`` (its dtype, device kind
        and state shape; the model id and layout version are this end's) into the global header of ``mm``."""
        _GLOBAL.pack_into(
            mm, 0, GLOBAL_MAGIC, LAYOUT_VERSION, GLOBAL_HEADER_BYTES, self.owner_pid, self.owner_start_time,
            self.instance_id, self.n_slots, SLOT_HEADER_BYTES, self.slot_bytes, self.slot_stride, self.total_bytes,
            self.model_id, time.monotonic_ns())
        shape = contract.state_shape or ()
        ndim = -1 if contract.state_shape is None else len(shape)
        _CONTRACT.pack_into(mm, CONTRACT_OFFSET, DTYPE_CODES.get(contract.dtype, 0), DEVICE_KINDS[contract.device_kind],
                            ndim, *(shape + (0,) * (MAX_NDIM - len(shape))))

    def _read_global_header(self, head: bytes, file_size: int) -> tuple[Contract, str]:
        """Parse and judge the global header ``head`` (the first ``GLOBAL_HEADER_BYTES`` bytes of a segment file
        of ``file_size`` bytes): sets the geometry and owner attributes and returns (the producer's contract, the
        wake-up directory name). Raises RingError for a file that is not a ring of this layout version or whose
        geometry is inconsistent, RingContractError for an unknown dtype code."""
        if len(head) < GLOBAL_HEADER_BYTES:
            raise RingError(f"{self.path} is too small to be a ring")
        (magic, version, header_bytes, self.owner_pid, self.owner_start_time, self.instance_id, n_slots,
         slot_header_bytes, slot_bytes, stride, total, self.model_id, _created) = _GLOBAL.unpack_from(head)
        if magic != GLOBAL_MAGIC:
            raise RingError(f"{self.path} is not a hybrid_vla ring (bad magic)")
        if version != LAYOUT_VERSION:
            raise RingError(f"{self.path} has layout version {version}, this code reads {LAYOUT_VERSION} "
                            "(prefix and suffix from different versions of hybrid_vla_ros?)")
        if (header_bytes != GLOBAL_HEADER_BYTES or slot_header_bytes != SLOT_HEADER_BYTES
                or not MIN_SLOTS <= n_slots <= MAX_SLOTS or stride != SLOT_HEADER_BYTES + slot_bytes
                or slot_bytes % PAYLOAD_ALIGN or total != GLOBAL_HEADER_BYTES + n_slots * stride
                or file_size < total):
            raise RingError(f"{self.path} has an inconsistent global header")
        self.n_slots, self.slot_bytes, self.slot_stride, self.total_bytes = n_slots, slot_bytes, stride, total
        code, device, ndim, *dims = _CONTRACT.unpack_from(head, CONTRACT_OFFSET)
        contract = Contract.from_wire(self.model_id, code, device, ndim, dims, version)
        return contract, _WAKE_NAME.unpack_from(head, WAKE_NAME_OFFSET)[0].rstrip(b"\0").decode("ascii", "replace")

    def _opened(self, fd: int, handles) -> None:
        """Keep ``handles`` (closed by :meth:`_shut`, or by a finalizer if this end is dropped unclosed) and make
        the segment mutex on ``fd``."""
        self._handles = handles
        self._finalizer = weakref.finalize(self, handles.close)
        self._lock = SegmentLock(fd)

    def _check_open(self) -> None:
        """Raise RingError ('<role> is closed') after close()."""
        if self._closed:
            raise RingError(f"{self._ROLE} is closed")

    def slot_states(self) -> list[str]:
        """Diagnostic snapshot of every slot's state name (FREE/WRITING/READY/READING, or UNKNOWN(<n>)).
        Raises RingError after close()."""
        if self._closed:
            raise RingError("ring end is closed")
        with self._lock:
            return slots.state_names(self._mm, self.n_slots, self.slot_stride)

    def _shut(self) -> None:
        """Mark this end closed, close its handles (once) and drop its reference to the mapping (views handed
        out keep it mapped until they are garbage-collected). Idempotent."""
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
