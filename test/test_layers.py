"""The package's layers: every import of every module (function-level ones included) goes down or sideways
within its own sub-package, and nothing below ``ros`` imports ROS.

Layers, lowest first: util; model, transport, vehicle; split; runtime; ros; tools (see hybrid_vla_ros/__init__).
"""
import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "hybrid_vla_ros"
LAYER = {"util": 0, "model": 1, "transport": 1, "vehicle": 1, "split": 2, "runtime": 3, "ros": 4, "tools": 5}
#: Top-level modules that belong to ROS 2 (client library, launch, interfaces, the ament index).
ROS_MODULES = ("rclpy", "launch", "launch_ros", "launch_testing", "launch_testing_ros", "ament_index_python",
               "rosidl_runtime_py", "rosidl_parser", "ros2cli", "cv_bridge", "builtin_interfaces", "rcl_interfaces")


def _is_ros(top: str) -> bool:
    return top in ROS_MODULES or top.endswith(("_msgs", "_srvs", "_interfaces"))


def _modules():
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        parts = list(rel.parts)
        is_init = parts[-1] == "__init__"
        if is_init:
            parts = parts[:-1]
        yield path, ".".join(parts), is_init


def _imports(path: Path, module: str, is_init: bool):
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    package = module if is_init else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield node.lineno, target
            if not node.module:  # from . import a, b: each name is a module
                for alias in node.names:
                    yield node.lineno, f"{target}.{alias.name}"


def _layer(module: str):
    parts = module.split(".")
    if parts[0] != "hybrid_vla_ros" or len(parts) < 2:
        return None, None
    if parts[1] in LAYER:
        return parts[1], LAYER[parts[1]]
    return parts[1], max(LAYER.values()) + 1  # __init__, __main__: the top


def test_every_module_sits_in_a_layer():
    loose = [m for _, m, _ in _modules() if m.count(".") == 1 and m.split(".")[1] not in LAYER
             and m not in ("hybrid_vla_ros.__main__",)]
    assert not loose, f"modules outside the layer sub-packages: {loose}"
    assert {m.split(".")[1] for _, m, _ in _modules() if m.count(".") >= 1} >= set(LAYER)


def test_imports_only_go_down():
    problems = []
    for path, module, is_init in _modules():
        own, level = _layer(module)
        if own is None:
            continue
        for line, target in _imports(path, module, is_init):
            t_own, t_level = _layer(target)
            if t_own is None or t_own == own:
                continue
            if t_level >= level:
                problems.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {own} (layer {level}) imports "
                                f"{target} (layer {t_level})")
    assert not problems, "imports that go up or sideways:\n" + "\n".join(problems)


def test_nothing_below_ros_imports_ros():
    problems = []
    for path, module, is_init in _modules():
        own, level = _layer(module)
        if own is None or level >= LAYER["ros"]:
            continue
        for line, target in _imports(path, module, is_init):
            if _is_ros(target.split(".")[0]):
                problems.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: imports {target}")
    assert not problems, "ROS imports below the ros layer:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("from ..split.planner import x\n", "hybrid_vla_ros.split.planner"),
    ("from . import node_base\n", "hybrid_vla_ros.ros.node_base"),
])
def test_relative_imports_are_resolved(tmp_path, source, expected):
    """The walker itself: relative imports resolve to the module they name (else the checks above see nothing)."""
    path = tmp_path / "m.py"
    path.write_text(source)
    assert expected in [t for _, t in _imports(path, "hybrid_vla_ros.ros.m", False)]
