"""The ring's producer: creates the segment (and its wake-up directory: :func:`_create_segment`), takes slots and
publishes frames. What it shares with the consumer (the global header, mapping, mutex, close) is
:class:`~.ring_end.RingEnd`."""
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
from .contract import DTYPE_CODES, Contract, TensorSpec, device_kind_of, dtype_name, side_specs
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
from .wake import WakeSender, make_wake_dir, remove_wake_dir, wake_socket_path

__all__ = ["RingProducer", "WriteSlot", "ConsumerPresence", "slot_bytes_for"]

_NO_LOCK = contextlib.nullcontext()


def _check_side(side) -> tuple[TensorSpec, ...]:
    """``side`` as a checked tuple of TensorSpec (:func:`.contract.side_specs`), at most MAX_SIDE_TENSORS of
    them; ValueError otherwise."""
    side = side_specs(side)
    if len(side) > MAX_SIDE_TENSORS:
        raise ValueError(f"at most {MAX_SIDE_TENSORS} side tensors, got {len(side)}")
    return side


def slot_bytes_for(shape, dtype: torch.dtype, side: tuple[TensorSpec, ...] = ()) -> int:
    """Payload capacity in bytes needed for one tensor of ``shape`` (at most 4 dims) and ``dtype``, plus the side
    tensors ``side`` (:class:`.contract.TensorSpec`) every frame carries.

    Returns numel * element size rounded up to 64 bytes (at least 64), plus each side tensor's nbytes rounded up
    to 64 (:func:`.slots.side_region_bytes`); pass it as ``RingProducer(slot_bytes=...)`` with the same ``side``.
    Without side tensors, the hidden states' size alone. Raises ValueError for a bad shape or ``side`` (not
    TensorSpecs, a name twice, more than MAX_SIDE_TENSORS) and TypeError for a dtype the ring cannot carry
    (supported: float32/16/64, bfloat16, (u)int8, int16/32/64, bool).
    """
    _, _, nbytes = slots.check_shape_dtype(shape, dtype)
    return max(PAYLOAD_ALIGN, align(nbytes, PAYLOAD_ALIGN)) + slots.side_region_bytes(_check_side(side))


