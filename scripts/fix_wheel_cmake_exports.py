#!/usr/bin/env python3
"""Repoint foreign Python/numpy include paths baked into ROS 2 wheel CMake exports.

The ROS 2 Kilted message wheels on PyPI ship
``share/<pkg>/cmake/export_<pkg>__rosidl_generator_pyExport.cmake`` files whose
``INTERFACE_INCLUDE_DIRECTORIES`` name the wheel builder's interpreter (for example
``/opt/python/cp311-cp311/include/python3.11`` and its numpy include folder). CMake's
generate step fails on a path that does not exist, so building an interface package
against those wheels needs the paths rewritten to this interpreter's own folders.

Only paths that do not exist on this machine and that look like a Python or numpy
include folder are rewritten; everything else is left byte for byte. Running it twice
changes nothing the second time. Usage: ``fix_wheel_cmake_exports.py PREFIX`` where PREFIX
is the install prefix (the venv). Prints how many files it changed.
"""
from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path

import numpy

_PROPERTY = re.compile(r'(INTERFACE_INCLUDE_DIRECTORIES\s+")([^"]*)(")')
_PY_INCLUDE = re.compile(r"/include/python3\.\d+$")
_NUMPY_INCLUDE = re.compile(r"/numpy/(_core|core)/include$")


def _replacement(path: str) -> str:
    """Return the local equivalent of one include path, or the path itself."""
    if os.path.isdir(path):
        return path
    if _PY_INCLUDE.search(path):
        return sysconfig.get_paths()["include"]
    if _NUMPY_INCLUDE.search(path):
        return numpy.get_include()
    return path


def fix_file(path: Path) -> bool:
    """Rewrite the include directories of one export file; return True if it changed."""
    text = path.read_text()

    def sub(match: re.Match) -> str:
        dirs = [_replacement(d) for d in match.group(2).split(";")]
        return match.group(1) + ";".join(dirs) + match.group(3)

    fixed = _PROPERTY.sub(sub, text)
    if fixed != text:
        path.write_text(fixed)
        return True
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    share = Path(argv[1]) / "share"
    changed = sum(fix_file(p) for p in share.glob("*/cmake/*Export*.cmake"))
    print(f"fix_wheel_cmake_exports: {changed} file(s) repointed under {share}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
