"""Composed checkpoints (this package's vision side / planning head + a transformers LLM or LLaVA directory)
through the real ring between processes and the real node processes, checked against transformers' own forward.

Reference: the referred directory loaded by transformers' ``from_pretrained``, run on the same inputs
(``inputs_embeds`` = this package's own vision side's h_0 for an LLM directory; the whole
``LlavaForConditionalGeneration`` on the camera frame for a LLaVA directory); the planning head (this
package's own tensor) applied to its final hidden state.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from hf_builders import write_llama, write_llava
from hybrid_vla_ros.model.checkpoint import model_id, open_checkpoint
from hybrid_vla_ros.model.sources import CheckpointError, MissingFileError
from hybrid_vla_ros.transport.ring import RingConsumer, segment_name
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess

REPO = Path(__file__).resolve().parent.parent
TOL = 1e-5


def _cli(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("composed") / "llama")


@pytest.fixture(scope="module")
def composed(llama_dir, tmp_path_factory):
    """`hybrid-vla init-model --preset tiny --llm DIR OUT` as a user runs it."""
    out = tmp_path_factory.mktemp("composed") / "tiny_on_llama"
    made = _cli("init-model", "--preset", "tiny", "--llm", str(llama_dir), str(out))
    assert made.returncode == 0, made.stderr
    assert "composed 'tiny' checkpoint" in made.stdout and "not copied" in made.stdout
    return out


def _pixels(cfg, items):
    return preprocess([compressed_msg_to_rgb(m) for _, m in items], cfg.image_size, cfg.image_mean, cfg.image_std)


def _llm_reference(llama_dir, composed, pixels):
    """transformers' LlamaForCausalLM of the referred directory on h_0 (this package's vision side, K = 0):
    its hidden_states (L + 1, batch dim dropped) and the planning head's modes on its final state."""
    from transformers import LlamaForCausalLM

    ck = open_checkpoint(composed)
    with torch.inference_mode():
        h0 = ck.load("prefix", 0)(pixels)
        ref = LlamaForCausalLM.from_pretrained(str(llama_dir)).eval()
        states = [h[0] for h in ref.model(inputs_embeds=h0[None], output_hidden_states=True).hidden_states]
        modes = ck.load("suffix", ck.num_layers).head(states[-1][-1])
    return states, modes


