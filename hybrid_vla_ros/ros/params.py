"""Node parameters, driven by one JSON schema per node (ROS-free, so they are tested without a ROS graph).

``schema/<node>.schema.json`` (Autoware convention, draft-07) is the single source of truth for names, types,
defaults, ranges and descriptions: the nodes declare their parameters from it and
``scripts/generate_param_tables.py`` renders the README tables from it. Code here holds only what a schema
cannot say (checkpoint, camera count, directories, cores of this machine).
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jsonschema

from .settings import SETTINGS, NodeSettings, PrefixNodeSettings, SuffixNodeSettings

NODES = ("prefix_node", "suffix_node")
PACKAGE = "hybrid_vla_ros"
_SOURCE_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schema"  # <repo>/schema in a source tree


class ParameterError(ValueError):
    """Invalid parameters; the message and ``problems`` list each as 'name: problem'."""

    def __init__(self, problems: list[str] | str):
        problems = [problems] if isinstance(problems, str) else problems
        super().__init__("invalid parameters: " + "; ".join(problems))
        self.problems = list(problems)


#: A node's validated parameters, read by name (``p["ring.delivery"]``) or attribute (``p.ring.delivery``).
Params = NodeSettings


# ------------------------------------------------------------------------------------------- schema
def schema_path(node: str) -> Path:
    """``<node>.schema.json`` from the source tree, else ``share/hybrid_vla_ros/schema``. Raises LookupError."""
    if node not in NODES:
        raise LookupError(f"no parameter schema for {node!r} (nodes: {', '.join(NODES)})")
    name = f"{node}.schema.json"
    local = _SOURCE_SCHEMA_DIR / name
    if local.is_file():
        return local
    from ..util.paths import share_directory  # ament index lookup; no rclpy

    installed = share_directory(PACKAGE) / "schema" / name
    if not installed.is_file():
        raise LookupError(f"parameter schema {name} is neither in {_SOURCE_SCHEMA_DIR} nor in {installed.parent}")
    return installed


# JSON Schema counts 2.0 as an integer; a ROS parameter of 2.0 is a double, and a split layer of 2.0 is
# not a block index. Integers here are Python ints (bools excluded), as rclpy types them.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft7Validator,
    type_checker=jsonschema.Draft7Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, v: isinstance(v, int) and not isinstance(v, bool)))


@functools.lru_cache(maxsize=None)
def _load(node: str) -> tuple[dict, jsonschema.Draft7Validator]:
    schema = json.loads(schema_path(node).read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return schema, _Validator(schema)


def load_schema(node: str) -> dict:
    """The node's parameter schema (a copy; the loaded one is cached)."""
    return copy.deepcopy(_load(node)[0])


def parameter_specs(node: str) -> dict[str, dict]:
    """Parameter name -> its schema (type, description, default, range ...), in schema order."""
    return load_schema(node)["definitions"][node]["properties"]


def defaults(node: str) -> dict[str, Any]:
    """Parameter name -> schema default, for every parameter that has one."""
    return {name: spec["default"] for name, spec in parameter_specs(node).items() if "default" in spec}


_ROS_TYPES = {"string": "string", "integer": "int", "number": "double", "boolean": "bool"}


def ros_type(spec: Mapping) -> str:
    """The ROS parameter type of a schema entry: 'string', 'int', 'double', 'bool' or '<item type>[]'."""
    if isinstance(spec["type"], list):  # declared with dynamic typing, e.g. split_layer: an int or 'auto'
        return " or ".join(_ROS_TYPES[t] for t in spec["type"])
    if spec["type"] == "array":
        return ros_type(spec["items"]) + "[]"
    return _ROS_TYPES[spec["type"]]


