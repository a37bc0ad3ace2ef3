"""The ring's shared-memory segment: name and path, global header, owner identity, mapping and the mutex.

``/dev/shm/<name>`` (mode 0600) holds a 4096-byte global header and ``n_slots`` slots (:mod:`.slots`). The
header's fields are declared in :data:`.layout.GLOBAL` (table at the end of this docstring) and written and read
only by :class:`.ring_end.RingEnd`.

Slot payload: the hidden states at offset 0, in ``state bytes`` (the payload capacity ``slot_bytes`` less the side
region); then each side tensor in the table's order, 64-byte aligned, each taking its nbytes rounded up to 64; the
side region ends at ``slot_bytes``.

Mutex: an open-file-description record lock (``F_OFD_SETLKW``, Linux >= 3.15, fcntl(2)) on byte 0, which the
kernel drops when its holder dies, plus a ``threading.Lock`` per object. (A classic ``fcntl.lockf`` lock belongs
to the process, so it would not exclude a producer and a consumer in one process, and closing any fd of the file
would drop it.) Byte 1 is the single consumer's lock (:mod:`.consumer`).

"""
from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import struct
import threading
from typing import NamedTuple

import torch

from .layout import GLOBAL, GLOBAL_HEADER_BYTES, MAX_SIDE_TENSORS, SLOT_HEADER_BYTES

__all__ = ["SHM_DIR", "LAYOUT_VERSION", "GLOBAL_MAGIC", "GLOBAL_HEADER_BYTES", "SLOT_HEADER_BYTES", "PAYLOAD_ALIGN",
           "MIN_SLOTS", "MAX_SLOTS", "MAX_DOMAIN_ID", "MAX_SIDE_TENSORS", "ros_domain_id", "segment_name",
           "segment_path", "SegmentLock", "try_lock_byte", "byte_locked", "Occupants", "segment_occupants",
           "proc_identity", "process_alive", "CONSUMER_LOCK_BYTE", "STAGE_STATES", "map_segment", "tensor_view",
           "align"]

SHM_DIR = "/dev/shm"
LAYOUT_VERSION = 9  # a segment of another version is refused (9: the decode channel's ended-reply record)
GLOBAL_MAGIC = int.from_bytes(b"HVLARNG1", "little")
PAYLOAD_ALIGN = 64
MIN_SLOTS = 3
MAX_SLOTS = 1024
MAX_SEGMENT_NAME = 100
#: Byte of the segment on which the single consumer holds its OFD lock (byte 0 is the mutex).
CONSUMER_LOCK_BYTE = 1
#: What an end says of itself in the header (``set_running``): its node works frames, or is inactive.
STAGE_STATES = {0: "not said", 1: "running", 2: "paused"}
__doc__ += "\n" + GLOBAL.table().replace("\n", "\n    ")  # the byte table, in help() and the docs

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


#: The largest ROS domain id: the RTPS well-known port mapping (DDSI-RTPS 2.5, 9.6.1.1: port base 7400 + 250 per
#: domain) runs out of UDP ports above 232, which both Fast DDS and Cyclone DDS use; ROS 2's docs recommend 0-101.
MAX_DOMAIN_ID = 232


def ros_domain_id(domain_id: int | None = None) -> int:
    """``domain_id`` when given, else ``ROS_DOMAIN_ID`` (unset or empty: 0), as ``rcl_get_default_domain_id``; a
    node passes its ``Context.get_domain_id()``. Raises ValueError, naming the source, for an id that is not an
    integer in [0, :data:`MAX_DOMAIN_ID`]."""
    if domain_id is None:
        text = os.environ.get("ROS_DOMAIN_ID", "").strip()
        if not text:
            return 0
        if not text.isdigit():
            raise ValueError(f"ROS_DOMAIN_ID={text!r} is not a domain id (a non-negative integer)")
        domain_id, source = int(text), "ROS_DOMAIN_ID"
    else:
        source = "domain_id"
    if isinstance(domain_id, bool) or not isinstance(domain_id, int) or not 0 <= domain_id <= MAX_DOMAIN_ID:
        raise ValueError(f"{source} {domain_id!r} is not a domain id (an integer in [0, {MAX_DOMAIN_ID}])")
    return domain_id


