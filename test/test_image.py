"""Tests for hybrid_vla_ros.vehicle.image on the embedded bag's real camera frames.

Bag: data/dgp_scene02_6cam_mcap (DDAD/DGP scene 02): 6 cameras as CompressedImage JPEG 1936x1216,
3 stamps each, plus camera0 as raw rgb8 484x304 (step 1452) at the same stamps. The raw frame is the
JPEG frame reduced 4x (INTER_AREA resize of our decode matches it to ~1.9 grey levels mean absolute
difference, correlation 0.999; not bit-exact, so it was made with another decoder/filter).

The last section cross-checks against the PyPI cv_bridge with real rclpy sensor_msgs messages.
"""

from __future__ import annotations

import array
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
from rosbags.highlevel import AnyReader

from hybrid_vla_ros.vehicle.image import (
    SUPPORTED_ENCODINGS,
    ImageDecodeError,
    compressed_msg_to_rgb,
    decode_compressed,
    decode_image,
    image_msg_to_rgb,
    preprocess,
)

BAG = Path(__file__).resolve().parents[1] / "data" / "dgp_scene02_6cam_mcap"
N_CAMERAS = 6
JPEG_SHAPE = (1216, 1936, 3)


def _stamp_ns(msg) -> int:
    return msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec


@pytest.fixture(scope="module")
def bag():
    """Camera messages of the bag: compressed[(cam, stamp)], raw[stamp] (rosbags objects) and their CDR bytes."""
    compressed, raw, cdr = {}, {}, {}
    with AnyReader([BAG]) as reader:
        conns = [c for c in reader.connections if "/image_raw" in c.topic]
        for conn, _, data in reader.messages(connections=conns):
            msg = reader.deserialize(data, conn.msgtype)
            cam = int(conn.topic.split("/")[3].removeprefix("camera"))
            stamp = _stamp_ns(msg)
            if conn.topic.endswith("/compressed"):
                compressed[(cam, stamp)] = msg
                cdr[("compressed", cam, stamp)] = bytes(data)
            else:
                raw[stamp] = msg
                cdr[("raw", cam, stamp)] = bytes(data)
    assert len(compressed) == 3 * N_CAMERAS and len(raw) == 3
    return SimpleNamespace(compressed=compressed, raw=raw, cdr=cdr, stamps=sorted(raw))


@pytest.fixture(scope="module")
def decoded(bag):
    return {key: compressed_msg_to_rgb(msg) for key, msg in bag.compressed.items()}


@pytest.fixture(scope="module")
def src(bag):
    """A real RGB frame (camera0 raw rgb8, 304x484) used to build every other encoding."""
    msg = bag.raw[bag.stamps[0]]
    img = np.frombuffer(msg.data, np.uint8).reshape(msg.height, msg.step)[:, : msg.width * 3]
    return img.reshape(msg.height, msg.width, 3).copy()


def _mad(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def _corr(a, b) -> float:
    return float(np.corrcoef(np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64))[0, 1])


