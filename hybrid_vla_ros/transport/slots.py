"""One slot of the ring: its header, its states and the protocol that makes a frame visible.

Slot i starts at ``GLOBAL_HEADER_BYTES + i * stride``: a 256-byte header (fields: :data:`.layout.SLOT`, table at
the end of this docstring; bytes 104-135: :class:`SlotTimings`), then the 64-byte aligned payload: the hidden
states (the header's payload nbytes), then the side tensors (:func:`side_layout`). A consumer takes only slots of
its own :data:`SLOT_VERSION` (else ``bad_version``).

Publish protocol: acquire stores ``state = WRITING`` *first* (a READY frame being overwritten stops being READY
before anything of it changes), then magic, version and seq; the payload is written while WRITING; publish stores
every other header field, then, in a separate last store, ``state = READY``. So a READY (or READING) slot's header
and payload are all of one frame, written completely, even if the producer is SIGKILLed at any instruction:

* Each store is a ``struct.Struct.pack_into`` call on the shared mapping, which writes its fields before it
  returns; the C compiler cannot move its stores past a later call writing through the same escaped pointer.
* The consumer reads a slot's state, and only if READY its other fields, under the segment mutex (an OFD lock),
  whose fcntl(2) lock and unlock order memory (acquire / release); the publish count it spins on is a hint only.
* On x86-64 (TSO, Intel SDM vol. 3 section 8.2.2: stores visible in program order, loads not reordered with older
  loads; :data:`STORES_VISIBLE_IN_ORDER`) every store is a release store, so the producer publishes without the
  mutex (a WRITING slot is its alone). Elsewhere (e.g. aarch64) it publishes under the mutex.
* A kill lands at an instruction boundary: the stores done are a program-order prefix, visible in order (TSO) or
  all once the kernel drops the dead process's mutex. Without the READY store the slot stays WRITING, which no
  consumer delivers. The state is one aligned 2-byte store of a value < 256: no byte-wise write shows a third.
"""
from __future__ import annotations

import math
import numbers
import platform
from dataclasses import dataclass

import torch

from .contract import CODE_DTYPES, DTYPE_CODES, TensorSpec, conversion_kind, itemsize
from .errors import RingContractError, RingError
from .layout import GLOBAL, GLOBAL_HEADER_BYTES, SLOT
from .segment import PAYLOAD_ALIGN, align

__all__ = ["FrameMeta", "SlotTimings", "NO_TIMINGS", "FREE", "WRITING", "READY", "READING", "STATE_NAMES",
           "SLOT_MAGIC", "SLOT_VERSION", "MAX_NDIM", "side_region_bytes", "side_layout"]

#: True on CPUs whose stores become visible in program order (x86-64, TSO): publish needs no mutex there.
STORES_VISIBLE_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64")
SLOT_MAGIC = int.from_bytes(b"SLOT", "little")
SLOT_VERSION = 3
MAX_NDIM = 4
FREE, WRITING, READY, READING = 0, 1, 2, 3
STATE_NAMES = {FREE: "FREE", WRITING: "WRITING", READY: "READY", READING: "READING"}

__doc__ += "\n" + SLOT.table().replace("\n", "\n    ")  # the byte table, in help() and the docs
_INT64 = (-(1 << 63), 1 << 63)