def segment_name(ring_name: str, namespace: str = "/", domain_id: int | None = None) -> str:
    """Segment name ``hybrid_vla.<uid>.d<domain>.<ns>.<ring_name>``: scoped by user, ROS domain and namespace, so
    two pipelines in two ROS domains on one computer never read each other's frames.

    ``domain_id``: as :func:`ros_domain_id`. The namespace (``[A-Za-z0-9_/]``, leading/trailing '/' optional) has
    '/' mapped to '-' (one-to-one: ROS names have no '-'): "/" -> "-", "/car1/front" -> "-car1-front". Raises
    ValueError for a ring name not matching ``[A-Za-z0-9_-]+``, a bad namespace (other characters, "a//b"), a bad
    domain id, or a result longer than 100 characters.
    """
    if not isinstance(ring_name, str) or not _RING_RE.fullmatch(ring_name):
        raise ValueError(f"invalid ring name {ring_name!r}: use [A-Za-z0-9_-]+")
    if not isinstance(namespace, str) or not _NS_RE.fullmatch(namespace):
        raise ValueError(f"invalid ROS namespace {namespace!r}: use [A-Za-z0-9_/]")
    inner = namespace.strip("/")
    if "//" in inner:
        raise ValueError(f"invalid ROS namespace {namespace!r}: empty component")
    ns = ("/" + inner).replace("/", "-")
    return validate_segment_name(f"hybrid_vla.{os.getuid()}.d{ros_domain_id(domain_id)}.{ns}.{ring_name}")


def segment_path(name: str) -> str:
    """Filesystem path of a segment: ``/dev/shm/<name>``. Raises ValueError for an invalid name."""
    return os.path.join(SHM_DIR, validate_segment_name(name))


def proc_identity(pid: int) -> tuple[str, int] | None:
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


def process_alive(pid: int, start_time: int) -> bool:
    """True if process ``pid`` exists, is not a zombie and started at ``start_time`` (not a reused pid)."""
    ident = proc_identity(pid)
    return ident is not None and ident[0] not in ("Z", "X", "x") and ident[1] == start_time


class Occupants(NamedTuple):
    """Who uses a ring segment (:func:`segment_occupants`): the producer that created it and whether it lives
    (pid and start time), the pid the consumer wrote at attach (0: none), whether a consumer holds its lock now."""

    owner_pid: int
    owner_alive: bool
    consumer_pid: int
    consumer_attached: bool


def segment_occupants(name: str) -> Occupants | None:
    """Who uses segment ``name`` now, changing nothing; None when it is not a ring of this uid and layout.
    Raises ValueError for an invalid name."""
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        head = os.pread(fd, GLOBAL_HEADER_BYTES, 0)
        if st.st_uid != os.getuid() or len(head) < GLOBAL_HEADER_BYTES:
            return None
        magic, version, _hb, pid, start, _inst = GLOBAL.identity.read(head)
        if magic != GLOBAL_MAGIC or version != LAYOUT_VERSION:
            return None
        consumer_pid, _consumer_start = GLOBAL.consumer.read(head)
        return Occupants(pid, process_alive(pid, start), consumer_pid, byte_locked(fd, CONSUMER_LOCK_BYTE))
    finally:
        os.close(fd)


def map_segment(fd: int, nbytes: int) -> mmap.mmap:
    """Shared read-write mapping of the first ``nbytes`` of ``fd``, pages populated up front."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def tensor_view(mm: mmap.mmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy tensor of ``shape`` / ``dtype`` over ``mm`` at byte ``offset``. torch.frombuffer keeps a
    reference to the mmap object, so the mapping lives as long as any view: the ring never calls mmap.close()."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset).view(shape)


def _flock(kind: int, byte: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0)


def try_lock_byte(fd: int, byte: int) -> bool:
    """Take an OFD write lock on one byte of ``fd`` without waiting; False if another open file description holds
    it. Held until every fd of this description is closed (or the holder dies)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte))
    except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held elsewhere
        return False
    return True


def byte_locked(fd: int, byte: int) -> bool:
    """True when another open file description locks one byte of ``fd`` (``F_OFD_GETLK``; this description's own
    lock does not count). Since the kernel drops a dead holder's lock, this tells whether a consumer is attached."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte))
    return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK


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
