"""The nodes' validated parameters as frozen, typed dataclasses (ROS-free).

One field per parameter of ``schema/<node>.schema.json``, the source of truth (test/test_settings.py checks these
classes against it). A dotted name is a field of a nested dataclass (``ring.delivery``; the ``guard`` group is
:class:`~hybrid_vla_ros.vehicle.guard.GuardLimits`); lists are tuples. Units follow the name suffix: ``_ms``,
``_s``, ``_m``, ``_gb`` GB (1e9 bytes), ``_mb`` MiB (2**20 bytes).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..runtime.settings import (Backend, DecodeStep, Delivery, Dtype, PrecisionMode, PrefixRunnerSettings,
                                SplitPolicySettings, SuffixRunnerSettings)
from ..vehicle.guard import GuardLimits

#: ``split_layer`` as a parameter: a K in [0, L], ``"auto"``, or -1 (the schema's placeholder for "unset", which
#: validation rejects).
SplitLayer = typing.Union[int, Literal["auto"]]
CameraTransport = Literal["raw", "compressed"]
CameraReliability = Literal["auto", "best_effort", "reliable"]
NavigationCommand = Literal["LEFT", "RIGHT", "STRAIGHT", "LANE_FOLLOW", "CHANGE_LANE_LEFT", "CHANGE_LANE_RIGHT"]


@functools.cache
def _layout(cls: type) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(parameter name, attribute path) of every parameter of ``cls``, in field order; dataclass fields are groups."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += [(f"{f.name}.{g.name}", (f.name, g.name)) for g in dataclasses.fields(kind)]
        else:
            out.append((f.name, (f.name,)))
    return tuple(out)


class NodeSettings(Mapping):
    """Base of the frozen settings dataclasses, also a read-only ``Mapping`` by parameter name
    (``settings["guard.max_age_s"]``); :attr:`NODE` names the node and its schema."""

    NODE: ClassVar[str] = ""

    @classmethod
    def parameter_names(cls) -> tuple[str, ...]:
        """Every parameter name, dotted for a group's fields, in field order."""
        return tuple(name for name, _ in _layout(cls))

    @classmethod
    def from_parameters(cls, values: Mapping[str, Any]):
        """The settings from already validated name -> value (missing: the default). Raises ValueError for a
        name that is not a parameter of this node."""
        layout = dict(_layout(cls))
        unknown = sorted(set(values) - set(layout))
        if unknown:
            raise ValueError(f"not parameters of {cls.NODE}: {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        top: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        for name, path in layout.items():
            if name not in values:
                continue
            value = tuple(values[name]) if isinstance(values[name], list) else values[name]
            if len(path) == 1:
                top[path[0]] = value
            else:
                groups.setdefault(path[0], {})[path[1]] = value
        for group, kwargs in groups.items():
            top[group] = hints[group](**kwargs)
        return cls(**top)

    def parameters(self) -> dict[str, Any]:
        """Parameter name -> value, lists as lists."""
        return {name: list(v) if isinstance(v, tuple) else v for name, v in self.items()}

    def __getitem__(self, name: str) -> Any:
        path = dict(_layout(type(self))).get(name)
        if path is None:
            raise KeyError(name)
        value = self
        for part in path:
            value = getattr(value, part)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.parameter_names())

    def __len__(self) -> int:
        return len(_layout(type(self)))


