"""Camera image decoding and model preprocessing, free of ROS imports.

Inputs are plain values or duck-typed ``sensor_msgs/msg/Image`` / ``CompressedImage`` objects; outputs are
``(H, W, 3)`` ``uint8`` **RGB**, C-contiguous. Every encoding has one documented conversion; anything else
raises :class:`ImageDecodeError`.

Sources: encoding names and layouts from ``sensor_msgs/image_encodings.hpp`` (``yuv422`` = UYVY,
``yuv422_yuy2`` = YUYV, later aliases ``uyvy`` / ``yuyv``); ``step`` (row bytes, padding ignored) and
``is_bigendian`` from ``Image.msg``. ROS names a Bayer pattern at the top-left pixel, OpenCV's legacy
``COLOR_Bayer<XY>2*`` at pixel (1, 1), so ROS ``rggb`` is OpenCV ``BayerBG`` (as cv_bridge maps it).
Compressed ``format`` strings and their channel order follow ``compressed_image_transport``'s subscriber.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
import re
from typing import TYPE_CHECKING, Sequence

import cv2
import numpy as np

from ..util.image_filters import RESIZE_FILTERS

if TYPE_CHECKING:  # torch is imported lazily by preprocess(): decoding alone does not need it.
    import torch

__all__ = [
    "ImageDecodeError",
    "SUPPORTED_ENCODINGS",
    "decode_image",
    "decode_compressed",
    "image_msg_to_rgb",
    "compressed_msg_to_rgb",
    "preprocess",
]


class ImageDecodeError(ValueError):
    """An image message cannot be turned into an RGB array (bad fields, unsupported encoding, corrupt data)."""


# encoding -> (bytes per pixel, OpenCV conversion code to RGB, or None where numpy handles it).
_MONO16 = -1  # sentinel: handled by taking the high byte, see decode_image()
_ENCODINGS: dict[str, tuple[int, int | None]] = {
    "rgb8": (3, None),
    "bgr8": (3, cv2.COLOR_BGR2RGB),
    "rgba8": (4, cv2.COLOR_RGBA2RGB),
    "bgra8": (4, cv2.COLOR_BGRA2RGB),
    "mono8": (1, cv2.COLOR_GRAY2RGB),
    "mono16": (2, _MONO16),
    # ROS top-left pattern -> OpenCV code named from pixel (1, 1); see the module docstring.
    "bayer_rggb8": (1, cv2.COLOR_BayerBG2RGB),
    "bayer_bggr8": (1, cv2.COLOR_BayerRG2RGB),
    "bayer_gbrg8": (1, cv2.COLOR_BayerGR2RGB),
    "bayer_grbg8": (1, cv2.COLOR_BayerGB2RGB),
    # 4:2:2 packed, 2 bytes per pixel; one macropixel = 2 pixels = 4 bytes.
    "yuv422": (2, cv2.COLOR_YUV2RGB_UYVY),  # image_encodings: YUV422 is U Y0 V Y1 (UYVY)
    "uyvy": (2, cv2.COLOR_YUV2RGB_UYVY),
    "yuv422_yuy2": (2, cv2.COLOR_YUV2RGB_YUY2),  # image_encodings: YUV422_YUY2 is Y0 U Y1 V (YUYV)
    "yuyv": (2, cv2.COLOR_YUV2RGB_YUY2),
}

#: Encodings :func:`decode_image` accepts (ROS ``sensor_msgs/image_encodings.hpp`` names).
SUPPORTED_ENCODINGS: tuple[str, ...] = tuple(_ENCODINGS)

_GENERIC_TYPE = re.compile(r"^(8|16|32|64)(U|S|F)C([1-4])$")
_YUV = ("yuv422", "uyvy", "yuv422_yuy2", "yuyv")


def _unsupported_reason(encoding: str) -> str:
    """Why ``encoding`` is not accepted, for the ImageDecodeError message."""
    if _GENERIC_TYPE.match(encoding):
        return (
            f"{encoding!r} is a generic OpenCV-type encoding (image_encodings TYPE_*): it has no colour "
            "semantics (typically depth, disparity or other per-pixel measurements), so there is no RGB "
            "interpretation to decode"
        )
    if encoding in ("rgb16", "bgr16", "rgba16", "bgra16") or (
        encoding.startswith("bayer_") and encoding.endswith("16")
    ):
        return f"{encoding!r} (16 bits per channel colour) is not supported; publish 8-bit colour"
    if encoding.lower() in ("jpeg", "jpg", "png", "tiff"):
        return f"{encoding!r} is a compressed format: use decode_compressed() on a CompressedImage"
    if encoding != encoding.lower() and encoding.lower() in _ENCODINGS:
        return f"{encoding!r}: ROS encoding names are lower case (did you mean {encoding.lower()!r}?)"
    return f"{encoding!r} is not a supported colour encoding"


def _as_index(value, name: str) -> int:
    """An integer-like field as ``int``, else ImageDecodeError."""
    if isinstance(value, bool):
        raise ImageDecodeError(f"{name} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ImageDecodeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _as_bytes_array(data, what: str) -> np.ndarray:
    """View ``data`` (bytes, bytearray, array('B'), memoryview, numpy array) as a flat uint8 array, no copy."""
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ImageDecodeError(
            f"{what}: data must be a contiguous byte buffer (bytes, array('B'), uint8 ndarray), "
            f"got {type(data).__name__}: {exc}"
        ) from None


def decode_image(
    encoding: str, height: int, width: int, step: int, is_bigendian: bool | int, data, copy: bool = True
) -> np.ndarray:
    """The fields of a ``sensor_msgs/msg/Image`` as ``(height, width, 3)`` ``uint8`` RGB, written in one pass.

    ``encoding`` is one of :data:`SUPPORTED_ENCODINGS`: alpha is dropped, grey replicated, ``mono16`` keeps its
    high byte (order from ``is_bigendian``), Bayer is OpenCV's bilinear demosaic, 4:2:2 YUV needs an even
    ``width``. ``data``: ``height * step`` bytes in any buffer (``array('B')`` from rclpy, ndarray from
    rosbags), never modified. ``copy=False`` (``rgb8`` only): the result is a read-only view of ``data``, valid
    while the message lives and is unchanged (the prefix uses it).

    Raises ImageDecodeError for an unknown or non-colour encoding (``16UC1``, ``32FC1``), sizes <= 0 or not
    integers, ``step < width * bytes_per_pixel``, ``len(data) != height * step``, an odd YUV width, or ``data``
    that is not a byte buffer.
    """
    if not isinstance(encoding, str):
        raise ImageDecodeError(f"encoding must be a str, got {type(encoding).__name__}")
    spec = _ENCODINGS.get(encoding)
    if spec is None:
        raise ImageDecodeError(f"cannot decode image: {_unsupported_reason(encoding)}; "
                               f"supported: {', '.join(SUPPORTED_ENCODINGS)}")
    bpp, code = spec
    height = _as_index(height, "height")
    width = _as_index(width, "width")
    step = _as_index(step, "step")
    if height <= 0 or width <= 0:
        raise ImageDecodeError(f"empty or negative image size {width}x{height} ({encoding})")
    row_bytes = width * bpp
    if step < row_bytes:
        raise ImageDecodeError(
            f"step {step} < width * bytes_per_pixel = {width} * {bpp} = {row_bytes} ({encoding})"
        )
    if encoding in _YUV and width % 2:
        raise ImageDecodeError(f"{encoding} packs 2 pixels per 4-byte macropixel: width {width} must be even")
    buf = _as_bytes_array(data, encoding)
    expected = height * step
    if buf.size != expected:
        kind = "short" if buf.size < expected else "long"
        raise ImageDecodeError(
            f"data too {kind}: {buf.size} bytes, expected height * step = {height} * {step} = {expected} "
            f"({encoding} {width}x{height})"
        )

    # (height, row_bytes) view that skips the padding; no copy.
    rows = buf.reshape(height, step)[:, :row_bytes]
    if code is None:  # rgb8: already the output layout, one copy detaches it from the message.
        view = rows.reshape(height, width, 3)
        return view.copy() if copy else view
    if code == _MONO16:
        # The high byte of each 16-bit sample is value >> 8: byte 0 when big-endian, byte 1 when little.
        high = rows[:, 0::2] if bool(is_bigendian) else rows[:, 1::2]
        return cv2.cvtColor(high, cv2.COLOR_GRAY2RGB)
    if bpp == 1:
        src = rows
    else:
        src = rows.reshape(height, width, bpp)
    out = cv2.cvtColor(src, code)
    if out.shape != (height, width, 3):  # defensive: OpenCV must return exactly one RGB pixel per input pixel
        raise ImageDecodeError(f"{encoding}: conversion produced shape {out.shape}, expected {(height, width, 3)}")
    return out


_JPEG_SOI = b"\xff\xd8\xff"
_JPEG_EOI = b"\xff\xd9"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_IEND = b"IEND\xaeB`\x82"
_IMREAD_COLOR_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)
_COLOUR_ENCODINGS = ("rgb8", "rgba8", "rgb16", "rgba16", "bgr8", "bgra8", "bgr16", "bgra16")  # isColor()


def _parse_format(fmt: str) -> tuple[str, bool]:
    """(codec, payload_is_bgr) of a CompressedImage ``format`` string, as compressed_image_transport reads it.

    A bare ``jpeg``/``png`` or a non-colour original is BGR/grey; a colour original is BGR only when the string
    says ``compressed bgr...``, else the publisher stored RGB bytes.
    """
    if not isinstance(fmt, str):
        raise ImageDecodeError(f"format must be a str, got {type(fmt).__name__}")
    text = fmt.strip()
    if ";" not in text:
        codec = text.lower()
        if codec == "jpg":
            codec = "jpeg"
        if codec not in ("jpeg", "png"):
            raise ImageDecodeError(f"unsupported CompressedImage format {fmt!r}: expected 'jpeg', 'png' or "
                                   "'<encoding>; <jpeg|png> compressed <encoding>'")
        return codec, True
    original, rest = (part.strip() for part in text.split(";", 1))
    rest_lower = rest.lower()
    if "compresseddepth" in rest_lower.replace(" ", ""):
        raise ImageDecodeError(f"{fmt!r} is a compressedDepth (depth image) payload, not a colour image")
    words = rest_lower.split()
    codec = words[0] if words else ""
    if codec == "jpg":
        codec = "jpeg"
    if codec not in ("jpeg", "png") or "compressed" not in words:
        raise ImageDecodeError(f"unsupported CompressedImage format {fmt!r}: expected "
                               "'<encoding>; <jpeg|png> compressed <encoding>'")
    if original in _COLOUR_ENCODINGS:
        return codec, "compressed bgr" in rest_lower
    return codec, True


def jpeg_size(buf: np.ndarray) -> tuple[int, int] | None:
    """(height, width) px from a JPEG's start-of-frame segment (ITU-T T.81, B.2.2), or None when malformed."""
    data = memoryview(buf)  # walks the marker segments in place, however long the APP/EXIF segments are
    i = 2
    while i + 9 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOF0..SOF15 (not DHT, JPG, DAC)
            return (int.from_bytes(data[i + 5:i + 7].tobytes(), "big"),
                    int.from_bytes(data[i + 7:i + 9].tobytes(), "big"))
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length field
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2:i + 4].tobytes(), "big")
    return None


