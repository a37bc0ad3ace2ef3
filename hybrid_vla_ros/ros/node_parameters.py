"""A pipeline node's ROS parameters from its schema (``schema/<node>.schema.json``): declared with the schema's
defaults and descriptions, read back as values, and each change checked against the schema before rclpy
applies it (:class:`ParameterChecks`)."""
from __future__ import annotations

from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
from rclpy.exceptions import InvalidParameterTypeException, ParameterUninitializedException
from rclpy.node import Node
from rclpy.parameter import Parameter

from . import params
from .lifecycle_hooks import lifecycle_state

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
    """'name: must be of type int, got string 'four'' (with a hint for an integer given to a double)."""
    hint = f" (write {float(given.value)!r})" if (given.type_, declared) == (
        Parameter.Type.INTEGER, Parameter.Type.DOUBLE) else ""
    return (f"{name}: must be of type {_TYPE_WORDS.get(declared, declared.name)}, "
            f"got {_TYPE_WORDS.get(given.type_, given.type_.name)} {given.value!r}{hint}")


def declare_parameters(node: Node, schema_node: str) -> None:
    """Declare every schema parameter with its default, description and valid values (``ros2 param describe``).

    Parameters without a default, or with default [] (rclpy cannot type an empty list), are declared by type and
    stay unset until given. A given ``[]`` (rcl: 'not set') counts as the empty list. Values of the wrong type
    are all collected into one ParameterError after declaring (rclpy would raise on the first); unknown names
    are logged as a warning.
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
    """Name -> current value of each set schema parameter."""
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


class ParameterChecks:
    """Checks of a PipelineNode's parameter changes against its schema; refusals name the parameter and rule
    and are logged. ``LIVE_PARAMETERS`` apply at once, the others at the next configure."""

    def __init__(self, node: Node, schema_node: str):
        self._node = node
        self._schema_node = schema_node

    def refusal(self, parameter_list: list[Parameter]) -> SetParametersResult | None:
        """The refusal of an undeclared, unset or mistyped parameter; None when rclpy may go on."""
        node = self._node
        problems = []
        for p in parameter_list:
            if not node.has_parameter(p.name):
                problems += params.value_problems(self._schema_node, {p.name: p.value})
            elif p.type_ == Parameter.Type.NOT_SET:
                problems.append(f"{p.name}: cannot be unset (it is declared with a type)")
            elif node.describe_parameter(p.name).dynamic_typing:  # several types: the schema judges the value
                problems += params.value_problems(self._schema_node, {p.name: p.value})
            else:
                declared = Parameter.Type(node.describe_parameter(p.name).type)
                if p.type_ != declared:
                    problems.append(type_problem(p.name, p, declared))
        return self._refuse(problems) if problems else None

    def on_set(self, changes: list[Parameter]) -> SetParametersResult:
        """On-set-parameters callback: the whole change is refused unless every value meets its schema entry
        (checkpoint checks wait for configure). Parameters outside the schema are left to rclpy."""
        node, live_names = self._node, self._node.LIVE_PARAMETERS
        specs = params.parameter_specs(self._schema_node)
        values = {}
        for p in changes:
            if p.name in specs and p.value is not None:
                v = p.value
                values[p.name] = list(v) if isinstance(v, (list, tuple)) or type(v).__name__ == "array" else v
        problems = params.value_problems(self._schema_node, values)
        problems += node.live_parameter_problems({k: v for k, v in values.items() if k in live_names})
        if problems:
            return self._refuse(problems)
        later = [name for name in values if name not in live_names]
        if later and lifecycle_state(node) in ("inactive", "active"):
            node.get_logger().info(f"parameter change accepted ({', '.join(later)}): it takes effect at the "
                                   "next configure (deactivate, cleanup, configure, activate)")
        live = {name: v for name, v in values.items() if name in live_names}
        if live:
            try:
                node.apply_live_parameters(live)
            except Exception as e:  # noqa: BLE001 - a parameter callback must never take the node down
                reason = f"{', '.join(live)}: could not be applied: {type(e).__name__}: {e}"
                node.get_logger().error(f"parameter change refused: {reason}")
                return SetParametersResult(successful=False, reason=reason)
        return SetParametersResult(successful=True)

    def _refuse(self, problems: list[str]) -> SetParametersResult:
        reason = "; ".join(problems)
        self._node.get_logger().warning(f"parameter change refused: {reason}")
        return SetParametersResult(successful=False, reason=reason)
