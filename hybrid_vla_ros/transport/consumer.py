"""The ring's consumer: attaches to a producer's segment (checking its contract), takes frames and waits for them."""
from __future__ import annotations

import os
import time
import weakref

import torch

from . import slots
from .contract import TensorSpec, check_contract, side_specs
from .errors import REJECT_CAUSES, RingConsumerConflict, RingError, SlotRejected
from .ring_end import RingEnd
from .layout import GLOBAL, GLOBAL_HEADER_BYTES, SLOT_HEADER_BYTES
from .segment import (
    CONSUMER_LOCK_BYTE, STAGE_STATES, map_segment, proc_identity, process_alive, tensor_view, try_lock_byte,
)
from .slots import READING, FrameMeta, slot_offset
from .stats import ConsumerStats
from .decode_channel import DecodeRegion
from .wake import REPLY_SOCKET_NAME, FrameWaiter, SpinPolicy, WakeReceiver, WakeSender, wake_socket_path

__all__ = ["RingConsumer", "ReadSlot", "DELIVERY_POLICIES"]

#: ``fifo``: the oldest READY frame first (every frame, in order, while the ring keeps up). ``newest``: the
#: newest READY frame; the older READY ones are freed unread and counted as ``superseded``.
DELIVERY_POLICIES = ("fifo", "newest")


