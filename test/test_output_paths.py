"""Up-front checks of output paths (util.paths) and the subcommands that use them: a bad output path is a
one-line error with exit status 2 before any work starts."""
from pathlib import Path

import pytest

from hybrid_vla_ros.tools.cli import main
from hybrid_vla_ros.util.paths import output_dir_problem, output_file_problem


def test_output_file_problem(tmp_path):
    assert output_file_problem(tmp_path / "p.json") == ""
    assert "does not exist" in output_file_problem(tmp_path / "missing" / "p.json")
    assert output_file_problem(tmp_path / "missing" / "p.json", create_parents=True) == ""
    (tmp_path / "f").write_text("x")
    assert "is not a folder" in output_file_problem(tmp_path / "f" / "p.json")
    assert "is not a folder" in output_file_problem(tmp_path / "f" / "a" / "p.json", create_parents=True)
    assert "is a folder, not a file" in output_file_problem(tmp_path)
    assert output_file_problem("p.json") == ""  # a bare name: the current folder


def test_output_dir_problem(tmp_path):
    assert output_dir_problem(tmp_path) == ""
    assert output_dir_problem(tmp_path / "a" / "b") == ""
    (tmp_path / "f").write_text("x")
    assert "is not a folder" in output_dir_problem(tmp_path / "f")
    assert "is not a folder" in output_dir_problem(tmp_path / "f" / "plots")
    assert not (tmp_path / "a").exists(), "nothing is created"


@pytest.mark.parametrize("argv,needle", [
    (["profile", "--preset", "smol", "--quiet", "--out", "{tmp}/nodir/p.json"],
     "--out {tmp}/nodir/p.json: the folder"),
    (["plan", "--preset", "tiny", "--json", "{tmp}/nodir/p.json"], "--json {tmp}/nodir/p.json: the folder"),
    (["plan", "--preset", "tiny", "--plot", "{tmp}/nodir/p.png"], "--plot {tmp}/nodir/p.png: the folder"),
    (["bench", "--only", "handoff", "--json", "{tmp}/file/b.json"], "--json {tmp}/file/b.json:"),
    (["bench", "--only", "handoff", "--json", "{tmp}/b.json", "--markdown", "{tmp}/file/b.md"], "--markdown"),
    (["bench", "--only", "handoff", "--json", "{tmp}/b.json", "--plots", "{tmp}/file/plots"], "--plots"),
])
def test_a_bad_output_path_is_refused_before_any_work(tmp_path, capsys, argv, needle):
    (tmp_path / "file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert needle.replace("{tmp}", str(tmp_path)) in captured.err and captured.err.count("\n") == 1, captured.err
    assert captured.out == "", "nothing ran"
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["file"]