def _quarter(img: np.ndarray) -> np.ndarray:
    return cv2.resize(img, (img.shape[1] // 4, img.shape[0] // 4), interpolation=cv2.INTER_AREA)


def _chroma_corr(out, ref) -> float:
    """Correlation of the R - B difference images: ~+1 for the right channel order, ~-1 when swapped."""
    o, r = out.astype(np.float64), ref.astype(np.float64)
    return _corr(o[..., 0] - o[..., 2], r[..., 0] - r[..., 2])


# ------------------------------------------------------------------------------ real bag frames
def test_all_six_cameras_decode_to_plausible_rgb(bag, decoded):
    for (cam, stamp), img in decoded.items():
        assert img.shape == JPEG_SHAPE and img.dtype == np.uint8 and img.flags.c_contiguous, (cam, stamp)
        assert 40 < img.mean() < 200 and img.std() > 30, (cam, stamp)
    # Same camera at consecutive stamps looks alike; different cameras at one stamp do not.
    small = {k: cv2.resize(v, (242, 152), interpolation=cv2.INTER_AREA) for k, v in decoded.items()}
    s0, s1 = bag.stamps[0], bag.stamps[1]
    for cam in range(N_CAMERAS):
        same = _mad(small[(cam, s0)], small[(cam, s1)])
        others = [_mad(small[(cam, s0)], small[(o, s0)]) for o in range(N_CAMERAS) if o != cam]
        assert same < 0.6 * min(others), (cam, same, others)


def test_compressed_matches_raw_rgb8_frame_of_same_stamp(bag, decoded):
    for stamp, raw in bag.raw.items():
        assert (raw.encoding, raw.width, raw.height, raw.step) == ("rgb8", 484, 304, 1452)
        raw_rgb = image_msg_to_rgb(raw)
        full = decoded[(0, stamp)]
        reduced = cv2.resize(full, (raw.width, raw.height), interpolation=cv2.INTER_AREA)
        assert _mad(reduced, raw_rgb) < 3.0
        assert _corr(reduced, raw_rgb) > 0.99
        # Channel order: the colour-difference images agree, and a swapped decode would anti-correlate.
        assert _chroma_corr(reduced, raw_rgb) > 0.98
        assert _chroma_corr(reduced[..., ::-1], raw_rgb) < -0.98
        assert _mad(reduced[..., ::-1], raw_rgb) > 2 * _mad(reduced, raw_rgb)
        # Frames of the other stamps are clearly further away: the pairing by stamp is real.
        for other in bag.stamps:
            if other != stamp:
                far = cv2.resize(decoded[(0, other)], (raw.width, raw.height), interpolation=cv2.INTER_AREA)
                assert _mad(far, raw_rgb) > 5 * _mad(reduced, raw_rgb)


def test_raw_rgb8_uses_step_and_copies(bag, src):
    msg = bag.raw[bag.stamps[0]]
    out = image_msg_to_rgb(msg)
    np.testing.assert_array_equal(out, src)
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.owndata
    assert not np.shares_memory(out, msg.data)


# ------------------------------------------------------------------- every accepted encoding
def _mosaic(rgb: np.ndarray, pattern: str) -> np.ndarray:
    """Sample an RGB image through a Bayer colour filter whose top-left 2x2 cell is ``pattern`` (ROS naming)."""
    channel = {"r": 0, "g": 1, "b": 2}
    out = np.empty(rgb.shape[:2], np.uint8)
    for dy in range(2):
        for dx in range(2):
            out[dy::2, dx::2] = rgb[dy::2, dx::2, channel[pattern[2 * dy + dx]]]
    return out


def _encode(rgb: np.ndarray, encoding: str, bigendian: bool = False):
    """(rows (H, row_bytes) uint8, expected RGB, max mean abs error) for ``rgb`` in ``encoding``."""
    h, w, _ = rgb.shape
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    alpha = np.random.default_rng(0).integers(0, 256, (h, w, 1), dtype=np.uint8)
    if encoding == "rgb8":
        return rgb.reshape(h, -1), rgb, 0.0
    if encoding == "bgr8":
        return np.ascontiguousarray(rgb[..., ::-1]).reshape(h, -1), rgb, 0.0
    if encoding == "rgba8":
        return np.concatenate([rgb, alpha], axis=2).reshape(h, -1), rgb, 0.0
    if encoding == "bgra8":
        return np.concatenate([rgb[..., ::-1], alpha], axis=2).reshape(h, -1), rgb, 0.0
    grey3 = np.repeat(grey[..., None], 3, axis=2)
    if encoding == "mono8":
        return grey, grey3, 0.0
    if encoding == "mono16":
        low = np.random.default_rng(1).integers(0, 256, (h, w), dtype=np.uint16)
        value = (grey.astype(np.uint16) << 8) | low  # high byte = grey, low byte = noise
        return value.astype(">u2" if bigendian else "<u2").view(np.uint8).reshape(h, -1), grey3, 0.0
    if encoding.startswith("bayer_"):
        return _mosaic(rgb, encoding[6:10]), rgb, 6.0
    if encoding in ("yuv422", "uyvy"):
        return cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_UYVY).reshape(h, -1), rgb, 2.0
    if encoding in ("yuv422_yuy2", "yuyv"):
        return cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_YUYV).reshape(h, -1), rgb, 2.0
    raise AssertionError(encoding)


def test_supported_encodings_list():
    assert set(SUPPORTED_ENCODINGS) == {
        "rgb8", "bgr8", "rgba8", "bgra8", "mono8", "mono16", "bayer_rggb8", "bayer_bggr8", "bayer_gbrg8",
        "bayer_grbg8", "yuv422", "uyvy", "yuv422_yuy2", "yuyv",
    }