def png_size(buf) -> tuple[int, int] | None:
    """(height, width) px from a PNG's IHDR chunk (ISO/IEC 15948, 5.2 and 11.2.2), or None when absent."""
    data = bytes(memoryview(buf)[:24])
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")


def jpeg_reduction(height: int, width: int, min_size: int) -> int:
    """Largest libjpeg DCT scale-down r in (8, 4, 2) keeping both sides >= ``min_size`` px, else 1."""
    for r in (8, 4, 2):
        if -(-height // r) >= min_size and -(-width // r) >= min_size:
            return r
    return 1


#: cv2.imdecode flags that decode a JPEG scaled down by 2, 4 or 8 inside libjpeg (IMREAD_REDUCED_*),
#: keeping the payload's channel order (key False) or swapping BGR to RGB in the decoder (key True).
_REDUCED_FLAGS = {False: {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}}
if _IMREAD_COLOR_RGB is not None:  # IMREAD_REDUCED_GRAYSCALE_r carries only the scale bits; add RGB colour
    _REDUCED_FLAGS[True] = {r: f | _IMREAD_COLOR_RGB for r, f in (
        (2, cv2.IMREAD_REDUCED_GRAYSCALE_2), (4, cv2.IMREAD_REDUCED_GRAYSCALE_4), (8, cv2.IMREAD_REDUCED_GRAYSCALE_8))}


try:
    import simplejpeg as _simplejpeg
except ImportError:  # optional: OpenCV decodes every JPEG too
    _simplejpeg = None

#: What decodes JPEG payloads: ``simplejpeg`` when installed, else ``opencv``. Both are libjpeg-turbo with the same
#: pixels (test_image); simplejpeg took 0.85x OpenCV's time on six 1600x900 JPEGs (docs/performance.md). What
#: simplejpeg refuses (CMYK, damaged streams) or scales to another size goes to OpenCV, whose errors apply.
JPEG_DECODER = "simplejpeg" if _simplejpeg is not None else "opencv"


def _decode_jpeg_simplejpeg(buf: np.ndarray, payload_is_bgr: bool, reduction: int, size) -> np.ndarray | None:
    """What :func:`decode_compressed` returns, decoded by simplejpeg at 1/``reduction`` (``size``: the header's
    (height, width)); None when simplejpeg refuses it or scales to another size than libjpeg would."""
    kwargs = {}
    if reduction > 1:
        kwargs = {"min_height": -(-size[0] // reduction), "min_width": -(-size[1] // reduction)}
    try:
        img = _simplejpeg.decode_jpeg(buf, colorspace="RGB" if payload_is_bgr else "BGR", **kwargs)
    except ValueError:
        return None
    if reduction > 1 and img.shape[:2] != (kwargs["min_height"], kwargs["min_width"]):
        return None
    return img


def decode_compressed(format: str, data, min_size: int | None = None) -> np.ndarray:  # noqa: A002 - the message field is called format
    """A ``sensor_msgs/msg/CompressedImage`` payload as ``(H, W, 3)`` ``uint8`` RGB, C-contiguous.

    ``format``: ``jpeg``/``jpg``/``png`` or ``"<encoding>; <codec> compressed <target>"`` (see
    :func:`_parse_format`). ``min_size``: decode a JPEG scaled down by :func:`jpeg_reduction` (8x8-block
    averages: 1-3 grey levels off a full decode after a 64-128 px resize); PNG ignores it. Grey is replicated,
    16-bit PNG reduced to 8 bits by OpenCV; JPEGs go to :data:`JPEG_DECODER`.

    Raises ImageDecodeError for an unsupported format (``tiff``, ``compressedDepth``), empty data, magic bytes
    that do not match the codec, a JPEG without its end-of-image marker (truncated), or undecodable data.
    Damage inside JPEG entropy-coded data that libjpeg recovers from ("Corrupt JPEG data") is not detected.
    """
    codec, payload_is_bgr = _parse_format(format)
    buf = _as_bytes_array(data, f"CompressedImage({format!r})")
    if buf.size == 0:
        raise ImageDecodeError(f"empty CompressedImage payload ({format!r})")
    head = buf[:8].tobytes()
    if codec == "jpeg":
        if not head.startswith(_JPEG_SOI):
            raise ImageDecodeError(f"format {format!r} says JPEG but data does not start with the JPEG SOI marker "
                                   f"(first bytes {head.hex()})")
        # Allow zero padding after EOI (some drivers pad to a fixed size); look only at the tail.
        end = buf.size
        tail_floor = max(0, end - 4096)
        while end > tail_floor and buf[end - 1] == 0:
            end -= 1
        if end < 2 or buf[end - 2 : end].tobytes() != _JPEG_EOI:
            raise ImageDecodeError(f"JPEG payload has no end-of-image marker: truncated ({buf.size} bytes)")
    else:
        if head != _PNG_SIGNATURE:
            raise ImageDecodeError(f"format {format!r} says PNG but data does not start with the PNG signature "
                                   f"(first bytes {head.hex()})")
    # IMREAD_COLOR yields the decoder's B, G, R memory order; IMREAD_COLOR_RGB (OpenCV >= 4.10) swaps to
    # R, G, B inside the decoder, saving a pass. Older OpenCV: decode BGR, then swap in place.
    swap_after = payload_is_bgr and _IMREAD_COLOR_RGB is None
    flag = _IMREAD_COLOR_RGB if (payload_is_bgr and not swap_after) else cv2.IMREAD_COLOR
    r, size = 1, None
    if codec == "jpeg" and min_size is not None:
        size = jpeg_size(buf)
        r = jpeg_reduction(*size, int(min_size)) if size else 1
        if r > 1:
            flag = _REDUCED_FLAGS[payload_is_bgr and not swap_after][r]
    if codec == "jpeg" and JPEG_DECODER == "simplejpeg":
        img = _decode_jpeg_simplejpeg(buf, payload_is_bgr, r, size)
        if img is not None:
            return img
    try:
        img = cv2.imdecode(buf, flag)
    except cv2.error as exc:
        raise ImageDecodeError(f"OpenCV failed to decode {codec} payload ({buf.size} bytes): {exc}") from None
    if img is None:
        raise ImageDecodeError(f"corrupt or truncated {codec} payload ({buf.size} bytes): OpenCV could not decode it")
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
        raise ImageDecodeError(f"decoded {codec} has unexpected shape/dtype {img.shape} {img.dtype}")
    if swap_after:
        cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=img)
    return img


def image_msg_to_rgb(msg, copy: bool = True) -> np.ndarray:
    """:func:`decode_image` of an Image message's fields; also ImageDecodeError when a field is missing."""
    try:
        fields = (msg.encoding, msg.height, msg.width, msg.step, msg.is_bigendian, msg.data)
    except AttributeError as exc:
        raise ImageDecodeError(f"not an Image message: {exc}") from None
    return decode_image(*fields, copy=copy)


def compressed_msg_to_rgb(msg, min_size: int | None = None) -> np.ndarray:
    """:func:`decode_compressed` of a CompressedImage's ``format`` and ``data``; ImageDecodeError when missing."""
    try:
        fmt, data = msg.format, msg.data
    except AttributeError as exc:
        raise ImageDecodeError(f"not a CompressedImage message: {exc}") from None
    return decode_compressed(fmt, data, min_size)


def _channel_triplet(values, name: str) -> tuple[float, float, float]:
    """A per-channel mean/std (scalar or 3 values, RGB) as a float triple, or ValueError."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 1:
        arr = np.repeat(arr, 3)
    if arr.size != 3 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be a finite scalar or 3 values (R, G, B), got {values!r}")
    return float(arr[0]), float(arr[1]), float(arr[2])




@dataclass(frozen=True)
class CropResize:
    """One camera's ``orion_crop`` geometry (:func:`orion_crop_geometry`).

    ``scale``: the first resize's factor; ``resized``: its (width, height) px; ``crop``: (left, top, right,
    bottom) px kept from it, Pillow's exclusive box; ``size``: the model's side S (the S x S/2 crop stretched).
    """

    scale: float
    resized: tuple[int, int]
    crop: tuple[int, int, int, int]
    size: int

    def intrinsics(self, k: np.ndarray) -> np.ndarray:
        """The 3 x 3 float64 camera matrix of the S x S model image from the camera's ``k`` (as the published
        pipeline updates ``cam_intrinsic``). Raises ValueError unless ``k`` is 3 x 3 and finite."""
        k = np.asarray(k, dtype=np.float64)
        if k.shape != (3, 3) or not np.isfinite(k).all():
            raise ValueError(f"camera matrix must be 3 x 3 and finite, got {k.shape}")
        left, top, right, bottom = self.crop
        first = np.array([[self.scale, 0.0, -left], [0.0, self.scale, -top], [0.0, 0.0, 1.0]])
        stretch = np.diag([self.size / (right - left), self.size / (bottom - top), 1.0])
        return stretch @ first @ k


#: ``orion_crop`` refuses a camera whose first resize would exceed this many times the crop's area (e.g. 16:1).
MAX_CROP_RESIZE_AREA = 8


def orion_crop_geometry(height: int, width: int, size: int) -> CropResize:
    """Where the ``orion_crop`` pipeline takes an S x S model image from a ``width`` x ``height`` camera.

    MindDrive's inference configs (``ResizeCropFlipRotImage``, ``final_dim`` (S/2, S), ``bot_pct_lim`` (0, 0),
    then ``ResizeMultiview3D`` to (S, S)): scale by max((S/2) / height, S / width), keep the centre S columns and
    bottom S/2 rows. The published code scales from a fixed 1600 x 900; this uses the camera's own size. Raises
    ValueError for sizes < 1, an odd S, or a first resize over MAX_CROP_RESIZE_AREA times the crop.
    """
    if min(height, width, size) < 1 or size % 2:
        raise ValueError(f"orion_crop needs a positive camera size and an even model side, got {width}x{height}, "
                         f"S = {size}")
    fh, fw = size // 2, size
    scale = max(fh / height, fw / width)
    # int() as published; never below the crop (the product can round to S - 1 for some sizes, and Pillow would
    # fill the missing row or column with black)
    new_w, new_h = max(fw, int(width * scale)), max(fh, int(height * scale))
    if new_w * new_h > MAX_CROP_RESIZE_AREA * fw * fh:
        raise ValueError(f"a {width}x{height} camera is too far from 2:1 for orion_crop: its first resize would be "
                         f"{new_w}x{new_h} px to keep a {fw}x{fh} crop")
    top = new_h - fh
    left = int(max(0, new_w - fw) / 2)
    return CropResize(scale, (new_w, new_h), (left, top, left + fw, top + fh), size)


_CROP_POOLS: dict = {}


def _orion_crops(images: Sequence[np.ndarray], size: int) -> list:
    """Each camera's ``orion_crop`` crop as a Pillow image (Pillow's bicubic resize, the published pipeline's);
    cameras run in a thread pool of one worker per allowed core (Pillow releases the GIL)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    def crop(img: np.ndarray):
        g = orion_crop_geometry(img.shape[0], img.shape[1], size)
        return Image.fromarray(img).resize(g.resized, Image.Resampling.BICUBIC).crop(g.crop)

    workers = min(len(images), len(os.sched_getaffinity(0)))
    if workers < 2:
        return [crop(img) for img in images]
    pool = _CROP_POOLS.get(workers)
    if pool is None:
        pool = _CROP_POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="orion_crop")
    return list(pool.map(crop, images))


