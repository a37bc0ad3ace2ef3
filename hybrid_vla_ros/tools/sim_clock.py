"""The bag's clock on ``/clock``, as ``ros2 bag play --clock`` publishes it, for nodes run with ``use_sim_time``.

A replayed bag carries its recorded stamps. Nodes on system time would judge them years old (the output
guard's age check); nodes with ``use_sim_time: true`` take their clock from ``/clock`` instead
(``rosgraph_msgs/msg/Clock``, REP 2008-style simulation time as rclpy's ``TimeSource`` implements it), so
the replay publishes the bag's time there: held at the bag's first receive time until playback starts,
then ``t0 + rate x (wall time since the start of playback)``, advanced to each message's receive time
(shifted by the loop offset, exactly as the message stamps are) before that message goes out, so a node
never sees a message from its own future. Between loops it keeps running, so time keeps increasing.

It publishes at :data:`PUBLISH_HZ` (rosbag2's default ``--clock`` rate, 40 Hz) from a thread of its own
and never goes backwards.
"""
from __future__ import annotations

import threading
import time

#: How often the clock is published while nothing else moves it (Hz): rosbag2's ``--clock`` default.
PUBLISH_HZ = 40.0


class BagClock:
    """Publishes a bag's time on ``/clock`` from ``node`` (an rclpy node).

    ``hold(t_ns)``: stand still at ``t_ns`` (ns, the bag's time); ``run(t0_ns, wall0, rate)``: from then on,
    bag time = ``t0_ns + (time.monotonic() - wall0) x rate`` s; ``advance_to(t_ns)``: publish at least
    ``t_ns`` now (before a message with that receive time goes out). Thread-safe; :meth:`stop` ends the
    publishing thread. ``now_ns`` is the last time published (ns).
    """

    def __init__(self, node, start_ns: int, hz: float = PUBLISH_HZ):
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rosgraph_msgs.msg import Clock

        self._msg_cls = Clock
        # Reliable keep-last 1: matches rclpy's and rclcpp's best-effort /clock subscriptions and reliable ones.
        self._pub = node.create_publisher(Clock, "/clock", QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE))
        self._lock = threading.Lock()
        self._period_s = 1.0 / hz
        self._running: tuple[int, float, float] | None = None  # (t0 ns, wall0 s, rate) once playing
        self.now_ns = int(start_ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bag_clock", daemon=True)

    def start(self) -> "BagClock":
        """Publish now and every 1 / ``hz`` s from a background thread; returns self."""
        self._publish(self.now_ns)
        self._thread.start()
        return self

    def hold(self, t_ns: int) -> None:
        """Stand still at bag time ``t_ns`` (ns) (never before a time already published)."""
        with self._lock:
            self._running = None
        self._publish(t_ns)

    def run(self, t0_ns: int, wall0: float, rate: float) -> None:
        """Advance with the wall clock from bag time ``t0_ns`` at ``time.monotonic() == wall0``, ``rate`` x real
        time."""
        with self._lock:
            self._running = (int(t0_ns), float(wall0), float(rate))
        self._publish(self._running_time())

    def advance_to(self, t_ns: int) -> None:
        """Publish bag time ``t_ns`` (ns) now unless the clock is past it already."""
        self._publish(t_ns)

    def stop(self) -> None:
        """End the publishing thread (the publisher stays until its node is destroyed)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    def _running_time(self) -> int:
        with self._lock:
            running = self._running
        if running is None:
            return self.now_ns
        t0_ns, wall0, rate = running
        return t0_ns + int((time.monotonic() - wall0) * rate * 1e9)

    def _publish(self, t_ns: int) -> None:
        with self._lock:
            self.now_ns = max(self.now_ns, int(t_ns))
            msg = self._msg_cls()
            msg.clock.sec, msg.clock.nanosec = divmod(self.now_ns, 1_000_000_000)
            self._pub.publish(msg)

    def _loop(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self._publish(self._running_time())
            except Exception:  # noqa: BLE001 - the context is shutting down: nothing left to tell
                return