@dataclass(frozen=True, eq=False)
class SlotTimings:
    """Stage timings of one frame, written into its slot header (``FrameMeta.timings``); not sent: NaN ms, 0 ns.

    ``preprocess_ms``: the producer's input preparation (the prefix: decode, resize, normalise every camera);
    ``prefix_ms``: its stage (the prefix: vision .. block K-1); ``ego_wait_ms``: its wait, before starting, for the
    ego state at the frame's stamp; ``prefix_start_ns``: its start, exact int64 CLOCK_MONOTONIC ns (comparable
    across processes). NaN == NaN in equality and hashing, so a slot round trip compares equal. Raises TypeError
    for a non-number (a non-int ``prefix_start_ns``), ValueError for an instant outside int64.
    """

    preprocess_ms: float = math.nan
    prefix_ms: float = math.nan
    prefix_start_ns: int = 0
    ego_wait_ms: float = math.nan

    def __post_init__(self):
        for name in ("preprocess_ms", "prefix_ms", "ego_wait_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"SlotTimings.{name} must be a number of ms (NaN: not sent), got {value!r}")
            object.__setattr__(self, name, float(value))
        start = self.prefix_start_ns
        if isinstance(start, bool) or not isinstance(start, numbers.Integral):
            raise TypeError(f"SlotTimings.prefix_start_ns must be an int of CLOCK_MONOTONIC ns (0: not sent), "
                            f"got {start!r}")
        if not _INT64[0] <= start < _INT64[1]:
            raise ValueError(f"SlotTimings.prefix_start_ns must fit in int64, got {start}")
        object.__setattr__(self, "prefix_start_ns", int(start))

    def _key(self) -> tuple:
        """The fields, each NaN as None (so that NaN == NaN)."""
        return tuple(None if isinstance(v, float) and math.isnan(v) else v
                     for v in (self.preprocess_ms, self.prefix_ms, self.prefix_start_ns, self.ego_wait_ms))

    def __eq__(self, other) -> bool:
        if not isinstance(other, SlotTimings):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


#: The timings of a producer that sent none: NaN ms, instant 0 (``publish``'s default).
NO_TIMINGS = SlotTimings()
_TIMING_FIELDS = ("preprocess_ms", "prefix_ms", "prefix_start_ns", "ego_wait_ms")


def _slot_timings(*values) -> SlotTimings:
    """SlotTimings of values read from a slot header, without __init__'s checks (as :func:`_frame_meta`)."""
    timings = object.__new__(SlotTimings)
    timings.__dict__.update(zip(_TIMING_FIELDS, values))
    return timings


@dataclass(frozen=True)
class FrameMeta:
    """Header of one published frame: ``seq`` (1, 2, ... in publish order: a drop is a gap), ``stamp_ns`` (the
    producer's frame stamp, e.g. the camera's, ns), ``shape`` (<= 4 dims) / ``dtype`` (the producer's),
    ``split_layer`` (K) / ``model_id`` as declared, ``t_write_start_ns`` / ``t_publish_ns`` (CLOCK_MONOTONIC ns at
    acquire / publish), ``timings`` (:class:`SlotTimings`)."""

    seq: int
    stamp_ns: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    split_layer: int
    model_id: int
    t_write_start_ns: int
    t_publish_ns: int
    timings: SlotTimings

    @property
    def nbytes(self) -> int:
        """Payload size in bytes (numel times element size)."""
        return math.prod(self.shape) * itemsize(self.dtype)


_META_FIELDS = ("seq", "stamp_ns", "shape", "dtype", "split_layer", "model_id", "t_write_start_ns", "t_publish_ns",
                "timings")


def _frame_meta(*values) -> FrameMeta:
    """FrameMeta(*values), built in one dict update: the frozen dataclass's __init__ sets each field through
    object.__setattr__, which took a third of a read() here."""
    meta = object.__new__(FrameMeta)
    meta.__dict__.update(zip(_META_FIELDS, values))
    return meta


def side_region_bytes(side: tuple[TensorSpec, ...]) -> int:
    """Bytes the side tensors ``side`` take in every slot's payload: each one's nbytes rounded up to 64 (a
    zero-element tensor takes 0), summed."""
    return sum(align(spec.nbytes, PAYLOAD_ALIGN) for spec in side)


def side_layout(side: tuple[TensorSpec, ...], slot_bytes: int) -> tuple[int, tuple[int, ...]]:
    """(state bytes, each side tensor's payload offset) in a payload of ``slot_bytes`` (a multiple of 64): the
    side tensors fill its end, each where the previous one ends, rounded up to 64. ValueError if they do not fit."""
    state_bytes = slot_bytes - side_region_bytes(side)
    if state_bytes < 0:
        raise ValueError(f"the side tensors need {side_region_bytes(side)} bytes, more than the slot's "
                         f"{slot_bytes}")
    offsets, off = [], state_bytes
    for spec in side:
        offsets.append(off)
        off += align(spec.nbytes, PAYLOAD_ALIGN)
    return state_bytes, tuple(offsets)


def slot_offset(index: int, stride: int) -> int:
    """Byte offset of slot ``index`` in the segment."""
    return GLOBAL_HEADER_BYTES + index * stride


def read_prefix(mm, off: int) -> tuple[int, int, int, int]:
    """(magic, version, state, seq) of the slot at ``off``."""
    return SLOT.prefix.read(mm, off)


def set_state(mm, off: int, state: int) -> None:
    """Store one slot state (call with the segment mutex held)."""
    SLOT.state.write(mm, state, base=off)


def begin_write(mm, off: int, seq: int) -> None:
    """Make the slot at ``off`` WRITING for frame ``seq``: state first, then magic, version and seq."""
    SLOT.state.write(mm, WRITING, base=off)
    SLOT.identity.write(mm, SLOT_MAGIC, SLOT_VERSION, base=off)
    SLOT.seq.write(mm, seq, base=off)


def finish_write(mm, off: int, *, stamp_ns: int, t_write_start_ns: int, t_publish_ns: int, nbytes: int,
                 model_id: int, split_layer: int, dtype_code: int, shape: tuple[int, ...],
                 timings: SlotTimings) -> None:
    """Publish the WRITING slot at ``off``: every header field, then READY as the last store (mutex held unless
    :data:`STORES_VISIBLE_IN_ORDER`)."""
    shape4 = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    SLOT.body.write(mm, stamp_ns, t_write_start_ns, t_publish_ns, nbytes, model_id, split_layer, dtype_code,
                    len(shape), *shape4, timings.preprocess_ms, timings.prefix_ms, timings.prefix_start_ns,
                    timings.ego_wait_ms, base=off)
    SLOT.state.write(mm, READY, base=off)


def announce(mm, published: int, t_publish_ns: int) -> None:
    """Store the publish count and instant in the global header *after* the mutex is released, so a spinning
    consumer that sees the count change finds the mutex free instead of sleeping on it. A hint only."""
    GLOBAL.published.write(mm, published, t_publish_ns)


def check_shape_dtype(shape, dtype) -> tuple[tuple[int, ...], int, int]:
    """Validate shape/dtype; returns (shape, dtype code, payload nbytes). ValueError / TypeError."""
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: {sorted(str(d) for d in DTYPE_CODES)}")
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"shape {shape} has more than {MAX_NDIM} dims")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape, DTYPE_CODES[dtype], math.prod(shape) * itemsize(dtype)


