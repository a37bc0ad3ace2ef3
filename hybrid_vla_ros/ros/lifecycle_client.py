"""Client side of the ROS 2 lifecycle services (what a lifecycle manager does for a managed node)."""
from __future__ import annotations

import threading
import time

from lifecycle_msgs.msg import Transition
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


class LifecycleClient:
    """Calls ``<node>/change_state`` and ``<node>/get_state`` of one managed node.

    ``node`` must be spun by an executor in another thread (calls block on a future).
    """

    def __init__(self, node, target: str):
        self.name = target
        self._change = node.create_client(ChangeState, f"{target}/change_state")
        self._get = node.create_client(GetState, f"{target}/get_state")

    def wait_for_services(self, timeout_s: float, procs=()) -> bool:
        """Wait until both services exist; gives up early if a process in ``procs`` has exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._change.service_is_ready() and self._get.service_is_ready():
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
        """Trigger a transition by name (see TRANSITIONS). Returns (success, detail)."""
        req = ChangeState.Request()
        req.transition.id = TRANSITIONS[transition]
        result = self._call(self._change, req, timeout_s)
        if result is None:
            return False, f"no answer within {timeout_s:.0f} s"
        return bool(result.success), "" if result.success else "the node refused or its callback failed"

    def get_state(self, timeout_s: float = 5.0) -> str:
        """Label of the node's current state, or '' when it does not answer."""
        result = self._call(self._get, GetState.Request(), timeout_s)
        return result.current_state.label if result is not None else ""
