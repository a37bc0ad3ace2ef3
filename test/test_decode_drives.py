"""Driving checkpoints that decode every frame (issue 40): a composition on a transformers VLM with a ``decode``
mapping decodes tokens after its prefill, then its planning head reads tokens placed after the decode; or the
waypoints are written in the decoded text.

Referee: transformers' own ``<Family>ForConditionalGeneration`` on the same processor outputs: ``generate``
(greedy, static cache) for the tokens and each step's logits, and a forward over prompt + decoded tokens + the
placed tokens for the read-out (the text model's final-norm input at the read-out rows, then the checkpoint's own
norm and head: this package's tensors). The replay runs the real prefix and suffix node processes on the embedded
bag and checks every trajectory and every reasoning text against that referee, frame by frame.
"""
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch

from replay_check import assert_trajectory_matches, published_and_odometry, stamp_ns
from vlm_builders import VLM_BUILDERS
from hybrid_vla_ros.model.checkpoint import open_checkpoint
from hybrid_vla_ros.model.decode import SideCache, SuffixDecoding, decode_in_process
from hybrid_vla_ros.model.decode_spec import DecodeSpec, TextWaypoints, UnparseableWaypoints
from hybrid_vla_ros.split.verify import BagFrames
from hybrid_vla_ros.runtime.compiled_step import DecodeStepStatus
from hybrid_vla_ros.split.verify_decode import verify_decode
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, resize_rgb

REPO = Path(__file__).resolve().parent.parent
TOKENS = 4


def _compose(root: Path, family: str, decode: dict, *sets: str) -> tuple[Path, Path]:
    from hybrid_vla_ros.tools.cli import main

    builder, kw = VLM_BUILDERS[family]
    vlm = builder(root / family, **kw)
    drive = root / f"drive_{family}"
    more = [a for s in sets for a in ("--set", s)]
    assert main(["init-model", "--preset", "tiny", "--vlm", str(vlm), "--set", f"decode={json.dumps(decode)}", *more,
                 str(drive)]) == 0
    return vlm, drive


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_drives")
    return {family: _compose(root, family, {"max_new_tokens": TOKENS})
            for family in ("qwen2_5_vl", "qwen3_vl", "internvl")}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_the_decode_and_the_head_after_it_equal_transformers_at_every_k(composed, family):
    """Every K: the tokens are transformers' generate's, every step's logits within 1e-5, and the waypoints the
    head reads from the planning token placed after the decode within 1e-5 m of the head on transformers' forward
    over prompt + decoded tokens + planning token."""
    _, drive = composed[family]
    report = verify_decode(drive, TOKENS)
    assert report.ok, report.rows
    assert all(r.readout is not None and r.readout <= 1e-5 for r in report.rows)
    assert len(report.rows) == open_checkpoint(drive).num_layers + 1


def test_tokens_placed_before_the_read_out_are_read_like_transformers_and_leaving_them_out_is_caught(tmp_path):
    """ORION's shape: a planning prompt (``after_token_ids``) between the decode and the planning token, and a stop
    token. The split equals the referee; the same decode with the prompt left out moves the waypoints by far more
    than the tolerance (the read-out really reads what the placed tokens make of the decode)."""
    _, drive = _compose(tmp_path, "qwen2_5_vl", {"max_new_tokens": 6, "after_token_ids": [17, 29, 31]})
    report = verify_decode(drive, 6)
    assert report.ok and all(r.readout <= 1e-5 for r in report.rows), report.rows
    ck = open_checkpoint(drive)
    sm, cfg = ck.split_model(), ck.cfg
    assert cfg.decode_placed_token_ids == [17, 29, 31, cfg.planning_token_id]
    spec = cfg.decode_spec
    with torch.inference_mode():
        inputs = sm.example_inputs(BagFrames())
        bound = SuffixDecoding.bound(sm.prompt_tokens(inputs), spec.settings, 4)
        config, k = sm.text_config(), 1
        head = ck.load("lm_head")

        def run(placed):
            return decode_in_process(sm, ck.load("prefix", k), ck.load("suffix", k), head, SideCache(config, bound, 0),
                                     SideCache(config, bound, k), inputs, spec.settings, placed=placed).plan.modes

        full, short = run(cfg.decode_placed_token_ids), run([cfg.planning_token_id])
        want = sm.decode_readout_referee(torch.float32, inputs, report.reference_tokens, 3)
    assert (full - want).abs().max() <= 1e-5
    assert (short - want).abs().max() > 1e-3


