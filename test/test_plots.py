"""`hybrid-vla replay --plots DIR`: the five pictures from a real replay, the frame-timing instants they are
drawn from, and the camera projection and extrinsics math on their own."""
import dataclasses
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import cv2
import matplotlib.colors
import numpy as np
import pytest

from hybrid_vla_ros.ros.status import FrameTiming
from hybrid_vla_ros.tools import plots
from hybrid_vla_ros.tools.output_bag import typestore

REPO = Path(__file__).resolve().parent.parent
EXTRINSICS = REPO / "config" / plots.DEFAULT_EXTRINSICS
# K of camera0 in the embedded bag's CameraInfo (DGP CAMERA_01)
K_CAMERA0 = np.array([[2181.530254382263, 0.0, 928.0218817103168],
                      [0.0, 2181.6034466840038, 615.9567879463117],
                      [0.0, 0.0, 1.0]])
EXPECTED_PX = {  # (width, height)
    "trajectory_camera.png": (1300, 900),
    "trajectory_bev.png": (900, 1000),
    "timeline.png": (1400, 900),
    "latency_hist.png": (1400, 800),
    "open_loop.png": (1300, 800),
}


@pytest.fixture(scope="module")
def plots_run(tmp_path_factory, tiny_checkpoint, embedded_bag):
    out = tmp_path_factory.mktemp("replay_plots")
    plot_dir = out / "plots"
    cmd = [sys.executable, "-m", "hybrid_vla_ros.tools.cli", "replay", "--model-path", str(tiny_checkpoint),
           "--bag", str(embedded_bag), "--loops", "1", "--split-layer", "2",
           "--namespace", f"/pl_{uuid.uuid4().hex[:8]}", "--output", str(out), "--plots", str(plot_dir), "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert proc.returncode == 0, f"replay failed:\n{proc.stdout}\n{proc.stderr}\n{logs}"
    return out, plot_dir, proc.stdout


def test_replay_writes_the_four_pictures(plots_run):
    _, plot_dir, stdout = plots_run
    for name, (width, height) in EXPECTED_PX.items():
        path = plot_dir / name
        assert path.is_file(), name
        assert str(path) in stdout, f"{name} not listed in the replay output"
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        assert image is not None, f"{name} does not decode"
        assert image.shape == (height, width, 3), name
        gray = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY).astype(np.float64)
        assert gray.var() > 100.0, f"{name} looks blank (pixel variance {gray.var():.1f})"
        assert (gray < 128).mean() > 0.002, f"{name} has almost no dark pixels (no text or lines)"


def test_frame_timing_carries_ordered_monotonic_instants(plots_run):
    out, _, _ = plots_run
    from rosbags.highlevel import AnyReader

    with AnyReader([out / "trajectories"], default_typestore=typestore()) as reader:
        conns = [c for c in reader.connections if c.topic.endswith("/debug/frame_timing")]
        arrays = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages(connections=conns)]
    assert len(arrays) == 3
    order = ("t_prefix_start_ns", "t_write_start_ns", "t_ready_ns", "t_suffix_end_ns", "t_publish_ns")
    for array in arrays:
        values = {kv.key: kv.value for kv in array.status[0].values}
        for key in ("preprocess_ms", "prefix_ms", "handoff_ms", "suffix_ms", "odometry_wait_ms"):
            assert float(values[key]) >= 0, key
        instants = [int(values[k]) for k in order]
        assert all(a <= b for a, b in zip(instants, instants[1:])), dict(zip(order, instants))
        # the durations agree with the instants (the prefix ends before its ring write starts)
        t = dict(zip(order, instants))
        assert (t["t_write_start_ns"] - t["t_prefix_start_ns"]) / 1e6 >= float(values["preprocess_ms"]) + \
            float(values["prefix_ms"]) - 0.01
        assert (t["t_ready_ns"] - t["t_write_start_ns"]) / 1e6 == pytest.approx(float(values["handoff_ms"]), abs=1e-3)
        assert (t["t_suffix_end_ns"] - t["t_ready_ns"]) / 1e6 == pytest.approx(float(values["suffix_ms"]), abs=1e-3)