def check_frame_fields(stamp_ns, split_layer, timings) -> tuple[int, int, SlotTimings]:
    """Validate a publish's header fields; returns (stamp_ns, split_layer, timings). TypeError when ``timings``
    is not a SlotTimings (e.g. a tuple); ValueError for a split layer outside int32 or a stamp outside int64."""
    if not isinstance(timings, SlotTimings):
        raise TypeError(f"timings must be a SlotTimings (named fields, slot version {SLOT_VERSION}), got "
                        f"{type(timings).__name__} {timings!r}")
    split_layer, stamp_ns = int(split_layer), int(stamp_ns)
    if not -(1 << 31) <= split_layer < (1 << 31) or not _INT64[0] <= stamp_ns < _INT64[1]:
        raise ValueError("split_layer must fit in int32 and stamp_ns in int64")
    return stamp_ns, split_layer, timings


def version_refused(version: int) -> str:
    """The ``bad_version`` detail, naming both versions."""
    return (f"slot header version {version}, this consumer reads version {SLOT_VERSION} only (a producer of "
            f"another hybrid_vla_ros release?)")


def validate(raw: tuple, *, slot_bytes: int, declared_dtype, compute_dtype, expected_model_id,
             expected_split_layer) -> tuple[str | None, FrameMeta | None, str]:
    """Judge a READY slot's unpacked header (:func:`read_header`), never the payload: (None, meta, "") to take
    it, else (cause from errors.REJECT_CAUSES, meta or None, detail: "" or :func:`version_refused`)."""
    (magic, version, _state, seq, stamp, t_ws, t_pub, nbytes, model_id, split, code, ndim) = raw[:12]
    if magic != SLOT_MAGIC:
        return "bad_magic", None, ""
    if version != SLOT_VERSION:
        return "bad_version", None, version_refused(version)
    dtype = CODE_DTYPES.get(code)
    if dtype is None or (declared_dtype is not None and dtype != declared_dtype):
        return "bad_dtype", None, ""
    if ndim > MAX_NDIM:
        return "bad_shape", None, ""
    shape = tuple(raw[12:12 + ndim])
    if (ndim and min(shape) < 0) or nbytes > slot_bytes or math.prod(shape) * itemsize(dtype) != nbytes:
        return "bad_shape", None, ""
    meta = _frame_meta(seq, stamp, shape, dtype, split, model_id, t_ws, t_pub, _slot_timings(*raw[16:20]))
    if expected_model_id is not None and model_id != expected_model_id:
        return "model_mismatch", meta, ""
    expected = expected_split_layer
    if expected is not None and (split != expected if isinstance(expected, int) else split not in expected):
        return "split_mismatch", meta, ""
    if compute_dtype is not None and declared_dtype is None:
        try:
            conversion_kind(dtype, compute_dtype)
        except RingContractError:
            return "dtype_mismatch", meta, ""
    return None, meta, ""


