"""How each stage sees the other: the peer status a node reports on /diagnostics (no ROS imports).

A stage whose peer is gone cannot produce a trajectory, and a safety monitor reading /diagnostics must learn
that from the stage that is still alive, within a stated time, with the cause and the peer named. What each
end can observe of the other lives in the ring's global header and in the kernel:

* the prefix (producer) sees whether a consumer holds the ring's single-consumer lock (an OFD lock the kernel
  drops the moment its holder closes it or dies, SIGKILL included), which process it named at attach, whether
  it said it is paused (its node is inactive), when it last took a frame and when it said it will take the
  next (``transport.producer.ConsumerPresence``);
* the suffix (consumer) sees whether the ring exists, whether the process that owns it is alive (pid and start
  time), whether the producer said it is paused, when it last published and how often it said it publishes
  (``RingProducer.announce_cycle``), and why an attach failed (no ring, another consumer holds it, the contract
  does not fit).

:func:`consumer_status` and :func:`producer_status` turn those observations into a :class:`PeerStatus`. The
nodes check them every :data:`CHECK_PERIOD_S` and publish /diagnostics at once when the status changes, so a
dead peer is reported as ERROR within that period plus one publish. Two judgements need time. A producer that is
alive but publishes nothing (stopped, hung, or without camera input) is stalled once its last publish is
:data:`STALL_CYCLES` of its announced cycles old (at least :data:`PRODUCER_MIN_GRACE_S`; it announces none before
its second publish, and is never called stalled before). A consumer that holds the ring but takes no frame: frames
published after its last take are overdue once ``grace_ns`` (three camera frame periods, at least
:data:`MIN_GRACE_S`) has passed beyond the later of the first such publish and the read it announced
(``RingConsumer.announce_next_read``: a suffix slower than the cameras announces its own cycle, so its long frames
are not mistaken for a stall; before it has measured one cycle it announces nothing and is never called stalled).
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

#: Every cause a :class:`PeerStatus` can name, with what it means. Prefix side (the suffix is the peer):
#: ``no_consumer``, ``consumer_paused``, ``consumer_stalled``; suffix side (the prefix is the peer):
#: ``no_ring``, ``owner_dead``, ``producer_paused``, ``prefix_stalled``, ``locked_out``, ``contract``,
#: ``attach_error``.
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

    ``cause``: "" while the peer can take part in the pipeline, else a key of :data:`PEER_CAUSES`. ``peer``:
    who it is, as far as known (e.g. "suffix pid 4242", "prefix pid 17 (dead)", "" when unknown).
    ``message``: one sentence for /diagnostics and the log, naming the ring and what to do.
    """

    cause: str
    peer: str
    message: str

    @property
    def ok(self) -> bool:
        """True when the peer can take part (no cause)."""
        return not self.cause


def stall_grace_ns(frame_period_ns: int | None) -> int:
    """How long frames may wait past their due read before a consumer counts as stalled (ns): three camera frame
    periods (``frame_period_ns``; None: not known yet), at least :data:`MIN_GRACE_S`."""
    floor = int(MIN_GRACE_S * 1e9)
    return floor if not frame_period_ns or frame_period_ns <= 0 else max(floor, 3 * int(frame_period_ns))


def consumer_status(presence, ring: str, now_ns: int, waiting_since_ns: int, grace_ns: int) -> PeerStatus:
    """The suffix as the prefix sees it.

    Args:
        presence: the producer's ``ConsumerPresence`` (``RingProducer.consumer()``).
        ring: the ring's segment name (for the message).
        now_ns: CLOCK_MONOTONIC now (ns).
        waiting_since_ns: CLOCK_MONOTONIC ns of the first frame published after the consumer's last take, 0 when
            none waits (every published frame was taken or superseded by a take).
        grace_ns: :func:`stall_grace_ns`.

    Returns ``no_consumer`` when nobody holds the consumer lock, ``consumer_paused`` when the holder said it is
    inactive, ``consumer_stalled`` when a frame has waited ``grace_ns`` past the later of its publish and the
    consumer's announced next read, else an ok status.
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

    Args:
        attached: the suffix holds a consumer end of the ring.
        attach_failure: why the last attach failed ("" when attached or not tried): 'no_ring', 'locked_out',
            'contract' or 'attach_error'.
        attach_error: the failed attach's message.
        ring: the ring's segment name.
        owner_pid, owner_alive: the ring's owner as its header names it, and whether that process lives.
        producer_state: what the producer said of itself ('running', 'paused', 'not said').
        holder_pid: for 'locked_out', the process that holds the ring (0: unknown).
        now_ns: CLOCK_MONOTONIC now (ns).
        last_publish_ns, cycle_ns: the producer's last publish (CLOCK_MONOTONIC ns) and its announced interval
            between publishes (ns); 0 when there is none (not judged).

    Returns ``owner_dead`` (attached to a ring whose owner died), ``producer_paused``, ``prefix_stalled`` (alive,
    running, its last publish :data:`STALL_CYCLES` announced cycles old, at least :data:`PRODUCER_MIN_GRACE_S`), or the
    attach failure (``no_ring``, ``locked_out``, ``contract``, ``attach_error``), else an ok status.
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