@dataclass(frozen=True)
class ConsumerPresence:
    """Whether a consumer is attached to the producer's ring, and what it last did (:meth:`RingProducer.consumer`).

    ``attached``: a consumer holds the consumer lock (the kernel drops it the moment its holder closes it or dies,
    SIGKILL included). ``pid`` / ``start_time``: the process the consumer wrote into the header at attach (0: not
    known, e.g. it detached); ``alive``: that process exists (pid and start time: a reused pid is not it).
    ``state``: what the consumer said of itself (``segment.STAGE_STATES``: 'running', 'paused' or 'not said').
    ``last_take_ns``: CLOCK_MONOTONIC ns of its last take since it attached (0: none);
    ``next_read_ns``: when it said it will take the next (0: no expectation); ``published``: frames published so
    far; ``last_publish_ns``: CLOCK_MONOTONIC ns of the last publish (0: none).
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

    ``tensor``: writable CPU tensor of the requested shape/dtype that lives inside the segment; write the frame
    into it (``slot.tensor.copy_(src)``, or produce it there: ``torch.add(a, b, out=slot.tensor)``). ``seq``:
    the seq this frame gets when published. ``index``: slot index. ``t_write_start_ns``: ``time.monotonic_ns()``
    at acquire, i.e. when the copy into the slot starts; a producer that computes the frame in the slot sets it
    to the instant the frame was complete there (nothing is copied), before publish. Do not touch ``tensor``
    (nor ``side``) after publish/abort. A WriteSlot dropped without publish/abort is taken back (counted as aborted)
    by the next acquire().

    ``side``: a dict, side-tensor name -> writable CPU tensor inside the slot, of that
    :class:`~.contract.TensorSpec`'s shape and dtype (empty for a ring without side tensors); fill every one
    before publish (``slot.side["mask"].copy_(mask)``). Publish does not check that they were written: one left
    unwritten holds whatever bytes an earlier frame (or nobody: zeros) left in this slot, and the consumer gets
    those stale bytes.
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

    def close(self) -> None:
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
    """Create the segment file ``path`` of ``total_bytes`` bytes, fully initialised before anyone can attach.

    It is made under a temporary name ``<path>.init-<pid>-<start time>-<random>`` (mode 0600 whatever the
    umask; pid and process start time in the name so that a dead process's leftover is recognised even if
    its pid has been reused: :func:`.leftovers.remove_dead_init_files`), its tmpfs pages reserved, mapped,
    its global header written by ``write_header(mm)``, its wake-up directory made (for ROS domain ``domain_id``;
    the name recorded in the header first), and then hard-linked to ``path``; a segment already there is evicted
    (:func:`.leftovers.evict_existing`) and the link tried again, 16 times at most. The temporary name is
    always removed. Returns (the mmap, the :class:`_Handles`: fd, wake sender, path, file identity, wake-up
    directory name, the pid of a dead owner whose segment it replaced or 0). Raises RingNameConflict (a live
    owner), RingError (the name keeps being re-created),
    OSError (e.g. ENOSPC); on failure the fd is closed and the wake-up directory removed.
    """
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
    """Creates the segment and publishes frames into it (single producer).

    Args:
        name: segment name (``segment_name(...)`` builds one), file ``/dev/shm/<name>``.
        n_slots: number of slots, >= 3 (one being read, one being written, one ready) and <= 1024.
        slot_bytes: payload capacity per slot in bytes (``slot_bytes_for(shape, dtype, side)``), side tensors
            included; rounded up to 64. The hidden states get what the side tensors leave (``state_bytes``).
        model_id: int64 written into the global header and every slot header (the consumer can require it).
        dtype, state_shape, device: the contract in the global header (:mod:`.contract`): the dtype and shape of
            every frame (None: undeclared, each frame's header says) and where they are computed ('cpu',
            'cuda', a torch.device; None: undeclared). acquire() refuses another dtype or shape.
        domain_id: the ROS domain of the pipeline, declared in the header (a consumer that expects another refuses
            the ring); None: undeclared. Also part of the wake-up directory's name.
        side: the side tensors (:class:`~.contract.TensorSpec`, at most 32, names unique) every frame carries after
            the hidden states, declared in the header's side-tensor table (a consumer can require them:
            ``expected_side``) and filled through ``WriteSlot.side``. Each lies at a fixed, 64-byte aligned payload
            offset (``side_offsets``) at the end of the payload (:mod:`.segment`). ``()``: none (the ring is what
            it was before side tensors).

    The segment (mode 0600 whatever the umask) is fully initialised under a temporary name, then hard-linked
    into place, so nobody ever attaches to a half-initialised segment. If the name exists and its owner (pid
    and process start time) is alive and is another process, raises RingNameConflict; a leftover of a dead or
    pid-reused owner, of this very process, or a file that is not a ring is unlinked and replaced (with its
    wake-up directory). Raises ValueError for bad arguments (with side tensors: a ``slot_bytes`` that leaves the
    hidden states less than 64 bytes, or less than the declared ``state_shape`` and ``dtype`` need; TypeError for
    non-integers or an unknown dtype) and
    OSError (e.g. ENOSPC from posix_fallocate) if /dev/shm cannot hold it. ``close()`` (or the end of a
    ``with`` block, or interpreter exit) unlinks the segment. Not fork-safe: create it in the process that uses it.

    Attributes: ``name``, ``path``, ``n_slots``, ``slot_bytes`` (payload capacity, bytes), ``slot_stride`` and
    ``total_bytes`` (bytes), ``state_bytes`` (the hidden states' capacity in a payload, bytes), ``side`` (the
    TensorSpecs), ``side_offsets`` (each one's payload offset, bytes, ``side`` order), ``model_id``, ``dtype``,
    ``state_shape``, ``device_kind``, ``owner_pid``, ``owner_start_time`` (clock ticks), ``instance_id``,
    ``wake_dir``.
    """

    _ROLE = "producer"

    def __init__(self, name: str, n_slots: int, slot_bytes: int, model_id: int, *, dtype: torch.dtype | None = None,
                 state_shape=None, device=None, domain_id: int | None = None, side: tuple[TensorSpec, ...] = ()):
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
        self.total_bytes = GLOBAL_HEADER_BYTES + n_slots * self.slot_stride
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
                            self.side)
        self._mm, handles = _create_segment(self.path, self.total_bytes, self.owner_pid, self.owner_start_time,
                                            lambda mm: self._write_global_header(mm, contract), self.domain_id)
        self.wake_dir = handles.wake_dir
        #: The pid of the dead producer whose segment (and wake-up directory) this one replaced, 0 when none.
        self.replaced_pid = handles.replaced_pid
        self._opened(handles.fd, handles)
        self._closed = False

    @property
    def stats(self) -> ProducerStats:
        """The counters now (:class:`~.stats.ProducerStats`: published, dropped_oldest, aborted, wake_errors)."""
        return ProducerStats(published=self._published, dropped_oldest=self._dropped, aborted=self._aborted,
                             wake_errors=self._wake_errors)

    def consumer_schedule(self) -> tuple[int, int]:
        """(when the consumer last took a frame, when it expects to take the next one), CLOCK_MONOTONIC ns, from
        ``RingConsumer.announce_next_read``; (0, 0) when no consumer said so (none attached, or it closed). A
        hint: a SIGKILLed consumer's last values stay, and only ever lie in the past. Raises RingError after
        close()."""
        self._check_open()
        return GLOBAL.schedule.read(self._mm)

    def consumer_stage_time(self) -> tuple[int, int]:
        """(the K, the consumer's stage time in ns at that K) from ``RingConsumer.announce_stage_time``; (-1, 0)
        when it announced none (none attached, not timed yet, or it closed). Raises RingError after close()."""
        self._check_open()
        stage_ns, k = GLOBAL.stage_time.read(self._mm)
        return (k, stage_ns) if stage_ns > 0 else (-1, 0)

    def consumer_attached(self) -> bool:
        """Whether a consumer holds the consumer lock now (one system call: no /proc read, unlike
        :meth:`consumer`). Raises RingError after close()."""
        self._check_open()
        return byte_locked(self._handles.fd, CONSUMER_LOCK_BYTE)

    def consumer(self) -> ConsumerPresence:
        """Who reads this ring now (:class:`ConsumerPresence`): whether a consumer holds the consumer lock (a
        system call, no waiting), the process it named at attach and its last take and announced next read.
        Raises RingError after close()."""
        attached = self.consumer_attached()
        pid, start = GLOBAL.consumer.read(self._mm)
        state = STAGE_STATES.get(GLOBAL.consumer_state.one(self._mm), "not said")
        taken, next_read = GLOBAL.schedule.read(self._mm)
        published, last_publish = GLOBAL.published.read(self._mm)
        return ConsumerPresence(attached, pid, start, pid > 0 and process_alive(pid, start), state, taken,
                                next_read, published, last_publish)

    def announce_cycle(self, cycle_ns: int) -> None:
        """Say in the header how long this producer expects between its publishes (ns; 0: no expectation), so that
        the consumer can tell a producer that stopped publishing from a slow one (``RingConsumer.producer_schedule``).
        Raises RingError after close()."""
        self._check_open()
        GLOBAL.producer_cycle.write(self._mm, int(cycle_ns))

    def consumer_max_age_ns(self) -> int:
        """The oldest a frame may be (ns after its camera stamp) for the consumer to publish its result, as the
        consumer announced it (``RingConsumer.announce_max_age``); 0 when none is announced. Raises RingError after
        close()."""
        self._check_open()
        return GLOBAL.max_age.one(self._mm)

    def set_running(self, running: bool) -> None:
        """Say in the header whether this producer's node works frames ('running') or is attached but idle
        ('paused': the node is inactive), for the consumer's health report (``RingConsumer.producer``). Raises
        RingError after close()."""
        self._check_open()
        GLOBAL.producer_state.write(self._mm, 1 if running else 2)

    def mapping(self):
        """The segment's mmap object (the whole ``total_bytes``), e.g. to page-lock it for a device
        (:mod:`.pinned`). Raises RingError after close()."""
        self._check_open()
        return self._mm

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> WriteSlot:
        """Take a slot for one frame of ``shape`` (<= 4 dims) and ``dtype`` (e.g. bf16 (tokens, hidden)).

        Returns a WriteSlot whose ``tensor`` is a writable CPU view of that shape/dtype into the segment, and whose
        ``side`` holds a writable view of each side tensor (to be filled before publish). Takes a
        FREE slot (the one written last when the consumer has freed it: its memory is warm in the cache), else
        the oldest READY one (its frame is dropped and counted in ``dropped_oldest``), never a READING one
        (:func:`.slots.pick_write_slot`). Raises ValueError if the payload exceeds ``state_bytes`` (``slot_bytes``
        less the side tensors), the shape is
        bad or differs from the declared ``state_shape``, or the dtype differs from the declared ``dtype``;
        TypeError for an unsupported dtype; RingError if a previous WriteSlot is still alive and neither
        published nor aborted (one that was garbage-collected unpublished is aborted here) or if the ring is
        closed.
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
        # Start the next scan at this slot: once the consumer has freed it, the next frame is written into the
        # same memory, still warm in the cache, instead of rotating through every slot (an 8 MiB copy into a
        # warm slot took 0.15 ms here, into slots rotated round-robin 0.23-0.26 ms).
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

        ``stamp_ns``: frame stamp (int64 ns); ``split_layer``: int32 decoder block index K; ``timings``: the
        frame's :class:`~.slots.SlotTimings` (preprocess and prefix ms, the instant the producer started it),
        passed through to ``FrameMeta.timings``; the default :data:`~.slots.NO_TIMINGS` sends none (NaN ms,
        instant 0). ``FrameMeta.t_publish_ns`` is taken on entry: the frame is complete in the slot. Raises
        RingError if ``slot`` is not the outstanding slot or the ring is closed, TypeError when ``timings`` is
        not a SlotTimings, ValueError for out-of-range ints.
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
        """Give an acquired slot back unpublished (state FREE); its seq is reused by the next acquire.

        Raises RingError if ``slot`` is not the outstanding slot or the ring is closed.
        """
        self._take_back(slot)
        with self._lock:
            slots.set_state(self._mm, slot_offset(slot.index, self.slot_stride), slots.FREE)
        slot._done = True
        self._outstanding = None
        self._aborted += 1

    def close(self) -> None:
        """Unlink the segment (only if the name still points at this producer's segment), wake the consumer so
        it sees ``producer_gone``, remove the wake-up directory and close the fd and socket. Idempotent. Views
        handed out stay mapped until they are garbage-collected."""
        self._shut()
        self._side_views = {}