def test_a_composed_checkpoint_refers_to_the_llm_and_holds_only_its_own_tensors(llama_dir, composed, tmp_path):
    from safetensors import safe_open

    cfg = json.loads((composed / "config.json").read_text())
    assert cfg["llm_path"] == str(llama_dir.resolve()) and cfg["llm"]["num_hidden_layers"] == 3
    with safe_open(str(composed / "model.safetensors"), framework="pt") as f:
        tops = {k.split(".")[0] for k in f.keys()}
    assert tops == {"vision", "projector", "head"}, "no LLM tensor copied"
    ck = open_checkpoint(composed)
    assert ck.kind == "composed" and ck.cfg is not None and ck.num_layers == 3
    # the model id covers the referred directory: its config.json and its shards' headers
    llm2, comp2 = shutil.copytree(llama_dir, tmp_path / "llama"), shutil.copytree(composed, tmp_path / "comp")
    doc = json.loads((comp2 / "config.json").read_text())
    doc["llm_path"] = str(llm2)
    (comp2 / "config.json").write_text(json.dumps(doc))
    before = model_id(comp2)
    original = (llm2 / "config.json").read_bytes()
    hf_cfg = json.loads(original)
    (llm2 / "config.json").write_text(json.dumps({**hf_cfg, "note": "edited"}))
    assert model_id(comp2) != before
    from safetensors.torch import load_file, save_file

    (llm2 / "config.json").write_bytes(original)
    assert model_id(comp2) == before
    shard = sorted(llm2.glob("model-*.safetensors"))[0]
    save_file(load_file(str(shard)), str(shard), metadata={"format": "pt", "edited": "1"})
    assert model_id(comp2) != before
    # the referred directory changed architecture, or went away: clear errors naming both files
    (llm2 / "config.json").write_text(json.dumps({**hf_cfg, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError, match="differs from .*config.json in num_hidden_layers"):
        open_checkpoint(comp2)
    shutil.rmtree(llm2)
    with pytest.raises(MissingFileError, match=f"refers to {llm2}"):
        open_checkpoint(comp2)


def test_hidden_states_cross_the_real_ring_between_processes_equal_transformers(llama_dir, composed, frames):
    """A prefix process (PrefixRunner) publishes one frame at every K into the shared-memory ring; this process
    reads each slot (the zero-copy view another process wrote) and compares h_K with transformers'
    hidden_states[K], then runs the suffix on the view: final planning-token state and waypoints."""
    ns = f"/cr_{uuid.uuid4().hex[:6]}"
    stamp, items = frames[0]
    script = f"""
import sys
from rosbags.typesys import Stores, get_typestore
from hybrid_vla_ros.runtime.prefix import PrefixRunner
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings
from hybrid_vla_ros.util.bags import read_bag
store = get_typestore(Stores.ROS2_KILTED)
first = {{}}
for m in read_bag({str(REPO / 'data' / 'dgp_scene02_6cam_mcap')!r}):
    if m.topic.endswith('/image_raw/compressed'):
        msg = store.deserialize_cdr(m.raw, m.msgtype)
        if msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec == {stamp}:
            first[m.topic] = msg
items = [('compressed', first[t]) for t in sorted(first)]
runner = PrefixRunner({str(composed)!r}, PrefixRunnerSettings(0, device='cpu', namespace={ns!r}, ring_slots=8))
for k in range(runner.cfg.num_layers + 1):
    runner.request_split_layer(k)
    runner.apply_split_request(timeout=None)
    runner.run(items, {stamp} + k)
print('published', flush=True)
sys.stdin.readline()
runner.close()
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        assert line.strip() == "published", proc.stderr.read()
        ck = open_checkpoint(composed)
        states, modes = _llm_reference(llama_dir, composed, _pixels(ck.cfg, items))
        L = ck.num_layers
        seen = []
        with RingConsumer(segment_name("prefix_states", ns), expected_model_id=model_id(composed)) as ring:
            for _ in range(L + 1):
                slot = ring.read(10.0)
                assert slot is not None
                with slot, torch.inference_mode():
                    k = slot.meta.split_layer
                    h = slot.tensor
                    if k < L:
                        assert (h - states[k]).abs().max().item() <= TOL, f"h_{k} through the ring"
                    suffix = ck.load("suffix", k)
                    final = suffix.final_hidden_states(h)
                    assert (final[-1] - states[L][-1]).abs().max().item() <= TOL, f"final at K={k}"
                    assert (suffix.plan_all(h).modes - modes).abs().max().item() <= TOL, f"waypoints at K={k}"
                    seen.append(k)
        assert seen == list(range(L + 1))
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0, proc.stderr.read()


def _stamp(msg) -> int:
    return msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec


def test_the_nodes_run_a_composed_checkpoint_end_to_end_with_a_live_resplit(llama_dir, composed, frames,
                                                                          embedded_bag, tmp_path):
    """`hybrid-vla replay` starts prefix_node and suffix_node on the composed checkpoint (model_path), moves K
    1 -> 3 live after the first frame; every trajectory equals the one from transformers' forward."""
    from hybrid_vla_ros.tools.output_bag import typestore
    from hybrid_vla_ros.vehicle.odometry import OdometryBuffer
    from hybrid_vla_ros.vehicle.trajectory import ego_state_from_odometry, waypoints_to_trajectory

    out = tmp_path / "replay"
    run = _cli("replay", "--model-path", str(composed), "--bag", str(embedded_bag), "--loops", "1", "--split-layer",
               "1", "--resplit", "1:3", "--namespace", f"/cp_{uuid.uuid4().hex[:8]}", "--output", str(out), "--quiet",
               timeout=400)
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}
    assert "re-split K 1 -> 3" in logs
    store = typestore()
    odometry = OdometryBuffer()
    for m in read_bag(embedded_bag):
        if m.topic == "/localization/kinematic_state":
            odometry.add(ego_state_from_odometry(store.deserialize_cdr(m.raw, m.msgtype)))
    from rosbags.highlevel import AnyReader

    with AnyReader([out / "trajectories"], default_typestore=store) as reader:
        conns = [c for c in reader.connections if c.msgtype == "autoware_planning_msgs/msg/Trajectory"
                 and c.topic != "/ground_truth/trajectory"]  # the published ones, not the logged drive
        published = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages(connections=conns)]
    assert len(published) == 3
    cfg = open_checkpoint(composed).cfg
    by_stamp = dict(frames)
    for traj in published:
        stamp = _stamp(traj)
        _, modes = _llm_reference(llama_dir, composed, _pixels(cfg, by_stamp[stamp]))
        waypoints = modes[3].double().numpy()  # LANE_FOLLOW, the suffix node's default command
        ego, _ = odometry.pose_at(stamp, int(1e9))
        expected = waypoints_to_trajectory(waypoints, cfg.waypoint_dt_s, ego, 2.79)
        got = np.array([[p.pose.position.x, p.pose.position.y] for p in traj.points])
        assert np.abs(got - np.stack([expected.x, expected.y], axis=1)).max() <= 1e-4
        assert all(math.isfinite(p.longitudinal_velocity_mps) for p in traj.points)


