"""Client side of the ROS 2 lifecycle services (what a lifecycle manager does for a managed node)."""
from __future__ import annotations

import threading
import time

from lifecycle_msgs.msg import Transition, TransitionEvent
from lifecycle_msgs.srv import ChangeState, GetState

TRANSITIONS = {
    "configure": Transition.TRANSITION_CONFIGURE,
    "cleanup": Transition.TRANSITION_CLEANUP,
    "activate": Transition.TRANSITION_ACTIVATE,
    "deactivate": Transition.TRANSITION_DEACTIVATE,
    "unconfigured_shutdown": Transition.TRANSITION_UNCONFIGURED_SHUTDOWN,
    "inactive_shutdown": Transition.TRANSITION_INACTIVE_SHUTDOWN,
    "active_shutdown": Transition.TRANSITION_ACTIVE_SHUTDOWN,
}
#: The primary states of a managed node; the others (configuring, activating, ...) are transition states.
PRIMARY_STATES = ("unconfigured", "inactive", "active", "finalized")
#: Transitions that take a node one step towards active from each primary state.
TOWARDS_ACTIVE = {"unconfigured": "configure", "inactive": "activate"}
#: The state a transition passes through and the primary state it ends in when it succeeds (the lifecycle design's
#: state machine: design.ros2.org "Managed nodes").
TRANSITION_STATES = {
    "configure": ("configuring", "inactive"), "cleanup": ("cleaningup", "unconfigured"),
    "activate": ("activating", "active"), "deactivate": ("deactivating", "inactive"),
    "unconfigured_shutdown": ("shuttingdown", "finalized"), "inactive_shutdown": ("shuttingdown", "finalized"),
    "active_shutdown": ("shuttingdown", "finalized"),
}
#: Transitions that take an active node back to each primary state (what :meth:`LifecycleClient.return_to` runs).
BACK_FROM_ACTIVE = {"active": (), "inactive": ("deactivate",), "unconfigured": ("deactivate", "cleanup")}