def constraint_text(spec: Mapping, code: str = "") -> str:
    """The valid values of a schema entry in words, e.g. 'Must be in [3, 64].' ('' when unconstrained);
    ``code`` wraps literals, e.g. '`' for Markdown."""
    def lit(v: Any) -> str:
        return f"{code}{v}{code}"

    if isinstance(spec.get("type"), list):  # e.g. an int or 'auto': say which rule applies to which type
        numeric = {k: v for k, v in spec.items()
                   if k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")}
        textual = {k: v for k, v in spec.items() if k in ("pattern", "minLength", "maxLength", "enum")}
        parts = [f"{article} {word} " + " and ".join(_value_constraints(rules, lit))
                 for article, word, rules in (("an", "integer", numeric), ("a", "string", textual)) if rules]
        return ("; ".join(parts)[0].upper() + "; ".join(parts)[1:] + ".") if parts else ""
    parts = _value_constraints(spec, lit)
    if spec.get("type") == "array":
        if "minItems" in spec:
            parts.append(f"at least {spec['minItems']} item{'s' if spec['minItems'] != 1 else ''}")
        if "maxItems" in spec:
            parts.append(f"at most {spec['maxItems']} items")
        if spec.get("uniqueItems"):
            parts.append("no duplicates")
        item = _value_constraints(spec.get("items", {}), lit)
        if item:
            parts.append("each item " + " and ".join(item))
    if not parts:
        return ""
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def _value_constraints(spec: Mapping, lit: Callable[[Any], str]) -> list[str]:
    """'must ...' phrases for the enum, range, length and pattern keywords of one schema entry."""
    parts = []
    if "enum" in spec:
        parts.append("must be one of " + ", ".join(lit(v) for v in spec["enum"]))
    low = ("[", spec["minimum"]) if "minimum" in spec else \
        ("(", spec["exclusiveMinimum"]) if "exclusiveMinimum" in spec else None
    high = ("]", spec["maximum"]) if "maximum" in spec else \
        (")", spec["exclusiveMaximum"]) if "exclusiveMaximum" in spec else None
    if low and high:
        parts.append(f"must be in {low[0]}{low[1]}, {high[1]}{high[0]}")
    elif low:
        parts.append(f"must be {'>=' if low[0] == '[' else '>'} {low[1]}")
    elif high:
        parts.append(f"must be {'<=' if high[0] == ']' else '<'} {high[1]}")
    if spec.get("minLength") == 1 and "maxLength" not in spec:
        parts.append("must not be empty")
    else:
        if "minLength" in spec:
            parts.append(f"must have at least {spec['minLength']} characters")
        if "maxLength" in spec:
            parts.append(f"must have at most {spec['maxLength']} characters")
    if "pattern" in spec:
        parts.append(f"must match {lit(spec['pattern'])}")
    return parts


# --------------------------------------------------------------------------------------- validation
def schema_problems(node: str, values: Mapping[str, Any]) -> list[str]:
    """Every way ``values`` breaks the node's schema, one 'name: problem' each."""
    return [f"{_label(path)}: {problem}" for path, problem in _schema_errors(node, values)]


def value_problems(node: str, values: Mapping[str, Any]) -> list[str]:
    """Problems of the given parameters only (unknown names included), for ``ros2 param set``; the code-side
    checks of :func:`validate` wait for configure."""
    merged = {**copy.deepcopy(defaults(node)), **values}
    return [f"{_label(path)}: {problem}" for path, problem in _schema_errors(node, merged) if path[0] in values]


def _schema_errors(node: str, values: Mapping[str, Any]) -> list[tuple[list, str]]:
    """(path, e.g. ['camera_transports', 0], problem) for each schema violation."""
    _, validator = _load(node)
    document = {"/**": {"ros__parameters": dict(values)}}
    found = []
    for error in sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.absolute_path]):
        found.extend(_describe(node, error))
    return found


def _label(path: list) -> str:
    return str(path[0]) + "".join(f"[{i}]" for i in path[1:])


def _describe(node: str, error: jsonschema.ValidationError) -> list[tuple[list, str]]:
    """Paths and problems, in words, of one jsonschema error about a node's parameter dict."""
    path = list(error.absolute_path)[2:]  # drop "/**", "ros__parameters"
    kind, bound, value = error.validator, error.validator_value, error.instance
    if kind == "additionalProperties":
        known = set(parameter_specs(node))
        return [([name], f"unknown parameter (not in {node}'s schema)") for name in sorted(set(value) - known)]
    if kind == "required":
        return [([name], "missing") for name in bound if name not in value]
    if not path:
        return [([node], error.message)]
    messages = {
        "type": lambda: f"must be of type {_type_words(bound)}, got {value!r}",
        "minimum": lambda: f"must be >= {bound}, got {value!r}",
        "maximum": lambda: f"must be <= {bound}, got {value!r}",
        "exclusiveMinimum": lambda: f"must be > {bound}, got {value!r}",
        "exclusiveMaximum": lambda: f"must be < {bound}, got {value!r}",
        "enum": lambda: f"must be one of {', '.join(map(str, bound))}, got {value!r}",
        "pattern": lambda: f"must match {bound}, got {value!r}",
        "minLength": lambda: "must not be empty" if bound == 1 else f"must have at least {bound} characters",
        "maxLength": lambda: f"must have at most {bound} characters",
        "minItems": lambda: f"must have at least {bound} item{'s' if bound != 1 else ''}",
        "maxItems": lambda: f"must have at most {bound} items",
        "uniqueItems": lambda: f"must not repeat an entry, got {value!r}",
    }
    problem = messages[kind]() if kind in messages else error.message
    default = parameter_specs(node).get(path[0], {}).get("default")
    if len(path) == 1 and type(value) is type(default) and value == default:
        problem += " (the default, a placeholder: set it)"  # e.g. split_layer -1
    return [(path, problem)]


def _type_words(t: str | list[str]) -> str:
    names = [_ROS_TYPES.get(x, x) if x != "array" else "list" for x in ([t] if isinstance(t, str) else t)]
    return " or ".join(names)


