"""The camera resize filters' names: one list for a checkpoint's ``image_resize`` and for the preprocessing."""
from __future__ import annotations

#: The resize filters of :func:`hybrid_vla_ros.vehicle.image.preprocess` (a checkpoint's ``image_resize``):
#:
#: * ``area``: OpenCV ``cv2.resize(..., interpolation=cv2.INTER_AREA)`` (each output pixel the mean of the input
#:   area it covers, fractional edges weighted; rounded to uint8). The default.
#: * ``bilinear`` / ``bicubic``: ``torch.nn.functional.interpolate(..., antialias=True)`` on the uint8 image (torch's
#:   separable uint8 kernels, vectorised for channels-last RGB), which follow Pillow's ``Image.resize`` with
#:   ``BILINEAR`` / ``BICUBIC`` (the filters Hugging Face image processors name with ``resample`` 2 / 3): on the
#:   nuScenes cameras at 128, 448 and 640 px they differ from Pillow by at most 1 level on at most 0.4 % of the
#:   pixels (test_image). Several times faster than ``area`` on downscales of 1600x900 cameras
#:   (docs/performance.md, camera preprocessing).
#: * ``orion_crop``: Orion's and MindDrive's published test pipeline for a side S (640 published): Pillow ``BICUBIC``
#:   to the smallest size that covers S x S/2 (1600x900 -> 640x360), the centre S columns and the bottom S/2 rows
#:   kept (rows 40-360), then OpenCV ``INTER_LINEAR`` on the float32 pixels to S x S (rows doubled). The geometry and
#:   the camera intrinsics it implies: :func:`hybrid_vla_ros.vehicle.image.orion_crop_geometry`.
RESIZE_FILTERS = ("area", "bilinear", "bicubic", "orion_crop")
