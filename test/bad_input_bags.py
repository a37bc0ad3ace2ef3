"""Small rosbag2 bags of bad camera and odometry input, built from the real frames of the embedded bag.

Helpers only (no tests): ``test_bad_inputs.py`` plays these bags through the real node processes with
``hybrid-vla replay`` and checks what happened to every frame.

Every bag is an MCAP rosbag2 folder written with rosbags' ``Writer`` and the ``ROS2_KILTED`` typestore.
It holds the topics ``hybrid-vla replay`` plays (see ``hybrid_vla_ros.tools.replay``):
``/sensing/camera/camera<i>/image_raw`` (``sensor_msgs/msg/Image``) or ``.../image_raw/compressed``
(``sensor_msgs/msg/CompressedImage``) for i = 0..5, and ``/localization/kinematic_state``
(``nav_msgs/msg/Odometry``). The pictures are the 6 real JPEG cameras of
``data/dgp_scene02_6cam_mcap`` (3 instants), decoded and reduced to 484x304, then re-encoded in the
layout a frame exercises. Good frames and bad ones alternate (good, bad, good), so the test can see
that the frame after a bad one is processed normally.

Time: a bag's receive times (when the replay sends a message) start at :data:`T0_NS`; the cameras of one
frame go out 1 ms apart. A good frame's header stamps are its send time plus ``2 ms x camera`` (a real
rig's trigger spread, well inside the 50 ms sync tolerance), so its synchronized stamp (the newest of
the set, which the Trajectory carries) is send time + 10 ms. Odometry runs at 20 Hz on a straight
line at constant speed, stamped 25 ms off the frame grid, so two messages bracket every frame stamp.

What each frame should produce is recorded with it (:class:`Frame`): a Trajectory, or drops counted by
cause under the names report.json uses (``prefix.decode_error``, ``suffix.stale_odometry``, ...).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np

REPO = Path(__file__).resolve().parent.parent
EMBEDDED_BAG = REPO / "data" / "dgp_scene02_6cam_mcap"
N_CAMERAS = 6
WIDTH, HEIGHT = 484, 304  # raw frames: the embedded bag's camera0 image_raw size (1936x1216 / 4)
T0_NS = 1_700_000_000 * 10**9  # the embedded bag's first stamp
MS = 1_000_000
CAMERA_SPREAD_NS = 2 * MS  # header stamp of camera i = frame time + i * 2 ms
IMAGE_TOPIC = "/sensing/camera/camera{}/image_raw"
ODOMETRY_TOPIC = "/localization/kinematic_state"
IMAGE_TYPE = "sensor_msgs/msg/Image"
COMPRESSED_TYPE = "sensor_msgs/msg/CompressedImage"
ODOMETRY_TYPE = "nav_msgs/msg/Odometry"
SPEED_MPS = 1.25
FUTURE_NS = 3600 * 10**9  # "far in the future": one hour ahead

#: Encodings whose decode gives back exactly the RGB pixels they were made from.
LOSSLESS_ENCODINGS = ("rgb8", "bgr8", "rgba8", "bgra8")


def typestore():
    """The ROS2_KILTED rosbags typestore (sensor_msgs, nav_msgs, std_msgs)."""
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(Stores.ROS2_KILTED)


# ------------------------------------------------------------------------------------------ real frames
@functools.lru_cache(maxsize=1)
def source_frames() -> tuple[tuple[np.ndarray, ...], ...]:
    """The embedded bag's 3 instants x 6 cameras as ``(HEIGHT, WIDTH, 3)`` uint8 RGB, camera-index order.

    Decoded with OpenCV straight from the bag's JPEG bytes (not through the code under test) and
    reduced with INTER_AREA. Returned arrays are read-only; copy before changing them.
    """
    from rosbags.highlevel import AnyReader

    by_stamp: dict[int, dict[int, np.ndarray]] = {}
    with AnyReader([EMBEDDED_BAG]) as reader:
        conns = [c for c in reader.connections if c.topic.endswith("/image_raw/compressed")]
        for conn, _, raw in reader.messages(connections=conns):
            msg = reader.deserialize(raw, conn.msgtype)
            cam = int(conn.topic.split("/")[3].removeprefix("camera"))
            bgr = cv2.imdecode(np.asarray(msg.data, dtype=np.uint8), cv2.IMREAD_COLOR)
            rgb = cv2.cvtColor(cv2.resize(bgr, (WIDTH, HEIGHT), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB)
            rgb.setflags(write=False)
            stamp = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
            by_stamp.setdefault(stamp, {})[cam] = rgb
    frames = tuple(tuple(cams[i] for i in range(N_CAMERAS)) for _, cams in sorted(by_stamp.items()))
    assert len(frames) == 3 and all(len(f) == N_CAMERAS for f in frames), "the embedded bag changed"
    return frames


@functools.lru_cache(maxsize=1)
def start_pose() -> tuple[float, float, float, float]:
    """(x, y, z, yaw) of the embedded bag's first odometry message: where the synthetic track starts."""
    from rosbags.highlevel import AnyReader

    with AnyReader([EMBEDDED_BAG]) as reader:
        conns = [c for c in reader.connections if c.topic == ODOMETRY_TOPIC]
        conn, _, raw = next(iter(reader.messages(connections=conns)))
        msg = reader.deserialize(raw, conn.msgtype)
    p, q = msg.pose.pose.position, msg.pose.pose.orientation
    yaw = math.atan2(2 * (q.w * q.z + q.x * q.y), 1 - 2 * (q.y * q.y + q.z * q.z))
    return float(p.x), float(p.y), float(p.z), yaw


