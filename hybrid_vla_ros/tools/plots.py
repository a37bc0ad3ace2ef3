"""Pictures of a replay (``hybrid-vla replay --plots DIR``): matplotlib on an Agg canvas, no display.

* ``trajectory_camera.png``: one frame's planned trajectory projected into the front camera image (intrinsics
  K from the bag's CameraInfo, base_link -> camera from the bag's /tf_static or, for the embedded bag,
  ``config/dgp_scene02_camera0_extrinsics.yaml``).
* ``trajectory_bev.png``: bird's-eye view in base_link (x forward up the page): every frame's trajectory
  faint, one highlighted, the ego box and the camera's field of view on a metres grid.
* ``timeline.png``: per frame, bars for preprocess / prefix / hand-off / suffix over wall time, from the
  CLOCK_MONOTONIC instants of the suffix node's ``~/debug/frame_timing``; shows when the prefix of frame
  t+1 ran while the suffix of frame t did (the cross-frame pipeline); a frame sent that got no trajectory
  is an x on its row at the time it was sent.
* ``latency_hist.png``: per-stage and end-to-end latency histograms with p50 / p90.

:func:`collect` turns what the replay recorded into a :class:`PlotData`; :func:`write_all` draws it.
Frames: base_link x forward, y left (REP 103); camera frames are optical (z forward, x right, y down).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator, MultipleLocator

from ..ros.status import FrameTiming

DEFAULT_EXTRINSICS = "dgp_scene02_camera0_extrinsics.yaml"  # in the package's config/ folder
DPI = 100
FIGSIZE_IN = {  # width, height in inches; at DPI the PNGs are exactly 100x these in pixels
    "trajectory_camera.png": (13.0, 9.0),
    "trajectory_bev.png": (9.0, 10.0),
    "timeline.png": (14.0, 9.0),
    "latency_hist.png": (14.0, 8.0),
    "open_loop.png": (13.0, 8.0),
}
MIN_DEPTH_M = 0.1  # points closer to the camera plane than this (or behind it) are not drawn
STAGE_STYLE = (  # key in the frame timing, legend label, colour
    ("preprocess", "preprocess (decode, resize)", "#1f77b4"),
    ("prefix", "prefix (vision .. block K-1)", "#ff7f0e"),
    ("handoff", "hand-off (ring copy -> suffix view)", "#2ca02c"),
    ("suffix", "suffix (blocks K..L-1, head)", "#d62728"),
)
INPUT_WAIT = ("images sent -> prefix start (DDS, sync, queue)", "#c9c9c9")
#: The logged drive's colour in the trajectory pictures (the published trajectory is cyan / red).
LOGGED_COLOR = "#ff9f1c"
EGO_WAIT = ("ego-state wait (prefix, odometry at the camera stamp)", "#8c6d31")
OUTPUT_WAIT = ("odometry wait + publish", "#c5b0d5")
LOST_COLOR = "#000000"  # a frame the replay sent that got no trajectory
RANDOM_NOTE = "RANDOM-INIT model: the path tests the pipeline, it is not a driving plan"
EGO_BOX_M = (-1.0, 3.9, 0.95)  # rear and front end along x from base_link (rear axle), half width (m)
GROUND_GRID_X_M = (10.0, 20.0, 30.0, 50.0)  # reference lines on the ground (base_link z = 0) in the camera picture
GROUND_GRID_Y_M = (-1.75, 1.75)  # a 3.5 m lane centred on base_link
_OUTLINE = [patheffects.withStroke(linewidth=3, foreground="black")]


# ------------------------------------------------------------------------------------------- geometry
def quaternion_matrix(x: float, y: float, z: float, w: float) -> np.ndarray:
    """3x3 rotation matrix of a quaternion (x, y, z, w) (normalised first). Raises ValueError for a zero one."""
    q = np.array([x, y, z, w], dtype=np.float64)
    n = float(np.linalg.norm(q))
    if not math.isfinite(n) or n < 1e-9:
        raise ValueError(f"quaternion {tuple(q)} is not a rotation")
    x, y, z, w = q / n
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


def rigid_transform(translation, quaternion_xyzw) -> np.ndarray:
    """4x4 homogeneous transform from a translation (x, y, z) and a quaternion (x, y, z, w)."""
    t = np.eye(4)
    t[:3, :3] = quaternion_matrix(*quaternion_xyzw)
    t[:3, 3] = np.asarray(translation, dtype=np.float64)
    return t


@dataclass
class Extrinsics:
    """Pose of ``child`` (a camera) in ``parent`` (base_link): ``matrix`` maps child to parent coordinates,
    as a tf2 transform with header.frame_id ``parent`` and child_frame_id ``child``."""

    parent: str
    child: str
    matrix: np.ndarray  # 4x4
    source: str


def load_extrinsics_yaml(path: str | Path) -> Extrinsics:
    """Read a parent_frame / child_frame / translation {x,y,z} / rotation {x,y,z,w} YAML file
    (see config/dgp_scene02_camera0_extrinsics.yaml). Raises OSError, ValueError."""
    import yaml

    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    try:
        t, r = doc["translation"], doc["rotation"]
        matrix = rigid_transform((t["x"], t["y"], t["z"]), (r["x"], r["y"], r["z"], r["w"]))
        return Extrinsics(str(doc["parent_frame"]), str(doc["child_frame"]), matrix, path.name)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: needs parent_frame, child_frame, translation {{x, y, z}} and "
                         f"rotation {{x, y, z, w}} ({e})") from None


def extrinsics_from_tf(transforms, parent: str, child: str, source: str = "/tf_static") -> Extrinsics | None:
    """Compose ``parent`` -> ``child`` from (parent, child, 4x4) transforms (e.g. a bag's /tf_static) by walking
    up from ``child``; None when ``child`` is not below ``parent`` in them."""
    up = {c.lstrip("/"): (p.lstrip("/"), m) for p, c, m in transforms}
    parent, frame = parent.lstrip("/"), child.lstrip("/")
    matrix, seen = np.eye(4), set()
    while frame != parent:
        if frame not in up or frame in seen:
            return None
        seen.add(frame)
        frame, step = up[frame]
        matrix = step @ matrix
    return Extrinsics(parent, child, matrix, source)


def project_points(points_base, camera_in_base: np.ndarray, k: np.ndarray, min_depth: float = MIN_DEPTH_M):
    """Pinhole projection of base_link points (N, 3) into pixels (N, 2) with the camera pose in base_link
    (4x4, child -> parent) and intrinsics K (3x3). Returns ``(uv, in_front)``: points less than ``min_depth``
    (m) in front of the camera (behind it included) get ``in_front`` False and NaN pixels."""
    pts = np.asarray(points_base, dtype=np.float64).reshape(-1, 3)
    cam = camera_coordinates(pts, camera_in_base)
    in_front = cam[:, 2] > min_depth
    uv = np.full((len(pts), 2), np.nan)
    if in_front.any():
        uvw = cam[in_front] @ np.asarray(k, dtype=np.float64).T
        uv[in_front] = uvw[:, :2] / uvw[:, 2:3]
    return uv, in_front


def camera_coordinates(points_base: np.ndarray, camera_in_base: np.ndarray) -> np.ndarray:
    """base_link points (N, 3) -> camera coordinates: ``R^T (p - t)`` for the camera pose (R, t) in base_link."""
    rotation, origin = camera_in_base[:3, :3], camera_in_base[:3, 3]
    return (np.asarray(points_base, dtype=np.float64) - origin) @ rotation


def visible_segments(points_base, camera_in_base: np.ndarray, k: np.ndarray, min_depth: float = MIN_DEPTH_M):
    """Pixel segments (M, 2, 2) of the polyline through base_link points, each cut at ``min_depth`` in front
    of the camera; segments wholly behind it are left out."""
    cam = camera_coordinates(np.asarray(points_base, dtype=np.float64).reshape(-1, 3), camera_in_base)
    k = np.asarray(k, dtype=np.float64)
    out = []
    for a, b in zip(cam[:-1], cam[1:]):
        if a[2] <= min_depth and b[2] <= min_depth:
            continue
        if a[2] < min_depth:
            a = a + (b - a) * (min_depth - a[2]) / (b[2] - a[2])
        elif b[2] < min_depth:
            b = b + (a - b) * (min_depth - b[2]) / (a[2] - b[2])
        ends = np.stack([a, b]) @ k.T
        out.append(ends[:, :2] / ends[:, 2:3])
    return np.array(out).reshape(-1, 2, 2)


def to_base_link(path_map: np.ndarray, x: float, y: float, yaw: float) -> np.ndarray:
    """(P, 3) rows of (t, map x, map y) -> (t, x, y) in the base_link frame of the pose (x, y, yaw)."""
    c, s = math.cos(yaw), math.sin(yaw)
    dx, dy = path_map[:, 1] - x, path_map[:, 2] - y
    return np.stack([path_map[:, 0], c * dx + s * dy, -s * dx + c * dy], axis=1)


# ---------------------------------------------------------------------------------------- recorded data
@dataclass
class FrameRecord:
    """One frame as the replay saw it (stamp = camera stamp, ns)."""

    stamp_ns: int
    timing: FrameTiming | None  # the suffix node's ~/debug/frame_timing of the frame (ros/status.py), None: none
    path: np.ndarray | None = None  # (P, 3): time_from_start (s), x, y (m) in base_link at the camera stamp
    sent_s: float | None = None  # CLOCK_MONOTONIC (s): the replay published the frame's last image
    received_s: float | None = None  # CLOCK_MONOTONIC (s): the replay received the trajectory
    #: (Q, 3): the drive the bag logged after the stamp, time from the stamp (s), x, y (m) in the same base_link
    logged: np.ndarray | None = None


@dataclass
class CameraView:
    """The highlighted frame's image of one camera with what projecting into it takes."""

    name: str
    stamp_ns: int
    image: np.ndarray  # (H, W, 3) uint8 RGB
    k: np.ndarray  # 3x3, for this image's size
    frame_id: str
    extrinsics: Extrinsics | None  # None: no base_link -> camera transform known (note says why)
    note: str = ""


@dataclass
class PlotData:
    frames: list[FrameRecord]  # in stamp order
    highlight: int | None = None  # index into frames of the frame drawn on the camera and highlighted
    camera: CameraView | None = None
    camera_note: str = ""  # why camera is None
    caption: str = ""  # e.g. the split layer
    random_init: bool = True
    end_to_end_ms: list[float] = field(default_factory=list)
    #: Frames the replay sent that got no trajectory: camera stamp (ns) -> CLOCK_MONOTONIC (s) of the send.
    unanswered: dict[int, float] = field(default_factory=dict)
    #: The open-loop figures of each trajectory compared (:class:`~hybrid_vla_ros.vehicle.open_loop.FrameErrors`);
    #: None: the bag has no usable logged drive.
    open_loop: list | None = None
    #: What the logged drive was, for the picture's title (e.g. "3 odometry samples over 2.001 s").
    open_loop_source: str = ""


def _nearest(keys, stamp: int, tolerance_ns: float):
    best = min(keys, key=lambda k: abs(k - stamp), default=None)
    return None if best is None or abs(best - stamp) > tolerance_ns else best


def collect(*, timings: dict, paths: dict, received: dict, sent: dict, odometry: list, camera_images: dict,
            bag_messages: list, tolerance_ns: float, extrinsics_yaml: str | Path | None, caption: str = "",
            random_init: bool = True, unanswered: dict | None = None, logged: dict | None = None) -> PlotData:
    """Build the :class:`PlotData` of a replay.

    ``timings`` / ``paths`` / ``received`` / ``sent``: by trajectory stamp, as the replay recorded them (paths
    in map: rows of time_from_start, x, y). ``odometry``: the EgoStates played (for the heading that turns a
    map path back into base_link; its position is the path's first point, the ego pose the suffix used).
    ``camera_images``: played stamp -> bag message (topic, msgtype, raw CDR) of the first camera;
    ``bag_messages``: the whole bag, for that camera's CameraInfo and /tf_static. ``unanswered``: frames sent
    that got no trajectory, camera stamp (ns) -> send time (s, CLOCK_MONOTONIC); the timeline marks them.
    ``logged``: by trajectory stamp, the drive the bag logged after it (rows of time from the stamp, map x, y:
    :func:`~hybrid_vla_ros.vehicle.open_loop.logged_future`), placed in the same base_link as the trajectory.
    """
    from ..vehicle.odometry import OdometryBuffer

    buffer = OdometryBuffer(maxlen=len(odometry) + 1, jump_back_ns=1 << 62)
    for ego in odometry:
        buffer.add(ego)
    frames = []
    logged = logged or {}
    for stamp in sorted(set(timings) | set(paths)):
        path, drive = paths.get(stamp), logged.get(stamp)
        if path is not None and len(path):
            try:
                ego, _ = buffer.pose_at(stamp, 1_000_000_000)
                origin = path[0, 1], path[0, 2]  # the ego pose the suffix placed the trajectory with
                path = to_base_link(path, *origin, ego.yaw)
                drive = to_base_link(drive, *origin, ego.yaw) if drive is not None and len(drive) else None
            except LookupError:
                path = drive = None  # no heading for this frame
        else:
            path = drive = None
        frames.append(FrameRecord(stamp, timings.get(stamp), path, sent.get(stamp), received.get(stamp), drive))
    e2e = [(f.received_s - f.sent_s) * 1e3 for f in frames if f.received_s is not None and f.sent_s is not None]
    data = PlotData(frames, caption=caption, random_init=random_init, end_to_end_ms=e2e,
                    unanswered=dict(unanswered or {}))
    # a frame whose trajectory starts where the log says the car was (not one placed across a looped replay's jump)
    placed = [i for i, f in enumerate(frames) if f.path is not None and f.logged is not None
              and float(np.hypot(*(f.logged[0, 1:3] - f.path[0, 1:3]))) < 0.05]
    with_path = placed or [i for i, f in enumerate(frames) if f.path is not None]
    with_image = [i for i in with_path if _nearest(camera_images, frames[i].stamp_ns, tolerance_ns) is not None]
    candidates = with_image or with_path
    if candidates and placed:  # the longest logged drive shows most of the drive
        data.highlight = max(candidates, key=lambda i: frames[i].logged[-1, 0])
    elif candidates:
        data.highlight = candidates[len(candidates) // 2]
    if not with_image:
        data.camera_note = "no camera image of a frame with a trajectory"
        return data
    stamp = frames[data.highlight].stamp_ns
    message = camera_images[_nearest(camera_images, stamp, tolerance_ns)]
    try:
        data.camera = camera_view(message, stamp, bag_messages, extrinsics_yaml)
    except (LookupError, ValueError, OSError) as e:
        data.camera_note = str(e)
    return data


def camera_view(message, stamp_ns: int, bag_messages: list, extrinsics_yaml: str | Path | None) -> CameraView:
    """Decode a bag image message and find its CameraInfo (``<camera>/camera_info`` next to the image topic)
    and base_link -> camera transform (/tf_static of the bag, else ``extrinsics_yaml`` when it names this
    camera's frame). Raises LookupError when the bag has no CameraInfo for it, ValueError for bad data."""
    from rosbags.typesys import Stores, get_typestore

    from ..vehicle.image import compressed_msg_to_rgb, image_msg_to_rgb

    store = get_typestore(Stores.ROS2_KILTED)
    msg = store.deserialize_cdr(message.raw, message.msgtype)
    image = compressed_msg_to_rgb(msg) if message.msgtype.endswith("CompressedImage") else image_msg_to_rgb(msg)
    image_topic = message.topic.removesuffix("/compressed")
    info_topic = image_topic.rsplit("/", 1)[0] + "/camera_info"
    infos = [m for m in bag_messages if m.topic == info_topic]
    if not infos:
        raise LookupError(f"the bag has no {info_topic} (CameraInfo) for the intrinsics")
    info = store.deserialize_cdr(infos[0].raw, infos[0].msgtype)
    k = np.asarray(info.k, dtype=np.float64).reshape(3, 3)
    if not np.isfinite(k).all() or k[0, 0] <= 0 or k[1, 1] <= 0:
        raise ValueError(f"{info_topic} has no usable K: {k.ravel().tolist()}")
    h, w = image.shape[:2]
    if info.width and info.height and (info.width, info.height) != (w, h):  # e.g. a downscaled image_raw
        k = np.diag([w / info.width, h / info.height, 1.0]) @ k
    frame_id = info.header.frame_id or msg.header.frame_id
    name = image_topic.split("/")[-2] if image_topic.count("/") >= 2 else image_topic
    transforms = []
    for m in bag_messages:
        if m.topic == "/tf_static":
            for t in store.deserialize_cdr(m.raw, m.msgtype).transforms:
                tr, q = t.transform.translation, t.transform.rotation
                transforms.append((t.header.frame_id, t.child_frame_id,
                                   rigid_transform((tr.x, tr.y, tr.z), (q.x, q.y, q.z, q.w))))
    extrinsics, note = extrinsics_from_tf(transforms, "base_link", frame_id, "the bag's /tf_static"), ""
    if extrinsics is None and extrinsics_yaml is not None:
        candidate = load_extrinsics_yaml(extrinsics_yaml)
        if candidate.child.lstrip("/") == frame_id.lstrip("/") and candidate.parent.lstrip("/") == "base_link":
            extrinsics = candidate
        else:
            note = (f"no base_link -> {frame_id} transform: the bag has no /tf_static for it and "
                    f"{candidate.source} describes {candidate.child}")
    elif extrinsics is None:
        note = f"no base_link -> {frame_id} transform in the bag's /tf_static"
    return CameraView(name, stamp_ns, image, k, frame_id, extrinsics, note)


# -------------------------------------------------------------------------------------------- drawing
def _figure(name: str) -> Figure:
    fig = Figure(figsize=FIGSIZE_IN[name], dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _stamp_label(stamp_ns: int) -> str:
    return f"stamp {stamp_ns / 1e9:.3f} s"


def _model_note(data: PlotData) -> str:
    parts = [RANDOM_NOTE if data.random_init else "", data.caption]
    return " | ".join(p for p in parts if p)


def draw_camera(data: PlotData) -> Figure:
    """``trajectory_camera.png``: the highlighted frame's trajectory over its front camera image."""
    fig = _figure("trajectory_camera.png")
    ax = fig.add_subplot()
    cam = data.camera
    if cam is None:
        ax.text(0.5, 0.5, f"no camera picture: {data.camera_note}", ha="center", va="center", wrap=True)
        ax.set_axis_off()
        fig.suptitle("Trajectory on the front camera", fontsize=15)
        return fig
    h, w = cam.image.shape[:2]
    ax.imshow(cam.image, extent=(0, w, h, 0), interpolation="antialiased")
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_xlabel("u (px)")
    ax.set_ylabel("v (px)")
    frame = data.frames[data.highlight]
    where = f"frame {data.highlight} of {len(data.frames)}, {_stamp_label(frame.stamp_ns)}"
    fig.suptitle(f"Planned trajectory projected on {cam.name} ({where})", fontsize=15)
    source = "extrinsics: none" if cam.extrinsics is None else f"base_link -> camera from {cam.extrinsics.source}"
    subtitle = [_model_note(data), f"K from {cam.name}/camera_info, {source}"]
    if cam.extrinsics is not None:
        _draw_ground_grid(ax, cam)
    if cam.extrinsics is not None and frame.logged is not None:
        drive = np.column_stack([frame.logged[:, 1:3], np.zeros(len(frame.logged))])
        ax.add_collection(LineCollection(visible_segments(drive, cam.extrinsics.matrix, cam.k), colors=LOGGED_COLOR,
                                         linewidths=3, linestyles="--", zorder=3,
                                         label=f"logged drive (odometry), 0 .. {frame.logged[-1, 0]:.1f} s"))
        uv, ahead = project_points(drive, cam.extrinsics.matrix, cam.k)
        seen = int((ahead & (uv[:, 0] >= 0) & (uv[:, 0] < w) & (uv[:, 1] >= 0) & (uv[:, 1] < h)).sum())
        moved = float(np.hypot(*(frame.logged[-1, 1:3] - frame.logged[0, 1:3])))
        logged_note = f"logged drive (to {frame.logged[-1, 0]:.1f} s, {moved:.1f} m): {seen} of {len(drive)} in view"
    else:
        logged_note = ""
    if cam.extrinsics is not None and frame.path is not None:
        points = np.column_stack([frame.path[:, 1:3], np.zeros(len(frame.path))])  # on the ground, z = 0
        segments = visible_segments(points, cam.extrinsics.matrix, cam.k)
        ax.add_collection(LineCollection(segments, colors="#00e5ff", linewidths=3, zorder=3))
        uv, in_front = project_points(points, cam.extrinsics.matrix, cam.k)
        inside = in_front & (uv[:, 0] >= 0) & (uv[:, 0] < w) & (uv[:, 1] >= 0) & (uv[:, 1] < h)
        ax.scatter(uv[inside, 0], uv[inside, 1], s=60, c="#00e5ff", edgecolors="black", linewidths=1.2, zorder=4,
                   label="trajectory point (time from the camera stamp)" if inside.any() else None)
        _place_labels(ax, [(u, v, f"{t:.1f} s") for (u, v), t in zip(uv[inside], frame.path[inside, 0])],
                      color="white", fontsize=12, fontweight="bold", path_effects=_OUTLINE, zorder=5)
        behind, off = int((~in_front).sum()), int((in_front & ~inside).sum())
        counts = [f"trajectory points (t = 0 .. {frame.path[-1, 0]:.1f} s): {int(inside.sum())} in view"]
        if behind:
            counts.append(f"{behind} behind the camera, not drawn")
        if off:
            counts.append(f"{off} outside the image")
        subtitle.append("; ".join(counts + ([logged_note] if logged_note else [])))
        if not inside.any():
            ax.text(w / 2, h * 0.25, "no trajectory point lies in front of the camera:\n"
                    f"all {len(points)} are within {np.abs(frame.path[:, 1:3]).max():.1f} m of base_link "
                    "(the rear axle); see trajectory_bev.png", ha="center", va="center", fontsize=14,
                    color="white", fontweight="bold", path_effects=_OUTLINE, zorder=6)
        ax.legend(loc="upper right", fontsize=10, facecolor="#303030", labelcolor="white", framealpha=0.8)
    else:
        subtitle.append(cam.note or "this frame has no trajectory")
    ax.set_title("\n".join(subtitle), fontsize=11)
    return fig


def _place_labels(ax, items, **style) -> None:
    """Annotate (x, y, text) items in order next to their points, leaving out any whose text would overlap
    the text of one already placed (measured in pixels on the laid-out figure)."""
    if not items:
        return
    fig = ax.get_figure()
    fig.canvas.draw()  # lay the figure out so that text extents are final
    renderer = fig.canvas.get_renderer()
    placed = []
    for x, y, text in items:
        label = ax.annotate(text, (x, y), xytext=(8, -14), textcoords="offset points", **style)
        box = label.get_window_extent(renderer).expanded(1.1, 1.2)
        if any(box.overlaps(other) for other in placed):
            label.remove()
        else:
            placed.append(box)


def _draw_ground_grid(ax, cam: CameraView) -> None:
    """Dashed reference lines on the ground (base_link z = 0): a lane of GROUND_GRID_Y_M, distances GROUND_GRID_X_M."""
    far = max(GROUND_GRID_X_M)
    lines = [((x, -6.0), (x, 6.0)) for x in GROUND_GRID_X_M] + [((0.0, y), (far, y)) for y in GROUND_GRID_Y_M]
    for n, ((xa, ya), (xb, yb)) in enumerate(lines):
        seg = visible_segments([(xa, ya, 0.0), (xb, yb, 0.0)], cam.extrinsics.matrix, cam.k)
        label = (f"ground (base_link z = 0): x = {', '.join(f'{x:g}' for x in GROUND_GRID_X_M)} m, "
                 f"y = {', '.join(f'{y:+g}' for y in GROUND_GRID_Y_M)} m") if n == 0 else None
        ax.add_collection(LineCollection(seg, colors="white", linewidths=1.2, linestyles="--", alpha=0.8,
                                         zorder=2, label=label))
    h, w = cam.image.shape[:2]
    for x in GROUND_GRID_X_M:
        (u, v), ok = (a[0] for a in project_points([(x, GROUND_GRID_Y_M[-1] + 0.3, 0.0)], cam.extrinsics.matrix,
                                                   cam.k))
        if ok and 0 <= u < w and 0 <= v < h:
            ax.annotate(f"{x:g} m", (u, v), xytext=(-4, 3), textcoords="offset points", ha="right", color="white",
                        fontsize=10, path_effects=_OUTLINE, zorder=5)


def _grid_step(extent_m: float) -> float:
    for step in (1.0, 2.0, 5.0, 10.0, 20.0, 50.0):
        if extent_m / step <= 16:
            return step
    return 100.0


def draw_bev(data: PlotData) -> Figure:
    """``trajectory_bev.png``: all frames' trajectories in base_link, one highlighted, ego box, metres grid."""
    fig = _figure("trajectory_bev.png")
    ax = fig.add_subplot()
    x0, x1, half = EGO_BOX_M
    ax.add_patch(Rectangle((-half, x0), 2 * half, x1 - x0, facecolor="#ececec", edgecolor="black", lw=1.5,
                           zorder=2, label="ego vehicle; + is base_link (rear axle)"))
    ax.plot([0], [0], marker="+", color="black", ms=12, mew=2, zorder=3)
    xs, ys = [x0, x1], [-half, half]
    paths = [(i, f.path) for i, f in enumerate(data.frames) if f.path is not None]
    for n, (i, path) in enumerate(p for p in paths if p[0] != data.highlight):
        ax.plot(path[:, 2], path[:, 1], color="#7f7f7f", alpha=0.35, lw=1.2, marker="o", ms=2.5, zorder=3,
                label="other frames" if n == 0 else None)
    for _, path in paths:
        xs += list(path[:, 1])
        ys += list(path[:, 2])
    if data.highlight is not None and data.frames[data.highlight].logged is not None:
        xs += list(data.frames[data.highlight].logged[:, 1])
        ys += list(data.frames[data.highlight].logged[:, 2])
    cam = data.camera
    if cam is not None and cam.extrinsics is not None:
        m = cam.extrinsics.matrix
        cx, cy = m[0, 3], m[1, 3]
        reach = max(6.0, 1.2 * max(abs(v) for v in xs + ys))
        w = cam.image.shape[1]
        for u, lab in ((0.0, f"{cam.name} field of view"), (float(w), None)):
            ray = m[:3, :3] @ np.linalg.solve(cam.k, [u, cam.k[1, 2], 1.0])
            ray = ray / max(np.hypot(ray[0], ray[1]), 1e-9)
            ax.plot([cy, cy + reach * ray[1]], [cx, cx + reach * ray[0]], color="#1f77b4", ls="--", lw=1,
                    zorder=1, label=lab)
        ax.plot([cy], [cx], ls="none", marker="^", color="#1f77b4", ms=8, zorder=4, label=cam.name)
    pad = 1.5
    lo_x, hi_x = min(xs) - pad, max(xs) + pad
    lo_y, hi_y = min(ys) - pad, max(ys) + pad
    span = max(hi_x - lo_x, (hi_y - lo_y) * 10 / 9, 8.0)  # the axes are about 9 wide by 10 high
    drive = data.frames[data.highlight].logged if data.highlight is not None else None
    if drive is not None:
        ax.plot(drive[:, 2], drive[:, 1], color=LOGGED_COLOR, lw=2.5, ls="--", zorder=4,
                label=f"frame {data.highlight}: the drive the bag logged, 0 .. {drive[-1, 0]:.1f} s")
    if data.highlight is not None and data.frames[data.highlight].path is not None:
        path = data.frames[data.highlight].path
        ax.plot(path[:, 2], path[:, 1], color="#d62728", lw=2.5, marker="o", ms=6, zorder=5,
                label=f"frame {data.highlight} (the camera picture's), times from its stamp")
        bev_labels = [(y, x, f"{t:.1f} s") for t, x, y in path[1:]]
    else:
        bev_labels = []
    mid_x, mid_y = (lo_x + hi_x) / 2, (lo_y + hi_y) / 2
    ax.set_ylim(mid_x - span / 2, mid_x + span / 2)
    ax.set_xlim(mid_y + span * 0.45, mid_y - span * 0.45)  # y left: +y on the left of the page
    ax.set_aspect("equal", adjustable="box")
    step = _grid_step(span)
    ax.xaxis.set_major_locator(MultipleLocator(step))
    ax.yaxis.set_major_locator(MultipleLocator(step))
    ax.grid(True, color="#e0e0e0", zorder=0)
    ax.set_axisbelow(True)
    ax.set_xlabel("y, left (m)")
    ax.set_ylabel("x, forward (m)")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=10, frameon=False)
    _place_labels(ax, bev_labels, color="#d62728", fontsize=10, fontweight="bold", zorder=6)
    n = len(paths)
    fig.suptitle(f"Bird's-eye view in base_link: {n} planned trajectories", fontsize=15)
    ax.set_title(f"{_model_note(data)}\nwaypoints in the ego frame at each camera stamp, grid {step:g} m",
                 fontsize=10)
    return fig


def _intervals(f: FrameRecord, origin_ns: int) -> dict[str, tuple[float, float]] | None:
    """Stage name -> (start, end) in seconds since ``origin_ns``, from the frame's instants; None without them."""
    t = f.timing
    if t is None:
        return None
    instants = (t.t_prefix_start_ns, t.t_write_start_ns, t.t_ready_ns, t.t_suffix_end_ns, t.t_publish_ns)
    if not all(instants):
        return None
    start, write, ready, end, publish = ((x - origin_ns) / 1e9 for x in instants)
    pre_end = start + _ms_or_0(t.preprocess_ms) / 1e3
    out = {
        "preprocess": (start, pre_end),
        "prefix": (pre_end, pre_end + _ms_or_0(t.prefix_ms) / 1e3),
        "handoff": (write, ready),
        "suffix": (ready, end),
        "output_wait": (end, publish),
    }
    # an ego-state model's prefix waits for the odometry at the camera stamp before it starts (its own stage)
    ego = _ms_or_0(t.ego_wait_ms) / 1e3
    if ego > 0:
        out["ego_wait"] = (start - ego, start)
    if f.sent_s is not None:
        sent = f.sent_s - origin_ns / 1e9
        out["input_wait"] = (sent, max(sent, start - ego))
    if f.received_s is not None:
        out["received"] = (f.received_s - origin_ns / 1e9,) * 2
    return out


def _ms_or_0(ms: float) -> float:
    """A stage time (ms) for a bar, 0 where the producer did not time it (NaN)."""
    return 0.0 if ms != ms else ms


def cross_frame_overlap_s(a: dict, b: dict) -> float:
    """Seconds during which the prefix of the later frame ``b`` (preprocess start .. ring write) ran while the
    suffix of ``a`` computed (view ready .. suffix end); 0 when they did not overlap."""
    start = max(b["preprocess"][0], a["suffix"][0])
    end = min(b["handoff"][0], a["suffix"][1])
    return max(0.0, end - start)


def _draw_bars(ax, rows: list[int], ivs: list[dict], scale: float, offset: float) -> None:
    def barh(key, color, **kw):
        left = [(iv[key][0] - offset) * scale for iv in ivs if key in iv]
        width = [(iv[key][1] - iv[key][0]) * scale for iv in ivs if key in iv]
        y = [r for r, iv in zip(rows, ivs) if key in iv]
        ax.barh(y, width, left=left, height=0.7, color=color, linewidth=0, **kw)

    barh("input_wait", INPUT_WAIT[1])
    barh("ego_wait", EGO_WAIT[1])
    for key, _, color in STAGE_STYLE:
        barh(key, color)
    barh("output_wait", OUTPUT_WAIT[1])
    got = [((iv["received"][0] - offset) * scale, r) for r, iv in zip(rows, ivs) if "received" in iv]
    if got:  # the marker shrinks with the row height
        size = float(np.clip(170 / (max(rows) - min(rows) + 1), 3, 11))
        ax.plot(*zip(*got), ls="none", marker="|", ms=size, mew=min(2.0, size / 4), color="black", zorder=5)


_BAR_NAMES = {"input_wait": "DDS, sync, queue", "ego_wait": "ego wait", "handoff": "hand-off",
              "output_wait": "odometry wait"}


def _label_bars(ax, rows: list[int], ivs: list[dict], t0: float) -> None:
    """Write each stage's duration (ms) inside its bar in the zoom, where the bar is wide enough."""
    lo, hi = ax.get_xlim()
    for row, iv in zip(rows, ivs):
        for key in ("input_wait", "ego_wait", *(k for k, _, _ in STAGE_STYLE), "output_wait"):
            if key not in iv:
                continue
            a, b = ((v - t0) * 1e3 for v in iv[key])
            name = _BAR_NAMES.get(key, key)
            if b - a > 0.012 * (hi - lo) * max(len(name), 7):
                ax.text((a + b) / 2, row, f"{name}\n{b - a:.1f} ms", ha="center", va="center",
                        fontsize=9, color="black" if key.endswith("wait") else "white", clip_on=True)


def draw_timeline(data: PlotData) -> Figure:
    """``timeline.png``: per-frame stage bars over wall time, whole run and a zoom on a few frames."""
    fig = _figure("timeline.png")
    timed = [(i, f) for i, f in enumerate(data.frames) if f.timing is not None and f.timing.t_prefix_start_ns]
    if not timed:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no frame timing with CLOCK_MONOTONIC instants was recorded", ha="center", va="center")
        ax.set_axis_off()
        fig.suptitle("Pipeline timeline", fontsize=15)
        return fig
    starts = [f.timing.t_prefix_start_ns for _, f in timed] + [int(f.sent_s * 1e9) for _, f in timed if f.sent_s]
    starts += [int(t * 1e9) for t in data.unanswered.values()]
    origin = min(starts)
    # one row per frame in stamp order, those without a trajectory included (a gap with a mark)
    row_of = {stamp: r for r, stamp in enumerate(sorted({f.stamp_ns for f in data.frames} | set(data.unanswered)))}
    rows, ivs = [], []
    for _, f in timed:
        iv = _intervals(f, origin)
        if iv is not None:
            rows.append(row_of[f.stamp_ns])
            ivs.append(iv)
    lost = sorted((row_of[stamp], t - origin / 1e9) for stamp, t in data.unanswered.items())
    overlaps = [cross_frame_overlap_s(a, b) for a, b in zip(ivs, ivs[1:])]
    n_overlap = sum(o > 0 for o in overlaps)
    top, bottom = fig.subplots(2, 1, height_ratios=[3, 2])

    _draw_bars(top, rows, ivs, 1.0, 0.0)
    if lost:
        top.plot([t for _, t in lost], [r for r, _ in lost], ls="none", marker="x", ms=7, mew=1.5,
                 color=LOST_COLOR, zorder=5)
    all_rows = rows + [r for r, _ in lost]
    top.set_ylim(max(all_rows) + 0.8, min(all_rows) - 0.8)
    top.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=12))
    top.set_xlabel("wall time since the first frame's images were sent (s, CLOCK_MONOTONIC)")
    top.set_ylabel("frame (stamp order)")
    top.grid(True, axis="x", color="#e6e6e6")
    top.set_axisbelow(True)
    top.set_title(f"all {len(rows)} frames with a trajectory" + (
        f"; x: {len(lost)} sent that got none (the report's drops say why)" if lost else ""), fontsize=11, loc="left")

    if n_overlap:
        j = int(np.argmax(overlaps))
        window = list(range(max(0, j - 1), min(len(ivs), j + 3)))
        what = (f"zoom: frames {rows[window[0]]}..{rows[window[-1]]}, the largest overlap "
                f"({overlaps[j] * 1e3:.1f} ms, frame {rows[j + 1]} prefix || frame {rows[j]} suffix) shaded")
    else:
        latency = [iv["output_wait"][1] - iv["preprocess"][0] for iv in ivs]
        window = [int(np.argsort(latency)[len(latency) // 2])]
        what = f"zoom: frame {rows[window[0]]} (median latency), stage by stage"
    sub = [ivs[w] for w in window]
    t0 = min(min(v[0] for v in iv.values()) for iv in sub)
    _draw_bars(bottom, [rows[w] for w in window], sub, 1e3, t0)
    for w in window:
        if w + 1 in window and overlaps[w] > 0:
            a, b = ivs[w], ivs[w + 1]
            lo = (max(b["preprocess"][0], a["suffix"][0]) - t0) * 1e3
            bottom.axvspan(lo, lo + overlaps[w] * 1e3, color="#ffd54f", alpha=0.45, zorder=0)
    bottom.set_ylim(max(rows[w] for w in window) + 0.8, min(rows[w] for w in window) - 0.8)
    bottom.set_yticks([rows[w] for w in window])
    _label_bars(bottom, [rows[w] for w in window], sub, t0)
    bottom.set_xlabel("time since the start of the zoom (ms)")
    bottom.set_ylabel("frame")
    bottom.grid(True, axis="x", color="#e6e6e6")
    bottom.set_axisbelow(True)
    bottom.set_title(what, fontsize=11, loc="left")

    handles = [Patch(color=INPUT_WAIT[1], label=INPUT_WAIT[0])]
    if any("ego_wait" in iv for iv in ivs):
        handles.append(Patch(color=EGO_WAIT[1], label=EGO_WAIT[0]))
    handles += [Patch(color=c, label=lab) for _, lab, c in STAGE_STYLE]
    handles += [Patch(color=OUTPUT_WAIT[1], label=OUTPUT_WAIT[0])]
    handles += [top.plot([], [], ls="none", marker="|", ms=11, mew=2, color="black",
                         label="trajectory received by the replay")[0]]
    if lost:
        handles.append(top.plot([], [], ls="none", marker="x", ms=7, mew=1.5, color=LOST_COLOR,
                                label="frame sent, no trajectory")[0])
    if n_overlap:
        handles.append(Patch(color="#ffd54f", alpha=0.45, label="prefix t+1 overlaps suffix t"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=10, frameon=False)
    pairs = len(overlaps)
    fig.suptitle(f"Pipeline timeline: the prefix of frame t+1 overlapped the suffix of frame t in {n_overlap} of "
                 f"{pairs} consecutive frame pairs" + (f"\n{data.caption}" if data.caption else ""), fontsize=14)
    return fig


def draw_latency(data: PlotData) -> Figure:
    """``latency_hist.png``: histograms of per-stage and end-to-end latency (ms), p50 and p90 marked."""
    fig = _figure("latency_hist.png")
    panels = [(key, label, color) for key, label, color in STAGE_STYLE]
    panels.append(("odometry_wait", "odometry wait (suffix, before publishing)", OUTPUT_WAIT[1]))
    panels.append(("end_to_end", "end to end (last image sent -> trajectory received)", "#555555"))
    axes = fig.subplots(2, 3).ravel()
    for ax, (key, label, color) in zip(axes, panels):
        if key == "end_to_end":
            values = np.asarray(data.end_to_end_ms, dtype=np.float64)
        else:
            values = np.asarray([f.timing.stage_ms()[key] for f in data.frames if f.timing is not None],
                                dtype=np.float64)
        values = values[np.isfinite(values)]
        ax.set_title(f"{label}\nn = {values.size}", fontsize=10)
        ax.set_xlabel("latency (ms)")
        ax.set_ylabel("frames")
        if not values.size:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        bins = int(np.clip(np.sqrt(values.size) * 2, 5, 40))
        ax.hist(values, bins=bins, color=color, edgecolor="white")
        p50, p90 = np.percentile(values, [50, 90])
        ax.axvline(p50, color="black", ls="--", lw=1.5, label=f"p50 {p50:.2f} ms")
        ax.axvline(p90, color="black", ls=":", lw=1.8, label=f"p90 {p90:.2f} ms")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom for the legend
        ax.legend(fontsize=9, loc="upper right")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, axis="y", color="#e6e6e6")
        ax.set_axisbelow(True)
    n = len(data.frames)
    fig.suptitle(f"Latency per frame ({n} frames)" + (f", {data.caption}" if data.caption else ""), fontsize=15)
    return fig


#: The horizons ``open_loop.png`` draws, with their colours.
OPEN_LOOP_HORIZONS = (("1s", "#1f77b4"), ("2s", "#ff7f0e"), ("3s", "#2ca02c"))


def draw_open_loop(data: PlotData) -> Figure:
    """``open_loop.png``: per frame against its stamp (s from the first frame), the ADE (top) and FDE (bottom) at
    1, 2 and 3 s against the logged drive (:mod:`~hybrid_vla_ros.vehicle.open_loop`); a horizon a frame does not
    reach is not drawn for it (the legend counts the frames that reach each), never drawn as 0."""
    fig = _figure("open_loop.png")
    top, bottom = fig.subplots(2, 1, sharex=True)
    frames = sorted(data.open_loop or [], key=lambda f: f.stamp_ns)
    if not frames:
        why = "the bag has no usable odometry" if data.open_loop is None else "no trajectory was compared"
        for ax in (top, bottom):
            ax.text(0.5, 0.5, f"no open-loop figures: {why}", ha="center", va="center", transform=ax.transAxes)
    t0 = frames[0].stamp_ns if frames else 0
    for ax, key, what in ((top, "ade_m", "ADE"), (bottom, "fde_m", "FDE")):
        for name, color in OPEN_LOOP_HORIZONS:
            pts = [((f.stamp_ns - t0) / 1e9, getattr(f.horizons[name], key)) for f in frames if name in f.horizons]
            if pts:
                t, v = zip(*pts)
                ax.plot(t, v, color=color, marker="o", ms=5, lw=1.2, label=f"{what} at {name} ({len(pts)} frames)")
        ax.set_ylabel(f"{what} (m)")
        ax.set_ylim(bottom=0)
        ax.grid(True, color="#e6e6e6")
        ax.set_axisbelow(True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=10, loc="upper right")
    bottom.set_xlabel("camera stamp (s from the first frame compared)")
    reached = ", ".join(f"{name}: {sum(name in f.horizons for f in frames)}" for name, _ in OPEN_LOOP_HORIZONS)
    fig.suptitle(f"Open loop: the published trajectories against the drive the bag logged "
                 f"({data.open_loop_source or 'none'})", fontsize=14)
    top.set_title(f"{_model_note(data)}\nframes reaching each horizon: {reached or '-'} (autoware_planning_data_"
                  "analyzer's definitions; a horizon not covered is left out, not drawn as 0)", fontsize=10)
    return fig


DRAW = {
    "trajectory_camera.png": draw_camera,
    "trajectory_bev.png": draw_bev,
    "timeline.png": draw_timeline,
    "latency_hist.png": draw_latency,
    "open_loop.png": draw_open_loop,
}


def write_all(data: PlotData, directory: str | Path) -> list[Path]:
    """Draw every picture into ``directory`` (created); returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in DRAW.items():
        fig = draw(data)
        path = directory / name
        fig.savefig(path, dpi=DPI)
        written.append(path)
    return written
