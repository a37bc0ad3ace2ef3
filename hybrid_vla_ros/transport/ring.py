"""Shared-memory ring that hands hidden states from the prefix process to the suffix process.

One POSIX shared-memory segment (``/dev/shm/<name>``, mode 0600) holds a global header and ``n_slots`` slots.
Exactly one :class:`RingProducer` (which creates and finally unlinks the segment) and one :class:`RingConsumer`
(which attaches and never unlinks) use it. The producer's single copy (e.g. device-to-host) goes straight into a
slot; the consumer gets a zero-copy ``torch`` view of the slot. Linux only.

Layout (all integers little-endian; offsets in bytes)::

    global header, GLOBAL_HEADER_BYTES (4096) long, struct "<QIIqQQIIQQQqq":
      0 magic u64 (GLOBAL_MAGIC)     8 layout version u32        12 header bytes u32 (offset of slot 0)
     16 owner pid i64               24 owner start time u64 (clock ticks after boot, /proc/<pid>/stat field 22)
     32 instance id u64 (random)    40 n_slots u32              44 slot header bytes u32
     48 slot payload capacity u64   56 slot stride u64          64 total segment bytes u64
     72 model id i64                80 created at, CLOCK_MONOTONIC ns
    slot i at GLOBAL_HEADER_BYTES + i * stride; a SLOT_HEADER_BYTES (256) header, struct "<IHHQqqqQqiIII4q8d":
      0 magic u32 (SLOT_MAGIC)   4 version u16   6 state u16 (FREE 0 / WRITING 1 / READY 2 / READING 3)
      8 seq u64                 16 stamp ns i64  24 t_write_start ns i64   32 t_publish ns i64
     40 payload nbytes u64      48 model id i64  56 split layer i32        60 dtype code u32
     64 ndim u32                68 n timings u32 72 shape i64[4]           104 timings ms f64[8]
    then the payload at slot offset + 256 (64-byte aligned), capacity = slot payload capacity.

Slot states change only while holding a mutex shared by unrelated processes and released by the kernel if its
holder dies: an open-file-description record lock (``F_OFD_SETLKW``) on byte 0 of the segment, plus a
``threading.Lock`` per object. (A classic ``fcntl.lockf`` lock belongs to the process, so it would not exclude a
producer and a consumer living in one process, and closing any fd of the file would drop it.) The producer takes a FREE slot, else overwrites the oldest READY one (counted as
``dropped_oldest``), never a READING one. The consumer takes the READY slot with the lowest seq. A publish
sends one byte to an abstract-namespace ``AF_UNIX`` datagram socket the consumer has bound (its name is derived
from the segment name); that binding also guarantees a single live consumer. The consumer looks for READY slots
before it sleeps on that socket, so a frame published before read() is never missed, and drains stale wake-ups.

Lifecycle: a SIGKILLed producer leaves its segment behind; the next producer finds the owner (pid + start time)
dead and replaces it, and a consumer still attached to the old one then sees ``producer_gone`` and re-attaches.
A consumer that dies while holding a slot leaves it READING; the next consumer resets it to FREE at attach.
"""
from __future__ import annotations

import errno
import fcntl
import math
import mmap
import operator
import os
import re
import secrets
import select
import socket
import stat
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import torch

__all__ = [
    "RingError", "RingNameConflict", "SlotRejected", "FrameMeta", "WriteSlot", "ReadSlot", "RingProducer",
    "RingConsumer", "segment_name", "slot_bytes_for", "segment_path", "REJECT_CAUSES",
]

SHM_DIR = "/dev/shm"
LAYOUT_VERSION = 1
GLOBAL_MAGIC = int.from_bytes(b"HVLARNG1", "little")
SLOT_MAGIC = int.from_bytes(b"SLOT", "little")
SLOT_VERSION = 1
GLOBAL_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 256
PAYLOAD_ALIGN = 64
MAX_NDIM = 4
MAX_TIMINGS = 8
MIN_SLOTS = 3
MAX_SLOTS = 1024
MAX_SEGMENT_NAME = 100  # the wake socket name (segment name + ".wake") must fit the 107-byte abstract sun_path

FREE, WRITING, READY, READING = 0, 1, 2, 3
STATE_NAMES = {FREE: "FREE", WRITING: "WRITING", READY: "READY", READING: "READING"}
REJECT_CAUSES = ("bad_magic", "bad_version", "bad_shape", "bad_dtype", "split_mismatch", "model_mismatch")

