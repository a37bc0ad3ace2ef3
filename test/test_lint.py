"""The lint runs in `make test`: ruff (pinned in requirements.txt) with the repository's ruff.toml over every
Python file of the repository (the package, tests, scripts, launch files), and the config itself is checked to
catch what it claims to (a long line, a blind ``except``, a ``noqa`` that suppresses nothing)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "ruff.toml"


def _ruff() -> str:
    """The venv's ruff (next to this interpreter), else one on PATH; fails (not skips) when there is none: the
    bootstrap installs it."""
    here = Path(sys.executable).with_name("ruff")
    found = str(here) if here.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed (requirements.txt pins it; run `make venv`)")
    return found


def _check(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([_ruff(), "check", "--no-cache", "--config", str(CONFIG), "--output-format", "concise",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_repository_is_lint_clean():
    out = _check(".")
    assert out.returncode == 0, f"ruff finds:\n{out.stdout}{out.stderr}"


def test_the_config_is_the_one_the_code_claims():
    """Line length 119 and every rule family a ``noqa`` comment in the code names is selected (so no ``noqa`` is
    decoration: RUF100 reports one that suppresses nothing)."""
    cfg = tomllib.loads(CONFIG.read_text())
    assert cfg["line-length"] == 119
    selected = set(cfg["lint"]["select"]) | set(cfg["lint"].get("extend-select", ()))
    assert {"E", "F", "W", "BLE", "RUF100"} <= selected


@pytest.mark.parametrize("source, code", [
    ("x = 1  # " + "a" * 120 + "\n", "E501"),
    ("try:\n    pass\nexcept Exception:\n    pass\n", "BLE001"),
    ("import os  # noqa: E731\n\nprint(os.sep)\n", "RUF100"),
    ("def f():\n    return undefined_name\n", "F821"),
])
def test_the_config_catches_what_it_claims(tmp_path, source, code):
    """A planted fault in a file of its own, checked with the repository's config: the lint would fail on it."""
    (tmp_path / "planted.py").write_text(source)
    out = _check("planted.py", cwd=tmp_path)
    assert out.returncode == 1 and code in out.stdout, out.stdout + out.stderr
