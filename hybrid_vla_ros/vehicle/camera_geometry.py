"""The camera geometry the published query heads need (``lidar2img`` per camera), from what a ROS vehicle provides:
each camera's ``sensor_msgs/CameraInfo`` and the static transforms from ``base_link`` to the cameras' optical frames
(``/tf_static``).

Frames (REP 103 / REP 105; Autoware):
  * ``base_link``: x forward, y left, z up; Autoware puts it at the rear axle's centre on the ground;
  * a camera's optical frame (``CameraInfo.header.frame_id``): x right, y down, z along the optical axis;
  * the **model frame** of the published models: their training data's lidar frame (Bench2Drive), x right,
    y forward, z up. Its pose in ``base_link`` is the rotation below and an origin the user gives
    (:class:`ModelFrame`): the published lidar sits 1.84 m above the ground and 0.39 m behind the vehicle's centre
    (Bench2Drive's ``lidar2ego``), so on a car whose base_link is the rear axle the origin is about
    (wheelbase / 2 - 0.39, 0, 1.84) m.

``lidar2img`` of camera i = K'_i (4 x 4) @ T(optical_i <- model), with K'_i the camera matrix of the *model image*
(the camera pipeline's crop and resize applied to CameraInfo's ``p[:3, :3]``; :func:`model_image_intrinsics`) and
T(optical_i <- model) = inverse(T(base_link <- optical_i)) @ T(base_link <- model). The published pipeline builds it
the same way from its dataset's ``cam_intrinsic`` and ``lidar2cam``.

No ROS imports: the readers take any object with the message's fields.
"""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass

import numpy as np

from ..util.image_filters import RESIZE_FILTERS
from .image import orion_crop_geometry

