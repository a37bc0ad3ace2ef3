"""The ring's shared-memory segment: its name and path, global header layout, owner identity, mapping and the
mutex between processes.

One POSIX shared-memory file ``/dev/shm/<name>`` (mode 0600) holds a 4096-byte global header and ``n_slots``
slots (slot layout: :mod:`.slots`). All integers little-endian; offsets in bytes::

      0 magic u64 (GLOBAL_MAGIC)     8 layout version u32        12 header bytes u32 (offset of slot 0)
     16 owner pid i64               24 owner start time u64 (clock ticks after boot, /proc/<pid>/stat field 22)
     32 instance id u64 (random)    40 n_slots u32              44 slot header bytes u32
     48 slot payload capacity u64   56 slot stride u64          64 total segment bytes u64
     72 model id i64                80 created at, CLOCK_MONOTONIC ns          (struct "<QIIqQQIIQQQqq")
     96 contract (layout 2): dtype code u32 (0 undeclared)   100 device kind u32 (contract.DEVICE_KINDS)
    104 state ndim i32 (-1 undeclared)   112 state shape i64[4]                (struct "<IIi4x4q")
    160 wake-up directory name, 64 bytes ASCII, NUL-padded (:mod:`.wake`)
    256 publish count u64           264 last publish CLOCK_MONOTONIC ns i64    (own cache line; a hint, see
                                                                               wake.FrameWaiter)
    320 consumer's last take i64    328 its expected next read i64, CLOCK_MONOTONIC ns (0: none) (own cache
                                                                               line; written by the consumer,
                                                                               a pacing hint)

Mutex: an open-file-description record lock (``F_OFD_SETLKW``, Linux >= 3.15, fcntl(2)) on byte 0 of the
segment, which the kernel drops when its holder dies, plus a ``threading.Lock`` per object. (A classic
``fcntl.lockf`` lock belongs to the process, so it would not exclude a producer and a consumer in one process,
and closing any fd of the file would drop it.) Byte 1 carries the single consumer's lock (:mod:`.consumer`).
The global header's geometry, owner and contract are written and read in one place, :class:`.ring_end.RingEnd`.
"""
from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import struct
import threading

import torch

__all__ = ["SHM_DIR", "LAYOUT_VERSION", "GLOBAL_MAGIC", "GLOBAL_HEADER_BYTES", "SLOT_HEADER_BYTES", "PAYLOAD_ALIGN",
           "MIN_SLOTS", "MAX_SLOTS", "segment_name", "segment_path", "SegmentLock", "try_lock_byte"]

SHM_DIR = "/dev/shm"
LAYOUT_VERSION = 2  # 2: contract, wake-up directory and publish count in the global header; READY written last
GLOBAL_MAGIC = int.from_bytes(b"HVLARNG1", "little")
GLOBAL_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 256
PAYLOAD_ALIGN = 64
MIN_SLOTS = 3
MAX_SLOTS = 1024
MAX_SEGMENT_NAME = 100

_GLOBAL = struct.Struct("<QIIqQQIIQQQqq")
_GLOBAL_OWNER = struct.Struct("<QIIqQQ")  # magic .. instance id: fixed across layout versions
_CONTRACT = struct.Struct("<IIi4x4q")
CONTRACT_OFFSET = 96
_WAKE_NAME = struct.Struct("<64s")
WAKE_NAME_OFFSET = 160
_PUBLISHED = struct.Struct("<Qq")
PUBLISHED_OFFSET = 256
_NEXT_READ = struct.Struct("<qq")
NEXT_READ_OFFSET = 320
assert _GLOBAL.size <= CONTRACT_OFFSET and CONTRACT_OFFSET + _CONTRACT.size <= WAKE_NAME_OFFSET
assert WAKE_NAME_OFFSET + _WAKE_NAME.size <= PUBLISHED_OFFSET and PUBLISHED_OFFSET % 64 == 0

# struct flock for F_OFD_SETLK(W): short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (must be 0)
_FLOCK = struct.Struct("@hhqqi4x")

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_RING_RE = re.compile(r"[A-Za-z0-9_\-]+")
_NS_RE = re.compile(r"[A-Za-z0-9_/]*")


def align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def validate_segment_name(name: str) -> str:
    """Return ``name`` if it is a safe segment file name, else raise ValueError."""
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
    return validate_segment_name(f"hybrid_vla.{os.getuid()}.{ns}.{ring_name}")


def segment_path(name: str) -> str:
    """Filesystem path of a segment: ``/dev/shm/<name>``. Raises ValueError for an invalid name."""
    return os.path.join(SHM_DIR, validate_segment_name(name))


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
    """True if process ``pid`` exists, is not a zombie and started at ``start_time`` (not a reused pid)."""
    ident = _proc_identity(pid)
    return ident is not None and ident[0] not in ("Z", "X", "x") and ident[1] == start_time


def map_segment(fd: int, nbytes: int) -> mmap.mmap:
    """Shared read-write mapping of the first ``nbytes`` of ``fd``, pages populated up front."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def tensor_view(mm: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy tensor of ``shape`` / ``dtype`` over ``mm`` at byte ``offset``.

    torch.frombuffer keeps a reference to the mmap object (not a buffer export), so the mapping lives as long
    as any view; the ring therefore never calls mmap.close() and lets reference counting unmap it."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)


def _flock(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


def try_lock_byte(fd: int, byte: int) -> bool:
    """Take an OFD write lock on one byte of ``fd`` without waiting; False if another open file description
    holds it. Held until every fd of this open file description is closed (or the holder dies)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte))
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held elsewhere
        return False
    return True


class SegmentLock:
    """Mutex between processes (OFD lock on byte 0 of the segment) and threads (threading.Lock)."""

    __slots__ = ("_fd", "_tlock")
    _LOCK, _UNLOCK = _flock(fcntl.F_WRLCK, 0), _flock(fcntl.F_UNLCK, 0)

    def __init__(self, fd: int):
        self._fd = fd
        self._tlock = threading.Lock()

    def __enter__(self):
        self._tlock.acquire()
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLKW, self._LOCK)
        except BaseException:
            self._tlock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, self._UNLOCK)
        finally:
            self._tlock.release()
        return False
