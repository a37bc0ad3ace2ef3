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
#: (transition state, primary state on success) of each transition (design.ros2.org "Managed nodes").
TRANSITION_STATES = {
    "configure": ("configuring", "inactive"), "cleanup": ("cleaningup", "unconfigured"),
    "activate": ("activating", "active"), "deactivate": ("deactivating", "inactive"),
    "unconfigured_shutdown": ("shuttingdown", "finalized"), "inactive_shutdown": ("shuttingdown", "finalized"),
    "active_shutdown": ("shuttingdown", "finalized"),
}
#: Transitions that take an active node back to each primary state (what :meth:`LifecycleClient.return_to` runs).
BACK_FROM_ACTIVE = {"active": (), "inactive": ("deactivate",), "unconfigured": ("deactivate", "cleanup")}


class LifecycleClient:
    """Calls one managed node's ``change_state`` / ``get_state`` and follows its ``transition_event`` topic
    (transitions anyone triggers). ``node`` must be spun in another thread (calls block on a future).
    """

    #: While a change_state request has no answer, how often (s) the node's state is asked instead.
    ASK_STATE_S = 5.0

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
        """Destroy the clients and the subscription (idempotent)."""
        for attr, destroy in (("_change", self._node.destroy_client), ("_get", self._node.destroy_client),
                              ("_events_sub", self._node.destroy_subscription)):
            handle = getattr(self, attr, None)
            if handle is not None:
                destroy(handle)
                setattr(self, attr, None)

    def wait_for_events(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait up to ``timeout_s`` (s) until the volatile ``transition_event`` subscription is matched (events
        before that are lost); True when matched."""
        deadline = time.monotonic() + timeout_s
        while self._events_sub is not None and self._events_sub.get_publisher_count() < 1:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return self._events_sub is not None

    def other_managers(self) -> int:
        """Other clients of the node's ``change_state`` (e.g. ``ros2 launch``'s LifecycleNode action)."""
        return max(0, self._node.count_clients(f"{self.name}/change_state") - 1)

    def _on_event(self, msg: TransitionEvent) -> None:
        with self._lock:
            self._last_event = time.monotonic()
            self._events += 1
            self._completed.append((self._last_event, msg.start_state.label, msg.goal_state.label))
            del self._completed[:-20]

    def transition_finished(self, transition: str, since: float) -> bool:
        """Whether a transition_event after ``since`` (monotonic s) says ``transition`` succeeded."""
        between, goal = TRANSITION_STATES[transition]
        with self._lock:
            return any(t >= since and start == between and end == goal for t, start, end in self._completed)

    def wait_for_services(self, timeout_s: float, procs=()) -> bool:
        """Wait until both services exist; False early if a process in ``procs`` exited."""
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
        """Trigger a transition by name (:data:`TRANSITIONS`); returns (success, detail).

        A lost response counts as success once transition_event says it finished, or once ``get_state`` (asked
        every :data:`ASK_STATE_S` while no answer came) says the node is in the transition's goal state:
        rmw_fastrtps drops responses before the client's reader is matched ("failed to send response (timeout)"),
        and on a loaded machine the volatile transition_event may not be matched yet either.
        """
        req = ChangeState.Request()
        req.transition.id = TRANSITIONS[transition]
        since = time.monotonic()
        done = threading.Event()
        future = self._change.call_async(req)
        future.add_done_callback(lambda _: done.set())
        deadline = since + timeout_s
        next_ask = since + self.ASK_STATE_S
        while not done.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if self.transition_finished(transition, since):
                self._change.remove_pending_request(future)
                return True, "the answer was lost; the node's transition_event says the transition finished"
            if time.monotonic() >= next_ask:  # a node in its transition callback does not answer: '' then
                next_ask = time.monotonic() + self.ASK_STATE_S
                if self.get_state(1.0) == TRANSITION_STATES[transition][1] and not done.is_set():
                    self._change.remove_pending_request(future)
                    return True, "the answer was lost; get_state says the node is in the transition's goal state"
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
        """The node's primary state once settled, '' after ``timeout_s``; ``waited_s`` gets the time spent.

        Unless active or finalized, it must also see no transition event for ``quiet_s`` (``managed_quiet_s``
        while :meth:`other_managers`), so another manager's autostart (seen > 3 s late on a busy machine) is
        waited for, not raced. A node that does not answer ``get_state`` is in a transition callback.
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
        """Make the node active with only the transitions its state needs, after :meth:`settled_state`. A
        refusal because someone else moved the node is not an error. Returns (first settled state, transitions
        made, '' or why the node is not active)."""
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
        """Deactivate / clean up down to ``state`` (a node at or below it is left alone); (success, detail)."""
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
    """Configure ``target`` (process ``pid``) once its ``get_state`` answers, for a launch autostart; returns its
    state afterwards ('' when it never answered or died).

    After a respawn DDS still lists the dead process's services for a while, so "service ready" is not trusted:
    ``get_state`` is asked every 2 s. A node that is not unconfigured is left as it is.
    """
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
