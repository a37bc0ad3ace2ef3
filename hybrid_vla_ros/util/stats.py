"""Counters and rolling latency percentiles for the nodes' diagnostics and the replay report."""
from __future__ import annotations

import threading
from collections import Counter, deque

import numpy as np


class StageTimes:
    """Thread-safe rolling window of per-stage durations in milliseconds.

    ``add(stage, ms)`` records one sample; ``summary()`` returns ``{stage: {"n", "p50", "p90",
    "mean", "max"}}`` over the last ``window`` samples of each stage (ms).
    """

    def __init__(self, window: int = 1000):
        self._window = window
        self._samples: dict[str, deque] = {}
        self._lock = threading.Lock()

    def add(self, stage: str, ms: float) -> None:
        """Record one duration (ms) of ``stage``."""
        with self._lock:
            self._samples.setdefault(stage, deque(maxlen=self._window)).append(float(ms))

    def summary(self) -> dict[str, dict[str, float]]:
        """Per stage: sample count, p50, p90, mean and max (ms) over the window."""
        with self._lock:
            snap = {k: np.asarray(v) for k, v in self._samples.items() if v}
        return {
            k: {"n": int(v.size), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
                "mean": float(v.mean()), "max": float(v.max())}
            for k, v in snap.items()
        }


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
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