def resize_filter(name) -> str:
    """``name`` checked against :data:`RESIZE_FILTERS`; raises ValueError naming the choices."""
    if name not in RESIZE_FILTERS:
        raise ValueError(f"image_resize must be one of {', '.join(RESIZE_FILTERS)}, got {name!r}")
    return name


def preprocess(
    images: Sequence[np.ndarray],
    size: int,
    mean: Sequence[float] | float,
    std: Sequence[float] | float,
    out: "torch.Tensor | None" = None,
    resize: str = "area",
) -> "torch.Tensor":
    """``n_cams`` ``(H_i, W_i, 3)`` uint8 RGB images -> the model's ``float32 (n_cams, 3, size, size)`` RGB input.

    Each image is resized to ``size x size`` (aspect not kept) with ``resize`` (:data:`RESIZE_FILTERS`) from its
    uint8 pixels, then normalised as ``(pixel / 255 - mean[c]) / std[c]`` (``mean``, ``std``: [0, 1] units, RGB,
    scalar or 3 values), computed as ``(pixel - 255 mean) / (255 std)``. ``orion_crop`` is the published
    Orion / MindDrive pipeline (:func:`orion_crop_geometry`). ``out``: a preallocated tensor of that shape on any
    device, filled in place and returned (off the CPU the uint8 image crosses and is normalised there).

    Raises ValueError for empty ``images``, an image not ``(H, W, 3)`` uint8, ``size`` not an int > 0, mean/std
    not finite (also as 255 mean, 255 std or outputs in float32) or ``std <= 0``, a wrong ``out``, an unknown
    ``resize``, or a camera or odd ``size`` that ``orion_crop`` refuses.
    """
    import torch

    resize_filter(resize)

    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ValueError(f"size must be an int, got {type(size).__name__}")
    size = int(size)
    if size <= 0:
        raise ValueError(f"size must be > 0, got {size}")
    n = len(images)
    if n == 0:
        raise ValueError("images is empty")
    mean3 = _channel_triplet(mean, "mean")
    std3 = _channel_triplet(std, "std")
    if min(std3) <= 0:
        raise ValueError(f"std must be > 0, got {std3}")
    for i, img in enumerate(images):
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
            desc = f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__
            raise ValueError(f"images[{i}] must be an (H, W, 3) uint8 RGB array, got {desc}")
        if img.shape[0] == 0 or img.shape[1] == 0:
            raise ValueError(f"images[{i}] is empty: {img.shape}")
    shape = (n, 3, size, size)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif tuple(out.shape) != shape or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {shape}, got {out.dtype} {tuple(out.shape)}")

    # (x / 255 - m) / s == (x - 255 m) / (255 s), per channel: 0 and 255 map exactly where 255 m and 255 s are exact
    mean255 = torch.tensor([255.0 * m for m in mean3], dtype=torch.float32, device=out.device).view(3, 1, 1)
    std255 = torch.tensor([255.0 * s for s in std3], dtype=torch.float32, device=out.device).view(3, 1, 1)
    f32_max = float(np.finfo(np.float32).max)
    widest = max(max(abs(m), abs(1.0 - m)) / s for m, s in zip(mean3, std3))  # the largest |output| of 0..255
    if max(max(abs(m), s) for m, s in zip(mean3, std3)) * 255.0 >= f32_max or widest >= f32_max / 2:
        raise ValueError(f"mean {mean3} and std {std3}: 255 mean, 255 std and the normalised pixels "
                         f"(up to {widest:.3g}) must be finite in float32")
    fused = out.device.type == "cpu"
    crops = _orion_crops(images, size) if resize == "orion_crop" else None
    for i, img in enumerate(images):
        if resize == "area":
            resized = torch.from_numpy(cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA))  # (S, S, 3)
        elif resize == "orion_crop":  # the crop (uint8, made above) stretched on float32 pixels, as published
            resized = torch.from_numpy(cv2.resize(np.asarray(crops[i], dtype=np.float32), (size, size),
                                                  interpolation=cv2.INTER_LINEAR))  # float32 (S, S, 3)
        elif img.shape[:2] == (size, size):
            resized = torch.from_numpy(np.ascontiguousarray(img))  # interpolate at the same size copies as is
        else:
            # (1, 3, H, W) with channels-last strides: the layout torch's vectorised uint8 kernels take
            chw = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).unsqueeze(0)
            resized = torch.nn.functional.interpolate(chw, size=(size, size), mode=resize, antialias=True,
                                                      align_corners=False)[0].permute(1, 2, 0)
        if fused:  # HWC uint8 -> CHW float32 minus the mean in one pass, then divided while still in the cache
            torch.sub(resized.permute(2, 0, 1), mean255, out=out[i]).div_(std255)
        else:  # another device: the small uint8 image crosses (a blocking copy_ with a dtype change would convert
            # on the CPU and send float32), then is converted and normalised there below
            out[i].copy_(resized.permute(2, 0, 1).to(out.device))
    if not fused:
        out.sub_(mean255).div_(std255)
    return out


def resize_rgb(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """An (H, W, 3) uint8 RGB image at ``size`` = (width, height) px (``INTER_AREA``; as is when already so), the
    fixed size a VLM's processor gets so every frame has the same token count. Raises ValueError for bad input."""
    w, h = (int(v) for v in size)
    if w <= 0 or h <= 0:
        raise ValueError(f"camera size must be two positive ints (width, height), got {size!r}")
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got "
                         f"{getattr(image, 'dtype', type(image).__name__)} {getattr(image, 'shape', '')}")
    if image.shape[1] == w and image.shape[0] == h:
        return image
    return cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)
