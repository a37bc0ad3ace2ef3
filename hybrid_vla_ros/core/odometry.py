"""Recent ego states, to pick the one that matches a camera stamp."""
from __future__ import annotations

import threading
from collections import deque


class OdometryBuffer:
    """Thread-safe buffer of the last ``maxlen`` (stamp_ns, ego state) pairs.

    ``nearest(stamp_ns, max_age_ns)`` returns the entry closest in time to a camera stamp, so the
    waypoints of a frame are placed in ``map`` with the ego pose of that frame even when the
    odometry of that instant arrives after the images (Autoware's kinematic_state runs at ~50 Hz;
    recorded bags may be slower). Raises LookupError('no_odometry') when empty and
    LookupError('stale_odometry') when the closest entry is more than ``max_age_ns`` away.
    """

    def __init__(self, maxlen: int = 256):
        self._entries: deque = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, stamp_ns: int, ego) -> None:
        with self._lock:
            self._entries.append((stamp_ns, ego))

    def nearest(self, stamp_ns: int, max_age_ns: int):
        """-> (ego, |stamp difference| in ns) of the closest entry; see the class docstring."""
        with self._lock:
            if not self._entries:
                raise LookupError("no_odometry")
            stamp, ego = min(self._entries, key=lambda e: abs(e[0] - stamp_ns))
        gap = abs(stamp - stamp_ns)
        if gap > max_age_ns:
            raise LookupError("stale_odometry")
        return ego, gap

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
