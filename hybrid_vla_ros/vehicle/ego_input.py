"""Ego-state model input at a camera stamp: speed, longitudinal acceleration and yaw rate.

A checkpoint with ``ego_state_input`` takes :data:`config.EGO_FEATURES` at the instant the cameras fired, from
Autoware's ``/localization/kinematic_state`` (Odometry, twist in ``base_link``) and ``/localization/acceleration``
(``autoware_twist2accel``). Without an acceleration sample near the stamp, the speeds' finite difference is used,
as twist2accel computes it (its 1 ms dt floor, not its low-pass filter). No ROS imports.
"""
from __future__ import annotations

import bisect
import math

import numpy as np

from ..util.stamps import NS_PER_S as _NS_PER_S
from ..util.stamps import header_stamp_ns
from .timeseries import SeriesBuffer, StampedSeries

#: How :meth:`EgoInputBuffer.ego_state_at` obtained the acceleration.
ACCEL_SOURCES = ("measured", "speed_difference")
#: The causes (``LookupError.args[0]``) of :meth:`EgoInputBuffer.ego_state_at` failing.
LOOKUP_CAUSES = ("no_ego_state", "stale_ego_state", "no_acceleration")

_MIN_DT_NS = 1_000_000  # 1 ms floor of the finite-difference step, as autoware_twist2accel


def kinematic_sample_from_odometry(msg) -> tuple[int, float, float]:
    """(stamp ns, speed m/s, yaw rate rad/s) of a ``nav_msgs/msg/Odometry``.

    Raises ValueError for a bad stamp or non-finite values, AttributeError when a field is missing.
    """
    stamp = header_stamp_ns(msg, "odometry stamp")
    speed, yaw_rate = float(msg.twist.twist.linear.x), float(msg.twist.twist.angular.z)
    if not (math.isfinite(speed) and math.isfinite(yaw_rate)):
        raise ValueError(f"odometry has a non-finite speed or yaw rate: speed={speed} yaw_rate={yaw_rate}")
    return stamp, speed, yaw_rate


def acceleration_sample_from_msg(msg) -> tuple[int, float]:
    """(stamp ns, longitudinal acceleration m/s^2) of a ``geometry_msgs/msg/AccelWithCovarianceStamped``.

    Raises ValueError for a bad stamp or a non-finite value, AttributeError when a field is missing.
    """
    stamp = header_stamp_ns(msg, "acceleration stamp")
    accel = float(msg.accel.accel.linear.x)
    if not math.isfinite(accel):
        raise ValueError(f"acceleration is not finite: {accel}")
    return stamp, accel


def _value_at(series: StampedSeries, stamp_ns: int, max_age_ns: int) -> tuple[float, ...] | None:
    """Values at ``stamp_ns``, interpolated or held (see :meth:`EgoInputBuffer.ego_state_at`), else None."""
    s, v = series.stamps, series.items
    lo, hi = series.bracket(stamp_ns)
    if lo is not None and lo == hi:
        return v[lo]
    near_lo = lo is not None and stamp_ns - s[lo] <= max_age_ns
    near_hi = hi is not None and s[hi] - stamp_ns <= max_age_ns
    if near_lo and near_hi:
        w = (stamp_ns - s[lo]) / (s[hi] - s[lo])
        return tuple(a + w * (b - a) for a, b in zip(v[lo], v[hi]))
    if near_lo or near_hi:
        return v[lo] if near_lo else v[hi]
    return None


def _slope(series: StampedSeries, stamp_ns: int, max_age_ns: int, index: int = 0) -> float | None:
    """d(values[index])/dt (per s) at ``stamp_ns`` from two samples within ``max_age_ns``, None without a pair.

    Prefers the central pair, then a pair with a sample at the stamp, then the two nearest on one side.
    """
    s, v = series.stamps, series.items
    n = len(s)

    def near(j: int) -> bool:
        return 0 <= j < n and abs(s[j] - stamp_ns) <= max_age_ns

    lo = bisect.bisect_left(s, stamp_ns) - 1  # last sample strictly before the stamp
    hi = bisect.bisect_right(s, stamp_ns)  # first sample strictly after it
    exact = lo + 1 if lo + 1 < hi else None
    pairs = [(lo, hi)]
    if exact is not None:
        pairs += [(lo, exact), (exact, hi)]
    pairs += [(lo - 1, lo), (hi, hi + 1)]
    for a, b in pairs:
        if near(a) and near(b):
            dt_ns = max(s[b] - s[a], _MIN_DT_NS)
            return (v[b][index] - v[a][index]) * _NS_PER_S / dt_ns
    return None