def resized(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """``rgb`` resized to width x height (INTER_AREA), C-contiguous."""
    return np.ascontiguousarray(cv2.resize(rgb, (width, height), interpolation=cv2.INTER_AREA))


# ------------------------------------------------------------------------------------- raw encoders
def _grey(rgb: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)


def _mosaic(rgb: np.ndarray, pattern: str) -> np.ndarray:
    """Bayer mosaic; ``pattern`` names the 2x2 cell at the top-left corner as ROS does ('rggb': R G / G B)."""
    channel = {"r": 0, "g": 1, "b": 2}
    out = np.empty(rgb.shape[:2], np.uint8)
    for letter, (dy, dx) in zip(pattern, ((0, 0), (0, 1), (1, 0), (1, 1))):
        out[dy::2, dx::2] = rgb[dy::2, dx::2, channel[letter]]
    return out


def encode_rows(rgb: np.ndarray, encoding: str, bigendian: bool = False) -> np.ndarray:
    """The pixel rows of ``rgb`` in a ROS encoding, ``(height, width * bytes_per_pixel)`` uint8, no padding.

    Alpha is not constant (it repeats the red channel) and the mono16 low byte is noise, so a decoder
    that read either as colour would be visibly wrong.
    """
    h, w, _ = rgb.shape
    if encoding == "rgb8":
        px = rgb
    elif encoding == "bgr8":
        px = rgb[..., ::-1]
    elif encoding in ("rgba8", "bgra8"):
        colour = rgb if encoding == "rgba8" else rgb[..., ::-1]
        px = np.concatenate([colour, 255 - rgb[..., :1]], axis=2)
    elif encoding == "mono8":
        px = _grey(rgb)
    elif encoding == "mono16":
        low = np.random.default_rng(7).integers(0, 256, (h, w), dtype=np.uint16)
        value = (_grey(rgb).astype(np.uint16) << 8) | low  # high byte: the grey level
        return value.astype(">u2" if bigendian else "<u2").view(np.uint8).reshape(h, 2 * w)
    elif encoding.startswith("bayer_"):
        px = _mosaic(rgb, encoding[len("bayer_"):-1])
    elif encoding in ("yuv422", "uyvy"):
        px = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2YUV_UYVY)
    elif encoding in ("yuv422_yuy2", "yuyv"):
        px = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2YUV_YUYV)
    else:
        raise ValueError(f"no encoder for {encoding!r}")
    return np.ascontiguousarray(px).reshape(h, -1)


def padded(rows: np.ndarray, pad: int, fill: int = 0xEE) -> np.ndarray:
    """``rows`` with ``pad`` junk bytes at the end of every row (legal: ``step > width * bpp``)."""
    out = np.full((rows.shape[0], rows.shape[1] + pad), fill, np.uint8)
    out[:, : rows.shape[1]] = rows
    return out


