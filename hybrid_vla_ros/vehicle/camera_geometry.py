"""The camera geometry the published query heads need (``lidar2img`` per camera), from what a ROS vehicle provides:
each camera's ``sensor_msgs/CameraInfo`` and the static transforms from ``base_link`` to the cameras' optical frames
(``/tf_static``).

Frames: ``base_link`` x forward, y left, z up (Autoware: rear axle centre on the ground); a camera's optical
frame (``CameraInfo.header.frame_id``) x right, y down, z forward; the **model frame** is the published models'
Bench2Drive lidar frame, x right, y forward, z up, placed by :class:`ModelFrame` (with base_link at the rear axle
its origin is about (wheelbase / 2 - 0.39, 0, 1.84) m).

``lidar2img`` of camera i = K'_i (4 x 4) @ inverse(T(base_link <- optical_i)) @ T(base_link <- model), K'_i the
model image's camera matrix (:func:`model_image_intrinsics`), as the published pipeline builds it from
``cam_intrinsic`` and ``lidar2cam``. No ROS imports: readers take any object with the message's fields.
"""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass

import numpy as np

from ..util.image_filters import RESIZE_FILTERS
from .image import orion_crop_geometry

#: Rotation of the model frame in base_link; columns are the model axes (x = -y_base, y = x_base, z = z_base).
MODEL_AXES_IN_BASE_LINK = np.array([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
#: The published lidar (model frame origin) from the vehicle's centre on the ground, m, base_link axes
#: (Bench2Drive's ``lidar2ego``).
PUBLISHED_LIDAR_FROM_VEHICLE_CENTRE = (-0.39, 0.0, 1.84)


@dataclass(frozen=True)
class ModelFrame:
    """The model frame's pose in base_link: axes :data:`MODEL_AXES_IN_BASE_LINK`, ``origin`` (x, y, z) m.
    Raises ValueError for a non-finite origin."""

    origin: tuple[float, float, float]

    def __post_init__(self) -> None:
        if len(self.origin) != 3 or not all(math.isfinite(float(v)) for v in self.origin):
            raise ValueError(f"model frame origin must be 3 finite metres (x, y, z in base_link), got {self.origin}")

    def in_base_link(self) -> np.ndarray:
        """T(base_link <- model), (4, 4) float64."""
        t = np.eye(4)
        t[:3, :3] = MODEL_AXES_IN_BASE_LINK
        t[:3, 3] = np.asarray(self.origin, dtype=np.float64)
        return t


@dataclass(frozen=True, eq=False)
class CameraIntrinsics:
    """One camera: ``k`` (3, 3) float64, CameraInfo's ``p[:3, :3]`` for the rectified ``width`` x ``height`` px
    image, and its optical ``frame_id``. Equality compares ``k`` element-wise."""

    k: np.ndarray
    width: int
    height: int
    frame_id: str

    def __eq__(self, other) -> bool:
        if not isinstance(other, CameraIntrinsics):
            return NotImplemented
        return ((self.width, self.height, self.frame_id) == (other.width, other.height, other.frame_id)
                and np.array_equal(self.k, other.k))

    __hash__ = object.__hash__


def camera_intrinsics_from_info(msg) -> CameraIntrinsics:
    """A ``sensor_msgs/msg/CameraInfo``'s *rectified* camera matrix ``p[:3, :3]`` (as image_geometry's
    PinholeCameraModel reads it; ``k``/``d`` describe the raw image), so the node needs ``image_rect``.

    Raises ValueError, naming the field, for an empty frame_id, a size <= 0, a ``p`` that is not a finite pinhole
    projection (fx, fy > 0, last row (0, 0, 1, 0)), a stereo second camera (Tx, Ty != 0), binning, a region of
    interest, or a principal point outside the image.
    """
    frame = msg.header.frame_id.strip() if isinstance(msg.header.frame_id, str) else ""
    if not frame:
        raise ValueError("camera_info has an empty header.frame_id: the camera's optical frame is needed to place it")
    width, height = msg.width, msg.height
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (width, height)):
        raise ValueError(f"camera_info of {frame}: image size {width!r} x {height!r} is not in whole pixels")
    width, height = int(width), int(height)
    if width <= 0 or height <= 0:
        raise ValueError(f"camera_info of {frame}: image size {width}x{height} (a calibration must give it)")
    p = np.asarray(list(msg.p), dtype=np.float64)
    if p.shape != (12,) or not np.isfinite(p).all():
        raise ValueError(f"camera_info of {frame}: p (the rectified image's projection) must be 12 finite values")
    p = p.reshape(3, 4)
    k = p[:, :3].copy()
    fx, fy, cx, cy = k[0, 0], k[1, 1], k[0, 2], k[1, 2]
    if fx <= 0 or fy <= 0:
        raise ValueError(f"camera_info of {frame}: focal length in p fx={fx}, fy={fy} (must be > 0; an uncalibrated "
                         "camera publishes zeros)")
    if not np.allclose(p[2], (0.0, 0.0, 1.0, 0.0)) or k[1, 0] != 0:
        raise ValueError(f"camera_info of {frame}: p is not a pinhole projection (last row {p[2].tolist()})")
    if p[0, 3] != 0 or p[1, 3] != 0:
        raise ValueError(f"camera_info of {frame}: p has Tx={p[0, 3]}, Ty={p[1, 3]}: the second camera of a stereo "
                         "pair projects from the first camera's frame; give each camera's own monocular CameraInfo")
    binning = (int(getattr(msg, "binning_x", 0) or 0), int(getattr(msg, "binning_y", 0) or 0))
    if max(binning) > 1:
        raise ValueError(f"camera_info of {frame}: binning {binning[0]} x {binning[1]} is not supported (publish the "
                         "full-resolution rectified image)")
    roi = getattr(msg, "roi", None)
    if roi is not None and (roi.width or roi.height) and \
            (roi.x_offset, roi.y_offset, roi.width, roi.height) != (0, 0, width, height):
        raise ValueError(f"camera_info of {frame}: region of interest {roi.width}x{roi.height} at ({roi.x_offset}, "
                         f"{roi.y_offset}) is not supported (publish the whole rectified image)")
    if not (0 <= cx <= width and 0 <= cy <= height):
        raise ValueError(f"camera_info of {frame}: principal point ({cx}, {cy}) outside the {width}x{height} image")
    return CameraIntrinsics(k=k, width=width, height=height, frame_id=frame)


def model_image_intrinsics(cam: CameraIntrinsics, size: int, resize: str) -> np.ndarray:
    """(3, 3) float64 camera matrix of the S x S model image after the ``image_resize`` pipeline ``resize``
    (:meth:`~hybrid_vla_ros.vehicle.image.CropResize.intrinsics`, or diag(S / width, S / height, 1) @ k)."""
    if resize not in RESIZE_FILTERS:
        raise ValueError(f"image_resize {resize!r} is not one of {', '.join(RESIZE_FILTERS)}")
    if resize == "orion_crop":
        return orion_crop_geometry(cam.height, cam.width, size).intrinsics(cam.k)
    return np.diag([size / cam.width, size / cam.height, 1.0]) @ cam.k


def _quaternion_matrix(x: float, y: float, z: float, w: float) -> np.ndarray:
    n = math.sqrt(x * x + y * y + z * z + w * w)
    if not math.isfinite(n) or abs(n - 1.0) > 1e-3:
        raise ValueError(f"rotation quaternion ({x}, {y}, {z}, {w}) is not a unit quaternion (norm {n})")
    x, y, z, w = x / n, y / n, z / n, w / n
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def transform_matrix(translation, rotation) -> np.ndarray:
    """(4, 4) float64 from a ``geometry_msgs`` translation and rotation. Raises ValueError for non-finite values
    or a quaternion norm off 1 by more than 1e-3 (within that it is normalised)."""
    t = np.array([float(translation.x), float(translation.y), float(translation.z)])
    if not np.isfinite(t).all():
        raise ValueError(f"translation {t.tolist()} is not finite")
    out = np.eye(4)
    out[:3, :3] = _quaternion_matrix(float(rotation.x), float(rotation.y), float(rotation.z), float(rotation.w))
    out[:3, 3] = t
    return out


class StaticTransforms:
    """The static transform tree of ``/tf_static`` ``tf2_msgs/TFMessage`` messages; frame names compared without a
    leading '/'. A child given again takes the newer transform, as tf2 does."""

    def __init__(self) -> None:
        self._parent: dict[str, tuple[str, np.ndarray]] = {}

    @staticmethod
    def _name(frame: str) -> str:
        return str(frame).strip().lstrip("/")

    def add(self, msg) -> tuple[int, list[str]]:
        """Add a TFMessage's transforms; returns (number added, a problem line per transform left out: empty or
        self-parent frames, bad pose). The others are still added, as tf2's buffer does."""
        added, problems = 0, []
        for tr in msg.transforms:
            try:
                parent, child = self._name(tr.header.frame_id), self._name(tr.child_frame_id)
                if not parent or not child or parent == child:
                    raise ValueError("empty or identical frame names")
                pose = transform_matrix(tr.transform.translation, tr.transform.rotation)
            except (ValueError, TypeError, AttributeError) as e:
                problems.append(f"static transform {getattr(tr.header, 'frame_id', '?')!r} -> "
                                f"{getattr(tr, 'child_frame_id', '?')!r} left out: {e}")
                continue
            self._parent[child] = (parent, pose)
            added += 1
        return added, problems

    @property
    def frames(self) -> set[str]:
        """Every frame named so far."""
        return set(self._parent) | {p for p, _ in self._parent.values()}

    def _to_root(self, frame: str) -> list[tuple[str, np.ndarray]]:
        """[(f, T(f <- frame))] for each f from ``frame`` up to its root."""
        chain, t, seen = [(frame, np.eye(4))], np.eye(4), {frame}
        while frame in self._parent:
            parent, pose = self._parent[frame]
            if parent in seen:
                raise ValueError(f"static transforms form a loop through {parent}")
            t = pose @ t  # T(parent <- source) = T(parent <- frame) @ T(frame <- source)
            frame = parent
            seen.add(frame)
            chain.append((frame, t))
        return chain

    def lookup(self, target: str, source: str) -> np.ndarray:
        """T(target <- source), (4, 4) float64. Raises LookupError when not connected, ValueError for a loop."""
        target, source = self._name(target), self._name(source)
        up_source = {f: t for f, t in self._to_root(source)}
        for frame, t_target in self._to_root(target):
            if frame in up_source:  # the lowest common frame: T(common <- target) and T(common <- source)
                return np.linalg.inv(t_target) @ up_source[frame]
        known = ", ".join(sorted(self.frames)) or "none"
        raise LookupError(f"no static transform connects {target} and {source} (frames known: {known})")


def lidar2img(cameras: list[CameraIntrinsics], tf: StaticTransforms, model: ModelFrame, size: int, resize: str,
              base_frame: str = "base_link") -> np.ndarray:
    """(C, 4, 4) float64 ``lidar2img`` (module docstring), in ``cameras`` order. Raises LookupError naming an
    unconnected camera, ValueError for no camera, an unknown ``resize`` or a camera the pipeline refuses."""
    if not cameras:
        raise ValueError("lidar2img needs at least one camera")
    base_model = model.in_base_link()
    out = []
    for i, cam in enumerate(cameras):
        try:
            base_cam = tf.lookup(base_frame, cam.frame_id)  # T(base <- optical)
        except LookupError as e:
            raise LookupError(f"camera {i} ({cam.frame_id}): {e}") from None
        k4 = np.eye(4)
        k4[:3, :3] = model_image_intrinsics(cam, size, resize)
        out.append(k4 @ np.linalg.inv(base_cam) @ base_model)
    return np.stack(out)


#: Entries of the published models' can-bus vector (MindDrive's Bench2Drive dataset, ``B2D_minddrive_Dataset``).
CAN_BUS_FIELDS = ("x", "y", "z", "qw", "qx", "qy", "qz", "vx", "vy", "vz", "ax", "ay", "az", "wx", "wy", "wz",
                  "yaw_rad", "yaw_deg")


def ego_motion_inputs(x: float, y: float, z: float, yaw: float, speed: float, accel: float, yaw_rate: float,
                      model: ModelFrame) -> tuple[np.ndarray, np.ndarray]:
    """The query heads' motion inputs from base_link's odometry-frame pose (m, rad) and its ``speed`` (m/s),
    ``accel`` (m/s^2), ``yaw_rate`` (rad/s) at the camera stamp.

    Returns float64 ``(ego_pose, can_bus)``: ``ego_pose`` (4, 4) = T(odometry <- model) (published "lidar to
    global"; roll and pitch zero, as the published yaw-only can-bus); ``can_bus`` (18,) in :data:`CAN_BUS_FIELDS`
    order, the unmeasured velocity, acceleration and rate components 0, yaw in [0, 2 pi). Raises ValueError for a
    non-finite value.
    """
    values = (x, y, z, yaw, speed, accel, yaw_rate)
    if not all(math.isfinite(float(v)) for v in values):
        raise ValueError(f"ego state has a non-finite value: {values}")
    c, s = math.cos(yaw), math.sin(yaw)
    base = np.array([[c, -s, 0.0, x], [s, c, 0.0, y], [0.0, 0.0, 1.0, z], [0.0, 0.0, 0.0, 1.0]])
    heading = yaw % (2 * math.pi)
    can_bus = np.array([x, y, z, math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2), speed, 0.0, 0.0, accel, 0.0, 0.0,
                        0.0, 0.0, yaw_rate, heading, math.degrees(heading)])
    return base @ model.in_base_link(), can_bus