_GLOBAL = struct.Struct("<QIIqQQIIQQQqq")
_GLOBAL_OWNER = struct.Struct("<QIIqQQ")  # magic .. instance id: fixed across layout versions
_SLOT = struct.Struct("<IHHQqqqQqiIII4q8d")
_SLOT_PREFIX = struct.Struct("<IHHQ")  # magic, version, state, seq
_STATE = struct.Struct("<H")
SLOT_STATE_OFFSET = 6
SLOT_FIELD_OFFSETS = {
    "magic": 0, "version": 4, "state": 6, "seq": 8, "stamp_ns": 16, "t_write_start_ns": 24, "t_publish_ns": 32,
    "payload_nbytes": 40, "model_id": 48, "split_layer": 56, "dtype": 60, "ndim": 64, "n_timings": 68,
    "shape": 72, "timings_ms": 104,
}
assert _GLOBAL.size <= GLOBAL_HEADER_BYTES and _SLOT.size == 168 <= SLOT_HEADER_BYTES

_DTYPE_CODES = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4, torch.uint8: 5, torch.int8: 6,
    torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10,
}
_CODE_DTYPES = {code: dt for dt, code in _DTYPE_CODES.items()}
_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in _DTYPE_CODES}

# struct flock for F_OFD_SETLK(W): short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (must be 0)
_FLOCK = struct.Struct("@hhqqi4x")
_LOCK_BYTE0 = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
_UNLOCK_BYTE0 = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
_IGNORED_SEND_ERRNOS = {errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN, errno.ENOBUFS}

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_RING_RE = re.compile(r"[A-Za-z0-9_\-]+")
_NS_RE = re.compile(r"[A-Za-z0-9_/]*")


class RingError(RuntimeError):
    """Base class of the ring's errors (bad use, incompatible or inconsistent segment)."""


class RingNameConflict(RingError):
    """A live producer (another process, same pid and start time) already owns the segment name."""


class SlotRejected(RingError):
    """A READY slot's header failed validation; the slot was released and the cause counted.

    ``cause`` is one of :data:`REJECT_CAUSES`; ``meta`` is the parsed :class:`FrameMeta` for ``split_mismatch``
    and ``model_mismatch`` and ``None`` when the header could not be parsed.
    """

    def __init__(self, cause: str, meta: FrameMeta | None = None, detail: str = ""):
        super().__init__(f"slot rejected: {cause}" + (f" ({detail})" if detail else ""))
        self.cause = cause
        self.meta = meta


@dataclass(frozen=True)
class FrameMeta:
    """Header of one published frame.

    seq: 1, 2, 3, ... in publish order (no gaps; a drop shows as a gap on the consumer side).
    stamp_ns: the producer's frame stamp (ns, any clock the producer chose, e.g. the camera stamp).
    shape / dtype: the payload tensor's shape (at most 4 dims) and torch dtype.
    split_layer / model_id: decoder block index K and model identity the producer declared.
    t_write_start_ns / t_publish_ns: ``time.monotonic_ns()`` (CLOCK_MONOTONIC, comparable across processes) when
    the slot was acquired (copy start) and when it was published.
    timings_ms: up to 8 floats (ms) passed through from the producer (stage timings).
    """

    seq: int
    stamp_ns: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    split_layer: int
    model_id: int
    t_write_start_ns: int
    t_publish_ns: int
    timings_ms: tuple[float, ...]

    @property
    def nbytes(self) -> int:
        """Payload size in bytes (numel times element size)."""
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    return size if size is not None else torch.empty((), dtype=dtype).element_size()


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _check_shape_dtype(shape, dtype) -> tuple[tuple[int, ...], int, int]:
    """Validate shape/dtype; returns (shape, dtype code, payload nbytes). ValueError / TypeError."""
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_CODES:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {sorted(str(d) for d in _DTYPE_CODES)}")
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"shape {shape} has more than {MAX_NDIM} dims")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape, _DTYPE_CODES[dtype], math.prod(shape) * _itemsize(dtype)


def slot_bytes_for(shape, dtype: torch.dtype) -> int:
    """Payload capacity in bytes needed for one tensor of ``shape`` (at most 4 dims) and ``dtype``.

    Returns numel * element size rounded up to 64 bytes (at least 64). Raises ValueError for a bad shape and
    TypeError for a dtype the ring cannot carry (supported: float32/16/64, bfloat16, (u)int8, int16/32/64, bool).
    """
    _, _, nbytes = _check_shape_dtype(shape, dtype)
    return max(PAYLOAD_ALIGN, _align(nbytes, PAYLOAD_ALIGN))


def _validate_segment_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > MAX_SEGMENT_NAME:
        raise ValueError(
            f"invalid segment name {name!r}: use [A-Za-z0-9_.-], not starting with '.' or '-', "
            f"at most {MAX_SEGMENT_NAME} characters (see segment_name())")
    return name


