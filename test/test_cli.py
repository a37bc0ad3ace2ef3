"""`hybrid-vla` command line: init-model and the replay's up-front argument checks (no ROS graph needed)."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_vla_ros.tools.cli import build_parser

REPO = Path(__file__).resolve().parent.parent


def _run(*argv, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_init_model_writes_a_random_init_checkpoint_and_refuses_to_overwrite(tmp_path):
    out = _run("init-model", "--preset", "tiny", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    assert "RANDOM-INIT" in out.stdout and "not driving advice" in out.stdout
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["random_init"] is True and cfg["preset"] == "tiny"
    again = _run("init-model", "--preset", "tiny", str(tmp_path / "m"))
    assert again.returncode == 1 and "already holds a checkpoint" in again.stderr


@pytest.mark.parametrize("extra,needle", [
    (["--rate", "0"], "--rate must be > 0"),
    (["--rate", "-2"], "--rate must be > 0"),
    (["--loops", "0"], "--loops must be >= 1"),
    (["--suffix-cores", "4096"], "--suffix-cores '4096'"),
    (["--suffix-cores", "a,b"], "not a comma-separated list"),
    (["--namespace", "bad name"], "is not a ROS namespace"),
    (["--sync-tolerance-ms", "0"], "--sync-tolerance-ms must be > 0"),
    (["--attach-wait", "-1"], "--attach-wait must be >= 0"),
    (["--dtype", "fp8"], "--dtype must be one of fp32, bf16, fp16"),
    (["--prefix-threads", "-1"], "--prefix-threads must be >= 0"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--attach", "--suffix-backend", "openvino"], "attached nodes keep their own"),
    (["--attach", "--decode-step", "inductor"], "set decode_step on them"),
    (["--decode-step", "compiled"], "invalid choice: 'compiled'"),
    (["--camera-topics", "/a/image", "--camera-topic-suffix", "image_rect_color"], "not both"),
    (["--camera-topics", "a/image,,/b"], "give absolute topics"),
])
def test_replay_rejects_bad_arguments_before_starting_anything(tiny_checkpoint, tmp_path, extra, needle):
    out = _run("replay", "--model-path", str(tiny_checkpoint), "--output", str(tmp_path / "o"), *extra)
    assert out.returncode == 2, out.stdout + out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "o").exists(), "nothing is started or written for bad arguments"


@pytest.mark.parametrize("make_args,needle", [
    (lambda ck, tmp: ["--model-path", str(REPO / "README.md")], "cannot read the checkpoint config"),
    (lambda ck, tmp: ["--model-path", str(tmp / "missing")], "cannot read the checkpoint config"),
    (lambda ck, tmp: ["--model-path", str(ck), "--bag", str(tmp / "nobag")], "cannot use the bag"),
    (lambda ck, tmp: ["--model-path", str(ck), "--transport", "raw"], "the bag has 1 raw cameras, the model takes 6"),
    (lambda ck, tmp: ["--model-path", str(ck), "--output", "/proc/forbidden/out"], "cannot create the output folder"),
])
def test_replay_reports_unusable_inputs_clearly(tiny_checkpoint, tmp_path, make_args, needle):
    out = _run("replay", "--output", str(tmp_path / "o"), *make_args(tiny_checkpoint, tmp_path))
    assert out.returncode == 1 and needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


SUBCOMMANDS = ("init-model", "convert", "verify-split", "compile-suffix", "export-smollm2", "replay", "evaluate",
               "plan", "profile", "bench", "gpu-check")


def test_parser_help_lists_subcommands():
    parser = build_parser()
    text = parser.format_help()
    description = text.split("\n\n")[1]
    assert "``" not in description
    assert all(f"  {name} " in description for name in SUBCOMMANDS), description
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) == set(SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_help_has_a_plain_description(name):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    assert sub.description and len(sub.description.split()) >= 8 and "``" not in sub.description
    assert " ".join(sub.description.split()[:4]) in " ".join(sub.format_help().split())


def test_top_level_help_from_the_command_line():
    out = _run("--help")
    assert out.returncode == 0 and all(name in out.stdout for name in SUBCOMMANDS)


def test_verify_split_on_this_packages_own_format_and_its_errors(tiny_checkpoint, tmp_path):
    """verify-split on an own-format checkpoint: transformers' LlamaModel with the checkpoint's LLM tensors is
    the reference; bad arguments exit with a message and no traceback (2 for a checkpoint it cannot read)."""
    out = _run("verify-split", "--model", str(tiny_checkpoint), "--quiet", "--json", str(tmp_path / "v.json"),
               timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "transformers LlamaModel with the checkpoint's LLM tensors on h_0" in out.stdout
    assert "OK: 5 of 5 split layers within the allowed difference" in out.stdout
    assert "bit-exact against the same code unsplit" in out.stdout
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"] is True and [r["k"] for r in report["rows"]] == [0, 1, 2, 3, 4]
    assert all(r["output"] is not None and r["output"] <= r["allowed_output"] for r in report["rows"])
    assert all(r["unsplit"] == 0.0 for r in report["rows"]) and report["worst_fraction"] <= 1.0
    # a checkpoint that cannot be read exits 2 (as a bad argument does), another error 1
    for argv, needle, code in ((["--model", str(tmp_path / "none")], "no checkpoint at", 2),
                               (["--model", str(tiny_checkpoint), "--layers", "2,9"],
                                "split layers [9] outside [0, 4]", 1),
                               (["--model", str(REPO / "README.md")], "is a file; a checkpoint is a directory", 2)):
        bad = _run("verify-split", *argv)
        assert bad.returncode == code and needle in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_verify_split_progress_goes_to_stderr_and_the_table_once_to_stdout(tiny_checkpoint):
    out = _run("verify-split", "--model", str(tiny_checkpoint), "--layers", "0,4", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reference forward" in out.stderr and "reference forward" not in out.stdout
    progress = [line for line in out.stderr.splitlines() if line.lstrip()[:1].isdigit()]
    assert len(progress) == 2, out.stderr
    assert all(out.stdout.splitlines().count(line) == 1 for line in progress), out.stdout
    assert "OK: 2 of 2 split layers within the allowed difference" in out.stdout


@pytest.mark.parametrize("value,needle", [("-1", "give at least one split layer K, each >= 0"),
                                          ("a,b", "not a comma-separated list of split layers")])
def test_verify_split_layers_errors_talk_about_split_layers(value, needle):
    out = _run("verify-split", "--model", "x", f"--layers={value}")
    assert out.returncode == 2 and needle in out.stderr and "token id" not in out.stderr, out.stderr


def test_init_model_on_an_llm_notes_the_size_and_the_random_stand_ins(tmp_path):
    from hf_builders import write_llama

    llama = write_llama(tmp_path / "llama")
    out = _run("init-model", "--preset", "tiny", "--llm", str(llama), str(tmp_path / "c"))
    assert out.returncode == 0, out.stderr
    note = [line for line in out.stdout.splitlines() if line.startswith("note: ")]
    assert len(note) == 1, out.stdout
    size = sum(f.stat().st_size for f in (tmp_path / "c").rglob("*") if f.is_file()) / 1e9
    assert f"{size:.3g} GB written to {tmp_path / 'c'}" in note[0]
    assert "vision side and projector are random-init stand-ins sized for the 'tiny' preset" in note[0]


@pytest.mark.parametrize("extra,needle", [([], "dtype fp16 (plan's default, the GPU dtype;"),
                                          (["--dtype", "fp32"], "dtype fp32 (plan defaults to fp16, the GPU dtype)")])
def test_plan_first_line_states_the_dtype_and_its_default(capsys, extra, needle):
    from hybrid_vla_ros.tools.cli import main

    assert main(["plan", "--preset", "tiny", *extra]) == 0
    assert needle in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize("command", ["plan", "profile", "verify-split", "replay", "compile-suffix"])
@pytest.mark.parametrize("spelling", ["--model", "--model-path"])
def test_every_subcommand_takes_the_checkpoint_as_model_or_model_path(command, spelling):
    """The nodes' parameter is model_path and the tools said --model: each command takes both spellings."""
    from hybrid_vla_ros.tools.cli import build_parser

    required = {"profile": ["--out", "p.json"], "compile-suffix": ["--split-layers", "1"]}.get(command, [])
    args = build_parser().parse_args([command, spelling, "/ckpt", *required])
    assert (args.model_path if command == "replay" else args.model) == "/ckpt"


