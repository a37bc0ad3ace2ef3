#!/usr/bin/env python3
"""Render the README's parameter tables from the node schemas (schema/<node>.schema.json).

README.md holds one table per node between the marker comments
``<!-- params:<node>:start ... -->`` and ``<!-- params:<node>:end -->``; this script rewrites what
lies between them (Name | Type | Default | Description, the valid values appended to the
description). Edit the schema, never the table, then run it.

Usage: .venv/bin/python scripts/generate_param_tables.py [--check] [--readme README.md]
  --check  change nothing; exit 1 when the README's tables differ from the schemas (for CI / tests)
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hybrid_vla_ros.ros import params  # noqa: E402  (after the path set-up above)


def _cell(text: str) -> str:
    """Table-safe text: a '|' would end the cell, even inside a code span."""
    return text.replace("|", "\\|")


def _literal(value) -> str:
    """A default as written in a params file, in a code span: `auto`, `""`, `50.0`, `true`, `[raw]`, `[]`."""
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"  # YAML's spelling, not Python's
    if isinstance(value, list):
        return "`[" + ", ".join(str(v) if v != "" else '""' for v in value) + "]`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def table(node: str) -> str:
    """The Markdown parameter table of one node."""
    rows = ["| Name | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name, spec in params.parameter_specs(node).items():
        default = _literal(spec["default"]) if "default" in spec else "(none)"
        description = " ".join(x for x in (spec.get("description", ""), params.constraint_text(spec, "`")) if x)
        rows.append(f"| `{name}` | {params.ros_type(spec)} | {_cell(default)} | {_cell(description)} |")
    return "\n".join(rows)


def _block(node: str) -> str:
    return (f"<!-- params:{node}:start (generated from schema/{node}.schema.json by "
            f"scripts/generate_param_tables.py: edit the schema, not this table) -->\n\n"
            f"{table(node)}\n\n<!-- params:{node}:end -->")


def render(readme: str) -> str:
    """``readme`` with every node's table regenerated. Raises ValueError when a node's markers are missing."""
    for node in params.NODES:
        pattern = re.compile(rf"<!-- params:{node}:start\b.*?-->.*?<!-- params:{node}:end -->", re.DOTALL)
        if len(pattern.findall(readme)) != 1:
            raise ValueError(f"the README needs exactly one <!-- params:{node}:start --> ... "
                             f"<!-- params:{node}:end --> pair")
        readme = pattern.sub(lambda _: _block(node), readme)
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is not current; write nothing")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md", help="default: the repository's README.md")
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    try:
        new = render(text)
    except ValueError as e:
        print(f"{args.readme}: {e}", file=sys.stderr)
        return 2
    if new == text:
        return 0
    if args.check:
        print(f"{args.readme}: the parameter tables differ from schema/*.schema.json; "
              f"run scripts/generate_param_tables.py", file=sys.stderr)
        return 1
    args.readme.write_text(new)
    print(f"{args.readme}: parameter tables rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
