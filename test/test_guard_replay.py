"""The output guard and the published trajectory agree, through the real nodes on the embedded bag (issue 19.5).

`hybrid-vla replay` runs prefix_node and suffix_node on the embedded bag with a `tiny` checkpoint whose planning
head emits one fixed path (its output layer's weights zero, its bias the path's per-step displacements), so the
shapes a guard must tell apart reach the real suffix: a car at standstill (centimetres of jitter), walking pace
along a gentle curve (0.45 m per 0.5 s step, radius 8 m: no segment is the guard's 1 m long, the chords over three
steps are), the same steps wiggling 0.3 m left and right (judged, as Autoware's planning_validator does, over
1 m chords: a gentle path, published with the steering of those chords), and a zigzag 1 m either side that no
vehicle can drive.

Every published point is then judged here, independently of the package's code: its steering and heading-rate
fields against the shipped limits, and the curvature of the published positions (the circle through points at
least 1 m apart, written out below) against the curvature its steering field states. Before this issue the
kinematic fields came from the individual segments while the guard judged 1 m chords only: a slow replay published
front wheel angles of 1.518 rad (limit 1.414) and heading rates implying 3.4 1/m (limit 1.0).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, init_model
from hybrid_vla_ros.tools.output_bag import typestore

REPO = Path(__file__).resolve().parent.parent
WHEELBASE = 2.79  # the suffix's wheelbase_m as shipped
LIMITS = {"steering": 1.414, "curvature": 1.0, "lateral": 9.8, "min_chord": 1.0}  # the shipped guard.* values


def _path_deltas(shape: str, n: int) -> np.ndarray:
    """(n, 2) per-step displacements (m, ego frame) of one of the three test paths."""
    if shape == "standstill":
        rng = np.random.default_rng(5)
        return rng.uniform(-0.03, 0.03, size=(n, 2))
    if shape == "gentle":
        radius, step = 8.0, 0.45
        theta = step * np.arange(n + 1) / radius
        pts = np.stack([radius * np.sin(theta), radius * (1 - np.cos(theta))], 1)
        return np.diff(pts, axis=0)
    if shape in ("wiggle", "zigzag"):
        side = 0.3 if shape == "wiggle" else 1.0
        pts = np.array([[0.0, 0.0]] + [[0.45 * k, side * (1 if k % 2 else -1)] for k in range(1, n + 1)])
        return np.diff(pts, axis=0)
    raise ValueError(shape)


def _fixed_path_checkpoint(base: Path, shape: str) -> Path:
    """A tiny checkpoint whose head puts out ``shape`` for every frame and mode (same tensors and model id)."""
    path = base / shape
    cfg = init_model("tiny", path)
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        state, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    deltas = torch.tensor(_path_deltas(shape, cfg.n_waypoints), dtype=state["head.fc2.bias"].dtype)
    state["head.fc2.weight"] = torch.zeros_like(state["head.fc2.weight"])
    state["head.fc2.bias"] = deltas.flatten().repeat(cfg.n_modes)
    save_file(state, str(path / WEIGHTS_FILE), metadata=meta)
    return path


def _replay(checkpoint: Path, out: Path, embedded_bag: Path, publishes: bool) -> dict:
    """One replay of the embedded bag (twice looped, at twice the recorded rate: a frame every 0.5 s, still slower
    than a tiny frame's work); its report. ``publishes``: trajectories are expected (the replay exits 0 only when
    some came out)."""
    cmd = [sys.executable, "-m", "hybrid_vla_ros", "replay", "--model-path", str(checkpoint), "--bag",
           str(embedded_bag), "--split-layer", "2", "--loops", "2", "--rate", "2", "--namespace",
           f"/gr_{uuid.uuid4().hex[:8]}",
           "--output", str(out), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode == 0) == publishes and (out / "report.json").is_file(), proc.stdout + proc.stderr
    return json.loads((out / "report.json").read_text())


def _published(out: Path) -> list:
    from rosbags.highlevel import AnyReader

    with AnyReader([out / "trajectories"], default_typestore=typestore()) as reader:
        conns = [c for c in reader.connections if c.msgtype == "autoware_planning_msgs/msg/Trajectory"
                 and c.topic != "/ground_truth/trajectory"]  # the published ones, not the logged drive
        return [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages(connections=conns)]


def _circle_curvatures(xy: np.ndarray, yaw0: float, min_chord: float) -> dict[int, float]:
    """Unsigned curvature (1/m) at the points of a path thinned to chords of at least ``min_chord`` m: at point 0
    the arc tangent to ``yaw0`` through the first kept point (2 |sin a| / chord), at each inner kept point the
    circle through it and its kept neighbours (4 x area / product of the sides). Point index -> curvature."""
    kept = [0]
    for i in range(1, len(xy)):
        if np.hypot(*(xy[i] - xy[kept[-1]])) >= min_chord:
            kept.append(i)
    out = {}
    if len(kept) >= 2:
        chord = xy[kept[1]] - xy[0]
        a = math.atan2(chord[1], chord[0]) - yaw0
        a = math.atan2(math.sin(a), math.cos(a))
        a = a if abs(a) <= math.pi / 2 else math.pi - abs(a)  # a chord behind: driven in reverse
        out[0] = 2 * abs(math.sin(a)) / np.hypot(*chord)
    for j in range(1, len(kept) - 1):
        p, q, r = xy[kept[j - 1]], xy[kept[j]], xy[kept[j + 1]]
        sides = np.hypot(*(q - p)) * np.hypot(*(r - q)) * np.hypot(*(r - p))
        area2 = abs((q - p)[0] * (r - p)[1] - (q - p)[1] * (r - p)[0])
        out[kept[j]] = 2 * area2 / sides if sides > 0 else 0.0
    return out


@pytest.fixture(scope="module")
def replays(tmp_path_factory, embedded_bag):
    base = tmp_path_factory.mktemp("guard_replay")
    return {shape: (_replay(_fixed_path_checkpoint(base / "models", shape), base / shape, embedded_bag,
                            shape != "zigzag"), _published(base / shape)) for shape in SHAPES}


SHAPES = ("standstill", "gentle", "wiggle", "zigzag")


@pytest.mark.parametrize("shape", SHAPES)
def test_every_published_point_is_within_the_limits_the_guard_judges(replays, shape):
    report, published = replays[shape]
    for traj in published:
        pts = traj.points
        xy = np.array([[p.pose.position.x, p.pose.position.y] for p in pts])
        q = pts[0].pose.orientation
        yaw0 = math.atan2(2 * (q.w * q.z + q.x * q.y), 1 - 2 * (q.y * q.y + q.z * q.z))
        v = np.array([p.longitudinal_velocity_mps for p in pts])
        steering = np.array([p.front_wheel_angle_rad for p in pts])
        rate = np.array([p.heading_rate_rps for p in pts])
        stated = np.tan(steering) / WHEELBASE  # the curvature the steering field states
        assert np.all(np.abs(steering) <= LIMITS["steering"]), steering
        assert np.all(np.abs(stated) <= LIMITS["curvature"] + 1e-12), stated
        np.testing.assert_allclose(rate, stated * v, atol=1e-9)  # the heading rate is that curvature at that speed
        faster = np.maximum(np.abs(v), np.append(np.abs(v[1:]), abs(v[-1])))
        assert np.all(faster ** 2 * np.abs(stated) <= LIMITS["lateral"] + 1e-9)
        for i, kappa in _circle_curvatures(xy, yaw0, LIMITS["min_chord"]).items():
            assert abs(stated[i]) == pytest.approx(kappa, abs=1e-6), (i, stated, kappa)
            assert kappa <= LIMITS["curvature"] + 1e-9
    print(f"\n{shape}: {len(published)} published, drops {report['drops']}")


def test_standstill_and_a_gentle_walking_pace_go_out_the_zigzag_is_dropped(replays):
    """Every standstill, gentle-curve and wiggle trajectory is published (standstill with no heading rate or
    steering at all: no chord of 1 m), every zigzag one dropped as too sharp a turn, never published."""
    for shape in ("standstill", "gentle", "wiggle"):
        report, published = replays[shape]
        assert report["trajectories_out"] >= 5 and not any(k.startswith("suffix.guard") for k in report["drops"]), \
            (shape, report)
    _, still = replays["standstill"]
    assert all(p.front_wheel_angle_rad == 0.0 and p.heading_rate_rps == 0.0 for t in still for p in t.points)
    _, gentle = replays["gentle"]
    steering = [p.front_wheel_angle_rad for t in gentle for p in t.points]
    assert max(steering) == pytest.approx(math.atan(WHEELBASE / 8.0), rel=0.05)  # a radius of 8 m, measured
    report, published = replays["zigzag"]  # its 1 m swings turn > 90 deg: reversals too (decel first in order)
    guard = sum(n for cause, n in report["drops"].items() if cause.startswith("suffix.guard_"))
    assert published == [] and guard >= 5 and report["trajectories_out"] == 0, report
