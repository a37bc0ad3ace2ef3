"""What the pipeline nodes report, as typed classes: the 1 Hz '<node>: pipeline' status on /diagnostics
(:class:`PrefixStatus`, :class:`SuffixStatus`) and the suffix's per-frame ``~/debug/frame_timing``
(:class:`FrameTiming`).

One class per message, used on both sides: nodes write it with :meth:`key_values` (diagnostic_msgs/KeyValue
strings), ``hybrid-vla replay`` and the tests read it with :meth:`from_key_values`. No key is spelled outside this
module, so a renamed field fails where the status is built, not as a silent 0 in a tool.

Encoding (round-trip tested in test/test_status.py): floats with 3 decimals (memory in MiB = 2**20 bytes with 1);
None as ""; ``cpu_affinity`` a JSON list; ring fill ``READY/SLOTS``; counters by name one key per entry
(``drop_<cause>``); stage times ``<stage>_p50_ms`` / ``_p90_ms`` / ``_n``. Imports nothing from ROS.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping

__all__ = ["StageTime", "RingFill", "NodeStatus", "PrefixStatus", "SuffixStatus", "FrameTiming", "StatusError",
           "PIPELINE", "pipeline_status_name"]

#: The task name of a node's pipeline status, '<fully qualified node name>: pipeline'.
PIPELINE = "pipeline"


def pipeline_status_name(node_fqn: str) -> str:
    """The DiagnosticStatus name of the pipeline status of node ``node_fqn`` ('/ns/prefix_node')."""
    return f"{node_fqn}: {PIPELINE}"


class StatusError(ValueError):
    """A /diagnostics value that does not decode as its field's type (the message names the key and value)."""


@dataclass(frozen=True)
class StageTime:
    """Recent times of one stage (util.stats.StageTimes): median and 90th percentile in ms, sample count."""

    p50_ms: float
    p90_ms: float
    n: int


@dataclass(frozen=True)
class RingFill:
    """Slots of a ring holding an unread frame (READY) and all its slots; (0, 0) without a ring."""

    ready: int = 0
    slots: int = 0


# ------------------------------------------------------------------------------------------ codecs
@dataclass(frozen=True)
class _Codec:
    """A field's KeyValue string ``encode`` and ``decode`` (ValueError / TypeError for unreadable text)."""

    encode: Callable[[Any], str]
    decode: Callable[[str], Any]

    def optional(self) -> "_Codec":
        """The same codec for a value that may be None, written as ""."""
        return _Codec(lambda v: "" if v is None else self.encode(v), lambda t: None if t == "" else self.decode(t))


def _float(decimals: int) -> _Codec:
    return _Codec(lambda v: f"{float(v):.{decimals}f}", float)


def _read_bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(f"not True / False: {text!r}")
    return text == "True"


def _read_cores(text: str) -> tuple[int, ...]:
    value = json.loads(text) if text else []
    if not isinstance(value, list) or not all(isinstance(c, int) for c in value):
        raise ValueError(f"not a list of core indices: {text!r}")
    return tuple(value)


def _read_fill(text: str) -> RingFill:
    ready, slots = text.split("/")
    return RingFill(int(ready), int(slots))


_INT = _Codec(lambda v: str(int(v)), int)
_MS, _MIB = _float(3), _float(1)
_BOOL = _Codec(lambda v: str(bool(v)), _read_bool)
_STR = _Codec(str, str)
_CORES = _Codec(lambda v: json.dumps(list(v)), _read_cores)  # a JSON list of core indices
_COMMA_INTS = _Codec(lambda v: ",".join(str(int(c)) for c in v),  # "0,3"
                     lambda t: tuple(int(c) for c in t.split(",")) if t else ())
_FILL = _Codec(lambda v: f"{v.ready}/{v.slots}", _read_fill)  # "READY/SLOTS"
_OPT_INT, _OPT_MIB, _OPT_BOOL = _INT.optional(), _MIB.optional(), _BOOL.optional()
_OPT_MS1 = _float(1).optional()  # arrival delays: 1 decimal of a ms
_COMMA_OPT_MS1 = _Codec(lambda v: ",".join(_OPT_MS1.encode(d) for d in v),  # "12.5,,1503.0": one per camera
                        lambda t: tuple(_OPT_MS1.decode(d) for d in t.split(",")) if t else ())
_OPT_S = _float(3).optional()


def _field(codec: _Codec, default: Any = None, *, counter: bool = False, doc: str = ""):
    """A status field: its codec, whether it counts events over the node process's life (``counter``)."""
    return field(default=default, metadata={"codec": codec, "counter": counter, "doc": doc})


