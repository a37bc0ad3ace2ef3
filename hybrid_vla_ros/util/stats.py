"""Sample summaries (percentiles), counters and rolling latency windows."""
from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np

#: The keys of :func:`percentiles`.
SUMMARY_KEYS = ("n", "p50", "p90", "p99", "mean", "min", "max")


def percentiles(values, *, finite_only: bool = False) -> dict:
    """:data:`SUMMARY_KEYS` of a sample, in its unit: numpy's linear interpolation (Hyndman and Fan's type 7).
    ``finite_only`` drops NaN / inf first. An empty sample gives ``n`` 0 and None for the rest (valid JSON)."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if finite_only:
        v = v[np.isfinite(v)]
    if v.size == 0:
        return {"n": 0, **{k: None for k in SUMMARY_KEYS[1:]}}
    p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
    return {"n": int(v.size), "p50": p50, "p90": p90, "p99": p99, "mean": float(v.mean()),
            "min": float(v.min()), "max": float(v.max())}


class StageTimes:
    """Thread-safe rolling window of the last ``window`` durations (ms) of each stage."""

    def __init__(self, window: int = 1000):
        self._window = window
        self._samples: dict[str, deque] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, ms: float) -> None:
        """Record one duration (ms) of ``stage``."""
        with self._lock:
            self._samples.setdefault(stage, deque(maxlen=self._window)).append(float(ms))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per stage with samples: :func:`percentiles` of the window (ms)."""
        with self._lock:
            snap = {k: list(v) for k, v in self._samples.items() if v}
        return {k: percentiles(v) for k, v in snap.items()}


class DropCounter:
    """Thread-safe counts of dropped frames or messages by cause (e.g. ``decode_error``)."""

    def __init__(self):
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, cause: str, n: int = 1) -> int:
        """Count ``n`` drops of ``cause``; returns the new total for that cause."""
        with self._lock:
            self._counts[cause] += n
            return self._counts[cause]

    def snapshot(self) -> dict[str, int]:
        """Cause -> count so far (a copy)."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        """Drops of every cause so far."""
        with self._lock:
            return sum(self._counts.values())
