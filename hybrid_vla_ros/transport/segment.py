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
    144 ROS domain id i32 (layout 3; -1 undeclared)
    160 wake-up directory name, 64 bytes ASCII, NUL-padded (:mod:`.wake`)
    256 publish count u64           264 last publish CLOCK_MONOTONIC ns i64    (own cache line; a hint, see
                                                                               wake.FrameWaiter)
    272 producer state u32 (layout 3; STAGE_STATES: 0 not said, 1 running, 2 paused)
    280 producer cycle i64 ns (layout 6; 0: none): the interval it expects between its publishes
    320 consumer's last take i64    328 its expected next read i64, CLOCK_MONOTONIC ns (0: none)
    336 consumer pid i64 (0: none)  344 consumer start time u64 (clock ticks)   (layout 3; own cache line,
    352 consumer state u32 (STAGE_STATES)                                       written by the consumer: the
    360 its stage time i64 ns (0: none) 368 the K it was measured at i32       pacing hint, who is attached, and
        (layout 5; the median compute time of its recent frames at that K)     its stage time)
    376 its frame age limit i64 ns (layout 6; 0: none): older frames are not published (its output guard)
    384 side tensors (layout 4): count u32, 4 bytes 0, state bytes u64 (payload offset of the side region: the
        hidden states' capacity)                                               (struct "<I4xQ")
    448 side-tensor table, SIDE_ENTRY_BYTES = 80 bytes per entry, MAX_SIDE_TENSORS = 32 entries (to 3008):
        +0 name 32 bytes ASCII, NUL-padded   +32 dtype code u32 (contract.DTYPE_CODES)   +36 ndim u32
        +40 dims i64[4] (0 past ndim)        +72 payload offset u64 (from the start of the slot's payload)
                                                                               (struct "<32sII4qQ")

Slot payload (layout 4; :mod:`.slots` for the slot header before it): the hidden states at payload offset 0, in
a region of ``state bytes`` (the payload capacity less the side region); then each side tensor, in the table's
order, at its payload offset: 64-byte aligned, each one's region its nbytes rounded up to 64. The side region
ends at the payload capacity (``slot_bytes``). With no side tensors the state bytes are the payload capacity.

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
from typing import NamedTuple

import torch

__all__ = ["SHM_DIR", "LAYOUT_VERSION", "GLOBAL_MAGIC", "GLOBAL_HEADER_BYTES", "SLOT_HEADER_BYTES", "PAYLOAD_ALIGN",
           "MIN_SLOTS", "MAX_SLOTS", "MAX_DOMAIN_ID", "MAX_SIDE_TENSORS", "ros_domain_id", "segment_name",
           "segment_path", "SegmentLock", "try_lock_byte", "byte_locked", "Occupants", "segment_occupants"]

SHM_DIR = "/dev/shm"
LAYOUT_VERSION = 6  # 2: contract, wake-up directory and publish count in the global header; READY written last;
#                    3: the ROS domain id, the consumer's pid and its last take (every take);
#                    4: side tensors (their table in the global header, their data after the hidden states);
#                    5: the consumer's stage time and the K it was measured at (live rebalancing);
#                    6: the producer's publish cycle and the consumer's frame age limit (health by time)
GLOBAL_MAGIC = int.from_bytes(b"HVLARNG1", "little")
GLOBAL_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 256
PAYLOAD_ALIGN = 64
MIN_SLOTS = 3
MAX_SLOTS = 1024
MAX_SEGMENT_NAME = 100
#: Byte of the segment on which the single consumer holds its OFD lock (byte 0 is the mutex).
CONSUMER_LOCK_BYTE = 1

_GLOBAL = struct.Struct("<QIIqQQIIQQQqq")
_GLOBAL_OWNER = struct.Struct("<QIIqQQ")  # magic .. instance id: fixed across layout versions
_CONTRACT = struct.Struct("<IIi4x4q")
CONTRACT_OFFSET = 96
_WAKE_NAME = struct.Struct("<64s")
WAKE_NAME_OFFSET = 160
_PUBLISHED = struct.Struct("<Qq")
PUBLISHED_OFFSET = 256
_DOMAIN = struct.Struct("<i")
DOMAIN_OFFSET = 144
_NEXT_READ = struct.Struct("<qq")
NEXT_READ_OFFSET = 320
_TAKEN = struct.Struct("<q")
TAKEN_OFFSET = 320
_CONSUMER = struct.Struct("<qQ")
CONSUMER_OFFSET = 336
_STATE = struct.Struct("<I")
PRODUCER_STATE_OFFSET = 272
_NS = struct.Struct("<q")  # one CLOCK_MONOTONIC duration in ns
PRODUCER_CYCLE_OFFSET = 280
CONSUMER_MAX_AGE_OFFSET = 376
CONSUMER_STATE_OFFSET = 352
_STAGE_TIME = struct.Struct("<qi")  # the consumer's stage time ns, the K of the frames it was measured on
STAGE_TIME_OFFSET = 360
_SIDE_HEAD = struct.Struct("<I4xQ")  # count, state bytes
SIDE_HEAD_OFFSET = 384
_SIDE_ENTRY = struct.Struct("<32sII4qQ")  # name, dtype code, ndim, dims, payload offset
SIDE_TABLE_OFFSET = 448
SIDE_ENTRY_BYTES = _SIDE_ENTRY.size
#: Most side tensors one ring carries (the table's entries in the global header).
MAX_SIDE_TENSORS = 32
#: What an end says of itself in the header (``RingProducer.set_running``, ``RingConsumer.set_running``): its
#: node is active and works frames, or it is attached but paused (the node is inactive: no frames come or go).
STAGE_STATES = {0: "not said", 1: "running", 2: "paused"}
assert _GLOBAL.size <= CONTRACT_OFFSET and CONTRACT_OFFSET + _CONTRACT.size <= DOMAIN_OFFSET
assert DOMAIN_OFFSET + _DOMAIN.size <= WAKE_NAME_OFFSET and CONSUMER_OFFSET == NEXT_READ_OFFSET + _NEXT_READ.size
assert WAKE_NAME_OFFSET + _WAKE_NAME.size <= PUBLISHED_OFFSET and PUBLISHED_OFFSET % 64 == 0
assert CONSUMER_STATE_OFFSET + _STATE.size <= STAGE_TIME_OFFSET
assert PRODUCER_STATE_OFFSET + _STATE.size <= PRODUCER_CYCLE_OFFSET and PRODUCER_CYCLE_OFFSET + _NS.size <= 320
assert STAGE_TIME_OFFSET + _STAGE_TIME.size <= CONSUMER_MAX_AGE_OFFSET
assert CONSUMER_MAX_AGE_OFFSET + _NS.size <= SIDE_HEAD_OFFSET
assert SIDE_HEAD_OFFSET + _SIDE_HEAD.size <= SIDE_TABLE_OFFSET and SIDE_TABLE_OFFSET % 64 == 0
assert SIDE_ENTRY_BYTES == 80 and SIDE_TABLE_OFFSET + MAX_SIDE_TENSORS * SIDE_ENTRY_BYTES <= GLOBAL_HEADER_BYTES

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
    """The ROS domain id a ring belongs to: ``domain_id`` when given, else ``ROS_DOMAIN_ID`` from the environment
    (unset or empty: 0, rcl's default), the rule rcl applies (``rcl_get_default_domain_id``). A node passes its
    context's own (``Context.get_domain_id()``), which is the same unless the node was started with another.
    Raises ValueError for a negative or non-integer id, naming where it came from."""
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
    """Segment name ``hybrid_vla.<uid>.d<domain>.<ns>.<ring_name>`` for a ring in a ROS domain and namespace.

    Scoped by user, ROS domain and namespace: two pipelines of one namespace in two ROS domains on one computer
    (two vehicles, a simulator beside a vehicle) get two rings and never read each other's frames.
    ``domain_id``: see :func:`ros_domain_id` (None: ``ROS_DOMAIN_ID``, else 0). The namespace (ROS characters
    ``[A-Za-z0-9_/]``, leading/trailing '/' optional) is written with '/' mapped to '-' (ROS names cannot contain
    '-', so the mapping is one-to-one): "/" -> "-", "/car1/front" -> "-car1-front". ``ring_name`` must match
    ``[A-Za-z0-9_-]+``. Raises ValueError for an unsafe ring name (e.g. containing '/') or namespace (other
    characters, empty components like "a//b"), a bad domain id, or a result longer than 100 characters.
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


class Occupants(NamedTuple):
    """Who uses a ring segment, read from its global header and its locks (:func:`segment_occupants`).

    ``owner_pid`` / ``owner_alive``: the producer that created it and whether that process lives (pid and start
    time). ``consumer_pid``: the pid the consumer wrote at attach (0: none said); ``consumer_attached``: a
    consumer holds the consumer lock now."""

    owner_pid: int
    owner_alive: bool
    consumer_pid: int
    consumer_attached: bool


def segment_occupants(name: str) -> Occupants | None:
    """Who uses segment ``name`` now, without attaching to it (nothing is changed); None when there is no such
    segment of this uid or it is not a ring of this layout. Raises ValueError for an invalid name."""
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
        magic, version, _hb, pid, start, _inst = _GLOBAL_OWNER.unpack_from(head)
        if magic != GLOBAL_MAGIC or version != LAYOUT_VERSION:
            return None
        consumer_pid, _consumer_start = _CONSUMER.unpack_from(head, CONSUMER_OFFSET)
        return Occupants(pid, _process_alive(pid, start), consumer_pid, byte_locked(fd, CONSUMER_LOCK_BYTE))
    finally:
        os.close(fd)


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


def byte_locked(fd: int, byte: int) -> bool:
    """True when another open file description holds a lock on one byte of ``fd`` (``F_OFD_GETLK``: a lock of
    this very description does not count). The kernel drops a lock when its holder closes it or dies, so this
    tells at once whether a consumer (:mod:`.consumer`, byte 1) is attached, whatever became of its process."""
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