def _counts(prefix: str, *, counter: bool = True, doc: str = ""):
    """A dict field written as one key per entry, ``<prefix><name>``, integer values."""
    return field(default_factory=dict, metadata={"prefix": prefix, "counter": counter, "doc": doc})


_STAGE_KEY = re.compile(r"^(?P<stage>.+)_(?P<what>p50_ms|p90_ms|n)$")


# ------------------------------------------------------------------------------------------ statuses
@dataclass(frozen=True)
class NodeStatus:
    """The values both nodes report in their pipeline status (levels and messages: :mod:`.diagnostics`)."""

    state: str = _field(_STR, "", doc="lifecycle state: unconfigured, inactive, active, finalized")
    lifecycle_requests_refused: int = _field(_INT, 0, counter=True,
                                             doc="ChangeState requests that left the state as it was")
    configure_error: str = _field(_STR, "", doc="the last configure's error, '' after a successful one")
    peer_cause: str = _field(_STR, "", doc="runtime.peer cause of the other stage's state, '' while not active")
    peer: str = _field(_STR, "", doc="the other stage as this node sees it (its pid, state)")
    peer_message: str = _field(_STR, "", doc="what the peer state means, in words")
    use_sim_time: bool = _field(_BOOL, False, doc="the node clock follows /clock")
    clock_missing: bool = _field(_BOOL, False, doc="use_sim_time and no /clock yet (the node clock reads 0)")
    ring_ready_slots: RingFill = _field(_FILL, RingFill(), doc="unread ring slots / all slots")
    rss_mib: float | None = _field(_OPT_MIB, None, doc="resident set of the process, MiB")
    cuda_allocated_mib: float | None = _field(_OPT_MIB, None, doc="CUDA caching allocator: allocated, MiB")
    cuda_reserved_mib: float | None = _field(_OPT_MIB, None, doc="CUDA caching allocator: reserved, MiB")
    cuda_driver_used_mib: float | None = _field(_OPT_MIB, None, doc="device memory in use, every process, MiB")
    cuda_driver_free_mib: float | None = _field(_OPT_MIB, None, doc="device memory free, MiB")
    last_error: str = _field(_STR, "", doc="the message of the last drop or failure")
    cpu_affinity: tuple[int, ...] = _field(_CORES, (), doc="cores the process may run on")
    stages: Mapping[str, StageTime] = field(default_factory=dict, metadata={"stages": True})
    drops: Mapping[str, int] = _counts("drop_", doc="dropped frames or messages by cause")

    # ----------------------------------------------------------------------------- encoding
    def key_values(self) -> list[tuple[str, str]]:
        """The status as (key, value) strings, in field order."""
        out: list[tuple[str, str]] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("stages"):
                for stage, s in value.items():
                    out += [(f"{stage}_p50_ms", _MS.encode(s.p50_ms)), (f"{stage}_p90_ms", _MS.encode(s.p90_ms)),
                            (f"{stage}_n", str(int(s.n)))]
            elif "prefix" in f.metadata:
                out += [(f"{f.metadata['prefix']}{name}", str(int(n))) for name, n in sorted(value.items())]
            else:
                out.append((f.name, f.metadata["codec"].encode(value)))
        return out

    @classmethod
    def from_key_values(cls, values: Mapping[str, str] | Iterable[tuple[str, str]]):
        """The status from :meth:`key_values` pairs or a dict; unknown keys ignored, missing ones default.
        Raises StatusError naming a key whose value does not decode."""
        pairs = dict(values.items() if isinstance(values, Mapping) else values)
        kwargs: dict[str, Any] = {}
        left = dict(pairs)
        fields = dataclasses.fields(cls)
        for f in fields:
            if f.metadata.get("stages") or "prefix" in f.metadata or f.name not in pairs:
                continue
            text = left.pop(f.name)
            try:
                kwargs[f.name] = f.metadata["codec"].decode(text)
            except (ValueError, TypeError) as e:
                raise StatusError(f"{cls.__name__}: key {f.name!r}: cannot read {text!r} ({e})") from None
        for f in fields:
            prefix = f.metadata.get("prefix")
            if prefix is None:
                continue
            counts = {}
            for key in [k for k in left if k.startswith(prefix)]:
                text = left.pop(key)
                try:
                    counts[key[len(prefix):]] = int(text)
                except ValueError:
                    raise StatusError(f"{cls.__name__}: key {key!r}: not an integer: {text!r}") from None
            kwargs[f.name] = counts
        kwargs["stages"] = _read_stages(cls.__name__, left)
        return cls(**kwargs)

    @classmethod
    def unknown_keys(cls, values: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[str]:
        """The keys of ``values`` that no field reads ([] for this release's nodes)."""
        pairs = dict(values.items() if isinstance(values, Mapping) else values)
        known = {k for k, _ in cls.from_key_values(pairs).key_values()}
        return sorted(set(pairs) - known)

    def counters(self) -> dict[str, int]:
        """The process-lifetime counters by key (e.g. ``drop_<cause>``), for a report's JSON."""
        out = {}
        for f in dataclasses.fields(self):
            if not f.metadata.get("counter"):
                continue
            value = getattr(self, f.name)
            if "prefix" in f.metadata:
                out.update({f"{f.metadata['prefix']}{k}": int(v) for k, v in value.items()})
            else:
                out[f.name] = int(value)
        return out

    def since(self, before: "NodeStatus | None"):
        """This status with counters since ``before`` (an earlier report; None: process start), 0 where a
        restart reset one. Raises TypeError for a status of another class."""
        if before is not None and type(before) is not type(self):
            raise TypeError(f"{type(self).__name__}.since({type(before).__name__})")
        changes = {}
        for f in dataclasses.fields(self):
            if not f.metadata.get("counter"):
                continue
            now, then = getattr(self, f.name), getattr(before, f.name) if before is not None else None
            if "prefix" in f.metadata:
                then = then or {}
                changes[f.name] = {k: v - then.get(k, 0) for k, v in now.items() if v - then.get(k, 0) > 0}
            else:
                changes[f.name] = max(0, now - (then or 0))
        return dataclasses.replace(self, **changes)


def _read_stages(owner: str, left: dict[str, str]) -> dict[str, StageTime]:
    parts: dict[str, dict[str, str]] = {}
    for key, text in left.items():
        m = _STAGE_KEY.match(key)
        if m:
            parts.setdefault(m["stage"], {})[m["what"]] = text
    stages = {}
    for stage, p in parts.items():
        if set(p) != {"p50_ms", "p90_ms", "n"}:
            continue  # not a stage time (another key that happens to end so)
        try:
            stages[stage] = StageTime(float(p["p50_ms"]), float(p["p90_ms"]), int(p["n"]))
        except ValueError:
            raise StatusError(f"{owner}: stage {stage!r}: cannot read {p}") from None
    return stages


@dataclass(frozen=True)
class PrefixStatus(NodeStatus):
    """prefix_node's '<node>: pipeline' values (see :class:`NodeStatus` for those of both nodes)."""

    frames_in: int = _field(_INT, 0, counter=True, doc="camera messages received")
    frames_synchronized: int = _field(_INT, 0, counter=True, doc="synchronized camera sets")
    frames_out: int = _field(_INT, 0, counter=True, doc="frames computed into the ring")
    ring_published: int = _field(_INT, 0, counter=True, doc="frames the ring took")
    ring_dropped_oldest: int = _field(_INT, 0, counter=True, doc="unread frames overwritten (suffix too slow)")
    split_layer: int | None = _field(_OPT_INT, None, doc="K of the loaded prefix; None while unconfigured")
    model_id: str = _field(_STR, "", doc="the loaded checkpoint's id (util.ids.model_id_text)")
    num_layers: int | None = _field(_OPT_INT, None, doc="L, decoder blocks of the loaded checkpoint")
    split_layer_auto: bool = _field(_BOOL, False, doc="K comes from a plan (split_layer: auto)")
    resplits: int = _field(_INT, 0, counter=True, doc="live moves of the split layer applied")
    decode_tokens: int = _field(_INT, 0, counter=True, doc="tokens decoded in the frames this prefix followed")
    split_moves_latency: int = _field(_INT, 0, counter=True, doc="K moves asked for by live rebalancing")
    split_moves_memory: int = _field(_INT, 0, counter=True, doc="K moves asked for by memory pressure")
    split_move_reason: str = _field(_STR, "", doc="the auto policy's last judgement (split.rebalance)")
    handoff_path: str = _field(_STR, "", doc="how hidden states reach the ring (runtime.prefix handoff_path)")
    fast_jpeg_decode: bool | None = _field(_OPT_BOOL, None, doc="JPEGs decoded scaled down; None unconfigured")
    ego_state_input: bool = _field(_BOOL, False, doc="the checkpoint reads speed, acceleration and yaw rate")
    ego_accel: Mapping[str, int] = _counts("ego_accel_", doc="frames out by acceleration source")
    ego_time_jumps: int = _field(_INT, 0, counter=True, doc="odometry stamps that went back (buffer reset)")
    camera_reliability: str = _field(_STR, "", doc="the cameras' QoS reliability in use, comma-separated")
    camera_delay_worst: int | None = _field(_OPT_INT, None, doc="the camera with the largest median arrival delay")
    camera_delay_p50_ms: float | None = _field(_OPT_MS1, None, doc="that camera's median arrival delay, ms")
    camera_delay_max_ms: float | None = _field(_OPT_MS1, None, doc="largest arrival delay of any camera, ms")
    camera_delays_p50_ms: tuple[float | None, ...] = _field(_COMMA_OPT_MS1, (),
                                                            doc="median arrival delay of each camera, ms")
    camera_delays_max_ms: tuple[float | None, ...] = _field(_COMMA_OPT_MS1, (),
                                                            doc="largest arrival delay of each camera, ms")
    frames_too_old_in_a_row: int = _field(_INT, 0, doc="synchronized frames in a row older than the frame age limit")
    frame_age_limit_s: float | None = _field(_OPT_S, None, doc="the suffix's announced frame age limit, s")
    cameras_silent: tuple[int, ...] = _field(_COMMA_INTS, (), doc="camera indices sending nothing")
    scene_inputs: bool = _field(_BOOL, False, doc="the query heads read camera geometry and ego frame")
    camera_infos_in: int = _field(_INT, 0, counter=True, doc="CameraInfo messages read (query heads)")
    static_transforms_in: int = _field(_INT, 0, counter=True, doc="/tf_static transforms read (query heads)")
    navigation_command: str = _field(_STR, "", doc="the command of the next frame (query heads)")


@dataclass(frozen=True)
class SuffixStatus(NodeStatus):
    """suffix_node's '<node>: pipeline' values (see :class:`NodeStatus` for those of both nodes)."""

    frames_in: int = _field(_INT, 0, counter=True, doc="frames taken from the ring, rejected ones included")
    trajectories_out: int = _field(_INT, 0, counter=True, doc="trajectories published")
    frames_too_old_in_a_row: int = _field(_INT, 0, doc="frames in a row dropped as too old (guard_too_old)")
    ring_attached: bool = _field(_BOOL, False, doc="attached to the prefix's ring")
    ring_contract_error: str = _field(_STR, "", doc="why the ring's contract does not fit, '' when it does")
    ring_conversion: str = _field(_STR, "", doc="dtype conversion of the hidden states read")
    ring_owner_alive: bool = _field(_BOOL, False, doc="the prefix process owning the ring is alive")
    ring_read: int = _field(_INT, 0, counter=True, doc="frames read from the ring")
    odometry_in: int = _field(_INT, 0, counter=True, doc="odometry messages read into the pose buffer")
    odometry_propagated: int = _field(_INT, 0, counter=True, doc="poses propagated, not interpolated")
    odometry_late: int = _field(_INT, 0, counter=True, doc="frames placed at once: odometry late")
    odometry_time_jumps: int = _field(_INT, 0, counter=True, doc="odometry stamps that went back")
    candidate_trajectories_out: int = _field(_INT, 0, counter=True, doc="CandidateTrajectories messages sent")
    candidates_out: int = _field(_INT, 0, counter=True, doc="candidate trajectories in them")
    split_layer: int | None = _field(_OPT_INT, None, doc="K of the last frame computed")
    blocks_held_from: int | None = _field(_OPT_INT, None, doc="the first block this side holds")
    resplits: int = _field(_INT, 0, counter=True, doc="block moves that followed the prefix's K")
    resplits_on_demand: int = _field(_INT, 0, counter=True, doc="of which loads for a frame not announced")
    navigation_command: str = _field(_STR, "", doc="the command of the next frame")
    decode_frames: int = _field(_INT, 0, counter=True, doc="frames decoded (a decoding model)")
    decode_tokens: int = _field(_INT, 0, counter=True, doc="tokens decoded over those frames")
    decode_max_tokens: int = _field(_INT, 0, counter=True, doc="decodes that ended at max_new_tokens, not a stop "
                                                               "token")
    decode_tokens_last: int = _field(_INT, 0, doc="tokens decoded for the last frame")
    suffix_backend: str = _field(_STR, "", doc="the suffix_backend parameter")
    suffix_backend_in_use: str = _field(_STR, "", doc="the backend computing frames now")
    suffix_linear_packing: str = _field(_STR, "", doc="bf16 linear layers packed for oneDNN once, or why not")
    suffix_inference_precision: str = _field(_STR, "", doc="the dtype the blocks compute in (fp32 for a bf16 / fp16 "
                                                           "dtype on a CPU without native units for it)")
    suffix_inference_precision_reason: str = _field(_STR, "", doc="why that dtype (inference_precision)")
    decode_step: str = _field(_STR, "", doc="the decode_step parameter")
    suffix_decode_step: str = _field(_STR, "", doc="a decoding model's token step in one line: eager, inductor at K, "
                                                   "building, or why not compiled")
    suffix_decode_step_k: int | None = _field(_OPT_INT, None, doc="the K whose compiled decode step serves frames "
                                                                  "at the last frame's K")
    suffix_decode_step_building: int | None = _field(_OPT_INT, None, doc="the K whose decode step is being compiled")
    suffix_decode_step_error: str = _field(_STR, "", doc="why the asked-for decode step is not in use and will not "
                                                         "be at the last frame's K")
    suffix_backend_k: int | None = _field(_OPT_INT, None, doc="the K the compiled backend covers")
    suffix_backend_building: int | None = _field(_OPT_INT, None, doc="the K being compiled in the background")
    suffix_backend_precision: str = _field(_STR, "", doc="the compiled backend's precision")
    suffix_backend_error: str = _field(_STR, "", doc="why the asked-for backend is not in use")
    suffix_backend_cache_dir: str = _field(_STR, "", doc="where compiled suffixes are built and found")
    suffix_backend_frames_compiled: int = _field(_INT, 0, counter=True, doc="frames the compiled backend ran")
    suffix_backend_frames_eager: int = _field(_INT, 0, counter=True, doc="frames eager PyTorch ran")


# ------------------------------------------------------------------------------------------ frame timing
@dataclass(frozen=True)
class FrameTiming:
    """One frame on the suffix's ``~/debug/frame_timing`` (stamped with the camera stamp): stage ms (NaN when not
    timed) and system-wide CLOCK_MONOTONIC instants (ns), one timeline for both nodes on this host."""

    STAGES: ClassVar[tuple[str, ...]] = ("ego_wait", "preprocess", "prefix", "handoff", "suffix", "odometry_wait")

    ego_wait_ms: float = math.nan  # the prefix waiting for the ego state at the camera stamp (ego-state models)
    preprocess_ms: float = math.nan  # camera decode and resize into the model tensor
    prefix_ms: float = math.nan  # vision encoder, projector, blocks [0, K), into the slot
    handoff_ms: float = math.nan  # slot write start to READY seen by the suffix
    suffix_ms: float = math.nan  # blocks [K, L) and the read-out (a decoding model: the whole decode)
    odometry_wait_ms: float = math.nan  # waiting for the pose at the camera stamp
    t_prefix_start_ns: int = 0
    t_write_start_ns: int = 0
    t_ready_ns: int = 0
    t_suffix_end_ns: int = 0
    t_publish_ns: int = 0
    decode_tokens: int = 0  # tokens decoded for this frame (0: the model does not decode)
    prefix_token_ms: float = math.nan  # median per decode step: embedding + blocks [0, K) on the prefix
    suffix_token_ms: float = math.nan  # median per token: blocks [K, L), norm, LM head, choice on the suffix
    decode_round_trip_ms: float = math.nan  # median per step: the suffix's wait for it minus the prefix's compute

    def stage_ms(self) -> dict[str, float]:
        """Stage name (:attr:`STAGES`) -> milliseconds."""
        return {s: getattr(self, f"{s}_ms") for s in self.STAGES}

    def key_values(self) -> list[tuple[str, str]]:
        """(key, value) strings: ``<stage>_ms`` with 4 decimals, ``t_<event>_ns`` as integers."""
        return [(f.name, f"{getattr(self, f.name):.4f}" if f.name.endswith("_ms") else str(int(getattr(self, f.name))))
                for f in dataclasses.fields(self)]

    @classmethod
    def from_key_values(cls, values: Mapping[str, str] | Iterable[tuple[str, str]]) -> "FrameTiming":
        """The timing from :meth:`key_values`; unknown keys ignored, missing NaN / 0. Raises StatusError."""
        pairs = dict(values.items() if isinstance(values, Mapping) else values)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in pairs:
                try:
                    kwargs[f.name] = float(pairs[f.name]) if f.name.endswith("_ms") else int(pairs[f.name])
                except ValueError:
                    raise StatusError(f"FrameTiming: key {f.name!r}: cannot read {pairs[f.name]!r}") from None
        return cls(**kwargs)
