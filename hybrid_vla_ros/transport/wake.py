"""Waking the consumer: a Unix datagram socket only the owner's user can reach, and a bounded spin before it.

Channel: the producer creates a directory ``/dev/shm/hvla-wake.<uid>.d<ROS domain>.<pid>-<start time>.<16 random
hex>`` (mode 0700; ``dx``: no ROS domain; mkdir(2) fails if the name exists, so nobody can plant it first;
/dev/shm is sticky, so nobody else can rename or remove it) and writes its name into the 0600 segment's global
header. The consumer binds ``<dir>/wake``; the producer sends one byte per publish to it. Another user can
neither bind, connect nor send there (every path lookup under someone else's 0700 directory fails with EACCES:
path_resolution(7)), nor learn the name. A filesystem socket is found by path, not per network namespace (unlike
the abstract namespace, unix(7)), so wake-ups and the single-consumer rule work for a consumer in another one.

Spin: waking an idle, blocked consumer costs the kernel's wake-up of an idle CPU (a few hundred microseconds;
docs/performance.md), while a consumer polling memory on its own core sees a publish within microseconds.
:class:`SpinPolicy` predicts the next frame from recent publish instants and spins only from ``lead_ms`` (plus
three times the recent jitter) before it is due, for at most ``max_ms`` (about ``lead_ms`` of one core per
frame), then blocks on the socket. When most recent spins missed it pauses (blocks only) for a while: on shared
cores a spinning task also loses the scheduler's wake-up preference, so a missed spin costs more than none.
"""
from __future__ import annotations

import errno
import math
import os
import re
import secrets
import select
import socket
import stat
import time
from collections import deque

from .errors import RingError
from .layout import GLOBAL
from .segment import SHM_DIR

__all__ = ["SpinPolicy", "make_wake_dir", "wake_socket_path", "remove_wake_dir", "WakeSender", "WakeReceiver",
           "FrameWaiter"]

_DIR_RE = re.compile(r"hvla-wake\.[0-9]+\.d(?:[0-9]+|x)\.[0-9]+-[0-9]+\.[0-9a-f]{16}")
WAKE_DIR_PREFIX = "hvla-wake."
SOCKET_NAME = "wake"
#: The producer's socket in the same directory: the consumer's decode replies wake it (:mod:`.decode_channel`).
REPLY_SOCKET_NAME = "reply"
_IGNORED_SEND_ERRNOS = {errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN, errno.ENOBUFS}


def _start_time() -> int:
    from .segment import proc_identity

    return proc_identity(os.getpid())[1]


def wake_dir_owner(name: str) -> tuple[int, int] | None:
    """(pid, start time) of the process that created wake-up directory ``name``, or None for another name."""
    if not isinstance(name, str) or not _DIR_RE.fullmatch(name):
        return None
    pid, start = name.split(".")[3].split("-")
    return int(pid), int(start)


def make_wake_dir(record=None, domain_id: int | None = None) -> str:
    """Create a fresh wake-up directory (module docstring; ``domain_id`` None: ``dx``) and return its name (< 64
    characters). ``record(name)`` is called before each mkdir, so a producer killed right after it has already
    written the name into its header, where its successor finds it."""
    for _ in range(16):
        domain = "x" if domain_id is None else int(domain_id)
        name = f"hvla-wake.{os.getuid()}.d{domain}.{os.getpid()}-{_start_time()}.{secrets.token_hex(8)}"
        if record is not None:
            record(name)
        try:
            os.mkdir(os.path.join(SHM_DIR, name), 0o700)
        except FileExistsError:
            continue
        os.chmod(os.path.join(SHM_DIR, name), 0o700)  # whatever the umask
        return name
    raise RingError("could not create a wake-up directory in /dev/shm")


