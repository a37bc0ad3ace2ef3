"""The navigation command both nodes share: the latest of ``~/input/navigation_command`` (std_msgs/String, a name
of :data:`~hybrid_vla_ros.model.config.NAV_COMMANDS`) and the ``navigation_command`` parameter.

The suffix picks the planner mode by it; a prefix with the published query heads feeds it to their can-bus token.
"""
from __future__ import annotations

import threading

from std_msgs.msg import String

from ..model.config import NAV_COMMANDS, nav_command_index
from ..model.modeling import DEFAULT_COMMAND


class NavigationCommandInput:
    """The command for the next frame; an unknown name is a ``bad_navigation_command`` drop and the command stays."""

    TOPIC = "~/input/navigation_command"

    def __init__(self, ctx):
        """``ctx``: the node's node_base.PartContext."""
        self._ctx = ctx
        self._command = DEFAULT_COMMAND
        self._lock = threading.Lock()
        self._sub = None

    @property
    def command(self) -> int:
        """The navigation command index (0..5, NAV_COMMANDS) for the next frame."""
        return self._command

    def start(self) -> None:
        """Subscribe (depth 10)."""
        self._sub = self._ctx.ros.create_subscription(String, self.TOPIC, self._on_message, 10)

    def stop(self) -> None:
        """Unsubscribe (idempotent)."""
        if self._sub is not None:
            self._ctx.ros.destroy_subscription(self._sub)
            self._sub = None

    @property
    def subscription(self):
        """The subscription while started, else None."""
        return self._sub

    def _on_message(self, msg: String) -> None:
        try:
            index = nav_command_index(msg.data)
        except ValueError as e:
            self._ctx.drop("bad_navigation_command", f"{self.TOPIC}: {e}; keeping {NAV_COMMANDS[self._command]}")
            return
        self.set_command(index, f"topic {self.TOPIC}")

    def set_command(self, index: int, source: str) -> None:
        """Use ``index`` from the next frame on; a change is logged with its ``source``."""
        with self._lock:
            old, self._command = self._command, index
        if old != index:
            self._ctx.logger.info(f"navigation command {NAV_COMMANDS[old]} -> {NAV_COMMANDS[index]} (from {source})")
