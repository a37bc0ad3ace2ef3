"""PrefixRunner -> ring -> SuffixRunner in one process (no ROS): results, non-finite values, stale frames."""
import json
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE, load_stage
from hybrid_vla_ros.runtime.prefix import PrefixRunner
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
from hybrid_vla_ros.runtime.suffix import StaleFrame, SuffixRunner
from hybrid_vla_ros.util.bags import read_bag
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess


@pytest.fixture(scope="module")
def frame(embedded_bag):
    """The first synchronized frame of the embedded bag: (stamp_ns, [("compressed", msg)] * 6)."""
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(embedded_bag):
        if m.topic.endswith("/image_raw/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    msgs = [first[t] for t in sorted(first)]
    stamp = msgs[0].header.stamp.sec * 10**9 + msgs[0].header.stamp.nanosec
    return stamp, [("compressed", msg) for msg in msgs]


def _poisoned(tmp_path, tiny_checkpoint, prefix: str):
    """A copy of the tiny checkpoint whose tensors starting with ``prefix`` are NaN."""
    out = tmp_path / f"nan_{prefix.strip('.')}"
    out.mkdir()
    (out / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    state = load_file(str(tiny_checkpoint / WEIGHTS_FILE))
    state = {k: torch.full_like(v, float("nan")) if k.startswith(prefix) else v for k, v in state.items()}
    save_file(state, str(out / WEIGHTS_FILE))
    return out


@pytest.mark.parametrize("resize", ["area", "bicubic"])
def test_frame_through_both_runners_matches_the_monolithic_model(tmp_path, tiny_checkpoint, frame, resize):
    """Prefix and suffix runners at K = 2 answer a real frame as the whole model on the package's preprocessing;
    with ``image_resize: bicubic`` in the checkpoint's config the prefix resizes with that filter."""
    ns = f"/pl_{uuid.uuid4().hex[:6]}"
    stamp, items = frame
    if resize != "area":
        path = tmp_path / resize
        path.mkdir()
        doc = json.loads((tiny_checkpoint / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**doc, "image_resize": resize}))
        (path / WEIGHTS_FILE).symlink_to(tiny_checkpoint / WEIGHTS_FILE)
        tiny_checkpoint = path
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", namespace=ns))
    suffix = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, namespace=ns))
    try:
        assert suffix.poll(0.05) is None  # attaches, nothing published yet
        published = prefix.run(items, stamp)
        result = suffix.poll(5.0)
        assert result is not None and result.meta.seq == published.seq and result.meta.stamp_ns == stamp
        assert result.meta.split_layer == 2 and result.handoff_ms >= 0 and result.suffix_ms > 0
        full = load_stage(tiny_checkpoint, "full")
        cfg = full.cfg
        with torch.inference_mode():
            assert cfg.image_resize == resize
            images = [compressed_msg_to_rgb(m) for _, m in items]
            expected = full(preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std,
                                       resize=resize)).double().numpy()
            other = full(preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std,
                                    resize="bilinear")).double().numpy()
        assert abs(result.waypoints - expected).max() <= 1e-5
        assert abs(result.waypoints - other).max() > 1e-4, "the filter changes the answer"
    finally:
        suffix.close()
        prefix.close()


def test_non_finite_values_are_refused_on_both_sides(tmp_path, tiny_checkpoint, frame):
    stamp, items = frame
    ns = f"/pl_{uuid.uuid4().hex[:6]}"
    bad_prefix = PrefixRunner(str(_poisoned(tmp_path, tiny_checkpoint, "vision.")),
                              PrefixRunnerSettings(1, device="cpu", namespace=ns))
    try:
        with pytest.raises(FloatingPointError, match="hidden states"):
            bad_prefix.run(items, stamp)
        assert bad_prefix.ring.stats.published == 0, "nothing non-finite reaches the ring"
    finally:
        bad_prefix.close()
    nan_head = _poisoned(tmp_path, tiny_checkpoint, "head.")
    prefix = PrefixRunner(str(nan_head), PrefixRunnerSettings(1, device="cpu", namespace=ns))
    suffix = SuffixRunner(str(nan_head), SuffixRunnerSettings(1, namespace=ns))
    try:
        suffix.poll(0.05)
        prefix.run(items, stamp)
        with pytest.raises(FloatingPointError, match="waypoints"):
            suffix.poll(5.0)
    finally:
        suffix.close()
        prefix.close()


