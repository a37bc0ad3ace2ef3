"""The query heads of Orion and MindDrive: how the camera features become the LLM's scene tokens, with a memory of
earlier frames moved by the ego motion.

Both heads read the backbone's (C, Dv, h, w) maps (camera-major, then row-major) with each feature's 3-D position
embedding (:mod:`.camera_rays`):

* the **map head** (published ``map_head``): extra queries and lane queries attend to one another, to the
  remembered lanes and to the image features; the extra queries' outputs are the map tokens;
* the **detection head** (published ``pts_bbox_head``): extra queries, object queries and the newest remembered
  objects as queries, the older ones as keys; the object tokens are its extra queries' outputs, then (MindDrive)
  scene-history queries that read the last 16 frames' extra queries, then one can-bus token (the command, the
  motion state of this and two earlier frames, the mean pose of each frame's remembered objects).

Scene tokens = object tokens then map tokens (:attr:`QueryHeadsConfig.scene_tokens`).

Sources: StreamPETR (Wang et al., 2023: the decoder layer, the top-k memory queue moved by the ego motion, the
motion-aware layer norm); NeRF's sin / cos encoding (Mildenhall et al., 2020); Orion (Fu et al., 2025: extra
queries and the can-bus token as LLM tokens); the published code (MindDrive's ``MinddriveHead`` /
``MinddriveHeadM``, its inference config) for the sizes, masks, memory update order and parameter names, kept so a
converted checkpoint loads one to one.

Left out on purpose, as feeding neither the tokens nor the memory: the outputs of levels 0 .. 4, the traffic-light
and motion-prediction branches (:data:`OUTPUT_ONLY`; the last level's scores and boxes / lanes are computed for
the memory's top-k), the objects' velocities (``memory_velo``); training-only parts (denoising, losses).

The memory's poses, points and can-bus positions are float64 (float32 in the published code), so a vehicle hundreds
of kilometres from its map origin (UTM) keeps centimetre resolution. As published, the memory resets on a gap of
:data:`MEMORY_MAX_GAP_S` or more; here also when time does not advance (a bag loop, a replayed frame) and on
:meth:`QueryHeads.reset`.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from .camera_rays import CameraRayEmbedding, RayEmbeddingConfig, inverse_sigmoid

#: The published detection range of the heads, metres, model frame: (x_min, y_min, z_min, x_max, y_max, z_max).
PC_RANGE = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
#: Entries of the published can-bus vector: translation (3), rotation quaternion (4), velocity (3),
#: acceleration (3), angular rate (3), yaw in radians, yaw in degrees.
CAN_BUS_SIZE = 18
#: NeRF encoding frequencies 2^0 .. 2^(n - 1) (the published ``nerf_positional_encoding`` default).
NERF_FREQUENCIES = 6
#: The published memory validity window, seconds: a frame this far from the last one resets the memory.
MEMORY_MAX_GAP_S = 2.0


@dataclass(frozen=True)
class QueryHeadsConfig:
    """Shapes of both heads. Defaults are MindDrive-0.5B's published inference config with the LLM width to set.

    ``embed_dims`` E: the heads' width; ``in_channels``: the backbone's; ``out_dims`` D: the LLM's; ``num_extra``:
    extra queries (LLM tokens) per head; ``n_control``: points per lane (and the repeat of an object's centre in
    its position encoding); ``code_size``: box vector (centre 3, size 3, yaw 2, velocity 2); ``num_propagated``:
    newest remembered objects used as queries; ``num_memory``: scene-history queries (0: none, Orion);
    ``num_lanes_one2one``: the first lane queries, the one-to-one group (the rest only train); ``with_mask``: the
    object / lane queries cannot see the extra queries."""

    embed_dims: int = 256
    in_channels: int = 1024
    out_dims: int = 896
    num_layers: int = 6
    num_heads: int = 8
    feedforward_dims: int = 2048
    num_extra: int = 256
    n_control: int = 11
    num_query: int = 600
    memory_len: int = 600
    topk_proposals: int = 300
    num_propagated: int = 300
    num_classes: int = 9
    code_size: int = 10
    can_bus_len: int = 2
    num_memory: int = 16
    scene_memory_len: int = 256
    memory_ffn_dims: int = 512
    num_lane: int = 1800
    num_lanes_one2one: int = 300
    map_memory_len: int = 600
    map_topk: int = 300
    map_classes: int = 6
    with_mask: bool = True
    pc_range: tuple[float, ...] = PC_RANGE

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "QueryHeadsConfig":
        """From a model config's ``projector`` dict (without ``type``; missing keys take the defaults); ``overrides``
        win. Raises ValueError for an unknown key (a misspelt size must not silently take the default) and for
        :meth:`problems`."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"query heads: unknown key(s) {unknown}; the keys are {sorted(names)}")
        values = {k: (tuple(v) if k == "pc_range" and isinstance(v, (list, tuple)) else v) for k, v in d.items()}
        cfg = cls(**{**values, **overrides})
        problems = cfg.problems()
        if problems:
            raise ValueError("query heads: " + "; ".join(problems))
        return cfg

    def problems(self) -> list[str]:
        """What makes these sizes unusable, one line each (empty when fine)."""
        out = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "with_mask":
                if not isinstance(v, bool):
                    out.append(f"with_mask must be true or false, got {v!r}")
            elif f.name == "pc_range":
                if not (isinstance(v, tuple) and len(v) == 6 and all(
                        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)):
                    out.append(f"pc_range must be 6 finite numbers (x_min, y_min, z_min, x_max, y_max, z_max), "
                               f"got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < (0 if f.name in ("num_memory",
                                                                                     "num_propagated") else 1):
                least = "a non-negative" if f.name in ("num_memory", "num_propagated") else "a positive"
                out.append(f"{f.name} must be {least} integer, got {v!r}")
        if out:
            return out
        if self.embed_dims % self.num_heads or self.embed_dims % 2:
            out.append("embed_dims must be even and a multiple of num_heads")
        if self.num_extra > self.num_query:
            out.append("num_extra must not exceed num_query (the extra queries take their zero reference points "
                       "from the object queries', as published)")
        if self.memory_len % self.topk_proposals or self.memory_len // self.topk_proposals > 8:
            out.append("memory_len must be a small multiple of topk_proposals (the can-bus token takes the mean "
                       "pose of each frame's objects)")
        if not 0 <= self.num_propagated <= self.topk_proposals:
            out.append("num_propagated must be in [0, topk_proposals]")
        if self.topk_proposals > self.num_query + self.num_propagated:
            out.append("topk_proposals must not exceed num_query + num_propagated")
        if self.num_memory and self.scene_memory_len % self.num_memory:
            out.append("scene_memory_len must be a multiple of num_memory (0: no scene history)")
        if not self.num_lanes_one2one <= self.num_lane or self.map_topk > self.num_lanes_one2one:
            out.append("need map_topk <= num_lanes_one2one <= num_lane")
        if any(hi <= lo for lo, hi in zip(self.pc_range[:3], self.pc_range[3:])):
            out.append("pc_range must have each max above its min")
        return out

    @property
    def can_bus_input(self) -> int:
        """Width of the can-bus token's input (89 in the published model)."""
        return (1 + self.can_bus_len) * (1 + CAN_BUS_SIZE) + 16 * (self.memory_len // self.topk_proposals)

    @property
    def object_tokens(self) -> int:
        """273 for MindDrive, 257 for Orion."""
        return self.num_extra + self.num_memory + 1

    @property
    def scene_tokens(self) -> int:
        """Object tokens then map tokens: 529 for MindDrive, 513 for Orion."""
        return self.object_tokens + self.num_extra


# ---------------------------------------------------------------------------------------------- encodings
def nerf_encoding(x: torch.Tensor, frequencies: int = NERF_FREQUENCIES) -> torch.Tensor:
    """(..., k) -> (..., 2 k ``frequencies``), same dtype, ordered as the published ``nerf_positional_encoding``
    (no input term)."""
    bands = 2.0 ** torch.linspace(0.0, frequencies - 1, frequencies, dtype=x.dtype, device=x.device)
    return torch.cat([fn(x * f) for f in bands for fn in (torch.sin, torch.cos)], dim=-1)


def time_encoding(t: torch.Tensor, dims: int = 256, temperature: float = 10000.0) -> torch.Tensor:
    """(..., 1) times in seconds -> (..., ``dims``) in t's dtype: the sine encoding of 2 pi t (the published
    ``pos2posemb1d``; ``dims`` even). Computed in float64 for float64 times, as published, else float32."""
    work = torch.float64 if t.dtype == torch.float64 else torch.float32
    i = torch.arange(dims, dtype=torch.float32, device=t.device)
    dim_t = temperature ** (2 * torch.div(i, 2, rounding_mode="floor") / dims)
    x = (t.to(work) * (2 * math.pi))[..., 0, None] / dim_t
    return torch.stack((x[..., 0::2].sin(), x[..., 1::2].cos()), dim=-1).flatten(-2).to(t.dtype)


class MotionLayerNorm(nn.Module):
    """StreamPETR's motion-aware layer norm (published ``MLN``): x (..., E), condition c (..., c_dim) ->
    (..., E)."""

    def __init__(self, c_dim: int, f_dim: int):
        super().__init__()
        self.reduce = nn.Sequential(nn.Linear(c_dim, f_dim), nn.ReLU())
        self.gamma = nn.Linear(f_dim, f_dim)
        self.beta = nn.Linear(f_dim, f_dim)
        self.ln = nn.LayerNorm(f_dim, elementwise_affine=False)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c = self.reduce(c)
        return self.gamma(c) * self.ln(x) + self.beta(c)


# ---------------------------------------------------------------------------------------------- decoders
class PosAttention(nn.Module):
    """``attn(q + q_pos, k + k_pos, k) + q``: (B, Q, E), (B, K, E) -> (B, Q, E). ``mask``: bool (Q, K), True = not
    attended. ``bias`` False for the scene-history decoders (their published flash-attention has none)."""

    def __init__(self, embed_dims: int, num_heads: int, bias: bool = True):
        super().__init__()
        self.attn = nn.MultiheadAttention(embed_dims, num_heads, bias=bias, batch_first=True)

    def forward(self, query, key, query_pos=None, key_pos=None, mask=None) -> torch.Tensor:
        q = query if query_pos is None else query + query_pos
        k = key if key_pos is None else key + key_pos
        out, _ = self.attn(q, k, key, attn_mask=mask, need_weights=False)
        return out + query


class FFN(nn.Module):
    """Linear, ReLU, Linear with a residual; indexes 0 and 3 as published (the dropouts are identities)."""

    def __init__(self, embed_dims: int, feedforward_dims: int):
        super().__init__()
        self._layers = nn.Sequential(nn.Linear(embed_dims, feedforward_dims), nn.ReLU(), nn.Identity(),
                                     nn.Linear(feedforward_dims, embed_dims), nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._layers(x) + x


class TemporalDecoderLayer(nn.Module):
    """StreamPETR's post-norm decoder layer: self-attention over [queries; memory], cross-attention to the image
    features, FFN, each followed by a LayerNorm."""

    def __init__(self, embed_dims: int, num_heads: int, feedforward_dims: int):
        super().__init__()
        self.transformer_layers = nn.ModuleList([
            PosAttention(embed_dims, num_heads), nn.LayerNorm(embed_dims), PosAttention(embed_dims, num_heads),
            nn.LayerNorm(embed_dims), FFN(embed_dims, feedforward_dims), nn.LayerNorm(embed_dims)])

    def forward(self, query, query_pos, feats, feats_pos, mask, temp_memory, temp_pos) -> torch.Tensor:
        self_attn, norm1, cross_attn, norm2, ffn, norm3 = self.transformer_layers
        keys = torch.cat([query, temp_memory], dim=1)
        keys_pos = torch.cat([query_pos, temp_pos], dim=1)
        query = norm1(self_attn(query, keys, query_pos, keys_pos, mask))
        query = norm2(cross_attn(query, feats, query_pos, feats_pos))
        return norm3(ffn(query))


class _Decoder(nn.Module):
    """Returns the last layer's queries (only they are read at inference)."""

    def __init__(self, cfg: QueryHeadsConfig):
        super().__init__()
        self._layers = nn.ModuleList(TemporalDecoderLayer(cfg.embed_dims, cfg.num_heads, cfg.feedforward_dims)
                                     for _ in range(cfg.num_layers))

    def forward(self, query, *args) -> torch.Tensor:
        for layer in self._layers:
            query = layer(query, *args)
        return query


class TemporalTransformer(nn.Module):
    """The published ``transformer`` wrapper: its one child ``query_decoder``."""

    def __init__(self, cfg: QueryHeadsConfig):
        super().__init__()
        self.query_decoder = _Decoder(cfg)

    def forward(self, query, query_pos, feats, feats_pos, mask, temp_memory, temp_pos) -> torch.Tensor:
        """(B, Q, E) queries and positions, (B, N, E) image features and positions, bool (Q, Q + M) mask or
        None, (B, M, E) memory and positions -> (B, Q, E)."""
        return self.query_decoder(query, query_pos, feats, feats_pos, mask, temp_memory, temp_pos)


class CrossDecoderLayer(nn.Module):
    """The scene-history decoders' layer: bias-free cross-attention, LayerNorm, FFN, LayerNorm."""

    def __init__(self, embed_dims: int, num_heads: int, feedforward_dims: int):
        super().__init__()
        self.transformer_layers = nn.ModuleList([
            PosAttention(embed_dims, num_heads, bias=False), nn.LayerNorm(embed_dims),
            FFN(embed_dims, feedforward_dims), nn.LayerNorm(embed_dims)])

    def forward(self, query, key, query_pos=None, key_pos=None) -> torch.Tensor:
        attn, norm1, ffn, norm2 = self.transformer_layers
        return norm2(ffn(norm1(attn(query, key, query_pos, key_pos))))


class CrossDecoder(nn.Module):
    """``_layers`` of one :class:`CrossDecoderLayer` (published ``memory_decoder_cq`` / ``_mq``)."""

    def __init__(self, cfg: QueryHeadsConfig):
        super().__init__()
        self._layers = nn.ModuleList([CrossDecoderLayer(cfg.embed_dims, cfg.num_heads, cfg.memory_ffn_dims)])

    def forward(self, query, key, query_pos=None, key_pos=None) -> torch.Tensor:
        for layer in self._layers:
            query = layer(query, key, query_pos, key_pos)
        return query


def _class_branch(e: int, out: int) -> nn.Sequential:
    """Linear, LayerNorm, ReLU twice, then Linear(E, out): indexes 0, 1, 3, 4, 6 as published."""
    return nn.Sequential(nn.Linear(e, e), nn.LayerNorm(e), nn.ReLU(), nn.Linear(e, e), nn.LayerNorm(e), nn.ReLU(),
                         nn.Linear(e, out))


def _regression_branch(e: int, out: int) -> nn.Sequential:
    """Linear, ReLU twice, then Linear(E, out): indexes 0, 2, 4 as published."""
    return nn.Sequential(nn.Linear(e, e), nn.ReLU(), nn.Linear(e, e), nn.ReLU(), nn.Linear(e, out))


# ---------------------------------------------------------------------------------------------- frame inputs
@dataclass(frozen=True)
class EgoFrame:
    """What the heads need of one frame besides the images.

    ``timestamp``: camera stamp, seconds; ``ego_pose``: (4, 4) float64 pose of the model frame in the odometry's
    world frame, metres (published "lidar to global"); ``can_bus``: (18,) float64 as :data:`CAN_BUS_SIZE` (the
    quaternion w first; m/s, m/s^2, rad/s); ``command``: navigation command index 0 .. 5."""

    timestamp: float
    ego_pose: torch.Tensor
    can_bus: torch.Tensor
    command: int

    def check(self) -> None:
        """Raise ValueError unless the shapes are right, every value finite, the pose rigid and the command in
        0 .. 5."""
        if isinstance(self.timestamp, bool) or not isinstance(self.timestamp, numbers.Real) or not math.isfinite(
                self.timestamp):
            raise ValueError(f"timestamp must be finite seconds, got {self.timestamp!r}")
        if not isinstance(self.ego_pose, torch.Tensor) or not isinstance(self.can_bus, torch.Tensor):
            raise ValueError("ego_pose and can_bus must be torch tensors")
        if isinstance(self.command, bool) or not isinstance(self.command, numbers.Integral):
            raise ValueError(f"command must be an integer navigation command index 0 .. 5, got {self.command!r}")
        if tuple(self.ego_pose.shape) != (4, 4) or not torch.isfinite(self.ego_pose).all():
            raise ValueError(f"ego_pose must be a finite (4, 4) matrix, got shape {tuple(self.ego_pose.shape)}")
        pose = self.ego_pose.to(torch.float64).cpu()
        if not torch.allclose(pose[3], torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)):
            raise ValueError(f"ego_pose's last row must be (0, 0, 0, 1), got {pose[3].tolist()}")
        r = pose[:3, :3]
        if not torch.allclose(r.T @ r, torch.eye(3, dtype=torch.float64), atol=1e-3) or float(torch.det(r)) < 0:
            raise ValueError("ego_pose's rotation is not a rotation (R^T R = I, det +1): not a rigid pose")
        if tuple(self.can_bus.shape) != (CAN_BUS_SIZE,) or not torch.isfinite(self.can_bus).all():
            raise ValueError(f"can_bus must be {CAN_BUS_SIZE} finite values, got shape {tuple(self.can_bus.shape)}")
        if not 0 <= int(self.command) <= 5:
            raise ValueError(f"command {self.command} is not a navigation command index 0 .. 5")


@dataclass(frozen=True)
class SceneInputs:
    """What a ``scene_queries`` model needs per frame besides the pixels: ``lidar2img`` (C, 4, 4) float (see
    :mod:`.camera_rays`) and the ``frame``."""

    lidar2img: torch.Tensor
    frame: EgoFrame


def example_scene_inputs(n_cameras: int, image_size: int, timestamp: float = 0.0) -> SceneInputs:
    """A made-up scene for checks without a vehicle (split checks, profiling, benchmarks): ``n_cameras`` pinhole
    cameras, 90 degrees field of view, at even headings from +y, 1.6 m up; the vehicle standing at the world
    origin. Not a calibration: never for driving."""
    f = image_size / 2.0
    k = torch.tensor([[f, 0, image_size / 2.0, 0], [0, f, image_size / 2.0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
                     dtype=torch.float64)
    out = []
    for i in range(n_cameras):
        yaw = 2 * math.pi * i / n_cameras  # heading of the optical axis, counter-clockwise from +y
        forward = torch.tensor([-math.sin(yaw), math.cos(yaw), 0.0], dtype=torch.float64)
        right = torch.tensor([math.cos(yaw), math.sin(yaw), 0.0], dtype=torch.float64)
        down = torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)
        rot = torch.stack([right, down, forward])  # rows: the camera's x (right), y (down), z (optical axis)
        cam = torch.eye(4, dtype=torch.float64)
        cam[:3, :3] = rot
        cam[:3, 3] = -rot @ torch.tensor([0.0, 0.0, 1.6], dtype=torch.float64)
        out.append(k @ cam)
    can_bus = torch.zeros(CAN_BUS_SIZE, dtype=torch.float64)
    can_bus[3] = 1.0  # identity rotation quaternion (w first)
    frame = EgoFrame(timestamp=timestamp, ego_pose=torch.eye(4, dtype=torch.float64), can_bus=can_bus, command=3)
    return SceneInputs(lidar2img=torch.stack(out).float(), frame=frame)


@dataclass
class ObjectMemory:
    """The detection head's memory (batch 1), newest first; float64 but ``embedding`` and ``scene_query``.

    ``reference`` (M, 3) centres, metres; ``egopose`` (M, 4, 4) the pose of the frame each was seen in;
    ``timestamp`` (M, 1) seconds; ``can_bus`` (can_bus_len, 19) earlier frames' command and can-bus, of which
    ``can_bus_frames`` rows hold a frame. Between frames everything is held in the world frame and at minus the
    absolute time; :meth:`QueryHeads.forward` brings it into the current frame and back."""

    embedding: torch.Tensor
    reference: torch.Tensor
    egopose: torch.Tensor
    timestamp: torch.Tensor
    can_bus: torch.Tensor
    can_bus_frames: int
    scene_query: torch.Tensor
    scene_timestamp: torch.Tensor


@dataclass
class MapMemory:
    """The map head's memory, held as :class:`ObjectMemory` is; ``reference`` (M, n_control, 3) lane points."""

    embedding: torch.Tensor
    reference: torch.Tensor
    egopose: torch.Tensor
    timestamp: torch.Tensor


@dataclass
class HeadsOutput:
    """One frame of :class:`QueryHeads`: ``tokens`` (scene_tokens, D); float32 ``objects`` (num_query +
    num_propagated, code_size) boxes (centre in metres, model frame), ``lanes`` (num_lanes_one2one, n_control, 3)
    metres, and their sigmoid scores; ``memory_reset``: whether the memory started afresh at this frame."""

    tokens: torch.Tensor
    objects: torch.Tensor
    object_scores: torch.Tensor
    lanes: torch.Tensor
    lane_scores: torch.Tensor
    memory_reset: bool


@dataclass
class MapFrame:
    """One frame of :class:`MapHead`: ``lanes`` (num_lanes_one2one, n_control, 3) metres, ``scores`` logits;
    ``kept_*``: the ``map_topk`` best-scored lanes, which the memory keeps."""

    tokens: torch.Tensor
    lanes: torch.Tensor
    scores: torch.Tensor
    kept_embedding: torch.Tensor
    kept_points: torch.Tensor


@dataclass
class ObjectFrame:
    """One frame of :class:`ObjectHead`: ``boxes`` (centre in metres) and ``scores`` logits; ``kept_*``: the
    ``topk_proposals`` best-scored objects; ``history`` (num_memory, E) or None; ``can_bus_row`` (19,) float64
    command and can-bus, translation and yaw in degrees zeroed (published ``rec_can_bus``)."""

    tokens: torch.Tensor
    boxes: torch.Tensor
    scores: torch.Tensor
    kept_embedding: torch.Tensor
    kept_centres: torch.Tensor
    history: torch.Tensor | None
    can_bus_row: torch.Tensor


def _to_frame(points: torch.Tensor, pose: torch.Tensor) -> torch.Tensor:
    """(..., 3) points transformed by ``pose`` (4, 4)."""
    return points @ pose[:3, :3].T + pose[:3, 3]


# ---------------------------------------------------------------------------------------------- heads
class MapHead(nn.Module):
    """The published ``map_head`` at inference; its six per-level branches (one shared module) are
    ``cls_branch`` / ``reg_branch`` here."""

    def __init__(self, cfg: QueryHeadsConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.embed_dims
        self.transformer = TemporalTransformer(cfg)
        self.cls_branch = _class_branch(e, cfg.map_classes)
        self.reg_branch = _regression_branch(e, cfg.n_control * 3)
        self.input_projection = nn.Linear(cfg.in_channels, e)
        self.output_projection = nn.Linear(e, cfg.out_dims)
        self.reference_points_lane = nn.Linear(e, 3)
        self.points_embedding_lane = nn.Embedding(cfg.n_control, e)
        self.instance_embedding_lane = nn.Embedding(cfg.num_lane, e)
        self.query_embedding = nn.Embedding(cfg.num_extra, e)
        self.rebuild_buffers(None)

    def rebuild_buffers(self, device) -> None:
        """(Re)compute ``pc_range`` and the attention mask on ``device`` from the configuration."""
        self.register_buffer("pc_range", torch.tensor(self.cfg.pc_range, dtype=torch.float32, device=device),
                             persistent=False)
        self.register_buffer("attn_mask", self._mask().to(device), persistent=False)

    def _mask(self) -> torch.Tensor:
        c = self.cfg
        n, one = c.num_lane + c.num_extra, c.num_lanes_one2one + c.num_extra
        mask = torch.zeros(n, n + c.map_memory_len, dtype=torch.bool)
        mask[one:, :one] = True  # the one-to-many lanes (a training device) and the rest do not see each other
        mask[:one, one:n] = True
        if c.with_mask:
            mask[c.num_extra:, :c.num_extra] = True
        return mask

    def empty_memory(self) -> MapMemory:
        c, dev = self.cfg, self.pc_range.device
        f64 = dict(dtype=torch.float64, device=dev)
        return MapMemory(embedding=torch.zeros(c.map_memory_len, c.embed_dims, dtype=self.query_embedding.weight.dtype,
                                               device=dev),
                         reference=torch.zeros(c.map_memory_len, c.n_control, 3, **f64),
                         egopose=torch.zeros(c.map_memory_len, 4, 4, **f64),
                         timestamp=torch.zeros(c.map_memory_len, 1, **f64))

    def forward(self, feats: torch.Tensor, feats_pos: torch.Tensor, mem: MapMemory,
                shared: "SharedEncoders") -> MapFrame:
        """``feats`` (N, in_channels), ``feats_pos`` (N, E), ``mem`` in the current frame -> :class:`MapFrame`."""
        c, dt = self.cfg, self.query_embedding.weight.dtype
        memory_img = self.input_projection(feats).unsqueeze(0)
        lane = self.instance_embedding_lane.weight.unsqueeze(-2) + self.points_embedding_lane.weight.unsqueeze(0)
        ref = self.reference_points_lane(lane).sigmoid().flatten(-2)  # (num_lane, n_control 3)
        query_pos = shared.query_pos(nerf_encoding(ref)).unsqueeze(0)
        now = shared.time_embedding(time_encoding(torch.zeros_like(ref[..., :1]), c.embed_dims))
        query_pos = query_pos + now.unsqueeze(0)
        tgt = self.instance_embedding_lane.weight.unsqueeze(0)
        lo, hi = self.pc_range[:3].double(), self.pc_range[3:].double()
        temp_pos = shared.query_pos(nerf_encoding(((mem.reference - lo) / (hi - lo)).flatten(-2).to(dt)))
        temp_pos = shared.memory_motion(temp_pos, mem.egopose, mem.timestamp)
        tgt = torch.cat([self.query_embedding.weight.unsqueeze(0), tgt], dim=1)
        query_pos = torch.cat([torch.zeros_like(self.query_embedding.weight).unsqueeze(0), query_pos], dim=1)
        out = self.transformer(tgt, query_pos, memory_img, feats_pos.unsqueeze(0), self.attn_mask,
                               mem.embedding.unsqueeze(0), temp_pos.unsqueeze(0))[0]
        tokens = self.output_projection(out[:c.num_extra])
        lanes_q = torch.nan_to_num(out[c.num_extra:c.num_extra + c.num_lanes_one2one])
        one_ref = ref[:c.num_lanes_one2one]
        points = (self.reg_branch(lanes_q) + inverse_sigmoid(one_ref)).sigmoid()
        points = points.reshape(-1, c.n_control, 3) * (self.pc_range[3:] - self.pc_range[:3]) + self.pc_range[:3]
        scores = self.cls_branch(lanes_q)
        best = scores.sigmoid().max(dim=-1).values.topk(c.map_topk).indices
        return MapFrame(tokens=tokens, lanes=points, scores=scores, kept_embedding=lanes_q.index_select(0, best),
                        kept_points=points.index_select(0, best))


class SharedEncoders(nn.Module):
    """The encoders both heads share (published on the detector and referenced by each head)."""

    def __init__(self, cfg: QueryHeadsConfig):
        super().__init__()
        e, code = cfg.embed_dims, 3 * cfg.n_control * 2 * NERF_FREQUENCIES
        self.query_pos = nn.Sequential(nn.Linear(code, e), nn.ReLU(), nn.Linear(e, e))
        self.time_embedding = nn.Sequential(nn.Linear(e, e), nn.LayerNorm(e))
        self.ego_pose_pe = MotionLayerNorm(13 * 2 * NERF_FREQUENCIES, e)

    def memory_motion(self, temp_pos: torch.Tensor, egopose: torch.Tensor, timestamp: torch.Tensor) -> torch.Tensor:
        """(M, E) memory positions, (M, 4, 4) float64 poses, (M, 1) float64 relative times -> (M, E)."""
        dt = temp_pos.dtype
        motion = torch.cat([timestamp, egopose[..., :3, :].flatten(-2)], dim=-1).to(dt)
        temp_pos = self.ego_pose_pe(temp_pos, nerf_encoding(motion))
        return temp_pos + self.time_embedding(time_encoding(timestamp, temp_pos.shape[-1]).to(dt))


class ObjectHead(nn.Module):
    """The published ``pts_bbox_head`` at inference; branches as :class:`MapHead`'s."""

    def __init__(self, cfg: QueryHeadsConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.embed_dims
        self.transformer = TemporalTransformer(cfg)
        self.cls_branch = _class_branch(e, cfg.num_classes)
        self.reg_branch = _regression_branch(e, cfg.code_size)
        self.input_projection = nn.Linear(cfg.in_channels, e)
        self.output_projection = nn.Linear(e, cfg.out_dims)
        self.reference_points = nn.Embedding(cfg.num_query, 3)
        if cfg.num_propagated:
            self.pseudo_reference_points = nn.Embedding(cfg.num_propagated, 3)
        self.query_embedding = nn.Embedding(cfg.num_extra, e)
        self.can_bus_embed = nn.Sequential(nn.Linear(cfg.can_bus_input, 4 * e), nn.ReLU(),
                                           nn.Linear(4 * e, cfg.out_dims))
        if cfg.num_memory:
            self.memory_query = nn.Embedding(cfg.num_memory, e)
            self.scene_time_embedding = nn.Sequential(nn.Linear(e, e), nn.LayerNorm(e))
            self.memory_decoder_cq = CrossDecoder(cfg)
            self.memory_decoder_mq = CrossDecoder(cfg)
        self.rebuild_buffers(None)

    def rebuild_buffers(self, device) -> None:
        """(Re)compute ``pc_range`` and the attention mask on ``device`` from the configuration."""
        self.register_buffer("pc_range", torch.tensor(self.cfg.pc_range, dtype=torch.float32, device=device),
                             persistent=False)
        mask = self._mask()
        self.register_buffer("attn_mask", None if mask is None else mask.to(device), persistent=False)

    def _mask(self) -> torch.Tensor | None:
        c = self.cfg
        if not c.with_mask:
            return None
        mask = torch.zeros(c.num_extra + c.num_query + c.num_propagated, c.num_extra + c.num_query + c.memory_len,
                           dtype=torch.bool)
        mask[c.num_extra:, :c.num_extra] = True
        return mask

    def empty_memory(self) -> ObjectMemory:
        c, dev, dt = self.cfg, self.pc_range.device, self.query_embedding.weight.dtype
        f64 = dict(dtype=torch.float64, device=dev)
        return ObjectMemory(
            embedding=torch.zeros(c.memory_len, c.embed_dims, dtype=dt, device=dev),
            reference=torch.zeros(c.memory_len, 3, **f64), egopose=torch.zeros(c.memory_len, 4, 4, **f64),
            timestamp=torch.zeros(c.memory_len, 1, **f64), can_bus=torch.zeros(c.can_bus_len, 1 + CAN_BUS_SIZE, **f64),
            can_bus_frames=0, scene_query=torch.zeros(c.scene_memory_len, c.embed_dims, dtype=dt, device=dev),
            scene_timestamp=torch.zeros(c.scene_memory_len, 1, **f64))

    def seed_empty(self, mem: ObjectMemory) -> None:
        """Give a fresh memory the learned pseudo objects (published, first frame)."""
        n = self.cfg.num_propagated
        if n:
            lo, hi = self.pc_range[:3].double(), self.pc_range[3:].double()
            mem.reference[:n] += self.pseudo_reference_points.weight.double() * (hi - lo) + lo
            mem.egopose[:n] += torch.eye(4, dtype=torch.float64, device=mem.egopose.device)

    def forward(self, feats, feats_pos, mem: ObjectMemory, frame: EgoFrame, shared: SharedEncoders) -> ObjectFrame:
        """As :meth:`MapHead.forward`, plus ``frame`` -> :class:`ObjectFrame`."""
        c, dt = self.cfg, self.query_embedding.weight.dtype
        lo, hi = self.pc_range[:3].double(), self.pc_range[3:].double()
        memory_img = self.input_projection(feats).unsqueeze(0)
        ref = torch.cat([torch.zeros_like(self.reference_points.weight[:c.num_extra]), self.reference_points.weight])
        query_pos = shared.query_pos(nerf_encoding(ref.repeat(1, c.n_control)))
        query_pos = query_pos + shared.time_embedding(time_encoding(torch.zeros_like(ref[..., :1]), c.embed_dims))
        tgt = torch.zeros_like(query_pos)
        temp_ref = (mem.reference - lo) / (hi - lo)  # (M, 3) float64
        temp_pos = shared.query_pos(nerf_encoding(temp_ref.to(dt).repeat(1, c.n_control)))
        temp_pos = shared.memory_motion(temp_pos, mem.egopose, mem.timestamp)
        n = c.num_propagated
        tgt = torch.cat([tgt, mem.embedding[:n]])
        query_pos = torch.cat([query_pos, temp_pos[:n]])
        ref = torch.cat([ref, temp_ref[:n].to(ref.dtype)])
        tgt[:c.num_extra] = self.query_embedding.weight
        query_pos[:c.num_extra] = 0
        history = None
        if c.num_memory:
            key_pos = self.scene_time_embedding(time_encoding(mem.scene_timestamp, c.embed_dims).to(dt))
            current = self.memory_query.weight.unsqueeze(0)
            history = self.memory_decoder_mq(current, mem.scene_query.unsqueeze(0), torch.zeros_like(current),
                                             key_pos.unsqueeze(0))
        out = self.transformer(tgt.unsqueeze(0), query_pos.unsqueeze(0), memory_img, feats_pos.unsqueeze(0),
                               self.attn_mask, mem.embedding[n:].unsqueeze(0), temp_pos[n:].unsqueeze(0))
        out = torch.nan_to_num(out[0])
        extra, objects = out[:c.num_extra], out[c.num_extra:]
        tokens = [extra]
        if history is not None:
            history = self.memory_decoder_cq(history, extra.unsqueeze(0))[0]
            tokens.append(history)
        scores = self.cls_branch(objects)
        boxes = self.reg_branch(objects)
        centre = (boxes[:, :3] + inverse_sigmoid(ref[c.num_extra:])).sigmoid()
        boxes = torch.cat([centre * (self.pc_range[3:] - self.pc_range[:3]) + self.pc_range[:3], boxes[:, 3:]], -1)
        can_bus = frame.can_bus.to(torch.float64).clone()
        can_bus[:3] = 0
        can_bus[-1] = 0
        row = torch.cat([can_bus.new_full((1,), float(frame.command)), can_bus])  # (19,)
        frames = c.memory_len // c.topk_proposals
        mean_pose = mem.egopose.reshape(frames, c.topk_proposals, 16).mean(dim=1).flatten()
        can_bus_input = torch.cat([row, mem.can_bus.flatten(), mean_pose]).to(torch.float32)
        token_can = self.can_bus_embed(can_bus_input.to(dt))
        tokens = torch.cat([self.output_projection(torch.cat(tokens)), token_can.unsqueeze(0)])
        best = scores.sigmoid().max(dim=-1).values.topk(c.topk_proposals).indices
        return ObjectFrame(tokens=tokens, boxes=boxes, scores=scores, kept_embedding=objects.index_select(0, best),
                           kept_centres=boxes[:, :3].index_select(0, best), history=history, can_bus_row=row)


class QueryHeads(nn.Module):
    """The scene-token stage of Orion / MindDrive: 3-D position embedding, both heads and their memory.

    ``forward(features, lidar2img, frame)``: (C, Dv, h, w) feature maps (any float dtype), (C, 4, 4) geometries,
    an :class:`EgoFrame` -> :class:`HeadsOutput` (tokens float32). Frames must come in time order; the memory is
    held between calls (:attr:`object_memory`, :attr:`map_memory`). Raises ValueError for feature maps of the wrong
    width, a geometry count that is not the cameras', a bad frame or a geometry that is not finite or invertible;
    the memory is then unchanged. Non-finite tokens (bad features, overflow) are returned for the caller to refuse
    (the prefix runner does) and not remembered.
    """

    #: The heads compute in float32 whatever the stage's dtype, as the published models do (``fp32_infer``): the
    #: memory's top-k choice is discrete, and in bf16 near-equal scores flip it. ``.to(bf16)`` / ``.half()`` leave
    #: them float32 (:meth:`_apply`); ``modeling.embed`` casts the tokens; the split planner counts 4-byte weights.
    keeps_float32 = True

    def __init__(self, cfg: QueryHeadsConfig, rays: RayEmbeddingConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.rays = CameraRayEmbedding(rays or RayEmbeddingConfig(embed_dims=cfg.embed_dims))
        self.shared = SharedEncoders(cfg)
        self.map_head = MapHead(cfg)
        self.pts_bbox_head = ObjectHead(cfg)
        self.object_memory: ObjectMemory | None = None
        self.map_memory: MapMemory | None = None
        self.last_timestamp: float | None = None

    def _apply(self, fn, recurse=True):
        """As nn.Module's, but floating tensors stay float32 (:attr:`keeps_float32`); a device move applies."""
        def keep_float32(t):
            out = fn(t)
            if out.is_floating_point() and out.dtype != t.dtype:  # a dtype change: keep the values, move only
                return t.to(device=out.device)
            return out
        return super()._apply(keep_float32, recurse)

    @property
    def pc_range_device(self) -> torch.device:
        """The device the heads (and their memory) are on."""
        return self.pts_bbox_head.pc_range.device

    def reset(self) -> None:
        """Forget every earlier frame: the next frame starts the memory afresh."""
        self.object_memory = self.map_memory = self.last_timestamp = None

    def _current(self, frame: EgoFrame) -> tuple[ObjectMemory, MapMemory, bool]:
        """The memory brought into ``frame`` (published ``pre_update_memory``), or a fresh one; whether fresh."""
        c, obj, lane = self.cfg, self.object_memory, self.map_memory
        gap = None if self.last_timestamp is None else frame.timestamp - self.last_timestamp
        if obj is None or lane is None or gap is None or not 0.0 < gap < MEMORY_MAX_GAP_S:
            obj, lane = self.pts_bbox_head.empty_memory(), self.map_head.empty_memory()
            self.pts_bbox_head.seed_empty(obj)
            return obj, lane, True
        inv = torch.linalg.inv(frame.ego_pose.to(torch.float64))
        t = frame.timestamp
        obj = replace(obj, embedding=obj.embedding[:c.memory_len],
                      reference=_to_frame(obj.reference[:c.memory_len], inv),
                      egopose=(inv @ obj.egopose)[:c.memory_len], timestamp=obj.timestamp[:c.memory_len] + t,
                      scene_query=obj.scene_query[:c.scene_memory_len],
                      scene_timestamp=obj.scene_timestamp[:c.scene_memory_len] + t)
        can_bus = obj.can_bus.clone()
        held = min(obj.can_bus_frames, can_bus.shape[0])
        can_bus[:held, 1:4] -= frame.can_bus[:3]
        can_bus[:held, -1] -= frame.can_bus[-1]
        obj.can_bus = can_bus[:c.can_bus_len]
        obj.can_bus_frames = min(obj.can_bus_frames, c.can_bus_len)
        lane = MapMemory(embedding=lane.embedding[:c.map_memory_len],
                         reference=_to_frame(lane.reference[:c.map_memory_len], inv),
                         egopose=(inv @ lane.egopose)[:c.map_memory_len],
                         timestamp=lane.timestamp[:c.map_memory_len] + t)
        return obj, lane, False

    def forward(self, features: torch.Tensor, lidar2img: torch.Tensor, frame: EgoFrame) -> HeadsOutput:
        frame.check()
        if features.dim() != 4 or features.shape[1] != self.cfg.in_channels:
            raise ValueError(f"features must be (C, {self.cfg.in_channels}, h, w) feature maps, got "
                             f"{tuple(features.shape)}")
        if tuple(lidar2img.shape) != (features.shape[0], 4, 4):
            raise ValueError(f"lidar2img must be ({features.shape[0]}, 4, 4), one per camera, got "
                             f"{tuple(lidar2img.shape)}")
        features = features.float()  # the heads compute in float32 (keeps_float32)
        dev = self.pc_range_device  # the frame's pose and can-bus join the memory on the heads' device
        frame = replace(frame, ego_pose=frame.ego_pose.to(dev, torch.float64),
                        can_bus=frame.can_bus.to(dev, torch.float64))
        n_cam, _, h, w = features.shape
        stride = self.rays.cfg.stride
        feats_pos = self.rays(lidar2img.to(features.device), h, w, h * stride, w * stride)
        feats = features.permute(0, 2, 3, 1).reshape(n_cam * h * w, -1)
        obj, lane, fresh = self._current(frame)
        lanes = self.map_head(feats, feats_pos, lane, self.shared)
        objects = self.pts_bbox_head(feats, feats_pos, obj, frame, self.shared)
        tokens = torch.cat([objects.tokens, lanes.tokens])
        if bool(torch.isfinite(tokens).all()):  # a frame with non-finite tokens (bad features, an absurd can-bus)
            self._remember(frame, obj, lane, objects, lanes)  # must not poison the memory
        return HeadsOutput(tokens=tokens, objects=objects.boxes.float(),
                           object_scores=objects.scores.sigmoid().float(), lanes=lanes.lanes.float(),
                           lane_scores=lanes.scores.sigmoid().float(), memory_reset=fresh)

    @torch.no_grad()
    def _remember(self, frame: EgoFrame, obj: ObjectMemory, lane: MapMemory, objects: ObjectFrame,
                  lanes: MapFrame) -> None:
        """Prepend this frame's kept queries, back in the world frame (published ``post_update_memory``)."""
        pose, t = frame.ego_pose.to(torch.float64), frame.timestamp
        c = self.cfg
        k = c.topk_proposals
        eye = torch.eye(4, dtype=torch.float64, device=pose.device)
        emb, centre, history = objects.kept_embedding, objects.kept_centres, objects.history
        can_bus = torch.cat([objects.can_bus_row.unsqueeze(0), obj.can_bus])
        frames = obj.can_bus_frames + 1
        can_bus[:frames, 1:4] += frame.can_bus[:3]
        can_bus[:frames, -1] += frame.can_bus[-1]
        scene_query, scene_ts = obj.scene_query, obj.scene_timestamp
        if history is not None:
            scene_query = torch.cat([history, scene_query])
            scene_ts = torch.cat([torch.zeros(c.num_memory, 1, dtype=torch.float64, device=pose.device), scene_ts])
        self.object_memory = ObjectMemory(
            embedding=torch.cat([emb, obj.embedding]),
            reference=_to_frame(torch.cat([centre.to(torch.float64), obj.reference]), pose),
            egopose=pose @ torch.cat([eye.expand(k, 4, 4), obj.egopose]),
            timestamp=torch.cat([torch.zeros(k, 1, dtype=torch.float64, device=pose.device), obj.timestamp]) - t,
            can_bus=can_bus, can_bus_frames=frames, scene_query=scene_query, scene_timestamp=scene_ts - t)
        lemb, lpoints = lanes.kept_embedding, lanes.kept_points
        m = c.map_topk
        self.map_memory = MapMemory(
            embedding=torch.cat([lemb, lane.embedding]),
            reference=_to_frame(torch.cat([lpoints.to(torch.float64), lane.reference]), pose),
            egopose=pose @ torch.cat([eye.expand(m, 4, 4), lane.egopose]),
            timestamp=torch.cat([torch.zeros(m, 1, dtype=torch.float64, device=pose.device), lane.timestamp]) - t)
        self.last_timestamp = t


# ---------------------------------------------------------------------------------------------- published keys
#: Published tensors the heads leave out because they feed neither the tokens nor the memory (module docstring).
OUTPUT_ONLY = ("pts_bbox_head.tl_branches.", "pts_bbox_head.motion_decoder.", "pts_bbox_head.motion_map_decoder.",
               "pts_bbox_head.lane_encoder.", "pts_bbox_head.pos_mlp.", "pts_bbox_head.pos_mlp_sa.",
               "pts_bbox_head.motion_mode_query.", "pts_bbox_head.traj_branches.",
               "pts_bbox_head.traj_cls_branches.")
#: Published tensors used only by the training losses.
TRAINING_ONLY = ("pts_bbox_head.code_weights", "pts_bbox_head.match_costs", "map_head.code_weights",
                 "map_head.match_costs")
#: Published top-level prefixes of the heads' tensors (the detector's shared encoders and the two heads).
PUBLISHED_PREFIXES = ("position_encoder.", "query_pos.", "time_embedding.", "ego_pose_pe.", "pts_bbox_head.",
                      "map_head.", "coords_d", "position_range")
_SHARED = ("query_pos.", "time_embedding.", "ego_pose_pe.")


@dataclass
class PlacedHeads:
    """The published heads' tensors in :class:`QueryHeads`' names: ``tensors`` local key -> tensor; ``read``
    every published key consumed; ``left_out`` published key -> why; ``checked`` the derived constants and shared
    copies compared rather than placed."""

    tensors: dict
    read: set
    left_out: dict
    checked: list


def _local_key(key: str) -> tuple[str | None, str]:
    """(local key or None, why none) for a published key of :data:`PUBLISHED_PREFIXES`."""
    if key.startswith(OUTPUT_ONLY):
        return None, "output only (feeds neither the scene tokens nor the memory)"
    if key in TRAINING_ONLY:
        return None, "training only (loss weights)"
    head, _, rest = key.partition(".")
    if head not in ("pts_bbox_head", "map_head"):
        if key.startswith(_SHARED):
            return f"shared.{key}", ""
        return f"rays.{key}", ""
    if rest.startswith(_SHARED):
        return f"shared.{rest}", ""
    for many, one in (("cls_branches.", "cls_branch."), ("reg_branches.", "reg_branch.")):
        if rest.startswith(many):
            _, _, inner = rest[len(many):].partition(".")
            return f"{head}.{one}{inner}", ""
    return f"{head}.{rest}", ""


def place_published_heads(state, cfg: QueryHeadsConfig, rays: RayEmbeddingConfig | None = None) -> PlacedHeads:
    """Map a published detector's head tensors (e.g. a MindDrive ``.pth``'s ``state_dict``) onto
    :class:`QueryHeads` of ``cfg``.

    The shared encoders are stored at the top and under each head, and each head's six per-level branches are one
    module; every copy must be equal and is placed once. Raises ValueError, naming the keys, when copies differ,
    a derived constant or a shape is not the configuration's, or an inference tensor is missing."""
    from .camera_rays import POSITION_RANGE, depth_bins

    rays = rays or RayEmbeddingConfig(embed_dims=cfg.embed_dims)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in QueryHeads(cfg, rays).state_dict().items()}
    tensors, read, left_out, checked, problems = {}, set(), {}, [], []
    derived = {"coords_d": depth_bins(rays), "position_range": torch.tensor(rays.position_range or POSITION_RANGE),
               "pts_bbox_head.pc_range": torch.tensor(cfg.pc_range), "map_head.pc_range": torch.tensor(cfg.pc_range)}
    for key in sorted(k for k in state if k.startswith(PUBLISHED_PREFIXES)):
        value = state[key]
        read.add(key)
        if key in derived:
            if tuple(value.shape) != tuple(derived[key].shape) or not torch.allclose(
                    value.float(), derived[key].float(), rtol=1e-5, atol=1e-5):
                problems.append(f"{key} {value.flatten()[:6].tolist()} is not the configuration's "
                                f"{derived[key].flatten()[:6].tolist()}")
            checked.append(key)
            continue
        local, why = _local_key(key)
        if local is None:
            left_out[key] = why
            continue
        if local in tensors:
            if tensors[local].shape != value.shape or not torch.equal(tensors[local], value):
                problems.append(f"{key} differs from the other copy of {local} (shared modules must be equal)")
            checked.append(key)
            continue
        if local not in expected:
            problems.append(f"{key}: no tensor {local} in heads of this configuration")
        elif tuple(expected[local]) != tuple(value.shape):
            problems.append(f"{key}: shape {tuple(value.shape)} != {tuple(expected[local])} of this configuration")
        tensors[local] = value
    missing = sorted(set(expected) - set(tensors))
    if missing:
        problems.append(f"{len(missing)} inference tensor(s) of the query heads missing (a partial checkpoint): "
                        + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
    if problems:
        raise ValueError("query heads: " + "; ".join(problems))
    return PlacedHeads(tensors=tensors, read=read, left_out=left_out, checked=checked)