def test_extrinsics_yaml_is_a_proper_rotation_with_optical_axes():
    ext = plots.load_extrinsics_yaml(EXTRINSICS)
    assert (ext.parent, ext.child) == ("base_link", "camera0/camera_optical_link")
    rot = ext.matrix[:3, :3]
    assert np.allclose(rot.T @ rot, np.eye(3), atol=1e-9)
    assert np.linalg.det(rot) == pytest.approx(1.0, abs=1e-9)
    assert np.array_equal(ext.matrix[3], [0, 0, 0, 1])
    # optical frame: z forward, x right (-y of base_link), y down (-z of base_link)
    assert rot[:, 2] @ [1, 0, 0] > 0.99
    assert rot[:, 0] @ [0, -1, 0] > 0.99
    assert rot[:, 1] @ [0, 0, -1] > 0.99
    assert 1.0 < ext.matrix[2, 3] < 2.0  # the camera sits above base_link


def test_point_on_the_optical_axis_projects_to_the_principal_point():
    ext = plots.load_extrinsics_yaml(EXTRINSICS)
    origin, axis = ext.matrix[:3, 3], ext.matrix[:3, 2]
    uv, in_front = plots.project_points([origin + 12.0 * axis, origin + 40.0 * axis], ext.matrix, K_CAMERA0)
    assert in_front.all()
    assert np.allclose(uv, [[K_CAMERA0[0, 2], K_CAMERA0[1, 2]]] * 2, atol=1e-6)
    # one metre to the camera's right at 10 m depth lands fx / 10 pixels right of cx
    right = ext.matrix[:3, 0]
    uv, _ = plots.project_points([origin + 10.0 * axis + right], ext.matrix, K_CAMERA0)
    assert uv[0] == pytest.approx([K_CAMERA0[0, 2] + K_CAMERA0[0, 0] / 10, K_CAMERA0[1, 2]], abs=1e-6)


def test_points_behind_the_camera_are_not_projected_nor_drawn():
    ext = plots.load_extrinsics_yaml(EXTRINSICS)
    origin, axis = ext.matrix[:3, 3], ext.matrix[:3, 2]
    uv, in_front = plots.project_points([origin - 5.0 * axis, origin + 20.0 * axis], ext.matrix, K_CAMERA0)
    assert list(in_front) == [False, True]
    assert np.isnan(uv[0]).all() and np.isfinite(uv[1]).all()
    # drawing: a path with base_link (behind the camera), a point 20 m ahead and one 5 m behind the car
    image = np.full((1216, 1936, 3), 90, dtype=np.uint8)
    view = plots.CameraView("camera0", 0, image, K_CAMERA0, ext.child, ext)
    path = np.array([[0.0, 0.0, 0.0], [0.5, 20.0, 0.0], [1.0, -5.0, 0.0]])  # t, x, y in base_link
    data = plots.PlotData([plots.FrameRecord(0, None, path)], highlight=0, camera=view)
    ax = plots.draw_camera(data).axes[0]
    scatters = [c for c in ax.collections if type(c).__name__ == "PathCollection"]
    assert len(scatters) == 1
    drawn = scatters[0].get_offsets()
    expected, _ = plots.project_points([[20.0, 0.0, 0.0]], ext.matrix, K_CAMERA0)
    assert np.allclose(np.asarray(drawn), expected)
    # the line towards it is cut at the near plane, never through a point behind the camera
    segments = plots.visible_segments(path[:, [1, 2, 0]] * [1, 1, 0], ext.matrix, K_CAMERA0)
    assert len(segments) == 2 and np.isfinite(segments).all()


def test_extrinsics_compose_along_a_tf_chain():
    a = plots.rigid_transform((1.0, 0.0, 0.5), (0.0, 0.0, math.sin(0.25), math.cos(0.25)))
    b = plots.load_extrinsics_yaml(EXTRINSICS).matrix
    tfs = [("base_link", "sensor_kit", a), ("/sensor_kit", "camera0/camera_optical_link", b)]
    ext = plots.extrinsics_from_tf(tfs, "base_link", "camera0/camera_optical_link")
    assert ext is not None and np.allclose(ext.matrix, a @ b)
    assert plots.extrinsics_from_tf(tfs, "base_link", "camera1/camera_optical_link") is None


def _timed_frame(stamp_ns: int, t0_ns: int) -> plots.FrameRecord:
    """A frame whose stages took 10 ms each from ``t0_ns`` (CLOCK_MONOTONIC ns), sent 5 ms before."""
    ms = 1_000_000
    timing = FrameTiming(preprocess_ms=10.0, prefix_ms=10.0, t_prefix_start_ns=t0_ns, t_write_start_ns=t0_ns + 20 * ms,
                         t_ready_ns=t0_ns + 21 * ms, t_suffix_end_ns=t0_ns + 31 * ms, t_publish_ns=t0_ns + 32 * ms)
    return plots.FrameRecord(stamp_ns, timing, None, (t0_ns - 5 * ms) / 1e9, (t0_ns + 33 * ms) / 1e9)