#: Why a frame could not get its camera geometry (:class:`CalibrationError`'s cause), each a counted drop.
CALIBRATION_CAUSES = ("no_camera_info", "bad_camera_info", "camera_size_mismatch", "no_camera_transform",
                      "bad_camera_transform")


class CalibrationError(LookupError):
    """A frame's camera geometry cannot be made: ``args`` = (cause in :data:`CALIBRATION_CAUSES`, reason)."""

    @property
    def cause(self) -> str:
        return str(self.args[0])

    @property
    def reason(self) -> str:
        return str(self.args[1])


def check_optical_frame(base_cam: np.ndarray, frame: str) -> None:
    """Raise ValueError unless T(base_link <- camera) ``base_cam`` (4, 4) is an *optical* frame (z within 45 deg of
    horizontal, y down): a body-convention ``camera_link`` would turn the geometry by 90 degrees."""
    z_axis, y_axis = base_cam[:3, 2], base_cam[:3, 1]
    if abs(z_axis[2]) > math.sqrt(0.5) or y_axis[2] > -math.sqrt(0.5):
        raise ValueError(
            f"{frame} is not an optical frame in base_link (its z axis {np.round(z_axis, 3).tolist()} should point "
            f"out horizontally, its y axis {np.round(y_axis, 3).tolist()} down): CameraInfo's header.frame_id must "
            "name the camera's optical frame (x right, y down, z forward), e.g. camera0/camera_optical_link")


