"""Multi-camera time synchronization by header stamp, pure Python (no ROS, no message_filters).

The prefix node feeds every camera message here, undecoded, with its ``header.stamp`` in integer
nanoseconds; a frame is released once every camera has one message and all chosen stamps lie within
``tolerance_ns`` of each other. Only then are the images decoded, so a frame that never completes costs
no decode. ``message_filters`` (ApproximateTime) is not installable from PyPI here, and its policy has no
bound on the stamp spread; this is the small fixed-tolerance variant the pipeline needs.
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
    """One synchronized frame: unpacks as ``stamp_ns, items = synced_set``.

    Attributes:
        stamp_ns: reference stamp (ns) = the **newest** (maximum) header stamp in the set, so no image
            of the frame is later than it; per-camera stamps are in
            :attr:`CameraSynchronizer.last_stamps_ns`.
        items: the items passed to :meth:`CameraSynchronizer.add`, one per camera, in camera-index order.
    """

    stamp_ns: int
    items: list


class CameraSynchronizer:
    """Group one message per camera whose stamps lie within a tolerance.

    Args:
        n_cameras: number of cameras (>= 1); camera indices are ``0 .. n_cameras - 1``.
        tolerance_ns: largest allowed spread ``max(stamps) - min(stamps)`` within one set (ns, >= 0).
        queue_depth: messages kept per camera while waiting (>= 1); the oldest is dropped beyond it.
        jump_back_ns: a backwards step larger than this is a clock jump, not a late message (ns, >= 1).

    Behaviour:
        * Per camera, stamps must strictly increase: an equal stamp is counted as ``duplicate``, an
          older one as ``out_of_order``; both are discarded.
        * A stamp more than ``jump_back_ns`` older than that camera's last one is a clock jump, counted
          as ``time_jump``. When no other camera's last stamp lies within ``jump_back_ns`` of the new
          stamp, the whole clock jumped (a bag restarted, a sensor clock reset, or every camera's earlier
          stamps far in the future): every queue and stamp history is cleared, the queued messages count
          as ``unsynced``, and the new message starts the new timeline. When some other camera is on the
          new stamp's timeline, only this camera's earlier stamps were off (one camera stamped far in
          the future): only its own queue (counted as ``unsynced``) and history are cleared, so the
          other cameras' messages of the frame in progress are kept.
        * :meth:`add` returns a :class:`SyncedSet` when the new message completes a set (each camera
          contributes the message closest in time to the new one inside the best window of width
          ``tolerance_ns``), else ``None``. At most one set is completed per call.
        * After a set is emitted, every queued message at or before the one used for its camera is
          removed; the skipped older ones count as ``unsynced``.
        * A queued message that can no longer be matched -- some other camera has already moved more
          than ``tolerance_ns`` past it without a partner in its queue -- is discarded as ``unsynced``.
          A camera whose last stamp is more than ``jump_back_ns`` ahead of the message does not count
          as having moved past it: that stamp is a jump or an outlier, and the camera's next message
          decides which (otherwise one camera stamped an hour ahead would discard every other camera's
          next message before its own next message is seen).
        * A camera that stops publishing makes the others' queues fill up: the first message pushed
          out of a frame counts as ``queue_overflow``, the frame's other members then as ``unsynced``.
          Every discarded message is counted exactly once.

    Attributes:
        drops: cumulative counters ``{cause: count}`` for the causes in :data:`DROP_CAUSES`.
        sets_emitted: number of sets returned so far.
        last_stamps_ns: per-camera stamps (ns, camera order) of the last emitted set, or ``None``.

    Thread safety: :meth:`add`, :meth:`pop_drops` and :meth:`reset` hold an internal lock.
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
        """Queue one message and return the set it completes, if any.

        Args:
            camera_index: ``0 .. n_cameras - 1``.
            stamp_ns: the message's ``header.stamp`` in ns (int >= 0).
            item: anything (typically the undecoded message); returned as is, never inspected.

        Returns:
            :class:`SyncedSet` ``(stamp_ns = max stamp of the set, items in camera order)`` or ``None``.

        Raises:
            ValueError: ``camera_index`` out of range or not an int; ``stamp_ns`` not an int >= 0.
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
        """Drops since the previous call, ``{cause: count}`` with only non-zero causes (for diagnostics)."""
        with self._lock:
            new = {k: v - self._reported[k] for k, v in self.drops.items() if v != self._reported[k]}
            self._reported = dict(self.drops)
        return new

    def reset(self) -> None:
        """Forget queued messages and per-camera stamp history (counters are kept); e.g. after a clock jump."""
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
        """Camera ``cam``'s new ``stamp`` lies more than ``jump_back_ns`` before its last one: start over
        rather than wait for time to catch up. Only ``cam`` restarts when another camera is on the new
        stamp's timeline (``cam``'s earlier stamps were the outliers), every camera otherwise."""
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
