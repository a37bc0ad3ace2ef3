"""Helpers shared by the two lifecycle nodes: parameter reading, diagnostics, throttled logs."""
from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.exceptions import ParameterUninitializedException
from rclpy.node import Node
from rclpy.parameter import Parameter
from rcl_interfaces.msg import ParameterDescriptor

from .msg_conv import ns_to_stamp


def declare(node: Node, name: str, default, description: str, ptype: Parameter.Type | None = None) -> None:
    """Declare a parameter with a description. Array parameters without a default take ``ptype``."""
    desc = ParameterDescriptor(description=description)
    if ptype is not None:
        node.declare_parameter(name, ptype, desc)
    else:
        node.declare_parameter(name, default, desc)


def value(node: Node, name: str, default=None):
    """Current value of a declared parameter; ``default`` when it was declared without one."""
    try:
        v = node.get_parameter(name).value
    except ParameterUninitializedException:
        return default
    return list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "array" else v


def lifecycle_state(node) -> str:
    """Label of a LifecycleNode's current primary state ('unconfigured', 'inactive', 'active', ...)."""
    machine = getattr(node, "_state_machine", None)  # rclpy keeps it private; it is what get_state serves
    return machine.current_state[1] if machine is not None else "unknown"


class Throttle:
    """Allow one event per ``period_s`` per key (for rate-limited log lines)."""

    def __init__(self, period_s: float = 2.0):
        self.period_s = period_s
        self._last: dict[str, float] = {}

    def __call__(self, key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.period_s:
            self._last[key] = now
            return True
        return False


def diagnostic_array(node: Node, name: str, level: bytes, message: str, values: dict) -> DiagnosticArray:
    """One DiagnosticStatus (Autoware convention: '<node>: <name>') in a DiagnosticArray stamped now."""
    status = DiagnosticStatus(level=level, name=f"{node.get_name()}: {name}", message=message,
                              hardware_id=node.get_fully_qualified_name())
    status.values = [KeyValue(key=str(k), value=str(v)) for k, v in values.items()]
    arr = DiagnosticArray(status=[status])
    arr.header.stamp = ns_to_stamp(node.get_clock().now().nanoseconds)
    return arr


OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


def flatten_stats(stage_summary: dict, drops: dict, extra: dict) -> dict:
    """Diagnostic key/values: '<stage>_p50_ms', '<stage>_p90_ms', 'drop_<cause>', plus ``extra``."""
    out = dict(extra)
    for stage, s in stage_summary.items():
        out[f"{stage}_p50_ms"] = f"{s['p50']:.3f}"
        out[f"{stage}_p90_ms"] = f"{s['p90']:.3f}"
        out[f"{stage}_n"] = s["n"]
    for cause, n in sorted(drops.items()):
        out[f"drop_{cause}"] = n
    return out
