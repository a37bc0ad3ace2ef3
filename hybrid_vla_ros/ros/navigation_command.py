"""The navigation command input both nodes share: ``~/input/navigation_command`` (std_msgs/String, a CARLA
RoadOption name of :data:`~hybrid_vla_ros.model.config.NAV_COMMANDS`) and the node's ``navigation_command``
parameter, the latest of the two.

The suffix picks the planner mode by it; a prefix with the published query heads also feeds it to the heads'
can-bus token (as the published models do). The launch file remaps both nodes' inputs onto one topic.
"""
from __future__ import annotations

import threading

from std_msgs.msg import String

from ..model.config import NAV_COMMANDS, nav_command_index
from ..model.modeling import DEFAULT_COMMAND


class NavigationCommandInput:
    """``command``: the navigation command index (0..5, NAV_COMMANDS) for the next frame, set by a name on
    ``~/input/navigation_command`` or by :meth:`set_command` (the parameter). A name that is not a command is a
    ``bad_navigation_command`` drop (through the node's PartContext) and the command in use stays."""

    TOPIC = "~/input/navigation_command"

    def __init__(self, ctx):
        """``ctx``: the node's node_base.PartContext (its ``ros`` node for the subscription)."""
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
        """Use navigation command ``index`` (0..5) from the next frame on; a change is logged with its source."""
        with self._lock:
            old, self._command = self._command, index
        if old != index:
            self._ctx.logger.info(f"navigation command {NAV_COMMANDS[old]} -> {NAV_COMMANDS[index]} (from {source})")
