"""Own model code (model_class in config.json): a toy team package (test/fixtures/toy_vla) split at every K.

The reference is the team's own ``forward`` on weights the test loads itself (``load_state_dict`` of the
safetensors shards), not this package's loader or stages.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.config import VLAConfig
from hybrid_vla_ros.model.extension import TRUST_ENV
from hybrid_vla_ros.model.sources import CheckpointError

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "test" / "fixtures"
CONFIG = dict(image_size=32, patch=8, width=48, heads=4, depth=5, n_waypoints=6)


def _toy_class():
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    from toy_vla import ToyVLA

    return ToyVLA


def _write(path: Path, spec: str = "toy_vla.model:ToyVLA", config: dict = CONFIG, seed: int = 0,
           cls=None) -> Path:
    """The team's state dict (``cls``, default ToyVLA) as 4 safetensors shards + a transformers-style index."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = (cls or _toy_class())(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorm gains / biases away from 1 / 0
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(model.state_dict())
    state = model.state_dict()
    weight_map = {}
    for i in range(4):
        shard = f"model-{i + 1:05d}-of-00004.safetensors"
        part = {n: state[n].contiguous() for n in names[i::4]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "hybrid_vla_code", "format_version": 1,
                                                  "model_class": spec, "config": config}))
    return path


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("own") / "toy")


def _reference_model(path: Path):
    from safetensors.torch import load_file

    model = _toy_class()(CONFIG)
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict(state, strict=True)
    return model.eval()


def _env():
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{FIXTURES}"}


def test_own_code_is_refused_without_the_opt_in_and_nothing_is_imported(toy_dir):
    script = (f"import sys\nfrom hybrid_vla_ros.model.checkpoint import open_checkpoint\n"
              f"try:\n    open_checkpoint({str(toy_dir)!r})\nexcept ValueError as e:\n    print('refused:', e)\n"
              "print('imported' if 'toy_vla' in sys.modules else 'not imported')\n")
    env = {k: v for k, v in _env().items() if k != TRUST_ENV}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert "refused:" in out.stdout and "--trust-model-code" in out.stdout and TRUST_ENV in out.stdout, out.stderr
    assert out.stdout.strip().endswith("not imported")
    with pytest.raises(ValueError, match="own model code"):
        VLAConfig.load(toy_dir)  # the nodes' first read: refused with what runs it


def test_split_equals_the_models_own_forward_at_every_k(toy_dir):
    ck = open_checkpoint(toy_dir, trust_model_code=True)
    assert ck.kind == "model_code" and ck.num_layers == CONFIG["depth"]
    assert len(list(toy_dir.glob("model-*.safetensors"))) > 3, "sharded through the index"
    reference = _reference_model(toy_dir)
    pixels = reference.example_inputs(3)[0]
    with torch.inference_mode():
        expected = reference(pixels)
        assert expected.shape == (CONFIG["n_waypoints"], 2)
        for k in range(ck.num_layers + 1):
            prefix, suffix = ck.load("prefix", k), ck.load("suffix", k)
            assert len(prefix.layers) == k and len(suffix.layers) == ck.num_layers - k
            assert not hasattr(prefix, "waypoints") and not hasattr(suffix, "patchify")
            h = prefix(pixels)
            assert tuple(h.shape) == ck.model.prefix_state_shape == (17, CONFIG["width"])
            assert (suffix(h) - expected).abs().max().item() <= 1e-5, f"split at {k}"


def test_plan_counts_the_weights_of_every_stage_exactly(toy_dir):
    from hybrid_vla_ros.split.planner import plan_for_checkpoint

    plan = plan_for_checkpoint(toy_dir, dtype="fp32", trust_model_code=True)
    ck = open_checkpoint(toy_dir, trust_model_code=True)
    assert len(plan.rows) == ck.num_layers + 1
    assert any("activations are not estimated" in n for n in plan.notes)
    for row in plan.rows:
        for role, want in (("prefix", row.gpu_weight_bytes), ("suffix", row.cpu_weight_bytes)):
            stage = ck.load(role, row.k)
            assert sum(t.numel() * t.element_size() for t in stage.state_dict().values()) == want, (role, row.k)
    total = sum(p.numel() * 4 for p in _reference_model(toy_dir).parameters())
    assert plan.rows[0].gpu_weight_bytes + plan.rows[0].cpu_weight_bytes == total


def test_live_resplit_moves_blocks_of_own_code(toy_dir):
    from hybrid_vla_ros.split.resplit import move_split

    ck = open_checkpoint(toy_dir, trust_model_code=True)
    pixels = _reference_model(toy_dir).example_inputs(1)[0]
    with torch.inference_mode():
        expected = _reference_model(toy_dir)(pixels)
        prefix, suffix = ck.load("prefix", 2), ck.load("suffix", 2)
        up = move_split(prefix, 4, torch.device("cpu"), ck.load_blocks(2, 4))
        assert (up.blocks_loaded, len(prefix.layers)) == (2, 4)
        assert (suffix(prefix(pixels), 4) - expected).abs().max().item() <= 1e-5, "suffix follows K=4"
        down = move_split(suffix, 1, torch.device("cpu"), ck.load_blocks(1, 2))
        move_split(prefix, 1, torch.device("cpu"))
        assert (down.blocks_loaded, len(suffix.layers)) == (1, 4)
        assert (suffix(prefix(pixels)) - expected).abs().max().item() <= 1e-5
        with pytest.raises(RuntimeError, match="were not loaded"):
            move_split(prefix, 3, torch.device("cpu"), ck.load_blocks(2, 4))


