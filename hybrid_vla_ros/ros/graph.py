"""Waiting on the ROS graph: the one home of "wait until these publishers are heard".

A message published before DDS matches the subscriber is lost (volatile QoS), so whatever publishes to nodes it
just started waits here first. Duck-typed on rclpy objects; imports nothing from rclpy.
"""
from __future__ import annotations

import time
from typing import Iterable


def wait_for_subscribers(publishers: Iterable, timeout_s: float, minimum: int | dict = 1,
                         poll_s: float = 0.05) -> bool:
    """Wait up to ``timeout_s`` (s) until every publisher has ``minimum`` matched subscriptions; False on timeout.

    ``minimum``: one count, or ``{topic_name: count}`` with 1 for topics it does not name.
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


def wait_for_reliable_subscriptions(node, topics: Iterable[str], timeout_s: float, poll_s: float = 0.1,
                                    every: bool = False) -> bool:
    """Wait up to ``timeout_s`` (s) until each of ``topics`` has a reliable subscription; False on timeout.

    A prefix with ``camera_reliability: auto`` switches to reliable about a second after it hears reliable
    publishers (:mod:`.prefix_inputs`); a one-shot publisher waits here so no frame meets the switch. ``every``:
    wait until every subscription is reliable (the prefix's interim best-effort one retired too)."""
    topics = list(topics)
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [node.get_subscriptions_info_by_topic(t) for t in topics]
        test = all if every else any
        if all(info and test(i.qos_profile.reliability.name == "RELIABLE" for i in info) for info in infos):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def running_pipeline(node, namespace: str, ring_name: str, domain_id: int, discovery_s: float = 2.0,
                     poll_s: float = 0.05) -> list[str]:
    """What of a pipeline already runs in ``namespace``, one phrase each (e.g. "/ns/suffix_node"); [] when none.

    Checked before starting nodes there: two nodes of one name would answer each other's lifecycle requests.
    Sources: the ring's occupants (instant, ``transport.segment.segment_occupants``) and the ROS graph as
    ``node`` discovers it within ``discovery_s`` seconds."""
    from ..transport.segment import segment_name, segment_occupants

    ns = "/" + namespace.strip("/")
    names = {"prefix_node": f"{ns.rstrip('/')}/prefix_node", "suffix_node": f"{ns.rstrip('/')}/suffix_node"}
    segment = segment_name(ring_name, ns, domain_id)
    found: dict[str, str] = {}
    occ = segment_occupants(segment)
    if occ is not None and occ.owner_alive:
        found["prefix_node"] = f"{names['prefix_node']} (pid {occ.owner_pid}, owner of the ring {segment})"
    if occ is not None and occ.consumer_attached:
        pid = f"pid {occ.consumer_pid}, " if occ.consumer_pid > 0 else ""
        found["suffix_node"] = f"{names['suffix_node']} ({pid}attached to the ring {segment})"
    deadline = time.monotonic() + discovery_s
    while len(found) < 2:
        for name, namespace_ in node.get_node_names_and_namespaces():
            if name in names and namespace_.rstrip("/") == ns.rstrip("/") and name not in found:
                found[name] = names[name]
        if found or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return [found[n] for n in ("prefix_node", "suffix_node") if n in found]
