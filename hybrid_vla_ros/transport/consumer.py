"""The ring's consumer: attaches to a producer's segment (checking its contract), takes frames (oldest first or
newest first) and waits for them (bounded spin, then the wake-up socket)."""
from __future__ import annotations

import math
import os
import time
import weakref

import torch

from . import slots
from .contract import Contract, check_contract
from .errors import REJECT_CAUSES, RingError, SlotRejected
from .segment import (
    _CONTRACT, _GLOBAL, _NEXT_READ, _PUBLISHED, _WAKE_NAME, CONTRACT_OFFSET, GLOBAL_HEADER_BYTES, GLOBAL_MAGIC,
    LAYOUT_VERSION, MAX_SLOTS, MIN_SLOTS, NEXT_READ_OFFSET, PAYLOAD_ALIGN, PUBLISHED_OFFSET, SLOT_HEADER_BYTES,
    WAKE_NAME_OFFSET, SegmentLock,
    _process_alive, map_segment, segment_path, tensor_view, try_lock_byte, validate_segment_name,
)
from .slots import READING, READY, FrameMeta, slot_offset
from .wake import SpinPolicy, WakeReceiver, wake_socket_path

__all__ = ["RingConsumer", "ReadSlot", "DELIVERY_POLICIES"]

#: ``fifo``: the oldest READY frame first (every frame, in order, while the ring keeps up). ``newest``: the
#: newest READY frame; the older READY ones are freed unread and counted as ``superseded``.
DELIVERY_POLICIES = ("fifo", "newest")
CONSUMER_LOCK_BYTE = 1


class ReadSlot:
    """A frame the consumer holds (slot state READING) until :meth:`release` or the end of a ``with`` block.

    ``tensor``: zero-copy CPU view into the segment, shape ``meta.shape``, the producer's dtype ``meta.dtype``;
    treat it as read-only and do not use it after release (the producer may overwrite the slot then; clone
    what you keep). ``meta``: the :class:`FrameMeta`. ``index``: slot index. ``superseded``: older READY
    frames freed unread when this one was taken (newest-first delivery). A ReadSlot dropped without release()
    is released by the consumer's next read().
    """

    __slots__ = ("tensor", "meta", "index", "superseded", "_consumer", "_released", "_compute", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meta: FrameMeta, index: int, consumer: RingConsumer, superseded: int):
        self.tensor, self.meta, self.index, self._consumer = tensor, meta, index, consumer
        self.superseded, self._released, self._compute = superseded, False, None

    @property
    def compute_tensor(self) -> torch.Tensor:
        """The frame in the consumer's ``compute_dtype``: ``tensor`` itself (zero-copy) when the dtypes agree or
        none was stated, else a converted copy (``Tensor.to``; made once; which pairs are exact:
        :mod:`.contract`). Raises RingError after release."""
        if self._released:
            raise RingError("ReadSlot already released")
        if self._compute is None:
            dst = self._consumer.compute_dtype
            self._compute = self.tensor if dst is None or dst == self.tensor.dtype else self.tensor.to(dst)
        return self._compute

    def release(self) -> None:
        """Give the slot back to the producer (state FREE). Idempotent; a no-op after the consumer closed."""
        if not self._released:
            self._released = True
            self._compute = None
            self._consumer._release(self.index, self.meta.seq)

    def __enter__(self) -> ReadSlot:
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


