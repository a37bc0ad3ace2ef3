"""Validated node parameters (ROS-free, so they are tested without a ROS graph).

The nodes read their ROS parameters into a plain dict and build one of these dataclasses; every
problem is reported at once as a :class:`ParameterError` naming the parameter and the valid range.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

_RING_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
DEVICES = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
DTYPE_NAMES = ("fp32", "bf16", "fp16")
TRANSPORTS = ("raw", "compressed")


class ParameterError(ValueError):
    """One or more parameters are invalid; the message lists each as 'name: problem'."""


def _check(problems: list[str], ok: bool, name: str, msg: str) -> None:
    if not ok:
        problems.append(f"{name}: {msg}")


@dataclass
class PrefixParams:
    """Parameters of ``prefix_node``.

    camera_topics: one image topic per camera, camera-index order ([] = ``~/input/image<i>``).
        With transport "compressed" the node subscribes to ``<topic>/compressed`` (image_transport).
    camera_transports: "raw" (sensor_msgs/Image) or "compressed" (sensor_msgs/CompressedImage), one
        per camera or a single value for all.
    sync_tolerance_ms: largest spread of header stamps within one synchronized frame (ms, > 0).
    split_layer: K in [0, L]; the prefix runs decoder blocks [0, K).
    model_path: checkpoint directory (config.json + model.safetensors).
    device: "auto" (cuda when available, else cpu), "cpu", "cuda" or "cuda:N".
    dtype: "fp32", "bf16" or "fp16" for weights and hidden states.
    ring_name, ring_slots: shared-memory ring name (scoped by user and namespace) and slot count (>= 3).
    torch_threads: intra-op threads when the prefix runs on CPU (0 = torch's default).
    """

    model_path: str
    split_layer: int
    camera_topics: list[str] = field(default_factory=list)
    camera_transports: list[str] = field(default_factory=lambda: ["raw"])
    sync_tolerance_ms: float = 50.0
    device: str = "auto"
    dtype: str = "fp32"
    ring_name: str = "prefix_states"
    ring_slots: int = 4
    torch_threads: int = 0

    def validate(self, n_cameras: int | None = None, num_layers: int | None = None) -> "PrefixParams":
        """Raise ParameterError listing every invalid field. ``n_cameras`` / ``num_layers`` come from
        the checkpoint when known. Expands single-value ``camera_transports`` and empty topics."""
        p: list[str] = []
        _check_common(p, self.model_path, self.split_layer, num_layers, self.dtype, self.ring_name)
        if n_cameras is not None:
            if not self.camera_topics:
                self.camera_topics = [f"~/input/image{i}" for i in range(n_cameras)]
            _check(p, len(self.camera_topics) == n_cameras, "camera_topics",
                   f"{len(self.camera_topics)} topics given, the model takes {n_cameras} cameras")
            if len(self.camera_transports) == 1:
                self.camera_transports = self.camera_transports * n_cameras
            _check(p, len(self.camera_transports) == n_cameras, "camera_transports",
                   f"give one value or {n_cameras} (one per camera)")
        _check(p, all(t in TRANSPORTS for t in self.camera_transports), "camera_transports",
               f"each must be one of {TRANSPORTS}, got {self.camera_transports}")
        _check(p, len(set(self.camera_topics)) == len(self.camera_topics), "camera_topics", "duplicate topic")
        _check(p, self.sync_tolerance_ms > 0, "sync_tolerance_ms", "must be > 0 ms")
        _check(p, bool(DEVICES.match(self.device)), "device", "must be auto, cpu, cuda or cuda:N")
        _check(p, 3 <= self.ring_slots <= 64, "ring_slots", "must be in [3, 64]")
        _check(p, self.torch_threads >= 0, "torch_threads", "must be >= 0")
        if p:
            raise ParameterError("invalid parameters: " + "; ".join(p))
        return self


@dataclass
class SuffixParams:
    """Parameters of ``suffix_node``.

    cpu_affinity: CPU cores the whole process is pinned to ([] = not pinned). Applied before torch
        and rclpy start threads (see :mod:`hybrid_vla_ros.core.affinity`).
    threads: torch intra-op threads (0 = one per pinned core, or torch's default when not pinned).
    split_layer: the K this suffix expects; a slot stamped with another K is rejected and counted.
    model_path, dtype, ring_name: as for the prefix; both nodes must name the same checkpoint and ring.
    output_frame: frame of the published trajectory (Autoware: "map").
    wheelbase_m: vehicle wheelbase for front_wheel_angle_rad (m, > 0; Autoware vehicle_info wheel_base).
    max_odometry_age_s: odometry farther than this from the camera stamp is not used (s, > 0); the
        ego pose at the camera stamp is interpolated between the two bracketing odometry messages, or
        propagated at constant velocity from the nearest one.
    odometry_wait_s: longest wait for the odometry message after a camera stamp (s, >= 0).
    """

    model_path: str
    split_layer: int
    cpu_affinity: list[int] = field(default_factory=list)
    threads: int = 0
    dtype: str = "fp32"
    ring_name: str = "prefix_states"
    output_frame: str = "map"
    wheelbase_m: float = 2.79
    max_odometry_age_s: float = 1.0
    odometry_wait_s: float = 0.2

    def validate(self, num_layers: int | None = None) -> "SuffixParams":
        """Raise ParameterError listing every invalid field."""
        p: list[str] = []
        _check_common(p, self.model_path, self.split_layer, num_layers, self.dtype, self.ring_name)
        available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
        bad = [c for c in self.cpu_affinity if c not in available]
        _check(p, not bad, "cpu_affinity", f"cores {bad} do not exist (this machine has 0..{(os.cpu_count() or 1) - 1})")
        _check(p, self.threads >= 0, "threads", "must be >= 0")
        _check(p, bool(self.output_frame), "output_frame", "must not be empty")
        _check(p, self.wheelbase_m > 0, "wheelbase_m", "must be > 0 m")
        _check(p, self.max_odometry_age_s > 0, "max_odometry_age_s", "must be > 0 s")
        _check(p, 0 <= self.odometry_wait_s <= 5, "odometry_wait_s", "must be in [0, 5] s")
        if p:
            raise ParameterError("invalid parameters: " + "; ".join(p))
        return self


def _check_common(p: list[str], model_path: str, k: int, num_layers: int | None, dtype: str, ring_name: str) -> None:
    """Checks both nodes share: model_path, split_layer, dtype, ring_name."""
    _check(p, bool(model_path), "model_path", "must name a checkpoint directory")
    _check(p, not model_path or os.path.isdir(model_path), "model_path", f"{model_path!r} is not a directory")
    _check_split(p, k, num_layers)
    _check(p, dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}")
    _check(p, isinstance(ring_name, str) and bool(_RING_NAME.match(ring_name)), "ring_name",
           "1-64 characters of [A-Za-z0-9_-]")


def _check_split(p: list[str], k: int, num_layers: int | None) -> None:
    if isinstance(k, bool) or not isinstance(k, int):
        p.append(f"split_layer: must be an integer, got {k!r}")
    elif num_layers is None:
        _check(p, k >= 0, "split_layer", "must be set to K in [0, L]")
    else:
        _check(p, 0 <= k <= num_layers, "split_layer", f"{k} out of range [0, {num_layers}] for this model")
