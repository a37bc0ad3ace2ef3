"""The base of the two lifecycle nodes (PipelineNode) and how a node process runs (run_node, spin).

Its parts live in :mod:`.node_parameters`, :mod:`.diagnostics` and :mod:`.lifecycle_hooks`, whose public names
are re-exported here.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import rclpy
from rcl_interfaces.msg import SetParametersResult
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.signals import SignalHandlerOptions

from ..runtime.loops import LoopContext
from ..util.stats import DropCounter, StageTimes
from . import params
from .status import NodeStatus
from .diagnostics import (
    ERROR,
    NO_CLOCK_HINT,
    OK,
    WARN,
    PipelineDiagnostics,
    diagnostic_array,
    memory_values,
    ring_fill,
)
from .lifecycle_hooks import lifecycle_state, on_refused_change_state
from .node_parameters import ParameterChecks, declare_parameters, parameter_values, type_problem
from .params_file import unreadable_parameters

__all__ = ["PipelineNode", "PartContext", "Throttle", "run_node", "spin", "lifecycle_state", "declare_parameters",
           "parameter_values", "type_problem", "diagnostic_array", "ring_fill", "memory_values",
           "OK", "WARN", "ERROR", "NO_CLOCK_HINT"]


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


class SteadyTimers:
    """A node's timers (runtime.split_control.Timers) on the steady clock, not a bag's simulated one."""

    def __init__(self, node):
        self._node = node

    def start(self, period_s: float, fn):
        from rclpy.clock import Clock, ClockType

        return self._node.create_timer(period_s, fn, clock=Clock(clock_type=ClockType.STEADY_TIME))

    def cancel(self, handle) -> None:
        self._node.destroy_timer(handle)


@dataclass(frozen=True)
class PartContext(LoopContext):
    """What a node's part (inputs, worker, outputs) may use of the node, so no part reaches into its private state.

    Beyond :class:`~hybrid_vla_ros.runtime.loops.LoopContext` (``drop`` logs at most every 2 s per cause;
    ``alive`` turns False once Ctrl-C shut the context down): ``ros``, the rclpy node, for the part's own ROS
    entities only; ``settings()``, the validated parameters (None while unconfigured).
    """

    ros: Any = None
    settings: Callable[[], Any] = lambda: None


class PipelineNode(LifecycleNode):
    """Lifecycle scaffolding shared by prefix_node and suffix_node (after ros2/demos lifecycle_py).

    Parameters are declared from ``schema/<name>.schema.json`` and each change is checked against it.
    Subclasses implement ``on_configure``, ``on_activate`` (ending with ``super().on_activate``), idempotent
    ``_stop`` (worker, subscriptions) and ``_release`` (stage, ring), ``STATUS`` and ``status_fields``. This
    class gives deactivate / cleanup / shutdown / error handling, rate-limited drop counts and ``/diagnostics``.
    """

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)
        self._schema_node = name
        self._parameter_checks = ParameterChecks(self, name)
        declare_parameters(self, name)
        self.add_on_set_parameters_callback(self._parameter_checks.on_set)  # after declaring: file values
        # are not judged here but at configure, which reports every problem at once
        self.drops = DropCounter()
        self.times = StageTimes()
        self.last_error = ""
        #: A standing fault that keeps the node from working; /diagnostics reports ERROR with it while set.
        self.fault = ""
        #: The last failed configure's error ("" after a success); /diagnostics ERROR while unconfigured.
        self.configure_error = ""
        self._throttle = Throttle()
        self._diagnostics = PipelineDiagnostics(self)
        #: ChangeState requests that left the state as it was; `hybrid-vla replay --attach` reads it from
        #: /diagnostics to tell whether another lifecycle manager was bringing the node up too.
        self.lifecycle_requests_refused = 0
        on_refused_change_state(self, self._count_refused_request)

    def _count_refused_request(self) -> None:
        self.lifecycle_requests_refused += 1

    #: Parameters a running node applies as soon as they are set (through :meth:`apply_live_parameters`);
    #: every other one is read at configure.
    LIVE_PARAMETERS: tuple[str, ...] = ()

    def apply_live_parameters(self, values: dict) -> None:
        """Apply accepted new values of ``LIVE_PARAMETERS`` now."""

    def live_parameter_problems(self, values: dict) -> list[str]:
        """'name: problem' for live values the schema allows but the loaded checkpoint does not."""
        return []

    def set_parameters_atomically(self, parameter_list: list[Parameter]) -> SetParametersResult:
        """rclpy's, but refusals (undeclared, unset, wrong type) name the parameter, unlike rclpy's own."""
        refused = self._parameter_checks.refusal(parameter_list)
        return refused if refused is not None else super().set_parameters_atomically(parameter_list)

    def read_parameters(self, **checkpoint) -> params.Params:
        """The parameters validated against the schema and ``checkpoint`` facts. Raises ParameterError."""
        return params.validate(self._schema_node, parameter_values(self, self._schema_node), **checkpoint)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop()
        self.publish_diagnostics()
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.shutdown_pipeline()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error in a transition callback; releasing everything ({self.last_error})")
        self.shutdown_pipeline()
        return TransitionCallbackReturn.SUCCESS  # back to unconfigured, ready to configure again

    def shutdown_pipeline(self) -> None:
        """Stop the worker and release the stage and the ring (idempotent)."""
        self._stop()
        self._release()

    def part_context(self) -> PartContext:
        """The :class:`PartContext` the node's parts are built with."""
        return PartContext(logger=self.get_logger(), drop=self._drop, count=self.drops.add, log_every=self._throttle,
                           times=self.times, runner=lambda: self.runner, set_fault=self._set_fault,
                           alive=self.context.ok, ros=self, settings=lambda: self.params)

    def _set_fault(self, text: str) -> None:
        self.fault = text
        if text:
            self.last_error = text

    def _drop(self, cause: str, message: str, n: int = 1) -> None:
        """Count ``n`` drops of ``cause``; log at most every 2 s per cause."""
        total = self.drops.add(cause, n)
        self.last_error = message
        if self._throttle(cause):
            self.get_logger().warning(f"dropped ({cause}, {total} so far): {message}")

    STALL_S = 3.0  # inputs arriving without any output for this long is an ERROR (see stall_s)

    def stall_s(self) -> float:
        """Seconds of inputs without output before /diagnostics says ERROR."""
        return self.STALL_S

    def use_sim_time(self) -> bool:
        """The node's ``use_sim_time`` parameter."""
        return bool(self.get_parameter("use_sim_time").value)

    def clock_missing(self) -> bool:
        """True while ``use_sim_time`` is set and no ``/clock`` message has arrived (the node clock reads 0)."""
        return self.use_sim_time() and self.get_clock().now().nanoseconds == 0

    def publish_diagnostics(self) -> None:
        """Publish '<node>: pipeline' on /diagnostics (:class:`~.diagnostics.PipelineDiagnostics`)."""
        self._diagnostics.publish()

    #: The node's status class (ros/status.py): what ``publish_diagnostics`` writes.
    STATUS: type[NodeStatus] = NodeStatus
    #: The stage runner (runtime.prefix.PrefixRunner / runtime.suffix.SuffixRunner), None while unconfigured.
    runner: Any = None
    #: The validated parameters of the last successful configure, None before it.
    params: Any = None

    def io_counts(self) -> tuple[int, int]:
        """(inputs seen, outputs produced) so far, for stall detection."""
        return 0, 0

    def peer_status(self):
        """The other stage as seen from here (runtime.peer.PeerStatus), None while not active."""
        return None

    def input_problem(self) -> str:
        """An input problem that stops output (ERROR while active), "" when none."""
        return ""

    def input_warning(self) -> str:
        """An input problem that does not (yet) stop output (WARN while active), "" when none."""
        return ""

    def configure_failed(self, error: Exception | str) -> TransitionCallbackReturn:
        """Record and log a failed configure; returns FAILURE."""
        self.last_error = self.configure_error = str(error)
        self.get_logger().error(f"configure failed: {error}")
        return TransitionCallbackReturn.FAILURE

    def configured(self) -> None:
        """Clear the previous configure's error."""
        self.configure_error = ""

    def ring_end(self):
        """This node's end of the shared-memory ring, or None while it has none."""
        return self.runner.ring if self.runner is not None else None

    def _stop(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def status_fields(self) -> dict:
        """This node's own ``STATUS`` fields (name -> typed value)."""
        return {}


def run_node(name: str, factory, argv: list[str]) -> int:
    """Start rclpy, build the node with ``factory()``, :func:`spin` it and end the process with its exit code
    (no return after a spin). Returns 2 or 130 when the node could not be started.

    Unreadable or mistyped parameters print one ``<name>: ...`` line naming each parameter (no traceback) and
    return 2. rclpy's signal handlers are not installed, so the node still logs while it shuts down.
    """
    try:
        rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    except _rclpy.RCLError as e:
        found = unreadable_parameters(argv)
        print(f"{name}: cannot read the parameters: " + ("; ".join(found) if found else str(e)), file=sys.stderr)
        return 2
    try:
        node = factory()
    except params.ParameterError as e:
        print(f"{name}: {e}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    except KeyboardInterrupt:
        rclpy.try_shutdown()
        return 130
    _exit_now(spin(node))


def _exit_now(code: int) -> None:
    """Destroy the ROS context (Fast DDS's shared-memory files with it), flush, then ``os._exit(code)``: Python's
    finalization with torch takes seconds (docs/reliability.md), beyond ``ros2 launch``'s 5 s SIGINT grace."""
    try:
        rclpy.get_default_context().destroy()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class _Stop(Exception):
    """Raised in the main thread by the SIGINT / SIGTERM handler of :func:`spin`."""


def _stop_signal(signum, frame) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # one stop: a second signal (Ctrl-C and launch) waits for it
        signal.signal(s, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def spin(node: PipelineNode) -> int:
    """Spin ``node`` in a background thread until SIGINT / SIGTERM or an external shutdown, then release it.

    The pipeline is released while the ROS context is still valid (so it logs); further signals are ignored.
    Returns 1 when the executor failed while running, else 0 (a callback error during the stop is a warning).
    """
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    failed = []  # (exception, whether the stop had been asked for when it was raised)
    stopping = threading.Event()

    def _spin() -> None:
        try:
            executor.spin()
        except ExternalShutdownException:
            pass
        except Exception as e:  # noqa: BLE001 - reported below, then the node shuts down
            failed.append((e, stopping.is_set()))

    thread = threading.Thread(target=_spin, name="executor", daemon=True)
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _stop_signal)
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
    except (_Stop, KeyboardInterrupt):
        pass
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        stopping.set()
        executor.shutdown(timeout_sec=30.0)
        # the executor thread may still be leaving a callback the shutdown interrupted: wait for it, so that an
        # error it raises is logged here rather than turning the exit code without a word
        thread.join(5.0)
        for error, during_stop in failed:
            if during_stop:
                node.get_logger().warning(f"while stopping, a callback raised {type(error).__name__}: {error}")
            else:
                node.get_logger().error(f"executor failed: {type(error).__name__}: {error}")
        node.shutdown_pipeline()
        node.destroy_node()
        rclpy.try_shutdown()
    return 1 if any(not during_stop for _, during_stop in failed) else 0
