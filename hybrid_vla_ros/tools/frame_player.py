"""A looping camera + odometry player for long runs (soak script, fault tests) over rclpy publishers.

Unlike ``hybrid-vla replay`` (which plays a bag at its recorded rate), this publishes frames on demand
or on a fixed schedule, any number of them, with stamps that keep increasing across loops.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from ..ros.graph import wait_for_reliable_subscriptions, wait_for_subscribers
from ..util.stamps import header_stamp_ns, set_header_stamp

LOOP_NS = 3_000_000_000  # the embedded bag: 3 frames 1 s apart; loop k is shifted by k * 3 s
ODOM_WINDOW_NS = 950_000_000  # odometry sent with a frame: stamps within +-0.95 s (one before, one after)


class LoopingFramePlayer:
    """Publishes a bag's 6 compressed cameras as ``<ns>/cam<i>/compressed`` and its odometry as ``<ns>/odom``.

    Frame k is bag frame k % F shifted by (k // F) * ``loop_ns`` (ns), so stamps keep increasing. Before
    each frame go the odometry messages (of any loop) within +-``odom_window_ns`` of its stamp: with the
    embedded bag one before and one after it, so a suffix started at any time can interpolate the pose,
    never waits for odometry, and no odometry stamp steps back by more than the 1 s clock-jump threshold.
    Attributes: ``stamps`` (frame k's stamp, ns) and ``sent`` (stamp -> time.monotonic() after its images).
    """

    def __init__(self, node, ns: str, bag: Path, loop_ns: int = LOOP_NS, odom_window_ns: int = ODOM_WINDOW_NS):
        from rclpy.serialization import deserialize_message

        from ..util.bags import read_bag
        from .playback import message_class

        msgs = read_bag(bag)
        cams = sorted({m.topic for m in msgs if m.topic.endswith("/image_raw/compressed")})
        image_cls = message_class("sensor_msgs/msg/CompressedImage")
        odom_cls = message_class("nav_msgs/msg/Odometry")
        self.images = [[deserialize_message(m.raw, image_cls) for m in msgs if m.topic == t] for t in cams]
        self.odom = [deserialize_message(m.raw, odom_cls) for m in msgs if m.topic == "/localization/kinematic_state"]
        self.image_stamps = [header_stamp_ns(m) for m in self.images[0]]
        self.odom_stamps = [header_stamp_ns(m) for m in self.odom]
        self.n_cameras = len(cams)
        self.loop_ns, self.odom_window_ns = loop_ns, odom_window_ns
        self.pubs = [node.create_publisher(image_cls, f"{ns}/cam{i}/compressed", 10) for i in range(len(cams))]
        self.odom_pub = node.create_publisher(odom_cls, f"{ns}/odom", 10)
        self.node = node
        self.count = 0
        self.stamps: list[int] = []
        self.sent: dict[int, float] = {}

    def wait_for_subscribers(self, timeout: float = 20.0, odometry: bool = True) -> bool:
        """True once every camera publisher (and, with ``odometry``, the odometry one) has a subscriber; then up to
        10 s more until each camera topic has a reliable subscription (a prefix with ``camera_reliability: auto``
        re-subscribes reliable about a second after it hears these reliable publishers; a frame sent during that
        switch can be lost: ros/graph.wait_for_reliable_subscriptions). A prefix that stays best effort only
        costs the 10 s."""
        if not wait_for_subscribers(self.pubs + ([self.odom_pub] if odometry else []), timeout):
            return False
        wait_for_reliable_subscriptions(self.node, [p.topic_name for p in self.pubs], 10.0)
        return True

    def publish(self) -> int:
        """Publish the next frame (odometry first); returns its stamp (ns, the same for all cameras)."""
        loop, i = divmod(self.count, len(self.image_stamps))
        stamp = self.image_stamps[i] + loop * self.loop_ns
        for lp in (loop - 1, loop, loop + 1):
            for msg, s in zip(self.odom, self.odom_stamps):
                shifted = s + lp * self.loop_ns
                if abs(shifted - stamp) <= self.odom_window_ns and shifted > 0:
                    set_header_stamp(msg, shifted)
                    self.odom_pub.publish(msg)
        for pub, cam in zip(self.pubs, self.images):
            msg = cam[i]
            set_header_stamp(msg, stamp)
            pub.publish(msg)
        self.sent[stamp] = time.monotonic()
        self.stamps.append(stamp)
        self.count += 1
        return stamp

    def play(self, n: int, fps: float, stop: threading.Event | None = None) -> tuple[list[int], float]:
        """Publish ``n`` frames at ``fps`` on a fixed schedule (no drift; late frames go out at once).

        Returns (their stamps in ns, wall seconds)."""
        stamps, t0 = [], time.monotonic()
        for k in range(n):
            if stop is not None and stop.is_set():
                break
            delay = t0 + k / fps - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            stamps.append(self.publish())
        return stamps, time.monotonic() - t0