# ------------------------------------------------------------------------------- compressed encoders
def jpeg(bgr_or_grey: np.ndarray, quality: int = 90) -> bytes:
    ok, buf = cv2.imencode(".jpg", bgr_or_grey, [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


def png(pixels: np.ndarray) -> bytes:
    ok, buf = cv2.imencode(".png", pixels)
    assert ok
    return buf.tobytes()


def compressed_payload(rgb: np.ndarray, fmt: str) -> bytes:
    """Bytes a compressed_image_transport publisher would send for ``fmt`` (what decode must undo).

    A bare ``jpeg``/``png`` and a ``"... compressed bgr8"`` target hold a normal (BGR) colour picture;
    ``"rgb8; png compressed rgb8"`` holds the RGB bytes handed to the encoder as they are; mono8 is grey;
    ``"bgra8; png compressed bgra8"`` keeps an alpha channel.
    """
    bgr = np.ascontiguousarray(rgb[..., ::-1])
    kind = fmt.lower()
    if kind in ("jpeg", "jpg") or kind.endswith("jpeg compressed bgr8"):
        return jpeg(bgr)
    if kind in ("png",) or kind.endswith("png compressed bgr8"):
        return png(bgr)
    if kind == "rgb8; png compressed rgb8":
        return png(np.ascontiguousarray(rgb))
    if kind == "mono8; jpeg compressed mono8":
        return jpeg(_grey(rgb))
    if kind == "bgra8; png compressed bgra8":
        return png(np.concatenate([bgr, 255 - rgb[..., :1]], axis=2))
    raise ValueError(f"no encoder for format {fmt!r}")


def corrupt_jpeg_header(data: bytes) -> bytes:
    """The JPEG with 600 bytes from offset 20 overwritten with noise: SOI and EOI markers intact, the
    quantization / Huffman tables and frame header gone, so only the decoder itself can tell."""
    noise = np.random.default_rng(3).integers(0, 256, 600, dtype=np.uint8).tobytes()
    return data[:20] + noise + data[20 + len(noise):]


def damage_jpeg_scan(data: bytes) -> bytes:
    """The JPEG with 64 zero bytes in the middle of its entropy-coded data. libjpeg warns ("Corrupt JPEG
    data") and still returns a (damaged) picture; OpenCV does not report it (core/image.py documents it)."""
    mid = len(data) // 2
    return data[:mid] + bytes(64) + data[mid + 64:]


def corrupt_png_data(data: bytes) -> bytes:
    """The PNG with 256 bytes in the middle of its image data inverted (the IDAT CRC no longer matches)."""
    mid = len(data) // 2
    middle = bytes(b ^ 0xFF for b in data[mid: mid + 256])
    return data[:mid] + middle + data[mid + 256:]


# --------------------------------------------------------------------------------- message builders
def _header(store, stamp_ns: int | None, frame_id: str, sec_nanosec: tuple[int, int] | None = None):
    Header = store.types["std_msgs/msg/Header"]
    Time = store.types["builtin_interfaces/msg/Time"]
    sec, nanosec = sec_nanosec if sec_nanosec is not None else divmod(stamp_ns, 10**9)
    return Header(stamp=Time(sec=sec, nanosec=nanosec), frame_id=frame_id)


def image_msg(store, header, encoding: str, height: int, width: int, step: int, data, bigendian: bool = False):
    Image = store.types[IMAGE_TYPE]
    return Image(header=header, height=height, width=width, encoding=encoding, is_bigendian=int(bigendian),
                 step=step, data=np.frombuffer(bytes(data), np.uint8).copy())


def compressed_msg(store, header, fmt: str, data: bytes):
    CompressedImage = store.types[COMPRESSED_TYPE]
    return CompressedImage(header=header, format=fmt, data=np.frombuffer(bytes(data), np.uint8).copy())


def odometry_msg(store, stamp_ns: int, x: float, y: float, z: float, yaw: float, speed: float,
                 quaternion: tuple[float, float, float, float] | None = None):
    t = store.types
    q = quaternion if quaternion is not None else (0.0, 0.0, math.sin(yaw / 2), math.cos(yaw / 2))
    pose = t["geometry_msgs/msg/Pose"](position=t["geometry_msgs/msg/Point"](x=x, y=y, z=z),
                                       orientation=t["geometry_msgs/msg/Quaternion"](x=q[0], y=q[1], z=q[2], w=q[3]))
    zero = t["geometry_msgs/msg/Vector3"](x=0.0, y=0.0, z=0.0)
    twist = t["geometry_msgs/msg/Twist"](linear=t["geometry_msgs/msg/Vector3"](x=speed, y=0.0, z=0.0), angular=zero)
    return t[ODOMETRY_TYPE](
        header=_header(store, stamp_ns, "map"), child_frame_id="base_link",
        pose=t["geometry_msgs/msg/PoseWithCovariance"](pose=pose, covariance=np.zeros(36)),
        twist=t["geometry_msgs/msg/TwistWithCovariance"](twist=twist, covariance=np.zeros(36)))


# ------------------------------------------------------------------------------------------ the bags
@dataclass
class Frame:
    """One frame of a bag: 6 camera messages (or fewer) sent from ``t_ns`` on, and what it should cause.

    Attributes:
        label: what the frame exercises, e.g. ``"mono16 big-endian"`` or ``"16UC1 on camera 2"``.
        t_ns: receive time of its camera-0 message in the bag (camera i follows i ms later).
        stamps: header stamp (ns) of each camera's message; ``None`` where that camera sends nothing.
        msgs: the rosbags message of each camera (``None`` where it sends nothing).
        trajectory: True when a Trajectory stamped :attr:`trajectory_stamp` must come out.
        drops: drops this frame must cause, ``{report cause: count}`` (e.g. ``{"prefix.decode_error": 1}``).
        discarded: camera messages of this frame the synchronizer must throw away as ``unsynced`` or
            ``queue_overflow`` (which of the two depends on arrival order, so only the total is known).
        known_issue: why the frame does not (yet) do what the reliability goal wants (see the test).
        intact: False when a camera's picture is knowingly damaged yet decodable, so the decoded
            pictures need not match their source.
        source: which of the embedded bag's 3 instants the pictures come from (``source_frames()[source]``).
    """

    label: str
    t_ns: int
    stamps: list
    msgs: list
    trajectory: bool = True
    drops: dict = field(default_factory=dict)
    discarded: int = 0
    known_issue: str = ""
    intact: bool = True
    source: int = 0

    @property
    def trajectory_stamp(self) -> int:
        """The synchronized stamp: the newest header stamp of the set."""
        return max(s for s in self.stamps if s is not None)


@dataclass
class BadInputBag:
    """A written bag and what playing it must produce."""

    path: Path
    transport: str  # "raw" or "compressed": the replay's --transport
    frames: list
    odometry: list  # every Odometry message written (rosbags objects), bad ones included

    @property
    def camera_messages(self) -> int:
        return sum(m is not None for f in self.frames for m in f.msgs)

    def expected_drops(self) -> dict[str, int]:
        """``{report cause: count}`` over all frames (unsynced / queue_overflow not included: see ``discarded``)."""
        total: dict[str, int] = {}
        for f in self.frames:
            for cause, n in f.drops.items():
                total[cause] = total.get(cause, 0) + n
        return total

    @property
    def discarded(self) -> int:
        return sum(f.discarded for f in self.frames)

    @property
    def span_s(self) -> float:
        return (self.frames[-1].t_ns - self.frames[0].t_ns) / 1e9


class _BagBuilder:
    """Collects frames and odometry, then writes them in time order into an MCAP rosbag2 folder."""

    def __init__(self, transport: str):
        self.transport = transport
        self.store = typestore()
        self.frames: list[Frame] = []
        self.odometry: list = []
        self._odometry_t: list[int] = []
        self.sources = source_frames()

    # stamps and pictures of the frame being built
    @staticmethod
    def good_stamps(t_ns: int) -> list[int]:
        return [t_ns + i * CAMERA_SPREAD_NS for i in range(N_CAMERAS)]

    def picture(self, cam: int) -> np.ndarray:
        """The real picture of camera ``cam`` for the next frame (the 3 instants of the bag in turn)."""
        return self.sources[len(self.frames) % len(self.sources)][cam]

    def header(self, stamp_ns, cam: int, sec_nanosec=None):
        return _header(self.store, stamp_ns, f"camera{cam}/camera_optical_link", sec_nanosec)

    def raw(self, cam: int, stamp_ns, encoding: str = "rgb8", *, bigendian: bool = False, pad: int = 0,
            size: tuple[int, int] | None = None, sec_nanosec=None):
        """A well-formed raw Image of the camera's real picture in ``encoding``."""
        rgb = self.picture(cam) if size is None else resized(self.picture(cam), *size)
        rows = encode_rows(rgb, encoding, bigendian)
        if pad:
            rows = padded(rows, pad)
        h, w, _ = rgb.shape
        return image_msg(self.store, self.header(stamp_ns, cam, sec_nanosec), encoding, h, w, rows.shape[1],
                         rows.tobytes(), bigendian)

    def compressed(self, cam: int, stamp_ns, fmt: str = "jpeg", *, size=None, data: bytes | None = None,
                   sec_nanosec=None):
        rgb = self.picture(cam) if size is None else resized(self.picture(cam), *size)
        payload = compressed_payload(rgb, fmt) if data is None else data
        return compressed_msg(self.store, self.header(stamp_ns, cam, sec_nanosec), fmt, payload)

    def good_msg(self, cam: int, stamp_ns, **kw):
        return self.raw(cam, stamp_ns, **kw) if self.transport == "raw" else self.compressed(cam, stamp_ns, **kw)

    def add(self, label: str, t_ns: int, stamps=None, msgs=None, **expect) -> Frame:
        """Add a frame at ``t_ns``; by default a good one (the transport's default layout, good stamps)."""
        stamps = self.good_stamps(t_ns) if stamps is None else stamps
        if msgs is None:
            msgs = [None if s is None else self.good_msg(cam, s) for cam, s in enumerate(stamps)]
        frame = Frame(label, t_ns, list(stamps), list(msgs), source=len(self.frames) % len(self.sources), **expect)
        self.frames.append(frame)
        return frame

    def add_odometry(self, t_from_ns: int, t_to_ns: int, period_ns: int = 50 * MS) -> None:
        """Good odometry every ``period_ns`` over [t_from, t_to]: straight line at SPEED_MPS from the real start
        pose."""
        t = t_from_ns
        while t <= t_to_ns:
            self.add_odometry_msg(t)
            t += period_ns

    def add_odometry_msg(self, stamp_ns: int, **override) -> None:
        """One odometry message at ``stamp_ns`` on the track; ``override`` replaces fields (x, speed,
        quaternion...)."""
        x0, y0, z0, yaw = start_pose()
        d = SPEED_MPS * (stamp_ns - T0_NS) / 1e9
        fields = dict(x=x0 + d * math.cos(yaw), y=y0 + d * math.sin(yaw), z=z0, yaw=yaw, speed=SPEED_MPS)
        fields.update(override)
        self.odometry.append(odometry_msg(self.store, stamp_ns, **fields))
        self._odometry_t.append(stamp_ns)

    def write(self, path: Path) -> BadInputBag:
        from rosbags.rosbag2 import StoragePlugin, Writer

        image_type = IMAGE_TYPE if self.transport == "raw" else COMPRESSED_TYPE
        suffix = "" if self.transport == "raw" else "/compressed"
        records = []  # (receive time, order, topic index, message)
        for f in self.frames:
            for cam, msg in enumerate(f.msgs):
                if msg is not None:
                    records.append((f.t_ns + cam * MS, len(records), cam, msg))
        for t, msg in zip(self._odometry_t, self.odometry):
            records.append((t, len(records), N_CAMERAS, msg))
        records.sort(key=lambda r: (r[0], r[1]))
        path = Path(path)
        with Writer(path, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
            conns = [writer.add_connection(IMAGE_TOPIC.format(cam) + suffix, image_type, typestore=self.store)
                     for cam in range(N_CAMERAS)]
            conns.append(writer.add_connection(ODOMETRY_TOPIC, ODOMETRY_TYPE, typestore=self.store))
            for t, _, index, msg in records:
                writer.write(conns[index], t, self.store.serialize_cdr(msg, msg.__msgtype__))
        return BadInputBag(path, self.transport, self.frames, self.odometry)


def raw_layouts_bag(path: Path, period_ms: int = 200) -> BadInputBag:
    """Raw ``sensor_msgs/Image`` layouts, accepted and rejected, one frame each, bad ones between good ones.

    Accepted (a Trajectory each): every encoding core/image.py accepts, on all 6 cameras (mono16 in
    both byte orders); a frame mixing encodings with legal row padding (odd pads included); a frame
    whose cameras have 6 different sizes (each is resized to the model input).
    Rejected (``prefix.decode_error``, one camera bad, the other five good rgb8): 16UC1 and 32FC1
    depth-type encodings, a 0x0 image, data shorter than height * step, a step smaller than
    width * 3 (width and step disagree), a height smaller than the data holds (height and step
    disagree with the data length).
    """
    b = _BagBuilder("raw")
    period = period_ms * MS
    t = [T0_NS]

    def next_t() -> int:
        now = t[0]
        t[0] += period
        return now

    def accepted(label: str, encodings, **per_cam):
        tt = next_t()
        stamps = b.good_stamps(tt)
        msgs = []
        for cam, s in enumerate(stamps):
            enc = encodings[cam] if isinstance(encodings, (list, tuple)) else encodings
            msgs.append(b.raw(cam, s, enc, **{k: v[cam] for k, v in per_cam.items()}))
        return b.add(label, tt, stamps, msgs)

    def rejected(label: str, cam: int, bad_msg_fn):
        tt = next_t()
        stamps = b.good_stamps(tt)
        msgs = [b.raw(c, s) if c != cam else bad_msg_fn(b.header(s, c)) for c, s in enumerate(stamps)]
        return b.add(label, tt, stamps, msgs, trajectory=False, drops={"prefix.decode_error": 1})

    rows_rgb = lambda: encode_rows(np.asarray(b.picture(0)), "rgb8")  # noqa: E731 - a real rgb8 picture's rows
    depth16 = lambda h: image_msg(b.store, h, "16UC1", HEIGHT, WIDTH, WIDTH * 2,  # noqa: E731
                                  (np.asarray(_grey(b.picture(2)), np.uint16) * 20).tobytes())
    depth32 = lambda h: image_msg(b.store, h, "32FC1", HEIGHT, WIDTH, WIDTH * 4,  # noqa: E731
                                  (np.asarray(_grey(b.picture(4)), np.float32) / 10).tobytes())
    empty = lambda h: image_msg(b.store, h, "rgb8", 0, 0, 0, b"")  # noqa: E731
    short = lambda h: image_msg(b.store, h, "rgb8", HEIGHT, WIDTH, WIDTH * 3,  # noqa: E731
                                rows_rgb().tobytes()[: WIDTH * 3 * HEIGHT - 1000])
    narrow_step = lambda h: image_msg(b.store, h, "rgb8", HEIGHT, WIDTH, 1200,  # noqa: E731
                                      rows_rgb().tobytes()[: 1200 * HEIGHT])
    short_height = lambda h: image_msg(b.store, h, "rgb8", 200, WIDTH, WIDTH * 3,  # noqa: E731
                                       rows_rgb().tobytes())

    accepted("rgb8", "rgb8")
    accepted("bgr8", "bgr8")
    accepted("rgba8", "rgba8")
    rejected("16UC1 (depth) on camera 2", 2, depth16)
    accepted("bgra8", "bgra8")
    accepted("mono8", "mono8")
    rejected("32FC1 (depth) on camera 4", 4, depth32)
    accepted("mono16 little-endian", "mono16", bigendian=[False] * N_CAMERAS)
    accepted("mono16 big-endian", "mono16", bigendian=[True] * N_CAMERAS)
    rejected("0x0 image on camera 1", 1, empty)
    accepted("bayer_rggb8", "bayer_rggb8")
    accepted("bayer_bggr8", "bayer_bggr8")
    rejected("data shorter than height * step on camera 0", 0, short)
    accepted("bayer_gbrg8", "bayer_gbrg8")
    accepted("bayer_grbg8", "bayer_grbg8")
    rejected("step 1200 < width 484 * 3 on camera 5", 5, narrow_step)
    accepted("yuv422 (UYVY)", "yuv422")
    accepted("uyvy", "uyvy")
    rejected("height 200 but 304 rows of data on camera 3", 3, short_height)
    accepted("yuv422_yuy2 (YUYV)", "yuv422_yuy2")
    accepted("yuyv", "yuyv")
    accepted("row padding, mixed encodings", ["rgb8", "bgra8", "mono16", "yuyv", "bayer_grbg8", "bgr8"],
             pad=[12, 8, 3, 4, 5, 7], bigendian=[False, False, True, False, False, False])
    accepted("6 different sizes", "rgb8",
             size=[(WIDTH, HEIGHT), (242, 152), (968, 608), (320, 180), (200, 200), (640, 304)])
    accepted("rgb8 (last)", "rgb8")
    b.add_odometry(T0_NS - 75 * MS, t[0] + 100 * MS)
    return b.write(path)


def compressed_bag(path: Path, period_ms: int = 200) -> BadInputBag:
    """``sensor_msgs/CompressedImage``: accepted formats and broken payloads, bad ones between good ones.

    Accepted: ``jpeg``, ``png``, ``JPG`` (upper case alias), image_transport strings
    ``"rgb8; jpeg compressed bgr8"``, ``"bgr8; jpeg compressed bgr8"``, ``"rgb8; png compressed rgb8"`` (RGB
    payload), ``"mono8; jpeg compressed mono8"``, ``"bgra8; png compressed bgra8"`` (alpha), and
    a frame of 6 JPEGs of different sizes.
    Rejected (``prefix.decode_error``, one camera bad): JPEG with a corrupt header, JPEG truncated to half,
    PNG truncated to half, PNG with corrupt image data, an empty payload, PNG bytes labelled ``jpeg``,
    and a ``compressedDepth`` (depth) payload.
    Accepted although damaged: a JPEG with zeroed bytes inside its scan data (libjpeg conceals the damage;
    nothing reports it, as core/image.py documents), so a Trajectory comes out of a damaged picture.
    """
    b = _BagBuilder("compressed")
    period = period_ms * MS
    t = [T0_NS]

    def next_t() -> int:
        now = t[0]
        t[0] += period
        return now

    def accepted(label: str, fmt: str, sizes=None):
        tt = next_t()
        stamps = b.good_stamps(tt)
        msgs = [b.compressed(cam, s, fmt, size=None if sizes is None else sizes[cam]) for cam, s in enumerate(stamps)]
        return b.add(label, tt, stamps, msgs)

    def rejected(label: str, cam: int, fmt: str, data_fn):
        tt = next_t()
        stamps = b.good_stamps(tt)
        msgs = [b.compressed(c, s) if c != cam else b.compressed(c, s, fmt, data=data_fn(np.asarray(b.picture(c))))
                for c, s in enumerate(stamps)]
        return b.add(label, tt, stamps, msgs, trajectory=False, drops={"prefix.decode_error": 1})

    bgr = lambda rgb: np.ascontiguousarray(rgb[..., ::-1])  # noqa: E731
    depth_payload = lambda rgb: bytes(12) + png(_grey(rgb).astype(np.uint16) * 20)  # noqa: E731 - 12-byte depth header

    accepted("jpeg", "jpeg")
    accepted("png", "png")
    rejected("JPEG with a corrupt header on camera 3", 3, "jpeg", lambda rgb: corrupt_jpeg_header(jpeg(bgr(rgb))))
    accepted("rgb8; jpeg compressed bgr8", "rgb8; jpeg compressed bgr8")
    accepted("bgr8; jpeg compressed bgr8", "bgr8; jpeg compressed bgr8")
    rejected("JPEG truncated to half on camera 0", 0, "jpeg", lambda rgb: (d := jpeg(bgr(rgb)))[: len(d) // 2])
    accepted("rgb8; png compressed rgb8", "rgb8; png compressed rgb8")
    accepted("mono8; jpeg compressed mono8", "mono8; jpeg compressed mono8")
    rejected("PNG truncated to half on camera 2", 2, "png", lambda rgb: (d := png(bgr(rgb)))[: len(d) // 2])
    accepted("JPG (upper case)", "JPG")
    accepted("bgra8; png compressed bgra8", "bgra8; png compressed bgra8")
    rejected("PNG with corrupt image data on camera 5", 5, "png", lambda rgb: corrupt_png_data(png(bgr(rgb))))
    accepted("6 JPEGs of different sizes", "jpeg",
             sizes=[(WIDTH, HEIGHT), (242, 152), (968, 608), (320, 180), (200, 200), (1936, 1216)])
    rejected("empty payload on camera 1", 1, "jpeg", lambda rgb: b"")
    accepted("jpeg (after empty)", "jpeg")
    rejected("PNG bytes labelled jpeg on camera 4", 4, "jpeg", lambda rgb: png(bgr(rgb)))
    accepted("png (after mislabelled)", "png")
    rejected("compressedDepth payload on camera 2", 2, "16UC1; compressedDepth png", depth_payload)
    tt = next_t()
    stamps = b.good_stamps(tt)
    msgs = [b.compressed(c, st) if c != 1
            else b.compressed(c, st, data=damage_jpeg_scan(jpeg(bgr(np.asarray(b.picture(c))))))
            for c, st in enumerate(stamps)]
    b.add("JPEG with damaged scan data on camera 1 (undetectable: decoded with damage)", tt, stamps, msgs,
          intact=False)
    accepted("jpeg (last)", "jpeg")
    b.add_odometry(T0_NS - 75 * MS, t[0] + 100 * MS)
    return b.write(path)


def time_and_odometry_bag(path: Path) -> BadInputBag:
    """Header-stamp anomalies on the cameras and missing / stale / NaN odometry (compressed JPEG cameras).

    Odometry part (frame times in s from T0): no odometry at all before 0.925 s (frames at 0 and 0.25:
    ``suffix.no_odometry``); three odometry messages with NaN position, infinite speed and a NaN
    quaternion between good ones (``suffix.bad_odometry``, the frames around them still interpolate);
    odometry stops after 1.775 s and comes back at 4.025 s (frames at 3.0 and 3.25 are more than
    max_odometry_age_s = 1 s from any odometry: ``suffix.stale_odometry``).
    Camera part, from 4.5 s, odometry steady: stamps 100 ms backwards (``prefix.out_of_order`` x 6),
    duplicated stamps (``prefix.duplicate`` x 6), one camera 80 ms off (outside the 50 ms tolerance:
    the 6 messages are discarded), one camera silent for 5 frames (its 25 partners are discarded),
    every camera an hour in the future (the set goes through, one ``prefix.time_jump`` at the next
    frame, and the suffix finds no odometry that close: ``suffix.stale_odometry``), nanosec = 1.5e9 on
    one camera (``prefix.bad_stamp``, its 5 partners discarded), one camera an hour in the future
    (its frame discarded; only that camera restarts, ``prefix.time_jump``, and the next frame goes
    through), all stamps zero (as for the future), a negative stamp on one
    camera (``prefix.bad_stamp``).
    """
    b = _BagBuilder("compressed")
    s = 10**9
    at = lambda seconds: T0_NS + round(seconds * s)  # noqa: E731

    # --- odometry anomalies
    b.add("no odometry yet", at(0.0), trajectory=False, drops={"suffix.no_odometry": 1})
    b.add("no odometry yet", at(0.25), trajectory=False, drops={"suffix.no_odometry": 1})
    b.add_odometry(at(0.925), at(1.775))
    b.add("odometry started", at(1.0))
    b.add("before NaN odometry", at(1.25))
    b.add_odometry_msg(at(1.30), x=float("nan"))
    b.add_odometry_msg(at(1.35), speed=float("inf"))
    b.add_odometry_msg(at(1.40), quaternion=(0.0, 0.0, float("nan"), 1.0))
    b.frames[-1].drops["suffix.bad_odometry"] = 3  # counted on arrival, around this frame
    b.add("after NaN odometry", at(1.5))
    b.add("last before the odometry gap", at(1.75))
    b.add("odometry 1.2 s old", at(3.0), trajectory=False, drops={"suffix.stale_odometry": 1})
    b.add("odometry 1.5 s old", at(3.25), trajectory=False, drops={"suffix.stale_odometry": 1})
    b.add_odometry(at(4.025), at(11.5))
    b.add("odometry back", at(4.25))

    # --- camera stamp anomalies
    b.add("good", at(4.5))
    back = [st - 100 * MS for st in b.frames[-1].stamps]
    b.add("stamps 100 ms backwards", at(4.75), back, trajectory=False, drops={"prefix.out_of_order": 6})
    b.add("good", at(5.0))
    b.add("duplicate stamps", at(5.25), list(b.frames[-1].stamps), trajectory=False, drops={"prefix.duplicate": 6})
    b.add("good", at(5.5))
    off = b.good_stamps(at(5.75))
    off[3] += 80 * MS
    b.add("camera 3 80 ms off (tolerance 50 ms)", at(5.75), off, trajectory=False, discarded=6)
    b.add("good", at(6.0))
    for k in range(5):
        gap = b.good_stamps(at(6.25 + 0.25 * k))
        gap[4] = None
        b.add(f"camera 4 silent ({k + 1}/5)", at(6.25 + 0.25 * k), gap, trajectory=False, discarded=5)
    b.add("camera 4 back", at(7.5))
    future = [st + FUTURE_NS for st in b.good_stamps(at(7.75))]
    b.add("all cameras 1 h in the future", at(7.75), future, trajectory=False,
          drops={"suffix.stale_odometry": 1})
    b.add("good after the future frame", at(8.0), drops={"prefix.time_jump": 1})
    bad_ns = b.good_stamps(at(8.25))
    frame = b.add("nanosec 1.5e9 on camera 2", at(8.25), bad_ns, trajectory=False,
                  drops={"prefix.bad_stamp": 1}, discarded=5)
    frame.msgs[2] = b.compressed(2, None, sec_nanosec=(bad_ns[2] // s, 1_500_000_000))
    frame.stamps[2] = (bad_ns[2] // s) * s + 1_500_000_000
    b.add("good", at(8.5))
    one_future = b.good_stamps(at(8.75))
    one_future[1] += FUTURE_NS
    b.add("camera 1 alone 1 h in the future", at(8.75), one_future, trajectory=False, discarded=6)
    b.add("good after camera 1's future stamp", at(9.0), drops={"prefix.time_jump": 1})
    b.add("good", at(9.25))
    b.add("all stamps zero", at(9.5), [0] * N_CAMERAS, trajectory=False,
          drops={"prefix.time_jump": 1, "suffix.stale_odometry": 1})
    b.add("good after zero stamps", at(9.75))
    neg = b.good_stamps(at(10.0))
    frame = b.add("negative stamp (sec = -1) on camera 3", at(10.0), neg, trajectory=False,
                  drops={"prefix.bad_stamp": 1}, discarded=5)
    frame.msgs[3] = b.compressed(3, None, sec_nanosec=(-1, 0))
    frame.stamps[3] = -s
    b.add("good after the negative stamp", at(10.25))
    b.add("good (last)", at(10.5))
    return b.write(path)
