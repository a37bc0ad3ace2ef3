"""Multi-camera time synchronization by header stamp, pure Python (no ROS, no message_filters).

The prefix node feeds undecoded camera messages here and decodes only released frames. ``message_filters``
(ApproximateTime) is not on PyPI and does not bound the stamp spread; this is a fixed-tolerance variant.
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from typing import Any, NamedTuple

__all__ = ["CameraSynchronizer", "SyncedSet", "DROP_CAUSES"]

#: Causes counted in :attr:`CameraSynchronizer.drops`.
DROP_CAUSES = ("unsynced", "queue_overflow", "out_of_order", "duplicate", "time_jump")


class SyncedSet(NamedTuple):
    """One frame: ``stamp_ns`` the **newest** stamp of the set (ns), ``items`` in camera order.

    Per-camera stamps are in :attr:`CameraSynchronizer.last_stamps_ns`.
    """

    stamp_ns: int
    items: list


class CameraSynchronizer:
    """Group one message per camera (``n_cameras``) whose stamps spread at most ``tolerance_ns``.

    ``queue_depth`` messages are kept per camera; a backward step over ``jump_back_ns`` is a clock jump. Every
    discarded message is counted once in ``drops`` (cumulative, :data:`DROP_CAUSES`):

    * per camera stamps must strictly increase (else ``duplicate`` / ``out_of_order``);
    * ``time_jump``: when no other camera is on the new stamp's timeline every queue is cleared, else only this
      camera's (its earlier stamps were the outliers); cleared messages count as ``unsynced``;
    * a set takes, per camera, the message nearest the new one in the tightest window; older queued messages
      then count as ``unsynced``, as does one another camera has passed by more than ``tolerance_ns`` without
      a partner (a camera more than ``jump_back_ns`` ahead does not count as passing: its next message decides);
    * a stopped camera fills the others' queues: the first message pushed out is ``queue_overflow``.

    :meth:`add`, :meth:`pop_drops` and :meth:`reset` hold an internal lock.
    """

    def __init__(self, n_cameras: int, tolerance_ns: int, queue_depth: int = 4,
                 jump_back_ns: int = 1_000_000_000) -> None:
        self.n_cameras = _positive_int(n_cameras, "n_cameras", minimum=1)
        self.tolerance_ns = _positive_int(tolerance_ns, "tolerance_ns", minimum=0)
        self.queue_depth = _positive_int(queue_depth, "queue_depth", minimum=1)
        self.jump_back_ns = _positive_int(jump_back_ns, "jump_back_ns", minimum=1)
        self._queues: list[deque[tuple[int, Any]]] = [deque() for _ in range(self.n_cameras)]
        self._last_stamp: list[int | None] = [None] * self.n_cameras
        self.drops: dict[str, int] = dict.fromkeys(DROP_CAUSES, 0)
        self._reported: dict[str, int] = dict.fromkeys(DROP_CAUSES, 0)
        self.sets_emitted = 0
        self.last_stamps_ns: tuple[int, ...] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ public
    def add(self, camera_index: int, stamp_ns: int, item: Any) -> SyncedSet | None:
        """Queue ``item`` (never inspected) and return the :class:`SyncedSet` it completes, if any (at most one).

        Raises ValueError for ``camera_index`` not an int in range or ``stamp_ns`` not an int >= 0.
        """
        cam = _index(camera_index, "camera_index")
        if not 0 <= cam < self.n_cameras:
            raise ValueError(f"camera_index {cam} outside [0, {self.n_cameras})")
        stamp = _index(stamp_ns, "stamp_ns")
        if stamp < 0:
            raise ValueError(f"stamp_ns must be >= 0, got {stamp}")
        with self._lock:
            last = self._last_stamp[cam]
            if last is not None and last - stamp > self.jump_back_ns:
                self._restart_after_jump(cam, stamp)
                last = None
            if last is not None and stamp <= last:
                self.drops["duplicate" if stamp == last else "out_of_order"] += 1
                return None
            self._last_stamp[cam] = stamp
            queue = self._queues[cam]
            queue.append((stamp, item))
            if len(queue) > self.queue_depth:
                queue.popleft()
                self.drops["queue_overflow"] += 1
            result = self._try_emit(cam, stamp)
            self._prune()
            return result

    def pop_drops(self) -> dict[str, int]:
        """Non-zero drops since the previous call, ``{cause: count}``."""
        with self._lock:
            new = {k: v - self._reported[k] for k, v in self.drops.items() if v != self._reported[k]}
            self._reported = dict(self.drops)
        return new

    def reset(self) -> None:
        """Forget queued messages and stamp history; counters are kept."""
        with self._lock:
            for queue in self._queues:
                queue.clear()
            self._last_stamp = [None] * self.n_cameras

    @property
    def queued(self) -> tuple[int, ...]:
        """Messages currently waiting, per camera."""
        return tuple(len(q) for q in self._queues)

    # ----------------------------------------------------------------------------------- private
    def _restart_after_jump(self, cam: int, stamp: int) -> None:
        """Start over after camera ``cam`` jumped back (see the class docstring)."""
        self.drops["time_jump"] += 1
        others_agree = any(s is not None and abs(s - stamp) <= self.jump_back_ns
                           for j, s in enumerate(self._last_stamp) if j != cam)
        restarted = [cam] if others_agree else range(self.n_cameras)
        for j in restarted:
            self.drops["unsynced"] += len(self._queues[j])
            self._queues[j].clear()
            self._last_stamp[j] = None

    def _try_emit(self, cam: int, stamp: int) -> SyncedSet | None:
        tol = self.tolerance_ns
        # A set containing the new message lies in a window [lo, lo + tol] with stamp - tol <= lo <= stamp.
        candidates: list[list[int]] = []
        for j, queue in enumerate(self._queues):
            if j == cam:
                candidates.append([stamp])
                continue
            near = [s for s, _ in queue if abs(s - stamp) <= tol]
            if not near:
                return None
            candidates.append(near)
        window_starts = sorted({s for near in candidates for s in near if s <= stamp})
        best: tuple[int, list[int]] | None = None
        for lo in window_starts:
            hi = lo + tol
            chosen = []
            for near in candidates:
                inside = [s for s in near if lo <= s <= hi]
                if not inside:
                    break
                chosen.append(min(inside, key=lambda s: (abs(s - stamp), s)))
            else:
                spread = max(chosen) - min(chosen)
                if best is None or spread < best[0]:
                    best = (spread, chosen)
        if best is None:
            return None
        chosen = best[1]
        items = []
        for j, queue in enumerate(self._queues):
            target = chosen[j]
            while queue:
                s, item = queue.popleft()
                if s == target:
                    items.append(item)
                    break
                self.drops["unsynced"] += 1  # older than the message used for this camera
        self.sets_emitted += 1
        self.last_stamps_ns = tuple(chosen)
        return SyncedSet(max(chosen), items)

    def _prune(self) -> None:
        tol = self.tolerance_ns
        for j, queue in enumerate(self._queues):
            if not queue:
                continue
            keep = deque()
            for s, item in queue:
                if self._can_still_match(j, s, tol):
                    keep.append((s, item))
                else:
                    self.drops["unsynced"] += 1
            if len(keep) != len(queue):
                self._queues[j] = keep

    def _can_still_match(self, cam: int, stamp: int, tol: int) -> bool:
        for i, queue in enumerate(self._queues):
            if i == cam:
                continue
            last = self._last_stamp[i]
            if last is None or last < stamp + tol:
                continue  # camera i may still deliver a message within tolerance
            if last - stamp > self.jump_back_ns:
                continue  # camera i jumped far ahead: a clock jump or one bad stamp; its next message tells
            if not any(abs(s - stamp) <= tol for s, _ in queue):
                return False
        return True


def _index(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None


def _positive_int(value, name: str, minimum: int) -> int:
    value = _index(value, name)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
