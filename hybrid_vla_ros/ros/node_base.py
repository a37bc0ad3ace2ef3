"""Helpers shared by the two lifecycle nodes: parameters from the schema, diagnostics, throttled logs."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
from rclpy.clock import Clock
from rclpy.clock_type import ClockType
from rclpy.exceptions import InvalidParameterTypeException, ParameterUninitializedException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.signals import SignalHandlerOptions

from ..util.stats import DropCounter, StageTimes
from . import params
from .msg_conv import ns_to_stamp
from .params_file import unreadable_parameters

# ROS parameter type of each schema type (as params.ros_type names it)
_PARAMETER_TYPES = {
    "string": Parameter.Type.STRING, "int": Parameter.Type.INTEGER, "double": Parameter.Type.DOUBLE,
    "bool": Parameter.Type.BOOL, "string[]": Parameter.Type.STRING_ARRAY,
    "int[]": Parameter.Type.INTEGER_ARRAY, "double[]": Parameter.Type.DOUBLE_ARRAY,
    "bool[]": Parameter.Type.BOOL_ARRAY,
}
_TYPE_WORDS = {t: word for word, t in _PARAMETER_TYPES.items()}  # Parameter.Type -> 'int', 'string[]', ...


#: Parameters rclpy declares on every node (not in the schemas, never reported as unknown).
_RCLPY_PARAMETERS = ("use_sim_time", "start_type_description_service")


def type_problem(name: str, given: Parameter, declared: Parameter.Type) -> str:
    """'name: must be of type int, got string 'four'' for a value of the wrong ROS type (with a hint to
    write 3.0 for a double given as an integer)."""
    hint = f" (write {float(given.value)!r})" if (given.type_, declared) == (
        Parameter.Type.INTEGER, Parameter.Type.DOUBLE) else ""
    return (f"{name}: must be of type {_TYPE_WORDS.get(declared, declared.name)}, "
            f"got {_TYPE_WORDS.get(given.type_, given.type_.name)} {given.value!r}{hint}")


def declare_parameters(node: Node, schema_node: str) -> None:
    """Declare every parameter of ``schema/<schema_node>.schema.json`` with the schema's default,
    description and valid values (``ros2 param describe``). A parameter without a default, or an
    array whose default is [] (rclpy cannot type an empty list), is declared by its type and stays
    unset until given; validation then applies the schema default.

    Values given at start (``--params-file``, ``-p``; launch_ros' files included) are taken as rcl read
    them. An empty list (YAML ``name: []`` or ``-p 'name:=[]'``, which rcl reads as 'not set') of an array
    parameter counts as the empty list. A value of the wrong type (``ring_slots: four``) is not declared: every such parameter is
    collected and ParameterError is raised after all are declared, naming each ('ring_slots: must be of
    type int, got string 'four''), where rclpy would raise on the first with a traceback. Values for
    names the schema does not have are logged as a warning (rclpy ignores them).
    """
    overrides = node._parameter_overrides  # rclpy's map of the values given at start (no public accessor)
    problems = []
    for name, spec in params.parameter_specs(schema_node).items():
        desc = ParameterDescriptor(description=spec.get("description", ""),
                                   additional_constraints=params.constraint_text(spec),
                                   dynamic_typing=isinstance(spec["type"], list))
        default = spec.get("default")
        declared_type = _PARAMETER_TYPES[params.ros_type(spec)] if not desc.dynamic_typing else None
        given = overrides.get(name)
        if given is not None and given.type_ == Parameter.Type.NOT_SET and spec["type"] == "array":
            # `name: []` / `-p 'name:=[]'`, which rcl reads as unset and rclpy cannot type (an empty list
            # becomes a BYTE_ARRAY): declared by its type, and read as the empty list (parameter_values)
            overrides.pop(name)
            empty = getattr(node, "_given_empty_arrays", set())
            empty.add(name)
            node._given_empty_arrays = empty
            default = None  # declared unset, so that the schema's default does not replace the []
        try:
            _declare(node, name, spec, default, declared_type, desc)
        except InvalidParameterTypeException:
            problems.append(type_problem(name, overrides.pop(name), declared_type))
            _declare(node, name, spec, default, declared_type, desc)
    unknown = sorted(n for n in overrides if not node.has_parameter(n) and n not in _RCLPY_PARAMETERS
                     and not n.startswith("qos_overrides."))
    if unknown:
        node.get_logger().warning(f"ignored: {', '.join(unknown)} (not parameters of {schema_node}; "
                                  "see its schema for the names)")
    if problems:
        raise params.ParameterError(problems)


def _declare(node: Node, name: str, spec: dict, default, declared_type, desc: ParameterDescriptor) -> None:
    if default is None or default == []:
        node.declare_parameter(name, declared_type, desc)
    else:
        node.declare_parameter(name, float(default) if spec["type"] == "number" else default, desc)


def parameter_values(node: Node, schema_node: str) -> dict:
    """Name -> current value of each of the schema's parameters that is set (unset ones left out)."""
    values = {}
    for name in params.parameter_specs(schema_node):
        try:
            v = node.get_parameter(name).value
        except ParameterUninitializedException:
            v = None
        if v is None:  # not set; an array given as [] at start is the empty list
            if name in getattr(node, "_given_empty_arrays", ()):
                values[name] = []
            continue
        values[name] = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "array" else v
    return values


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
    """One DiagnosticStatus named '<fully qualified node name>: <name>' (Autoware's '<node>: <task>'
    convention, with the namespace so that two deployments stay apart) in a DiagnosticArray stamped now."""
    status = DiagnosticStatus(level=level, name=f"{node.get_fully_qualified_name()}: {name}", message=message,
                              hardware_id=node.get_fully_qualified_name())
    status.values = [KeyValue(key=str(k), value=str(v)) for k, v in values.items()]
    arr = DiagnosticArray(status=[status])
    arr.header.stamp = ns_to_stamp(node.get_clock().now().nanoseconds)
    return arr


OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR

#: What a node with ``use_sim_time`` and no ``/clock`` says in /diagnostics, its log and the guard's drop line.
NO_CLOCK_HINT = ("use_sim_time is true but no message has arrived on /clock yet, so the node clock reads 0 (stamps "
                 "cannot be aged, timers on the ROS clock do not run): publish /clock (`ros2 bag play --clock`, "
                 "`hybrid-vla replay`) or set use_sim_time false")


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


class PipelineNode(LifecycleNode):
    """Lifecycle scaffolding shared by prefix_node and suffix_node (after ros2/demos lifecycle_py).

    The node's ROS parameters are declared from ``schema/<name>.schema.json`` (``name`` is the node's
    default name); ``read_parameters`` returns them validated. Subclasses implement ``on_configure``,
    ``on_activate`` (ending with ``super().on_activate``), ``_stop`` (stop the worker and
    subscriptions; idempotent), ``_release`` (free the stage and ring; idempotent) and
    ``_diagnostic_values`` (dict of key/values for /diagnostics). This class gives deactivate /
    cleanup / shutdown / error handling, counted and rate-limited drops, and a 1 Hz ``/diagnostics``
    publisher that also reports on deactivate.
    """

    def __init__(self, name: str, **kwargs):
        super().__init__(name, **kwargs)
        self._schema_node = name
        declare_parameters(self, name)
        self.add_on_set_parameters_callback(self._check_parameter_change)  # after declaring: file values
        # are not judged here but at configure, which reports every problem at once
        self.drops = DropCounter()
        self.times = StageTimes()
        self.last_error = ""
        #: A standing fault that keeps the node from working (e.g. the ring's contract does not fit): while
        #: set, /diagnostics reports ERROR with it as the message. "" when there is none.
        self.fault = ""
        self._throttle = Throttle()
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._stall_since = time.monotonic()
        self._clock_missing_said = False  # NO_CLOCK_HINT logged and not yet taken back
        # Steady time, not the node clock: with use_sim_time a ROS-time timer stops when /clock does, and
        # /diagnostics must keep coming (it is where a missing /clock is reported).
        self._diag_timer = self.create_timer(1.0, self.publish_diagnostics,
                                             clock=Clock(clock_type=ClockType.STEADY_TIME))
        #: ChangeState requests that left the state as it was (a transition not available from the current
        #: state, e.g. two lifecycle managers asking for the same one, or a callback that failed), in
        #: /diagnostics as lifecycle_requests_refused: `hybrid-vla replay --attach` reads it to tell whether
        #: another manager was bringing the node up while the replay did.
        self.lifecycle_requests_refused = 0
        self._count_refused_requests()

    def _count_refused_requests(self) -> None:
        """Wrap the callback of rclpy's ``change_state`` service (``_service_change_state``; rclpy has no public
        hook) to count the requests that leave the state unchanged."""
        service = getattr(self, "_service_change_state", None)
        if service is None:
            return
        inner = service.callback

        def on_change_state(request, response):
            before = lifecycle_state(self)
            response = inner(request, response)
            if not response.success and lifecycle_state(self) == before:
                self.lifecycle_requests_refused += 1
            return response

        service.callback = on_change_state

    #: Parameters a running node applies as soon as they are set (through :meth:`_apply_live_parameters`);
    #: every other one is read at configure.
    LIVE_PARAMETERS: tuple[str, ...] = ()

    def _check_parameter_change(self, changes: list[Parameter]) -> SetParametersResult:
        """on-set-parameters callback: each new value must meet its schema entry (type, range, enum,
        pattern; ``params.value_problems``), else the whole change is refused with a reason
        naming the parameter and the rule, e.g. 'split_layer: must be >= 0, got -5'. Values are read at
        configure, so an accepted change takes effect at the next configure (those in
        ``LIVE_PARAMETERS`` at once); the checks that need the checkpoint (e.g. split_layer <= L) wait
        for it too. Parameters outside the schema (rclpy's own, e.g. use_sim_time) are left to rclpy."""
        specs = params.parameter_specs(self._schema_node)
        values = {}
        for p in changes:
            if p.name in specs and p.value is not None:
                v = p.value
                values[p.name] = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "array" else v
        problems = params.value_problems(self._schema_node, values)
        problems += self._live_parameter_problems({k: v for k, v in values.items() if k in self.LIVE_PARAMETERS})
        if problems:
            reason = "; ".join(problems)
            self.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        later = [name for name in values if name not in self.LIVE_PARAMETERS]
        if later and lifecycle_state(self) in ("inactive", "active"):
            self.get_logger().info(f"parameter change accepted ({', '.join(later)}): it takes effect at the "
                                   "next configure (deactivate, cleanup, configure, activate)")
        live = {name: v for name, v in values.items() if name in self.LIVE_PARAMETERS}
        if live:
            try:
                self._apply_live_parameters(live)
            except Exception as e:  # noqa: BLE001 - a parameter callback must never take the node down
                reason = f"{', '.join(live)}: could not be applied: {type(e).__name__}: {e}"
                self.get_logger().error(f"parameter change refused: {reason}")
                return SetParametersResult(successful=False, reason=reason)
        return SetParametersResult(successful=True)

    def _apply_live_parameters(self, values: dict) -> None:
        """Apply accepted new values (name -> value) of ``LIVE_PARAMETERS`` now (they met the schema)."""

    def _live_parameter_problems(self, values: dict) -> list[str]:
        """'name: problem' for new values of ``LIVE_PARAMETERS`` that the schema allows but the loaded
        checkpoint does not (e.g. a split layer above L); [] by default."""
        return []

    def set_parameters_atomically(self, parameter_list: list[Parameter]) -> SetParametersResult:
        """rclpy's, but an undeclared name, an unset value or a value of the wrong type is refused with
        a reason that names the parameter (rclpy's own reasons do not, e.g. "Wrong parameter type,
        expected '2' got '4'"). The parameter services (``ros2 param set``) call this method."""
        problems = []
        for p in parameter_list:
            if not self.has_parameter(p.name):
                problems += params.value_problems(self._schema_node, {p.name: p.value})
            elif p.type_ == Parameter.Type.NOT_SET:
                problems.append(f"{p.name}: cannot be unset (it is declared with a type)")
            elif self.describe_parameter(p.name).dynamic_typing:  # several types: the schema judges the value
                problems += params.value_problems(self._schema_node, {p.name: p.value})
            else:
                declared = Parameter.Type(self.describe_parameter(p.name).type)
                if p.type_ != declared:
                    problems.append(type_problem(p.name, p, declared))
        if problems:
            reason = "; ".join(problems)
            self.get_logger().warning(f"parameter change refused: {reason}")
            return SetParametersResult(successful=False, reason=reason)
        return super().set_parameters_atomically(parameter_list)

    def read_parameters(self, **checkpoint) -> params.Params:
        """The current parameters checked against the node's schema and, given ``checkpoint`` facts
        (``num_layers``, ``n_cameras``), against the checkpoint. Raises ParameterError."""
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

    def _drop(self, cause: str, message: str) -> None:
        """Count a dropped frame or message by cause and log it at most every 2 s per cause."""
        n = self.drops.add(cause)
        self.last_error = message
        if self._throttle(cause):
            self.get_logger().warning(f"dropped ({cause}, {n} so far): {message}")

    STALL_S = 3.0  # inputs arriving without any output for this long is an ERROR

    def use_sim_time(self) -> bool:
        """The node's ``use_sim_time`` parameter (rclpy's own): its clock follows ``/clock``."""
        return bool(self.get_parameter("use_sim_time").value)

    def clock_missing(self) -> bool:
        """True while ``use_sim_time`` is set and no ``/clock`` message has arrived (the node clock reads 0)."""
        return self.use_sim_time() and self.get_clock().now().nanoseconds == 0

    def _say_clock_state(self, missing: bool) -> None:
        """Log NO_CLOCK_HINT when the clock goes missing, and once more when /clock arrives."""
        if missing and not self._clock_missing_said:
            self.get_logger().warning(NO_CLOCK_HINT)
        elif not missing and self._clock_missing_said:
            self.get_logger().info(f"/clock is arriving: node clock at {self.get_clock().now().nanoseconds} ns")
        self._clock_missing_said = missing

    def publish_diagnostics(self) -> None:
        """Publish one DiagnosticStatus '<fully qualified node name>: pipeline' on /diagnostics.

        Level: ERROR while ``fault`` is set (its text is the message) or when inputs keep arriving but
        nothing has come out for STALL_S seconds; WARN when ``use_sim_time`` is set and no /clock has
        arrived (NO_CLOCK_HINT, also logged), when something was dropped since the previous report or when
        the ring holds n_slots - 1 unread frames (the next frame overwrites one); else OK. Published on a
        steady-time timer, so also without /clock. Values include the ring's unread slots and the
        process's memory (resident set; CUDA allocated / reserved when the process uses CUDA).
        """
        drops = self.drops.snapshot()
        ring_ready, ring_slots = ring_fill(self._ring())
        clock_missing = self.clock_missing()
        self._say_clock_state(clock_missing)
        values = flatten_stats(self.times.summary(), drops,
                               {"state": lifecycle_state(self),
                                "lifecycle_requests_refused": self.lifecycle_requests_refused,
                                **self._diagnostic_values(),
                                "use_sim_time": self.use_sim_time(), "clock_missing": clock_missing,
                                "ring_ready_slots": f"{ring_ready}/{ring_slots}", **memory_values(),
                                "last_error": self.last_error})
        now = time.monotonic()
        inputs, outputs = self._io_counts()
        prev = getattr(self, "_diag_prev", None)
        if prev is None or outputs != prev["outputs"] or inputs == prev["inputs"]:
            self._stall_since = now  # output moved, or no new input: not stalled
        self._diag_prev = {"inputs": inputs, "outputs": outputs, "drops": sum(drops.values())}
        new_drops = self._diag_prev["drops"] - (prev["drops"] if prev else 0)
        if self.fault:
            level, message = ERROR, self.fault
        elif now - self._stall_since >= self.STALL_S:
            level, message = ERROR, f"inputs arrive but nothing came out for {now - self._stall_since:.0f} s"
        elif clock_missing:
            level, message = WARN, NO_CLOCK_HINT
        elif new_drops > 0:
            level, message = WARN, f"{new_drops} dropped since the last report ({self.last_error})"
        elif ring_slots and ring_ready >= ring_slots - 1:
            level, message = WARN, f"ring nearly full ({ring_ready}/{ring_slots} unread): the suffix falls behind"
        else:
            level, message = OK, "ok"
        self._diag_pub.publish(diagnostic_array(self, "pipeline", level, message, values))

    def _io_counts(self) -> tuple[int, int]:
        """(inputs seen, outputs produced) so far, for stall detection."""
        return 0, 0

    def _ring(self):
        """This node's end of the shared-memory ring, or None while it has none."""
        return None

    def _stop(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def _diagnostic_values(self) -> dict:
        return {}


def ring_fill(ring) -> tuple[int, int]:
    """(READY slots, all slots) of a ring end; (0, 0) without a ring or once it is closed."""
    if ring is None:
        return 0, 0
    try:
        states = ring.slot_states()
    except Exception:  # noqa: BLE001 - a ring closing under us just has no fill to report
        return 0, 0
    return states.count("READY"), len(states)


def memory_values() -> dict:
    """Process memory for diagnostics: resident set (MiB) and, when CUDA is in use, allocated / reserved (this
    process's caching allocator) and the device's driver-level used / free memory (``torch.cuda.mem_get_info``,
    every process on the device)."""
    import psutil
    import torch

    out = {"rss_mib": f"{psutil.Process().memory_info().rss / 2**20:.1f}"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_mib"] = f"{torch.cuda.memory_allocated() / 2**20:.1f}"
        out["cuda_reserved_mib"] = f"{torch.cuda.memory_reserved() / 2**20:.1f}"
        free, total = torch.cuda.mem_get_info()
        out["cuda_driver_used_mib"] = f"{(total - free) / 2**20:.1f}"
        out["cuda_driver_free_mib"] = f"{free / 2**20:.1f}"
    return out


def run_node(name: str, factory, argv: list[str]) -> int:
    """Start rclpy with ``argv``, build the node with ``factory()`` and spin it (:func:`spin`), then end the
    process with spin's exit code (:func:`_exit_now`; it does not return after a spin). Returns 2 or 130 when
    the node could not be started.

    A command line rcl cannot read (a parameter file that is not YAML, a list mixing types) and values of
    the wrong type are printed as one clear error naming each parameter, ``<name>: ...`` on stderr, and
    the process exits with 2, never with a traceback. rclpy's own signal handlers are not installed:
    SIGINT and SIGTERM are handled by :func:`spin`, so the node still logs (rosout included) while it
    shuts down.
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
    """End the process with ``code`` once the node is shut down: finalize the ROS context (the DDS participant,
    Fast DDS's shared-memory files with it), flush stdout and stderr, then ``os._exit``. Python's own
    interpreter finalization with torch loaded takes seconds on a busy machine (2.4 to 4.1 s measured on a
    2-core machine at load 5), more than the 5 s ``ros2 launch`` waits after SIGINT before it escalates to
    SIGTERM and then SIGKILL; nothing the node needs runs in it (the ring and the model are released, the
    logs written)."""
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
    """Spin a pipeline node until SIGINT / SIGTERM (or an external shutdown), then release it; exit code 0.

    The executor runs in a background thread and the main thread waits for a signal. On SIGINT or SIGTERM
    the executor stops, the pipeline is released (worker stopped, ring and model freed) and logged while
    the ROS context is still valid, then the node is destroyed and rclpy shut down. Further signals during
    that shutdown are ignored. Returns 1 when the executor itself failed (the error is logged).
    """
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    failed = []

    def _spin() -> None:
        try:
            executor.spin()
        except ExternalShutdownException:
            pass
        except Exception as e:  # noqa: BLE001 - reported below, then the node shuts down
            failed.append(e)

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
        executor.shutdown(timeout_sec=30.0)
        if failed:
            node.get_logger().error(f"executor failed: {type(failed[0]).__name__}: {failed[0]}")
        node.shutdown_pipeline()
        node.destroy_node()
        rclpy.try_shutdown()
    return 1 if failed else 0
