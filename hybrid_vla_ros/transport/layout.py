"""The ring's byte layout, declared once: the global header and the slot header as tables of fields.

Fields read or written together form a :class:`FieldGroup` (one little-endian struct, no implicit padding); all
code reads and writes the headers only through these groups. The byte tables in :mod:`.segment` and :mod:`.slots`
are :meth:`HeaderLayout.table` of them (``python -m hybrid_vla_ros.transport.layout`` prints both).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["Field", "FieldGroup", "HeaderLayout", "GLOBAL", "SLOT", "GLOBAL_HEADER_BYTES", "SLOT_HEADER_BYTES",
           "SIDE_ENTRY_BYTES", "MAX_SIDE_TENSORS", "MAX_DECODE_ROWS"]

GLOBAL_HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 256
#: Most side tensors one ring carries (entries of the global header's side-tensor table).
MAX_SIDE_TENSORS = 32
#: Most rows one decode step carries (and tokens one reply): a token, or a few drafted ones.
MAX_DECODE_ROWS = 4


@dataclass(frozen=True)
class Field:
    """One header field: ``code`` a struct code of one value (``Q``, ``64s``, ``4q``: an array of 4, ``4x``:
    padding), ``doc`` its meaning."""

    name: str
    code: str
    doc: str


class FieldGroup:
    """Consecutive fields at ``offset``, read and written as one struct: ``read(buf)`` -> tuple of values
    (arrays flattened, padding skipped), ``write(buf, *values)``, ``one(buf)`` for a single-value group; ``size``
    bytes; ``offset_of(name)``."""

    def __init__(self, offset: int, *fields: Field):
        self.offset, self.fields = offset, fields
        self.struct = struct.Struct("<" + "".join(f.code for f in fields))
        self.size = self.struct.size
        self._offsets, at = {}, offset
        for f in fields:
            self._offsets[f.name] = at
            at += struct.calcsize("<" + f.code)

    def read(self, buf, base: int = 0) -> tuple:
        return self.struct.unpack_from(buf, base + self.offset)

    def one(self, buf, base: int = 0):
        return self.struct.unpack_from(buf, base + self.offset)[0]

    def write(self, buf, *values, base: int = 0) -> None:
        self.struct.pack_into(buf, base + self.offset, *values)

    def offset_of(self, name: str) -> int:
        return self._offsets[name]


class HeaderLayout:
    """A header of ``size`` bytes: its groups by name (attributes). ValueError unless a field in several groups
    has one offset and code, distinct fields never overlap and none runs past the header. ``array``: a group
    repeated ``count`` times ``stride`` bytes apart (``entry(k)``), e.g. the side-tensor table."""

    def __init__(self, title: str, size: int, groups: dict[str, FieldGroup],
                 array: tuple[str, FieldGroup, int, int] | None = None):
        self.title, self.size, self.groups, self.array = title, size, groups, array
        seen: dict[str, tuple[int, str]] = {}
        for g in groups.values():
            for f in g.fields:
                at = (g.offset_of(f.name), f.code)
                if seen.setdefault(f.name, at) != at:
                    raise ValueError(f"{title}: field {f.name} at two offsets")
        spans = sorted((o, o + struct.calcsize("<" + c), n) for n, (o, c) in seen.items())
        if array:
            spans.append((array[1].offset, array[1].offset + (array[2] - 1) * array[3] + array[1].size, array[0]))
            spans.sort()
        for (_, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"{title}: {an} and {bn} overlap")
        if spans and max(end for _, end, _ in spans) > size:
            raise ValueError(f"{title}: a field runs past the header")
        self.__dict__.update(groups)

    def offset_of(self, name: str) -> int:
        """The offset of field ``name`` (KeyError if unknown)."""
        for g in self.groups.values():
            if name in g._offsets:
                return g.offset_of(name)
        raise KeyError(name)

    def entry(self, k: int) -> FieldGroup:
        """Entry ``k`` of the repeated group."""
        name, first, count, stride = self.array
        if not 0 <= k < count:
            raise IndexError(f"{name} entry {k} outside [0, {count})")
        return FieldGroup(first.offset + k * stride, *first.fields)

    def table(self) -> str:
        """The byte table: offset, name, struct code and meaning of every field, in offset order."""
        rows = {}
        for g in list(self.groups.values()) + ([self.array[1]] if self.array else []):
            for f in g.fields:
                if not f.name.startswith("_"):
                    rows[g.offset_of(f.name)] = f"{g.offset_of(f.name):>5}  {f.name:<22} {f.code:<4} {f.doc}"
        lines = [rows[k] for k in sorted(rows)]
        if self.array:
            name, _, count, stride = self.array
            lines.append(f"       ({name}: {count} entries, {stride} bytes apart)")
        return "\n".join([f"{self.title} ({self.size} bytes, little-endian):"] + lines)


SIDE_TABLE_OFFSET = 448
_SIDE_ENTRY_FIELDS = (
    Field("side_name", "32s", "a side tensor's name, ASCII, NUL-padded"),
    Field("side_dtype", "I", "its dtype code (contract.DTYPE_CODES)"),
    Field("side_ndim", "I", "its number of dims"),
    Field("side_dims", "4q", "its dims, 0 past ndim"),
    Field("side_offset", "Q", "its offset from the start of a slot's payload, 64-byte aligned"))
SIDE_ENTRY_BYTES = struct.calcsize("<" + "".join(f.code for f in _SIDE_ENTRY_FIELDS))

#: The global header, written by the producer at creation (identity, geometry, contract), then by the producer
#: (publish count, state, cycle) and the consumer (its cache line) while the ring runs.
GLOBAL = HeaderLayout("global header", GLOBAL_HEADER_BYTES, dict(
    identity=FieldGroup(
        0, Field("magic", "Q", "GLOBAL_MAGIC"), Field("layout_version", "I", "LAYOUT_VERSION"),
        Field("header_bytes", "I", "offset of slot 0"), Field("owner_pid", "q", "the producer's pid"),
        Field("owner_start_time", "Q", "its start time, clock ticks after boot (/proc/<pid>/stat field 22)"),
        Field("instance_id", "Q", "random, per segment")),
    geometry=FieldGroup(
        40, Field("n_slots", "I", ""), Field("slot_header_bytes", "I", ""),
        Field("slot_payload_bytes", "Q", "payload capacity per slot"), Field("slot_stride", "Q", ""),
        Field("total_bytes", "Q", "the whole segment"), Field("model_id", "q", "the checkpoint's id"),
        Field("created_ns", "q", "creation, CLOCK_MONOTONIC ns")),
    contract=FieldGroup(
        96, Field("dtype", "I", "the hidden states' dtype code (0: undeclared)"),
        Field("device_kind", "I", "contract.DEVICE_KINDS"), Field("ndim", "i", "state ndim, -1: undeclared"),
        Field("_pad0", "4x", ""), Field("state_shape", "4q", "state shape, 0 past ndim")),
    domain=FieldGroup(144, Field("ros_domain", "i", "ROS domain id, -1: undeclared (layout 3)")),
    wake_name=FieldGroup(160, Field("wake_dir", "64s", "the wake-up directory's name, ASCII, NUL-padded")),
    published=FieldGroup(
        256, Field("publish_count", "Q", "frames published (a hint: wake.FrameWaiter spins on it)"),
        Field("last_publish_ns", "q", "the last publish, CLOCK_MONOTONIC ns")),
    producer_state=FieldGroup(272, Field("producer_state", "I", "STAGE_STATES: 0 not said, 1 running, 2 paused")),
    producer_cycle=FieldGroup(
        280, Field("producer_cycle_ns", "q", "the interval the producer expects between publishes, ns (0: none; "
                                             "layout 6)")),
    schedule=FieldGroup(
        320, Field("last_take_ns", "q", "the consumer's last take, CLOCK_MONOTONIC ns (written by the consumer "
                                        "from here to 383, its own cache line)"),
        Field("next_read_ns", "q", "when it expects to take the next frame (0: none)")),
    last_take=FieldGroup(320, Field("last_take_ns", "q", "the consumer's last take, CLOCK_MONOTONIC ns (written by "
                                                         "the consumer from here to 383, its own cache line)")),
    consumer=FieldGroup(336, Field("consumer_pid", "q", "its pid (0: none)"),
                        Field("consumer_start_time", "Q", "its start time, clock ticks")),
    consumer_state=FieldGroup(352, Field("consumer_state", "I", "STAGE_STATES")),
    stage_time=FieldGroup(360, Field("stage_ns", "q", "its stage time, ns (0: none; layout 5)"),
                          Field("stage_k", "i", "the K it was measured at")),
    max_age=FieldGroup(376, Field("frame_age_limit_ns", "q", "the oldest a frame may be for it to publish the "
                                                             "result, ns after its stamp (0: none; layout 6)")),
    side_head=FieldGroup(384, Field("side_count", "I", "side tensors in the table (layout 4)"),
                         Field("_pad1", "4x", ""),
                         Field("state_bytes", "Q", "payload offset of the side region: the hidden states' "
                                                   "capacity")),
    decode=FieldGroup(
        3008, Field("decode_rows", "I", "the most rows one decode step carries, 0: no decode (layout 7)"),
        Field("decode_positions", "I", "rows of rotary positions each step carries (0 or 3)"),
        Field("decode_offset", "Q", "the decode region's offset in the segment, after the slots"),
        Field("decode_row_bytes", "Q", "bytes of one hidden-state row (H x the state dtype)")),
    step_seq=FieldGroup(
        3072, Field("step_seq", "Q", "twice the decode steps published, odd while the producer writes one (a "
                                     "sequence lock: the producer alone writes from here to 3135)")),
    step=FieldGroup(
        3080, Field("step_frame", "Q", "the seq of the frame's prefill slot"),
        Field("step_index", "I", "1, 2, ...: the step within the frame"),
        Field("step_rows", "I", "rows in the decode region"),
        Field("step_publish_ns", "q", "CLOCK_MONOTONIC ns"),
        Field("step_compute_ns", "q", "the prefix's compute of this step (embedding + blocks [0, K)), ns")),
    reply_seq=FieldGroup(
        3136, Field("reply_seq", "Q", "twice the replies published, odd while the consumer writes one (a sequence "
                                      "lock: the consumer alone writes from here to 3263)")),
    reply=FieldGroup(
        3144, Field("reply_frame", "Q", "the frame it answers"),
        Field("reply_index", "I", "the step it answers (0: its prefill)"),
        Field("reply_count", "I", "tokens in reply_tokens"),
        Field("reply_end", "I", "0 go on, 1 stop token, 2 max_new_tokens, 3 abandoned, 4 place, 5 turn"),
        Field("_pad2", "4x", ""),
        Field("reply_publish_ns", "q", "CLOCK_MONOTONIC ns"),
        Field("reply_tokens", f"{MAX_DECODE_ROWS}q", "the chosen token ids")),
    ended_seq=FieldGroup(
        3264, Field("ended_seq", "Q", "twice the ending replies published, odd while the consumer writes one (a "
                                      "sequence lock: the consumer alone writes from here to 3391; layout 9)")),
    ended=FieldGroup(
        3272, Field("ended_frame", "Q", "the last frame whose decode ended: a copy of its ending reply, kept while "
                                        "the next frame's replies replace the latest"),
        Field("ended_index", "I", "the step it answers"),
        Field("ended_count", "I", "tokens in ended_tokens"),
        Field("ended_end", "I", "1 stop token, 2 max_new_tokens, 3 abandoned"),
        Field("_pad3", "4x", ""),
        Field("ended_publish_ns", "q", "CLOCK_MONOTONIC ns"),
        Field("ended_tokens", f"{MAX_DECODE_ROWS}q", "the chosen token ids")),
), array=("side-tensor table", FieldGroup(SIDE_TABLE_OFFSET, *_SIDE_ENTRY_FIELDS), MAX_SIDE_TENSORS,
          SIDE_ENTRY_BYTES))

#: The slot header (slot version 3), before each slot's payload; the timings are the frame's SlotTimings.
SLOT = HeaderLayout("slot header", SLOT_HEADER_BYTES, dict(
    prefix=FieldGroup(0, Field("magic", "I", "SLOT_MAGIC"), Field("version", "H", "SLOT_VERSION"),
                      Field("state", "H", "FREE 0 / WRITING 1 / READY 2 / READING 3"),
                      Field("seq", "Q", "sequence number")),
    body=FieldGroup(
        16, Field("stamp_ns", "q", "the camera stamp"), Field("t_write_start_ns", "q", "CLOCK_MONOTONIC"),
        Field("t_publish_ns", "q", "CLOCK_MONOTONIC"), Field("payload_nbytes", "Q", "the hidden states' bytes"),
        Field("model_id", "q", ""), Field("split_layer", "i", "K"), Field("dtype", "I", "dtype code"),
        Field("ndim", "I", ""), Field("_pad", "4x", ""), Field("shape", "4q", "0 past ndim"),
        Field("preprocess_ms", "d", "NaN: not sent"), Field("prefix_ms", "d", "NaN: not sent"),
        Field("prefix_start_ns", "q", "CLOCK_MONOTONIC, 0: not sent"), Field("ego_wait_ms", "d", "NaN: not sent")),
    identity=FieldGroup(0, Field("magic", "I", "SLOT_MAGIC"), Field("version", "H", "SLOT_VERSION")),
    state=FieldGroup(6, Field("state", "H", "FREE 0 / WRITING 1 / READY 2 / READING 3")),
    seq=FieldGroup(8, Field("seq", "Q", "sequence number")),
))

if __name__ == "__main__":
    print(GLOBAL.table())
    print(SLOT.table())
