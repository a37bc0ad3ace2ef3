"""The ring's producer: creates the segment and its wake-up directory, takes slots and publishes frames."""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
import os
import secrets
import time
import weakref

import torch

from . import slots
from .contract import DTYPE_CODES, Contract, TensorSpec, device_kind_of, dtype_name, itemsize, side_specs
from .decode_channel import DecodeRegion, decode_region_bytes
from .errors import RingError
from .leftovers import evict_existing, remove_dead_init_files, remove_orphan_wake_dirs
from .ring_end import RingEnd
from .layout import GLOBAL, GLOBAL_HEADER_BYTES, MAX_SIDE_TENSORS, SLOT_HEADER_BYTES
from .segment import (
    CONSUMER_LOCK_BYTE, LAYOUT_VERSION, MAX_SLOTS, MIN_SLOTS, PAYLOAD_ALIGN, STAGE_STATES, align, byte_locked,
    map_segment, proc_identity, process_alive, ros_domain_id, tensor_view,
)
from .slots import slot_offset
from .stats import ProducerStats
from .wake import REPLY_SOCKET_NAME, WakeReceiver, WakeSender, make_wake_dir, remove_wake_dir, wake_socket_path

__all__ = ["RingProducer", "WriteSlot", "ConsumerPresence", "slot_bytes_for"]

_NO_LOCK = contextlib.nullcontext()


def _check_side(side) -> tuple[TensorSpec, ...]:
    """:func:`.contract.side_specs`, at most MAX_SIDE_TENSORS of them (ValueError)."""
    side = side_specs(side)
    if len(side) > MAX_SIDE_TENSORS:
        raise ValueError(f"at most {MAX_SIDE_TENSORS} side tensors, got {len(side)}")
    return side


def slot_bytes_for(shape, dtype: torch.dtype, side: tuple[TensorSpec, ...] = ()) -> int:
    """Payload capacity in bytes for one tensor of ``shape`` and ``dtype`` plus the side tensors ``side``, each
    rounded up to 64 (the tensor: at least 64): ``RingProducer(slot_bytes=...)`` with the same ``side``. Raises
    ValueError for a bad shape or ``side``, TypeError for a dtype the ring cannot carry."""
    _, _, nbytes = slots.check_shape_dtype(shape, dtype)
    return max(PAYLOAD_ALIGN, align(nbytes, PAYLOAD_ALIGN)) + slots.side_region_bytes(_check_side(side))


@dataclass(frozen=True)
class ConsumerPresence:
    """Whether a consumer is attached to the producer's ring, and what it last did (:meth:`RingProducer.consumer`).

    ``attached``: a consumer holds the consumer lock (dropped by the kernel when it closes or dies). ``pid`` /
    ``start_time``: the process it wrote at attach (0: unknown); ``alive``: that process (not a reused pid) exists.
    ``state``: ``segment.STAGE_STATES``. ``last_take_ns`` / ``next_read_ns``: its last and announced next take;
    ``published`` / ``last_publish_ns``: the producer's. Times in CLOCK_MONOTONIC ns, 0: none.
    """

    attached: bool
    pid: int
    start_time: int
    alive: bool
    state: str
    last_take_ns: int
    next_read_ns: int
    published: int
    last_publish_ns: int


class WriteSlot:
    """A slot acquired by the producer and not yet published.

    ``tensor`` and ``side`` (name -> tensor; fill every one: publish does not check, and one left unwritten carries
    an earlier frame's bytes) are writable views inside the segment: copy the frame in, or compute it there
    (``out=slot.tensor``). ``seq``: the frame's seq once published. ``t_write_start_ns``: ``time.monotonic_ns()``
    at acquire; a producer that computes in the slot sets it to when the frame was complete. Touch nothing after
    publish/abort; one dropped unpublished is aborted by the next acquire().
    """

    __slots__ = ("tensor", "seq", "index", "shape", "dtype", "t_write_start_ns", "side", "_nbytes", "_code", "_done",
                 "__weakref__")

    def __init__(self, tensor, seq, index, shape, dtype, code, nbytes, t_write_start_ns, side=None):
        self.tensor, self.seq, self.index, self.shape, self.dtype = tensor, seq, index, shape, dtype
        self._code, self._nbytes, self.t_write_start_ns, self._done = code, nbytes, t_write_start_ns, False
        self.side = {} if side is None else side


