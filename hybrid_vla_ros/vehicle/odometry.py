"""Ego pose at a camera stamp, from a buffer of recent odometry.

Waypoints are in the ego frame of the instant the cameras fired, so they are moved into ``map`` with the pose *at
the camera stamp*, not the latest odometry (at 1.3 m/s, 1 s of difference is 1.3 m). Odometry may arrive after the
images of its instant.
"""
from __future__ import annotations

import math

from .timeseries import SeriesBuffer
from .trajectory import EgoState, wrap_angle


def interpolate(a: EgoState, b: EgoState, stamp_ns: int) -> EgoState:
    """Linear in position and speed, shortest-arc in yaw; needs ``a.stamp_ns <= stamp_ns <= b.stamp_ns``."""
    span = b.stamp_ns - a.stamp_ns
    w = 0.0 if span <= 0 else (stamp_ns - a.stamp_ns) / span
    return EgoState(
        x=a.x + w * (b.x - a.x), y=a.y + w * (b.y - a.y), z=a.z + w * (b.z - a.z),
        yaw=wrap_angle(a.yaw + w * wrap_angle(b.yaw - a.yaw)), speed=a.speed + w * (b.speed - a.speed),
        stamp_ns=stamp_ns)


def propagate(ego: EgoState, stamp_ns: int) -> EgoState:
    """``ego`` moved along its heading at constant speed to ``stamp_ns``."""
    dt = (stamp_ns - ego.stamp_ns) * 1e-9
    return EgoState(x=ego.x + ego.speed * dt * math.cos(ego.yaw), y=ego.y + ego.speed * dt * math.sin(ego.yaw),
                    z=ego.z, yaw=ego.yaw, speed=ego.speed, stamp_ns=stamp_ns)


class OdometryBuffer:
    """Thread-safe, time-ordered buffer of the last ``maxlen`` ego states; jump-back handling as
    :class:`~.timeseries.SeriesBuffer`."""

    def __init__(self, maxlen: int = 256, jump_back_ns: int = 1_000_000_000):
        self._buf = SeriesBuffer(("odometry",), maxlen, jump_back_ns)
        self._series = self._buf.series["odometry"]

    @property
    def time_jumps(self) -> int:
        """Times the buffer was cleared for a clock jump."""
        return self._buf.time_jumps

    def add(self, ego: EgoState) -> None:
        """Insert a state; an equal stamp replaces the older entry."""
        self._buf.add("odometry", ego.stamp_ns, ego)

    def wait_for(self, stamp_ns: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a state at or after ``stamp_ns`` is buffered; True if one is."""
        return self._buf.wait_for("odometry", stamp_ns, timeout_s)

    def wait_budget(self, stamp_ns: int, cap_s: float) -> tuple[float, str]:
        """:meth:`~.timeseries.SeriesBuffer.wait_budget` of the odometry stream."""
        return self._buf.wait_budget("odometry", stamp_ns, cap_s)

    def pose_at(self, stamp_ns: int, max_age_ns: int) -> tuple[EgoState, str]:
        """(state, 'interpolated' | 'propagated') at ``stamp_ns``: between bracketing states, else propagated from
        the nearest. Raises LookupError('no_odometry') when empty, LookupError('stale_odometry') when a state
        needed is more than ``max_age_ns`` from the stamp.
        """
        with self._buf.lock:
            states = self._series.items
            if not states:
                raise LookupError("no_odometry")
            lo, hi = self._series.bracket(stamp_ns)
            if lo is not None and lo == hi:
                return states[lo], "interpolated"
            if lo is not None and hi is not None:
                a, b = states[lo], states[hi]
                if stamp_ns - a.stamp_ns <= max_age_ns and b.stamp_ns - stamp_ns <= max_age_ns:
                    return interpolate(a, b, stamp_ns), "interpolated"
                nearest = min((a, b), key=lambda e: abs(e.stamp_ns - stamp_ns))
            else:
                nearest = states[lo if lo is not None else hi]
        if abs(nearest.stamp_ns - stamp_ns) > max_age_ns:
            raise LookupError("stale_odometry")
        return propagate(nearest, stamp_ns), "propagated"

    def clear(self) -> None:
        """Forget every state."""
        self._buf.clear()
