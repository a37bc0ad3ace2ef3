"""Reading ROS 2 parameter files the way rcl reads them, before rclpy starts.

Both nodes pin their process to ``cpu_affinity`` before rclpy (and, in the suffix, torch) start threads, so
they read that one parameter themselves from their command line (``-p``, ``--params-file``) before
``rclpy.init`` (:func:`pin_from_ros_args`). The files it
meets there are written by people and by launch_ros. launch_ros (``launch_ros.actions.Node``) writes the
parameters of a launch file's dict with ``yaml.dump``, which turns the tuples its parameter normalisation
makes of every list into ``!!python/tuple`` nodes (``cpu_affinity: !!python/tuple [6, 7]``); rcl's own YAML
parser ignores tags, while ``yaml.safe_load`` refuses them. :func:`load_params_file` reads such a file with a
safe loader that treats a ``!!python/tuple`` sequence as the list it was, and nothing else beyond safe YAML.

Node keys follow ROS 2's parameter-file rules (:func:`node_key_matches`): ``/**`` (every node), ``/node``,
``/ns/node``, ``/ns/*``, ``/**/node``; namespaces may also be nested as mappings
(``ns: {node: {ros__parameters: ...}}``).
Only stdlib, PyYAML and :mod:`hybrid_vla_ros.util.cores` are imported here (no rclpy, no torch).
"""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from ..util.cores import parse_core_list, pin_process

PARAMETERS_KEY = "ros__parameters"


class ParamsFileError(ValueError):
    """A parameter file, or a parameter value in it or on the command line, that cannot be read; the message
    names the file and the parameter."""


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
    """The parsed parameter file: a mapping of node keys to sections (``{}`` for an empty file).

    Raises ParamsFileError naming the file when it cannot be read, is not YAML (another unsafe tag
    included), or its top level is not a mapping.
    """
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
    """Whether parameter-file node key ``key`` applies to node ``node`` in ``namespace``.

    The rule of rclcpp's ``parameter_map`` (which rclpy follows): a leading ``/`` is implied, ``/**`` stands
    for any number of namespace components and ``/*`` for exactly one, and the result must match the node's
    fully qualified name as a whole (so a bare ``suffix_node`` names the node in the root namespace only).
    """
    fqn = "/" + "/".join(p for p in (namespace.strip("/"), node) if p)
    pattern = re.escape(key if key.startswith("/") else "/" + key)
    pattern = pattern.replace(r"/\*\*", r"(?:/\w+)*").replace(r"/\*", r"/\w+")
    return re.fullmatch(pattern, fqn) is not None


def parameter_from_files(paths: list[str], namespace: str, node: str, name: str):
    """The value of parameter ``name`` for ``node`` in ``namespace`` from parameter files read in order,
    the last match winning (as rcl applies them); ``None`` when no file sets it. Raises ParamsFileError."""
    value = None
    for path in paths:
        for key, params in _flatten(load_params_file(path)):
            if name in params and node_key_matches(key, namespace, node):
                value = params[name]
    return value


def ros_args_parameter(argv: list[str], node: str, name: str, namespace: str = "/"):
    """The value of parameter ``name`` given to ``node`` on a ROS command line, before rclpy parses it.

    Reads ``-p name:=value`` / ``--param name:=value`` (also ``node:name:=value``) and ``--params-file FILE``
    after ``--ros-args`` in order, the last one winning as in rcl; ``-r __ns:=/ns`` (and ``__node:=``) set the
    namespace and name the file keys are matched with. ``-p`` values are YAML (``[6, 7]``). Returns the parsed
    value, or None when it is not given. Raises ParamsFileError naming the file or argument it cannot read.
    """
    args, value, in_ros, i = [], None, False, 0
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
                    value = _safe_yaml(raw)
                except yaml.YAMLError as e:
                    raise ParamsFileError(f"-p {text}: the value of {name} is not YAML: {e}") from e
        elif flag == "--params-file":
            found = parameter_from_files([text], namespace, node, name)
            if found is not None:
                value = found
    return value


def cpu_affinity_from_ros_args(argv: list[str], node: str = "suffix_node") -> list[int] | None:
    """``cpu_affinity`` of ``node`` from its command line (see :func:`ros_args_parameter`) as a core list; None
    when not given, [] when given empty (not pinned). Raises ParamsFileError naming the parameter for a value
    that is not a list of core indices, and for a file that cannot be read."""
    raw = ros_args_parameter(argv, node, "cpu_affinity")
    if raw is None or raw == [] or raw == "":
        return None if raw is None else []
    try:
        return parse_core_list(raw)
    except ValueError as e:
        raise ParamsFileError(f"cpu_affinity: {e}") from None


def pin_from_ros_args(argv: list[str], node: str) -> list[int] | None:
    """Pin the whole process (every thread that exists, and all later ones) to ``node``'s ``cpu_affinity`` from
    its command line (:func:`cpu_affinity_from_ros_args`). Returns the cores, None when not given, [] when
    given empty (not pinned). Raises ValueError (ParamsFileError) for a value or file that cannot be read,
    or cores this process may not use (:func:`~hybrid_vla_ros.util.cores.pin_process`)."""
    cores = cpu_affinity_from_ros_args(argv, node)
    if cores:
        pin_process(cores)
    return cores