def segment_name(ring_name: str, namespace: str = "/") -> str:
    """Segment name ``hybrid_vla.<uid>.<ns>.<ring_name>`` for a ring in a ROS namespace.

    The namespace (ROS characters ``[A-Za-z0-9_/]``, leading/trailing '/' optional) is written with '/' mapped to
    '-' (ROS names cannot contain '-', so the mapping is one-to-one): "/" -> "-", "/car1/front" -> "-car1-front".
    ``ring_name`` must match ``[A-Za-z0-9_-]+``. Raises ValueError for an unsafe ring name (e.g. containing '/')
    or namespace (other characters, empty components like "a//b"), or a result longer than 100 characters.
    """
    if not isinstance(ring_name, str) or not _RING_RE.fullmatch(ring_name):
        raise ValueError(f"invalid ring name {ring_name!r}: use [A-Za-z0-9_-]+")
    if not isinstance(namespace, str) or not _NS_RE.fullmatch(namespace):
        raise ValueError(f"invalid ROS namespace {namespace!r}: use [A-Za-z0-9_/]")
    inner = namespace.strip("/")
    if "//" in inner:
        raise ValueError(f"invalid ROS namespace {namespace!r}: empty component")
    ns = ("/" + inner).replace("/", "-")
    return _validate_segment_name(f"hybrid_vla.{os.getuid()}.{ns}.{ring_name}")


def segment_path(name: str) -> str:
    """Filesystem path of a segment: ``/dev/shm/<name>``. Raises ValueError for an invalid name."""
    return os.path.join(SHM_DIR, _validate_segment_name(name))


def _wake_address(name: str) -> bytes:
    return b"\0" + (name + ".wake").encode()


def _proc_identity(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of a process, or None if it does not exist."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # fields[0] is field 3 (state), field 22 is fields[19]
    return fields[0].decode(), int(fields[19])


def _process_alive(pid: int, start_time: int) -> bool:
    ident = _proc_identity(pid)
    return ident is not None and ident[0] not in ("Z", "X", "x") and ident[1] == start_time


class _SegmentLock:
    """Mutex between processes (OFD lock on byte 0 of the segment) and threads (threading.Lock)."""

    __slots__ = ("_fd", "_tlock")

    def __init__(self, fd: int):
        self._fd = fd
        self._tlock = threading.Lock()

    def __enter__(self):
        self._tlock.acquire()
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, _LOCK_BYTE0)
        except BaseException:
            self._tlock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _UNLOCK_BYTE0)
        finally:
            self._tlock.release()
        return False


class _Handles:
    """The fd / socket of a ring end; closed by close() or by a weakref finalizer (also at interpreter exit)."""

    def __init__(self, fd: int, sock: socket.socket, unlink_path: str | None, ident: tuple[int, int]):
        self.fd, self.sock, self.unlink_path, self.ident = fd, sock, unlink_path, ident
        self.wake_address: bytes | None = None

    def close(self) -> None:
        if self.unlink_path is not None:
            try:
                st = os.stat(self.unlink_path)
                if (st.st_dev, st.st_ino) == self.ident:  # never unlink a successor's segment
                    os.unlink(self.unlink_path)
            except FileNotFoundError:
                pass
            if self.wake_address is not None:  # wake a waiting consumer so it notices producer_gone
                _send_wake(self.sock, self.wake_address)
        self.sock.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _send_wake(sock: socket.socket, address: bytes) -> bool:
    """Send one wake byte; False only for an unexpected error (the frame is still found by the next read)."""
    try:
        sock.sendto(b"\x01", address)
    except OSError as e:  # no consumer bound, or its queue is full (it has wake-ups pending anyway)
        return e.errno in _IGNORED_SEND_ERRNOS
    return True