class _Handles:
    """The producer's fd and socket; closed by close() or by a weakref finalizer (also at interpreter exit)."""

    def __init__(self, fd: int, sender: WakeSender, path: str, ident: tuple[int, int], wake_dir: str,
                 replaced_pid: int = 0):
        self.fd, self.sender, self.path, self.ident, self.wake_dir = fd, sender, path, ident, wake_dir
        self.replaced_pid = replaced_pid
        self.reply: WakeReceiver | None = None  # the decode replies' socket

    def close(self) -> None:
        if self.reply is not None:
            self.reply.close()
            self.reply = None
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self.ident:  # never unlink a successor's segment
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.sender.send()  # wake a waiting consumer so it notices producer_gone
        self.sender.close()
        remove_wake_dir(self.wake_dir)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _create_segment(path: str, total_bytes: int, owner_pid: int, owner_start_time: int, write_header,
                    domain_id: int | None = None):
    """Create segment file ``path`` of ``total_bytes``, fully initialised before anyone can attach; returns (mmap,
    :class:`_Handles`). Made under ``<path>.init-<pid>-<start time>-<random>`` (mode 0600 whatever the umask;
    :func:`.leftovers.remove_dead_init_files`), header written by ``write_header(mm)``, wake-up directory made,
    then hard-linked to ``path``, evicting a segment there (:func:`.leftovers.evict_existing`), 16 tries at most.
    Raises RingNameConflict (a live owner), RingError (the name keeps being re-created), OSError (e.g. ENOSPC);
    on failure nothing is left behind."""
    tmp = f"{path}.init-{owner_pid}-{owner_start_time}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    wake_dir, replaced = None, 0
    try:
        os.fchmod(fd, 0o600)
        os.posix_fallocate(fd, 0, total_bytes)  # reserve tmpfs pages: ENOSPC now, not SIGBUS later
        mm = map_segment(fd, total_bytes)
        write_header(mm)
        wake_dir = make_wake_dir(lambda name: GLOBAL.wake_name.write(mm, name.encode()), domain_id)
        st = os.fstat(fd)
        sender = WakeSender(wake_socket_path(wake_dir))
        for _attempt in range(16):  # nothing after a successful link can fail
            try:
                os.link(tmp, path)
                break
            except FileExistsError:
                replaced = evict_existing(path, owner_pid, owner_start_time, wake_dir) or replaced
        else:
            sender.close()
            raise RingError(f"could not create {path}: it keeps being re-created by someone else")
    except BaseException:
        os.close(fd)
        if wake_dir is not None:
            remove_wake_dir(wake_dir)
        raise
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return mm, _Handles(fd, sender, path, (st.st_dev, st.st_ino), wake_dir, replaced)