@dataclass(frozen=True)
class PrefixNodeSettings(NodeSettings):
    """prefix_node's validated parameters (``schema/prefix_node.schema.json`` describes each)."""

    NODE: ClassVar[str] = "prefix_node"

    #: Checkpoint directory (``config.json`` + ``model.safetensors``).
    model_path: str = ""
    #: Split layer K in [0, L]: the prefix runs decoder blocks [0, K). ``"auto"``: plan K at configure (the K
    #: with the lowest predicted latency that fits ``gpu_budget_gb``). -1: unset (validation rejects it).
    split_layer: SplitLayer = -1
    #: ``hybrid-vla profile`` file that ``split_layer: auto`` predicts from; "": none.
    profile_path: str = ""
    #: GPU memory budget, GB (1e9 bytes). 0: the device's free memory at configure on CUDA, no limit on the CPU.
    gpu_budget_gb: float = 0.0
    #: ``split_layer: auto`` on CUDA: move K down live when free device memory falls under this, MiB (2**20
    #: bytes, despite the name's "mb"). 0: off.
    auto_resplit_free_mb: float = 0.0
    #: Free device memory a live move of K back up must leave, MiB (2**20 bytes). 0: twice ``auto_resplit_free_mb``.
    auto_resplit_recover_mb: float = 0.0
    #: ``split_layer: auto``: move K live towards the lowest latency at the measured load (split.rebalance).
    auto_rebalance: bool = True
    #: With ``auto_rebalance``: the most blocks one latency move takes; 0: straight to the latency-best K.
    auto_rebalance_max_step: int = 0
    #: One image topic per camera, camera order; () means ``~/input/image<i>`` (validation with the checkpoint's
    #: camera count expands it).
    camera_topics: tuple[str, ...] = ()
    #: ``raw`` or ``compressed``, one value for all cameras or one per camera (expanded to one per camera).
    camera_transports: tuple[CameraTransport, ...] = ("raw",)
    #: QoS reliability of the camera subscriptions: ``auto`` (match the publishers), ``best_effort``, ``reliable``.
    camera_reliability: CameraReliability = "auto"
    #: CameraInfo topic per camera (query heads); () means beside each image topic (params.camera_info_topic).
    camera_info_topics: tuple[str, ...] = ()
    #: Vehicle frame of /tf_static's camera transforms and of ``model_frame_origin`` (query heads).
    base_frame: str = "base_link"
    #: The model frame's origin in ``base_frame``, (x, y, z) m (query heads; vehicle.camera_geometry.ModelFrame).
    model_frame_origin: tuple[float, ...] = (1.01, 0.0, 1.84)
    #: Navigation command of the next frames, read by the query heads' can-bus token (CARLA RoadOption names).
    navigation_command: NavigationCommand = "LANE_FOLLOW"
    #: Decode JPEGs scaled down by 2, 4 or 8 inside libjpeg when the model input allows.
    fast_jpeg_decode: bool = False
    #: Largest spread of header stamps within one synchronized frame, ms.
    sync_tolerance_ms: float = 50.0
    #: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    device: str = "auto"
    #: Weights and ring hidden states: ``fp32``, ``bf16``, ``fp16``.
    dtype: Dtype = "fp32"
    #: Name of the shared-memory ring (scoped by user, ROS domain and namespace).
    ring_name: str = "prefix_states"
    #: Slots in the ring (frames in flight), 3..64.
    ring_slots: int = 4
    #: CPU cores the process is pinned to; (): not pinned.
    cpu_affinity: tuple[int, ...] = ()
    #: Wait before the next frame so that it is published just as a slower suffix asks for it.
    pace_to_suffix: bool = True
    #: Torch intra-op threads on the CPU; 0: one per pinned core, or torch's default when not pinned.
    torch_threads: int = 0
    #: Ego state samples farther than this from the camera stamp are not used, s (``ego_state_input`` checkpoints).
    max_ego_state_age_s: float = 1.0
    #: Longest wait for the first kinematic state at or after a camera stamp, s (``ego_state_input`` checkpoints).
    ego_state_wait_s: float = 0.2

    def runner_settings(self, split_layer: int | None = None, *, namespace: str = "/",
                        domain_id: int | None = None) -> PrefixRunnerSettings:
        """The :class:`~hybrid_vla_ros.runtime.prefix.PrefixRunner`'s settings at K = ``split_layer`` (None: the
        parameter's). ``namespace`` / ``domain_id`` scope the ring. Raises ValueError when no K is given and
        ``split_layer`` is ``auto``.
        """
        k = self.split_layer if split_layer is None else split_layer
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(f"split_layer {k!r}: the runner needs a K (plan `auto` first)")
        return PrefixRunnerSettings(
            split_layer=k, device=self.device, dtype=self.dtype, ring_name=self.ring_name,
            ring_slots=self.ring_slots, torch_threads=self.torch_threads or len(self.cpu_affinity),
            fast_jpeg_decode=self.fast_jpeg_decode, gpu_budget_bytes=int(round(self.gpu_budget_gb * 1e9)),
            namespace=namespace, domain_id=domain_id)

    def split_settings(self) -> SplitPolicySettings:
        """What the :class:`~hybrid_vla_ros.runtime.split_control.SplitLayerControl` of these parameters needs."""
        return SplitPolicySettings(**{f: getattr(self, f) for f in SplitPolicySettings.PARAMETER_OF})