def _map(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _view(mm: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # torch.frombuffer keeps a reference to the mmap object (not a buffer export), so the mapping lives as
    # long as any view; the ring therefore never calls mmap.close() and lets reference counting unmap it.
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)


class WriteSlot:
    """A slot acquired by the producer and not yet published.

    ``tensor``: writable CPU tensor of the requested shape/dtype that lives inside the segment; copy the frame
    into it (``slot.tensor.copy_(src)``). ``seq``: the seq this frame gets when published. ``index``: slot
    index. ``t_write_start_ns``: ``time.monotonic_ns()`` at acquire. Do not touch ``tensor`` after publish/abort.
    A WriteSlot dropped without publish/abort is taken back (counted as aborted) by the next acquire().
    """

    __slots__ = ("tensor", "seq", "index", "shape", "dtype", "t_write_start_ns", "_nbytes", "_code", "_done",
                 "__weakref__")

    def __init__(self, tensor, seq, index, shape, dtype, code, nbytes, t_write_start_ns):
        self.tensor, self.seq, self.index, self.shape, self.dtype = tensor, seq, index, shape, dtype
        self._code, self._nbytes, self.t_write_start_ns, self._done = code, nbytes, t_write_start_ns, False


class ReadSlot:
    """A frame the consumer holds (slot state READING) until :meth:`release` or the end of a ``with`` block.

    ``tensor``: zero-copy CPU view into the segment, shape ``meta.shape``, dtype ``meta.dtype``; treat it as
    read-only and do not use it after release (the producer may overwrite the slot then; clone what you keep).
    ``meta``: the :class:`FrameMeta`. ``index``: slot index. A ReadSlot dropped without release() is released
    by the consumer's next read().
    """

    __slots__ = ("tensor", "meta", "index", "_consumer", "_released", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meta: FrameMeta, index: int, consumer: RingConsumer):
        self.tensor, self.meta, self.index, self._consumer, self._released = tensor, meta, index, consumer, False

    def release(self) -> None:
        """Give the slot back to the producer (state FREE). Idempotent; a no-op after the consumer closed."""
        if not self._released:
            self._released = True
            self._consumer._release(self.index, self.meta.seq)

    def __enter__(self) -> ReadSlot:
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


class _RingEnd:
    """Shared plumbing of producer and consumer."""

    _mm: mmap.mmap | None
    _handles: _Handles
    _closed: bool

    def _slot_offset(self, index: int) -> int:
        return GLOBAL_HEADER_BYTES + index * self.slot_stride

    def _set_state(self, index: int, state: int) -> None:
        _STATE.pack_into(self._mm, self._slot_offset(index) + SLOT_STATE_OFFSET, state)

    def slot_states(self) -> list[str]:
        """Diagnostic snapshot of every slot's state name (FREE/WRITING/READY/READING, or UNKNOWN(<n>)).

        Raises RingError after close().
        """
        if self._closed:
            raise RingError("ring end is closed")
        with self._lock:
            states = [_SLOT_PREFIX.unpack_from(self._mm, self._slot_offset(i))[2] for i in range(self.n_slots)]
        return [STATE_NAMES.get(s, f"UNKNOWN({s})") for s in states]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


class RingProducer(_RingEnd):
    """Creates the segment and publishes frames into it (single producer).

    Args:
        name: segment name (``segment_name(...)`` builds one), file ``/dev/shm/<name>``.
        n_slots: number of slots, >= 3 (one being read, one being written, one ready) and <= 1024.
        slot_bytes: payload capacity per slot in bytes (``slot_bytes_for(shape, dtype)``); rounded up to 64.
        model_id: int64 written into every slot header (the consumer can require it).

    The segment (mode 0600 whatever the umask) is fully initialised under a temporary name, then hard-linked
    into place, so nobody ever attaches to a half-initialised segment. If the name exists and its owner (pid
    and process start time) is alive and is another process, raises RingNameConflict; a leftover of a dead or
    pid-reused owner, of this very process, or a file that is not a ring is unlinked and replaced. Raises
    ValueError for bad arguments (TypeError for non-integers) and OSError (e.g. ENOSPC from posix_fallocate)
    if /dev/shm cannot hold it. ``close()`` (or the end of a ``with`` block, or interpreter exit) unlinks the
    segment. Not fork-safe: create it in the process that uses it.

    Attributes: ``name``, ``path``, ``n_slots``, ``slot_bytes`` (payload capacity, bytes), ``slot_stride`` and
    ``total_bytes`` (bytes), ``model_id``, ``owner_pid``, ``owner_start_time`` (clock ticks), ``instance_id``.
    """

    def __init__(self, name: str, n_slots: int, slot_bytes: int, model_id: int):
        self.name = _validate_segment_name(name)
        self.path = segment_path(name)
        n_slots, slot_bytes, model_id = operator.index(n_slots), operator.index(slot_bytes), operator.index(model_id)
        if not MIN_SLOTS <= n_slots <= MAX_SLOTS:
            raise ValueError(f"n_slots must be in [{MIN_SLOTS}, {MAX_SLOTS}], got {n_slots}")
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        if not -(1 << 63) <= model_id < (1 << 63):
            raise ValueError("model_id must fit in int64")
        self.n_slots = n_slots
        self.slot_bytes = _align(slot_bytes, PAYLOAD_ALIGN)
        self.slot_stride = SLOT_HEADER_BYTES + self.slot_bytes
        self.total_bytes = GLOBAL_HEADER_BYTES + n_slots * self.slot_stride
        self.model_id = int(model_id)
        self.owner_pid = os.getpid()
        self.owner_start_time = _proc_identity(self.owner_pid)[1]
        self.instance_id = secrets.randbits(64)
        self._closed = True
        self._published = 0
        self._dropped = 0
        self._aborted = 0
        self._wake_errors = 0
        self._next_seq = 1
        self._next_index = 0
        self._outstanding: weakref.ref | None = None

        self._remove_dead_init_files()
        # pid and process start time in the name: a leftover of a dead process is recognised even if its
        # pid has been reused since (see _remove_dead_init_files)
        tmp = f"{self.path}.init-{self.owner_pid}-{self.owner_start_time}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        sock = None
        try:
            os.fchmod(fd, 0o600)
            os.posix_fallocate(fd, 0, self.total_bytes)  # reserve tmpfs pages: ENOSPC now, not SIGBUS later
            self._mm = _map(fd, self.total_bytes)
            _GLOBAL.pack_into(
                self._mm, 0, GLOBAL_MAGIC, LAYOUT_VERSION, GLOBAL_HEADER_BYTES, self.owner_pid,
                self.owner_start_time, self.instance_id, n_slots, SLOT_HEADER_BYTES, self.slot_bytes,
                self.slot_stride, self.total_bytes, self.model_id, time.monotonic_ns())
            st = os.fstat(fd)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            for _attempt in range(16):  # nothing after a successful link can fail
                try:
                    os.link(tmp, self.path)
                    break
                except FileExistsError:
                    self._evict_existing()
            else:
                raise RingError(f"could not create {self.path}: it keeps being re-created by someone else")
        except BaseException:
            os.close(fd)
            if sock is not None:
                sock.close()
            self._mm = None
            raise
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        self._handles = _Handles(fd, sock, self.path, (st.st_dev, st.st_ino))
        self._handles.wake_address = self._wake = _wake_address(name)
        self._finalizer = weakref.finalize(self, self._handles.close)
        self._lock = _SegmentLock(fd)
        self._closed = False

    def _remove_dead_init_files(self) -> None:
        prefix = self.name + ".init-"
        try:
            entries = os.listdir(SHM_DIR)
        except OSError:
            return
        for entry in entries:
            if entry.startswith(prefix):
                parts = entry[len(prefix):].split("-")
                if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
                    continue  # not a file of ours
                if not _process_alive(int(parts[0]), int(parts[1])):
                    try:
                        os.unlink(os.path.join(SHM_DIR, entry))
                    except OSError:
                        pass

    def _evict_existing(self) -> None:
        """The name exists: raise RingNameConflict if a live other process owns it, else unlink it."""
        try:
            lst = os.lstat(self.path)
        except FileNotFoundError:
            return
        if lst.st_uid != os.getuid():
            raise RingNameConflict(f"{self.path} belongs to uid {lst.st_uid}")
        if not stat.S_ISREG(lst.st_mode):
            raise RingNameConflict(f"{self.path} is not a regular file")
        try:
            efd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            st = os.fstat(efd)
            head = os.pread(efd, _GLOBAL_OWNER.size, 0)
            if len(head) == _GLOBAL_OWNER.size:
                magic, _ver, _hb, pid, start, _inst = _GLOBAL_OWNER.unpack(head)
                is_us = pid == self.owner_pid and start == self.owner_start_time
                if magic == GLOBAL_MAGIC and not is_us and _process_alive(pid, start):
                    raise RingNameConflict(f"{self.path} is owned by live process {pid}")
            try:
                cur = os.stat(self.path)
            except FileNotFoundError:
                return
            if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(self.path)
        finally:
            os.close(efd)

    @property
    def stats(self) -> dict:
        """Counters: ``published``, ``dropped_oldest`` (READY frames overwritten before the consumer took them),
        ``aborted`` (slots given back unpublished), ``wake_errors`` (notifications that failed unexpectedly; the
        frames were still published)."""
        return {"published": self._published, "dropped_oldest": self._dropped, "aborted": self._aborted,
                "wake_errors": self._wake_errors}

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype) -> WriteSlot:
        """Take a slot for one frame of ``shape`` (<= 4 dims) and ``dtype`` (e.g. bf16 (tokens, hidden)).

        Returns a WriteSlot whose ``tensor`` is a writable CPU view of that shape/dtype into the segment. Takes a
        FREE slot (the one written last when the consumer has freed it: its memory is warm in the cache), else
        the oldest READY one (its frame is dropped and counted in ``dropped_oldest``), never a READING one. Raises ValueError if the payload exceeds ``slot_bytes`` or the shape is bad, TypeError for
        an unsupported dtype, RingError if a previous WriteSlot is still alive and neither published nor aborted
        (one that was garbage-collected unpublished is aborted here) or if the ring is closed.
        """
        if self._closed:
            raise RingError("producer is closed")
        shape, code, nbytes = _check_shape_dtype(shape, dtype)
        if nbytes > self.slot_bytes:
            raise ValueError(f"payload {nbytes} bytes exceeds slot capacity {self.slot_bytes} bytes")
        if self._outstanding is not None:
            prev = self._outstanding()
            if prev is not None and not prev._done:
                raise RingError("acquire() while a previous WriteSlot is neither published nor aborted")
        seq = self._next_seq
        mm = self._mm
        with self._lock:
            if self._outstanding is not None:  # a dropped WriteSlot: its WRITING slot is reusable below
                self._outstanding = None
                self._aborted += 1
            chosen = -1
            oldest, oldest_seq = -1, 0
            for k in range(self.n_slots):
                i = (self._next_index + k) % self.n_slots
                _m, _v, state, slot_seq = _SLOT_PREFIX.unpack_from(mm, self._slot_offset(i))
                if state == READY:
                    if oldest < 0 or slot_seq < oldest_seq:
                        oldest, oldest_seq = i, slot_seq
                elif state != READING:  # FREE, a leftover WRITING, or garbage
                    chosen = i
                    break
            if chosen < 0:
                if oldest < 0:
                    raise RingError("no slot available: every slot is READING (header corruption?)")
                chosen = oldest
                self._dropped += 1
            _SLOT_PREFIX.pack_into(mm, self._slot_offset(chosen), SLOT_MAGIC, SLOT_VERSION, WRITING, seq)
        # Start the next scan at this slot: once the consumer has freed it, the next frame is written into the
        # same memory, still warm in the cache, instead of rotating through every slot (an 8 MiB copy into a
        # warm slot took 0.15 ms here, into slots rotated round-robin 0.23-0.26 ms).
        self._next_index = chosen
        tensor = _view(mm, self._slot_offset(chosen) + SLOT_HEADER_BYTES, shape, dtype)
        slot = WriteSlot(tensor, seq, chosen, shape, dtype, code, nbytes, time.monotonic_ns())
        self._outstanding = weakref.ref(slot)
        return slot

    def _take_back(self, slot: WriteSlot) -> None:
        if self._closed:
            raise RingError("producer is closed")
        if slot._done or self._outstanding is None or self._outstanding() is not slot:
            raise RingError("this WriteSlot is not the producer's outstanding slot (already published/aborted?)")

    def publish(self, slot: WriteSlot, *, stamp_ns: int, split_layer: int, timings_ms=()) -> int:
        """Publish a filled slot (state READY) and wake the consumer; returns the frame's seq.

        ``stamp_ns``: frame stamp (int64 ns); ``split_layer``: int32 decoder block index K; ``timings_ms``: up
        to 8 floats (ms) passed through to FrameMeta. Raises RingError if ``slot`` is not the outstanding slot
        or the ring is closed, ValueError for more than 8 timings or out-of-range ints.
        """
        self._take_back(slot)
        timings = tuple(float(t) for t in timings_ms)
        if len(timings) > MAX_TIMINGS:
            raise ValueError(f"at most {MAX_TIMINGS} timings, got {len(timings)}")
        split_layer, stamp_ns = int(split_layer), int(stamp_ns)
        if not -(1 << 31) <= split_layer < (1 << 31) or not -(1 << 63) <= stamp_ns < (1 << 63):
            raise ValueError("split_layer must fit in int32 and stamp_ns in int64")
        shape4 = slot.shape + (0,) * (MAX_NDIM - len(slot.shape))
        t_pub = time.monotonic_ns()
        off = self._slot_offset(slot.index)
        with self._lock:
            _m, _v, state, slot_seq = _SLOT_PREFIX.unpack_from(self._mm, off)
            if state != WRITING or slot_seq != slot.seq:
                raise RingError(f"slot {slot.index} changed under the producer (state {state}, seq {slot_seq})")
            _SLOT.pack_into(
                self._mm, off, SLOT_MAGIC, SLOT_VERSION, READY, slot.seq, stamp_ns, slot.t_write_start_ns, t_pub,
                slot._nbytes, self.model_id, split_layer, slot._code, len(slot.shape), len(timings), *shape4,
                *(timings + (0.0,) * (MAX_TIMINGS - len(timings))))
        slot._done = True
        self._outstanding = None
        self._published += 1
        self._next_seq += 1
        if not _send_wake(self._handles.sock, self._wake):
            self._wake_errors += 1
        return slot.seq

    def abort(self, slot: WriteSlot) -> None:
        """Give an acquired slot back unpublished (state FREE); its seq is reused by the next acquire.

        Raises RingError if ``slot`` is not the outstanding slot or the ring is closed.
        """
        self._take_back(slot)
        with self._lock:
            self._set_state(slot.index, FREE)
        slot._done = True
        self._outstanding = None
        self._aborted += 1

    def close(self) -> None:
        """Unlink the segment (only if the name still points at this producer's segment), wake the consumer so
        it sees ``producer_gone``, and close the fd and socket. Idempotent. Views handed out stay mapped
        until they are garbage-collected."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        self._mm = None


class RingConsumer(_RingEnd):
    """Attaches to a producer's segment and reads its frames (single consumer; never unlinks the segment).

    Args:
        name: segment name, as given to the producer.
        expected_model_id: if not None, frames whose model id differs are rejected (``model_mismatch``).
        expected_split_layer: if not None, frames whose split layer differs are rejected (``split_mismatch``):
            an int (that K only) or a container of ints (e.g. ``range(0, L + 1)``, every K the model has, for a
            consumer that follows a live re-split); a plain attribute, settable at any time.

    Raises FileNotFoundError if the segment does not exist, RingError if it is not a compatible ring, belongs
    to another uid, or another live consumer is attached (its wake socket is bound). Slots left READING by a
    crashed consumer are reset to FREE (that frame is lost, not re-delivered out of order).
    Frames published before attaching and not yet overwritten are delivered.

    Attributes: ``name``, ``path``, ``n_slots``, ``slot_bytes``, ``slot_stride``, ``total_bytes`` (bytes),
    ``model_id`` (the producer's, from the global header), ``owner_pid``, ``owner_start_time``, ``instance_id``,
    ``expected_model_id``, ``expected_split_layer``.
    """

    def __init__(self, name: str, *, expected_model_id: int | None = None,
                 expected_split_layer=None):
        self.name = _validate_segment_name(name)
        self.path = segment_path(name)
        self.expected_model_id = expected_model_id
        self.expected_split_layer = expected_split_layer
        self._closed = True
        self._read = 0
        self._rejected = {cause: 0 for cause in REJECT_CAUSES}
        self._outstanding: weakref.ref | None = None
        self._outstanding_key: tuple[int, int] | None = None
        self._mm = None
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        sock = None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise RingError(f"{self.path} belongs to uid {st.st_uid}, not {os.getuid()}")
            head = os.pread(fd, _GLOBAL.size, 0)
            if len(head) < _GLOBAL.size:
                raise RingError(f"{self.path} is too small to be a ring")
            (magic, version, header_bytes, self.owner_pid, self.owner_start_time, self.instance_id, n_slots,
             slot_header_bytes, slot_bytes, stride, total, self.model_id, _created) = _GLOBAL.unpack(head)
            if magic != GLOBAL_MAGIC:
                raise RingError(f"{self.path} is not a hybrid_vla ring (bad magic)")
            if version != LAYOUT_VERSION:
                raise RingError(f"{self.path} has layout version {version}, this code reads {LAYOUT_VERSION}")
            if (header_bytes != GLOBAL_HEADER_BYTES or slot_header_bytes != SLOT_HEADER_BYTES
                    or not MIN_SLOTS <= n_slots <= MAX_SLOTS or stride != SLOT_HEADER_BYTES + slot_bytes
                    or slot_bytes % PAYLOAD_ALIGN or total != GLOBAL_HEADER_BYTES + n_slots * stride
                    or st.st_size < total):
                raise RingError(f"{self.path} has an inconsistent global header")
            self.n_slots, self.slot_bytes, self.slot_stride, self.total_bytes = n_slots, slot_bytes, stride, total
            self._ident = (st.st_dev, st.st_ino)
            self._mm = _map(fd, total)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
            try:
                sock.bind(_wake_address(name))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise RingError(f"another consumer is attached to {name}") from None
                raise
        except BaseException:
            os.close(fd)
            if sock is not None:
                sock.close()
            self._mm = None
            raise
        self._handles = _Handles(fd, sock, None, self._ident)
        self._finalizer = weakref.finalize(self, self._handles.close)
        self._lock = _SegmentLock(fd)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._drain_buf = bytearray(64)
        reclaimed = 0
        with self._lock:  # we are the only consumer: READING slots belong to a dead predecessor
            for i in range(self.n_slots):
                if _SLOT_PREFIX.unpack_from(self._mm, self._slot_offset(i))[2] == READING:
                    self._set_state(i, FREE)
                    reclaimed += 1
        self._reclaimed = reclaimed
        self._closed = False

    @property
    def stats(self) -> dict:
        """Counters: ``read`` (frames handed out), ``rejected_<cause>`` for each cause in REJECT_CAUSES,
        ``reclaimed_reading`` (READING slots of a dead predecessor reset to FREE at attach)."""
        out = {"read": self._read}
        out.update({f"rejected_{c}": n for c, n in self._rejected.items()})
        out["reclaimed_reading"] = self._reclaimed
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

    def _drain(self) -> None:
        sock, buf = self._handles.sock, self._drain_buf
        try:
            while True:
                sock.recv_into(buf)
        except BlockingIOError:
            pass

    def _validate(self, raw: tuple) -> tuple[str | None, FrameMeta | None]:
        (magic, version, _state, seq, stamp, t_ws, t_pub, nbytes, model_id, split, code, ndim, n_tim) = raw[:13]
        if magic != SLOT_MAGIC:
            return "bad_magic", None
        if version != SLOT_VERSION:
            return "bad_version", None
        dtype = _CODE_DTYPES.get(code)
        if dtype is None:
            return "bad_dtype", None
        if ndim > MAX_NDIM:
            return "bad_shape", None
        shape = tuple(raw[13:13 + ndim])
        if any(s < 0 for s in shape):
            return "bad_shape", None
        if nbytes > self.slot_bytes or math.prod(shape) * _itemsize(dtype) != nbytes:
            return "bad_shape", None
        timings = tuple(raw[17:17 + min(n_tim, MAX_TIMINGS)])
        meta = FrameMeta(seq, stamp, shape, dtype, split, model_id, t_ws, t_pub, timings)
        if self.expected_model_id is not None and model_id != self.expected_model_id:
            return "model_mismatch", meta
        expected = self.expected_split_layer
        if expected is not None and (split != expected if isinstance(expected, int) else split not in expected):
            return "split_mismatch", meta
        return None, meta

    def _try_take(self) -> ReadSlot | None:
        mm = self._mm
        with self._lock:
            best, best_seq = -1, 0
            for i in range(self.n_slots):
                _m, _v, state, seq = _SLOT_PREFIX.unpack_from(mm, self._slot_offset(i))
                if state == READY and (best < 0 or seq < best_seq):
                    best, best_seq = i, seq
            if best < 0:
                return None
            cause, meta = self._validate(_SLOT.unpack_from(mm, self._slot_offset(best)))
            self._set_state(best, FREE if cause else READING)
        if cause:
            self._rejected[cause] += 1
            raise SlotRejected(cause, meta, f"slot {best}")
        self._read += 1
        slot = ReadSlot(_view(mm, self._slot_offset(best) + SLOT_HEADER_BYTES, meta.shape, meta.dtype),
                        meta, best, self)
        self._outstanding = weakref.ref(slot)
        self._outstanding_key = (best, meta.seq)
        return slot

    def read(self, timeout_s: float) -> ReadSlot | None:
        """Wait up to ``timeout_s`` seconds (0: do not wait) for the oldest unread published frame.

        Returns a ReadSlot (slot now READING until released) or None on timeout; also returns None early when no
        frame is ready and ``producer_gone`` is true. Frames published before the call are found without
        waiting; stale wake-ups are drained. Raises SlotRejected if the oldest READY slot's header is invalid
        (the slot is freed and ``rejected_<cause>`` counted; call read() again for the next frame), RingError if
        the previous ReadSlot is still alive and unreleased (one garbage-collected unreleased is released here)
        or the consumer is closed.
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
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            self._drain()
            slot = self._try_take()
            if slot is not None:
                return slot
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.producer_gone:
                return None
            self._poll.poll(math.ceil(remaining * 1000))

    def _release(self, index: int, seq: int) -> None:
        if self._closed:
            return
        off = self._slot_offset(index)
        with self._lock:
            _m, _v, state, slot_seq = _SLOT_PREFIX.unpack_from(self._mm, off)
            if state == READING and slot_seq == seq:
                self._set_state(index, FREE)
        if self._outstanding_key == (index, seq):
            self._outstanding = None
            self._outstanding_key = None

    def close(self) -> None:
        """Release a held slot, unbind the wake socket and close the fd; never unlinks. Idempotent. Views
        handed out stay mapped until they are garbage-collected (their contents may change)."""
        if self._closed:
            return
        if self._outstanding_key is not None:
            self._release(*self._outstanding_key)
        self._closed = True
        self._finalizer()
        self._mm = None