class RingProducer(RingEnd):
    """Creates the segment and publishes frames into it (single producer; not fork-safe: create it where it is used).

    Args:
        name: segment name (:func:`.segment.segment_name`), file ``/dev/shm/<name>``.
        n_slots: 3 (one being read, one written, one ready) to 1024.
        slot_bytes: payload capacity per slot, side tensors included (:func:`slot_bytes_for`); rounded up to 64.
        model_id: int64 written into the global header and every slot header.
        dtype, state_shape, device, domain_id: the contract (:mod:`.contract`; None: undeclared); acquire() refuses
            another dtype or shape.
        side: the :class:`~.contract.TensorSpec` (at most 32) every frame carries, filled via ``WriteSlot.side``.
        decode_rows, decode_positions: the decode channel (:mod:`.decode_channel`; 0: none), which needs ``dtype``
            and ``state_shape``.

    The segment is initialised under a temporary name, then hard-linked into place, so nobody attaches to a
    half-initialised one. RingNameConflict if the name's owner (pid and start time) is another live process; a
    leftover of a dead owner or of this process, or a file that is not a ring, is replaced. Raises ValueError for
    bad arguments (a ``slot_bytes`` that leaves the hidden states under 64 bytes or under what ``state_shape`` and
    ``dtype`` need included), TypeError for non-integers or an unknown dtype, OSError (e.g. ENOSPC) if /dev/shm
    cannot hold it. ``close()``, a ``with`` block's end or interpreter exit unlinks the segment; after it, the
    other methods raise RingError.

    Attributes: the arguments, :class:`~.ring_end.RingEnd`'s, ``path``, ``device_kind``, ``wake_dir``.
    """

    _ROLE = "producer"

    def __init__(self, name: str, n_slots: int, slot_bytes: int, model_id: int, *, dtype: torch.dtype | None = None,
                 state_shape=None, device=None, domain_id: int | None = None, side: tuple[TensorSpec, ...] = (),
                 decode_rows: int = 0, decode_positions: int = 0):
        super().__init__(name)
        n_slots, slot_bytes, model_id = operator.index(n_slots), operator.index(slot_bytes), operator.index(model_id)
        if not MIN_SLOTS <= n_slots <= MAX_SLOTS:
            raise ValueError(f"n_slots must be in [{MIN_SLOTS}, {MAX_SLOTS}], got {n_slots}")
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        if not -(1 << 63) <= model_id < (1 << 63):
            raise ValueError("model_id must fit in int64")
        if dtype is not None and dtype not in DTYPE_CODES:
            raise TypeError(f"unsupported dtype {dtype!r}")
        self.dtype = dtype
        self.state_shape = None if state_shape is None else slots.check_shape_dtype(state_shape, torch.uint8)[0]
        self.device_kind = "undeclared" if device is None else device_kind_of(device)
        self.domain_id = None if domain_id is None else ros_domain_id(domain_id)
        self.side = _check_side(side)
        self.n_slots = n_slots
        self.slot_bytes = align(slot_bytes, PAYLOAD_ALIGN)
        if self.side:
            need = slots.side_region_bytes(self.side)
            if self.slot_bytes - need < PAYLOAD_ALIGN:
                raise ValueError(f"slot_bytes {slot_bytes} leaves no room for the hidden states after the side "
                                 f"tensors ({need} bytes): use slot_bytes_for(shape, dtype, side)")
            self.state_bytes, self.side_offsets = slots.side_layout(self.side, self.slot_bytes)
            if dtype is not None and self.state_shape is not None:
                state = slots.check_shape_dtype(self.state_shape, dtype)[2]
                if state > self.state_bytes:
                    raise ValueError(f"slot_bytes {slot_bytes} leaves {self.state_bytes} bytes for the hidden states "
                                     f"after the side tensors ({need} bytes), less than {dtype_name(dtype)} "
                                     f"{self.state_shape} needs ({state}): use slot_bytes_for(shape, dtype, side)")
        else:
            self.state_bytes, self.side_offsets = self.slot_bytes, ()
        self.slot_stride = SLOT_HEADER_BYTES + self.slot_bytes
        self.decode_offset = GLOBAL_HEADER_BYTES + n_slots * self.slot_stride
        self.decode_row_bytes = 0
        if decode_rows:
            if dtype is None or self.state_shape is None:
                raise ValueError("a ring that decodes declares the hidden states' dtype and shape")
            self.decode_row_bytes = self.state_shape[-1] * itemsize(dtype)
        self.total_bytes = self.decode_offset + decode_region_bytes(decode_rows, self.decode_row_bytes,
                                                                    decode_positions)
        self.model_id = int(model_id)
        self.owner_pid = os.getpid()
        self.owner_start_time = proc_identity(self.owner_pid)[1]
        self.instance_id = secrets.randbits(64)
        self._published = self._dropped = self._aborted = self._wake_errors = 0
        self._next_seq, self._next_index = 1, 0
        self._outstanding: weakref.ref | None = None
        self._side_views: dict[int, dict[str, torch.Tensor]] = {}  # slot index -> its side views, made once
        remove_dead_init_files(self.name)
        remove_orphan_wake_dirs()
        self.wake_dir = None
        contract = Contract(self.model_id, dtype, self.device_kind, self.state_shape, LAYOUT_VERSION, self.domain_id,
                            self.side, int(decode_rows), int(decode_positions))
        self._mm, handles = _create_segment(self.path, self.total_bytes, self.owner_pid, self.owner_start_time,
                                            lambda mm: self._write_global_header(mm, contract), self.domain_id)
        self.wake_dir = handles.wake_dir
        #: The pid of the dead producer whose segment (and wake-up directory) this one replaced, 0 when none.
        self.replaced_pid = handles.replaced_pid
        self._opened(handles.fd, handles)
        #: The decode channel (:class:`~.decode_channel.DecodeRegion`: ``publish_step``, ``wait_reply``), or None.
        self.decode = None
        if decode_rows:
            handles.reply = WakeReceiver(wake_socket_path(self.wake_dir, REPLY_SOCKET_NAME))
            self.decode = DecodeRegion(self._mm, self.decode_offset, int(decode_rows), self.state_shape[-1], dtype,
                                       int(decode_positions), handles.sender.send, handles.reply)
        self._closed = False

    @property
    def stats(self) -> ProducerStats:
        """The counters now (:class:`~.stats.ProducerStats`)."""
        return ProducerStats(published=self._published, dropped_oldest=self._dropped, aborted=self._aborted,
                             wake_errors=self._wake_errors)

    def consumer_schedule(self) -> tuple[int, int]:
        """The consumer's (last take, expected next take), CLOCK_MONOTONIC ns (``RingConsumer.announce_next_read``);
        (0, 0) when none said. A hint: a SIGKILLed consumer's values stay, in the past."""
        self._check_open()
        return GLOBAL.schedule.read(self._mm)

    def consumer_stage_time(self) -> tuple[int, int]:
        """(K, the consumer's stage time in ns at that K) (``RingConsumer.announce_stage_time``); (-1, 0) when
        none announced."""
        self._check_open()
        stage_ns, k = GLOBAL.stage_time.read(self._mm)
        return (k, stage_ns) if stage_ns > 0 else (-1, 0)

    def consumer_attached(self) -> bool:
        """Whether a consumer holds the consumer lock now (one system call, unlike :meth:`consumer`)."""
        self._check_open()
        return byte_locked(self._handles.fd, CONSUMER_LOCK_BYTE)

    def consumer(self) -> ConsumerPresence:
        """Who reads this ring now (:class:`ConsumerPresence`)."""
        attached = self.consumer_attached()
        pid, start = GLOBAL.consumer.read(self._mm)
        state = STAGE_STATES.get(GLOBAL.consumer_state.one(self._mm), "not said")
        taken, next_read = GLOBAL.schedule.read(self._mm)
        published, last_publish = GLOBAL.published.read(self._mm)
        return ConsumerPresence(attached, pid, start, pid > 0 and process_alive(pid, start), state, taken,
                                next_read, published, last_publish)

    def announce_cycle(self, cycle_ns: int) -> None:
        """Announce the expected interval between publishes (ns; 0: none), so the consumer can tell a stopped
        producer from a slow one (``RingConsumer.producer_schedule``)."""
        self._check_open()
        GLOBAL.producer_cycle.write(self._mm, int(cycle_ns))

    def consumer_max_age_ns(self) -> int:
        """The consumer's frame age limit, ns after the camera stamp (``RingConsumer.announce_max_age``); 0: none."""
        self._check_open()
        return GLOBAL.max_age.one(self._mm)

    def set_running(self, running: bool) -> None:
        """Say in the header whether this producer's node works frames ('running') or is inactive ('paused'), for
        the consumer's health report."""
        self._check_open()
        GLOBAL.producer_state.write(self._mm, 1 if running else 2)

    def mapping(self):
        """The segment's mmap object (all ``total_bytes``), e.g. to page-lock it (:mod:`.pinned`)."""
        self._check_open()
        return self._mm

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> WriteSlot:
        """Take a slot for one frame of ``shape`` (<= 4 dims) and ``dtype``: a FREE one (preferring the last written:
        warm in the cache), else the oldest READY one (``dropped_oldest``), never a READING one.

        Raises ValueError if the payload exceeds ``state_bytes`` or the shape or dtype is bad or not the declared
        one; TypeError for an unsupported dtype; RingError while a previous WriteSlot is neither published nor
        aborted.
        """
        self._check_open()
        shape, code, nbytes = slots.check_shape_dtype(shape, dtype)
        if nbytes > self.state_bytes:
            where = " (slot_bytes less the side tensors)" if self.side else ""
            raise ValueError(f"payload {nbytes} bytes exceeds slot capacity {self.state_bytes} bytes{where}")
        if self.dtype is not None and dtype != self.dtype:
            raise ValueError(f"this ring carries {dtype_name(self.dtype)} (declared at creation), not "
                             f"{dtype_name(dtype)}")
        if self.state_shape is not None and shape != self.state_shape:
            raise ValueError(f"this ring carries shape {self.state_shape} (declared at creation), not {shape}")
        if self._outstanding is not None:
            prev = self._outstanding()
            if prev is not None and not prev._done:
                raise RingError("acquire() while a previous WriteSlot is neither published nor aborted")
        seq, mm, stride = self._next_seq, self._mm, self.slot_stride
        with self._lock:
            if self._outstanding is not None:  # a dropped WriteSlot: its WRITING slot is reusable below
                self._outstanding = None
                self._aborted += 1
            chosen, dropped = slots.pick_write_slot(mm, self.n_slots, stride, self._next_index)
            self._dropped += dropped
            slots.begin_write(mm, slot_offset(chosen, stride), seq)
        # Start the next scan here: a freed slot is reused while warm in the cache (an 8 MiB copy into a warm
        # slot took 0.15 ms, into slots rotated round-robin 0.23-0.26 ms).
        self._next_index = chosen
        tensor = tensor_view(mm, slot_offset(chosen, stride) + SLOT_HEADER_BYTES, shape, dtype)
        side = {}
        if self.side:
            side = self._side_views.get(chosen)
            if side is None:  # one set of views per slot, made once (torch.frombuffer is not free)
                base = slot_offset(chosen, stride) + SLOT_HEADER_BYTES
                side = self._side_views[chosen] = {
                    spec.name: tensor_view(mm, base + off, spec.shape, spec.dtype)
                    for spec, off in zip(self.side, self.side_offsets)}
            side = dict(side)
        slot = WriteSlot(tensor, seq, chosen, shape, dtype, code, nbytes, time.monotonic_ns(), side)
        self._outstanding = weakref.ref(slot)
        return slot

    def _take_back(self, slot: WriteSlot) -> None:
        self._check_open()
        if slot._done or self._outstanding is None or self._outstanding() is not slot:
            raise RingError("this WriteSlot is not the producer's outstanding slot (already published/aborted?)")

    def publish(self, slot: WriteSlot, *, stamp_ns: int, split_layer: int,
                timings: slots.SlotTimings = slots.NO_TIMINGS) -> int:
        """Publish a filled slot (READY, written last: :mod:`.slots`) and wake the consumer; returns its seq.

        ``stamp_ns``: int64; ``split_layer``: int32 block index K. ``t_publish_ns`` is taken on entry. Raises
        RingError if ``slot`` is not the outstanding slot, TypeError if ``timings`` is not a SlotTimings,
        ValueError for out-of-range ints.
        """
        t_pub = time.monotonic_ns()
        self._take_back(slot)
        stamp_ns, split_layer, timings = slots.check_frame_fields(stamp_ns, split_layer, timings)
        off = slot_offset(slot.index, self.slot_stride)
        # A WRITING slot is the producer's alone; where stores become visible in program order (x86-TSO) the
        # mutex adds nothing to READY-last, elsewhere its release orders the stores (slots' docstring).
        with _NO_LOCK if slots.STORES_VISIBLE_IN_ORDER else self._lock:
            _m, _v, state, slot_seq = slots.read_prefix(self._mm, off)
            if state != slots.WRITING or slot_seq != slot.seq:
                raise RingError(f"slot {slot.index} changed under the producer (state {state}, seq {slot_seq})")
            slots.finish_write(self._mm, off, stamp_ns=stamp_ns, t_write_start_ns=slot.t_write_start_ns,
                               t_publish_ns=t_pub, nbytes=slot._nbytes, model_id=self.model_id,
                               split_layer=split_layer, dtype_code=slot._code, shape=slot.shape, timings=timings)
        slots.announce(self._mm, self._published + 1, t_pub)
        slot._done = True
        self._outstanding = None
        self._published += 1
        self._next_seq += 1
        if not self._handles.sender.send():
            self._wake_errors += 1
        return slot.seq

    def abort(self, slot: WriteSlot) -> None:
        """Give an acquired slot back unpublished (FREE; its seq is reused). RingError if ``slot`` is not the
        outstanding slot."""
        self._take_back(slot)
        with self._lock:
            slots.set_state(self._mm, slot_offset(slot.index, self.slot_stride), slots.FREE)
        slot._done = True
        self._outstanding = None
        self._aborted += 1

    def close(self) -> None:
        """Unlink the segment (if the name is still this one's), wake the consumer so it sees ``producer_gone``,
        remove the wake-up directory, close fd and socket. Idempotent; views handed out stay mapped."""
        self._shut()
        self._side_views = {}