class _Handles:
    """The consumer's segment fd, its lock fd (an open file description of its own that holds the consumer
    lock: mmap keeps a dup of the segment fd alive as long as any view of the mapping, which must not keep
    the lock) and its wake-up socket."""

    def __init__(self, fd: int, lock_fd: int, receiver: WakeReceiver):
        self.fd, self.lock_fd, self.receiver = fd, lock_fd, receiver

    def close(self) -> None:
        self.receiver.close()  # unbind before the single-consumer lock goes with lock_fd
        for attr in ("lock_fd", "fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)


class RingConsumer:
    """Attaches to a producer's segment and reads its frames (single consumer; never unlinks the segment).

    Args:
        name: segment name, as given to the producer.
        expected_model_id: if not None, a producer of another model is refused at attach and frames whose model
            id differs are rejected (``model_mismatch``).
        expected_split_layer: if not None, frames whose split layer differs are rejected (``split_mismatch``):
            an int (that K only) or a container of ints (e.g. ``range(0, L + 1)``, every K the model has, for a
            consumer that follows a live re-split); a plain attribute, settable at any time.
        compute_dtype: the dtype the consumer computes in; a producer dtype that cannot be converted to it is
            refused at attach (:func:`.contract.conversion_kind`); ``ReadSlot.compute_tensor`` converts.
        expected_shape: if not None, a producer that declared another state shape is refused at attach.
        delivery: ``"fifo"`` or ``"newest"`` (:data:`DELIVERY_POLICIES`).
        spin: a :class:`~.wake.SpinPolicy` to spin for a predicted frame before blocking, or None (block only).

    Raises FileNotFoundError if the segment does not exist, RingContractError if the producer's contract does
    not fit (before anything is changed), RingError if it is not a compatible ring, belongs to another uid, or
    another live consumer is attached (it holds the consumer lock, an OFD lock on byte 1 of the segment on an
    fd of its own, whatever its network namespace; released by close() or the holder's death). Slots left
    READING by a crashed consumer are reset to FREE (that frame is lost, not re-delivered out of order). Frames
    published before attaching and not yet overwritten are delivered.

    Attributes: ``name``, ``path``, ``n_slots``, ``slot_bytes``, ``slot_stride``, ``total_bytes`` (bytes),
    ``model_id`` (the producer's), ``contract`` (:class:`.contract.Contract`), ``conversion`` ('none', 'exact',
    'rounds' or 'per frame'), ``wake_dir`` (the wake-up directory's name), ``owner_pid``, ``owner_start_time``,
    ``instance_id``, ``expected_model_id``,
    ``expected_split_layer``, ``compute_dtype``, ``delivery``, ``spin``.
    """

    def __init__(self, name: str, *, expected_model_id: int | None = None, expected_split_layer=None,
                 compute_dtype: torch.dtype | None = None, expected_shape=None, delivery: str = "fifo",
                 spin: SpinPolicy | None = None):
        if delivery not in DELIVERY_POLICIES:
            raise ValueError(f"delivery must be one of {DELIVERY_POLICIES}, got {delivery!r}")
        self.name = validate_segment_name(name)
        self.path = segment_path(name)
        self.expected_model_id, self.expected_split_layer = expected_model_id, expected_split_layer
        self.compute_dtype, self.delivery, self.spin = compute_dtype, delivery, spin
        self.expected_shape = None if expected_shape is None else tuple(int(d) for d in expected_shape)
        self._closed, self._mm = True, None
        self._read = self._superseded = self._reclaimed = 0
        self._rejected = {cause: 0 for cause in REJECT_CAUSES}
        self._wake_stats = {"found_ready": 0, "found_spinning": 0, "found_after_block": 0, "spin_misses": 0,
                            "spin_ns": 0}
        self._outstanding: weakref.ref | None = None
        self._outstanding_key: tuple[int, int] | None = None
        self._views: dict = {}
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        lock_fd = -1
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise RingError(f"{self.path} belongs to uid {st.st_uid}, not {os.getuid()}")
            wake_name = self.wake_dir = self._read_global_header(os.pread(fd, GLOBAL_HEADER_BYTES, 0), st.st_size)
            self._ident = (st.st_dev, st.st_ino)
            lock_fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            lst = os.fstat(lock_fd)
            if (lst.st_dev, lst.st_ino) != self._ident:
                raise RingError(f"{self.path} was replaced while attaching; attach again")
            if not try_lock_byte(lock_fd, CONSUMER_LOCK_BYTE):
                raise RingError(f"another consumer is attached to {name}")
            receiver = WakeReceiver(wake_socket_path(wake_name))
            self._mm = map_segment(fd, self.total_bytes)
        except BaseException:
            os.close(fd)
            if lock_fd >= 0:
                os.close(lock_fd)  # also drops the consumer lock, if taken
            self._mm = None
            raise
        self._handles = _Handles(fd, lock_fd, receiver)
        self._finalizer = weakref.finalize(self, self._handles.close)
        self._lock = SegmentLock(fd)
        with self._lock:  # we are the only consumer: READING slots belong to a dead predecessor
            for i in range(self.n_slots):
                off = slot_offset(i, self.slot_stride)
                if slots.read_prefix(self._mm, off)[2] == READING:
                    slots.set_state(self._mm, off, slots.FREE)
                    self._reclaimed += 1
        self._closed = False

    def _read_global_header(self, head: bytes, file_size: int) -> str:
        """Parse and judge the global header; returns the wake-up directory name. RingError /
        RingContractError."""
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
        self.contract = Contract.from_wire(self.model_id, code, device, ndim, dims, version)
        self.conversion = check_contract(self.contract, expected_model_id=self.expected_model_id,
                                         compute_dtype=self.compute_dtype, expected_shape=self.expected_shape)
        return _WAKE_NAME.unpack_from(head, WAKE_NAME_OFFSET)[0].rstrip(b"\0").decode("ascii", "replace")

    @property
    def stats(self) -> dict:
        """Counters: ``read`` (frames handed out), ``rejected_<cause>`` for each cause in REJECT_CAUSES,
        ``reclaimed_reading`` (READING slots of a dead predecessor reset to FREE at attach), ``superseded``
        (READY frames freed unread because a newer one was delivered), and how read() found the frames it
        returned: ``found_ready`` (at its first look), ``found_spinning`` (while polling the publish count),
        ``found_after_block`` (after a wait on the wake-up socket); ``spin_misses`` (spins that reached their
        bound without a frame), ``spin_ms`` (time spent spinning, ms: CPU time of the consumer's core) and
        ``spin_pauses`` (times the spin paused because most spins missed; :class:`~.wake.SpinPolicy`)."""
        out = {"read": self._read}
        out.update({f"rejected_{c}": n for c, n in self._rejected.items()})
        out["reclaimed_reading"] = self._reclaimed
        out["superseded"] = self._superseded
        out.update({k: v for k, v in self._wake_stats.items() if k != "spin_ns"})
        out["spin_ms"] = self._wake_stats["spin_ns"] / 1e6
        out["spin_pauses"] = self.spin.pauses if self.spin is not None else 0
        return out

    @property
    def producer_gone(self) -> bool:
        """True if the segment was unlinked (producer closed) or the name now points at another segment
        (producer restarted), or this consumer is closed: close it and attach again. A SIGKILLed producer's
        segment stays linked, so this stays False until a new producer replaces it (see ``owner_alive``)."""
        if self._closed:
            return True
        try:
            if os.fstat(self._handles.fd).st_nlink == 0:
                return True
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ident

    @property
    def owner_alive(self) -> bool:
        """True while the process that created the segment (pid and start time) is alive."""
        return _process_alive(self.owner_pid, self.owner_start_time)

    def slot_states(self) -> list[str]:
        """Diagnostic snapshot of every slot's state name (FREE/WRITING/READY/READING, or UNKNOWN(<n>)).
        Raises RingError after close()."""
        if self._closed:
            raise RingError("ring end is closed")
        with self._lock:
            return slots.state_names(self._mm, self.n_slots, self.slot_stride)

    def _try_take(self) -> tuple[ReadSlot | None, int]:
        """Take a READY slot by the delivery policy; returns (slot or None, publish count seen under the lock)."""
        mm, stride = self._mm, self.slot_stride
        with self._lock:
            seen = _PUBLISHED.unpack_from(mm, PUBLISHED_OFFSET)[0]
            ready = []
            for i in range(self.n_slots):
                _m, _v, state, seq = slots.read_prefix(mm, slot_offset(i, stride))
                if state == READY:
                    ready.append((seq, i))
            if not ready:
                return None, seen
            _seq, best = max(ready) if self.delivery == "newest" else min(ready)
            cause, meta = slots.validate(
                slots.read_header(mm, slot_offset(best, stride)), slot_bytes=self.slot_bytes,
                declared_dtype=self.contract.dtype, compute_dtype=self.compute_dtype,
                expected_model_id=self.expected_model_id, expected_split_layer=self.expected_split_layer)
            slots.set_state(mm, slot_offset(best, stride), slots.FREE if cause else READING)
            superseded = 0
            if not cause and self.delivery == "newest":
                for _s, i in ready:
                    if i != best:
                        slots.set_state(mm, slot_offset(i, stride), slots.FREE)
                        superseded += 1
        if cause:
            self._rejected[cause] += 1
            raise SlotRejected(cause, meta, f"slot {best}")
        self._read += 1
        self._superseded += superseded
        if self.spin is not None:
            self.spin.observe(meta.seq, meta.t_publish_ns)
        key = (best, meta.shape, meta.dtype)
        view = self._views.get(key)
        if view is None:  # one view per slot and shape, made once: torch.frombuffer took a fifth of a read()
            if len(self._views) >= 4 * self.n_slots:
                self._views.clear()
            view = self._views[key] = tensor_view(mm, slot_offset(best, stride) + SLOT_HEADER_BYTES, meta.shape,
                                                  meta.dtype)
        slot = ReadSlot(view, meta, best, self, superseded)
        self._outstanding = weakref.ref(slot)
        self._outstanding_key = (best, meta.seq)
        return slot, seen

    def _spin_until(self, until_ns: int, seen: int) -> bool:
        """Poll the publish count until it differs from ``seen`` (True) or ``until_ns`` passes (False)."""
        mm, unpack, now = self._mm, _PUBLISHED.unpack_from, time.monotonic_ns
        t0 = t = now()
        hit = False
        while t < until_ns:
            if unpack(mm, PUBLISHED_OFFSET)[0] != seen:
                hit = True
                break
            t = now()
        self._wake_stats["spin_ns"] += now() - t0
        if not hit:
            self._wake_stats["spin_misses"] += 1
        return hit

    def read(self, timeout_s: float) -> ReadSlot | None:
        """Wait up to ``timeout_s`` seconds (0: do not wait) for a published frame (the oldest unread one with
        ``delivery="fifo"``, the newest with ``"newest"``).

        Returns a ReadSlot (slot now READING until released) or None on timeout; also returns None early when no
        frame is ready and ``producer_gone`` is true. Frames published before the call are found without
        waiting; stale wake-ups are drained. With a ``spin`` policy it polls the segment's publish count inside
        the predicted window and blocks on the wake-up socket outside it. Raises SlotRejected if the chosen
        READY slot's header is invalid (the slot is freed and ``rejected_<cause>`` counted; call read() again
        for the next frame), RingError if the previous ReadSlot is still alive and unreleased (one
        garbage-collected unreleased is released here) or the consumer is closed.
        """
        if self._closed:
            raise RingError("consumer is closed")
        if self._outstanding is not None:
            prev = self._outstanding()
            if prev is not None and not prev._released:
                raise RingError("read() while the previous ReadSlot is not released")
            if prev is None:
                self._release(*self._outstanding_key)
            self._outstanding = None
        deadline = time.monotonic_ns() + int(max(0.0, timeout_s) * 1e9)
        receiver, how = self._handles.receiver, "found_ready"
        while True:
            slot, seen = self._try_take()
            if slot is None:  # drain stale wake-ups only now (not on the fast path), then look once more
                receiver.drain()
                slot, seen = self._try_take()
            if slot is not None:
                self._wake_stats[how] += 1
                return slot
            now = time.monotonic_ns()
            if now >= deadline or self.producer_gone:
                return None
            window = self.spin.window() if self.spin is not None else None
            if window is not None and now < window[1]:
                if window[0] - now > 1_500_000:  # poll(2) counts in ms: wake up 0.5-1.5 ms before spinning
                    receiver.wait(math.ceil((min(window[0] - 1_500_000, deadline) - now) / 1e6))
                    how = "found_after_block"
                    continue
                hit = self._spin_until(min(window[1], deadline), seen)
                self.spin.outcome(hit or window[1] > deadline)  # a spin cut short by the timeout did not miss
                if hit:
                    how = "found_spinning"
                    continue
                now = time.monotonic_ns()
            receiver.wait(max(0, math.ceil((deadline - now) / 1e6)))
            how = "found_after_block"

    def announce_next_read(self, taken_ns: int, next_read_ns: int) -> None:
        """Tell the producer that this consumer took a frame at ``taken_ns`` and expects to take the next one at
        ``next_read_ns`` (CLOCK_MONOTONIC ns; 0, 0: no expectation). A hint for pacing
        (``RingProducer.consumer_schedule``): a producer faster than this consumer can start its next frame so
        that it is complete just then, instead of computing frames that wait in the ring or are superseded.
        Raises RingError after close()."""
        if self._closed:
            raise RingError("consumer is closed")
        _NEXT_READ.pack_into(self._mm, NEXT_READ_OFFSET, int(taken_ns), int(next_read_ns))

    def _release(self, index: int, seq: int) -> None:
        if self._closed:
            return
        off = slot_offset(index, self.slot_stride)
        with self._lock:
            _m, _v, state, slot_seq = slots.read_prefix(self._mm, off)
            if state == READING and slot_seq == seq:
                slots.set_state(self._mm, off, slots.FREE)
        if self._outstanding_key == (index, seq):
            self._outstanding = None
            self._outstanding_key = None

    def close(self) -> None:
        """Release a held slot, unbind the wake socket and close the fd (which drops the consumer lock); never
        unlinks the segment. Idempotent. Views handed out stay mapped until they are garbage-collected (their
        contents may change)."""
        if self._closed:
            return
        if self._outstanding_key is not None:
            self._release(*self._outstanding_key)
        _NEXT_READ.pack_into(self._mm, NEXT_READ_OFFSET, 0, 0)  # no consumer: nothing to pace for
        self._closed = True
        self._finalizer()
        self._mm = None
        self._views = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

