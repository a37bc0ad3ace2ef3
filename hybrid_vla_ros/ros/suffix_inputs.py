"""The suffix node's vehicle inputs: the ego pose at a camera stamp and the navigation command.

Callbacks only buffer or set the command; an unreadable message is a drop counted by cause.
"""
from __future__ import annotations

import time

from nav_msgs.msg import Odometry

from ..vehicle.odometry import OdometryBuffer
from ..vehicle.trajectory import EgoState, ego_state_from_odometry
from .navigation_command import NavigationCommandInput


class SuffixInputs:
    """``~/input/kinematic_state`` (nav_msgs/Odometry) and the navigation command
    (:class:`~.navigation_command.NavigationCommandInput`)."""

    def __init__(self, ctx):
        """``ctx``: the node's node_base.PartContext."""
        self._ctx = ctx
        self.odometry = OdometryBuffer()
        self._odom_sub = None
        self._navigation = NavigationCommandInput(ctx)
        self.odometry_propagated = 0  # trajectories placed with a pose propagated, not interpolated
        self.odometry_late = 0  # frames placed at once because the odometry stream was late (no wait)
        self.odometry_in = 0  # odometry messages read into the buffer (unreadable ones are drops, not counted)

    @property
    def command(self) -> int:
        """The navigation command index (0..5, NAV_COMMANDS) for the next frame."""
        return self._navigation.command

    def start(self) -> None:
        """Subscribe (depth 10)."""
        self._odom_sub = self._ctx.ros.create_subscription(Odometry, "~/input/kinematic_state", self._on_odometry, 10)
        self._navigation.start()

    def stop(self) -> None:
        """Unsubscribe (idempotent)."""
        if self._odom_sub is not None:
            self._ctx.ros.destroy_subscription(self._odom_sub)
            self._odom_sub = None
        self._navigation.stop()

    def _on_odometry(self, msg: Odometry) -> None:
        try:
            ego = ego_state_from_odometry(msg)
        except ValueError as e:
            self._ctx.drop("bad_odometry", str(e))
            return
        self.odometry.add(ego)
        self.odometry_in += 1

    def set_command(self, index: int, source: str) -> None:
        """See :meth:`~.navigation_command.NavigationCommandInput.set_command`."""
        self._navigation.set_command(index, source)

    def pose_at(self, stamp: int, wait_s: float, max_age_s: float) -> tuple[EgoState, str, str, float]:
        """(ego pose at ``stamp`` ns, method, wait reason, ms waited): waits up to ``wait_s`` only while the next
        odometry is due (OdometryBuffer.wait_budget). Raises LookupError as OdometryBuffer.pose_at."""
        budget_s, why = self.odometry.wait_budget(stamp, wait_s)
        wait_ms = 0.0
        if budget_s > 0:
            t_wait = time.perf_counter()
            self.odometry.wait_for(stamp, budget_s)
            wait_ms = (time.perf_counter() - t_wait) * 1e3
        ego, method = self.odometry.pose_at(stamp, int(max_age_s * 1e9))
        return ego, method, why, wait_ms

    def count_placed(self, method: str, why: str) -> None:
        """Count how a published trajectory's pose was obtained."""
        if method == "propagated":
            self.odometry_propagated += 1
            self.odometry_late += why == "late"