def validate(node: str, values: Mapping[str, Any], *, n_cameras: int | None = None,
             num_layers: int | None = None,
             needs_camera_info: bool = False) -> PrefixNodeSettings | SuffixNodeSettings:
    """A node's parameters, defaults filled in, as its settings dataclass (:data:`~.settings.SETTINGS`).

    ``n_cameras`` / ``num_layers``: checkpoint facts when known; with ``n_cameras`` empty camera topics and a
    single transport expand to one per camera (:func:`camera_info_topic`), info topics distinct when
    ``needs_camera_info``. Raises :class:`ParameterError` listing every problem at once.
    """
    merged = {**copy.deepcopy(defaults(node)), **values}
    errors = _schema_errors(node, merged)
    problems = [f"{_label(path)}: {problem}" for path, problem in errors]
    bad = {path[0] for path, _ in errors}
    problems += _checkpoint_checks(merged, bad, num_layers)
    if node == "prefix_node":
        problems += _camera_checks(merged, bad, n_cameras, needs_camera_info)
    if "cpu_affinity" in merged:  # both nodes
        problems += _affinity_checks(merged, bad)
    if "model_frame_origin" in merged and "model_frame_origin" not in bad:  # both nodes
        problems += _origin_checks(merged["model_frame_origin"])
    if problems:
        raise ParameterError(problems)
    for name, spec in parameter_specs(node).items():
        if spec["type"] == "number":  # a YAML or JSON 50 is a valid double: hand the node a float
            merged[name] = float(merged[name])
    return SETTINGS[node].from_parameters(merged)


# The checks below are what a schema cannot say. Each skips a parameter the schema already rejected.
def _checkpoint_checks(v: dict, bad: set[str], num_layers: int | None) -> list[str]:
    problems = []
    path = v["model_path"]
    if "model_path" not in bad:
        if not path:
            problems.append("model_path: must name a checkpoint directory")
        elif not os.path.isdir(path):
            problems.append(f"model_path: {path!r} is not a directory")
    k = v["split_layer"]
    if "split_layer" not in bad and num_layers is not None and isinstance(k, int) and k > num_layers:
        problems.append(f"split_layer: {k} out of range [0, {num_layers}] for this model")
    return problems


def camera_info_topic(image_topic: str) -> str:
    """The CameraInfo topic beside an image topic, as image_transport pairs them, but ``image<N>`` ->
    ``camera_info<N>``: ``/cam0/image_rect_color`` -> ``/cam0/camera_info``, ``~/input/image3`` ->
    ``~/input/camera_info3``."""
    head, _, last = image_topic.rstrip("/").rpartition("/")
    number = last[len("image"):] if last.startswith("image") and last[len("image"):].isdigit() else ""
    return f"{head}/camera_info{number}" if head or image_topic.startswith("/") else f"camera_info{number}"


def _camera_checks(v: dict, bad: set[str], n_cameras: int | None, needs_camera_info: bool = False) -> list[str]:
    """Camera count against the checkpoint; expands the defaults in ``v``."""
    if n_cameras is None:
        return []
    problems = []
    if "camera_topics" not in bad:
        if not v["camera_topics"]:
            v["camera_topics"] = [f"~/input/image{i}" for i in range(n_cameras)]
        if len(v["camera_topics"]) != n_cameras:
            problems.append(f"camera_topics: {len(v['camera_topics'])} topics given, "
                            f"the model takes {n_cameras} cameras")
    if "camera_transports" not in bad:
        if len(v["camera_transports"]) == 1:
            v["camera_transports"] = v["camera_transports"] * n_cameras
        if len(v["camera_transports"]) != n_cameras:
            problems.append(f"camera_transports: give one value or {n_cameras} (one per camera), "
                            f"got {len(v['camera_transports'])}")
    if "camera_info_topics" not in bad and "camera_topics" not in bad and len(v["camera_topics"]) == n_cameras:
        if not v["camera_info_topics"]:
            v["camera_info_topics"] = [camera_info_topic(t) for t in v["camera_topics"]]
        if len(v["camera_info_topics"]) != n_cameras:
            problems.append(f"camera_info_topics: {len(v['camera_info_topics'])} topics given, "
                            f"the model takes {n_cameras} cameras")
        elif needs_camera_info and len(set(v["camera_info_topics"])) != n_cameras:
            problems.append(f"camera_info_topics: {v['camera_info_topics']} name a topic twice (derived from "
                            "camera_topics, which share a namespace): give one CameraInfo topic per camera")
    return problems


def _origin_checks(origin) -> list[str]:
    """model_frame_origin: finite (a schema's number takes NaN and infinity)."""
    if all(math.isfinite(float(v)) for v in origin):
        return []
    return [f"model_frame_origin: {list(origin)} must be finite metres (x, y, z)"]


def _affinity_checks(v: dict, bad: set[str]) -> list[str]:
    """cpu_affinity names cores this process may use."""
    if "cpu_affinity" in bad:
        return []
    count = os.cpu_count() or 1
    available = os.sched_getaffinity(0) | set(range(count))
    missing = [c for c in v["cpu_affinity"] if c not in available]
    return [f"cpu_affinity: cores {missing} do not exist (this machine has 0..{count - 1})"] if missing else []