def test_the_nodes_refuse_a_model_without_a_planning_head_at_configure(llama_dir, tmp_path):
    import rclpy

    from hybrid_vla_ros.ros.lifecycle_client import LifecycleClient
    from hybrid_vla_ros.tools.replay import launch_node, stop_processes

    llava = write_llava(tmp_path / "llava")
    ns = f"/nh_{uuid.uuid4().hex[:8]}"
    params = {f"{ns}/suffix_node": {"ros__parameters": {"model_path": str(llama_dir), "split_layer": 1}},
              f"{ns}/prefix_node": {"ros__parameters": {"model_path": str(llava), "split_layer": 1, "device": "cpu"}}}
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    procs = [launch_node("suffix_node", ns, params_file, [], tmp_path / "suffix.log"),
             launch_node("prefix_node", ns, params_file, [], tmp_path / "prefix.log")]
    import threading

    from rclpy.executors import SingleThreadedExecutor

    rclpy.init()
    node = rclpy.create_node(f"tester_{uuid.uuid4().hex[:6]}")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    threading.Thread(target=executor.spin, daemon=True).start()
    try:
        for name, needle in (("suffix_node", "--llm"), ("prefix_node", "--vlm")):
            client = LifecycleClient(node, f"{ns}/{name}")
            assert client.wait_for_services(60, procs), (tmp_path / f"{name.split('_')[0]}.log").read_text()
            ok, _ = client.change_state("configure", 60)
            assert not ok and client.get_state() == "unconfigured"
            log = (tmp_path / f"{name.split('_')[0]}.log").read_text()
            deadline = time.monotonic() + 10
            while "configure failed" not in log and time.monotonic() < deadline:
                time.sleep(0.1)
                log = (tmp_path / f"{name.split('_')[0]}.log").read_text()
            assert "configure failed" in log and "without a planning head" in log and needle in log, log
        assert all(p.poll() is None for p in procs), "a refused configure does not end the process"
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
        assert stop_processes(procs) == [0, 0]


