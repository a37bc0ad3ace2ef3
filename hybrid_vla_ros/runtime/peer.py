"""How each stage sees the other: the peer status a node reports on /diagnostics (no ROS imports).

A safety monitor must learn from the surviving stage, within a stated time, that its peer is gone, with cause and
peer named. The prefix (producer) observes the ring's single-consumer OFD lock (dropped by the kernel when its
holder dies, SIGKILL included), the holder's pid, paused state, last take and announced next read
(``transport.producer.ConsumerPresence``). The suffix (consumer) observes whether the ring exists, whether its
owner lives (pid and start time), the producer's paused state, last publish and announced cycle
(``RingProducer.announce_cycle``), and why an attach failed.

Nodes check every :data:`CHECK_PERIOD_S` and publish on change, so a dead peer is an ERROR within that period
plus one publish. A live producer is stalled once its last publish is :data:`STALL_CYCLES` announced cycles old
(at least :data:`PRODUCER_MIN_GRACE_S`). A consumer holding the ring is stalled once a frame waits ``grace_ns``
past the later of its publish and the read the consumer announced (``RingConsumer.announce_next_read``, so a
suffix slower than the cameras is not mistaken for a stall). Neither is judged before it has announced a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PeerStatus", "PEER_CAUSES", "CHECK_PERIOD_S", "MIN_GRACE_S", "PRODUCER_MIN_GRACE_S", "STALL_CYCLES",
           "consumer_status", "producer_status", "stall_grace_ns"]

#: How often a node checks its peer (s); a change is published on /diagnostics at once.
CHECK_PERIOD_S = 0.1
#: The shortest grace for a consumer that takes no frame (s), whatever the camera rate.
MIN_GRACE_S = 0.3
#: The shortest grace for a producer that publishes no frame (s), whatever its cycle: a busy 2-core machine can
#: hold a fast prefix back for a few tenths of a second without anything being wrong.
PRODUCER_MIN_GRACE_S = 0.5
#: A producer that has published nothing for this many of its announced cycles is stalled.
STALL_CYCLES = 3

#: Every cause a :class:`PeerStatus` can name: the first three on the prefix side, the rest on the suffix side.
PEER_CAUSES = {
    "no_consumer": "no suffix is attached to the ring",
    "consumer_paused": "the suffix is attached but inactive",
    "consumer_stalled": "the suffix holds the ring but takes no frame",
    "no_ring": "the prefix's ring does not exist",
    "owner_dead": "the process that owns the ring is dead",
    "producer_paused": "the prefix is inactive",
    "prefix_stalled": "the prefix is alive but has published no frame for 3 of its cycles",
    "locked_out": "another suffix holds the ring",
    "contract": "the ring's contract does not fit this suffix",
    "attach_error": "the ring cannot be attached",
}


@dataclass(frozen=True)
class PeerStatus:
    """The other stage as one stage sees it.

    ``cause``: "" when fine, else a key of :data:`PEER_CAUSES`; ``peer``: e.g. "suffix pid 4242", "" when
    unknown; ``message``: one sentence for /diagnostics, naming the ring and what to do.
    """

    cause: str
    peer: str
    message: str

    @property
    def ok(self) -> bool:
        """True when the peer can take part (no cause)."""
        return not self.cause


def stall_grace_ns(frame_period_ns: int | None) -> int:
    """Consumer stall grace (ns): three camera frame periods (None: unknown), at least :data:`MIN_GRACE_S`."""
    floor = int(MIN_GRACE_S * 1e9)
    return floor if not frame_period_ns or frame_period_ns <= 0 else max(floor, 3 * int(frame_period_ns))


def consumer_status(presence, ring: str, now_ns: int, waiting_since_ns: int, grace_ns: int) -> PeerStatus:
    """The suffix as the prefix sees it.

    ``presence``: ``RingProducer.consumer()``. Times are CLOCK_MONOTONIC ns; ``waiting_since_ns`` is the publish
    of the first frame after the consumer's last take (0: none waits); ``grace_ns``: :func:`stall_grace_ns`.
    """
    who = f"suffix pid {presence.pid}" if presence.pid > 0 else "suffix"
    if not presence.attached:
        return PeerStatus("no_consumer", "", f"no suffix_node is attached to the ring {ring} (it is not running, "
                                             "not configured, or died): no trajectory comes out")
    if presence.state == "paused":
        return PeerStatus("consumer_paused", who, f"the {who} is attached to the ring {ring} but inactive: no "
                                                  "trajectory comes out until it is activated")
    if waiting_since_ns > 0 and presence.next_read_ns != 0:
        due = max(waiting_since_ns, presence.next_read_ns)
        late_ns = now_ns - due
        if late_ns > grace_ns:
            return PeerStatus("consumer_stalled", who,
                              f"the {who} holds the ring {ring} but has taken no frame for "
                              f"{(now_ns - presence.last_take_ns) / 1e9:.1f} s (a frame waits "
                              f"{late_ns / 1e9:.1f} s past its due read): is it hung?")
    return PeerStatus("", who, f"{who} attached")


def producer_status(attached: bool, attach_failure: str, attach_error: str, ring: str, owner_pid: int,
                    owner_alive: bool, producer_state: str, holder_pid: int = 0, now_ns: int = 0,
                    last_publish_ns: int = 0, cycle_ns: int = 0) -> PeerStatus:
    """The prefix as the suffix sees it.

    ``attach_failure``: why the last attach failed ("" when attached or not tried; else a suffix-side cause).
    ``producer_state``: 'running', 'paused' or 'not said'. ``holder_pid``: who holds the ring when locked out
    (0: unknown). Times are CLOCK_MONOTONIC ns; ``last_publish_ns`` / ``cycle_ns`` 0: not judged.
    """
    if attached:
        who = f"prefix pid {owner_pid}"
        if not owner_alive:
            return PeerStatus("owner_dead", f"{who} (dead)",
                              f"the {who} that owns the ring {ring} is dead: no frame comes until a prefix_node "
                              "is started (it replaces the ring; this suffix attaches by itself)")
        if producer_state == "paused":
            return PeerStatus("producer_paused", who, f"the {who} is inactive: no frame comes until it is "
                                                      "activated")
        silent_ns = now_ns - last_publish_ns
        if cycle_ns > 0 and last_publish_ns > 0 and silent_ns > max(STALL_CYCLES * cycle_ns,
                                                                    PRODUCER_MIN_GRACE_S * 1e9):
            return PeerStatus("prefix_stalled", who,
                              f"the {who} is alive but has published no frame for {silent_ns / 1e9:.1f} s "
                              f"({silent_ns / cycle_ns:.0f} of its {cycle_ns / 1e9:.2f} s cycles): it is stopped or "
                              "hung, or its cameras send nothing (its own /diagnostics says which)")
        return PeerStatus("", who, f"attached to {who}")
    if attach_failure == "locked_out":
        holder = f"process {holder_pid}" if holder_pid > 0 else "another process"
        return PeerStatus("locked_out", f"suffix pid {holder_pid}" if holder_pid > 0 else "",
                          f"locked out: another suffix ({holder}) holds the ring {ring}; this node computes "
                          "nothing (a second suffix_node of this name and namespace?)")
    if attach_failure == "contract":
        return PeerStatus("contract", "", attach_error)
    if attach_failure == "attach_error":
        return PeerStatus("attach_error", "", f"cannot attach to the ring {ring}: {attach_error}")
    return PeerStatus("no_ring", "", f"no ring {ring}: no prefix_node is configured in this namespace and ROS "
                                     "domain (not running, not configured, or it exited)")