def test_frames_published_before_the_suffix_attached_are_stale(tiny_checkpoint, frame):
    stamp, items = frame
    ns = f"/pl_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(3, device="cpu", namespace=ns))
    try:
        prefix.run(items, stamp)  # nobody attached yet: e.g. a suffix restarting
        suffix = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(3, namespace=ns))
        try:
            with pytest.raises(StaleFrame):
                suffix.poll(5.0)
            prefix.run(items, stamp + 10**9)
            result = suffix.poll(5.0)
            assert result is not None and result.meta.stamp_ns == stamp + 10**9
        finally:
            suffix.close()
    finally:
        prefix.close()


def test_close_really_frees_the_stage_weights(tiny_checkpoint):
    """cleanup must return the stage's memory: no reference to its weights survives close()."""
    import gc
    import weakref

    ns = f"/pl_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", namespace=ns))
    suffix = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, namespace=ns))
    refs = [weakref.ref(p) for p in list(prefix.stage.parameters()) + list(suffix.stage.parameters())]
    assert refs
    suffix.close()
    prefix.close()
    gc.collect()
    assert all(r() is None for r in refs), "stage weights still referenced after close()"


def test_the_prefix_reads_both_stages_times_for_rebalancing(tiny_checkpoint, frame):
    """PrefixRunner.stage_sample: its own cycle, and the suffix's stage time with the K it was measured at and its
    whole cycle, as the suffix announces them in the ring header; none before it announced, none after it closed.
    Then a real SuffixRunner announces its stage time at the frame's K after computing it."""
    from hybrid_vla_ros.runtime.settings import SuffixRunnerSettings
    from hybrid_vla_ros.runtime.suffix import StaleFrame, SuffixRunner
    from hybrid_vla_ros.transport.ring import RingConsumer

    stamp, items = frame
    ns = f"/rb_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", namespace=ns))
    try:
        assert prefix.stage_sample() is None  # no frame yet
        prefix.run(items, stamp)
        sample = prefix.stage_sample(50_000_000)
        assert sample.prefix_ms > 0 and sample.camera_period_ms == 50.0
        assert (sample.k, sample.suffix_ms, sample.suffix_cycle_ms) == (-1, None, None)  # nobody announced
        with RingConsumer(prefix.ring.name) as cons:
            t = prefix._last_publish_ns + 1000
            cons.announce_next_read(t, t + 30_000_000)
            cons.announce_stage_time(3, 12_500_000)
            sample = prefix.stage_sample()
            assert (sample.k, sample.suffix_ms, sample.suffix_cycle_ms) == (3, 12.5, 30.0)
        sample = prefix.stage_sample()
        assert (sample.k, sample.suffix_ms, sample.suffix_cycle_ms) == (-1, None, None)  # closed: nothing stays
        suffix = SuffixRunner(str(tiny_checkpoint), SuffixRunnerSettings(2, dtype="fp32", namespace=ns))
        try:
            with pytest.raises(StaleFrame):  # attaches; the frame published before it is not computed
                suffix.poll(5.0)
            prefix.run(items, stamp + 10**8)
            result = suffix.poll(5.0)
            k, stage_ns = prefix.ring.consumer_stage_time()
            assert k == 2 and abs(stage_ns - result.suffix_ms * 1e6) < 1e3  # one frame: its own compute time
        finally:
            suffix.close()
    finally:
        prefix.close()


