"""What a pipeline node reports on /diagnostics: the 1 Hz '<node>: pipeline' status and its helpers."""
from __future__ import annotations

import os
import time

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.clock import Clock
from rclpy.clock_type import ClockType
from rclpy.node import Node

from .lifecycle_hooks import lifecycle_state
from .msg_conv import ns_to_stamp
from .status import PIPELINE, RingFill, StageTime

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR

#: What a node that is not active says in /diagnostics (WARN), by lifecycle state.
IDLE_MESSAGES = {
    "unconfigured": "unconfigured: no model loaded, nothing computed until configured and activated",
    "inactive": "inactive: configured, but nothing computed until activated",
    "finalized": "finalized: the node has shut down its pipeline",
}

#: What a node with ``use_sim_time`` and no ``/clock`` says in /diagnostics, its log and the guard's drop line.
NO_CLOCK_HINT = ("use_sim_time is true but no message has arrived on /clock yet, so the node clock reads 0 (stamps "
                 "cannot be aged, timers on the ROS clock do not run): publish /clock (`ros2 bag play --clock`, "
                 "`hybrid-vla replay`) or set use_sim_time false")


def diagnostic_array(node: Node, name: str, level: bytes, message: str,
                     values: list[tuple[str, str]]) -> DiagnosticArray:
    """A DiagnosticArray stamped now with one status '<fully qualified node>: <name>' (Autoware's '<node>: <task>',
    namespaced so deployments stay apart) holding ``values``."""
    status = DiagnosticStatus(level=level, name=f"{node.get_fully_qualified_name()}: {name}", message=message,
                              hardware_id=node.get_fully_qualified_name())
    status.values = [KeyValue(key=k, value=v) for k, v in values]
    arr = DiagnosticArray(status=[status])
    arr.header.stamp = ns_to_stamp(node.get_clock().now().nanoseconds)
    return arr


def stage_times(stage_summary: dict) -> dict[str, StageTime]:
    """``StageTimes.summary()`` (ms) as status.StageTime by stage."""
    return {stage: StageTime(s["p50"], s["p90"], s["n"]) for stage, s in stage_summary.items()}


def ring_fill(ring) -> RingFill:
    """READY and total slots of a ring end; RingFill(0, 0) without an open ring."""
    if ring is None:
        return RingFill()
    try:
        states = ring.slot_states()
    except Exception:  # noqa: BLE001 - a ring closing under us just has no fill to report
        return RingFill()
    return RingFill(states.count("READY"), len(states))