def test_timeline_marks_the_frames_sent_that_got_no_trajectory():
    # frames stamped 1, 2, 3 s; the middle one was sent at 1.5 s (monotonic) and never answered
    sec = 1_000_000_000
    data = plots.PlotData([_timed_frame(1 * sec, 1 * sec), _timed_frame(3 * sec, 2 * sec)],
                          unanswered={2 * sec: 1.5})
    fig = plots.draw_timeline(data)
    top = fig.axes[0]
    marks = [line for line in top.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
    assert len(marks) == 1
    # its row lies between the two answered frames' rows (stamp order), at its send time from the first send
    assert list(marks[0].get_ydata()) == [1]
    assert marks[0].get_xdata()[0] == pytest.approx(1.5 - (1 * sec - 5_000_000) / 1e9)
    bars = sorted({round(p.get_y() + p.get_height() / 2) for p in top.patches})
    assert bars == [0, 2]
    assert "1 sent that got none" in top.get_title(loc="left")

    # without unanswered frames: no mark, rows 0 and 1
    fig = plots.draw_timeline(plots.PlotData([_timed_frame(1 * sec, 1 * sec), _timed_frame(3 * sec, 2 * sec)]))
    top = fig.axes[0]
    assert not [line for line in top.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
    assert sorted({round(p.get_y() + p.get_height() / 2) for p in top.patches}) == [0, 1]


def test_the_ego_state_wait_is_its_own_bar_not_part_of_the_grey_input_wait():
    """An ego-state model's prefix waits for the odometry at the camera stamp before it starts: that wait is the
    stage ``ego_wait`` (in the report's stage sum), so the timeline draws it apart from the images' transport."""
    ms = 1_000_000
    frame = _timed_frame(10**9, 10**9)
    frame.timing = dataclasses.replace(frame.timing, ego_wait_ms=3.0)
    iv = plots._intervals(frame, 0)
    assert iv["ego_wait"] == pytest.approx((1.0 - 0.003, 1.0))
    assert iv["input_wait"] == pytest.approx(((10**9 - 5 * ms) / 1e9, 1.0 - 0.003))  # sent .. the wait's start
    fig = plots.draw_timeline(plots.PlotData([frame]))
    colors = {matplotlib.colors.to_hex(p.get_facecolor()) for p in fig.axes[0].patches}
    assert plots.EGO_WAIT[1] in colors and plots.INPUT_WAIT[1] in colors
    assert "ego_wait" not in plots._intervals(_timed_frame(10**9, 10**9), 0)  # not timed (NaN): no bar


def test_the_logged_drive_is_drawn_beside_the_trajectory():
    """Issue 43: the camera picture and the bird's-eye view draw the drive the bag logged after the frame (dashed,
    LOGGED_COLOR) next to the trajectory, through the same camera geometry; ``collect`` places it in the same
    base_link as the trajectory (the trajectory's first point and the odometry's heading)."""
    from hybrid_vla_ros.vehicle.trajectory import EgoState

    ext = plots.load_extrinsics_yaml(EXTRINSICS)
    view = plots.CameraView("camera0", 0, np.full((1216, 1936, 3), 90, dtype=np.uint8), K_CAMERA0, ext.child, ext)
    plan = np.array([[0.0, 0.0, 0.0], [0.5, 8.0, 0.0], [1.0, 16.0, 0.0]])
    drive = np.array([[0.0, 0.0, 0.0], [0.5, 9.0, 0.5], [1.0, 18.0, 1.0]])  # t, x, y in base_link
    data = plots.PlotData([plots.FrameRecord(0, None, plan, logged=drive)], highlight=0, camera=view)
    ax = plots.draw_camera(data).axes[0]
    dashed = [c for c in ax.collections if type(c).__name__ == "LineCollection"
              and matplotlib.colors.to_hex(c.get_colors()[0]) == plots.LOGGED_COLOR]
    assert len(dashed) == 1
    expect = plots.visible_segments(np.column_stack([drive[:, 1:3], np.zeros(3)]), ext.matrix, K_CAMERA0)
    assert np.allclose(np.concatenate(dashed[0].get_segments()), np.concatenate(expect))
    assert "; logged drive (to 1.0 s, 18.0 m): 2 of 3 in view" in ax.get_title()
    bev = plots.draw_bev(data).axes[0]
    lines = [line for line in bev.get_lines() if line.get_color() == plots.LOGGED_COLOR]
    assert len(lines) == 1 and list(lines[0].get_xdata()) == [0.0, 0.5, 1.0]  # y left on the page's x axis
    # collect: the map rows go to the trajectory's base_link (origin its first point, heading the odometry's)
    yaw = math.radians(30)
    c, s = math.cos(yaw), math.sin(yaw)
    to_map = lambda rows: np.column_stack([rows[:, 0], 100 + c * rows[:, 1] - s * rows[:, 2],  # noqa: E731
                                           50 + s * rows[:, 1] + c * rows[:, 2]])
    got = plots.collect(timings={}, paths={7: to_map(plan)}, received={}, sent={}, camera_images={},
                        odometry=[EgoState(x=100.0, y=50.0, z=0.0, yaw=yaw, speed=1.0, stamp_ns=7)],
                        bag_messages=[], tolerance_ns=1e6, extrinsics_yaml=None, logged={7: to_map(drive)})
    assert np.allclose(got.frames[0].path, plan) and np.allclose(got.frames[0].logged, drive)
    # the pictures show a frame placed where the log says the car was, the one with the longest logged drive: of three
    # frames, the one whose logged drive starts 0.3 m off its trajectory's first point (a looped replay's jump) is not
    # picked, though its drive is as long, nor the first (its drive ends at 0.5 s)
    moved = drive + [0.0, 0.3, 0.0]
    odometry = [EgoState(x=100.0, y=50.0, z=0.0, yaw=yaw, speed=1.0, stamp_ns=s) for s in (7, 8, 9)]
    three = plots.collect(timings={}, paths={s: to_map(plan) for s in (7, 8, 9)}, received={}, sent={},
                          camera_images={}, odometry=odometry, bag_messages=[], tolerance_ns=1e6,
                          extrinsics_yaml=None, logged={7: to_map(drive[:2]), 8: to_map(moved), 9: to_map(drive)})
    assert three.highlight == 2


def test_the_open_loop_picture_draws_each_horizon_only_where_a_frame_reaches_it():
    """``open_loop.png`` from the replay's FrameErrors: ADE (top) and FDE (bottom) per frame against its stamp
    (s from the first frame); frame 2 does not reach 2 s, so the 2 s lines have 2 points, never a 0 for it; without
    odometry the picture says so."""
    from hybrid_vla_ros.vehicle.open_loop import FrameErrors, HorizonErrors

    def fig(ade, fde):
        return HorizonErrors(ade, fde, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3)

    def frame(stamp, horizons):
        empty = np.zeros(0)
        return FrameErrors(stamp, horizons, {}, empty, empty, empty, empty, empty)

    sec = 10**9
    frames = [frame(5 * sec, {"1s": fig(0.5, 1.0), "2s": fig(1.0, 2.0)}), frame(7 * sec, {"1s": fig(0.2, 0.4)}),
              frame(6 * sec, {"1s": fig(0.3, 0.6), "2s": fig(0.6, 1.2)})]
    top, bottom = plots.draw_open_loop(plots.PlotData([], open_loop=frames,
                                                      open_loop_source="3 odometry samples over 2.0 s")).axes
    lines = {line.get_label(): line for line in top.get_lines()}
    assert set(lines) == {"ADE at 1s (3 frames)", "ADE at 2s (2 frames)"}
    assert list(lines["ADE at 1s (3 frames)"].get_xdata()) == [0.0, 1.0, 2.0]
    assert list(lines["ADE at 1s (3 frames)"].get_ydata()) == [0.5, 0.3, 0.2]
    assert list(lines["ADE at 2s (2 frames)"].get_ydata()) == [1.0, 0.6]
    assert [list(line.get_ydata()) for line in bottom.get_lines()] == [[1.0, 0.6, 0.4], [2.0, 1.2]]
    assert "1s: 3, 2s: 2, 3s: 0" in top.get_title()
    empty = plots.draw_open_loop(plots.PlotData([], open_loop=None)).axes[0]
    assert "no open-loop figures: the bag has no usable odometry" in [t.get_text() for t in empty.texts]