#: Rotation of the model frame's axes in base_link: model x (right) = -y_base, model y (forward) = x_base,
#: model z = z_base. Columns are the model axes written in base_link.
MODEL_AXES_IN_BASE_LINK = np.array([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
#: Where the published models' lidar (the model frame's origin) sits relative to the vehicle's centre on the
#: ground, metres, base_link axes (Bench2Drive's ``lidar2ego``: 0.39 m behind, 1.84 m up).
PUBLISHED_LIDAR_FROM_VEHICLE_CENTRE = (-0.39, 0.0, 1.84)


@dataclass(frozen=True)
class ModelFrame:
    """The model frame's pose in base_link: axes :data:`MODEL_AXES_IN_BASE_LINK`, origin ``origin`` (x, y, z)
    metres in base_link. Raises ValueError for a non-finite origin."""

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
    """One camera as its CameraInfo describes it: ``k`` (3, 3) float64, the camera matrix of the rectified
    ``width`` x ``height`` image in pixels (the CameraInfo's ``p[:3, :3]``), ``frame_id`` (the optical frame).
    Two are equal when every field is (the matrices element for element)."""

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
    """Read a ``sensor_msgs/msg/CameraInfo`` (or an object with its fields) for the camera's *rectified* image, the
    one the published models take: its camera matrix is ``p[:3, :3]`` (sensor_msgs/CameraInfo.msg: "P ... specifies
    the intrinsic (camera) matrix of the processed (rectified) image", as image_geometry's PinholeCameraModel reads
    it); ``k`` and ``d`` describe the raw image and are not used, so the node must subscribe to the rectified image
    (image_proc's ``image_rect`` / ``image_rect_color``). Raises ValueError, naming the field, for: an empty
    frame_id, a zero or negative image size, a ``p`` that is not 12 finite values of a pinhole projection (fx, fy
    > 0, last row (0, 0, 1, 0)), a stereo pair's second camera (p's Tx, Ty not 0: its projection is from the
    first camera's frame), binning or a region of interest (the image would not be the described one), or a
    principal point outside the image."""
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
    """(3, 3) float64 camera matrix of the S x S model image made from this camera by the camera pipeline
    ``resize`` (a checkpoint's ``image_resize``): ``orion_crop`` scales, crops and stretches
    (:meth:`~hybrid_vla_ros.vehicle.image.CropResize.intrinsics`); the plain resizes (``area``, ``bilinear``,
    ``bicubic``) stretch the whole image, diag(S / width, S / height, 1) @ k."""
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
    """(4, 4) float64 from a ``geometry_msgs`` translation (x, y, z) and rotation quaternion (x, y, z, w) (objects
    with those fields). Raises ValueError for non-finite values or a quaternion that is not a unit one (norm off
    by more than 1e-3; within that it is normalised)."""
    t = np.array([float(translation.x), float(translation.y), float(translation.z)])
    if not np.isfinite(t).all():
        raise ValueError(f"translation {t.tolist()} is not finite")
    out = np.eye(4)
    out[:3, :3] = _quaternion_matrix(float(rotation.x), float(rotation.y), float(rotation.z), float(rotation.w))
    out[:3, 3] = t
    return out


class StaticTransforms:
    """The static transform tree of ``tf2_msgs/TFMessage`` messages (``/tf_static``), for lookups from one frame
    to another through their common parents. Frame names are compared without a leading '/'.

    :meth:`add` takes a message's ``transforms`` (``geometry_msgs/TransformStamped``: ``header.frame_id`` the parent,
    ``child_frame_id`` the child, ``transform`` the child's pose in the parent); a child given again takes the newer
    transform (as tf2 does for static transforms). :meth:`lookup` answers T(target <- source)."""

    def __init__(self) -> None:
        self._parent: dict[str, tuple[str, np.ndarray]] = {}

    @staticmethod
    def _name(frame: str) -> str:
        return str(frame).strip().lstrip("/")

    def add(self, msg) -> tuple[int, list[str]]:
        """Add the transforms of a TFMessage; returns (how many were added, the problems of those left out). A
        transform with an empty frame name, a frame that is its own parent, or a bad translation / rotation is
        left out, named in its problem line; the message's other transforms are added (as tf2's buffer does:
        robot_state_publisher sends every fixed joint in one message)."""
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
        """Every frame named so far (parents and children)."""
        return set(self._parent) | {p for p, _ in self._parent.values()}

    def _to_root(self, frame: str) -> list[tuple[str, np.ndarray]]:
        """[(frame, T(frame's root <- frame))] along the chain from ``frame`` to its root (the root last)."""
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
        """T(target <- source), (4, 4) float64: maps points in ``source`` to ``target``. Raises LookupError naming
        the frames when they are not connected (a missing static transform) and ValueError for a loop."""
        target, source = self._name(target), self._name(source)
        up_source = {f: t for f, t in self._to_root(source)}
        for frame, t_target in self._to_root(target):
            if frame in up_source:  # the lowest common frame: T(common <- target) and T(common <- source)
                return np.linalg.inv(t_target) @ up_source[frame]
        known = ", ".join(sorted(self.frames)) or "none"
        raise LookupError(f"no static transform connects {target} and {source} (frames known: {known})")


def lidar2img(cameras: list[CameraIntrinsics], tf: StaticTransforms, model: ModelFrame, size: int, resize: str,
              base_frame: str = "base_link") -> np.ndarray:
    """(C, 4, 4) float64 ``lidar2img`` of the model images, camera order as ``cameras`` (module docstring). Raises
    LookupError naming the camera whose optical frame is not connected to ``base_frame``, ValueError for a
    camera pipeline that cannot take the camera (:func:`~hybrid_vla_ros.vehicle.image.orion_crop_geometry`), an
    unknown ``resize`` or no camera."""
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
    """The query heads' per-frame motion inputs from the vehicle's state at the camera stamp: base_link's position
    (x, y, z, metres) and heading ``yaw`` (rad, counter-clockwise from the odometry frame's +x) in the odometry
    frame, its longitudinal ``speed`` (m/s), ``accel`` (m/s^2) and ``yaw_rate`` (rad/s).

    Returns ``(ego_pose, can_bus)``, float64: ``ego_pose`` (4, 4) is T(odometry frame <- model frame) (published
    ``ego_pose``, "lidar to global": base_link's planar pose times :meth:`ModelFrame.in_base_link`; roll and pitch
    are taken as zero, as the published can-bus's yaw-only rotation does); ``can_bus`` (18,) in the published order
    (:data:`CAN_BUS_FIELDS`; MindDrive's ``B2D_minddrive_Dataset``): translation, the yaw quaternion (w, x, y, z),
    velocity, acceleration and angular rate in base_link (a ROS vehicle gives the longitudinal speed and
    acceleration and the yaw rate; the other components are 0), the yaw in [0, 2 pi) and in degrees. Raises
    ValueError for a non-finite value."""
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
    """A frame's camera geometry cannot be made: ``args`` = (cause, one of :data:`CALIBRATION_CAUSES`; the reason,
    naming the camera)."""

    @property
    def cause(self) -> str:
        return str(self.args[0])

    @property
    def reason(self) -> str:
        return str(self.args[1])


def check_optical_frame(base_cam: np.ndarray, frame: str) -> None:
    """Raise ValueError unless T(base_link <- camera frame) ``base_cam`` (4, 4) looks like an *optical* frame (x
    right, y down, z along the view; REP 103's ``_optical`` suffix): its z axis within 45 degrees of horizontal and
    its y axis pointing down. A body-convention camera frame (x forward, z up: ``camera_link`` instead of
    ``camera_optical_link``) fails, and would otherwise give a geometry turned by 90 degrees."""
    z_axis, y_axis = base_cam[:3, 2], base_cam[:3, 1]
    if abs(z_axis[2]) > math.sqrt(0.5) or y_axis[2] > -math.sqrt(0.5):
        raise ValueError(
            f"{frame} is not an optical frame in base_link (its z axis {np.round(z_axis, 3).tolist()} should point "
            f"out horizontally, its y axis {np.round(y_axis, 3).tolist()} down): CameraInfo's header.frame_id must "
            "name the camera's optical frame (x right, y down, z forward), e.g. camera0/camera_optical_link")


class CameraCalibration:
    """The latest calibration of a camera rig, for the ``lidar2img`` of each frame: one CameraInfo per camera and
    the static transforms. Thread-safe: ROS callbacks call :meth:`set_camera_info` / :meth:`add_static_transforms`,
    the prefix's worker :meth:`lidar2img`, which is computed again only after the calibration changed.

    ``n_cameras`` cameras in model order; ``model``: the model frame in ``base_frame``; ``size`` / ``resize``: the
    model image side (px) and the checkpoint's ``image_resize``. A CameraInfo that cannot be used replaces that
    camera's calibration until a good one comes (frames are dropped meanwhile, never computed with an older or
    made-up one)."""

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
        """Take camera ``cam``'s CameraInfo (:func:`camera_intrinsics_from_info`). Returns None when it is usable,
        else the reason (that camera then has no calibration until a usable one arrives). A message equal to the
        one in use changes nothing."""
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
        """Add a ``tf2_msgs/TFMessage``'s transforms (:meth:`StaticTransforms.add`); returns the problems of the
        transforms left out (one line each, [] when all were added)."""
        with self._lock:
            n, problems = self._tf.add(msg)
            self.static_transforms += n
            self._version += 1
        return problems

    def lidar2img(self, image_sizes: list[tuple[int, int] | None] | None = None) -> np.ndarray:
        """(C, 4, 4) float64 ``lidar2img`` of the current calibration (:func:`lidar2img`). ``image_sizes``: each
        camera's image (width, height) px in this frame, None where unknown: an image whose size is not its
        CameraInfo's is refused (its camera matrix would not fit). Raises :class:`CalibrationError`, cause
        ``no_camera_info`` (none received for a camera), ``bad_camera_info`` (the latest could not be used),
        ``camera_size_mismatch``, ``no_camera_transform`` (no static transform path from ``base_frame`` to the
        camera's frame) or ``bad_camera_transform`` (not an optical frame, :func:`check_optical_frame`; a loop)."""
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
