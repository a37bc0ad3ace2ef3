"""Camera geometry for the query heads (vehicle/camera_geometry.py) on real calibration: the embedded bag's
CameraInfo messages and the DGP scene's camera extrinsics (../shared/data/ddad_dgp_test_scene, the bag's source), as
the static transforms base_link -> camera<i>/camera_optical_link a vehicle would publish. The check: the annotated
3-D boxes of DGP scene 02 (in the front camera's frame), taken to the model frame and projected with our lidar2img,
land in the annotated 2-D boxes of the same objects, for the plain resize and for the published crop."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.camera_geometry import (ModelFrame, StaticTransforms, camera_intrinsics_from_info,
                                                    lidar2img, transform_matrix)
from hybrid_vla_ros.vehicle.image import orion_crop_geometry

DGP = Path(__file__).resolve().parents[2] / "shared" / "data" / "ddad_dgp_test_scene" / "scene_02"
#: camera index of the embedded bag = sorted DGP camera names (its SOURCE.txt)
CAMERAS = ["CAMERA_01", "CAMERA_05", "CAMERA_06", "CAMERA_07", "CAMERA_08", "CAMERA_09"]


def _calibration() -> dict:
    """The scene's calibration file (names, extrinsics, intrinsics); skips when ../shared is not beside the
    checkout."""
    if not DGP.is_dir():
        pytest.skip(f"the DGP scene is not at {DGP} (../shared beside the checkout)")
    return json.loads(next((DGP / "calibration").glob("*.json")).read_text())


def _tf_static() -> NS:
    """A TFMessage of the DGP extrinsics: base_link -> camera<i>/camera_optical_link (DGP's sensor poses in the
    vehicle body frame, whose LiDAR is at its origin: the bag's base_link)."""
    cal = _calibration()
    transforms = []
    for i, name in enumerate(CAMERAS):
        e = cal["extrinsics"][cal["names"].index(name)]
        r, t = e["rotation"], e["translation"]
        transforms.append(NS(header=NS(frame_id="base_link"), child_frame_id=f"camera{i}/camera_optical_link",
                             transform=NS(translation=NS(**t),
                                          rotation=NS(x=r["qx"], y=r["qy"], z=r["qz"], w=r["qw"]))))
    return NS(transforms=transforms)


@pytest.fixture(scope="module")
def infos(embedded_bag):
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(embedded_bag):
        if m.topic.endswith("/camera_info") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    return [first[t] for t in sorted(first)]


def _boxes():
    """[(centre (3,) in the front camera's frame, its 2-D box (x0, y0, x1, y1) px)] of every object annotated in
    both, over the scene's three samples."""
    _calibration()
    out = []
    three = sorted((DGP / "bounding_box_3d" / "CAMERA_01").glob("*.json"))
    two = sorted((DGP / "bounding_box_2d" / "CAMERA_01").glob("*.json"))
    for f3, f2 in zip(three, two):
        boxes2 = {a["instance_id"]: a["box"] for a in json.loads(f2.read_text())["annotations"]}
        for a in json.loads(f3.read_text())["annotations"]:
            b = boxes2.get(a["instance_id"])
            if b is not None:
                t = a["box"]["pose"]["translation"]
                out.append((np.array([t["x"], t["y"], t["z"]]), (b["x"], b["y"], b["x"] + b["w"], b["y"] + b["h"])))
    return out


def _project(m: np.ndarray, p: np.ndarray) -> np.ndarray:
    q = m @ np.append(p, 1.0)
    assert q[2] > 0
    return q[:2] / q[2]


@pytest.mark.parametrize("resize", ["area", "orion_crop"])
def test_annotated_objects_project_into_their_boxes(infos, resize):
    tf = StaticTransforms()
    assert tf.add(_tf_static()) == (6, [])
    cams = [camera_intrinsics_from_info(m) for m in infos]
    assert [c.frame_id for c in cams] == [f"camera{i}/camera_optical_link" for i in range(6)]
    model = ModelFrame(origin=(1.2, 0.0, 1.84))
    size = 640
    l2i = lidar2img(cams, tf, model, size, resize)
    assert l2i.shape == (6, 4, 4)
    base_cam0 = tf.lookup("base_link", cams[0].frame_id)
    model_from_base = np.linalg.inv(model.in_base_link())
    crop = orion_crop_geometry(cams[0].height, cams[0].width, size)
    boxes = _boxes()
    assert len(boxes) >= 6
    for centre_cam, (x0, y0, x1, y1) in boxes:
        p_model = (model_from_base @ base_cam0 @ np.append(centre_cam, 1.0))[:3]
        u, v = _project(l2i[0], p_model)
        if resize == "area":  # the whole 1936 x 1216 image stretched to S x S
            sx, sy = size / cams[0].width, size / cams[0].height
            lo, hi = (x0 * sx, y0 * sy), (x1 * sx, y1 * sy)
        else:  # scale, crop (left, top), stretch the crop to S x S
            left, top, right, bottom = crop.crop
            fx, fy = size / (right - left), size / (bottom - top)
            lo = ((x0 * crop.scale - left) * fx, (y0 * crop.scale - top) * fy)
            hi = ((x1 * crop.scale - left) * fx, (y1 * crop.scale - top) * fy)
        assert lo[0] <= u <= hi[0] and lo[1] <= v <= hi[1], (resize, (u, v), lo, hi)
    # the objects ahead are ahead in the model frame too (+y forward, x right)
    p = (model_from_base @ base_cam0 @ np.append(boxes[0][0], 1.0))[:3]
    assert p[1] > 10 and abs(p[0]) < p[1]


def test_the_model_frame_and_a_chain_of_static_transforms():
    model = ModelFrame(origin=(1.0, 0.0, 1.84))
    # a point 10 m ahead of base_link and 2 m to its left is 9 m ahead and 2 m left (x = -2) of the model origin
    p = np.linalg.inv(model.in_base_link()) @ np.array([10.0, 2.0, 1.84, 1.0])
    assert np.allclose(p[:3], [-2.0, 9.0, 0.0])
    # base_link -> sensor_kit -> camera: the lookup composes them, and finds them from either end
    tf = StaticTransforms()
    q90 = NS(x=0.0, y=0.0, z=np.sqrt(0.5), w=np.sqrt(0.5))  # 90 deg about z
    tf.add(NS(transforms=[
        NS(header=NS(frame_id="base_link"), child_frame_id="sensor_kit",
           transform=NS(translation=NS(x=1.0, y=0.0, z=2.0), rotation=q90)),
        NS(header=NS(frame_id="/sensor_kit"), child_frame_id="cam",
           transform=NS(translation=NS(x=0.5, y=0.0, z=0.0), rotation=NS(x=0.0, y=0.0, z=0.0, w=1.0)))]))
    t = tf.lookup("base_link", "cam")
    assert np.allclose(t[:3, 3], [1.0, 0.5, 2.0]) and np.allclose(t[:3, 0], [0.0, 1.0, 0.0])
    assert np.allclose(tf.lookup("cam", "base_link"), np.linalg.inv(t))
    assert np.allclose(tf.lookup("cam", "cam"), np.eye(4))
    with pytest.raises(LookupError, match="no static transform connects base_link and lidar"):
        tf.lookup("base_link", "lidar")


def _info_like(good, **fields) -> NS:
    """A CameraInfo-like object: ``good``'s fields with ``fields`` replaced."""
    d = dict(header=NS(frame_id=good.header.frame_id), width=good.width, height=good.height, k=list(good.k),
             d=list(good.d), distortion_model=good.distortion_model, p=list(good.p), binning_x=good.binning_x,
             binning_y=good.binning_y, roi=good.roi)
    d.update(fields)
    return NS(**d)


def test_bad_calibration_is_a_clear_error(infos):
    good = infos[0]

    def info(**fields):
        return _info_like(good, **fields)

    with pytest.raises(ValueError, match="focal length"):
        camera_intrinsics_from_info(info(p=[0.0] * 12))  # an uncalibrated camera
    with pytest.raises(ValueError, match="stereo pair"):
        camera_intrinsics_from_info(info(p=[2000.0, 0, 960, -240.0, 0, 2000.0, 600, 0, 0, 0, 1, 0]))
    with pytest.raises(ValueError, match="binning 2 x 2"):
        camera_intrinsics_from_info(info(binning_x=2, binning_y=2))
    with pytest.raises(ValueError, match="region of interest 640x480"):
        camera_intrinsics_from_info(info(roi=NS(x_offset=100, y_offset=50, width=640, height=480)))
    # the camera matrix is the rectified image's, p[:3, :3]: k and d describe the raw image and are not read
    rectified = [1900.0, 0.0, 950.0, 0.0, 0.0, 1901.0, 610.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    cam = camera_intrinsics_from_info(info(d=[-0.3, 0.1, 0.0, 0.0, 0.0], p=rectified))
    assert np.array_equal(cam.k, np.array(rectified).reshape(3, 4)[:, :3])
    with pytest.raises(ValueError, match="frame_id"):
        camera_intrinsics_from_info(info(header=NS(frame_id="")))
    with pytest.raises(ValueError, match="image size"):
        camera_intrinsics_from_info(info(width=0))
    with pytest.raises(ValueError, match="principal point"):
        camera_intrinsics_from_info(info(p=[1000.0, 0, 5000.0, 0, 0, 1000.0, 600.0, 0, 0, 0, 1, 0]))
    with pytest.raises(ValueError, match="unit quaternion"):
        transform_matrix(NS(x=0, y=0, z=0), NS(x=0.0, y=0.0, z=0.0, w=2.0))
    tf = StaticTransforms()
    added, problems = tf.add(NS(transforms=[NS(header=NS(frame_id="a"), child_frame_id="a",
                                               transform=NS(translation=NS(x=0, y=0, z=0),
                                                            rotation=NS(x=0, y=0, z=0, w=1)))]))
    assert added == 0 and len(problems) == 1 and "'a' -> 'a' left out: empty or identical" in problems[0]
    # a camera whose optical frame has no transform to base_link: named, never an identity
    tf.add(_tf_static())
    cams = [camera_intrinsics_from_info(m) for m in infos]
    cams[3] = camera_intrinsics_from_info(info(header=NS(frame_id="camera3/optical_frame_typo")))
    with pytest.raises(LookupError, match=r"camera 3 \(camera3/optical_frame_typo\)"):
        lidar2img(cams, tf, ModelFrame((0.0, 0.0, 1.84)), 640, "orion_crop")
    with pytest.raises(ValueError, match="origin"):
        ModelFrame((0.0, float("nan"), 1.84))


def test_ego_motion_inputs_follow_the_published_layout():
    from hybrid_vla_ros.vehicle.camera_geometry import CAN_BUS_FIELDS, ego_motion_inputs

    model = ModelFrame(origin=(1.0, 0.0, 1.84))
    pose, can_bus = ego_motion_inputs(100.0, -20.0, 0.5, -math.pi / 2, 5.0, 0.4, 0.1, model)
    # heading -90 deg (south): the model origin 1 m ahead of base_link is 1 m south of it, 1.84 m up; the model's
    # forward axis (+y) points south, its right axis (+x) west
    assert np.allclose(pose[:3, 3], [100.0, -21.0, 2.34])
    assert np.allclose(pose[:3, 1], [0.0, -1.0, 0.0]) and np.allclose(pose[:3, 0], [-1.0, 0.0, 0.0])
    fields = dict(zip(CAN_BUS_FIELDS, can_bus))
    assert (fields["x"], fields["y"], fields["z"]) == (100.0, -20.0, 0.5)
    assert fields["vx"] == 5.0 and fields["ax"] == 0.4 and fields["wz"] == 0.1
    assert fields["yaw_rad"] == pytest.approx(1.5 * math.pi) and fields["yaw_deg"] == pytest.approx(270.0)
    # the yaw quaternion (w, x, y, z), as pyquaternion lists Quaternion(axis=[0, 0, 1], radians=yaw)
    assert np.allclose([fields["qw"], fields["qz"]], [math.cos(-math.pi / 4), math.sin(-math.pi / 4)])
    with pytest.raises(ValueError, match="non-finite"):
        ego_motion_inputs(0.0, 0.0, 0.0, float("nan"), 0.0, 0.0, 0.0, model)


def test_odd_camera_info_and_pipelines_are_value_errors(infos):
    good = infos[0]

    def info(**fields):
        return _info_like(good, **fields)

    with pytest.raises(ValueError, match="frame_id"):
        camera_intrinsics_from_info(info(header=NS(frame_id=None)))
    with pytest.raises(ValueError, match="whole pixels"):
        camera_intrinsics_from_info(info(width=1920.7))
    cam = camera_intrinsics_from_info(good)
    from hybrid_vla_ros.vehicle.camera_geometry import model_image_intrinsics

    with pytest.raises(ValueError, match="image_resize 'nearest'"):
        model_image_intrinsics(cam, 640, "nearest")
    with pytest.raises(ValueError, match="at least one camera"):
        lidar2img([], StaticTransforms(), ModelFrame((0.0, 0.0, 1.84)), 640, "area")


@pytest.fixture(scope="module")
def bag_tf_static(embedded_bag):
    """The embedded bag's /tf_static messages (rosbags objects)."""
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    return [store.deserialize_cdr(m.raw, m.msgtype) for m in read_bag(embedded_bag) if m.topic == "/tf_static"]


def test_the_bags_static_transforms_are_the_dgp_calibration(bag_tf_static):
    """scripts/add_tf_static_from_dgp.py wrote one /tf_static message: base_link -> each camera's optical frame,
    the DGP calibration file's extrinsics of the bag's cameras (the camera order of its SOURCE.txt)."""
    assert len(bag_tf_static) == 1
    got = StaticTransforms()
    assert got.add(bag_tf_static[0]) == (6, [])
    want = StaticTransforms()
    want.add(_tf_static())
    for i in range(6):
        frame = f"camera{i}/camera_optical_link"
        assert np.allclose(got.lookup("base_link", frame), want.lookup("base_link", frame), atol=1e-12)


def test_a_camera_calibration_gives_lidar2img_only_from_complete_good_input(infos, bag_tf_static):
    """CameraCalibration (what the prefix node keeps from CameraInfo and /tf_static): the bag's calibration gives
    lidar2img of the model images, computed once per change; each missing or bad piece is a CalibrationError
    with its cause and the camera named, and a good CameraInfo after a bad one brings the camera back."""
    from hybrid_vla_ros.vehicle.camera_geometry import CameraCalibration, CalibrationError

    model = ModelFrame(origin=(1.01, 0.0, 1.84))
    cal = CameraCalibration(6, model, 640, "orion_crop")

    def cause(sizes=None):
        with pytest.raises(CalibrationError) as e:
            cal.lidar2img(sizes)
        return e.value.cause, e.value.reason

    assert cause() == ("no_camera_info", "camera 0: no camera_info received yet")
    for i, info in enumerate(infos):
        assert cal.set_camera_info(i, info) is None
    c, why = cause()
    assert c == "no_camera_transform" and why.startswith("camera 0: no static transform connects base_link and "
                                                          "camera0/camera_optical_link")
    assert cal.add_static_transforms(bag_tf_static[0]) == [] and cal.static_transforms == 6
    first = cal.lidar2img([(1936, 1216)] * 6)
    tf = StaticTransforms()
    tf.add(_tf_static())
    want = lidar2img([camera_intrinsics_from_info(m) for m in infos], tf, model, 640, "orion_crop")
    assert np.allclose(first, want, rtol=1e-12, atol=1e-9)
    assert cal.lidar2img() is first  # not computed again while nothing changed
    assert cal.set_camera_info(2, infos[2]) is None and cal.lidar2img() is first  # the same CameraInfo again
    # an image whose size is not its CameraInfo's
    c, why = cause([(1936, 1216), (968, 608)] + [None] * 4)
    assert c == "camera_size_mismatch" and why.startswith("camera 1 (camera1/camera_optical_link): image 968x608")
    # an uncalibrated camera (zero focal length), then the good CameraInfo again
    problem = cal.set_camera_info(3, _info_like(infos[3], p=[0.0] * 12))
    assert "focal length" in problem
    c, why = cause()
    assert c == "bad_camera_info" and why.startswith("camera 3: camera_info of camera3/camera_optical_link")
    cal.set_camera_info(3, infos[3])
    assert np.array_equal(cal.lidar2img(), first)
    # a changed good CameraInfo (another focal length) replaces the old one; the same again changes nothing
    moved = list(infos[3].p)
    moved[0] += 1.0
    assert cal.set_camera_info(3, _info_like(infos[3], p=moved)) is None
    second = cal.lidar2img()
    assert not np.array_equal(second, first) and cal.set_camera_info(3, _info_like(infos[3], p=moved)) is None
    assert cal.lidar2img() is second
    cal.set_camera_info(3, infos[3])
    assert np.array_equal(cal.lidar2img(), first)
    # a camera frame that is not an optical one (the body-convention camera_link: z up): turned 90 deg otherwise
    tr = bag_tf_static[0].transforms[4]
    body = NS(transforms=[NS(header=tr.header, child_frame_id=tr.child_frame_id,
                             transform=NS(translation=tr.transform.translation,
                                          rotation=NS(x=0.0, y=0.0, z=0.0, w=1.0)))])
    cal.add_static_transforms(body)
    c, why = cause()
    assert c == "bad_camera_transform" and why.startswith("camera 4: camera4/camera_optical_link is not an optical")
    # one bad transform in a message (robot_state_publisher sends every fixed joint in one) is left out alone
    good = bag_tf_static[0].transforms[4]
    problems = cal.add_static_transforms(NS(transforms=[
        NS(header=tr.header, child_frame_id="lidar", transform=NS(
            translation=tr.transform.translation, rotation=NS(x=0.0, y=0.0, z=0.0, w=0.0))), good]))
    assert len(problems) == 1 and "'lidar' left out" in problems[0] and "unit quaternion" in problems[0]
    assert np.array_equal(cal.lidar2img(), first)  # camera 4's good transform came in the same message
    # a frame dropped for its calibration raises a fresh error each time (a cached one grows its traceback and
    # holds every dropped frame's images)
    cal.set_camera_info(1, _info_like(infos[1], p=[0.0] * 12))
    errors = []
    for _ in range(3):
        with pytest.raises(CalibrationError) as e:
            cal.lidar2img()
        errors.append(e.value)
    def depth(tb):
        return 0 if tb is None else 1 + depth(tb.tb_next)

    assert errors[0] is not errors[2] and depth(errors[0].__traceback__) == depth(errors[2].__traceback__)