class CameraCalibration:
    """The latest CameraInfo per camera (``n_cameras``, model order) and static transforms, for each frame's
    ``lidar2img`` (``size`` px, ``resize`` = ``image_resize``).

    Thread-safe: ROS callbacks feed it, the prefix worker calls :meth:`lidar2img` (recomputed only after a
    change). An unusable CameraInfo replaces that camera's calibration until a good one comes: frames are
    dropped meanwhile, never computed with an older one.
    """

    def __init__(self, n_cameras: int, model: ModelFrame, size: int, resize: str, base_frame: str = "base_link"):
        if n_cameras < 1:
            raise ValueError(f"a camera rig has at least one camera, got {n_cameras}")
        if resize not in RESIZE_FILTERS:
            raise ValueError(f"image_resize {resize!r} is not one of {', '.join(RESIZE_FILTERS)}")
        if not str(base_frame).strip():
            raise ValueError("base_frame must name a frame")
        self.model, self.size, self.resize, self.base_frame = model, int(size), resize, str(base_frame)
        self._lock = threading.Lock()
        self._cameras: list[CameraIntrinsics | str | None] = [None] * n_cameras  # intrinsics, error text, nothing
        self._tf = StaticTransforms()
        self._version = 0  # bumped by every change of the calibration
        self._cached: tuple[int, np.ndarray | tuple[str, str]] | None = None  # lidar2img, or (cause, reason)
        self.camera_infos = 0  # CameraInfo messages read (good or bad)
        self.static_transforms = 0  # static transforms added

    def set_camera_info(self, cam: int, msg) -> str | None:
        """Take camera ``cam``'s CameraInfo; returns None when usable, else the reason."""
        try:
            new: CameraIntrinsics | str = camera_intrinsics_from_info(msg)
        except (ValueError, TypeError, AttributeError) as e:
            new = str(e)
        with self._lock:
            self.camera_infos += 1
            if self._cameras[cam] != new:
                self._cameras[cam] = new
                self._version += 1
        return new if isinstance(new, str) else None

    def add_static_transforms(self, msg) -> list[str]:
        """Add a TFMessage's transforms; returns the problem lines of :meth:`StaticTransforms.add`."""
        with self._lock:
            n, problems = self._tf.add(msg)
            self.static_transforms += n
            self._version += 1
        return problems

    def lidar2img(self, image_sizes: list[tuple[int, int] | None] | None = None) -> np.ndarray:
        """(C, 4, 4) float64 :func:`lidar2img` of the current calibration; ``image_sizes``: this frame's (width,
        height) px per camera, None where unknown. Raises :class:`CalibrationError`: ``no_camera_info``,
        ``bad_camera_info``, ``camera_size_mismatch`` (image size differs from CameraInfo's),
        ``no_camera_transform`` or ``bad_camera_transform`` (not optical, or a loop)."""
        with self._lock:
            version, cameras = self._version, list(self._cameras)
            cached = self._cached
            if cached is None or cached[0] != version:
                cached = (version, self._compute(cameras))
                self._cached = cached
        result = cached[1]
        if isinstance(result, tuple):  # a fresh exception each time: a cached one would grow its traceback
            raise CalibrationError(*result)
        for i, (cam, seen) in enumerate(zip(cameras, image_sizes or [])):
            if seen is not None and tuple(seen) != (cam.width, cam.height):
                raise CalibrationError("camera_size_mismatch", f"camera {i} ({cam.frame_id}): image {seen[0]}x"
                                       f"{seen[1]} but its camera_info describes {cam.width}x{cam.height}")
        return result

    def _compute(self, cameras: list) -> np.ndarray | tuple[str, str]:
        """lidar2img of ``cameras``, or (cause, reason) of the :class:`CalibrationError` to raise."""
        for i, cam in enumerate(cameras):
            if cam is None:
                return "no_camera_info", f"camera {i}: no camera_info received yet"
            if isinstance(cam, str):
                return "bad_camera_info", f"camera {i}: {cam}"
        for i, cam in enumerate(cameras):
            try:
                base_cam = self._tf.lookup(self.base_frame, cam.frame_id)
            except LookupError as e:
                return "no_camera_transform", f"camera {i}: {e}"
            except ValueError as e:  # the transforms form a loop
                return "bad_camera_transform", f"camera {i}: {e}"
            try:
                check_optical_frame(base_cam, cam.frame_id)
            except ValueError as e:
                return "bad_camera_transform", f"camera {i}: {e}"
        try:
            return lidar2img(cameras, self._tf, self.model, self.size, self.resize, self.base_frame)
        except ValueError as e:  # the camera pipeline cannot take a camera (orion_crop of a too small image)
            return "bad_camera_info", str(e)
