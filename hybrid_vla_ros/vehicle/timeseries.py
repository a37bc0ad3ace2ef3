"""Bounded, time-ordered buffers of stamped samples: the one home of "the value of a stream at a stamp".

Odometry (for the ego pose in ``map``, :mod:`.odometry`) and the ego-state model input (speed, yaw rate,
acceleration, :mod:`.ego_input`) are both streams sampled at their own stamps and read at a camera stamp.
:class:`StampedSeries` keeps one stream ordered by stamp; :class:`SeriesBuffer` makes one or more of them
thread-safe for subscription callbacks (writers) and a worker (reader), with the clock-jump rule both need:
a sample more than ``jump_back_ns`` older than the newest of its own stream means the clock jumped back
(bag restarted, clock reset, or earlier stamps in the future), and every stream is cleared first.
"""
from __future__ import annotations

import bisect
import statistics
import threading
from typing import Generic, Iterable, TypeVar

T = TypeVar("T")

_NS_PER_S = 1_000_000_000

#: A sample is "due" for a stamp while the stamp lies within this many sample periods of the newest
#: sample: the next sample, one period after the newest, brackets it (with half a period of jitter).
DUE_PERIODS = 1.5
#: Samples whose spacing gives a stream's period (the median spacing of the newest ones).
PERIOD_SAMPLES = 16


class StampedSeries(Generic[T]):
    """Samples ``(stamp ns, item)`` in stamp order, stamps unique, at most ``maxlen`` (the oldest go first).

    Not thread-safe on its own (see :class:`SeriesBuffer`). ``stamps`` and ``items`` are the parallel lists,
    oldest first; read them, do not modify them.
    """

    def __init__(self, maxlen: int):
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self.stamps: list[int] = []
        self.items: list[T] = []

    def __len__(self) -> int:
        return len(self.stamps)

    @property
    def latest_stamp(self) -> int | None:
        """The newest stamp (ns), None when empty."""
        return self.stamps[-1] if self.stamps else None

    def insert(self, stamp_ns: int, item: T) -> None:
        """Add one sample; an equal stamp replaces the older sample; beyond ``maxlen`` the oldest is dropped."""
        i = bisect.bisect_left(self.stamps, stamp_ns)
        if i < len(self.stamps) and self.stamps[i] == stamp_ns:
            self.items[i] = item
        else:
            self.stamps.insert(i, stamp_ns)
            self.items.insert(i, item)
        if len(self.stamps) > self.maxlen:
            del self.stamps[0], self.items[0]

    def clear(self) -> None:
        self.stamps.clear()
        self.items.clear()

    def period_ns(self) -> int | None:
        """The stream's sample period (ns): the median spacing of the newest :data:`PERIOD_SAMPLES` stamps;
        None with fewer than two samples."""
        recent = self.stamps[-PERIOD_SAMPLES:]
        if len(recent) < 2:
            return None
        return int(statistics.median(b - a for a, b in zip(recent, recent[1:])))

    def bracket(self, stamp_ns: int) -> tuple[int | None, int | None]:
        """Indices of the samples around ``stamp_ns``: ``(i, i)`` for a sample exactly at it, else (the last
        before, the first after), either None where the series has none on that side."""
        i = bisect.bisect_left(self.stamps, stamp_ns)
        if i < len(self.stamps) and self.stamps[i] == stamp_ns:
            return i, i
        return (i - 1 if i > 0 else None), (i if i < len(self.stamps) else None)


class SeriesBuffer:
    """Thread-safe named :class:`StampedSeries` that share one clock.

    ``add`` (from subscription callbacks) applies the clock-jump rule and wakes waiters; ``wait_for`` blocks
    (bounded) until a stream has a sample at or after a stamp; readers hold ``lock`` while they look at
    ``series[name]``. ``time_jumps`` counts the clears a backward clock jump caused.
    """

    def __init__(self, names: Iterable[str], maxlen: int = 256, jump_back_ns: int = _NS_PER_S):
        self.series: dict[str, StampedSeries] = {name: StampedSeries(maxlen) for name in names}
        self.jump_back_ns = jump_back_ns
        self.time_jumps = 0
        self.lock = threading.Condition()

    def add(self, name: str, stamp_ns: int, item) -> None:
        """Insert a sample into stream ``name`` (see the class docstring for the clock-jump rule)."""
        with self.lock:
            series = self.series[name]
            if series.stamps and series.stamps[-1] - stamp_ns > self.jump_back_ns:
                for s in self.series.values():
                    s.clear()
                self.time_jumps += 1
            series.insert(stamp_ns, item)
            self.lock.notify_all()

    def wait_for(self, name: str, stamp_ns: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (s) until stream ``name`` holds a sample at or after ``stamp_ns``; True
        if it does."""
        series = self.series[name]
        with self.lock:
            return self.lock.wait_for(lambda: bool(series.stamps) and series.stamps[-1] >= stamp_ns,
                                      max(0.0, timeout_s))

    def wait_budget(self, name: str, stamp_ns: int, cap_s: float) -> tuple[float, str]:
        """How long (s) a reader at ``stamp_ns`` may wait for stream ``name``'s sample at or after it, and why.

        * ``(0, "bracketed")``: a sample at or after the stamp is there already;
        * ``(0, "late")``: the stamp lies more than :data:`DUE_PERIODS` periods after the newest sample, so
          at least one sample that should precede it is overdue (the stream is late or has stopped):
          waiting would only hold the frame, use what is there;
        * ``(min(cap_s, DUE_PERIODS x period), "due")``: the next sample brackets the stamp and is due within
          about a period; wait for it, never longer than ``cap_s``;
        * ``(cap_s, "no_period")``: fewer than two samples (start-up), the period is not known yet.

        The period is measured in stamp time (:meth:`StampedSeries.period_ns`), so the bound is the same
        for live sensors and for a bag replayed at its recorded rate.
        """
        series = self.series[name]
        cap_s = max(0.0, float(cap_s))
        with self.lock:
            newest, period = series.latest_stamp, series.period_ns()
        if newest is not None and newest >= stamp_ns:
            return 0.0, "bracketed"
        if newest is None or period is None:
            return cap_s, "no_period"
        if stamp_ns - newest > DUE_PERIODS * period:
            return 0.0, "late"
        return min(cap_s, DUE_PERIODS * period / _NS_PER_S), "due"

    def clear(self) -> None:
        """Forget every sample of every stream."""
        with self.lock:
            for s in self.series.values():
                s.clear()