def memory_values() -> dict:
    """Process memory in MiB (2**20 bytes): RSS and, with CUDA in use, this process's allocated / reserved and the
    device's driver-level used / free (every process)."""
    import psutil
    import torch

    out = {"rss_mib": psutil.Process().memory_info().rss / 2**20}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
        out["cuda_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
        free, total = torch.cuda.mem_get_info()
        out["cuda_driver_used_mib"] = (total - free) / 2**20
        out["cuda_driver_free_mib"] = free / 2**20
    return out


class PipelineDiagnostics:
    """A PipelineNode's '<node>: pipeline' status on /diagnostics, from the node's public status interface.

    Published every 1 s on the steady clock (it must keep coming without /clock, which it reports), and at once
    when the peer check (every ``runtime.peer.CHECK_PERIOD_S``, 0.1 s) sees the peer's cause change.

    Level, first match: ERROR for ``fault`` or a failed configure while unconfigured; WARN while not active
    (an idle node is never "ok"); ERROR for a peer that cannot take part, inputs without output for
    ``stall_s()``, or an ``input_problem()``; WARN for a missing /clock, an ``input_warning()``, new drops, or
    a ring with n_slots - 1 unread frames; else OK. Values: the node's ``STATUS`` class.
    """

    def __init__(self, node):
        from ..runtime.peer import CHECK_PERIOD_S

        self._node = node
        self._pub = node.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._stall_since = time.monotonic()
        self._clock_missing_said = False  # NO_CLOCK_HINT logged and not yet taken back
        self._prev = None  # inputs, outputs and drops at the previous report
        self._peer = None  # the peer status of the last check (runtime.peer.PeerStatus), None: not active
        self._peer_seen = False  # a working peer was seen since the node's last activation
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._timer = node.create_timer(1.0, node.publish_diagnostics, clock=steady)
        self._peer_timer = node.create_timer(CHECK_PERIOD_S, self._check_peer, clock=steady)

    def _peer_now(self):
        """The node's peer status, None while not active or on any failure (never raised into the executor)."""
        try:
            return self._node.peer_status()
        except Exception as e:  # noqa: BLE001 - e.g. the ring closing under a cleanup: nothing to judge
            self._node.get_logger().debug(f"peer status not available: {e}")
            return None

    def _check_peer(self) -> None:
        """Publish and log when the peer's cause changed: a warning while none was seen since activation, an
        error when one is lost."""
        peer = self._peer_now()
        before = self._peer
        if lifecycle_state(self._node) != "active":
            self._peer_seen = False  # the next activation starts over: its peer may still be coming
        seen, self._peer_seen = self._peer_seen, self._peer_seen or (peer is not None and peer.ok)
        if (peer.cause if peer else None) == (before.cause if before else None):
            self._peer = peer
            return
        self._peer = peer
        logger = self._node.get_logger()
        if peer is not None and not peer.ok and not seen:  # none since activation: it may still be coming
            logger.warning(f"no peer yet ({peer.cause}): {peer.message}")
        elif peer is not None and not peer.ok:
            logger.error(f"peer lost ({peer.cause}): {peer.message}")
        elif peer is not None and before is not None and not before.ok:
            logger.info(f"peer back: {peer.message}")
        self.publish()

    def publish(self) -> None:
        """Publish the status now."""
        node = self._node
        peer = self._peer_now()  # the change log and the immediate publish are _check_peer's
        drops = node.drops.snapshot()
        fill = ring_fill(node.ring_end())
        clock_missing = node.clock_missing()
        self._say_clock_state(clock_missing)
        status = node.STATUS(
            state=lifecycle_state(node), lifecycle_requests_refused=node.lifecycle_requests_refused,
            configure_error=node.configure_error, peer_cause=peer.cause if peer else "",
            peer=peer.peer if peer else "", peer_message=peer.message if peer else "",
            use_sim_time=node.use_sim_time(), clock_missing=clock_missing, ring_ready_slots=fill,
            last_error=node.last_error, cpu_affinity=tuple(sorted(os.sched_getaffinity(0))),
            stages=stage_times(node.times.summary()), drops=drops, **memory_values(), **node.status_fields())
        now = time.monotonic()
        inputs, outputs = node.io_counts()
        prev = self._prev
        if prev is None or outputs != prev["outputs"] or inputs == prev["inputs"]:
            self._stall_since = now  # output moved, or no new input: not stalled
        self._prev = {"inputs": inputs, "outputs": outputs, "drops": sum(drops.values())}
        new_drops = self._prev["drops"] - (prev["drops"] if prev else 0)
        active = status.state == "active"
        problem = node.input_problem() if active else ""
        warning = node.input_warning() if active else ""
        if node.fault:
            level, message = ERROR, node.fault
        elif node.configure_error and status.state == "unconfigured":
            level, message = ERROR, f"configure failed: {node.configure_error}"
        elif not active:  # an idle node is never "ok"; a missing /clock is said too (it must be mended first)
            level, message = WARN, IDLE_MESSAGES.get(status.state, f"{status.state}: this node computes nothing")
            if clock_missing:
                message = f"{message}; {NO_CLOCK_HINT}"
        elif peer is not None and not peer.ok:
            level, message = ERROR, peer.message
        elif problem:
            level, message = ERROR, problem
        elif now - self._stall_since >= node.stall_s():
            level, message = ERROR, f"inputs arrive but nothing came out for {now - self._stall_since:.0f} s"
        elif clock_missing:
            level, message = WARN, NO_CLOCK_HINT
        elif warning:
            level, message = WARN, warning
        elif new_drops > 0:
            level, message = WARN, f"{new_drops} dropped since the last report ({node.last_error})"
        elif fill.slots and fill.ready >= fill.slots - 1:
            level, message = WARN, f"ring nearly full ({fill.ready}/{fill.slots} unread): the suffix falls behind"
        else:
            level, message = OK, "ok"
        self._pub.publish(diagnostic_array(node, PIPELINE, level, message, status.key_values()))

    def _say_clock_state(self, missing: bool) -> None:
        """Log NO_CLOCK_HINT when the clock goes missing, and once more when /clock arrives."""
        node = self._node
        if missing and not self._clock_missing_said:
            node.get_logger().warning(NO_CLOCK_HINT)
        elif not missing and self._clock_missing_said:
            node.get_logger().info(f"/clock is arriving: node clock at {node.get_clock().now().nanoseconds} ns")
        self._clock_missing_said = missing
