"""Ego pose at a camera stamp, from a buffer of recent odometry.

A frame's waypoints are in the ego frame of the instant its cameras fired, so they must be moved
into ``map`` with the ego pose *at the camera stamp*, not with whatever odometry arrived last
(at 1.3 m/s, one second of difference puts the whole trajectory 1.3 m off). Autoware's
``/localization/kinematic_state`` runs at about 50 Hz, so two messages bracket any recent camera
stamp; recorded bags may be slower, and the odometry of an instant may arrive after its images.
"""
from __future__ import annotations

import math

from .timeseries import SeriesBuffer
from .trajectory import EgoState, wrap_angle


def interpolate(a: EgoState, b: EgoState, stamp_ns: int) -> EgoState:
    """Linear interpolation of position and speed, shortest-arc interpolation of yaw, at ``stamp_ns``.

    Requires a.stamp_ns <= stamp_ns <= b.stamp_ns (ns); equal stamps return ``a``'s pose.
    """
    span = b.stamp_ns - a.stamp_ns
    w = 0.0 if span <= 0 else (stamp_ns - a.stamp_ns) / span
    return EgoState(
        x=a.x + w * (b.x - a.x), y=a.y + w * (b.y - a.y), z=a.z + w * (b.z - a.z),
        yaw=wrap_angle(a.yaw + w * wrap_angle(b.yaw - a.yaw)), speed=a.speed + w * (b.speed - a.speed),
        stamp_ns=stamp_ns)


def propagate(ego: EgoState, stamp_ns: int) -> EgoState:
    """Move ``ego`` along its heading at its longitudinal speed (m/s) to ``stamp_ns`` (constant velocity)."""
    dt = (stamp_ns - ego.stamp_ns) * 1e-9
    return EgoState(x=ego.x + ego.speed * dt * math.cos(ego.yaw), y=ego.y + ego.speed * dt * math.sin(ego.yaw),
                    z=ego.z, yaw=ego.yaw, speed=ego.speed, stamp_ns=stamp_ns)


class OdometryBuffer:
    """Thread-safe, time-ordered buffer of the last ``maxlen`` ego states (from Odometry).

    :meth:`pose_at` gives the ego pose at a camera stamp: interpolated between the two states that
    bracket it, or, when the stamp lies outside the buffered span, propagated at constant velocity
    from the nearest state. Either way every state used must lie within ``max_age_ns`` of the stamp.
    :meth:`wait_for` lets the caller wait (bounded) for the state after a stamp when it has not
    arrived yet, and :meth:`wait_budget` says how long that is worth it: only while the next state is
    due by the stream's own period, never when the stream is late or has stopped (then the pose is
    propagated from the newest state at once). A state more than ``jump_back_ns`` older than the newest clears the
    buffer first (the clock jumped back; counted in ``time_jumps``; :class:`~.timeseries.SeriesBuffer`).
    """

    def __init__(self, maxlen: int = 256, jump_back_ns: int = 1_000_000_000):
        self._buf = SeriesBuffer(("odometry",), maxlen, jump_back_ns)
        self._series = self._buf.series["odometry"]

    @property
    def time_jumps(self) -> int:
        """Times the buffer was cleared because the clock jumped back."""
        return self._buf.time_jumps

    def add(self, ego: EgoState) -> None:
        """Insert a state (ns stamp in ``ego.stamp_ns``); an equal stamp replaces the older entry."""
        self._buf.add("odometry", ego.stamp_ns, ego)

    def wait_for(self, stamp_ns: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a state at or after ``stamp_ns`` is buffered; True if one is."""
        return self._buf.wait_for("odometry", stamp_ns, timeout_s)

    def wait_budget(self, stamp_ns: int, cap_s: float) -> tuple[float, str]:
        """Seconds worth waiting for the state at or after ``stamp_ns`` (ns), at most ``cap_s``, and why:
        ``bracketed`` / ``late`` (0 s), ``due`` (up to 1.5 odometry periods), ``no_period`` (``cap_s``, fewer
        than two states yet). See :meth:`~.timeseries.SeriesBuffer.wait_budget`."""
        return self._buf.wait_budget("odometry", stamp_ns, cap_s)

    def pose_at(self, stamp_ns: int, max_age_ns: int) -> tuple[EgoState, str]:
        """Ego state at ``stamp_ns`` and how it was obtained: 'interpolated' or 'propagated'.

        Raises LookupError('no_odometry') when the buffer is empty and LookupError('stale_odometry')
        when the states needed are more than ``max_age_ns`` from the stamp.
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