def read_header(mm, off: int) -> tuple:
    """Every field of the slot header at ``off``: :data:`.layout.SLOT` ``prefix`` then ``body``, in order."""
    return SLOT.prefix.read(mm, off) + SLOT.body.read(mm, off)


def state_names(mm, n_slots: int, stride: int) -> list[str]:
    """Every slot's state name (or UNKNOWN(<n>)), slot order: a diagnostic snapshot (caller holds the lock)."""
    states = [read_prefix(mm, slot_offset(i, stride))[2] for i in range(n_slots)]
    return [STATE_NAMES.get(s, f"UNKNOWN({s})") for s in states]


def take_ready(mm, n_slots: int, stride: int, *, newest: bool, **expect):
    """Take the consumer's next frame (mutex held): the READY slot of the lowest seq (``newest``: highest), judged
    by :func:`validate` (``expect``: its keywords). Accepted, it becomes READING (``newest``: every other READY slot
    FREE); rejected, FREE. Returns None when none is READY, else (index, cause or None, meta or None, READY slots
    freed unread, detail)."""
    ready = []
    for i in range(n_slots):
        _m, _v, state, seq = read_prefix(mm, slot_offset(i, stride))
        if state == READY:
            ready.append((seq, i))
    if not ready:
        return None
    _seq, best = max(ready) if newest else min(ready)
    cause, meta, detail = validate(read_header(mm, slot_offset(best, stride)), **expect)
    set_state(mm, slot_offset(best, stride), FREE if cause else READING)
    superseded = 0
    if not cause and newest:
        for _s, i in ready:
            if i != best:
                set_state(mm, slot_offset(i, stride), FREE)
                superseded += 1
    return best, cause, meta, superseded, detail


def pick_write_slot(mm, n_slots: int, stride: int, start: int) -> tuple[int, bool]:
    """The slot the producer writes next (mutex held): the first from ``start`` on, cyclically, neither READY nor
    READING, else the oldest READY one. Returns (index, whether a READY frame is dropped); RingError if every slot
    is READING."""
    oldest, oldest_seq = -1, 0
    for k in range(n_slots):
        i = (start + k) % n_slots
        _m, _v, state, seq = read_prefix(mm, slot_offset(i, stride))
        if state == READY:
            if oldest < 0 or seq < oldest_seq:
                oldest, oldest_seq = i, seq
        elif state != READING:
            return i, False
    if oldest < 0:
        raise RingError("no slot available: every slot is READING (header corruption?)")
    return oldest, True


def reclaim_reading(mm, n_slots: int, stride: int) -> int:
    """Reset every READING slot to FREE and return how many (mutex held; at attach they are a dead predecessor's:
    those frames are lost, not re-delivered out of order)."""
    reclaimed = 0
    for i in range(n_slots):
        off = slot_offset(i, stride)
        if read_prefix(mm, off)[2] == READING:
            set_state(mm, off, FREE)
            reclaimed += 1
    return reclaimed