class LifecycleClient:
    """Calls ``<node>/change_state`` and ``<node>/get_state`` of one managed node and follows its
    ``<node>/transition_event`` topic (transitions anyone triggers, e.g. a launch file's autostart).

    ``node`` must be spun by an executor in another thread (calls block on a future).
    """

    def __init__(self, node, target: str):
        self.name = target
        self._node = node
        self._change = node.create_client(ChangeState, f"{target}/change_state")
        self._get = node.create_client(GetState, f"{target}/get_state")
        self._lock = threading.Lock()
        self._last_event = None  # monotonic time of the last transition event seen
        self._events = 0
        self._completed: list[tuple[float, str, str]] = []  # (monotonic time, start, goal) of the recent events
        self._events_sub = node.create_subscription(TransitionEvent, f"{target}/transition_event", self._on_event, 10)
        self._watch_since = time.monotonic()
        self._seen_at = None  # monotonic time its services were first seen ready
        self.waited_s = 0.0  # time the last settled_state spent waiting for the node to settle
        self.refused = 0  # change_state requests of this client the node answered with success false

    def close(self) -> None:
        """Destroy this client's service clients and its transition_event subscription (idempotent)."""
        for attr, destroy in (("_change", self._node.destroy_client), ("_get", self._node.destroy_client),
                              ("_events_sub", self._node.destroy_subscription)):
            handle = getattr(self, attr, None)
            if handle is not None:
                destroy(handle)
                setattr(self, attr, None)

    def wait_for_events(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait up to ``timeout_s`` (s) until this client's ``transition_event`` subscription is matched to the
        node's publisher. The topic is volatile: an event the node publishes before the match (discovery can take
        seconds on a loaded machine) never arrives, so a caller that will rely on the events (as
        :meth:`change_state` does when a service answer is lost) waits here first. True when matched."""
        deadline = time.monotonic() + timeout_s
        while self._events_sub is not None and self._events_sub.get_publisher_count() < 1:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return self._events_sub is not None

    def other_managers(self) -> int:
        """How many clients besides this one the node's ``change_state`` service has on the graph: a lifecycle
        manager such as ``ros2 launch``'s LifecycleNode action (it keeps one per node, autostart or not)."""
        return max(0, self._node.count_clients(f"{self.name}/change_state") - 1)

    def _on_event(self, msg: TransitionEvent) -> None:
        with self._lock:
            self._last_event = time.monotonic()
            self._events += 1
            self._completed.append((self._last_event, msg.start_state.label, msg.goal_state.label))
            del self._completed[:-20]

    def transition_finished(self, transition: str, since: float) -> bool:
        """True when the node said on its transition_event topic, after ``since`` (monotonic s), that a
        ``transition`` finished successfully (from its transition state to the primary state it leads to)."""
        between, goal = TRANSITION_STATES[transition]
        with self._lock:
            return any(t >= since and start == between and end == goal for t, start, end in self._completed)

    def wait_for_services(self, timeout_s: float, procs=()) -> bool:
        """Wait until both services exist; gives up early if a process in ``procs`` has exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._change.service_is_ready() and self._get.service_is_ready():
                if self._seen_at is None:
                    self._seen_at = time.monotonic()
                return True
            if any(p.poll() is not None for p in procs):
                return False
            time.sleep(0.05)
        return False

    def _call(self, client, request, timeout_s: float):
        done = threading.Event()
        future = client.call_async(request)
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout_s):
            client.remove_pending_request(future)
            return None
        return future.result()

    def change_state(self, transition: str, timeout_s: float = 30.0) -> tuple[bool, str]:
        """Trigger a transition by name (see TRANSITIONS). Returns (success, detail).

        A response that never comes is not taken for a failure while the node says on its transition_event topic
        that the transition finished: rmw_fastrtps drops a service response when the service has not yet matched
        the client's response reader ("failed to send response (timeout)" in the node's log), though the node made
        the transition. The call then succeeds with a detail that says so, as soon as the event is seen."""
        req = ChangeState.Request()
        req.transition.id = TRANSITIONS[transition]
        since = time.monotonic()
        done = threading.Event()
        future = self._change.call_async(req)
        future.add_done_callback(lambda _: done.set())
        deadline = since + timeout_s
        while not done.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if self.transition_finished(transition, since):
                self._change.remove_pending_request(future)
                return True, "the answer was lost; the node's transition_event says the transition finished"
            if time.monotonic() >= deadline:
                self._change.remove_pending_request(future)
                return False, f"no answer within {timeout_s:.0f} s"
        result = future.result()
        if result is None:
            return False, f"no answer within {timeout_s:.0f} s"
        if not result.success:
            self.refused += 1
        return bool(result.success), "" if result.success else "the node refused or its callback failed"

    def get_state(self, timeout_s: float = 5.0) -> str:
        """Label of the node's current state, or '' when it does not answer."""
        result = self._call(self._get, GetState.Request(), timeout_s)
        return result.current_state.label if result is not None else ""

    def settled_state(self, timeout_s: float, quiet_s: float = 0.0, managed_quiet_s: float | None = None) -> str:
        """The node's primary state once it has settled: not in a transition, and, unless it is active or
        finalized, with no transition seen on its ``transition_event`` topic for ``quiet_s`` seconds (counted
        from when this client first saw the node's services), or for ``managed_quiet_s`` seconds while another
        lifecycle manager has a client on its ``change_state`` service (:meth:`other_managers`). So a
        transition someone else is about to make (a launch file's autostart configures a node as soon as it sees
        the node's services, which on a busy machine took more than 3 s after this client saw them) is waited
        for, not raced.

        A node busy in a transition callback does not answer ``get_state`` (its executor is running the
        callback): that counts as "in a transition" too. Returns the label, or '' when the node did not settle
        within ``timeout_s``; ``waited_s`` is set to the time spent.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return ""
                label = self.get_state(min(5.0, max(remaining, 0.1)))
                if label in ("active", "finalized"):
                    return label
                if label in PRIMARY_STATES:
                    with self._lock:
                        last = max(t for t in (self._last_event, self._seen_at, self._watch_since) if t is not None)
                    need = managed_quiet_s if managed_quiet_s is not None and self.other_managers() else quiet_s
                    if time.monotonic() - last >= need:
                        return label
                time.sleep(0.1)
        finally:
            self.waited_s = time.monotonic() - start

    def bring_to_active(self, timeout_s: float, quiet_s: float = 0.0,
                        managed_quiet_s: float | None = None) -> tuple[str, list[str], str]:
        """Make the node active with only the transitions its state needs (unconfigured: configure, then
        activate; inactive: activate; active: none), waiting for transitions in progress and, first, for a
        quiet time (``quiet_s``, or ``managed_quiet_s`` when another lifecycle manager is there; see
        :meth:`settled_state`). A transition refused because the node moved meanwhile (someone else made it)
        is not an error: the state is read again. Returns (the settled state found first, the transitions this
        call made, '' or why the node is not active)."""
        deadline = time.monotonic() + timeout_s
        found, made, quiet, managed = "", [], quiet_s, managed_quiet_s
        while True:
            state = self.settled_state(max(deadline - time.monotonic(), 0.0), quiet, managed)
            found = found or state
            if state == "active":
                return found, made, ""
            if state not in TOWARDS_ACTIVE:
                return found, made, f"{self.name} is {state}" if state else \
                    f"{self.name} did not settle in a primary state within {timeout_s:.0f} s"
            transition = TOWARDS_ACTIVE[state]
            ok, detail = self.change_state(transition, max(deadline - time.monotonic(), 1.0))
            if ok:
                made.append(transition)
                quiet, managed = 0.0, None  # our own transition: the next one follows at once
                continue
            quiet, managed = quiet_s, managed_quiet_s
            if self.settled_state(max(deadline - time.monotonic(), 0.0), quiet, managed) == state:
                return found, made, f"{transition} of {self.name} failed ({detail})"

    def return_to(self, state: str, timeout_s: float) -> tuple[bool, str]:
        """Take the node back down to primary state ``state`` ('active', 'inactive' or 'unconfigured') from the
        state it is in now, with deactivate and cleanup as needed (a node already there, or below it, is left
        alone). Returns (success, detail)."""
        order = ("unconfigured", "inactive", "active")
        current = self.get_state(timeout_s)
        if current not in order:
            return False, f"{self.name} is {current or 'not answering'}"
        for transition, src in (("deactivate", "active"), ("cleanup", "inactive")):
            if current == src and order.index(state) < order.index(src):
                ok, detail = self.change_state(transition, timeout_s)
                if not ok:
                    return False, f"{transition} of {self.name} failed ({detail})"
                current = order[order.index(src) - 1]
        return True, ""


def configure_when_ready(node, target: str, pid: int, timeout_s: float = 600.0, log=None) -> str:
    """Configure managed node ``target`` of process ``pid`` once that process answers, for a launch file's
    autostart; returns the state it is in afterwards ('' when it never answered or the process died).

    A freshly (re)started process is asked only once its own ``get_state`` answers: right after a node process is
    killed and respawned, DDS discovery still lists the dead process's services for a while, so a request sent at
    once ("the service is ready") can go to the dead server alone and never be answered. ``get_state`` is asked
    every 2 s until an answer comes (a dead server never answers); then ``configure`` is requested when the node is
    unconfigured (a node some manager already moved is left as it is). ``node``: an rclpy node spun in another
    thread (the launch's own). ``log(message)``: where to say what happened (None: nothing)."""
    say = log or (lambda _message: None)
    client = LifecycleClient(node, target)
    try:
        return _configure_when_ready(client, target, pid, timeout_s, say)
    finally:
        client.close()


def _configure_when_ready(client: LifecycleClient, target: str, pid: int, timeout_s: float, say) -> str:
    deadline = time.monotonic() + timeout_s

    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
        except OSError:
            return False

    state = ""
    while not state:
        if not alive():
            say(f"{target} (pid {pid}) exited before it answered")
            return ""
        if time.monotonic() > deadline:
            say(f"{target} (pid {pid}) did not answer get_state within {timeout_s:.0f} s")
            return ""
        state = client.get_state(2.0)
    if state != "unconfigured":
        return state
    ok, detail = client.change_state("configure", max(deadline - time.monotonic(), 1.0))
    if not ok:
        say(f"configure of {target} (pid {pid}) failed: {detail}")
    return client.get_state(5.0)
