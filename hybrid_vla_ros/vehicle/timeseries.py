"""Bounded, time-ordered buffers of stamped samples: the one home of "the value of a stream at a stamp".

Used by :mod:`.odometry` and :mod:`.ego_input`, streams sampled at their own stamps and read at a camera stamp.
"""
from __future__ import annotations

import bisect
import statistics
import threading
from typing import Generic, Iterable, TypeVar

T = TypeVar("T")

_NS_PER_S = 1_000_000_000

#: A sample is "due" while the stamp lies within this many periods of the newest sample (half a period of jitter).
DUE_PERIODS = 1.5
#: Newest samples whose median spacing gives a stream's period.
PERIOD_SAMPLES = 16


class StampedSeries(Generic[T]):
    """Samples ``(stamp ns, item)`` in stamp order, stamps unique, at most ``maxlen`` (the oldest go first).

    Not thread-safe (see :class:`SeriesBuffer`). ``stamps`` and ``items`` are parallel read-only lists.
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
        """Add a sample; an equal stamp replaces the older one."""
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
        """Sample period (ns) over the newest :data:`PERIOD_SAMPLES`; None with fewer than two samples."""
        recent = self.stamps[-PERIOD_SAMPLES:]
        if len(recent) < 2:
            return None
        return int(statistics.median(b - a for a, b in zip(recent, recent[1:])))

    def bracket(self, stamp_ns: int) -> tuple[int | None, int | None]:
        """(last before, first after) indices around ``stamp_ns``, ``(i, i)`` on an exact hit, None where none."""
        i = bisect.bisect_left(self.stamps, stamp_ns)
        if i < len(self.stamps) and self.stamps[i] == stamp_ns:
            return i, i
        return (i - 1 if i > 0 else None), (i if i < len(self.stamps) else None)


class SeriesBuffer:
    """Thread-safe named :class:`StampedSeries` sharing one clock; readers hold ``lock`` while reading ``series``.

    A sample more than ``jump_back_ns`` older than its stream's newest means the clock jumped back (bag
    restarted, clock reset): every stream is cleared first and ``time_jumps`` counts it.
    """

    def __init__(self, names: Iterable[str], maxlen: int = 256, jump_back_ns: int = _NS_PER_S):
        self.series: dict[str, StampedSeries] = {name: StampedSeries(maxlen) for name in names}
        self.jump_back_ns = jump_back_ns
        self.time_jumps = 0
        self.lock = threading.Condition()

    def add(self, name: str, stamp_ns: int, item) -> None:
        """Insert a sample into stream ``name`` and wake waiters."""
        with self.lock:
            series = self.series[name]
            if series.stamps and series.stamps[-1] - stamp_ns > self.jump_back_ns:
                for s in self.series.values():
                    s.clear()
                self.time_jumps += 1
            series.insert(stamp_ns, item)
            self.lock.notify_all()

    def wait_for(self, name: str, stamp_ns: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` (s) for a sample at or after ``stamp_ns``; True if there is one."""
        series = self.series[name]
        with self.lock:
            return self.lock.wait_for(lambda: bool(series.stamps) and series.stamps[-1] >= stamp_ns,
                                      max(0.0, timeout_s))

    def wait_budget(self, name: str, stamp_ns: int, cap_s: float) -> tuple[float, str]:
        """(seconds, reason) a reader at ``stamp_ns`` may wait for stream ``name``'s next sample.

        ``(0, "bracketed")``: already there; ``(0, "late")``: the stamp is more than :data:`DUE_PERIODS`
        periods past the newest sample (stream late or stopped: use what is there);
        ``(min(cap_s, DUE_PERIODS x period), "due")``; ``(cap_s, "no_period")``: fewer than two samples.
        The period is in stamp time, so live sensors and replayed bags get the same bound.
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