def test_a_trained_head_attached_to_a_llava_drives_the_runners_exactly(tmp_path, frames):
    """`init-model --vlm DIR --head HEAD.safetensors OUT`: the LLaVA stays where it is, the trained head is in
    OUT; prefix and suffix runners (through the ring) give transformers' LLaVA + that head, at every K."""
    from safetensors.torch import save_file
    from transformers import LlavaForConditionalGeneration

    from hybrid_vla_ros.model.modeling import llava_input_ids
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    llava = write_llava(tmp_path / "llava")
    draft = tmp_path / "draft"
    assert _cli("init-model", "--preset", "tiny", "--vlm", str(llava), str(draft)).returncode == 0
    from safetensors.torch import load_file

    head = {k: v * 3.0 + 0.01 for k, v in load_file(str(draft / "model.safetensors")).items()}  # "trained"
    save_file(head, str(tmp_path / "head.safetensors"))
    out = tmp_path / "tiny_on_llava"
    made = _cli("init-model", "--preset", "tiny", "--vlm", str(llava), "--head", str(tmp_path / "head.safetensors"),
                str(out))
    assert made.returncode == 0 and "trained tensors from" in made.stdout, made.stderr
    assert json.loads((out / "config.json").read_text())["random_init"] is False
    stored = load_file(str(out / "model.safetensors"))
    assert set(stored) == set(head) and all(torch.equal(stored[k], head[k]) for k in head)
    bad = _cli("init-model", "--preset", "tiny", "--vlm", str(llava), "--head", str(llava / "config.json"),
               str(tmp_path / "x"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr  # a file it cannot read: exit 2

    ck = open_checkpoint(out)
    cfg = ck.cfg
    assert cfg.n_cameras == 6 and cfg.num_tokens == 6 * 16 + 1
    stamp, items = frames[0]
    pixels = _pixels(cfg, items)
    with torch.inference_mode():
        ref = LlavaForConditionalGeneration.from_pretrained(str(llava)).eval()
        final = ref(input_ids=torch.tensor([llava_input_ids(cfg)]), pixel_values=pixels,
                    output_hidden_states=True).hidden_states[-1][0, -1]
        expected = ck.load("suffix", ck.num_layers).head(final)[3].double().numpy()
    ns = f"/hd_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(out), PrefixRunnerSettings(0, device="cpu", namespace=ns, ring_slots=8))
    suffix = SuffixRunner(str(out), SuffixRunnerSettings(0, namespace=ns))
    try:
        assert suffix.poll(0.05) is None  # attach
        for k in range(ck.num_layers + 1):
            suffix.request_split_layer(k)
            prefix.request_split_layer(k)
            prefix.apply_split_request(timeout=None)
            published = prefix.run(items, stamp + k)
            result = suffix.poll(10.0)
            assert result.meta.seq == published.seq and result.meta.split_layer == k
            assert np.abs(result.waypoints - expected).max() <= TOL, f"K={k}"
    finally:
        suffix.close()
        prefix.close()


def test_a_two_pass_ego_composition_on_qwen2_verifies_against_transformers(tmp_path):
    """MindDrive's shape of composition (two LLM passes as a batch of 2, an ego token) on a Qwen2 directory:
    transformers' Qwen2 on the (2, T, H) h_0 at every K, planning head on the action pass."""
    from hf_builders import write_qwen2

    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.split.verify import verify_split

    qwen = write_qwen2(tmp_path / "qwen2")
    out = tmp_path / "two_pass"
    cfg = init_model("tiny", out, overrides={"llm_passes": 2, "ego_state_input": True}, llm=qwen)
    assert cfg.prefix_state_shape == (2, 106, 64) and cfg.llm_type == "qwen2"
    report = verify_split(out)
    assert report.ok and len(report.rows) == 4 and report.worst <= TOL
    assert "Qwen2ForCausalLM.from_pretrained" in report.reference and "ego state" in report.inputs
    assert all(r.output is not None for r in report.rows)


def test_profile_and_split_layer_auto_on_a_composed_and_a_transformers_directory(llama_dir, composed, tmp_path):
    """`hybrid-vla profile --model DIR` measures both kinds (composed: blocks read from the referred directory;
    a bare LM: front / blocks / tail), and the planner behind `split_layer: auto` consumes the profile."""
    from hybrid_vla_ros.split.planner import plan_for_checkpoint
    from hybrid_vla_ros.split.profiler import load_profile, profile_model, write_profile

    for path, kw in ((composed, {}), (llama_dir, {"tokens": 24})):
        doc = profile_model(model_path=path, device="cpu", repeats=1, warmup=0, **kw)
        prof = write_profile(doc, tmp_path / f"{path.name}.json")
        assert len(load_profile(prof)["devices"]["cpu"]["llm_blocks_ms"]) == 3
        plan = plan_for_checkpoint(path, prof, gpu_budget_gb=None, dtype="fp32", **kw)
        assert plan.profile == str(prof) and all(r.e2e_ms is not None for r in plan.rows)
        assert 0 <= plan.chosen_k <= 3 and "lowest predicted end-to-end latency" in plan.reason
    with pytest.raises(ValueError, match="another architecture"):
        plan_for_checkpoint(llama_dir, tmp_path / "tiny_on_llama.json", dtype="fp32", tokens=24)
