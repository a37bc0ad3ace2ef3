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


def wait_for_reliable_subscriptions(node, topics: Iterable[str], timeout_s: float, poll_s: float = 0.1,
                                    every: bool = False) -> bool:
    """Wait up to ``timeout_s`` (s) until each of ``topics`` has a reliable subscription (as
    ``node.get_subscriptions_info_by_topic`` lists them).

    Why: a prefix with ``camera_reliability: auto`` subscribes best effort first and re-subscribes reliable
    about a second after it hears reliable publishers (ros/prefix_inputs.py); a publisher that sends a
    few frames once (a replay, a test) waits here so that no frame meets the switch. The best-effort
    subscription the prefix keeps for a few seconds beside the new one (so that the switch loses nothing) does not
    matter: a frame goes to both and is taken once; nor does another reader's best-effort subscription (a viewer).
    Seeing the subscription in this node's graph means this participant discovered it, so a reliable publisher
    here is matched to it. Returns True when each topic has one, False on timeout (e.g. a prefix configured
    ``camera_reliability: best_effort``: the caller decides whether to go on). ``every``: wait instead until
    every subscription on each topic is reliable (the prefix's best-effort one retired too: stricter, for a
    publisher that knows no other reader is there). ``node``: an rclpy node (duck-typed)."""
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
    """What of a pipeline already runs in ``namespace`` (ROS domain ``domain_id``), one phrase each; [] when
    nothing does. Used before starting nodes there (the launch file, ``hybrid-vla replay``): two nodes of one name
    would answer each other's lifecycle requests, and the newcomer's prefix could not own the ring.

    Two sources, so that the answer does not hang on discovery alone: the ring (instant and certain for a
    configured pair: its owner process alive, a consumer holding its lock; ``transport.segment.segment_occupants``)
    and the ROS graph as the rclpy ``node`` discovers it within ``discovery_s`` seconds (nodes named
    ``<namespace>/prefix_node`` or ``<namespace>/suffix_node``, configured or not). Phrases look like
    "/ns/prefix_node (pid 4242, owner of the ring hybrid_vla.0.d0.-ns.prefix_states)" or "/ns/suffix_node"."""
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
