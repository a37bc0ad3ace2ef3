"""What the nodes read of rclpy's LifecycleNode that rclpy keeps private: the current state, and a hook on
the ``change_state`` service. The one place to look when an rclpy release renames them."""
from __future__ import annotations

from typing import Callable


def lifecycle_state(node) -> str:
    """Label of a LifecycleNode's current primary state ('unconfigured', 'inactive', 'active', ...)."""
    machine = getattr(node, "_state_machine", None)  # rclpy keeps it private; it is what get_state serves
    return machine.current_state[1] if machine is not None else "unknown"


def on_refused_change_state(node, refused: Callable[[], None]) -> None:
    """Call ``refused()`` after each ``change_state`` request that leaves the state unchanged, by wrapping rclpy's
    private ``_service_change_state`` callback; does nothing on an rclpy without it."""
    service = getattr(node, "_service_change_state", None)
    if service is None:
        return
    inner = service.callback

    def on_change_state(request, response):
        before = lifecycle_state(node)
        response = inner(request, response)
        if not response.success and lifecycle_state(node) == before:
            refused()
        return response

    service.callback = on_change_state