class EgoInputBuffer:
    """Thread-safe, bounded history of kinematic and acceleration samples; the ego state at a camera stamp.

    A sample more than ``jump_back_ns`` older than its stream's newest means the clock jumped back: both
    streams are cleared first and ``time_jumps`` counts it. An equal stamp replaces the older sample.
    """

    def __init__(self, maxlen: int = 256, jump_back_ns: int = _NS_PER_S):
        if maxlen < 2:
            raise ValueError(f"maxlen must be >= 2 (a finite difference needs two samples), got {maxlen}")
        # kinematic: (speed m/s, yaw rate rad/s); acceleration: (longitudinal acceleration m/s^2,)
        self._buf = SeriesBuffer(("kinematic", "acceleration"), maxlen, jump_back_ns)
        self._kin, self._acc = self._buf.series["kinematic"], self._buf.series["acceleration"]

    @property
    def time_jumps(self) -> int:
        """Times both streams were cleared for a clock jump."""
        return self._buf.time_jumps

    @staticmethod
    def _check(stamp_ns: int, values: dict[str, float]) -> tuple[int, tuple[float, ...]]:
        if isinstance(stamp_ns, bool) or not isinstance(stamp_ns, (int, np.integer)) or stamp_ns < 0:
            raise ValueError(f"stamp must be an integer >= 0 ns, got {stamp_ns!r}")
        bad = {k: v for k, v in values.items() if not math.isfinite(float(v))}
        if bad:
            raise ValueError(f"non-finite ego sample at {stamp_ns} ns: {bad}")
        return int(stamp_ns), tuple(float(v) for v in values.values())

    def add_kinematic(self, stamp_ns: int, speed_mps: float, yaw_rate_radps: float) -> None:
        """Add a kinematic sample. Raises ValueError (nothing stored) for a bad stamp or a non-finite value."""
        stamp, values = self._check(stamp_ns, {"speed_mps": speed_mps, "yaw_rate_radps": yaw_rate_radps})
        self._buf.add("kinematic", stamp, values)

    def add_acceleration(self, stamp_ns: int, accel_mps2: float) -> None:
        """Add an acceleration sample. Raises ValueError (nothing stored) for a bad stamp or a non-finite value."""
        stamp, values = self._check(stamp_ns, {"accel_mps2": accel_mps2})
        self._buf.add("acceleration", stamp, values)

    def wait_for(self, stamp_ns: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (s) for a kinematic sample at or after ``stamp_ns``; True if one is buffered.
        The acceleration stream, which may not exist, is not waited for."""
        return self._buf.wait_for("kinematic", stamp_ns, timeout_s)

    def ego_state_at(self, stamp_ns: int, max_age_ns: int) -> tuple[np.ndarray, str]:
        """``(values, accel_source)`` at ``stamp_ns``: float32 (3,) in :data:`config.EGO_FEATURES` order, and one of
        :data:`ACCEL_SOURCES`.

        Values are interpolated between the bracketing samples when both lie within ``max_age_ns``, else held
        from the nearest one within it (never extrapolated). Raises LookupError with cause ``no_ego_state``,
        ``stale_ego_state`` or ``no_acceleration`` (neither a measured sample nor two speeds within
        ``max_age_ns``), ValueError for a negative ``max_age_ns``.
        """
        if max_age_ns < 0:
            raise ValueError(f"max_age_ns must be >= 0, got {max_age_ns}")
        with self._buf.lock:
            if not self._kin.stamps:
                raise LookupError("no_ego_state")
            kin = _value_at(self._kin, stamp_ns, max_age_ns)
            if kin is None:
                raise LookupError("stale_ego_state")
            measured = _value_at(self._acc, stamp_ns, max_age_ns)
            if measured is not None:
                accel, source = measured[0], "measured"
            else:
                accel, source = _slope(self._kin, stamp_ns, max_age_ns), "speed_difference"
                if accel is None:
                    raise LookupError("no_acceleration")
        speed, yaw_rate = kin
        return np.array([speed, accel, yaw_rate], dtype=np.float32), source

    def clear(self) -> None:
        """Forget every sample."""
        self._buf.clear()