def test_cli_verify_split_and_plan_on_own_code(toy_dir, tmp_path):
    cli = [sys.executable, "-m", "hybrid_vla_ros.tools.cli"]
    out = subprocess.run(cli + ["verify-split", "--model", str(toy_dir), "--trust-model-code", "--quiet"],
                         capture_output=True, text=True, env=_env(), timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "toy_vla.model:ToyVLA.forward (the model's own)" in out.stdout and "OK: 6 of 6 split layers" in out.stdout
    refused = subprocess.run(cli + ["verify-split", "--model", str(toy_dir)], capture_output=True, text=True,
                             env={k: v for k, v in _env().items() if k != TRUST_ENV}, timeout=300, cwd=REPO)
    assert refused.returncode == 2 and "--trust-model-code" in refused.stderr and "Traceback" not in refused.stderr
    plan = subprocess.run(cli + ["plan", "--model", str(toy_dir), "--trust-model-code", "--dtype", "fp32",
                                 "--json", str(tmp_path / "plan.json")], capture_output=True, text=True, env=_env(),
                          timeout=300, cwd=REPO)
    assert plan.returncode == 0, plan.stderr
    assert len(json.loads((tmp_path / "plan.json").read_text())["rows"]) == CONFIG["depth"] + 1


def test_bad_model_class_entries_are_named(tmp_path):
    cases = {"no_colon": ("toy_vla.model.ToyVLA", "must be 'package.module:ClassName'"),
             "no_module": ("no_such_team_pkg:Model", "cannot import 'no_such_team_pkg'"),
             "not_protocol": ("torch.nn:Linear", "lacks front_modules, block_list, tail_modules")}
    _toy_class()
    for name, (spec, needle) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "hybrid_vla_code", "format_version": 1,
                                                   "model_class": spec, "config": CONFIG}))
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(d, trust_model_code=True)
        assert needle in str(e.value) and str(d / "config.json") in str(e.value), str(e.value)


# ------------------------------------------------------------------------------- own code on the nodes

DRIVE = dict(cameras=6, image_size=32, patch=16, width=32, heads=2, depth=4, n_waypoints=6, n_modes=6)


def test_own_code_with_driving_io_runs_through_the_real_nodes(tmp_path, frames, embedded_bag):
    """ToyDrive (a team's own model with a ``driving`` dict: 6 cameras, 6 modes) on the nodes: `hybrid-vla
    replay` with the opt-in in the environment and the team's package on PYTHONPATH, K moved 1 -> 3 live; every
    trajectory equals the team's own monolithic forward on the same preprocessed cameras (its LANE_FOLLOW mode).
    Without the opt-in the prefix refuses at configure, naming it."""
    from safetensors.torch import load_file

    from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess
    from replay_check import assert_trajectory_matches, published_and_odometry, stamp_ns

    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    from toy_vla.drive import ToyDrive

    path = _write(tmp_path / "drive", "toy_vla.drive:ToyDrive", DRIVE, cls=ToyDrive)
    model = ToyDrive(DRIVE)
    state = {}
    for shard in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    model.load_state_dict(state, strict=True)
    model.eval()
    out = tmp_path / "replay"
    cmd = [sys.executable, "-m", "hybrid_vla_ros.tools.cli", "replay", "--model-path", str(path), "--bag",
           str(embedded_bag), "--loops", "1", "--split-layer", "1", "--resplit", "1:3", "--output", str(out),
           "--quiet", "--namespace", f"/oc_{os.getpid()}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO,
                         env={**_env(), "HYBRID_VLA_TRUST_MODEL_CODE": "1"})
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}, \
        f"{json.dumps(report, indent=1)}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs[-6000:]}"
    assert "re-split K 1 -> 3" in logs and "own model code toy_vla.drive:ToyDrive" in logs
    published, odometry = published_and_odometry(out, embedded_bag)
    assert len(published) == 3
    by_stamp = dict(frames)
    io = model.driving
    for traj in published:
        pixels = preprocess([compressed_msg_to_rgb(m) for _, m in by_stamp[stamp_ns(traj)]], io["image_size"],
                            io["image_mean"], io["image_std"])
        with torch.inference_mode():
            waypoints = model(pixels)[3].double().numpy()  # LANE_FOLLOW, the suffix node's default command
        assert_trajectory_matches(traj, waypoints, io["waypoint_dt_s"], odometry)
    refused = subprocess.run(cmd[:-1] + [f"/oc_{os.getpid()}_b"], capture_output=True, text=True, timeout=400,
                             cwd=REPO, env={k: v for k, v in _env().items() if k != "HYBRID_VLA_TRUST_MODEL_CODE"})
    assert refused.returncode != 0
    assert "HYBRID_VLA_TRUST_MODEL_CODE" in refused.stdout + refused.stderr