def test_the_prefix_paces_itself_to_a_slower_suffix(tiny_checkpoint, frame):
    """The suffix announces its last take and next read in the ring; a prefix faster than it waits so that its
    next frame is published just before that read (and not for a read another frame already waits for); no
    delay for a faster suffix, a stale announcement or none. The rule is checked on given instants
    (pacing_delay_ns), the runner's plumbing (announcement through the ring, cycle known) on the real ring."""
    from hybrid_vla_ros.runtime.prefix import pacing_delay_ns
    from hybrid_vla_ros.transport.ring import RingConsumer

    stamp, items = frame
    ns = f"/pl_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(2, device="cpu", namespace=ns))
    try:
        assert prefix.pacing_delay_s() == 0.0  # no frame yet: no cycle known
        prefix.run(items, stamp)
        assert prefix._cycle_ns
        with RingConsumer(prefix.ring.name) as cons:
            assert prefix.pacing_delay_s() == 0.0  # nobody announced anything
            t = prefix._last_publish_ns + 1000  # took the frame just after it was published
            cons.announce_next_read(t, t + 60 * 10**9)
            assert prefix.ring.consumer_schedule() == (t, t + 60 * 10**9)
            assert prefix.pacing_delay_s(max_s=120) > 0  # a suffix far slower than this prefix: pace
        assert prefix.ring.consumer_schedule() == (0, 0) and prefix.pacing_delay_s(max_s=60) == 0.0  # closed
    finally:
        prefix.close()
    p_ns, s_ns, now, max_ns = 50_000_000, 700_000_000, 10**12, 60 * 10**9
    taken, published_before = now - 1_000_000, now - 2_000_000
    d = pacing_delay_ns(now, taken, taken + s_ns, p_ns, published_before, max_ns)
    assert d == taken + s_ns - now - p_ns  # published just as the suffix reads next
    d2 = pacing_delay_ns(now, taken, taken + s_ns, p_ns, taken + 500, max_ns)  # a frame now waits for that read
    assert d2 == d + s_ns  # aims one suffix cycle later
    assert pacing_delay_ns(now, taken, taken + s_ns, p_ns, taken + 500, d2 // 2) == 0  # more than max: no delay
    assert pacing_delay_ns(now, taken, taken + p_ns // 2, p_ns, published_before, max_ns) == 0  # faster suffix
    assert pacing_delay_ns(now, now - 10 * s_ns, now - 9 * s_ns, p_ns, published_before, max_ns) == 0  # stale
    assert pacing_delay_ns(now, 0, 0, p_ns, published_before, max_ns) == 0  # no announcement
    # the suffix will be done (and idle, waiting) before a frame started now is out: it takes it at once, no delay
    # (it does not read again every S on its own)
    late = taken + s_ns - p_ns // 2
    assert pacing_delay_ns(late, taken, taken + s_ns, p_ns, published_before, max_ns) == 0
    assert pacing_delay_ns(taken + s_ns + p_ns, taken, taken + s_ns, p_ns, published_before, max_ns) == 0
    # a suffix of 8.5 s a frame (minddrive-0.5b wholly on one core) is paced by seconds: 8.45 s, then one cycle more
    slow = 8_500_000_000
    assert pacing_delay_ns(now, taken, taken + slow, p_ns, published_before, max_ns) == taken + slow - now - p_ns
    assert pacing_delay_ns(now, taken, taken + slow, p_ns, taken + 500, max_ns) == taken + 2 * slow - now - p_ns
    # a delay over 1 s and beyond two of the suffix's cycles is no announcement the rule trusts: a take announced 5 s
    # ahead (a header gone wrong) with a 0.5 s cycle is refused; the same under 1 s is waited
    ahead = now + 5_000_000_000
    assert pacing_delay_ns(now, ahead, ahead + 500_000_000, p_ns, published_before, max_ns) == 0
    near = now + 300_000_000
    assert pacing_delay_ns(now, near, near + 500_000_000, p_ns, published_before, max_ns) == 750_000_000




class _PacedRunner:
    """A stand-in for PrefixRunner as the prefix node's worker sees it: a suffix that is always far behind
    (``pacing_delay_s`` answers ``delay_s`` on every ask), a split layer that can be requested, frames recorded."""

    def __init__(self, delay_s: float):
        from types import SimpleNamespace

        self.delay_s, self.asks, self.runs, self.split_requested = delay_s, 0, [], False
        self.cfg = SimpleNamespace(ego_state_input=False)
        self.handoff_path = "produced in slot"

    def pacing_delay_s(self, max_s: float = 30.0) -> float:
        self.asks += 1
        return self.delay_s

    def run(self, items, stamp, ego_state=None, ego_wait_ms=None, scene=None):
        from types import SimpleNamespace

        self.runs.append((stamp, self.split_requested))
        self.split_requested = False
        return SimpleNamespace(resplit=None, resplit_error=None, preprocess_ms=1.0, prefix_ms=1.0)


def test_the_prefix_worker_asks_the_pacing_delay_again_and_a_split_request_ends_the_wait():
    """The node's worker paces a frame to a suffix far behind (30 s): it asks the delay again while it waits
    (the suffix may take a frame, die or restart meanwhile: the first ask is not held to), and a split layer
    requested meanwhile ends the wait at once: the frame is computed (the runner applies the request first)
    long before the 30 s are over, not after them."""
    import threading
    import time

    from hybrid_vla_ros.runtime.loops import PrefixLoop, counting_context

    runner = _PacedRunner(30.0)
    ctx, drops = counting_context(runner)
    worker = PrefixLoop(ctx, pace=True)
    worker.start()
    try:
        worker.offer((123, []))
        deadline = time.monotonic() + 10
        while runner.asks < 3 and time.monotonic() < deadline:  # asked again while it waits
            time.sleep(0.05)
        assert runner.asks >= 3 and runner.runs == [], (runner.asks, runner.runs)
        runner.split_requested = True
        worker.wake()
        done = threading.Event()
        while not runner.runs and time.monotonic() < deadline:
            done.wait(0.05)
        assert runner.runs == [(123, True)], runner.runs  # computed with the request pending, well within 30 s
        assert worker.frames_out == 1 and drops == {}
    finally:
        worker.stop()


def _bag_frames(embedded_bag) -> list[tuple[int, list]]:
    """Every synchronized frame of the embedded bag: [(stamp_ns, [("compressed", msg)] * 6)] in time order."""
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_KILTED)
    per_topic = {}
    for m in read_bag(embedded_bag):
        if m.topic.endswith("/image_raw/compressed"):
            per_topic.setdefault(m.topic, []).append(store.deserialize_cdr(m.raw, m.msgtype))
    topics = sorted(per_topic)
    out = []
    for i in range(min(len(v) for v in per_topic.values())):
        msgs = [per_topic[t][i] for t in topics]
        out.append((msgs[0].header.stamp.sec * 10**9 + msgs[0].header.stamp.nanosec,
                    [("compressed", msg) for msg in msgs]))
    return out


#: A small model with the published vision side and query heads (scene_queries) on the tiny preset's LLM.
SCENE_QUERY_OVERRIDES = dict(
    vision=dict(type="eva02", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=170,
                patch_size=16, image_size=64, window_size=2, global_blocks=[2], pretrain_image_size=64),
    projector=dict(type="scene_queries", num_layers=1, feedforward_dims=64, num_extra=8, num_query=12,
                   memory_len=16, topk_proposals=8, num_propagated=8, num_memory=4, scene_memory_len=8,
                   memory_ffn_dims=64, num_lane=20, num_lanes_one2one=10, map_memory_len=16, map_topk=8))


def test_a_minddrive_shaped_model_answers_real_frames_through_both_runners(tmp_path, embedded_bag):
    """Issue 21: the published parts together at a small size: the published camera pipeline (`orion_crop` on the
    bag's 1936 x 1216 cameras, ImageNet statistics), an EVA-02 vision side (window and global blocks), the
    published query heads with their memory (`scene_queries`), two LLM passes with the decision read-out and
    MindDrive's speed and path planners (`vae_speed_path`), each pass on its own prompt of its own length (the
    shorter padded in the ring slot). Over the bag's three frames (the heads' memory carried
    from one to the next, in the prefix runner's stage), prefix and suffix runners give the whole model's
    trajectory on each frame within 1e-5; a live re-split (K 2 -> 1) before the third frame keeps the memory (the
    heads live in the prefix stage, which a re-split does not rebuild), and a restarted prefix starts it afresh
    (its first frame is a first frame). The camera geometry is made up (example_scene_inputs), the vehicle drives
    1.26 m/s ahead (the bag's odometry speed)."""
    from dataclasses import replace

    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.model.config import IMAGENET_MEAN, IMAGENET_STD
    from hybrid_vla_ros.model.query_heads import example_scene_inputs

    overrides = dict(**SCENE_QUERY_OVERRIDES, image_resize="orion_crop", image_mean=list(IMAGENET_MEAN),
                     image_std=list(IMAGENET_STD), llm_passes=2, decision_token_ids=[11, 23, 35, 47, 59, 71, 83],
                     planning_token_id=250, readout={"type": "vae_speed_path", "path_token_id": 251,
                                                     "path_points": 20},
                     # each pass its own prompt after the scene tokens, of another length (MindDrive's two)
                     pass_prompt_token_ids=[[7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 250, 5, 251]])
    path = tmp_path / "minddrive_like"
    cfg = init_model("tiny", path, overrides=overrides)
    assert cfg.readout_type == "vae_speed_path" and cfg.vision_type == "eva02"
    at = cfg.readout_positions  # the decision pass padded by 4 tokens: its -2 is 6 from the end
    assert (at.decision, at.planning, at.path) == (-6, -3, -1)
    assert cfg.num_vision_tokens == 8 + 4 + 1 + 8  # object extra + scene history + can-bus, map extra
    frames = _bag_frames(embedded_bag)
    assert len(frames) == 3
    t0 = frames[0][0]

    def scene(stamp_ns):
        base = example_scene_inputs(cfg.n_cameras, cfg.image_size, timestamp=(stamp_ns - t0) * 1e-9)
        pose = base.frame.ego_pose.clone()
        pose[1, 3] = 1.26 * base.frame.timestamp  # forward is +y of the model frame
        can_bus = base.frame.can_bus.clone()
        can_bus[:3], can_bus[7] = pose[:3, 3], 1.26
        return replace(base, frame=replace(base.frame, ego_pose=pose, can_bus=can_bus))

    ns = f"/pl_{uuid.uuid4().hex[:6]}"
    prefix = PrefixRunner(str(path), PrefixRunnerSettings(2, device="cpu", namespace=ns))
    suffix = SuffixRunner(str(path), SuffixRunnerSettings(2, namespace=ns))
    full = load_stage(path, "full")
    try:
        assert suffix.poll(0.05) is None
        with pytest.raises(ValueError, match="camera geometry and ego frame"):
            prefix.run(frames[0][1], frames[0][0])  # the query heads cannot run without their scene inputs
        got, want = [], []
        for i, (stamp, items) in enumerate(frames):
            if i == 2:  # a live re-split; the suffix follows the K in the slot header
                prefix.request_split_layer(1)
            result_prefix = prefix.run(items, stamp, scene=scene(stamp))
            assert result_prefix.split_layer == (1 if i == 2 else 2)
            result = suffix.poll(10.0)
            assert result is not None
            got.append(result.waypoints)
            with torch.inference_mode():
                images = [compressed_msg_to_rgb(m) for _, m in items]
                assert images[0].shape == (1216, 1936, 3)
                pixels = preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std, resize="orion_crop")
                want.append(full(pixels, scene=scene(stamp)).double().numpy())
        for g, w in zip(got, want):
            assert g.shape == w.shape == (cfg.n_waypoints, 2)
            assert abs(g - w).max() <= 1e-5
        assert not full.projector.object_memory.embedding.isnan().any()
        assert full.projector.last_timestamp == pytest.approx((frames[-1][0] - t0) * 1e-9)
        assert abs(got[2] - got[1]).max() > 1e-4  # the frames differ (a trajectory that ignored them would not)
        # a restarted prefix: a fresh memory, so its answer to the last frame is a first frame's
        prefix.close()
        prefix = PrefixRunner(str(path), PrefixRunnerSettings(2, device="cpu", namespace=ns))
        stamp, items = frames[-1]
        prefix.run(items, stamp, scene=scene(stamp))
        with pytest.raises(StaleFrame):  # the suffix re-attaches to the new ring: that first frame is stale
            suffix.poll(10.0)
        # the same frame again: not after the last one, so the heads start afresh once more (a first frame)
        assert prefix.run(items, stamp, scene=scene(stamp)).split_layer == 2
        restarted = suffix.poll(10.0)
        assert prefix.stage.projector.last_timestamp == pytest.approx((stamp - t0) * 1e-9)
        fresh = load_stage(path, "full")
        with torch.inference_mode():
            first = fresh(pixels, scene=scene(stamp)).double().numpy()
        assert restarted is not None and abs(restarted.waypoints - first).max() <= 1e-5
        assert abs(first - want[-1]).max() > 1e-4  # the memory of the two frames before made a difference
    finally:
        suffix.close()
        prefix.close()


def test_a_bf16_stage_keeps_the_query_heads_in_float32(tmp_path):
    """A checkpoint with the query heads loaded in bf16 (a GPU prefix's dtype): the heads stay float32 (as published),
    the rest is bf16, and the whole model plans a finite trajectory from a frame (made-up geometry)."""
    from hybrid_vla_ros.model.checkpoint import init_model
    from hybrid_vla_ros.model.query_heads import example_scene_inputs

    path = tmp_path / "heads"
    cfg = init_model("tiny", path, overrides=SCENE_QUERY_OVERRIDES)
    full = load_stage(path, "full", dtype="bf16")
    assert {p.dtype for p in full.projector.parameters()} == {torch.float32}
    assert {p.dtype for p in full.layers.parameters()} == {torch.bfloat16}
    pixels = torch.rand(cfg.n_cameras, 3, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        waypoints = full(pixels.to(torch.bfloat16), scene=example_scene_inputs(cfg.n_cameras, cfg.image_size))
    assert waypoints.shape == (cfg.n_waypoints, 2) and torch.isfinite(waypoints).all()