class ReadSlot:
    """A frame the consumer holds (slot READING) until :meth:`release` or the end of a ``with`` block.

    ``tensor`` (``meta.shape``, the producer's ``meta.dtype``) and ``side`` (name -> tensor) are zero-copy views:
    read-only, and invalid after release (clone what you keep). ``meta``: :class:`FrameMeta`; ``superseded``: older
    READY frames freed unread for this one. One dropped without release() is released by the next read().
    """

    __slots__ = ("tensor", "meta", "index", "superseded", "side", "_consumer", "_released", "_compute",
                 "__weakref__")

    def __init__(self, tensor: torch.Tensor, meta: FrameMeta, index: int, consumer: RingConsumer, superseded: int,
                 side: dict[str, torch.Tensor] | None = None):
        self.tensor, self.meta, self.index, self._consumer = tensor, meta, index, consumer
        self.superseded, self._released, self._compute = superseded, False, None
        self.side = {} if side is None else side

    @property
    def compute_tensor(self) -> torch.Tensor:
        """The frame in the consumer's ``compute_dtype``: ``tensor`` itself when the dtypes agree or none was
        stated, else a converted copy (made once; :mod:`.contract`). Raises RingError after release."""
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
    """The consumer's segment fd, its lock fd (its own open file description: mmap keeps a dup of the segment fd
    alive with any view, which must not keep the lock), its wake-up socket and the file's (st_dev, st_ino)."""

    def __init__(self, fd: int, lock_fd: int, receiver: WakeReceiver, ident: tuple[int, int]):
        self.fd, self.lock_fd, self.receiver, self.ident = fd, lock_fd, receiver, ident
        self.reply: WakeSender | None = None  # to the producer's decode-reply socket

    def close(self) -> None:
        if self.reply is not None:
            self.reply.close()
            self.reply = None
        self.receiver.close()  # unbind before the single-consumer lock goes with lock_fd
        for attr in ("lock_fd", "fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)


def _attach_segment(name: str, path: str, judge_header):
    """Open segment ``name`` (file ``path``) as its single consumer; returns (mmap, :class:`_Handles`).

    ``judge_header(head, file_size)`` judges the global header (raising to refuse it) and returns (wake-up directory
    name, total bytes); only then does a second fd take the consumer lock, the socket get bound and the segment
    mapped. Raises FileNotFoundError, RingConsumerConflict, RingError (another uid, the file replaced meanwhile)
    and what ``judge_header`` raises; on failure nothing is left open.
    """
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    lock_fd = -1
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise RingError(f"{path} belongs to uid {st.st_uid}, not {os.getuid()}")
        wake_dir, total_bytes = judge_header(os.pread(fd, GLOBAL_HEADER_BYTES, 0), st.st_size)
        ident = (st.st_dev, st.st_ino)
        lock_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        lst = os.fstat(lock_fd)
        if (lst.st_dev, lst.st_ino) != ident:
            raise RingError(f"{path} was replaced while attaching; attach again")
        if not try_lock_byte(lock_fd, CONSUMER_LOCK_BYTE):
            pid, _start = GLOBAL.consumer.read(os.pread(fd, GLOBAL_HEADER_BYTES, 0))
            raise RingConsumerConflict(name, pid)
        receiver = WakeReceiver(wake_socket_path(wake_dir))
        mm = map_segment(fd, total_bytes)
    except BaseException:
        os.close(fd)
        if lock_fd >= 0:
            os.close(lock_fd)  # also drops the consumer lock, if taken
        raise
    return mm, _Handles(fd, lock_fd, receiver, ident)


class RingConsumer(RingEnd):
    """Attaches to a producer's segment and reads its frames (single consumer; never unlinks the segment).

    Args:
        name: segment name, as given to the producer.
        expected_model_id, expected_split_layer: if not None, frames of another model id / split layer are rejected
            (``model_mismatch`` / ``split_mismatch``), and a producer of another model is refused at attach.
            ``expected_split_layer``: an int or a container of ints (``range(0, L + 1)``: follow a live re-split).
        compute_dtype: the dtype the consumer computes in (:func:`.contract.conversion_kind`; converted by
            ``ReadSlot.compute_tensor``).
        expected_shape, expected_domain_id, expected_side, expected_decode: if not None, a producer that declared
            another state shape, ROS domain (or none), side tensors (order not significant) or decode channel (rows,
            position rows) is refused at attach.
        delivery: one of :data:`DELIVERY_POLICIES`.
        spin: a :class:`~.wake.SpinPolicy`, or None (block only).

    Raises FileNotFoundError, RingContractError (:func:`.contract.check_contract`; nothing changed yet),
    RingConsumerConflict (another live consumer, whatever its network namespace), RingError (an incompatible ring,
    another uid's), ValueError (a malformed ``expected_side``). At attach, slots left READING by a dead consumer
    are freed (those frames are lost); older frames not yet overwritten are delivered. After close() the other
    methods raise RingError.

    Attributes: the arguments (``expected_split_layer``, ``compute_dtype``, ``delivery``, ``spin`` settable at any
    time), :class:`~.ring_end.RingEnd`'s, ``contract`` (:class:`.contract.Contract`), ``conversion`` (the kind
    :func:`.contract.check_contract` returned), ``wake_dir``.
    """

    _ROLE = "consumer"

    def __init__(self, name: str, *, expected_model_id: int | None = None, expected_split_layer=None,
                 compute_dtype: torch.dtype | None = None, expected_shape=None, delivery: str = "fifo",
                 spin: SpinPolicy | None = None, expected_domain_id: int | None = None,
                 expected_side: tuple[TensorSpec, ...] | None = None,
                 expected_decode: tuple[int, int] | None = None):
        if delivery not in DELIVERY_POLICIES:
            raise ValueError(f"delivery must be one of {DELIVERY_POLICIES}, got {delivery!r}")
        self.expected_side = None if expected_side is None else side_specs(expected_side, "expected_side")
        super().__init__(name)
        self.expected_model_id, self.expected_split_layer = expected_model_id, expected_split_layer
        self.compute_dtype, self.delivery, self.spin = compute_dtype, delivery, spin
        self.expected_shape = None if expected_shape is None else tuple(int(d) for d in expected_shape)
        self.expected_domain_id = expected_domain_id
        self.expected_decode = expected_decode
        self._read = self._superseded = self._reclaimed = 0
        self._rejected = {cause: 0 for cause in REJECT_CAUSES}
        self._outstanding: weakref.ref | None = None
        self._outstanding_key: tuple[int, int] | None = None
        self._views: dict = {}
        self._side_views: dict[int, dict[str, torch.Tensor]] = {}  # slot index -> its side views, made once
        self._mm, handles = _attach_segment(self.name, self.path, self._judge_header)
        self._waiter = FrameWaiter(handles.receiver)
        self._opened(handles.fd, handles)
        #: The decode channel (:class:`~.decode_channel.DecodeRegion`: ``wait_step``, ``publish_reply``), or None.
        self.decode = None
        c = self.contract
        if c.decode_rows:
            handles.reply = WakeSender(wake_socket_path(self.wake_dir, REPLY_SOCKET_NAME))
            self.decode = DecodeRegion(self._mm, self.decode_offset, c.decode_rows, c.state_shape[-1], c.dtype,
                                       c.decode_positions, handles.reply.send, handles.receiver)
        with self._lock:  # we are the only consumer: READING slots belong to a dead predecessor
            self._reclaimed = slots.reclaim_reading(self._mm, self.n_slots, self.slot_stride)
            self._me = (os.getpid(), proc_identity(os.getpid())[1])
            GLOBAL.schedule.write(self._mm, 0, 0)  # nothing taken yet by this consumer
            GLOBAL.stage_time.write(self._mm, 0, -1)  # nor timed
            GLOBAL.max_age.write(self._mm, 0)  # nor a frame age limit announced
            GLOBAL.consumer_state.write(self._mm, 0)
            GLOBAL.consumer.write(self._mm, *self._me)
        self._closed = False

    def _judge_header(self, head: bytes, file_size: int) -> tuple[str, int]:
        """Judge the global header (sets ``contract``, ``conversion``); returns (wake-up directory, total bytes)."""
        self.contract, self.wake_dir = self._read_global_header(head, file_size)
        self.conversion = check_contract(self.contract, expected_model_id=self.expected_model_id,
                                         compute_dtype=self.compute_dtype, expected_shape=self.expected_shape,
                                         expected_domain_id=self.expected_domain_id,
                                         expected_side=self.expected_side, expected_decode=self.expected_decode)
        return self.wake_dir, self.total_bytes

    @property
    def stats(self) -> ConsumerStats:
        """The counters now (:class:`~.stats.ConsumerStats`)."""
        w = self._waiter.counts
        return ConsumerStats(read=self._read, rejected=dict(self._rejected), reclaimed_reading=self._reclaimed,
                             superseded=self._superseded, found_ready=w["found_ready"],
                             found_spinning=w["found_spinning"], found_after_block=w["found_after_block"],
                             spin_misses=w["spin_misses"], spin_ms=w["spin_ns"] / 1e6,
                             spin_pauses=self.spin.pauses if self.spin is not None else 0)

    @property
    def producer_gone(self) -> bool:
        """True if the segment was unlinked or replaced (producer closed or restarted) or this consumer is closed:
        close and attach again. A SIGKILLed producer's segment stays linked until a new producer replaces it."""
        if self._closed:
            return True
        try:
            if os.fstat(self._handles.fd).st_nlink == 0:
                return True
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._handles.ident

    @property
    def owner_alive(self) -> bool:
        """True while the process that created the segment (pid and start time) is alive."""
        return process_alive(self.owner_pid, self.owner_start_time)

    @property
    def producer_state(self) -> str:
        """What the producer said of itself: 'running', 'paused' (no frames come) or 'not said'."""
        self._check_open()
        return STAGE_STATES.get(GLOBAL.producer_state.one(self._mm), "not said")

    def producer_schedule(self) -> tuple[int, int]:
        """(the producer's last publish, CLOCK_MONOTONIC ns, the interval it announced between publishes, ns
        (``RingProducer.announce_cycle``)); 0: none."""
        self._check_open()
        return GLOBAL.published.read(self._mm)[1], GLOBAL.producer_cycle.one(self._mm)

    def announce_max_age(self, max_age_ns: int) -> None:
        """Tell the producer the oldest a frame may be (ns after its camera stamp; 0: no limit) for this consumer to
        publish its result, so it can tell when its inputs arrive too late (``RingProducer.consumer_max_age_ns``)."""
        self._check_open()
        GLOBAL.max_age.write(self._mm, int(max_age_ns))

    def set_running(self, running: bool) -> None:
        """Say in the header whether this consumer takes frames ('running') or its node is inactive ('paused'),
        for the producer's health report (``RingProducer.consumer``)."""
        self._check_open()
        GLOBAL.consumer_state.write(self._mm, 1 if running else 2)

    def _try_take(self) -> tuple[ReadSlot | None, int]:
        """Take a READY slot by the delivery policy; returns (slot or None, publish count seen under the lock)."""
        mm, stride = self._mm, self.slot_stride
        with self._lock:
            seen = GLOBAL.published.read(mm)[0]
            taken = slots.take_ready(
                mm, self.n_slots, stride, newest=self.delivery == "newest", slot_bytes=self.state_bytes,
                declared_dtype=self.contract.dtype, compute_dtype=self.compute_dtype,
                expected_model_id=self.expected_model_id, expected_split_layer=self.expected_split_layer)
        if taken is None:
            return None, seen
        best, cause, meta, superseded, detail = taken
        if cause:
            self._rejected[cause] += 1
            raise SlotRejected(cause, meta, f"slot {best}" + (f": {detail}" if detail else ""))
        self._read += 1
        self._superseded += superseded
        GLOBAL.last_take.write(mm, time.monotonic_ns())  # who reads, and when (RingProducer.consumer)
        key = (best, meta.shape, meta.dtype)
        view = self._views.get(key)
        if view is None:  # one view per slot and shape, made once: torch.frombuffer took a fifth of a read()
            if len(self._views) >= 4 * self.n_slots:
                self._views.clear()
            view = self._views[key] = tensor_view(mm, slot_offset(best, stride) + SLOT_HEADER_BYTES, meta.shape,
                                                  meta.dtype)
        side = {}
        if self.side_offsets:
            side = self._side_views.get(best)
            if side is None:
                base = slot_offset(best, stride) + SLOT_HEADER_BYTES
                side = self._side_views[best] = {
                    spec.name: tensor_view(mm, base + off, spec.shape, spec.dtype)
                    for spec, off in zip(self.contract.side, self.side_offsets)}
            side = dict(side)
        slot = ReadSlot(view, meta, best, self, superseded, side)
        self._outstanding = weakref.ref(slot)
        self._outstanding_key = (best, meta.seq)
        return slot, seen

    def read(self, timeout_s: float) -> ReadSlot | None:
        """Wait up to ``timeout_s`` seconds (0: do not wait) for a frame, chosen by ``delivery``; None on timeout, or
        early when none is ready and ``producer_gone``. Frames published before the call are found without waiting.
        Raises SlotRejected for an invalid header (the slot is freed and counted; read again), RingError while
        the previous ReadSlot is alive and unreleased."""
        self._check_open()
        if self._outstanding is not None:
            prev = self._outstanding()
            if prev is not None and not prev._released:
                raise RingError("read() while the previous ReadSlot is not released")
            if prev is None:
                self._release(*self._outstanding_key)
            self._outstanding = None
        deadline = time.monotonic_ns() + int(max(0.0, timeout_s) * 1e9)
        return self._waiter.wait_for(self._try_take, deadline, lambda: self.producer_gone, self._mm, self.spin)

    def announce_next_read(self, taken_ns: int, next_read_ns: int) -> None:
        """Tell the producer this consumer took a frame at ``taken_ns`` and expects the next at ``next_read_ns``
        (CLOCK_MONOTONIC ns; 0, 0: none): a pacing hint (``RingProducer.consumer_schedule``)."""
        self._check_open()
        GLOBAL.schedule.write(self._mm, int(taken_ns), int(next_read_ns))

    def announce_stage_time(self, split_layer: int, stage_ns: int) -> None:
        """Tell the producer this consumer's stage time per frame (``stage_ns``, e.g. a recent median) at split
        layer ``split_layer``: what live rebalancing judges the suffix by (``RingProducer.consumer_stage_time``)."""
        self._check_open()
        GLOBAL.stage_time.write(self._mm, int(stage_ns), int(split_layer))

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
        """Release a held slot, unbind the wake socket, close the fds (dropping the consumer lock). Idempotent;
        views handed out stay mapped (their contents may change)."""
        if self._closed:
            return
        if self._outstanding_key is not None:
            self._release(*self._outstanding_key)
        GLOBAL.schedule.write(self._mm, 0, 0)  # no consumer: nothing to pace for
        GLOBAL.stage_time.write(self._mm, 0, -1)
        with self._lock:
            if GLOBAL.consumer.read(self._mm) == self._me:
                GLOBAL.consumer.write(self._mm, 0, 0)
                GLOBAL.consumer_state.write(self._mm, 0)
        self._shut()
        self._views = {}
        self._side_views = {}