def _cli(*argv, timeout=400):
    return subprocess.run([sys.executable, "-m", "hybrid_vla_ros.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _reasoning(out: Path) -> dict[int, str]:
    from rosbags.highlevel import AnyReader

    from hybrid_vla_ros.tools.output_bag import typestore

    with AnyReader([out / "trajectories"], default_typestore=typestore()) as reader:
        conns = [c for c in reader.connections if c.msgtype == "autoware_internal_debug_msgs/msg/StringStamped"]
        msgs = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages(connections=conns)]
    return {m.stamp.sec * 10**9 + m.stamp.nanosec: m.data for m in msgs}


def test_replay_through_the_nodes_decodes_every_frame_like_transformers(composed, frames, embedded_bag, tmp_path):
    """The embedded bag through the real nodes with the Qwen2.5-VL composition decoding 4 tokens a frame at K = 1
    (``--decode-step inductor`` asked for and refused, so the steps run eagerly):
    every frame answered, its reasoning text on ~/output/reasoning (camera stamp) equal to transformers' generate
    on that frame decoded by the tokenizer, its trajectory the head after that decode, and the report with tokens
    per frame and per-token times on each side."""
    from hybrid_vla_ros.model.vlm import frame_inputs, load_processor

    vlm_dir, drive = composed["qwen2_5_vl"]
    out = tmp_path / "replay"
    run = _cli("replay", "--model-path", str(drive), "--bag", str(embedded_bag), "--loops", "1", "--split-layer",
               "1", "--namespace", f"/dd_{uuid.uuid4().hex[:8]}", "--output", str(out), "--quiet",
               "--decode-step", "inductor")
    logs = "\n".join(p.read_text() for p in out.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    report = json.loads((out / "report.json").read_text())
    assert report["trajectories_out"] == 3 and report["drops"] == {}, report
    d = report["decode"]
    # asked for the compiled step, refused for Qwen2.5-VL's multimodal positions: said, and every token eager
    assert d["decode_step"] == "eager (not compiled: its decode steps take multimodal positions)", d
    assert ("warning: the compiled decode step is not in use; the suffix node's decode step: eager (not compiled: "
            "its decode steps take multimodal positions)") in run.stderr
    assert d["frames"] == 3 and d["tokens_per_frame"] == {"min": TOKENS, "p50": TOKENS, "max": TOKENS}, d
    assert d["reasoning_messages"] == 3 and d["ended_at_max_new_tokens"] == 3
    for key in ("prefix_token_ms", "suffix_token_ms", "round_trip_ms"):
        assert d[key]["n"] == 3 and d[key]["p50"] > 0, (key, d)
    assert "decodes up to 4 tokens a frame" in logs
    ck = open_checkpoint(drive)
    sm, cfg = ck.split_model(), ck.cfg
    processor = load_processor(vlm_dir, cfg.vlm_type)
    published, odometry = published_and_odometry(out, embedded_bag)
    reasoning = _reasoning(out)
    by_stamp = dict(frames)
    assert len(published) == 3 and sorted(reasoning) == sorted(stamp_ns(t) for t in published)
    with torch.inference_mode():
        for traj in published:
            images = [resize_rgb(compressed_msg_to_rgb(m), cfg.camera_size) for _, m in by_stamp[stamp_ns(traj)]]
            inputs = (frame_inputs(processor, cfg, images),)
            tokens, _, _, _ = sm.decode_referee(torch.float32, inputs, TOKENS)
            assert reasoning[stamp_ns(traj)] == processor.tokenizer.decode(tokens, skip_special_tokens=False)
            modes = sm.decode_readout_referee(torch.float32, inputs, tokens, 3)
            lane_follow = modes[3 if len(modes) > 1 else 0]  # the node's default command, LANE_FOLLOW
            assert_trajectory_matches(traj, lane_follow.double().numpy(), cfg.waypoint_dt_s, odometry)
    # RViz (issue 43): the output bag holds the suffix's ~/debug/reasoning_text (the text 3 m above the ego pose at
    # the camera stamp) and ~/debug/trajectory_markers (the published points) of every frame
    from rosbags.highlevel import AnyReader

    from hybrid_vla_ros.tools.output_bag import typestore

    with AnyReader([out / "trajectories"], default_typestore=typestore()) as reader:
        got = {}
        for c, _, raw in reader.messages():
            if c.topic.endswith(("/debug/reasoning_text", "/debug/trajectory_markers")):
                got.setdefault(c.topic.rsplit("/", 1)[-1], []).append(reader.deserialize(raw, c.msgtype))
    texts = {stamp_ns(m): m for m in got["reasoning_text"]}
    assert sorted(texts) == sorted(reasoning) and all(texts[s].text == reasoning[s] for s in reasoning)
    for traj in published:
        ego, _ = odometry.pose_at(stamp_ns(traj), int(1e9))
        m = texts[stamp_ns(traj)]
        assert (m.pose.position.x, m.pose.position.y, m.pose.position.z) == pytest.approx((ego.x, ego.y, ego.z + 3))
    lines = {stamp_ns(a.markers[1]): a.markers[1] for a in got["trajectory_markers"]}
    assert sorted(lines) == sorted(stamp_ns(t) for t in published)
    for traj in published:
        assert [q.x for q in lines[stamp_ns(traj)].points] == [p.pose.position.x for p in traj.points]


def test_replay_waits_for_the_inductor_decode_step_and_decodes_the_eager_tokens(composed, embedded_bag, tmp_path):
    """``replay --decode-step inductor`` with the InternVL composition (text positions in its steps) at K = 1: the
    replay waits for the suffix node's compiled step before playing the bag, every frame is answered with the
    reasoning text of an eager replay, and the report says the step in use at the end was the compiled one."""
    _, drive = composed["internvl"]
    texts, runs = {}, {}
    for step in ("inductor", "eager"):
        out = tmp_path / step
        run = _cli("replay", "--model-path", str(drive), "--bag", str(embedded_bag), "--loops", "1",
                   "--split-layer", "1", "--namespace", f"/dd_{uuid.uuid4().hex[:8]}", "--output", str(out),
                   "--quiet", "--decode-step", step)
        logs = "\n".join(p.read_text() for p in out.glob("*.log"))
        assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
        report = json.loads((out / "report.json").read_text())
        assert report["trajectories_out"] == 3 and report["drops"] == {}, report
        runs[step], texts[step] = (run, report["decode"]), _reasoning(out)
    run, decode = runs["inductor"]
    assert "waiting for the compiled decode step (K=1, TorchInductor)" in run.stdout, run.stdout
    assert "compiled decode step ready after" in run.stdout and decode["decode_step"] == "inductor at K=1", decode
    assert runs["eager"][1]["decode_step"] == "eager" and "waiting for the compiled" not in runs["eager"][0].stdout
    assert len(texts["inductor"]) == 3 and texts["inductor"] == texts["eager"]


# ------------------------------------------------------------------------------------------ text waypoints
def test_text_waypoints_are_read_in_order_in_the_declared_frame_and_units():
    grammar = TextWaypoints()
    text = "Reasoning: clear road. Trajectory: [(1.50, 0.00), (3.1, -0.2), (+4.75,0.5)]"
    assert grammar.parse(text, 3) == [(1.5, 0.0), (3.1, -0.2), (4.75, 0.5)]
    published = TextWaypoints(axes="x_right_y_forward", start="Trajectory:", scale=0.1)
    # x right 2 -> y left -0.2; y forward 10 -> x 1.0 (decimetres); the pair before the marker is not read
    assert published.parse("(9, 9) Trajectory: (2, 10) (0, 20)", 2) == [(1.0, -0.2), (2.0, 0.0)]


@pytest.mark.parametrize("text", ["(1, 2) (3, 4)", "no numbers at all", "(1, 2) (3, 4) (5, 6) (7, 8)"])
def test_text_with_another_count_of_waypoints_is_unparseable(text):
    with pytest.raises(UnparseableWaypoints, match="waypoint"):
        TextWaypoints().parse(text, 3)


def test_a_grammar_that_matches_words_gives_unparseable_text_not_an_error():
    with pytest.raises(UnparseableWaypoints, match="not two numbers"):
        TextWaypoints(pair=r"(w)(\d+)").parse("w1 w2", 2)


def test_null_text_and_codebook_take_their_defaults():
    assert DecodeSpec.from_dict({"drives": "text_waypoints", "text": None}, 320).text == TextWaypoints()
    assert DecodeSpec.from_dict({"drives": "action_codebook", "codebook": None}, 320).codebook.file == "codebook.npy"


@pytest.mark.parametrize("content, match", [
    (b"", "does not load"), (None, "not real numbers"), ("complex", "not real numbers"), ("empty", "actions >= 1"),
    ("pickle", "object array"),
])
def test_a_bad_codebook_file_is_refused_naming_why(tmp_path, content, match):
    import numpy as np

    from hybrid_vla_ros.model.decode_spec import ActionCodebook

    path = tmp_path / "codebook.npy"
    if content == b"":
        path.write_bytes(b"")
    elif content is None:
        np.save(path, np.array([["a"] * 2] * 4))
    elif content == "complex":
        np.save(path, np.zeros((2, 1, 4, 2), dtype=np.complex64))
    elif content == "empty":
        np.save(path, np.zeros((0, 1, 4, 2)))
    else:
        np.save(path, np.array([{"token_all": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=match):
        ActionCodebook().load(tmp_path)


def test_a_decode_longer_than_the_llm_positions_is_refused(tmp_path, capsys):
    """The prompt, max_new_tokens and the placed tokens must fit the LLM's max_position_embeddings (else every
    frame would fail to allocate its KV caches)."""
    from hybrid_vla_ros.tools.cli import main

    builder, kw = VLM_BUILDERS["qwen2_5_vl"]
    vlm = builder(tmp_path / "vlm", **kw)
    assert main(["init-model", "--preset", "tiny", "--vlm", str(vlm), "--set", 'decode={"max_new_tokens": 100000}',
                 str(tmp_path / "drive")]) != 0
    assert "max_position_embeddings" in capsys.readouterr().err


def test_a_missing_start_marker_is_unparseable():
    with pytest.raises(UnparseableWaypoints, match="Trajectory:"):
        TextWaypoints(start="Trajectory:").parse("(1, 2) (3, 4)", 2)


@pytest.mark.parametrize("decode, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"drives": "codebook"}, "drives"),
    ({"text": {}}, "decode.text"),
    ({"text": {"pair": "(x)"}}, "decode.text"),
    ({"drives": "text_waypoints", "text": {"pair": "(\\d+)"}}, "two groups"),
    ({"drives": "text_waypoints", "text": {"axes": "x_up"}}, "axes"),
    ({"drives": "text_waypoints", "text": {}, "after_token_ids": [1]}, "after_token_ids"),
    ({"drives": "text_waypoints", "codebook": {}}, "decode.codebook"),
    ({"drives": "action_codebook", "codebook": {"file": "../book.npy"}}, "file name"),
    ({"drives": "action_codebook", "codebook": {"first_token_id": 400}}, "outside the vocabulary"),
    ({"stop_token_ids": [10**6]}, "outside the vocabulary"),
    ({"max_tokens": 4}, "unknown decode key"),
    ({"temperature": float("inf")}, "finite"),
])
def test_a_bad_decode_mapping_is_refused_naming_what_is_wrong(decode, match):
    with pytest.raises(ValueError, match=match):
        DecodeSpec.from_dict(decode, vocab_size=320)


def test_a_decode_on_a_model_that_cannot_place_tokens_is_refused(tmp_path):
    """This package's own model decodes with one pass and a planning token placed after the decode (ORION's
    shape, test_decode_turns.py); two passes, another read-out or another thing to drive are refused by name."""
    from hybrid_vla_ros.model.config import VLAConfig, preset

    base = preset("tiny").to_dict()
    base.pop("model_type"), base.pop("format_version")
    cfg = VLAConfig(**{**base, "decode": {"max_new_tokens": 4}})
    assert cfg.num_tokens == preset("tiny").num_tokens - 1  # the planning token comes after the decode
    assert cfg.decode_placed_token_ids == [cfg.planning_token_id] and cfg.readout_positions.planning == -1
    with pytest.raises(ValueError, match="decodes with one LLM pass"):
        VLAConfig(**{**base, "llm_passes": 2, "decode": {"max_new_tokens": 4}})
    with pytest.raises(ValueError, match="drives its planning head"):
        VLAConfig(**{**base, "n_modes": 1, "decode": {"max_new_tokens": 4, "drives": "text_waypoints"}})


def _runners(drive: Path, k: int, overlap: bool = False, decode_step: str = "eager"):
    from hybrid_vla_ros.runtime.prefix import PrefixRunner
    from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import SuffixRunner

    ns = f"/dr_{uuid.uuid4().hex[:8]}"
    prefix = PrefixRunner(str(drive), PrefixRunnerSettings(k, device="cpu", namespace=ns, decode_overlap=overlap))
    suffix = SuffixRunner(str(drive), SuffixRunnerSettings(k, namespace=ns, backend="eager", decode_step=decode_step,
                                                           background_build=False))
    return prefix, suffix


def test_text_that_holds_no_waypoints_is_a_counted_drop_with_its_text(tmp_path, frames):
    """drives: text_waypoints on a random model (its text holds no pairs): the suffix loop counts the frame as
    ``unparseable_waypoints`` with the text in the message, publishes nothing, and both runners go on to the next
    frame."""
    from hybrid_vla_ros.runtime.loops import SuffixLoop, counting_context

    _, drive = _compose(tmp_path, "qwen2_5_vl", {"max_new_tokens": 3, "drives": "text_waypoints", "text": {}},
                        "n_modes=1")
    prefix, suffix = _runners(drive, 1)
    try:
        suffix.wait_attached(10)
        ctx, drops = counting_context(suffix)
        published = []
        loop = SuffixLoop(ctx, publish=published.append)
        results = []
        worker = threading.Thread(
            target=lambda: results.extend(prefix.run(items, stamp) for stamp, items in frames[:2]))
        worker.start()
        polled = [loop.poll_once(5.0) for _ in range(2)]
        worker.join(30)
        assert polled == [None, None] and published == []
        assert drops == {"unparseable_waypoints": 2}, drops
        assert "holds 0 waypoint(s)" in drops.last and "text '" in drops.last
        assert [r.decode.ended for r in results] == ["max_new_tokens"] * 2
        assert [len(r.decode.tokens) for r in results] == [3, 3] and all(r.decode.placed == 0 for r in results)
    finally:
        suffix.close()
        prefix.close()


@pytest.mark.parametrize("how", ["gone", "paused"])
def test_a_suffix_that_goes_away_or_pauses_ends_the_prefix_frame_at_once(composed, frames, how):
    """The suffix never answers the prefill (it detached, or its node was deactivated: attached, paused): the
    prefix's frame ends ``no_reply`` within a second (its peer check), not at the 30 s reply timeout, and the prefix
    loop counts it as ``decode_no_reply``."""
    import time

    from hybrid_vla_ros.runtime.loops import PrefixLoop, counting_context

    _, drive = composed["qwen2_5_vl"]
    prefix, suffix = _runners(drive, 1)
    try:
        suffix.wait_attached(10)
        if how == "gone":
            suffix.close()  # attached, then gone before the frame: the prefill is published, no reply ever comes
        else:
            suffix.set_running(False)  # still attached, takes no frame
        ctx, drops = counting_context(prefix)
        t0 = time.monotonic()
        result = PrefixLoop(ctx, pace=False).process(frames[0])
        assert time.monotonic() - t0 < 5.0
        assert result.decode.ended == "no_reply" and result.decode.tokens == []
        assert drops == {"decode_no_reply": 1}, drops
    finally:
        suffix.close()
        prefix.close()


def _pipeline(drive: Path, k: int, overlap: bool, frames: list, decode_step: str = "eager",
              seen=None) -> tuple[list, list, dict]:
    """``frames`` through a PrefixRunner (offered back to back on a thread) and a SuffixRunner (polled here):
    (the prefix's results, the suffix's results, seq -> the prefix's FollowedDecode). ``seen``: called with both
    runners after the last frame."""
    prefix, suffix = _runners(drive, k, overlap, decode_step)
    followed = {}
    prefix.on_decode = followed.__setitem__
    try:
        suffix.wait_attached(10)
        out = []
        worker = threading.Thread(target=lambda: out.extend(prefix.run(items, stamp) for stamp, items in frames))
        worker.start()
        got = []
        while len(got) < len(frames):
            r = suffix.poll(10.0)
            assert r is not None, "the suffix got no frame within 10 s"
            got.append(r)
        worker.join(30)
        assert prefix.follower.wait_idle(10)
        if seen is not None:
            seen(prefix, suffix)
        return out, got, followed
    finally:
        suffix.close()
        prefix.close()


def test_the_next_prefill_runs_between_the_decode_steps_and_changes_no_token(tmp_path, frames):
    """With overlap the prefix prefills frame t+1 (in its second KV cache, 64 tokens at a time) while frame t
    decodes, yielding to each step at every block: frame t+1's slot is published before frame t's decode ends, and
    every frame's tokens and text are the ones the same frames give without overlap (each frame ends before the
    next starts), its waypoints within 1e-6 m (the chunked prefill's attention rounds apart by ulps). No step ever
    waited while a prefill chunk started (it waits for the chunk computing when it came, never a whole prefill: a
    count, where a wait's milliseconds depend on the host's load; the bench measures those)."""
    _, drive = _compose(tmp_path, "qwen2_5_vl", {"max_new_tokens": 24})
    gates = []
    with_overlap = _pipeline(drive, 1, True, frames[:3], seen=lambda p, s: gates.append(p.follower.gate))
    without = _pipeline(drive, 1, False, frames[:3])
    for (out, got, followed), overlap in ((with_overlap, True), (without, False)):
        assert [r.meta.seq for r in got] == [o.seq for o in out] == sorted(followed)
        assert all(f.ended == "max_new_tokens" and len(f.tokens) == 24 for f in followed.values())
        published_before_end = [b.meta.t_publish_ns < a.t_suffix_end_ns for a, b in zip(got, got[1:])]
        assert all(published_before_end) if overlap else not any(published_before_end), (overlap, got)
    for a, b in zip(with_overlap[1], without[1]):
        assert a.decode.tokens == b.decode.tokens and a.decode.text == b.decode.text
        assert abs(a.modes - b.modes).max() <= 1e-6
    held = [ms for f in with_overlap[2].values() for ms in f.step_held_ms]
    assert held and gates[0].most_chunks_waited == 0 and gates[0].chunks_started > 3 * len(frames[:3])


def test_the_inductor_decode_step_gives_the_eager_tokens_through_the_runners(tmp_path, frames):
    """``decode_step: inductor`` on an InternVL composition (text positions in its steps), built at construction:
    each frame's tokens and text are the eager step's and its waypoints within 1e-5 m (the compiled kernels round
    apart by ulps), and the runner says the step ran compiled; a Qwen2.5-VL composition (multimodal positions in
    every step) is refused naming why and decodes eagerly."""
    _, drive = _compose(tmp_path, "internvl", {"max_new_tokens": 8})
    states = []
    compiled = _pipeline(drive, 1, False, frames[:2], "inductor", lambda p, s: states.append(s.decode_step_status()))
    eager = _pipeline(drive, 1, False, frames[:2], "eager", lambda p, s: states.append(s.decode_step_status()))
    assert states == [DecodeStepStatus("inductor", compiled_k=1, line="inductor at K=1"),
                      DecodeStepStatus("eager", line="eager")]
    for a, b in zip(compiled[1], eager[1]):
        assert a.decode.tokens == b.decode.tokens and a.decode.text == b.decode.text and len(a.decode.tokens) == 8
        assert abs(a.modes - b.modes).max() <= 1e-5
    _, qwen = _compose(tmp_path, "qwen2_5_vl", {"max_new_tokens": 2})
    prefix, suffix = _runners(qwen, 1, decode_step="inductor")
    try:
        why = "its decode steps take multimodal positions"
        assert suffix.decode_step_status() == DecodeStepStatus("inductor", error=why,
                                                               line=f"eager (not compiled: {why})")
        assert suffix.decode_steps is None and suffix.linear_packing == ""
    finally:
        suffix.close()
        prefix.close()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_a_chunked_prefill_equals_the_whole_one_and_a_chunk_without_the_cache_before_it_does_not(composed, family):
    """The overlap's chunked prefill (32 tokens at a time through the blocks, each chunk attending to the cached
    ones before it, Qwen3-VL's DeepStack rows split with its visual tokens) gives the whole prefill's h_K at every K
    (bit-exact for the Qwen-VL families here, InternVL within 1e-6 relative: the attention's rounding). Control:
    the same chunks each with an empty cache (no attention to the earlier tokens) are far off."""
    from hybrid_vla_ros.model.decode import PrefixDecoding
    from hybrid_vla_ros.model.modeling import run_blocks

    _, drive = composed[family]
    ck = open_checkpoint(drive)
    sm = ck.split_model()
    config = sm.text_config()
    with torch.inference_mode():
        inputs = sm.example_inputs(BagFrames())
        T = sm.prompt_tokens(inputs)
        assert T > 64
        for k in (1, ck.num_layers):
            stage = ck.load("prefix", k)
            whole = PrefixDecoding(sm, stage, SideCache(config, T, 0)).prefill(inputs)
            chunked = PrefixDecoding(sm, stage, SideCache(config, T, 0), chunk_rows=32).prefill(inputs)
            scale = whole.hidden_states.abs().max().item()
            assert (whole.hidden_states - chunked.hidden_states).abs().max().item() <= 1e-6 * scale, (family, k)
        embeds = stage.vlm  # the control: each chunk alone, from the front's output at K = L
        from hybrid_vla_ros.model.contract import SplitState
        from hybrid_vla_ros.model.vlm import run_front

        front = run_front(embeds, inputs[0])
        state = SplitState(front.inputs_embeds, front.position_ids, front.visual_mask, front.deepstack)
        alone = torch.cat([run_blocks(stage, stage.layers, part.hidden_states, state=part,
                                      cache=SideCache(config, T, 0).cache)
                           for part in (state.rows(a, min(T, a + 32)) for a in range(0, T, 32))])
        assert (alone - whole.hidden_states).abs().max().item() > 1e-2 * scale


# ------------------------------------------------------------------------------------------ action codebook
def _box(x: float, y: float, yaw: float, length: float = 4.0, width: float = 2.0):
    """The 4 corners (front-left, front-right, rear-right, rear-left) of a box at (x, y) heading ``yaw``."""
    import numpy as np

    local = np.array([[length / 2, width / 2], [length / 2, -width / 2], [-length / 2, -width / 2],
                      [-length / 2, width / 2]])
    c, s = np.cos(yaw), np.sin(yaw)
    return local @ np.array([[c, s], [-s, c]]) + np.array([x, y])


def _book():
    """Action 0: 2 m straight on; action 1: an arc of 3 m turning 0.3 rad left; action 2: stop. Two sub-steps each
    (only the last one places the next pose)."""
    import numpy as np

    r = 3.0 / 0.3
    arc = (r * np.sin(0.3), r * (1 - np.cos(0.3)), 0.3)
    return np.stack([np.stack([_box(1.0, 0, 0), _box(2.0, 0, 0)]), np.stack([_box(1.5, 0.1, 0.15), _box(*arc)]),
                     np.stack([_box(0, 0, 0), _box(0, 0, 0)])])


def test_action_tokens_roll_out_through_the_codebook_like_the_published_tokenizer(tmp_path):
    """AutoVLA's rollout: each action's last corners placed at the pose so far; next position their mean, next
    heading from corner 3 to corner 0. Straight 2 m, then the 0.3 rad arc (from (2, 0) heading 0), then the arc
    again from there (heading 0.3), then a stop: the expected poses by plain geometry. Tokens that are not actions
    (reasoning text, the stop token) are passed over; another count of actions is unparseable."""
    import numpy as np

    from hybrid_vla_ros.model.decode_spec import ActionCodebook

    np.save(tmp_path / "codebook.npy", _book())
    book = ActionCodebook(first_token_id=100)
    table = book.load(tmp_path)
    r = 10.0
    arc = np.array([r * np.sin(0.3), r * (1 - np.cos(0.3))])
    second = np.array([2.0, 0.0]) + arc
    rot = np.array([[np.cos(0.3), -np.sin(0.3)], [np.sin(0.3), np.cos(0.3)]])
    third = second + rot @ arc
    got = book.waypoints(table, [5, 100, 7, 101, 101, 102, 2], 4)  # 5, 7, 2: not actions
    assert np.allclose(got, [(2.0, 0.0), tuple(second), tuple(third), tuple(third)], atol=1e-9), got
    with pytest.raises(UnparseableWaypoints, match="3 action token"):
        book.waypoints(table, [100, 101, 102], 4)
    np.save(tmp_path / "flat.npy", np.zeros((3, 2, 4)))
    with pytest.raises(ValueError, match="not \\(actions >= 1, sub-steps >= 1, 4, 2\\)"):
        ActionCodebook(file="flat.npy").load(tmp_path)


def test_a_codebook_model_drives_its_decoded_actions_through_the_runners(tmp_path, frames):
    """drives: action_codebook with a codebook over the whole (tiny) vocabulary, 6 tokens a frame for 6 waypoints:
    each frame's trajectory is the rollout of the tokens transformers' generate gives on that frame."""
    import numpy as np

    from hybrid_vla_ros.model.decode_spec import ActionCodebook
    from hybrid_vla_ros.model.vlm import frame_inputs, load_processor

    decode = {"max_new_tokens": 6, "drives": "action_codebook", "codebook": {"file": "codebook.npy"}}
    vlm_dir, drive = _compose(tmp_path, "qwen2_5_vl", decode, "n_modes=1", "n_waypoints=6")
    rng = np.random.default_rng(0)
    vocab = open_checkpoint(drive).cfg.llm["vocab_size"]
    np.save(drive / "codebook.npy", np.stack([np.stack([_box(*rng.uniform(-1, 1, 2), 0), _box(
        *rng.uniform(0, 3, 2), rng.uniform(-0.2, 0.2))]) for _ in range(vocab)]))
    _, got, _ = _pipeline(drive, 1, False, frames[:2])
    ck = open_checkpoint(drive)
    sm, cfg = ck.split_model(), ck.cfg
    processor = load_processor(vlm_dir, cfg.vlm_type)
    table = ActionCodebook().load(drive)
    with torch.inference_mode():
        for r in got:
            stamp = r.meta.stamp_ns
            images = [resize_rgb(compressed_msg_to_rgb(m), cfg.camera_size) for _, m in dict(frames)[stamp]]
            tokens, _, _, _ = sm.decode_referee(torch.float32, (frame_inputs(processor, cfg, images),), 6)
            assert r.decode.tokens == tokens
            assert np.allclose(r.waypoints, ActionCodebook().waypoints(table, tokens, 6), atol=1e-5)


def test_learned_queries_placed_after_the_decode_are_read_like_transformers(tmp_path):
    """SimLingo's shape: a ``queries`` read-out (one learned query per waypoint) placed after the decode and a
    two-token prompt before them, in steps of at most 4 rows (the queries span steps; the head reads all of them):
    tokens bit-exact and waypoints within 1e-5 m of the head on transformers' forward over prompt + decoded tokens +
    the placed tokens with the learned queries in the last rows' embeddings, at every K. The ids under the queries
    do not matter (their embeddings are replaced), and the same placed tokens without the queries are far off."""
    from hybrid_vla_ros.model.config import preset

    n = preset("tiny").n_waypoints
    _, drive = _compose(tmp_path, "qwen3_vl", {"max_new_tokens": 5, "after_token_ids": [11, 12]},
                        f"readout={json.dumps({'type': 'queries', 'count': n})}")
    report = verify_decode(drive, 5)
    assert report.ok and all(r.readout <= 1e-5 for r in report.rows), report.rows
    ck = open_checkpoint(drive)
    sm, cfg = ck.split_model(), ck.cfg
    assert cfg.decode_placed_token_ids == [11, 12] + [cfg.planning_token_id] * n
    with torch.inference_mode():
        inputs = sm.example_inputs(BagFrames())
        bound = SuffixDecoding.bound(sm.prompt_tokens(inputs), cfg.decode_spec.settings, 2 + n)
        config, k, head = sm.text_config(), 2, ck.load("lm_head")

        def run(placed, queries=True):
            """decode_in_process, with the prefix's learned queries left out when not ``queries``."""
            from hybrid_vla_ros.model.decode import PrefixDecoding

            front = PrefixDecoding(sm, ck.load("prefix", k), SideCache(config, bound, 0), placed=len(placed))
            front.query_count = front.query_count if queries else 0  # else the planning tokens' own embeddings
            return decode_in_process(sm, None, ck.load("suffix", k), head, None, SideCache(config, bound, k),
                                     inputs, cfg.decode_spec.settings, placed=placed, front=front).plan.modes

        want = sm.decode_readout_referee(torch.float32, inputs, report.reference_tokens, 3)
        assert (run(cfg.decode_placed_token_ids) - want).abs().max() <= 1e-5
        assert (run([11, 12] + [7] * n) - want).abs().max() <= 1e-5
        assert (run(cfg.decode_placed_token_ids, queries=False) - want).abs().max() > 1e-3
