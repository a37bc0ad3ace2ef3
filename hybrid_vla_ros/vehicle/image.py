"""Camera image decoding and model preprocessing, free of ROS imports.

Everything here takes plain values (or duck-typed message objects that carry the fields of
``sensor_msgs/msg/Image`` / ``sensor_msgs/msg/CompressedImage``) and returns numpy arrays in one
fixed layout: ``(H, W, 3)`` ``uint8`` **RGB**, C-contiguous. Nothing in this module swaps channels
silently: every input encoding has one documented conversion, and anything else raises
:class:`ImageDecodeError`.

Conventions and their sources
-----------------------------
* Encoding names and their byte layouts: ROS ``sensor_msgs/image_encodings.hpp`` (``rgb8``, ``bgr8``,
  ``rgba8``, ``bgra8``, ``mono8``, ``mono16``, ``bayer_<pattern>8``, ``yuv422`` = UYVY,
  ``yuv422_yuy2`` = YUYV, and the aliases ``uyvy`` / ``yuyv`` added in later distributions).
* Row layout: ``sensor_msgs/msg/Image.msg`` -- ``step`` is the full row length in bytes (it may exceed
  ``width * bytes_per_pixel``: the padding is ignored), ``data`` holds ``step * height`` bytes and
  ``is_bigendian`` gives the byte order of multi-byte samples.
* Bayer names: ROS names the 2x2 pattern at the image's top-left corner (``bayer_rggb8`` = R G / G B).
  OpenCV's legacy ``COLOR_Bayer<XY>2*`` codes name the pattern that starts at pixel (1, 1), one row and
  one column further in, so ROS ``rggb`` is OpenCV ``BayerBG``, ``bggr`` is ``BayerRG``, ``gbrg`` is
  ``BayerGR`` and ``grbg`` is ``BayerGB`` (the same mapping cv_bridge uses; checked by a synthetic
  red-scene test).
* Compressed formats: ``sensor_msgs/msg/CompressedImage.msg`` (``format`` = ``jpeg`` / ``png``) and
  image_transport's ``compressed_image_transport`` strings ``"<encoding>; <codec> compressed <target>"``
  (e.g. ``"rgb8; jpeg compressed bgr8"``); the channel-order rule follows that package's subscriber.
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
    """Explain why ``encoding`` is not accepted (used in the ImageDecodeError message)."""
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
    """Coerce an integer-like field (Python or numpy int) to ``int``; anything else is an error."""
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
    """Decode the fields of a ``sensor_msgs/msg/Image`` into an RGB array.

    Args:
        encoding: ROS encoding name (``sensor_msgs/image_encodings.hpp``); one of
            :data:`SUPPORTED_ENCODINGS`: ``rgb8``, ``bgr8``, ``rgba8``, ``bgra8`` (alpha dropped),
            ``mono8`` (grey replicated to 3 channels), ``mono16`` (high byte, i.e. ``value >> 8``, in the
            byte order given by ``is_bigendian``, replicated), ``bayer_rggb8`` / ``bayer_bggr8`` /
            ``bayer_gbrg8`` / ``bayer_grbg8`` (OpenCV bilinear demosaic; pattern named at the top-left
            pixel as in ROS), ``yuv422`` / ``uyvy`` (U Y0 V Y1) and ``yuv422_yuy2`` / ``yuyv``
            (Y0 U Y1 V), converted by OpenCV (``width`` must be even).
        height: rows (pixels), > 0.
        width: columns (pixels), > 0.
        step: bytes per row including any padding, ``>= width * bytes_per_pixel``.
        is_bigendian: byte order of 16-bit samples (only ``mono16`` uses it).
        data: ``height * step`` bytes; any buffer-protocol object (``bytes``, ``array('B')`` as rclpy
            gives it, a ``uint8`` ndarray as rosbags gives it, ``memoryview``). It is not modified, and the
            result aliases it only for ``rgb8`` with ``copy=False``.
        copy: ``rgb8`` only: False returns a view of ``data`` (rows of ``step`` bytes, padding skipped; no
            pass over the pixels) that the caller must only read, valid while ``data`` lives and is not
            changed -- what the prefix uses, since the message outlives the frame's preprocessing. Other
            encodings convert anyway.

    Returns:
        ``(height, width, 3)`` ``uint8`` RGB. The input is read through a strided view (row padding skipped,
        OpenCV takes padded rows without copying) and written once: a single copy for ``rgb8`` (C-contiguous,
        newly allocated; none with ``copy=False``), a single colour conversion otherwise (``mono16`` only:
        OpenCV first gathers the high bytes, which was faster than any single-pass alternative measured).

    Raises:
        ImageDecodeError: unknown or non-colour encoding (e.g. ``16UC1``, ``32FC1``: depth has no RGB
            meaning), ``height`` or ``width`` <= 0, ``step < width * bytes_per_pixel``, ``len(data) !=
            height * step`` (``Image.msg``: data size is step * rows), odd ``width`` for 4:2:2 YUV,
            non-integer sizes or a ``data`` object that is not a byte buffer.
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
    """Return (codec, payload_is_bgr) for a CompressedImage ``format`` string.

    ``payload_is_bgr`` says whether the 3-channel matrix that OpenCV's decoder produces (B, G, R order
    in memory for a normal colour JPEG/PNG) holds BGR, following compressed_image_transport's
    subscriber: a bare ``jpeg``/``png`` or a non-colour original (mono, bayer, yuv -> compressed as
    mono8) is BGR/grey; a colour original is BGR only if the string says ``compressed bgr...``,
    otherwise the publisher stored RGB bytes and the decoded matrix already is RGB.
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
    """(height, width) in pixels from a JPEG's start-of-frame segment (ITU-T T.81, B.2.2), or None when
    the markers before it are not well formed. ``buf``: the uint8 payload, starting with SOI."""
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
    """(height, width) in pixels from a PNG's IHDR chunk (the signature, then IHDR first: PNG specification,
    ISO/IEC 15948, 5.2 and 11.2.2), or None when ``buf`` (the uint8 payload) does not start so."""
    data = bytes(memoryview(buf)[:24])
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")


def jpeg_reduction(height: int, width: int, min_size: int) -> int:
    """Largest libjpeg DCT scale-down factor r in (8, 4, 2) with ceil(height / r) and ceil(width / r) both
    >= ``min_size`` pixels, else 1 (decode at full size)."""
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

#: What decodes JPEG payloads: ``simplejpeg`` (libjpeg-turbo's TurboJPEG API) when that package is installed, else
#: ``opencv``. Both are libjpeg-turbo with its default (accurate) IDCT and upsampling; on the nuScenes cameras and
#: the embedded bag their pixels are equal (test_image), and simplejpeg took 0.85x OpenCV's time for six 1600x900
#: JPEGs at full size, 0.9x at 1/4 (bench preprocess, docs/performance.md). A payload simplejpeg refuses (CMYK, a
#: damaged stream: it is strict where libjpeg only warns) or a scaled decode whose size differs from OpenCV's
#: goes to OpenCV, so errors and recoveries are OpenCV's as before.
JPEG_DECODER = "simplejpeg" if _simplejpeg is not None else "opencv"


def _decode_jpeg_simplejpeg(buf: np.ndarray, payload_is_bgr: bool, reduction: int, size) -> np.ndarray | None:
    """A JPEG payload decoded by simplejpeg to what :func:`decode_compressed` returns (RGB when the payload is BGR
    as compressed_image_transport writes it, the payload's own order otherwise), scaled down by ``reduction``
    (1, 2, 4, 8; ``size`` (height, width) from the header when > 1); None when simplejpeg refuses it or scales to
    another size than libjpeg's 1/``reduction`` (OpenCV then decodes it)."""
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
    """Decode a ``sensor_msgs/msg/CompressedImage`` payload into an RGB array.

    Args:
        format: ``"jpeg"`` (or ``"jpg"``), ``"png"`` (case-insensitive), or image_transport's
            ``"<encoding>; <codec> compressed <target>"`` (e.g. ``"rgb8; jpeg compressed bgr8"``,
            ``"mono8; png compressed mono8"``). Channel order of the payload follows
            compressed_image_transport: BGR unless a colour original is declared with a non-``bgr``
            target, in which case the payload already holds RGB.
        data: the compressed bytes (any buffer-protocol object: ``bytes``, ``array('B')``, ``uint8``
            ndarray). Not modified.
        min_size: when given, a JPEG is decoded scaled down by the largest factor 2, 4 or 8 that keeps
            both sides >= ``min_size`` pixels (libjpeg's DCT scaling, :func:`jpeg_reduction`): far less
            work when the model input is much smaller than the camera image. The picture is then an
            8x8-block average rather than every pixel, so after the model's resize it differs slightly
            from a full decode (here: 1-3 grey levels on average at 64-128 px). PNG ignores it.

    Returns:
        ``(H, W, 3)`` ``uint8`` RGB, C-contiguous (H, W from the payload, divided by the reduction). Greyscale payloads
        are replicated to 3 channels; 16-bit PNG is reduced to 8 bits by OpenCV.

    Raises:
        ImageDecodeError: unsupported format string (``tiff``, ``compressedDepth``, ...), empty data, a
            payload whose magic bytes do not match the declared codec, a JPEG without its end-of-image
            marker (truncated), or a payload OpenCV cannot decode (corrupt).

    A JPEG is decoded by :data:`JPEG_DECODER` (simplejpeg when installed, OpenCV for what it refuses), a PNG by
    OpenCV.

    Note:
        libjpeg recovers from some damage inside the entropy-coded data (it prints "Corrupt JPEG data"
        on stderr and returns an image); OpenCV does not report that, so such frames cannot be detected
        here. Truncation and header damage are detected.
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
    """Decode a ``sensor_msgs/msg/Image`` (or any object with its fields) with :func:`decode_image`.

    Uses ``msg.encoding``, ``msg.height``, ``msg.width``, ``msg.step``, ``msg.is_bigendian`` and
    ``msg.data``. Returns ``(height, width, 3)`` ``uint8`` RGB; ``copy=False``: for ``rgb8`` a view of
    ``msg.data`` to read only (see :func:`decode_image`). Raises :class:`ImageDecodeError` as
    :func:`decode_image` does, and when a field is missing.
    """
    try:
        fields = (msg.encoding, msg.height, msg.width, msg.step, msg.is_bigendian, msg.data)
    except AttributeError as exc:
        raise ImageDecodeError(f"not an Image message: {exc}") from None
    return decode_image(*fields, copy=copy)


def compressed_msg_to_rgb(msg, min_size: int | None = None) -> np.ndarray:
    """Decode a ``sensor_msgs/msg/CompressedImage`` (or any object with ``format`` and ``data``).

    Returns ``(H, W, 3)`` ``uint8`` RGB (a JPEG scaled down when ``min_size`` allows: see
    :func:`decode_compressed`). Raises :class:`ImageDecodeError` as :func:`decode_compressed` does, and
    when a field is missing.
    """
    try:
        fmt, data = msg.format, msg.data
    except AttributeError as exc:
        raise ImageDecodeError(f"not a CompressedImage message: {exc}") from None
    return decode_compressed(fmt, data, min_size)


def _channel_triplet(values, name: str) -> tuple[float, float, float]:
    """Normalise a per-channel mean/std (scalar or 3 values, RGB order) to a float triple."""
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 1:
        arr = np.repeat(arr, 3)
    if arr.size != 3 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be a finite scalar or 3 values (R, G, B), got {values!r}")
    return float(arr[0]), float(arr[1]), float(arr[2])




@dataclass(frozen=True)
class CropResize:
    """The geometry of the ``orion_crop`` camera pipeline for one camera (:func:`orion_crop_geometry`).

    ``scale``: the first resize's factor (both axes); ``resized``: its output size (width, height) px;
    ``crop``: the box kept from it, (left, top, right, bottom) px, right / bottom exclusive (Pillow's
    ``Image.crop``); ``size``: the model's side S, the crop (S x S/2) stretched to S x S.
    """

    scale: float
    resized: tuple[int, int]
    crop: tuple[int, int, int, int]
    size: int

    def intrinsics(self, k: np.ndarray) -> np.ndarray:
        """The 3 x 3 camera matrix (float64) of the model's S x S image from the camera's own ``k`` (3 x 3, pixels
        of the original image): scaled by ``scale``, shifted by the crop's top-left corner, then scaled by S / crop
        width and S / crop height (as the published pipeline updates ``cam_intrinsic``; a zero-skew ``k`` gives
        its numbers exactly). Raises ValueError unless ``k`` is 3 x 3 and finite."""
        k = np.asarray(k, dtype=np.float64)
        if k.shape != (3, 3) or not np.isfinite(k).all():
            raise ValueError(f"camera matrix must be 3 x 3 and finite, got {k.shape}")
        left, top, right, bottom = self.crop
        first = np.array([[self.scale, 0.0, -left], [0.0, self.scale, -top], [0.0, 0.0, 1.0]])
        stretch = np.diag([self.size / (right - left), self.size / (bottom - top), 1.0])
        return stretch @ first @ k


#: ``orion_crop`` refuses a camera whose first resize would exceed this many times the crop's area (an aspect ratio
#: far from the crop's 2:1, e.g. 16:1: seconds of resizing and gigabytes for pixels that are cut away).
MAX_CROP_RESIZE_AREA = 8


def orion_crop_geometry(height: int, width: int, size: int) -> CropResize:
    """Where the ``orion_crop`` pipeline takes an S x S model image from a ``width`` x ``height`` camera.

    From the published test pipeline (MindDrive's inference configs, ``ResizeCropFlipRotImage`` with
    ``final_dim`` (S/2, S) and ``bot_pct_lim`` (0, 0), then ``ResizeMultiview3D`` to (S, S)): scale
    r = max((S/2) / height, S / width); resized (int(width r), int(height r)); keep the centre S columns and the
    bottom S/2 rows. The published code computes r from a fixed 1600 x 900 and so resizes any other camera to
    640 x 360; this takes the camera's own size (the same for 1600 x 900). Raises ValueError for sizes < 1, an
    odd S, or an aspect ratio so far from 2:1 that the first resize would exceed MAX_CROP_RESIZE_AREA times the
    crop.
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
    """Each camera's ``orion_crop`` crop (:func:`orion_crop_geometry`): Pillow's bicubic resize (Pillow is the
    published pipeline's own resize, so the pixels are its pixels) and the crop, as Pillow images. Pillow resizes
    on one core and releases the GIL while it does, so with more than one core allowed to this process the
    cameras are resized in a thread pool of that many workers (at most one per camera)."""
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
    """Resize and normalise camera images into the model's input tensor.

    Each image is resized to ``size x size`` with the filter ``resize`` (:data:`RESIZE_FILTERS`; aspect ratio not
    kept) in one pass from its uint8 pixels (no full-size float copy), its
    ``size x size`` uint8 result converted and normalised into ``out`` camera by camera while it is in the cache
    (on another device than the CPU the uint8 image crosses and is normalised there):
    ``(pixel / 255 - mean[c]) / std[c]``, computed in float32 as ``(pixel - 255 mean[c]) / (255 std[c])``.
    ``orion_crop`` is the published Orion / MindDrive pipeline instead (:func:`orion_crop_geometry`): a Pillow
    bicubic resize and crop in uint8, then its second resize on float32 pixels (as published, not rounded).

    Args:
        images: ``n_cams`` arrays, each ``(H_i, W_i, 3)`` ``uint8`` RGB (sizes may differ).
        size: output side in pixels, > 0.
        mean: per-channel mean in [0, 1] units, RGB order (e.g. ImageNet ``(0.485, 0.456, 0.406)``);
            a scalar applies to all channels.
        std: per-channel standard deviation in [0, 1] units, RGB order, each > 0; scalar allowed.
        out: optional preallocated ``float32`` tensor of shape ``(n_cams, 3, size, size)`` (any
            device); when given it is filled in place and returned, so steady-state calls allocate
            nothing but the small resized ``uint8`` images.
        resize: the filter, one of :data:`RESIZE_FILTERS` (default ``area``).

    Returns:
        ``float32`` tensor ``(n_cams, 3, size, size)``, channel order RGB (CHW per camera).

    Raises:
        ValueError: empty ``images``, an image that is not ``(H, W, 3)`` ``uint8``, ``size`` not an int > 0,
            non-finite mean/std or ``std <= 0`` (or 255 mean, 255 std or the normalised pixels not finite in float32),
            ``out`` with the wrong shape or dtype, an unknown ``resize``, or for ``orion_crop`` an odd ``size`` or a
            camera :func:`orion_crop_geometry` refuses.
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
    """An RGB uint8 image (H, W, 3) resized to ``size`` = (width, height) px with ``cv2.INTER_AREA`` (as
    :func:`preprocess`), returned as is when it already has that size: the fixed camera size a VLM's
    processor is given, so that every frame has the same token count T. Raises ValueError for a size that is
    not two positive ints or an image that is not (H, W, 3) uint8."""
    w, h = (int(v) for v in size)
    if w <= 0 or h <= 0:
        raise ValueError(f"camera size must be two positive ints (width, height), got {size!r}")
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 RGB image, got "
                         f"{getattr(image, 'dtype', type(image).__name__)} {getattr(image, 'shape', '')}")
    if image.shape[1] == w and image.shape[0] == h:
        return image
    return cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)
