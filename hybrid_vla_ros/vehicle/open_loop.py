"""Open-loop driving figures: published trajectories against the drive the bag logged, no ROS imports.

A trajectory published for a camera frame stamped ``t0`` is compared with the ego path logged after ``t0``: its
point ``i`` (``time_from_start`` ``t_i``) with the logged ``base_link`` pose at ``t0 + t_i``, interpolated between
odometry samples (position linearly, yaw along the shorter arc), both in the logged path's frame (``map`` for
Autoware's ``/localization/kinematic_state``; a ``base_link`` trajectory is carried into it by the logged pose at
``t0``). Stamps are header stamps (the camera's and the odometry's), not bag receive times.

The definitions are those of Autoware's ``autoware_planning_data_analyzer`` in open-loop mode (autoware_tools,
``docs/metrics/displacement_based_metrics.md``): with ``e_i`` the 2-D position error (m), ``h_i`` the absolute
wrapped heading error (rad) and ``(lon_i, lat_i)`` the position error rotated into the logged pose's frame (m), a
horizon ``H`` (s) takes the points up to ``k = max{i : t_i <= H}`` and exists only when ``H - t_k <= 0.1 s``:

* ``ade = mean(e_0..e_k)``, ``fde = e_k``, ``ahe = mean(h_0..h_k)``, ``fhe = h_k``;
* ``lateral_mean / lateral_max = mean / max |lat_0..lat_k|``, the same for ``longitudinal``.

``full`` takes every point. Here, in addition, a horizon whose points the logged path does not cover (the bag ends
more than 0.1 s before them, or a gap between odometry samples is longer than ``max_gap_s``) is left out and counted,
never filled in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from ..util.stamps import header_stamp_ns, stamp_to_ns
from .trajectory import EgoState, quaternion_to_yaw, wrap_angle

__all__ = ["HORIZONS_S", "HORIZON_TOLERANCE_S", "MAX_GAP_S", "END_TOLERANCE_S", "LoggedPath", "PlannedPath",
           "HorizonErrors", "FrameErrors", "HorizonSummary", "OpenLoopSummary", "frame_errors", "summarize",
           "horizon_name", "oracle_waypoints", "logged_future"]

#: Horizons (s) reported per frame: the analyzer's 1, 2, 4 and 8 s and the papers' 3 s (nuScenes L2 at 1 / 2 / 3 s).
HORIZONS_S = (1.0, 2.0, 3.0, 4.0, 8.0)
#: A horizon exists when a trajectory point lies within this much (s) below it (the analyzer's tolerance).
HORIZON_TOLERANCE_S = 0.1
#: Default longest gap (s) between two odometry samples that the logged path interpolates across.
MAX_GAP_S = 2.0
#: How far (s) before its first or after its last sample the logged path reaches, extrapolated along its end
#: segment: the analyzer's ``sync_tolerance_ms`` (100), so a camera stamped just before the first odometry sample
#: (the embedded bag's: 91 ms) is compared.
END_TOLERANCE_S = 0.1


def horizon_name(horizon_s: float | None) -> str:
    """``"full"`` for None, else ``"<H>s"`` (``1.0 -> "1s"``, ``0.5 -> "0.5s"``)."""
    return "full" if horizon_s is None else f"{horizon_s:g}s"


@dataclass(frozen=True)
class LoggedPath:
    """The ego's logged drive: ``stamps_ns`` (N,) int64 strictly increasing header stamps, ``xy`` (N, 2) float64
    ``base_link`` positions (m) and ``yaw`` (N,) float64 (rad) in ``frame_id``; ``max_gap_s`` the longest gap
    interpolated across. Raises ValueError for mismatched shapes, fewer than 2 samples, non-finite values or
    stamps not strictly increasing."""

    stamps_ns: np.ndarray
    xy: np.ndarray
    yaw: np.ndarray
    frame_id: str = "map"
    max_gap_s: float = MAX_GAP_S
    #: How far (s) before the first sample and after the last the path reaches (:data:`END_TOLERANCE_S`; a
    #: ground-truth trajectory, which already reaches past its log, takes 0 after).
    reach_before_s: float = END_TOLERANCE_S
    reach_after_s: float = END_TOLERANCE_S

    def __post_init__(self) -> None:
        n = np.shape(self.stamps_ns)[0] if np.ndim(self.stamps_ns) == 1 else -1
        if n < 2 or np.shape(self.xy) != (n, 2) or np.shape(self.yaw) != (n,):
            raise ValueError(f"a logged path needs >= 2 samples of stamps (N,), xy (N, 2), yaw (N,); got "
                             f"{np.shape(self.stamps_ns)}, {np.shape(self.xy)}, {np.shape(self.yaw)}")
        if not (np.all(np.isfinite(self.xy)) and np.all(np.isfinite(self.yaw))):
            raise ValueError("the logged path has non-finite positions or yaws")
        if np.any(np.diff(self.stamps_ns) <= 0):
            raise ValueError("the logged path's stamps must increase strictly")
        if not (math.isfinite(self.max_gap_s) and self.max_gap_s > 0):
            raise ValueError(f"max_gap_s must be finite and > 0, got {self.max_gap_s}")
        if not all(math.isfinite(r) and r >= 0 for r in (self.reach_before_s, self.reach_after_s)):
            raise ValueError(f"reach_before_s / reach_after_s must be finite and >= 0, got {self.reach_before_s}, "
                             f"{self.reach_after_s}")

    @classmethod
    def from_odometry(cls, messages, max_gap_s: float = MAX_GAP_S) -> tuple[LoggedPath | None, list[str]]:
        """The path from ``nav_msgs/msg/Odometry``, ``geometry_msgs/msg/PoseWithCovarianceStamped`` or
        ``geometry_msgs/msg/PoseStamped`` messages (or objects with their fields) in any order: the samples sorted
        by header stamp, a repeated stamp keeping its first message. Returns ``(path, dropped)``: ``dropped`` names
        each message left out and why (a bad stamp, a non-finite pose, another frame than the first message's, a
        repeated stamp); ``path`` is None when fewer than 2 samples are left."""
        samples, dropped, frame = {}, [], None
        for i, msg in enumerate(messages):
            try:
                stamp, x, y, yaw = _stamped_pose(msg)
            except (ValueError, AttributeError) as err:
                dropped.append(f"pose {i}: {err}")
                continue
            frame_id = str(msg.header.frame_id) or "map"
            frame = frame if frame is not None else frame_id
            if frame_id != frame:
                dropped.append(f"pose {i}: frame {frame_id!r}, the path's is {frame!r}")
            elif stamp in samples:
                dropped.append(f"pose {i}: repeated stamp {stamp} ns")
            else:
                samples[stamp] = (x, y, yaw)
        if len(samples) < 2:
            return None, dropped
        stamps = np.array(sorted(samples), dtype=np.int64)
        rows = np.array([samples[int(s)] for s in stamps], dtype=np.float64)
        return cls(stamps, rows[:, :2].copy(), rows[:, 2].copy(), frame, max_gap_s), dropped

    def shifted(self, offset_ns: int) -> LoggedPath:
        """The same path with every stamp moved by ``offset_ns`` (a replay's later loop)."""
        return LoggedPath(self.stamps_ns + int(offset_ns), self.xy, self.yaw, self.frame_id, self.max_gap_s,
                          self.reach_before_s, self.reach_after_s)

    def poses_at(self, t_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Interpolated poses at stamps ``t_ns`` (M,) int64: ``(xy (M, 2), yaw (M,), covered (M,) bool)``. A stamp
        up to ``reach_before_s`` / ``reach_after_s`` outside the logged span takes the end segment's line; one
        further out, or between two samples more than ``max_gap_s`` apart, is not covered (its pose is NaN)."""
        t = np.asarray(t_ns, dtype=np.int64)
        s = self.stamps_ns
        hi = np.clip(np.searchsorted(s, t, side="left"), 1, len(s) - 1)
        lo = hi - 1
        gap = (s[hi] - s[lo]).astype(np.float64)
        before, after = int(self.reach_before_s * 1e9), int(self.reach_after_s * 1e9)
        covered = (t >= s[0] - before) & (t <= s[-1] + after) & (gap <= self.max_gap_s * 1e9)
        w = np.where(covered, (t - s[lo]).astype(np.float64) / gap, np.nan)
        xy = self.xy[lo] + w[:, None] * (self.xy[hi] - self.xy[lo])
        yaw = wrap_angle(self.yaw[lo] + w * wrap_angle(self.yaw[hi] - self.yaw[lo]))
        xy[~covered] = np.nan
        yaw[~covered] = np.nan
        return xy, yaw, covered


@dataclass(frozen=True)
class PlannedPath:
    """One published trajectory: header ``stamp_ns`` (ns) and ``frame_id``, ``t_s`` (P,) float64 time_from_start
    (s, non-decreasing), ``xy`` (P, 2) float64 positions (m) and ``yaw`` (P,) float64 (rad). Raises ValueError for
    no points, mismatched shapes, non-finite values or decreasing times."""

    stamp_ns: int
    frame_id: str
    t_s: np.ndarray
    xy: np.ndarray
    yaw: np.ndarray

    def __post_init__(self) -> None:
        p = np.shape(self.t_s)[0] if np.ndim(self.t_s) == 1 else -1
        if p < 1 or np.shape(self.xy) != (p, 2) or np.shape(self.yaw) != (p,):
            raise ValueError(f"a trajectory needs >= 1 point of t (P,), xy (P, 2), yaw (P,); got "
                             f"{np.shape(self.t_s)}, {np.shape(self.xy)}, {np.shape(self.yaw)}")
        if not all(np.all(np.isfinite(a)) for a in (self.t_s, self.xy, self.yaw)):
            raise ValueError("the trajectory has non-finite times, positions or yaws")
        if np.any(np.diff(self.t_s) < 0) or self.t_s[0] < 0:
            raise ValueError("the trajectory's time_from_start must be >= 0 and non-decreasing")

    @classmethod
    def from_message(cls, msg) -> PlannedPath:
        """From an ``autoware_planning_msgs/msg/Trajectory`` (or an object with its fields). Raises ValueError
        for a bad stamp, no points, or a point with a non-finite or zero orientation."""
        stamp = header_stamp_ns(msg, "trajectory stamp")
        pts = list(msg.points)
        if not pts:
            raise ValueError("the trajectory has no points")
        t = np.array([stamp_to_ns(p.time_from_start, "time_from_start", allow_negative=False) / 1e9 for p in pts])
        xy = np.array([(float(p.pose.position.x), float(p.pose.position.y)) for p in pts], dtype=np.float64)
        q = [p.pose.orientation for p in pts]
        yaw = np.array([quaternion_to_yaw(o.x, o.y, o.z, o.w) for o in q], dtype=np.float64)
        return cls(stamp, str(msg.header.frame_id), t, xy, yaw)


@dataclass(frozen=True)
class HorizonErrors:
    """The errors of one trajectory up to one horizon (see the module docstring): m for ``ade_m``, ``fde_m``,
    ``lateral_*_m``, ``longitudinal_*_m``; rad for ``ahe_rad``, ``fhe_rad``; ``points`` compared."""

    ade_m: float
    fde_m: float
    ahe_rad: float
    fhe_rad: float
    lateral_mean_m: float
    lateral_max_m: float
    longitudinal_mean_m: float
    longitudinal_max_m: float
    points: int


@dataclass(frozen=True)
class FrameErrors:
    """One trajectory's figures: ``stamp_ns``; ``horizons`` by :func:`horizon_name`; ``left_out`` by the same
    names, why a horizon is absent (``"beyond the trajectory"``, ``"no point within 0.1 s below it"``, ``"beyond
    the logged path"``); and the
    point-wise signed arrays over the covered points (``t_s``, ``error_m``, ``heading_error_rad``,
    ``lateral_m``, ``longitudinal_m``, each (C,) float64)."""

    stamp_ns: int
    horizons: dict[str, HorizonErrors]
    left_out: dict[str, str]
    t_s: np.ndarray = field(repr=False)
    error_m: np.ndarray = field(repr=False)
    heading_error_rad: np.ndarray = field(repr=False)
    lateral_m: np.ndarray = field(repr=False)
    longitudinal_m: np.ndarray = field(repr=False)


def _stamped_pose(msg) -> tuple[int, float, float, float]:
    """``(header stamp ns, x m, y m, yaw rad)`` of an Odometry / PoseWithCovarianceStamped (``pose.pose``) or a
    PoseStamped (``pose``). Raises ValueError for a bad stamp, a non-finite position or a zero quaternion."""
    stamp = header_stamp_ns(msg, "pose stamp")
    pose = msg.pose.pose if hasattr(msg.pose, "pose") else msg.pose
    x, y = float(pose.position.x), float(pose.position.y)
    if not (math.isfinite(x) and math.isfinite(y)):
        raise ValueError(f"non-finite position ({x}, {y})")
    q = pose.orientation
    return stamp, x, y, quaternion_to_yaw(q.x, q.y, q.z, q.w)


def _to_path_frame(plan: PlannedPath, path: LoggedPath) -> tuple[np.ndarray, np.ndarray]:
    """``plan``'s positions and yaws in the logged path's frame. Raises ValueError for a frame that is neither
    the path's nor ``base_link``, or a ``base_link`` trajectory whose stamp the path does not cover."""
    if plan.frame_id == path.frame_id:
        return plan.xy, plan.yaw
    if plan.frame_id != "base_link":
        raise ValueError(f"trajectory in frame {plan.frame_id!r}, the logged path in {path.frame_id!r}: only "
                         f"{path.frame_id!r} and 'base_link' trajectories are compared")
    xy0, yaw0, covered = path.poses_at(np.array([plan.stamp_ns], dtype=np.int64))
    if not covered[0]:
        raise ValueError("a base_link trajectory's stamp lies outside the logged path")
    c, s = math.cos(yaw0[0]), math.sin(yaw0[0])
    xy = np.stack([xy0[0, 0] + c * plan.xy[:, 0] - s * plan.xy[:, 1],
                   xy0[0, 1] + s * plan.xy[:, 0] + c * plan.xy[:, 1]], axis=1)
    return xy, wrap_angle(plan.yaw + yaw0[0])


def frame_errors(plan: PlannedPath, path: LoggedPath, horizons_s=HORIZONS_S) -> FrameErrors:
    """Compare one trajectory with the logged path at ``horizons_s`` (s) and ``full`` (module docstring).

    Raises ValueError when the frames cannot be compared (:func:`_to_path_frame`) or a horizon is not > 0."""
    if any(not (math.isfinite(h) and h > 0) for h in horizons_s):
        raise ValueError(f"horizons must be finite and > 0 s, got {tuple(horizons_s)}")
    xy, yaw = _to_path_frame(plan, path)
    t_ns = plan.stamp_ns + np.rint(plan.t_s * 1e9).astype(np.int64)
    gt_xy, gt_yaw, covered = path.poses_at(t_ns)
    d = xy - gt_xy
    err = np.hypot(d[:, 0], d[:, 1])
    head = np.abs(wrap_angle(yaw - gt_yaw))
    c, s = np.cos(gt_yaw), np.sin(gt_yaw)
    lon, lat = c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1]
    result, left_out = {}, {}
    for h in (None, *horizons_s):
        name = horizon_name(h)
        if h is None:
            k = len(plan.t_s) - 1
        else:
            below = np.nonzero(plan.t_s <= h + 1e-9)[0]
            if below.size == 0 or h - plan.t_s[below[-1]] > HORIZON_TOLERANCE_S + 1e-9:
                left_out[name] = ("beyond the trajectory" if plan.t_s[-1] < h - HORIZON_TOLERANCE_S
                                  else "no point within 0.1 s below it")
                continue
            k = int(below[-1])
        if not covered[: k + 1].all():
            left_out[name] = "beyond the logged path"
            continue
        sl = slice(0, k + 1)
        result[name] = HorizonErrors(
            ade_m=float(err[sl].mean()), fde_m=float(err[k]), ahe_rad=float(head[sl].mean()), fhe_rad=float(head[k]),
            lateral_mean_m=float(np.abs(lat[sl]).mean()), lateral_max_m=float(np.abs(lat[sl]).max()),
            longitudinal_mean_m=float(np.abs(lon[sl]).mean()), longitudinal_max_m=float(np.abs(lon[sl]).max()),
            points=k + 1)
    return FrameErrors(plan.stamp_ns, result, left_out, plan.t_s[covered], err[covered], head[covered],
                       lat[covered], lon[covered])


@dataclass(frozen=True)
class HorizonSummary:
    """One horizon over a run: ``frames`` compared; ``mean``: each :class:`HorizonErrors` field's mean over them
    (so ``lateral_max_m`` is the mean of the frames' maxima; ``points`` their sum), None when no frame reached it;
    ``left_out`` counts frames without it by reason."""

    frames: int
    mean: HorizonErrors | None
    left_out: dict[str, int]


@dataclass(frozen=True)
class OpenLoopSummary:
    """A run's open-loop figures: per horizon name (``full``, ``1s``, ...) a :class:`HorizonSummary`; ``frames``
    compared at all; ``not_compared`` counts trajectories
    that could not be compared by reason."""

    horizons: dict[str, HorizonSummary]
    frames: int
    not_compared: dict[str, int]


def summarize(frames: list[FrameErrors], not_compared: dict[str, int] | None = None,
              horizons_s=HORIZONS_S) -> OpenLoopSummary:
    """Means over ``frames`` per horizon (module docstring); a horizon no frame reached has ``mean`` None."""
    out = {}
    for name in (horizon_name(h) for h in (None, *horizons_s)):
        got = [f.horizons[name] for f in frames if name in f.horizons]
        left: dict[str, int] = {}
        for f in frames:
            if name in f.left_out:
                left[f.left_out[name]] = left.get(f.left_out[name], 0) + 1
        mean = None
        if got:
            mean = HorizonErrors(**{k.name: float(np.mean([getattr(g, k.name) for g in got]))
                                    for k in fields(HorizonErrors) if k.name != "points"},
                                 points=sum(g.points for g in got))
        out[name] = HorizonSummary(frames=len(got), mean=mean, left_out=left)
    return OpenLoopSummary(out, len(frames), dict(not_compared or {}))

def oracle_waypoints(path: LoggedPath, ego: EgoState, n: int, dt_s: float) -> np.ndarray:
    """The logged future as a planner's waypoints: the logged positions at ``ego.stamp_ns + k * dt_s`` (k = 1..n)
    in ``ego``'s ``base_link`` frame (x forward, y left, m), ``(n', 2)`` float64 with ``n'`` the points before the
    first one the log does not cover. Placed back with the same ``ego`` (``waypoints_to_trajectory``), they are the
    logged positions exactly: the sanity oracle of the open-loop figures. Raises ValueError when the log covers
    none (``n`` < 1, ``dt_s`` not > 0, or the stamp at the log's end). ``ego`` and ``path`` must be in one frame
    (both from the same odometry topic)."""
    if n < 1 or not (math.isfinite(dt_s) and dt_s > 0):
        raise ValueError(f"the oracle needs n >= 1 and dt_s > 0, got {n}, {dt_s}")
    t = ego.stamp_ns + np.rint(np.arange(1, n + 1) * dt_s * 1e9).astype(np.int64)
    xy, _, covered = path.poses_at(t)
    m = int(np.argmin(covered)) if not covered.all() else n
    if m == 0:
        raise ValueError(f"the logged path does not cover {dt_s:g} s after the stamp {ego.stamp_ns} ns "
                         f"(it ends at {int(path.stamps_ns[-1])} ns)")
    c, s = math.cos(ego.yaw), math.sin(ego.yaw)
    d = xy[:m] - np.array([ego.x, ego.y])
    return np.stack([c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1]], axis=1)


def logged_future(path: LoggedPath, stamp_ns: int, horizon_s: float = 8.0,
                  step_s: float = 0.1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The logged drive after ``stamp_ns`` as a ground-truth trajectory, the form of autoware_planning_data_analyzer's
    ``/ground_truth/trajectory`` (its ``add_gt_trajectory_to_bag.py``: one per odometry message, 8 s at 0.1 s):
        ``(t (P,) s, xy (P, 2) m, yaw (P,) rad)`` at ``t = k * step_s`` up to ``horizon_s``, ending before the first
    time :meth:`LoggedPath.poses_at` does not cover (P may be 0; the last pose is not held past the log's reach, as
    that script does)."""
    n = int(math.floor(horizon_s / step_s + 1e-9)) + 1
    t = np.arange(n) * step_s
    xy, yaw, covered = path.poses_at(stamp_ns + np.rint(t * 1e9).astype(np.int64))
    m = int(np.argmin(covered)) if not covered.all() else n
    return t[:m], xy[:m], yaw[:m]