@pytest.mark.parametrize("text,ks", [("8-10", [8, 9, 10]), ("3,8-9", [3, 8, 9]), ("5", [5]), ("3,14-8", None),
                                     ("a-b", None), ("-2", None)])
def test_compile_suffix_takes_split_layers_and_ranges(text, ks):
    """``--split-layers``: K values and A-B ranges, both ends included; a reversed range is refused, not dropped."""
    from hybrid_vla_ros.tools.cli import build_parser

    argv = ["compile-suffix", "--model", "/m", "--split-layers", text]
    if ks is None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    else:
        assert build_parser().parse_args(argv).split_layers == ks


def test_camera_topics_named_one_by_one_must_be_in_the_bag_with_the_transports_type():
    """A camera stack records raw Image and CompressedImage side by side, sometimes under one name: a topic named
    with ``--camera-topics`` must carry the transport's type, and the message lists what the bag has."""
    from hybrid_vla_ros.util.bags import BagMessage, camera_topics

    bag = [BagMessage("/front/image", "sensor_msgs/msg/Image", 0, b""),
           BagMessage("/front/image/compressed", "sensor_msgs/msg/CompressedImage", 0, b""),
           BagMessage("/rear/image/compressed", "sensor_msgs/msg/Image", 0, b"")]  # compressed name, raw type
    assert camera_topics(bag, "compressed", topics=["/front/image"]) == ["/front/image"]
    assert camera_topics(bag, "raw", topics=["/front/image/compressed"]) == ["/front/image"]  # suffix dropped
    with pytest.raises(ValueError, match=r"/rear/image/compressed: not in the bag as sensor_msgs/msg/CompressedImage"
                                         r" \(the bag's compressed image topics: /front/image/compressed\)"):
        camera_topics(bag, "compressed", topics=["/front/image", "/rear/image"])
    with pytest.raises(ValueError, match="named twice"):
        camera_topics(bag, "compressed", topics=["/front/image", "/front/image/compressed"])
    with pytest.raises(ValueError, match="no raw camera topics like /sensing/camera/camera0/image_rect_color"):
        camera_topics(bag, "raw", suffix="image_rect_color")
