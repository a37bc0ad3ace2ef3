"""The README's shell blocks work as written.

Every ```sh block of README.md runs in bash from the repository root, as a new user pastes it after
``make demo`` (whose checkpoint ``out/models/smol`` the blocks may use; when it is missing the test
writes the same checkpoint with ``hybrid-vla init-model --preset smol`` and runs the block in a folder
that holds it and a link to this ``.venv``). A block the test cannot run is marked just above it with
``<!-- readme-test: not run: REASON -->``; the reason must name what covers it instead, and the launch
command's arguments are still checked against the launch file's own declarations.
"""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BLOCK = re.compile(r"(?:<!-- readme-test: not run: (?P<reason>.*?) -->\n)?```sh\n(?P<body>.*?)```", re.S)


def _blocks() -> list[tuple[str | None, str]]:
    """(reason it is not run or None, body) of every ```sh block of the README, in order."""
    return [(m["reason"], m["body"]) for m in BLOCK.finditer(README.read_text())]


def _run_ids():
    return [f"block{i}" for i, (reason, _) in enumerate(_blocks()) if reason is None]


def test_the_readme_has_shell_blocks_and_says_why_any_is_not_run():
    blocks = _blocks()
    assert len(blocks) >= 3
    assert any(reason is None for reason, _ in blocks), "no README shell block is run by this test"
    for reason, body in blocks:
        if reason is not None:
            assert "test" in reason or "CI" in reason, f"a block is not run without naming what covers it: {reason}"


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    """The repository root when ``make demo`` has written its checkpoint, else a folder with the same
    checkpoint written by ``init-model --preset smol`` and a link to this repository's ``.venv``."""
    if (REPO / "out" / "models" / "smol" / "config.json").is_file():
        return REPO
    root = tmp_path_factory.mktemp("readme")
    (root / ".venv").symlink_to(REPO / ".venv")
    subprocess.run([sys.executable, "-m", "hybrid_vla_ros", "init-model", "--preset", "smol",
                    str(root / "out" / "models" / "smol")], check=True, capture_output=True, timeout=300)
    return root


@pytest.mark.parametrize("index", [int(i[5:]) for i in _run_ids()], ids=_run_ids())
def test_a_readme_shell_block_runs_as_written(index, demo_folder):
    if not (REPO / ".venv" / "bin" / "hybrid-vla").is_file():
        pytest.fail("the bootstrap did not install the hybrid-vla command into .venv (scripts/bootstrap_venv.sh)")
    _, body = _blocks()[index]
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", body], cwd=demo_folder, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"README block {index} failed ({done.returncode}):\n{body}\n{done.stdout[-3000:]}" \
                                 f"\n{done.stderr[-3000:]}"


def _declared_launch_arguments() -> set[str]:
    """The names of the launch file's DeclareLaunchArgument actions, read from the real launch description."""
    import importlib.util

    from launch.actions import DeclareLaunchArgument

    spec = importlib.util.spec_from_file_location("hybrid_vla_launch", REPO / "launch" / "hybrid_vla.launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {e.name for e in module.generate_launch_description().entities if isinstance(e, DeclareLaunchArgument)}


def test_the_readme_launch_command_uses_declared_launch_arguments(ros_tools_available):
    lines = [line for _, b in _blocks() for line in b.replace("\\\n", " ").splitlines()]
    commands = [line for line in lines if line.startswith("ros2 launch ")]
    assert commands, "the README shows no ros2 launch command"
    declared = _declared_launch_arguments()
    for body in commands:
        words = shlex.split(body, comments=True)
        args = [w.split(":=", 1)[0] for w in words if ":=" in w]
        assert args, body
        unknown = sorted(set(args) - declared)
        assert not unknown, f"the README's ros2 launch passes {unknown}, which the launch file does not declare"


def test_the_readme_stays_a_front_page():
    """At most 300 lines: the details live in docs/ (the changelog in docs/changelog.md), linked from it."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move details into docs/"
    assert "docs/changelog.md" in README.read_text()
