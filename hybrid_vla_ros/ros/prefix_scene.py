"""The prefix node's scene inputs for a checkpoint with the published query heads (projector ``scene_queries``):
:class:`~hybrid_vla_ros.model.query_heads.SceneInputs` besides the pixels.

``lidar2img`` from each camera's CameraInfo (``camera_info_topics``, best effort) and ``/tf_static``
(:class:`~hybrid_vla_ros.vehicle.camera_geometry.CameraCalibration`); ego pose and can-bus from
prefix_inputs.EgoStateInputs; the navigation command. A frame whose geometry or ego state cannot be made is a
drop counted by cause (:data:`CALIBRATION_DROP_REASONS`, prefix_inputs.EGO_DROP_REASONS).
"""
from __future__ import annotations

import torch
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CameraInfo
from tf2_msgs.msg import TFMessage

from ..model.query_heads import EgoFrame, SceneInputs
from ..vehicle.camera_geometry import CameraCalibration, ModelFrame, ego_motion_inputs
from ..vehicle.image import jpeg_size, png_size
from .navigation_command import NavigationCommandInput

#: Log text of each calibration drop cause (vehicle.camera_geometry.CALIBRATION_CAUSES).
CALIBRATION_DROP_REASONS = {
    "no_camera_info": "no CameraInfo received for a camera (camera_info_topics)",
    "bad_camera_info": "a camera's latest CameraInfo cannot be used",
    "camera_size_mismatch": "an image's size differs from its CameraInfo's",
    "no_camera_transform": "no static transform (/tf_static) from base_frame to a camera's optical frame",
    "bad_camera_transform": "a camera's frame in /tf_static is not an optical frame, or the transforms form a loop",
}

#: QoS of the /tf_static subscription: tf2's static listener profile (reliable, transient local, keep last 100).
TF_STATIC_QOS = QoSProfile(depth=100, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.RELIABLE,
                           durability=DurabilityPolicy.TRANSIENT_LOCAL)


def image_size_of(transport: str, msg) -> tuple[int, int] | None:
    """(width, height) px of a camera message without decoding it; None for a payload neither JPEG nor PNG."""
    if transport != "compressed":
        return int(msg.width), int(msg.height)
    size = png_size(msg.data) or (jpeg_size(msg.data) if len(msg.data) > 4 else None)
    return None if size is None else (size[1], size[0])


class SceneSource:
    """A prefix node's scene inputs (module docstring); ``calibration`` is None while stopped."""

    def __init__(self, ctx, ego_inputs):
        """``ctx``: the node's PartContext; ``ego_inputs``: its prefix_inputs.EgoStateInputs (the node starts it)."""
        self._ctx = ctx
        self._ego = ego_inputs
        self.navigation = NavigationCommandInput(ctx)
        self.calibration: CameraCalibration | None = None
        self.model_frame: ModelFrame | None = None
        self.subscriptions = []
        self.bad_tf_static = 0

    def start(self, settings, cfg) -> None:
        """Subscribe with a fresh calibration (transient-local /tf_static is delivered again). Raises ValueError for
        a bad ``base_frame`` or ``model_frame_origin``."""
        self.model_frame = ModelFrame(tuple(settings.model_frame_origin))
        self.calibration = CameraCalibration(cfg.n_cameras, self.model_frame, cfg.image_size, cfg.image_resize,
                                             settings.base_frame)
        sensor = QoSProfile(depth=qos_profile_sensor_data.depth, history=HistoryPolicy.KEEP_LAST,
                            reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE)
        ros = self._ctx.ros
        self.subscriptions = [ros.create_subscription(CameraInfo, topic, self._camera_info_callback(cam), sensor)
                              for cam, topic in enumerate(settings.camera_info_topics)]
        self.subscriptions.append(ros.create_subscription(TFMessage, "/tf_static", self._on_tf_static, TF_STATIC_QOS))
        self.navigation.start()

    def stop(self) -> None:
        """Unsubscribe (idempotent)."""
        for sub in self.subscriptions:
            self._ctx.ros.destroy_subscription(sub)
        self.subscriptions = []
        self.navigation.stop()
        self.calibration = None

    def _camera_info_callback(self, cam: int):
        def callback(msg: CameraInfo) -> None:
            calibration = self.calibration
            if calibration is None:
                return
            problem = calibration.set_camera_info(cam, msg)
            if problem is not None and self._ctx.log_every(f"camera_info{cam}"):
                self._ctx.logger.warning(f"camera {cam}: camera_info not usable, its frames are dropped: {problem}")
        return callback

    def _on_tf_static(self, msg: TFMessage) -> None:
        calibration = self.calibration
        if calibration is None:
            return
        for problem in calibration.add_static_transforms(msg):  # the message's other transforms are kept
            self.bad_tf_static += 1
            self._ctx.drop("bad_tf_static", f"/tf_static: {problem}")

    def scene_at(self, stamp: int, items, settings) -> tuple[SceneInputs, str | None, float]:
        """(SceneInputs, acceleration source, ms waited) at camera ``stamp`` (ns) for ``items`` ((transport, msg)
        per camera). Raises CalibrationError or LookupError (cause in args[0])."""
        calibration = self.calibration
        if calibration is None:
            raise RuntimeError("scene inputs asked for while stopped")
        lidar2img = calibration.lidar2img([image_size_of(transport, msg) for transport, msg in items])
        values, accel_source, wait_ms = self._ego.state_at(stamp, settings.ego_state_wait_s,
                                                           settings.max_ego_state_age_s)
        pose = self._ego.pose_at(stamp, settings.max_ego_state_age_s)
        speed, accel, yaw_rate = (float(v) for v in values)
        ego_pose, can_bus = ego_motion_inputs(pose.x, pose.y, pose.z, pose.yaw, speed, accel, yaw_rate,
                                              self.model_frame)
        frame = EgoFrame(timestamp=stamp / 1e9, ego_pose=torch.from_numpy(ego_pose),
                         can_bus=torch.from_numpy(can_bus), command=self.navigation.command)
        return SceneInputs(lidar2img=torch.from_numpy(lidar2img), frame=frame), accel_source, wait_ms
