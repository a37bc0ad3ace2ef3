"""Reading ROS 2 parameter files the way rcl reads them, before rclpy starts.

The nodes read ``cpu_affinity`` from their command line themselves (:func:`cpu_affinity_from_ros_args`) to pin
the process before torch, OpenCV and rclpy start threads. launch_ros writes list parameters as
``!!python/tuple`` (``yaml.dump`` of its tuples), which rcl ignores and ``yaml.safe_load`` refuses; the loader
here reads that tag as a list and nothing else beyond safe YAML. Node keys may be nested as mappings
(``ns: {node: {ros__parameters: ...}}``). Imports no rclpy or torch.
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from ..util.cores import parse_core_list

PARAMETERS_KEY = "ros__parameters"


class ParamsFileError(ValueError):
    """A parameter file or value that cannot be read; the message names the file and the parameter."""


class _ParamsFileLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` plus the one tag launch_ros writes: ``tag:yaml.org,2002:python/tuple`` -> list."""


_ParamsFileLoader.add_constructor(
    "tag:yaml.org,2002:python/tuple", lambda loader, node: loader.construct_sequence(node, deep=True))


def _safe_yaml(text: str):
    """One YAML document parsed with :class:`_ParamsFileLoader`. Raises yaml.YAMLError."""
    loader = _ParamsFileLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_params_file(path: str | Path) -> dict:
    """The parsed file, node keys -> sections (``{}`` when empty). Raises ParamsFileError when it cannot be read,
    is not (safe) YAML, or its top level is not a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ParamsFileError(f"parameter file {path}: {e.strerror or e}") from e
    try:
        data = _safe_yaml(text)
    except yaml.YAMLError as e:
        raise ParamsFileError(f"parameter file {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsFileError(f"parameter file {path}: the top level must map node names to parameters")
    return data


def _flatten(data: dict, prefix: str = ""):
    """(fully qualified node key, parameters dict) of every node section, nested namespaces joined."""
    for key, section in data.items():
        if not isinstance(section, dict):
            continue
        name = f"{prefix}/{str(key).strip('/')}" if prefix else str(key)
        if PARAMETERS_KEY in section:
            params = section[PARAMETERS_KEY]
            if isinstance(params, dict):
                yield name, params
        else:
            yield from _flatten(section, name)


def node_key_matches(key: str, namespace: str, node: str) -> bool:
    """Whether node key ``key`` applies to ``node`` in ``namespace``, by rclcpp's ``parameter_map`` rule.

    A leading ``/`` is implied, ``/**`` is any number of namespace components, ``/*`` exactly one, and the
    whole name must match (a bare ``suffix_node`` is the root namespace's only).
    """
    fqn = "/" + "/".join(p for p in (namespace.strip("/"), node) if p)
    pattern = re.escape(key if key.startswith("/") else "/" + key)
    pattern = pattern.replace(r"/\*\*", r"(?:/\w+)*").replace(r"/\*", r"/\w+")
    return re.fullmatch(pattern, fqn) is not None


def _later(value, new):
    """rcl's rule for a repeated value: the later wins, except an empty list (rcl reads it as 'not set')."""
    return value if isinstance(new, list) and not new and value is not None else new


def parameter_from_files(paths: list[str], namespace: str, node: str, name: str):
    """Parameter ``name`` of ``node`` from ``paths`` in order (rcl's precedence, :func:`_later`); None when
    unset. Raises ParamsFileError."""
    value = None
    for path in paths:
        for key, params in _flatten(load_params_file(path)):
            if name in params and node_key_matches(key, namespace, node):
                value = _later(value, params[name])
    return value


def ros_args_parameter(argv: list[str], node: str, name: str, namespace: str = "/"):
    """Parameter ``name`` of ``node`` from a ROS command line before rclpy parses it; None when not given.

    Reads ``-p``/``--param`` (YAML values, ``node:name:=`` too) and ``--params-file`` after ``--ros-args`` with
    rcl's precedence; ``-r __ns:=`` / ``__node:=`` set what file keys match. Raises ParamsFileError naming what
    it cannot read.
    """
    args, value = _ros_args(argv), None
    for flag, text in args:  # the node's own name and namespace first: file keys are matched against them
        if flag in ("-r", "--remap"):
            target, _, to = text.partition(":=")
            if target in ("__ns", f"{node}:__ns"):
                namespace = to
            elif target in ("__node", "__name", f"{node}:__node"):
                node = to
    for flag, text in args:
        if flag in ("-p", "--param"):
            pname, sep, raw = text.partition(":=")
            owner, _, pname = pname.rpartition(":")
            if sep and pname == name and (not owner or owner == node):
                try:
                    value = _later(value, _safe_yaml(raw))
                except yaml.YAMLError as e:
                    raise ParamsFileError(f"-p {text}: the value of {name} is not YAML: {e}") from e
        elif flag == "--params-file":
            found = parameter_from_files([text], namespace, node, name)
            if found is not None:
                value = _later(value, found)
    return value


def _ros_args(argv: list[str]) -> list[tuple[str, str]]:
    """(flag, value) of every parameter and remap argument after ``--ros-args``."""
    args, in_ros, i = [], False, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--ros-args":
            in_ros = True
        elif arg == "--":
            in_ros = False
        elif in_ros and arg in ("-p", "--param", "--params-file", "-r", "--remap") and i + 1 < len(argv):
            args.append((arg, argv[i + 1]))
            i += 1
        i += 1
    return args


#: The parameter types rcl reads from YAML; a list must hold items of one of them only.
_RCL_SCALARS = ((bool, "bool"), (int, "integer"), (float, "double"), (str, "string"))


def _rcl_kind(value) -> str | None:
    for cls, word in _RCL_SCALARS:  # bool before int: a YAML true is a Python int too
        if isinstance(value, cls):
            return word
    return None


def _value_problem(value) -> str | None:
    """Why rcl cannot read ``value`` (a list of mixed types or non-scalars), None when it can."""
    if not isinstance(value, list):
        return None
    kinds = [_rcl_kind(v) for v in value]
    if None in kinds:
        return f"a list must hold plain values (bool, integer, double or string), got {value!r}"
    if len(set(kinds)) > 1:
        hint = " (write every item as a double, e.g. 2.0)" if set(kinds) == {"integer", "double"} else ""
        return f"a list must hold items of one type, got {' and '.join(sorted(set(kinds)))} in {value!r}{hint}"
    return None


def _walk_values(params: dict, prefix: str = ""):
    """(dotted name, value) of each parameter in a ``ros__parameters`` mapping."""
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _walk_values(value, f"{name}.")
        else:
            yield name, value


def unreadable_parameters(argv: list[str]) -> list[str]:
    """What on a ROS command line rcl cannot read, one line each naming the parameter and where; [] when none.

    Explains ``rclpy.init``'s parse error, which names a file and line but not the parameter.
    """
    problems = []
    for flag, text in _ros_args(argv):
        if flag == "--params-file":
            try:
                sections = list(_flatten(load_params_file(text)))
            except ParamsFileError as e:
                problems.append(str(e))
                continue
            for key, params in sections:
                for name, value in _walk_values(params):
                    problem = _value_problem(value)
                    if problem:
                        problems.append(f"{name}: {problem} (parameter file {text}, node key {key})")
        elif flag in ("-p", "--param"):
            name, sep, raw = text.partition(":=")
            if not sep:
                continue
            try:
                value = _safe_yaml(raw)
            except yaml.YAMLError as e:
                problems.append(f"{name}: the value {raw!r} is not YAML ({flag} {text}): {e}")
                continue
            problem = _value_problem(value)
            if problem:
                problems.append(f"{name.rpartition(':')[2]}: {problem} ({flag} {text})")
    return problems


def cpu_affinity_from_ros_args(argv: list[str], node: str = "suffix_node") -> list[int] | None:
    """``cpu_affinity`` of ``node`` from its command line as a core list; None when not given, [] when empty
    (not pinned). Raises ParamsFileError for a bad value or an unreadable file."""
    raw = ros_args_parameter(argv, node, "cpu_affinity")
    if raw is None or raw == [] or raw == "":
        return None if raw is None else []
    try:
        return parse_core_list(raw)
    except ValueError as e:
        raise ParamsFileError(f"cpu_affinity: {e}") from None