@dataclass(frozen=True)
class SuffixRingSettings:
    """The suffix's ``ring.*`` parameters: how it takes frames from the ring."""

    #: ``newest`` (the newest published frame; older unread ones are dropped as ``superseded``) or ``fifo``.
    delivery: Delivery = "newest"
    #: Start polling the ring this long before the next frame is due, ms (plus 3x the period's jitter).
    spin_lead_ms: float = 1.0
    #: Longest poll for one frame, ms; 0: no polling.
    spin_max_ms: float = 5.0


@dataclass(frozen=True)
class SuffixNodeSettings(NodeSettings):
    """suffix_node's validated parameters (``schema/suffix_node.schema.json`` describes each)."""

    NODE: ClassVar[str] = "suffix_node"

    #: Checkpoint directory, the same as the prefix node's.
    model_path: str = ""
    #: The split layer K this suffix prepares for (it loads decoder blocks [K, L) at configure); each frame is
    #: computed at the K in its slot header. ``"auto"``: follow the prefix's K (no blocks up front, the first
    #: frame loads those its K needs). -1: unset (validation rejects it).
    split_layer: SplitLayer = -1
    #: CPU cores the process is pinned to; (): not pinned.
    cpu_affinity: tuple[int, ...] = ()
    #: Torch intra-op threads; 0: one per pinned core, or torch's default when not pinned.
    threads: int = 0
    #: Weights dtype: ``fp32``, ``bf16``, ``fp16``.
    dtype: Dtype = "fp32"
    #: ``auto``: a bf16 / fp16 ``dtype`` is computed in fp32 on a CPU without native units for it; ``dtype``: never.
    inference_precision: PrecisionMode = "auto"
    #: How blocks [K, L) are computed: ``eager`` or ``openvino``.
    suffix_backend: Backend = "eager"
    #: A decoding model's one-row decode step: ``eager`` or ``inductor`` (compiled in the background).
    decode_step: DecodeStep = "eager"
    #: Folder of the compiled suffix artifacts; "": ``$HYBRID_VLA_CACHE`` or the user cache folder.
    backend_cache_dir: str = ""
    #: Name of the shared-memory ring to attach to, as the prefix node's.
    ring_name: str = "prefix_states"
    #: The ``ring.*`` parameters.
    ring: SuffixRingSettings = field(default_factory=SuffixRingSettings)
    #: Frame of the published trajectory (Autoware: ``map``).
    output_frame: str = "map"
    #: Vehicle wheelbase, m.
    wheelbase_m: float = 2.79
    #: The published query heads' model frame origin in base_link, (x, y, z) m: the prefix's value.
    model_frame_origin: tuple[float, ...] = (1.01, 0.0, 1.84)
    #: Odometry farther than this from the camera stamp is not used, s.
    max_odometry_age_s: float = 1.0
    #: Longest wait for the odometry message after a camera stamp, s.
    odometry_wait_s: float = 0.2
    #: Navigation command of the next frames (CARLA RoadOption names).
    navigation_command: NavigationCommand = "LANE_FOLLOW"
    #: Also publish every planner mode as CandidateTrajectories.
    publish_candidate_trajectories: bool = False
    #: A rosbag2 folder whose logged odometry replaces the model's plan (the open-loop sanity oracle); "": off.
    oracle_bag: str = ""
    #: The ``guard.*`` parameters: the output guard's limits (units in each field's name and docstring).
    guard: GuardLimits = field(default_factory=GuardLimits)

    def runner_settings(self, num_layers: int, *, namespace: str = "/",
                        domain_id: int | None = None) -> SuffixRunnerSettings:
        """The :class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner`'s settings; ``split_layer: auto`` starts at
        K = ``num_layers`` with no blocks held. The frame age limit is ``guard.max_age_s`` (0 without
        ``guard.check_age``).
        """
        k = num_layers if self.split_layer == "auto" else self.split_layer
        return SuffixRunnerSettings(
            split_layer=k, dtype=self.dtype, inference_precision=self.inference_precision, ring_name=self.ring_name,
            threads=self.threads or len(self.cpu_affinity), delivery=self.ring.delivery,
            spin_lead_ms=self.ring.spin_lead_ms, spin_max_ms=self.ring.spin_max_ms, backend=self.suffix_backend,
            decode_step=self.decode_step, backend_cache_dir=self.backend_cache_dir, namespace=namespace,
            domain_id=domain_id,
            frame_age_limit_s=self.guard.max_age_s if self.guard.check_age else 0.0)


#: Node name -> its settings class.
SETTINGS: dict[str, type[NodeSettings]] = {"prefix_node": PrefixNodeSettings, "suffix_node": SuffixNodeSettings}