def wake_socket_path(name: str, socket_name: str = SOCKET_NAME) -> str:
    """Path of the wake socket (``socket_name``: the consumer's, or :data:`REPLY_SOCKET_NAME`) in directory
    ``name``; RingError unless that is a real 0700 directory of this uid (a foreign or tampered header)."""
    if not isinstance(name, str) or not _DIR_RE.fullmatch(name) or name.split(".")[1] != str(os.getuid()):
        raise RingError(f"the ring's wake-up directory name {name!r} is not one of this user's")
    path = os.path.join(SHM_DIR, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RingError(f"the ring's wake-up directory {path} is missing") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise RingError(f"{path} is not a private directory of uid {os.getuid()} (mode "
                        f"{stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})")
    return os.path.join(path, socket_name)


def remove_wake_dir(name: str) -> None:
    """Remove a wake-up directory of this uid and its socket (nothing for a foreign or missing one)."""
    if not isinstance(name, str) or not _DIR_RE.fullmatch(name) or name.split(".")[1] != str(os.getuid()):
        return
    path = os.path.join(SHM_DIR, name)
    for socket_name in (SOCKET_NAME, REPLY_SOCKET_NAME):
        try:
            os.unlink(os.path.join(path, socket_name))
        except (FileNotFoundError, NotADirectoryError):
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass


def _datagram_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


class WakeSender:
    """The producer's end: one byte per :meth:`send` to the consumer's socket path."""

    def __init__(self, path: str):
        self.path = path
        self.sock = _datagram_socket()

    def send(self) -> bool:
        """Send one wake byte; False only for an unexpected error (no consumer bound or its queue full is fine)."""
        try:
            self.sock.sendto(b"\x01", self.path)
        except OSError as e:
            return e.errno in _IGNORED_SEND_ERRNOS
        return True

    def close(self) -> None:
        self.sock.close()


class WakeReceiver:
    """The consumer's end: bound to ``path`` (a stale socket file left by a dead predecessor is replaced:
    call only while holding the single-consumer lock). Raises OSError if it cannot bind."""

    def __init__(self, path: str):
        self.path = path
        self.sock = _datagram_socket()
        try:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self.sock.bind(path)
        except BaseException:
            self.sock.close()
            raise
        self._poll = select.poll()
        self._poll.register(self.sock.fileno(), select.POLLIN)
        self._buf = bytearray(64)

    def drain(self) -> None:
        """Discard pending wake bytes (the consumer looks at the slots right after)."""
        try:
            while True:
                self.sock.recv_into(self._buf)
        except BlockingIOError:
            pass

    def wait(self, timeout_ms: int) -> None:
        """Block until a wake byte is pending or ``timeout_ms`` (>= 0) has passed."""
        self._poll.poll(timeout_ms)

    def close(self) -> None:
        """Unbind: remove the socket file (before the single-consumer lock is given up) and close."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.sock.close()


class SpinPolicy:
    """When to spin for the next frame (module docstring).

    ``lead_ms`` (>= 0): start this long before the predicted publish (plus 3 x the median absolute deviation of the
    recent periods); ``max_ms`` (> 0): spin at most this long per frame; ``history`` (>= 2): publish intervals kept.
    Raises ValueError for bad values.
    """

    #: Spins judged at once; when more than half of them missed, the spin pauses for as many frames.
    OUTCOMES = 16

    def __init__(self, lead_ms: float = 1.0, max_ms: float = 5.0, history: int = 8):
        if not lead_ms >= 0 or not max_ms > 0 or history < 2:
            raise ValueError(f"spin needs lead_ms >= 0, max_ms > 0, history >= 2; got {lead_ms}, {max_ms}, {history}")
        self.lead_ns, self.max_ns = int(lead_ms * 1e6), int(max_ms * 1e6)
        self._periods: deque = deque(maxlen=history)
        self._last: tuple[int, int] | None = None  # (seq, t_publish_ns) of the newest frame seen
        self._outcomes: deque = deque(maxlen=self.OUTCOMES)
        self._paused = 0  # frames left without spinning
        #: Times the spin paused (blocked only, for ``OUTCOMES`` frames) because most spins missed.
        self.pauses = 0

    def outcome(self, hit: bool) -> None:
        """Record whether a spin found its frame (True) or reached its bound (False)."""
        self._outcomes.append(bool(hit))
        if len(self._outcomes) == self.OUTCOMES and sum(not h for h in self._outcomes) > self.OUTCOMES // 2:
            self._paused, self.pauses = self.OUTCOMES, self.pauses + 1
            self._outcomes.clear()

    def observe(self, seq: int, t_publish_ns: int) -> None:
        """Record a delivered frame's seq and publish instant (CLOCK_MONOTONIC ns)."""
        last = self._last
        if last is not None and seq > last[0] and t_publish_ns > last[1]:
            self._periods.append((t_publish_ns - last[1]) / (seq - last[0]))
        if last is None or seq > last[0]:
            self._last = (seq, t_publish_ns)
        if self._paused:
            self._paused -= 1

    def reset(self) -> None:
        """Forget the history (a new producer)."""
        self._periods.clear()
        self._last = None

    def window(self) -> tuple[int, int] | None:
        """(spin from, spin until), CLOCK_MONOTONIC ns, for the next frame; None without a prediction or paused."""
        if len(self._periods) < 2 or self._paused:
            return None
        periods = sorted(self._periods)
        period = periods[len(periods) // 2]
        jitter = sorted(abs(p - period) for p in periods)[len(periods) // 2]
        lead = min(self.max_ns, self.lead_ns + 3 * jitter)
        start = int(self._last[1] + period - lead)
        return start, start + self.max_ns


class FrameWaiter:
    """How the consumer's read() waits for a frame: look at the slots, drain stale wake-ups and look again, then
    spin on the publish count inside the :class:`SpinPolicy` window (passed per call: the consumer may replace it)
    and block on ``receiver`` outside it. ``counts``: the ``found_*`` and ``spin_*`` counters of
    :class:`~.stats.ConsumerStats` (``spin_ns`` in ns).
    """

    #: Block until this long (ns) before a spin window opens: poll(2) counts in ms, so the wait ends 0.5-1.5
    #: ms before the spin starts.
    BLOCK_MARGIN_NS = 1_500_000

    def __init__(self, receiver: WakeReceiver):
        self.receiver = receiver
        self.counts = {"found_ready": 0, "found_spinning": 0, "found_after_block": 0, "spin_misses": 0,
                       "spin_ns": 0}

    def wait_for(self, take, deadline_ns: int, gone, mm, spin: SpinPolicy | None):
        """Look for a frame until ``deadline_ns`` (CLOCK_MONOTONIC ns) or ``gone()`` and return it, or None.

        ``take()`` looks once: (a frame with a ``meta`` FrameMeta, or None; the publish count seen). A frame
        returned is counted and told to ``spin``. Raises what ``take`` raises.
        """
        receiver, how = self.receiver, "found_ready"
        while True:
            frame, seen = take()
            if frame is None:
                receiver.drain()
                frame, seen = take()
            if frame is not None:
                self.counts[how] += 1
                if spin is not None:
                    spin.observe(frame.meta.seq, frame.meta.t_publish_ns)
                return frame
            now = time.monotonic_ns()
            if now >= deadline_ns or gone():
                return None
            how = self._wait_once(mm, seen, now, deadline_ns, spin)

    def _wait_once(self, mm, seen: int, now_ns: int, deadline_ns: int, spin: SpinPolicy | None) -> str:
        """Wait once, at most until ``deadline_ns``, for a publish after count ``seen``: in the spin window poll
        the count, before it block until just before it opens, without one block until a wake-up. Returns the
        counter for a frame the next look finds: 'found_spinning' or 'found_after_block'."""
        receiver = self.receiver
        window = spin.window() if spin is not None else None
        if window is not None and now_ns < window[1]:
            if window[0] - now_ns > self.BLOCK_MARGIN_NS:
                receiver.wait(math.ceil((min(window[0] - self.BLOCK_MARGIN_NS, deadline_ns) - now_ns) / 1e6))
                return "found_after_block"
            hit = self._spin_until(mm, min(window[1], deadline_ns), seen)
            spin.outcome(hit or window[1] > deadline_ns)  # a spin cut short by the timeout did not miss
            if hit:
                return "found_spinning"
            now_ns = time.monotonic_ns()
        receiver.wait(max(0, math.ceil((deadline_ns - now_ns) / 1e6)))
        return "found_after_block"

    def _spin_until(self, mm, until_ns: int, seen: int) -> bool:
        """Poll the publish count until it differs from ``seen`` (True) or ``until_ns`` passes (False)."""
        count, now = GLOBAL.published.read, time.monotonic_ns
        t0 = t = now()
        hit = False
        while t < until_ns:
            if count(mm)[0] != seen:
                hit = True
                break
            t = now()
        self.counts["spin_ns"] += now() - t0
        if not hit:
            self.counts["spin_misses"] += 1
        return hit