@pytest.mark.parametrize("encoding", SUPPORTED_ENCODINGS)
def test_encoding_decodes_back_to_the_real_frame(src, encoding):
    rows, expected, tol = _encode(src, encoding)
    h, w, _ = src.shape
    out = decode_image(encoding, h, w, rows.shape[1], False, rows.tobytes())
    assert out.shape == (h, w, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    if tol == 0.0:
        np.testing.assert_array_equal(out, expected)
    else:
        assert _mad(out, expected) < tol
    if not encoding.startswith("mono"):
        # Right channel order, never silently swapped (compared at 1/4 scale: demosaicing blurs colour edges).
        assert _chroma_corr(_quarter(out), _quarter(src)) > 0.9


@pytest.mark.parametrize("bigendian", [False, True])
def test_mono16_takes_the_high_byte_in_either_byte_order(src, bigendian):
    rows, expected, _ = _encode(src, "mono16", bigendian)
    h, w, _ = src.shape
    out = decode_image("mono16", h, w, rows.shape[1], int(bigendian), rows.tobytes())
    np.testing.assert_array_equal(out, expected)
    # Reading with the wrong byte order gives the noise byte instead: clearly different.
    wrong = decode_image("mono16", h, w, rows.shape[1], int(not bigendian), rows.tobytes())
    assert _mad(wrong, expected) > 20


@pytest.mark.parametrize("pattern", ["rggb", "bggr", "gbrg", "grbg"])
def test_bayer_pattern_mapping(src, pattern):
    h, w, _ = src.shape
    # A red scene comes out red (not blue, not green) for every ROS pattern name.
    red = np.zeros((16, 20, 3), np.uint8)
    red[...] = (200, 30, 10)
    out = decode_image(f"bayer_{pattern}8", 16, 20, 20, 0, _mosaic(red, pattern).tobytes())
    np.testing.assert_allclose(out[2:-2, 2:-2].reshape(-1, 3).mean(0), (200, 30, 10), atol=2)
    # On the real frame the declared pattern beats every other pattern name clearly.
    mosaic = _mosaic(src, pattern).tobytes()
    right = decode_image(f"bayer_{pattern}8", h, w, w, 0, mosaic)
    assert _chroma_corr(_quarter(right), _quarter(src)) > 0.9
    for other in ("rggb", "bggr", "gbrg", "grbg"):
        if other != pattern:
            wrong = decode_image(f"bayer_{other}8", h, w, w, 0, mosaic)
            assert _mad(right, src) < 0.7 * _mad(wrong, src)
            assert _chroma_corr(_quarter(wrong), _quarter(src)) < 0.1
    # Same result as OpenCV's own top-left-named code (OpenCV >= 4.10 aliases, an independent name table).
    opencv_code = getattr(cv2, f"COLOR_Bayer{pattern.upper()}2RGB")
    np.testing.assert_array_equal(decode_image(f"bayer_{pattern}8", h, w, w, 0, mosaic),
                                  cv2.cvtColor(_mosaic(src, pattern), opencv_code))


def test_yuv_byte_orders_are_not_confused(src):
    h, w, _ = src.shape
    uyvy = cv2.cvtColor(src, cv2.COLOR_RGB2YUV_UYVY).tobytes()
    yuyv = cv2.cvtColor(src, cv2.COLOR_RGB2YUV_YUYV).tobytes()
    for name in ("yuv422", "uyvy"):
        assert _mad(decode_image(name, h, w, 2 * w, 0, uyvy), src) < 2
        assert _mad(decode_image(name, h, w, 2 * w, 0, yuyv), src) > 20
    for name in ("yuv422_yuy2", "yuyv"):
        assert _mad(decode_image(name, h, w, 2 * w, 0, yuyv), src) < 2
        assert _mad(decode_image(name, h, w, 2 * w, 0, uyvy), src) > 20
    red = np.zeros((8, 10, 3), np.uint8)
    red[...] = (200, 30, 10)
    out = decode_image("yuv422", 8, 10, 20, 0, cv2.cvtColor(red, cv2.COLOR_RGB2YUV_UYVY).tobytes())
    np.testing.assert_allclose(out.reshape(-1, 3).mean(0), (200, 30, 10), atol=4)


@pytest.mark.parametrize("encoding", SUPPORTED_ENCODINGS)
def test_padded_step_gives_the_same_image(src, encoding):
    rows, _, _ = _encode(src, encoding)
    h, row_bytes = rows.shape
    w = src.shape[1]
    tight = decode_image(encoding, h, w, row_bytes, False, rows.tobytes())
    pad = 7  # odd on purpose: rows start at unaligned offsets
    padded = np.full((h, row_bytes + pad), 0xA5, np.uint8)
    padded[:, :row_bytes] = rows
    out = decode_image(encoding, h, w, row_bytes + pad, False, padded.tobytes())
    np.testing.assert_array_equal(out, tight)
    assert out.flags.c_contiguous


def test_accepts_every_buffer_type_without_touching_it(src):
    h, w, _ = src.shape
    payload = np.ascontiguousarray(src[..., ::-1]).tobytes()
    buffers = [payload, bytearray(payload), array.array("B", payload), memoryview(payload),
               np.frombuffer(payload, np.uint8).copy()]
    for data in buffers:
        out = decode_image("bgr8", h, w, 3 * w, 0, data)
        np.testing.assert_array_equal(out, src)
        out[...] = 0  # the result is ours to modify; the message data is unchanged
        assert bytes(data) == payload


@pytest.mark.parametrize(
    "encoding, height, width, step, nbytes, match",
    [
        ("16UC1", 4, 4, 8, 32, "no colour semantics"),
        ("32FC1", 4, 4, 16, 64, "no colour semantics"),
        ("8UC3", 4, 4, 12, 48, "no colour semantics"),
        ("rgb16", 4, 4, 24, 96, "16 bits"),
        ("bayer_rggb16", 4, 4, 8, 32, "16 bits"),
        ("jpeg", 4, 4, 12, 48, "decode_compressed"),
        ("RGB8", 4, 4, 12, 48, "lower case"),
        ("nv21", 4, 4, 4, 24, "not a supported"),
        ("", 4, 4, 12, 48, "not a supported"),
        ("rgb8", 0, 0, 0, 0, "empty"),
        ("rgb8", 0, 4, 12, 0, "empty"),
        ("rgb8", 4, 0, 12, 48, "empty"),
        ("rgb8", -4, 4, 12, 48, "empty"),
        ("rgb8", 4, 4, 11, 44, "step 11 < width"),
        ("mono16", 4, 4, 7, 28, "step 7 < width"),
        ("rgb8", 4, 4, 12, 47, "too short"),
        ("rgb8", 4, 4, 12, 49, "too long"),
        ("yuv422", 4, 3, 6, 24, "must be even"),
    ],
)
def test_decode_image_rejects(encoding, height, width, step, nbytes, match):
    with pytest.raises(ImageDecodeError, match=match):
        decode_image(encoding, height, width, step, 0, bytes(max(nbytes, 0)))


def test_decode_image_rejects_bad_field_types():
    with pytest.raises(ImageDecodeError, match="height must be an integer"):
        decode_image("rgb8", 4.0, 4, 12, 0, bytes(48))
    with pytest.raises(ImageDecodeError, match="byte buffer"):
        decode_image("rgb8", 4, 4, 12, 0, [0] * 48)
    with pytest.raises(ImageDecodeError, match="encoding must be a str"):
        decode_image(None, 4, 4, 12, 0, bytes(48))
    assert issubclass(ImageDecodeError, ValueError)


def test_msg_wrappers_are_duck_typed(src):
    h, w, _ = src.shape
    msg = SimpleNamespace(encoding="rgb8", height=h, width=w, step=3 * w, is_bigendian=0, data=src.tobytes())
    np.testing.assert_array_equal(image_msg_to_rgb(msg), src)
    ok, jpg = cv2.imencode(".jpg", src[..., ::-1])
    out = compressed_msg_to_rgb(SimpleNamespace(format="jpeg", data=jpg))
    assert _mad(out, src) < 3
    with pytest.raises(ImageDecodeError, match="not an Image"):
        image_msg_to_rgb(SimpleNamespace(encoding="rgb8", height=h))
    with pytest.raises(ImageDecodeError, match="not a CompressedImage"):
        compressed_msg_to_rgb(SimpleNamespace(data=b""))


# ------------------------------------------------------------------------------- compressed
def test_compressed_format_strings(bag, decoded, src):
    msg = bag.compressed[(0, bag.stamps[0])]
    ref = decoded[(0, bag.stamps[0])]
    assert msg.format == "jpeg"
    for fmt in ("jpeg", "JPEG", "jpg", " jpeg ", "rgb8; jpeg compressed bgr8", "bgr8; jpeg compressed bgr8",
                "mono8; jpeg compressed mono8"):
        np.testing.assert_array_equal(decode_compressed(fmt, msg.data), ref, err_msg=fmt)
    # PNG (lossless): exact. imencode takes BGR memory order, as compressed_image_transport does ("compressed bgr8").
    ok, png = cv2.imencode(".png", src[..., ::-1])
    for fmt in ("png", "rgb8; png compressed bgr8", "bgra8; png compressed bgra8"):
        np.testing.assert_array_equal(decode_compressed(fmt, png), src, err_msg=fmt)
    # A colour original whose target is not bgr: the publisher stored R, G, B bytes (image_transport rule).
    ok, png_rgb_memory = cv2.imencode(".png", src)
    np.testing.assert_array_equal(decode_compressed("rgb8; png compressed rgb8", png_rgb_memory), src)
    # Greyscale payloads are replicated.
    grey = cv2.cvtColor(src, cv2.COLOR_RGB2GRAY)
    ok, png_grey = cv2.imencode(".png", grey)
    out = decode_compressed("mono8; png compressed mono8", png_grey)
    np.testing.assert_array_equal(out, np.repeat(grey[..., None], 3, axis=2))


def test_compressed_rejects_corrupt_truncated_and_mislabelled(bag, src):
    jpeg = bag.compressed[(0, bag.stamps[0])].data.tobytes()
    ok, png = cv2.imencode(".png", src)
    png = png.tobytes()
    cases = [
        ("jpeg", jpeg[: len(jpeg) // 2], "truncated"),
        ("jpeg", jpeg[:-2], "truncated"),
        ("jpeg", jpeg[:4] + bytes(400) + jpeg[404:], "corrupt"),  # tables and frame header zeroed
        ("jpeg", bytes(range(256)) * 4, "SOI"),
        ("jpeg", b"", "empty"),
        ("jpeg", png, "SOI"),
        ("png", jpeg, "PNG signature"),
        ("png", png[: len(png) // 2], "corrupt or truncated"),
        ("png", png[:-12], "corrupt or truncated"),
        ("tiff", jpeg, "unsupported"),
        ("", jpeg, "unsupported"),
        ("16UC1; compressedDepth png", png, "compressedDepth"),
        ("rgb8; webp compressed bgr8", jpeg, "unsupported"),
    ]
    for fmt, data, match in cases:
        with pytest.raises(ImageDecodeError, match=match):
            decode_compressed(fmt, data)
    # Zero padding after the end-of-image marker is tolerated.
    assert decode_compressed("jpeg", jpeg + bytes(64)).shape == JPEG_SHAPE


# ------------------------------------------------------------------------------- preprocess
def test_preprocess_real_frames(bag, decoded):
    images = [decoded[(cam, bag.stamps[0])] for cam in range(N_CAMERAS)]
    mean, std, size = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711), 64
    out = preprocess(images, size, mean, std)
    assert out.shape == (N_CAMERAS, 3, size, size) and out.dtype == torch.float32
    for cam, img in enumerate(images):
        resized = cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA).astype(np.float64) / 255.0
        expected = ((resized - mean) / std).transpose(2, 0, 1)
        np.testing.assert_allclose(out[cam].numpy(), expected, atol=1e-5)
    # Written in place into a preallocated tensor, no new tensor.
    buf = torch.full((N_CAMERAS, 3, size, size), float("nan"))
    ptr = buf.data_ptr()
    res = preprocess(images, size, mean, std, out=buf)
    assert res is buf and buf.data_ptr() == ptr
    torch.testing.assert_close(buf, out)
    # Scalar mean/std, different input sizes.
    mixed = [images[0], cv2.resize(images[1], (640, 360))]
    res = preprocess(mixed, 32, 0.5, 0.5)
    assert res.shape == (2, 3, 32, 32) and float(res.min()) >= -1.0 and float(res.max()) <= 1.0


def test_preprocess_rejects_bad_input(decoded):
    img = next(iter(decoded.values()))
    with pytest.raises(ValueError, match="empty"):
        preprocess([], 32, 0.5, 0.5)
    with pytest.raises(ValueError, match="uint8 RGB"):
        preprocess([img.astype(np.float32)], 32, 0.5, 0.5)
    with pytest.raises(ValueError, match="uint8 RGB"):
        preprocess([img[..., 0]], 32, 0.5, 0.5)
    with pytest.raises(ValueError, match="std must be > 0"):
        preprocess([img], 32, 0.5, (0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="finite in float32"):  # 255 x 1e37 overflows float32: NaN pixels
        preprocess([img], 32, 1e37, 1e37)
    with pytest.raises(ValueError, match="finite in float32"):  # 1 / (255 x 1e-40) overflows
        preprocess([img], 32, 0.5, 1e-40)
    # on another device than the CPU the uint8 image crosses and is normalised there ("meta": shapes only)
    assert preprocess([img], 32, 0.5, 0.5, out=torch.empty((1, 3, 32, 32), device="meta")).device.type == "meta"
    with pytest.raises(ValueError, match="3 values"):
        preprocess([img], 32, (0.5, 0.5), 0.5)
    with pytest.raises(ValueError, match="size"):
        preprocess([img], 0, 0.5, 0.5)
    with pytest.raises(ValueError, match="out must be"):
        preprocess([img], 32, 0.5, 0.5, out=torch.empty((1, 3, 32, 32), dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        preprocess([img], 32, 0.5, 0.5, out=torch.empty((2, 3, 32, 32)))


# =========================================================================== ROS cross-checks
# This section builds real rclpy sensor_msgs messages and compares with the PyPI cv_bridge port.
# Differences in that port (documented in /work/shared/notes/ros2-from-pypi.md and found here): it
# ignores ``step`` (no padded rows), has no yuv422 type, and its bayer_grbg8 -> rgb8 entry is keyed
# "bayer_grbg" so that conversion raises KeyError; those cases are checked against OpenCV above.
from cv_bridge import CvBridge  # noqa: E402
from rclpy.serialization import deserialize_message  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402

CV_BRIDGE_ENCODINGS = ("rgb8", "bgr8", "rgba8", "bgra8", "mono8", "bayer_rggb8", "bayer_bggr8", "bayer_gbrg8")


@pytest.mark.parametrize("encoding", CV_BRIDGE_ENCODINGS)
def test_matches_cv_bridge_on_rclpy_image(src, encoding):
    rows, _, _ = _encode(src, encoding)
    h, w, _ = src.shape
    msg = Image()
    msg.height, msg.width, msg.step = h, w, rows.shape[1]
    msg.encoding, msg.is_bigendian = encoding, 0
    msg.data = rows.tobytes()  # rclpy stores array('B'); assigning bytes is the fast path
    assert isinstance(msg.data, array.array)
    ours = image_msg_to_rgb(msg)
    theirs = CvBridge().imgmsg_to_cv2(msg, "rgb8")
    np.testing.assert_array_equal(ours, theirs)


def test_rclpy_messages_from_bag_cdr(bag, decoded, src):
    """The bag's CDR bytes deserialized by rclpy decode like the rosbags objects (and like cv_bridge)."""
    stamp = bag.stamps[0]
    raw = deserialize_message(bag.cdr[("raw", 0, stamp)], Image)
    assert (raw.encoding, raw.step) == ("rgb8", 1452)
    np.testing.assert_array_equal(image_msg_to_rgb(raw), src)
    for cam in range(N_CAMERAS):
        msg = deserialize_message(bag.cdr[("compressed", cam, stamp)], CompressedImage)
        ours = compressed_msg_to_rgb(msg)
        np.testing.assert_array_equal(ours, decoded[(cam, stamp)])
        theirs = CvBridge().compressed_imgmsg_to_cv2(msg, "rgb8")
        assert np.abs(ours.astype(np.int16) - theirs.astype(np.int16)).max() <= 1


# ------------------------------------------------------------------ scaled-down JPEG decode (fast_jpeg_decode)
def _dgp_jpegs():
    from rosbags.typesys import Stores, get_typestore

    from hybrid_vla_ros.util.bags import read_bag

    store = get_typestore(Stores.ROS2_KILTED)
    bag = Path(__file__).resolve().parents[1] / "data" / "dgp_scene02_6cam_mcap"
    msgs = [m for m in read_bag(bag) if m.topic.endswith("/image_raw/compressed")][:6]
    return [store.deserialize_cdr(m.raw, m.msgtype) for m in msgs]


def test_jpeg_size_reads_the_start_of_frame_of_real_camera_images():
    from hybrid_vla_ros.vehicle.image import jpeg_size

    for msg in _dgp_jpegs():
        assert jpeg_size(np.frombuffer(bytes(msg.data), np.uint8)) == (1216, 1936)
    assert jpeg_size(np.frombuffer(b"\xff\xd8\x00\x00garbage", np.uint8)) is None


def test_png_size_reads_the_header_of_a_real_camera_image_encoded_by_opencv():
    """png_size (the prefix's size check of a PNG camera against its CameraInfo) on a bag frame that OpenCV
    encodes as PNG at a size that is not square, so height and width cannot be swapped unseen."""
    from hybrid_vla_ros.vehicle.image import png_size

    msg = _dgp_jpegs()[0]
    picture = cv2.imdecode(np.frombuffer(bytes(msg.data), np.uint8), cv2.IMREAD_COLOR)[:300, :500]
    ok, png = cv2.imencode(".png", picture)
    assert ok and png_size(png) == (300, 500)
    assert png_size(np.frombuffer(bytes(msg.data), np.uint8)) is None  # a JPEG is not a PNG
    assert png_size(png[:20]) is None


@pytest.mark.parametrize("min_size, factor", [(64, 8), (152, 8), (153, 4), (304, 4), (608, 2), (609, 1)])
def test_scaled_down_decode_keeps_at_least_min_size_and_the_picture(min_size, factor):
    """Real 1936x1216 camera JPEGs: the largest factor that keeps both sides >= min_size, RGB order kept,
    and after the model's resize the picture matches a full decode within a few grey levels."""
    from hybrid_vla_ros.vehicle.image import decode_compressed, jpeg_reduction

    assert jpeg_reduction(1216, 1936, min_size) == factor
    for msg in _dgp_jpegs()[:2]:
        full = decode_compressed(msg.format, msg.data)
        fast = decode_compressed(msg.format, msg.data, min_size=min_size)
        assert fast.shape == (-(-1216 // factor), -(-1936 // factor), 3) and min(fast.shape[:2]) >= min_size
        if factor == 1:
            assert np.array_equal(fast, full)
            continue
        side = min(min_size, 128)
        a = cv2.resize(full, (side, side), interpolation=cv2.INTER_AREA).astype(int)
        b = cv2.resize(fast, (side, side), interpolation=cv2.INTER_AREA).astype(int)
        assert np.abs(a - b).mean() < 4.0, "same picture, same channel order"
        swapped = np.abs(a - b[..., ::-1]).mean()
        assert swapped > np.abs(a - b).mean(), "RGB, not BGR"


# ------------------------------------------------------------------ JPEG decoder and resize filters
NUSCENES = Path(__file__).resolve().parents[2] / "shared" / "data" / "nuscenes_scene0061_mmdet3d_demo"


def _real_jpegs() -> list[tuple[str, bytes]]:
    """(what, payload): the embedded bag's six 1936x1216 cameras and, when ../shared is beside the repo, the six
    1600x900 nuScenes CAM_* JPEGs (see its SOURCE.txt)."""
    out = [(f"dgp camera {i}", bytes(m.data)) for i, m in enumerate(_dgp_jpegs()[:N_CAMERAS])]
    out += [(f.name, f.read_bytes()) for f in sorted(NUSCENES.glob("*CAM_*.jpg"))[:6]]
    return out


def test_simplejpeg_decodes_the_pixels_opencv_decodes(monkeypatch, src):
    """The JPEG decoder in use (simplejpeg when installed) returns OpenCV's pixels exactly: full size, each
    libjpeg scale-down, the payload's channel-order rules, a greyscale JPEG; a payload it refuses (a damaged
    stream, which libjpeg only warns about) is decoded by OpenCV as before."""
    import hybrid_vla_ros.vehicle.image as image

    assert image.JPEG_DECODER == "simplejpeg", "requirements.txt installs simplejpeg"
    ok, grey = cv2.imencode(".jpg", cv2.cvtColor(src, cv2.COLOR_RGB2GRAY))
    cases = [(what, fmt, data, min_size) for what, data in _real_jpegs()
             for fmt in ("jpeg", "rgb8; jpeg compressed rgb8") for min_size in (None, 64, 153, 304)]
    cases.append(("grey", "mono8; jpeg compressed mono8", grey.tobytes(), None))
    assert len(cases) >= 2 * 4 * 6 + 1
    damaged = bytearray(_real_jpegs()[0][1])
    damaged[len(damaged) // 2: len(damaged) // 2 + 64] = bytes(64)  # entropy-coded data zeroed: libjpeg warns
    cases.append(("damaged", "jpeg", bytes(damaged), None))
    ours = [decode_compressed(fmt, data, min_size) for _, fmt, data, min_size in cases]
    monkeypatch.setattr(image, "JPEG_DECODER", "opencv")
    for (what, fmt, data, min_size), got in zip(cases, ours):
        np.testing.assert_array_equal(got, decode_compressed(fmt, data, min_size), err_msg=f"{what} {fmt} {min_size}")
    assert image._decode_jpeg_simplejpeg(np.frombuffer(bytes(damaged), np.uint8), True, 1, None) is None


@pytest.mark.parametrize("size", [64, 128, 448])
def test_resize_filters(bag, decoded, size):
    """``area`` is OpenCV's INTER_AREA exactly; ``bilinear`` / ``bicubic`` follow Pillow's resize with the same
    filter (what Hugging Face processors' ``resample`` 2 / 3 run) within 1 level on at most 0.5 % of the values,
    on the real cameras (the embedded bag's and, when present, nuScenes'), from an rgb8 message viewed in place."""
    from PIL import Image

    images = [decoded[(cam, bag.stamps[0])] for cam in range(N_CAMERAS)]
    images += [compressed_msg_to_rgb(SimpleNamespace(format="jpeg", data=d)) for w, d in _real_jpegs() if "CAM" in w]
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)

    def pixels(out):  # back to 0..255 levels, (n, S, S, 3)
        m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
        return ((out * s + m) * 255.0).permute(0, 2, 3, 1).numpy()

    area = pixels(preprocess(images, size, mean, std))
    for img, got in zip(images, area):
        np.testing.assert_allclose(got, cv2.resize(img, (size, size), interpolation=cv2.INTER_AREA), atol=1e-3)
    for name, pil in (("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC)):
        got = pixels(preprocess(images, size, mean, std, resize=name))
        for img, g in zip(images, got):
            ref = np.asarray(Image.fromarray(img).resize((size, size), pil)).astype(np.float64)
            diff = np.abs(g - ref)
            assert diff.max() < 1.0 + 1e-3 and (diff > 0.5).mean() <= 0.005, (name, diff.max(), (diff > 0.5).mean())
        assert np.abs(got - area).mean() > 0.05, "another filter than area"
    with pytest.raises(ValueError, match="image_resize must be one of area, bilinear, bicubic"):
        preprocess(images, size, mean, std, resize="lanczos")


def test_raw_rgb8_view_is_read_in_place(bag):
    """``copy=False`` (the prefix's raw path): an rgb8 message's pixels are viewed, not copied, and preprocess
    gives what it gives on the copy."""
    msg = bag.raw[bag.stamps[0]]
    message = SimpleNamespace(encoding="rgb8", height=msg.height, width=msg.width, step=msg.step, is_bigendian=0,
                             data=array.array("B", bytes(msg.data)))
    view, copy = image_msg_to_rgb(message, copy=False), image_msg_to_rgb(message)
    assert np.shares_memory(view, np.frombuffer(message.data, np.uint8)) and not np.shares_memory(copy, view)
    np.testing.assert_array_equal(view, copy)
    for resize in ("area", "bicubic"):
        torch.testing.assert_close(preprocess([view], 96, 0.5, 0.5, resize=resize),
                                   preprocess([copy], 96, 0.5, 0.5, resize=resize), rtol=0, atol=0)
