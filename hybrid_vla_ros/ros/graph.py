"""Waiting on the ROS graph: the one home of "wait until these publishers are heard".

DDS discovery takes a moment after a node starts or a publisher is created; a message published before the
subscriber is matched is lost (volatile QoS). Anything that publishes to nodes it just started (the replay,
the frame player, tests) waits here first. Duck-typed on rclpy's ``Publisher.get_subscription_count()``, so
this module imports nothing from rclpy.
"""
from __future__ import annotations

import time
from typing import Iterable


def wait_for_subscribers(publishers: Iterable, timeout_s: float, minimum: int | dict = 1,
                         poll_s: float = 0.05) -> bool:
    """Wait up to ``timeout_s`` (s) until every publisher has at least ``minimum`` matched subscriptions.

    ``minimum`` is one count for all, or a dict from topic name (``publisher.topic_name``) to a count, with
    1 for the topics it does not name. Returns True when they all have, False on timeout (the caller decides
    whether that is an error: e.g. a camera_info topic nobody reads).
    """
    publishers = list(publishers)

    def enough(pub) -> bool:
        want = minimum.get(pub.topic_name, 1) if isinstance(minimum, dict) else minimum
        return pub.get_subscription_count() >= want

    deadline = time.monotonic() + timeout_s
    while True:
        if all(enough(p) for p in publishers):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
