"""Pipeline efficiency of the two-process split: frame rate and latency against the stage times, and the same
frames run one stage after the other.

Per preset:

1. A checkpoint (random init, cached under the model cache folder and rebuilt when its config changes).
   ``minddrive-0.5b`` runs with its image size overridden (default 112 px, i.e. 7x7 patches of 16 px per camera
   instead of 640 px): the EVA-02-L-shaped ViT would take about a minute a frame at 640 px on one core. Its
   query projector still gives 513 LLM tokens, so the LLM side, where the split is, keeps its real shape
   ((2, 524, 896) hidden states, 24 Qwen2-0.5B blocks).
2. The split layer K (unless given): the per-block profile of :func:`hybrid_vla_ros.split.profiler.profile_model`
   on the prefix core (one thread, the pipeline dtype), plus the camera preprocessing of the bag's frames,
   predicts the prefix time P(K) and the hand-off + suffix time H + S(K) (:func:`choose_split`). K is the
   smallest K at which the prefix is at least ``margin`` (default 5 %) slower than hand-off + suffix: the
   pipeline then runs at the prefix's rate and the suffix never has a frame waiting in the ring (a waiting
   frame adds up to ring-slots - 1 frame periods of latency, because the consumer takes the oldest READY slot
   and the producer overwrites the oldest one only when all are taken); it gives away less than one block's
   time of throughput against the best-balanced K.
3. The pipeline: the prefix (:class:`~hybrid_vla_ros.runtime.prefix.PrefixRunner`) in a process pinned to
   ``prefix_cores`` and the suffix (:class:`~hybrid_vla_ros.runtime.suffix.SuffixRunner`) in one pinned to
   ``suffix_cores``, one torch thread per core; the prefix is fed the embedded bag's real frames (6 JPEG
   cameras of 1936x1216, looped) back to back, as fast as it runs.
4. Sequential baselines on the same frames in one process, prefix then suffix through the same ring code:
   ``1core`` (pinned to the prefix core, one thread: each stage as it runs alone) and ``2core`` (both cores,
   two threads: the no-pipeline use of the same hardware).

Per frame (ms; instants are CLOCK_MONOTONIC ns carried in the slot header and in the results):
``preprocess`` + ``prefix`` (PrefixResult / slot timings), ``copy`` = t_publish - t_write_start,
``queue_wait`` = max(0, end of the suffix's previous frame - t_publish), ``handoff_net`` = t_ready -
t_write_start - queue_wait (copy + notification + wake-up), ``suffix`` = t_suffix_end - t_ready,
``e2e`` = t_suffix_end - t_prefix_start.

Figures (over the frames after ``warmup``; stage times as percentiles {n, p50, p90, mean, min, max}):

* ``fps`` = (n - 1) / (t_suffix_end[last] - t_suffix_end[first]): the steady-state output rate.
* ``ideal_fps`` = 1 / max(mean(preprocess + prefix), mean(handoff_net + suffix)) over the frames whose periods
  the rate spans (all measured frames but the first), from this run's own per-frame stage times: the rate of a
  two-stage pipeline without overhead, whose throughput is set by its slowest stage (Hennessy and Patterson,
  "Computer Architecture: A Quantitative Approach", on pipelining). ``efficiency`` = fps / ideal_fps, goal
  >= 0.9. Means, not medians, because fps is itself a mean (frames over their time span): a frame slowed by
  other work on the machine lengthens both alike, so the ratio shows what the pipeline adds, not the machine's
  other load (ratios slightly above 1 are noise). ``efficiency_p50`` uses the medians instead.
* ``latency``: ``e2e`` against ``stage_sum`` = preprocess + prefix + suffix (the computing stages; hand-off,
  queueing and gaps are what the pipeline adds); ``overhead`` = e2e - stage_sum per frame. Goal: median overhead
  <= 0.05 x median stage_sum + 2 ms.

Suffix-bound case (``suffix_bound``, :func:`run_suffix_bound`): the presets above are split prefix-bound, so no
frame waits in the ring. When the suffix is the slower stage, a frame can wait: up to ring-slots - 1 suffix
periods with FIFO delivery, up to one prefix period with newest-first delivery, and about nothing when the
prefix also paces itself to the suffix's announced next read (``PrefixRunner.pacing_delay_s``; e2e counts from
the prefix's start, i.e. from the newest camera frame at that moment). The case runs a preset with its suffix
made slow by a busy wait, in the three variants, and reports the same latency figures for each.
"""
from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

from .common import DEFAULT_BAG, REPO_ROOT, Worker, percentiles

#: Default image size (px) of the presets whose 640 px ViT-L is too slow for one CPU core.
DEFAULT_IMAGE_SIZES = {"minddrive-0.5b": 112, "minddrive-3b": 112, "orion": 112}
#: Default measured frames per preset (after the warm-up frames); other presets get 10.
DEFAULT_FRAMES = {"tiny": 40, "smol": 30, "minddrive-0.5b": 8}
DEFAULT_CACHE = REPO_ROOT / "out" / "benchmark" / "models"
#: Ego state fed to models that take one: (speed m/s, acceleration m/s^2, yaw rate rad/s), about the embedded
#: bag's speed. Its value changes no timing.
EGO_STATE = (1.27, 0.0, 0.0)
RING_SLOTS = 4  # the prefix node's default ring_slots


# ------------------------------------------------------------------------------------------ configuration

# ------------------------------------------------------------------------------------------ frames

def load_bag_frames(bag: str | Path = DEFAULT_BAG, transport: str = "compressed") -> list[tuple[list, int]]:
    """The bag's synchronized camera frames: a list of (items, stamp_ns), items in camera order as
    ``PrefixRunner.run`` takes them (``(transport, message)``; messages deserialized by rosbags, which carry
    the fields of sensor_msgs/CompressedImage / Image). Frames are grouped by the k-th message of each camera
    topic; the stamp is camera 0's receive time."""
    from rosbags.typesys import Stores, get_typestore

    from ...util.bags import camera_topics, played_topic, read_bag

    msgs = read_bag(bag)
    topics = camera_topics(msgs, transport)
    store = get_typestore(Stores.ROS2_KILTED)
    per_cam = [[m for m in msgs if m.topic == played_topic(t, transport)] for t in topics]
    n = min(len(c) for c in per_cam)
    frames = []
    for k in range(n):
        items = [(transport, store.deserialize_cdr(c[k].raw, c[k].msgtype)) for c in per_cam]
        frames.append((items, per_cam[0][k].t_ns))
    return frames


def _frame(frames: list, i: int) -> tuple[list, int]:
    items, stamp = frames[i % len(frames)]
    return items, stamp + (i // len(frames)) * 10**10  # each loop 10 s later: stamps keep increasing


# ------------------------------------------------------------------------------------------ split choice

def split_profile_task(chan, *, model_path: str, dtype: str, threads: int = 1, bag: str = str(DEFAULT_BAG),
                       repeats: int = 3) -> dict:
    """Worker (on the prefix core): per-block profile of the checkpoint (:func:`profile_model`, one vision and
    one LLM block timed and counted for all) and the camera preprocessing time of the bag's frames (ms)."""
    import torch

    from ...model.config import VLAConfig
    from ...split.profiler import profile_model
    from ...vehicle.image import compressed_msg_to_rgb, image_msg_to_rgb, preprocess

    torch.set_num_threads(threads)
    cfg = VLAConfig.load(model_path)
    doc = profile_model(model_path=model_path, dtype=dtype, threads=threads, device="cpu", repeats=repeats,
                        warmup=1, vision_blocks="1", llm_blocks="1")
    cpu = doc["devices"]["cpu"]
    items, _ = load_bag_frames(bag)[0]
    out = torch.empty((cfg.n_cameras, 3, cfg.image_size, cfg.image_size))

    def pre():  # what PrefixRunner.decode + preprocess do for a frame
        imgs = [compressed_msg_to_rgb(m) if t == "compressed" else image_msg_to_rgb(m, copy=False) for t, m in items]
        preprocess(imgs, cfg.image_size, cfg.image_mean, cfg.image_std, out=out, resize=cfg.image_resize)

    pre()
    samples = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter_ns()
        pre()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    state_bytes = doc["handoff_bytes"]
    ring = min(cpu["handoff"]["ring"], key=lambda e: abs(e["bytes"] - state_bytes))
    return {"parts_ms": cpu["parts_ms"], "vision_blocks_ms": cpu["vision_blocks_ms"],
            "llm_blocks_ms": cpu["llm_blocks_ms"], "handoff_ms": ring["ms"], "state_bytes": state_bytes,
            "preprocess_ms": sorted(samples)[len(samples) // 2], "threads": cpu["threads"], "cores": cpu["cores"]}


def choose_split(profile: dict, margin: float = 0.05) -> dict:
    """Split layer from a profile (:func:`split_profile_task`'s result; times in ms).

    P(K) = preprocess + vision embeddings + vision blocks + vision post-norm + projector and embeddings
    + (rotary tables if K > 0) + LLM blocks [0, K); S(K) = (rotary if K < L) + blocks [K, L) + final norm and
    heads; H = ring hand-off of the hidden states. Returns ``split_layer`` = the smallest K with
    P(K) >= (1 + margin) (H + S(K)) (L when there is none), ``balanced_split_layer`` = argmin_K max(P(K),
    H + S(K)), and ``table``: [K, P(K), H + S(K)] for every K."""
    parts, blocks = profile["parts_ms"], profile["llm_blocks_ms"]
    L = len(blocks)
    front = (profile["preprocess_ms"] + parts["vision_embeddings"] + sum(profile["vision_blocks_ms"])
             + parts["vision_post"] + parts["projector_embed"])
    table = []
    for k in range(L + 1):
        p = front + (parts["rotary"] if k > 0 else 0.0) + sum(blocks[:k])
        s = profile["handoff_ms"] + (parts["rotary"] if k < L else 0.0) + sum(blocks[k:]) + parts["head"]
        table.append([k, p, s])
    chosen = next((k for k, p, s in table if p >= (1.0 + margin) * s), L)
    balanced = min(table, key=lambda r: (max(r[1], r[2]), r[0]))[0]
    return {"split_layer": chosen, "balanced_split_layer": balanced, "margin": margin, "table": table,
            "predicted_prefix_ms": table[chosen][1], "predicted_handoff_suffix_ms": table[chosen][2]}


def plan_check(choice: dict, stages_ms: dict) -> dict:
    """The profile's prediction at the chosen K against a pipeline run there, and the K it would choose knowing its
    error (ms; ``stages_ms``: :func:`summarize_pipeline`'s ``stages_ms``, p50 of each stage).

    ``prefix_error`` = measured (preprocess + prefix) / predicted P(K), ``suffix_error`` = measured (hand-off +
    suffix) / predicted H + S(K), the hand-off without the frame's wait in the ring (``handoff_net_ms``: a
    suffix-bound run's frames queue there, which is not the suffix's time); the run is ``prefix_bound`` when its
    measured prefix is the slower side. The margin that keeps the choice prefix-bound under that error is
    ``margin_needed`` = (1 + margin) x suffix_error / prefix_error - 1 (the errors taken as the same fraction at
    every K: they come mostly from the two stages running side by side on a shared memory bus, which a
    one-stage-at-a-time profile does not see);
    ``corrected_split_layer`` is :func:`choose_split`'s rule on the same table with max(margin, margin_needed)."""
    k = choice["split_layer"]
    measured_p = stages_ms["preprocess_ms"]["p50"] + stages_ms["prefix_ms"]["p50"]
    measured_s = stages_ms["handoff_net_ms"]["p50"] + stages_ms["suffix_ms"]["p50"]  # not the wait in the ring
    prefix_error = measured_p / choice["predicted_prefix_ms"]
    suffix_error = measured_s / choice["predicted_handoff_suffix_ms"]
    needed = (1.0 + choice["margin"]) * suffix_error / prefix_error - 1.0
    margin = max(choice["margin"], needed)
    table = choice["table"]
    corrected = next((row[0] for row in table if row[1] >= (1.0 + margin) * row[2]), table[-1][0])
    return {"split_layer": k, "predicted_prefix_ms": choice["predicted_prefix_ms"],
            "predicted_handoff_suffix_ms": choice["predicted_handoff_suffix_ms"], "measured_prefix_ms": measured_p,
            "measured_handoff_suffix_ms": measured_s, "prefix_error": prefix_error, "suffix_error": suffix_error,
            "prefix_bound": measured_p >= measured_s, "margin": choice["margin"], "margin_needed": needed,
            "corrected_split_layer": corrected}


# ------------------------------------------------------------------------------------------ worker tasks

def _suffix_record(r) -> dict:
    m = r.meta
    return {"seq": m.seq, "preprocess_ms": r.preprocess_ms, "prefix_ms": r.prefix_ms, "handoff_ms": r.handoff_ms,
            "suffix_ms": r.suffix_ms, "t_prefix_start_ns": r.t_prefix_start_ns, "t_write_start_ns": m.t_write_start_ns,
            "t_publish_ns": m.t_publish_ns, "t_ready_ns": r.t_ready_ns, "t_suffix_end_ns": r.t_suffix_end_ns,
            "split_layer": m.split_layer}


def prefix_task(chan, *, model_path: str, split_layer: int, dtype: str, ring_name: str, threads: int, total: int,
                bag: str = str(DEFAULT_BAG), device: str = "cpu", pace: bool = False,
                rebalance_times: list | None = None, load_step: dict | None = None) -> dict:
    """Worker: the prefix process. Waits for ``go``, runs ``total`` frames back to back (``pace``: each after
    ``PrefixRunner.pacing_delay_s``, as the prefix node's ``pace_to_suffix`` does), reports, then keeps the ring
    until ``close`` (so the suffix can read the last frames).

    ``rebalance_times``: the profile's :class:`~hybrid_vla_ros.split.rebalance.StageTimes` of every K, each as a
    dict of its fields (JSON from the parent): after each frame the prefix node's
    :class:`~hybrid_vla_ros.runtime.split_control.SplitLayerControl` judges the stage times (its latency balancer)
    and requests the move it decides, as with ``split_layer: auto`` (the result's ``moves``: {frame, from_k, to_k,
    reason} each). ``load_step``: {"start": frame index, "stop": frame index, "cores": [...]}: a co-tenant (one busy
    process per core, :class:`~.cotenant.CoTenant`) runs on those cores from frame ``start`` to ``stop``."""
    import torch

    from ...runtime.loops import PrefixLoop, counting_context
    from ...runtime.prefix import PrefixRunner
    from ...runtime.settings import PrefixRunnerSettings
    from ...runtime.split_control import SplitLayerControl
    from ...split.rebalance import LatencyBalancer, SplitPolicy, StageTimes
    from .cotenant import CoTenant

    torch.set_num_threads(threads)
    frames = load_bag_frames(bag)
    runner = PrefixRunner(model_path, PrefixRunnerSettings(split_layer, device=device, dtype=dtype,
                                                           ring_name=ring_name, ring_slots=RING_SLOTS,
                                                           torch_threads=threads))
    cotenant = CoTenant(load_step["cores"]) if load_step else None
    records, moves = [], []
    ctx, drops = counting_context(runner)
    control = None
    if rebalance_times:  # the node's split-layer control, on the profile's per-K times instead of a plan
        balancer = LatencyBalancer([StageTimes(**t) for t in rebalance_times], paced=pace)
        control = SplitLayerControl.of_policy(ctx, SplitPolicy(None, latency=balancer), on_move=lambda move, k: (
            moves.append({"frame": len(records), "from_k": k, "to_k": move.k, "reason": move.reason})))
    scene = bag_scene(runner.cfg, bag)
    loop = PrefixLoop(ctx, pace=pace, frame_inputs=lambda stamp, items: _frame_inputs(runner.cfg, stamp, scene),
                      after_frame=(lambda: control.after_frame(None)) if control is not None else None)
    try:
        chan.send({"type": "ready"})
        chan.recv()  # go
        for i in range(total):
            if cotenant is not None and i == load_step["start"]:
                cotenant.start()
            if cotenant is not None and i == load_step["stop"]:
                cotenant.stop()
            items, stamp = _frame(frames, i)
            t_call = time.monotonic_ns()
            r = loop.process((stamp, items))
            t_ret = time.monotonic_ns()
            if r is None:
                raise RuntimeError(f"the prefix dropped frame {i}: {drops}")
            records.append({"seq": r.seq, "preprocess_ms": r.preprocess_ms, "prefix_ms": r.prefix_ms,
                            "t_call_ns": t_call, "t_return_ns": t_ret, "split_layer": r.split_layer})
        stats = runner.ring.stats
        chan.send({"type": "done"})
        chan.recv()  # close: the suffix has what it needs
        return {"records": records, "ring_stats": stats.as_dict(), "moves": moves}
    finally:
        if cotenant is not None:
            cotenant.stop()
        runner.close()


def suffix_task(chan, *, model_path: str, split_layer: int, dtype: str, ring_name: str, threads: int, total: int,
                idle_timeout_s: float = 120.0, delivery: str = "newest", suffix_extra_ms: float = 0.0) -> dict:
    """Worker: the suffix process. Attaches to the ring, says ``ready``, then computes frames until the one with
    seq ``total`` (the last frame is never dropped: only the oldest READY slot is ever overwritten, and newest
    first delivery takes it). ``suffix_extra_ms``: a busy wait added to every suffix stage call (a suffix made
    slow, to run a suffix-bound pipeline with a small model)."""
    import torch

    from ...runtime.loops import SuffixLoop, counting_context
    from ...runtime.settings import SuffixRunnerSettings
    from ...runtime.suffix import SuffixRunner

    torch.set_num_threads(threads)
    runner = SuffixRunner(model_path, SuffixRunnerSettings(split_layer, dtype=dtype, ring_name=ring_name,
                                                           threads=threads, delivery=delivery))
    if suffix_extra_ms > 0:
        # The busy wait goes where the runner computes each frame (its backend's plan_all, eager or compiled), so
        # it lands inside the suffix stage's timer whatever path the frame takes.
        real_plan_all = runner.backend.plan_all

        def slow_plan_all(*args, **kwargs):
            out = real_plan_all(*args, **kwargs)
            end = time.perf_counter() + suffix_extra_ms / 1e3
            while time.perf_counter() < end:  # compute-like: the core stays busy
                pass
            return out

        runner.backend.plan_all = slow_plan_all
    try:
        runner.wait_attached(300)
        chan.send({"type": "ready"})
        records = []
        ctx, drops = counting_context(runner)
        loop = SuffixLoop(ctx, publish=lambda r: records.append(_suffix_record(r)))
        t_last = time.monotonic()
        while not records or records[-1]["seq"] < total:
            if loop.poll_once(1.0) is not None:
                t_last = time.monotonic()
            elif time.monotonic() - t_last > idle_timeout_s:
                last = records[-1]["seq"] if records else 0
                raise TimeoutError(f"no frame for {idle_timeout_s} s after seq {last} (dropped: {drops})")
        return {"records": records, "ring_stats": runner.ring_stats().as_dict()}
    finally:
        runner.close()


def bag_scene(cfg, bag: str | Path = DEFAULT_BAG):
    """The query heads' scene inputs of the bag's first frame, as a prefix node makes them
    (:class:`~hybrid_vla_ros.model.query_heads.SceneInputs`), or None for a checkpoint without the heads:
    ``lidar2img`` from each camera's first CameraInfo (``<camera>/camera_info``, model camera order) and the bag's
    ``/tf_static`` through :class:`~hybrid_vla_ros.vehicle.camera_geometry.CameraCalibration` (the prefix node's
    default ``base_frame`` and ``model_frame_origin``), the ego pose of the first odometry message (position, yaw)
    with the bench's ego state :data:`EGO_STATE`, the default navigation command. The image sizes are not checked
    against the CameraInfo (a bench part may time other frames of the same size class: the geometry does not change
    what a frame costs). Raises ValueError naming what the bag lacks, or the calibration's error."""
    from rosbags.typesys import Stores, get_typestore

    from ...model.config import takes_scene
    from ...model.modeling import DEFAULT_COMMAND
    from ...model.query_heads import EgoFrame, SceneInputs
    from ...ros.params import camera_info_topic
    from ...ros.settings import PrefixNodeSettings
    from ...util.bags import camera_topics, read_bag
    from ...vehicle.camera_geometry import CalibrationError, CameraCalibration, ModelFrame, ego_motion_inputs
    from ...vehicle.trajectory import quaternion_to_yaw

    if not takes_scene(cfg):
        return None
    import torch

    msgs = read_bag(bag)
    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in msgs:
        first.setdefault(m.topic, m)
    defaults = PrefixNodeSettings()
    model = ModelFrame(tuple(defaults.model_frame_origin))
    calibration = CameraCalibration(cfg.n_cameras, model, cfg.image_size, cfg.image_resize, defaults.base_frame)
    infos = [camera_info_topic(t) for t in camera_topics(msgs, "compressed")][:cfg.n_cameras]
    missing = [t for t in infos if t not in first] + [t for t in ("/tf_static", "/localization/kinematic_state")
                                                      if t not in first]
    if missing or len(infos) < cfg.n_cameras:
        raise ValueError(f"the bag {bag} lacks the query heads' inputs: {', '.join(missing) or 'cameras'}")
    for cam, topic in enumerate(infos):
        problem = calibration.set_camera_info(cam, store.deserialize_cdr(first[topic].raw, first[topic].msgtype))
        if problem is not None:
            raise ValueError(f"{topic}: {problem}")
    for m in msgs:
        if m.topic == "/tf_static":
            calibration.add_static_transforms(store.deserialize_cdr(m.raw, m.msgtype))
    try:
        lidar2img = calibration.lidar2img()
    except CalibrationError as e:
        raise ValueError(f"the bag {bag}'s calibration: {e}") from e
    odom = first["/localization/kinematic_state"]
    pose = store.deserialize_cdr(odom.raw, odom.msgtype).pose.pose
    q = pose.orientation
    ego_pose, can_bus = ego_motion_inputs(pose.position.x, pose.position.y, pose.position.z,
                                          quaternion_to_yaw(q.x, q.y, q.z, q.w), *EGO_STATE, model)
    frame = EgoFrame(timestamp=odom.t_ns * 1e-9, ego_pose=torch.from_numpy(ego_pose),
                     can_bus=torch.from_numpy(can_bus), command=DEFAULT_COMMAND)
    return SceneInputs(lidar2img=torch.from_numpy(lidar2img), frame=frame)


def _frame_inputs(cfg, stamp_ns: int, scene=None):
    """A bench frame's inputs beside its cameras (:class:`~hybrid_vla_ros.runtime.loops.FrameInputs`): the fixed ego
    state where the model takes one; for the published query heads ``scene`` (:func:`bag_scene`, the embedded
    bag's calibration) with the frame's stamp as its time, so the heads' memory carries from frame to frame."""
    from dataclasses import replace

    from ...runtime.loops import FrameInputs

    if scene is not None:
        scene = replace(scene, frame=replace(scene.frame, timestamp=stamp_ns * 1e-9))
    return FrameInputs(ego_state=EGO_STATE if cfg.ego_state_input else None, scene=scene)


def sequential_task(chan, *, model_path: str, split_layer: int, dtype: str, ring_name: str, threads: int, total: int,
                    bag: str = str(DEFAULT_BAG), device: str = "cpu") -> dict:
    """Worker: prefix then suffix on each frame in one process (same classes, same ring code)."""
    import torch

    from ...runtime.prefix import PrefixRunner
    from ...runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
    from ...runtime.suffix import SuffixRunner

    torch.set_num_threads(threads)
    frames = load_bag_frames(bag)
    prefix = PrefixRunner(model_path, PrefixRunnerSettings(split_layer, device=device, dtype=dtype,
                                                           ring_name=ring_name, ring_slots=RING_SLOTS,
                                                           torch_threads=threads))
    suffix = SuffixRunner(model_path, SuffixRunnerSettings(split_layer, dtype=dtype, ring_name=ring_name,
                                                           threads=threads))
    try:
        suffix.poll(0)  # attach before the first publish (a frame published earlier counts as stale)
        if not suffix.attached:
            raise RuntimeError(f"suffix could not attach: {suffix.attach_error}")
        records = []
        scene = bag_scene(prefix.cfg, bag)
        for i in range(total):
            items, stamp = _frame(frames, i)
            got = _frame_inputs(prefix.cfg, stamp, scene)
            prefix.run(items, stamp, got.ego_state, scene=got.scene)
            r = suffix.poll(60.0)
            if r is None:
                raise TimeoutError("the suffix got no frame in the sequential run")
            records.append(_suffix_record(r))
        return {"records": records, "threads": torch.get_num_threads()}
    finally:
        suffix.close()
        prefix.close()


# ------------------------------------------------------------------------------------------ summaries

def frame_rows(records: list[dict]) -> list[dict]:
    """Per-frame derived times (ms) from suffix records, in processing order (see the module docstring)."""
    recs = sorted(records, key=lambda r: r["seq"])
    rows = []
    prev_end = None
    for r in recs:
        wait = max(0.0, (prev_end - r["t_publish_ns"]) / 1e6) if prev_end is not None else 0.0
        handoff = (r["t_ready_ns"] - r["t_write_start_ns"]) / 1e6
        pre, pfx, suf = r["preprocess_ms"], r["prefix_ms"], r["suffix_ms"]
        e2e = (r["t_suffix_end_ns"] - r["t_prefix_start_ns"]) / 1e6
        copy = (r["t_publish_ns"] - r["t_write_start_ns"]) / 1e6
        rows.append({
            "seq": r["seq"], "preprocess_ms": pre, "prefix_ms": pfx, "copy_ms": copy, "queue_wait_ms": wait,
            "handoff_ms": handoff, "handoff_net_ms": handoff - wait, "wake_ms": handoff - wait - copy,
            "suffix_ms": suf,
            "e2e_ms": e2e, "stage_sum_ms": pre + pfx + suf, "overhead_ms": e2e - (pre + pfx + suf),
            "gap_ms": e2e - (pre + pfx + handoff + suf),  # non-finite check + slot acquire between prefix and copy
            "t_prefix_start_ns": r["t_prefix_start_ns"], "t_suffix_end_ns": r["t_suffix_end_ns"],
            "t_ready_ns": r["t_ready_ns"], "t_write_start_ns": r["t_write_start_ns"],
            "t_publish_ns": r["t_publish_ns"],
        })
        prev_end = r["t_suffix_end_ns"]
    return rows


def _rate(instants_ns: list[int]) -> float:
    """Frames per second from completion instants: (n - 1) / (last - first); NaN with fewer than 2."""
    if len(instants_ns) < 2 or instants_ns[-1] <= instants_ns[0]:
        return float("nan")
    return (len(instants_ns) - 1) / ((instants_ns[-1] - instants_ns[0]) / 1e9)


_STAGE_KEYS = ("preprocess_ms", "prefix_ms", "copy_ms", "queue_wait_ms", "handoff_ms", "handoff_net_ms", "wake_ms",
               "suffix_ms", "e2e_ms", "stage_sum_ms", "overhead_ms", "gap_ms")


def summarize_pipeline(suffix_records: list[dict], prefix_records: list[dict], warmup: int, total: int,
                       latency_rel: float = 0.05, latency_abs_ms: float = 2.0) -> dict:
    """Figures of one pipeline run (module docstring): frames with seq > ``warmup`` count."""
    rows = [r for r in frame_rows(suffix_records) if r["seq"] > warmup]
    stages = {k: percentiles([r[k] for r in rows]) for k in _STAGE_KEYS}
    prefix_side = percentiles([r["preprocess_ms"] + r["prefix_ms"] for r in rows])
    suffix_side = percentiles([r["handoff_net_ms"] + r["suffix_ms"] for r in rows])
    # the rate spans the n - 1 periods that end at frames 2..n: average the stage times of those same frames
    span = rows[1:] if len(rows) > 1 else rows
    ideal_period = max(percentiles([r["preprocess_ms"] + r["prefix_ms"] for r in span])["mean"],
                       percentiles([r["handoff_net_ms"] + r["suffix_ms"] for r in span])["mean"])
    ideal_p50 = max(prefix_side["p50"], suffix_side["p50"])
    fps = _rate([r["t_suffix_end_ns"] for r in rows])
    pre_meas = [p for p in prefix_records if p["seq"] > warmup]
    cycle = percentiles([(p["t_return_ns"] - p["t_call_ns"]) / 1e6 for p in pre_meas])
    e2e, ssum, over = stages["e2e_ms"]["p50"], stages["stage_sum_ms"]["p50"], stages["overhead_ms"]["p50"]
    allowed = latency_rel * ssum + latency_abs_ms
    return {
        "frames_total": total, "warmup_frames": warmup, "frames_measured": len(rows),
        "frames_dropped": sum(1 for p in pre_meas if p["seq"] not in {r["seq"] for r in rows}),
        "stages_ms": stages,
        "prefix_side_ms": prefix_side, "handoff_suffix_side_ms": suffix_side,
        "bottleneck": "prefix" if prefix_side["mean"] >= suffix_side["mean"] else "handoff+suffix",
        "prefix_cycle_ms": cycle,
        "fps": fps, "input_fps": _rate([p["t_call_ns"] for p in pre_meas]),
        "ideal_fps": 1e3 / ideal_period if ideal_period > 0 else float("nan"),
        "efficiency": fps * ideal_period / 1e3, "efficiency_p50": fps * ideal_p50 / 1e3,
        "efficiency_vs_prefix_cycle": fps * max(cycle["mean"], suffix_side["mean"]) / 1e3,
        "latency": {"e2e_p50_ms": e2e, "e2e_p90_ms": stages["e2e_ms"]["p90"], "stage_sum_p50_ms": ssum,
                    "overhead_p50_ms": over, "overhead_ratio": over / ssum if ssum else float("nan"),
                    "allowed_ms": allowed, "goal": f"median(e2e - stage_sum) <= {latency_rel} x median(stage_sum) "
                                                   f"+ {latency_abs_ms} ms",
                    "met": bool(over <= allowed)},
        "timeline": [{k: r[k] for k in ("seq", "t_prefix_start_ns", "t_write_start_ns", "t_publish_ns", "t_ready_ns",
                                         "t_suffix_end_ns")} for r in rows],
        "frames": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                   for r in frame_rows(suffix_records)],  # every frame, warm-up included, for offline analysis
    }


def summarize_sequential(records: list[dict], warmup: int) -> dict:
    """Figures of a sequential run: per-frame stage times (ms), fps from completions, e2e latency."""
    rows = [r for r in frame_rows(records) if r["seq"] > warmup]
    return {"frames_measured": len(rows), "fps": _rate([r["t_suffix_end_ns"] for r in rows]),
            "stages_ms": {k: percentiles([r[k] for r in rows]) for k in
                          ("preprocess_ms", "prefix_ms", "handoff_ms", "suffix_ms", "e2e_ms", "stage_sum_ms")}}


# ------------------------------------------------------------------------------------------ orchestration

def run_pipeline_once(model_path: Path, split_layer: int, dtype: str, *, prefix_cores, suffix_cores, frames: int,
                      warmup: int, bag: Path, expected_frame_s: float, delivery: str = "newest", pace: bool = False,
                      suffix_extra_ms: float = 0.0, prefix_extra: dict | None = None, log=print) -> dict:
    """One two-process pipeline run; returns the raw records of both workers. ``prefix_extra``: more arguments of
    :func:`prefix_task` (``rebalance_times``, ``load_step``)."""
    ring = f"bench_pipe_{uuid.uuid4().hex[:10]}"
    total = warmup + frames
    common = {"model_path": str(model_path), "split_layer": split_layer, "dtype": dtype, "ring_name": ring,
              "total": total}
    budget = 300 + 3 * total * expected_frame_s
    with Worker("pipeline_suffix", {**common, "threads": len(suffix_cores), "delivery": delivery,
                                    "suffix_extra_ms": suffix_extra_ms,
                                    "idle_timeout_s": 120 + 5 * expected_frame_s}, cores=list(suffix_cores)) as suf, \
            Worker("pipeline_prefix", {**common, "threads": len(prefix_cores), "bag": str(bag), "pace": pace,
                                       **(prefix_extra or {})}, cores=list(prefix_cores)) as pre:
        pre.recv(600, expect="ready")
        suf.recv(600, expect="ready")
        pre.send({"type": "go"})
        pre.recv(budget, expect="done")
        s = suf.result(budget)
        pre.send({"type": "close"})
        p = pre.result(120)
    return {"prefix": p, "suffix": s}


def run_sequential(model_path: Path, split_layer: int, dtype: str, *, cores, frames: int, warmup: int, bag: Path,
                   expected_frame_s: float) -> dict:
    """The stages one after the other in one worker pinned to ``cores`` on the same bag frames: frames/s and
    end-to-end ms (p50) of ``frames`` frames after ``warmup``, the baseline of the pipeline's efficiency.
    ``expected_frame_s`` (s) sizes the worker's time budget. Raises what the worker raised."""
    ring = f"bench_seq_{uuid.uuid4().hex[:10]}"
    args = {"model_path": str(model_path), "split_layer": split_layer, "dtype": dtype, "ring_name": ring,
            "threads": len(cores), "total": warmup + frames, "bag": str(bag)}
    with Worker("pipeline_sequential", args, cores=list(cores)) as w:
        return w.result(300 + 3 * (warmup + frames) * expected_frame_s)


def prepare_preset(name: str, *, dtype: str, image_size: int | None, split_layer: int | None, cache: Path,
                   prefix_cores, bag: Path, margin: float, profile_repeats: int = 3, log=print) -> dict:
    """Checkpoint and split layer of one preset (shared by the pipeline and preprocessing parts)."""
    from ...model.config import VLAConfig

    from ..harness import ensure_checkpoint, sized

    overrides = sized(name, image_size)
    path = ensure_checkpoint(cache, name, overrides, dtype, log=log)
    cfg = VLAConfig.load(path)
    plan = {"preset": name, "model_path": str(path), "dtype": dtype, "num_layers": cfg.num_layers,
            "image_size": cfg.image_size, "image_size_overridden": bool(overrides),
            "num_tokens": cfg.num_tokens, "prefix_state_shape": list(cfg.prefix_state_shape),
            "note": (f"image size overridden to {cfg.image_size} px (preset: "
                     f"{_preset_image(name)} px) so the vision encoder fits one CPU core; "
                     f"the query projector keeps {cfg.num_vision_tokens} LLM tokens, T = {cfg.num_tokens}")
            if overrides else ""}
    if split_layer is not None:
        plan.update(split_layer=int(split_layer), split_reason="given on the command line", profile=None)
        return plan
    log(f"  profiling {name} on cores {list(prefix_cores)} to choose K")
    with Worker("split_profile", {"model_path": str(path), "dtype": dtype, "threads": len(prefix_cores),
                                  "bag": str(bag), "repeats": profile_repeats}, cores=list(prefix_cores)) as w:
        prof = w.result(1200)
    choice = choose_split(prof, margin)
    plan.update(split_layer=choice["split_layer"], profile=prof, choice=choice,
                split_reason=(f"smallest K with predicted prefix >= {1 + margin:.2f} x (hand-off + suffix): "
                              f"P({choice['split_layer']}) = {choice['predicted_prefix_ms']:.1f} ms vs H + S = "
                              f"{choice['predicted_handoff_suffix_ms']:.1f} ms; prefix-bound, so no frame waits in "
                              f"the ring (best-balanced K would be {choice['balanced_split_layer']})"))
    return plan


def _preset_image(name: str) -> int:
    from ...model.config import preset

    return preset(name).image_size


def run_preset(plan: dict, *, frames: int, warmup: int, prefix_cores, suffix_cores, sequential=("1core", "2core"),
               bag: Path = DEFAULT_BAG, log=print) -> dict:
    """Pipeline and sequential runs of one prepared preset; returns its JSON entry."""
    path, k, dtype = Path(plan["model_path"]), plan["split_layer"], plan["dtype"]
    choice = plan.get("choice")
    expected = (max(choice["predicted_prefix_ms"], choice["predicted_handoff_suffix_ms"]) / 1e3) if choice else 5.0
    log(f"  {plan['preset']}: pipeline K={k} {dtype}, {warmup}+{frames} frames (prefix cores {list(prefix_cores)}, "
        f"suffix cores {list(suffix_cores)})")
    def pipeline_at(k: int) -> dict:
        raw = run_pipeline_once(path, k, dtype, prefix_cores=prefix_cores, suffix_cores=suffix_cores, frames=frames,
                                warmup=warmup, bag=bag, expected_frame_s=expected, log=log)
        pipe = summarize_pipeline(raw["suffix"]["records"], raw["prefix"]["records"], warmup, warmup + frames)
        pipe["ring_stats"] = {"producer": raw["prefix"]["ring_stats"], "consumer": raw["suffix"]["ring_stats"]}
        return pipe

    pipe = pipeline_at(k)
    checks = []
    if choice:  # the plan against its own error: a K that ran suffix-bound is chosen again knowing the error
        checks.append(plan_check(choice, pipe["stages_ms"]))
        c = checks[-1]
        log(f"  {plan['preset']}: K={k} predicted prefix {c['predicted_prefix_ms']:.1f} ms vs hand-off + suffix "
            f"{c['predicted_handoff_suffix_ms']:.1f}; measured {c['measured_prefix_ms']:.1f} vs "
            f"{c['measured_handoff_suffix_ms']:.1f} (errors x{c['prefix_error']:.2f} / x{c['suffix_error']:.2f})")
        if not c["prefix_bound"] and c["corrected_split_layer"] != k:
            k = c["corrected_split_layer"]
            log(f"  {plan['preset']}: ran suffix-bound; margin {c['margin_needed']:.2f} from the measured error "
                f"-> K={k}")
            choice = {**choice, "split_layer": k, "margin": max(choice["margin"], c["margin_needed"]),
                      "predicted_prefix_ms": choice["table"][k][1],
                      "predicted_handoff_suffix_ms": choice["table"][k][2]}
            pipe = pipeline_at(k)
            checks.append(plan_check(choice, pipe["stages_ms"]))
    entry = {**{key: plan[key] for key in ("preset", "model_path", "dtype", "num_layers", "image_size",
                                           "image_size_overridden", "num_tokens", "prefix_state_shape", "note",
                                           "split_reason")},
             "split_layer": k, "plan_checks": checks,
             "prefix_cores": list(prefix_cores), "suffix_cores": list(suffix_cores), "pipeline": pipe,
             "split_choice": {key: choice[key] for key in ("balanced_split_layer", "margin", "table",
                                                            "predicted_prefix_ms", "predicted_handoff_suffix_ms")}
             if choice else None,
             "sequential": {}}
    if len(checks) > 1:
        first = checks[0]
        entry["split_reason"] += (f"; K = {first['split_layer']} ran suffix-bound ({first['measured_prefix_ms']:.1f}"
                                  f" against {first['measured_handoff_suffix_ms']:.1f} ms), so K = {k} from a margin "
                                  f"of {first['margin_needed']:.2f} sized by the measured error (plan_checks)")
    seq_cores = {"1core": list(prefix_cores), "2core": sorted(set(prefix_cores) | set(suffix_cores))}
    for mode in sequential:
        log(f"  {plan['preset']}: sequential {mode} (cores {seq_cores[mode]})")
        raw_s = run_sequential(path, k, dtype, cores=seq_cores[mode], frames=frames, warmup=warmup, bag=bag,
                               expected_frame_s=2 * expected)
        s = summarize_sequential(raw_s["records"], warmup)
        s.update(cores=seq_cores[mode], threads=raw_s["threads"])
        s["pipeline_speedup_fps"] = pipe["fps"] / s["fps"]
        s["pipeline_e2e_ratio"] = pipe["latency"]["e2e_p50_ms"] / s["stages_ms"]["e2e_ms"]["p50"]
        entry["sequential"][mode] = s
    if "1core" in entry["sequential"]:
        alone = entry["sequential"]["1core"]["stages_ms"]
        st = pipe["stages_ms"]
        entry["contention"] = {  # stage time in the pipeline / the same stage alone on one core
            "prefix": (st["preprocess_ms"]["p50"] + st["prefix_ms"]["p50"])
            / (alone["preprocess_ms"]["p50"] + alone["prefix_ms"]["p50"]),
            "suffix": st["suffix_ms"]["p50"] / alone["suffix_ms"]["p50"]}
    return entry


#: The suffix-bound case's variants: name -> (delivery, pace the prefix to the suffix).
SUFFIX_BOUND_VARIANTS = {"fifo": ("fifo", False), "newest": ("newest", False), "newest_paced": ("newest", True)}


def run_suffix_bound(plan: dict, *, split_layer: int, suffix_extra_ms: float, frames: int, warmup: int,
                     prefix_cores, suffix_cores, bag: Path = DEFAULT_BAG, log=print) -> dict:
    """A suffix-bound pipeline (the preset's suffix made ``suffix_extra_ms`` slower with a busy wait) in three
    variants (:data:`SUFFIX_BOUND_VARIANTS`): FIFO delivery (frames queue in the ring), newest first (a frame
    waits up to one prefix period) and newest first with the prefix paced to the suffix's announced next read
    (the default of the nodes). Returns {preset, split_layer, suffix_extra_ms, warmup_frames, variants: {name:
    figures}}, figures as :func:`summarize_pipeline`'s plus the ring's counters, and ``error`` when a variant was
    not suffix-bound: its suffix took less than the busy wait (it did not reach the runner), or hand-off + suffix
    was not the slower side (the goal is then not met)."""
    path = Path(plan["model_path"])
    out = {"preset": plan["preset"], "split_layer": split_layer, "suffix_extra_ms": suffix_extra_ms,
           "dtype": plan["dtype"], "warmup_frames": warmup, "variants": {}}
    for name, (delivery, pace) in SUFFIX_BOUND_VARIANTS.items():
        log(f"  suffix-bound {plan['preset']} K={split_layer} (+{suffix_extra_ms:g} ms suffix): {name}")
        raw = run_pipeline_once(path, split_layer, plan["dtype"], prefix_cores=prefix_cores, suffix_cores=suffix_cores,
                                frames=frames, warmup=warmup, bag=bag, expected_frame_s=1.0, delivery=delivery,
                                pace=pace, suffix_extra_ms=suffix_extra_ms, log=log)
        total = warmup + frames
        pipe = summarize_pipeline(raw["suffix"]["records"], raw["prefix"]["records"], warmup, total)
        pipe.pop("frames", None)
        pipe["ring_stats"] = {"producer": raw["prefix"]["ring_stats"], "consumer": raw["suffix"]["ring_stats"]}
        suffix_p50 = pipe["stages_ms"]["suffix_ms"]["p50"]
        if suffix_p50 < suffix_extra_ms:  # the slowed suffix did not run: the case would not be suffix-bound
            out["error"] = (f"{name}: the suffix took {suffix_p50:.1f} ms (p50), less than the {suffix_extra_ms:g} "
                            "ms busy wait added to it; the wait did not reach the runner, so this pipeline was not "
                            "suffix-bound")
        elif pipe["bottleneck"] != "handoff+suffix":
            out["error"] = (f"{name}: hand-off + suffix ({pipe['handoff_suffix_side_ms']['mean']:.1f} ms, mean) was "
                            f"not slower than the prefix ({pipe['prefix_side_ms']['mean']:.1f} ms): not suffix-bound; "
                            "give a longer busy wait or a smaller K")
        if out.get("error"):
            log(f"    ERROR {out['error']}")
        out["variants"][name] = pipe
        lat = pipe["latency"]
        log(f"    e2e p50 {lat['e2e_p50_ms']:.1f} ms vs stages {lat['stage_sum_p50_ms']:.1f} ms: overhead "
            f"{lat['overhead_p50_ms']:.1f} ms (allowed {lat['allowed_ms']:.1f}), {pipe['fps']:.2f} fps")
    return out


def _suffix_bound_warmup(plan: dict, split_layer: int, suffix_extra_ms: float, measured: dict | None = None) -> int:
    """Warm-up frames of the suffix-bound case. The suffix announces its next read from its second frame on, so
    until then nothing is paced and the prefix publishes back to back: warm up for one suffix frame at the prefix
    rate, plus 3 (the suffix's second read, and a paced frame before the measured ones). Prefix P and hand-off +
    suffix S (ms) come from the profile's row at ``split_layer`` (``plan["choice"]["table"]``, rows [K, P, H + S],
    :func:`choose_split`), else from ``measured`` (this preset's pipeline run: ``prefix_side_ms`` and
    ``handoff_suffix_side_ms`` p50, at its own K); ``suffix_extra_ms`` is added to S. A 2 s suffix behind an 80 ms
    prefix: 29 frames. 3 when neither is known."""
    table = (plan.get("choice") or {}).get("table") or []
    row = next((r for r in table if r[0] == split_layer), None)
    if row is not None:
        prefix_ms, suffix_ms = row[1], row[2]
    elif measured:
        prefix_ms, suffix_ms = measured["prefix_side_ms"]["p50"], measured["handoff_suffix_side_ms"]["p50"]
    else:
        return 3
    if not prefix_ms or prefix_ms <= 0:
        return 3
    return math.ceil((suffix_ms + suffix_extra_ms) / prefix_ms) + 3


def run_pipeline_part(plans: dict, *, frames: dict, warmup: int, prefix_cores, suffix_cores,
                      sequential=("1core", "2core"), bag: Path = DEFAULT_BAG, efficiency_goal: float = 0.9,
                      suffix_bound: dict | None = None, log=print) -> dict:
    """The whole pipeline part for prepared presets (:func:`prepare_preset`); returns its JSON section.
    ``suffix_bound``: {preset, split_layer, suffix_extra_ms, frames} for :func:`run_suffix_bound` (its preset
    must be among ``plans``), or None."""
    presets = []
    for name, plan in plans.items():
        presets.append(run_preset(plan, frames=frames[name], warmup=warmup, prefix_cores=prefix_cores,
                                  suffix_cores=suffix_cores, sequential=sequential, bag=bag, log=log))
        if presets[-1]["split_layer"] != plan["split_layer"]:  # chosen again from the measured error: the later
            plan.update(split_layer=presets[-1]["split_layer"],  # parts (load step, preprocessing) run there too
                        split_reason=presets[-1]["split_reason"])
        p = presets[-1]["pipeline"]
        log(f"  {name}: {p['fps']:.2f} fps of ideal {p['ideal_fps']:.2f} (efficiency {p['efficiency']:.3f}), "
            f"e2e {p['latency']['e2e_p50_ms']:.1f} ms vs stages {p['latency']['stage_sum_p50_ms']:.1f} ms")
    bound = None
    if suffix_bound and suffix_bound["preset"] in plans:
        measured = next((p["pipeline"] for p in presets if p.get("preset") == suffix_bound["preset"]), None)
        settle = _suffix_bound_warmup(plans[suffix_bound["preset"]], suffix_bound["split_layer"],
                                      suffix_bound["suffix_extra_ms"], measured)
        bound = run_suffix_bound(plans[suffix_bound["preset"]], split_layer=suffix_bound["split_layer"],
                                 suffix_extra_ms=suffix_bound["suffix_extra_ms"], frames=suffix_bound["frames"],
                                 warmup=max(warmup, settle), prefix_cores=prefix_cores,
                                 suffix_cores=suffix_cores, bag=bag, log=log)
    return {"bag": str(Path(bag).relative_to(REPO_ROOT)) if Path(bag).is_relative_to(REPO_ROOT) else str(bag),
            "suffix_bound": bound,
            "frames": "6 JPEG cameras 1936x1216 (CompressedImage), looped", "warmup_frames": warmup,
            "efficiency_goal": efficiency_goal,
            "latency_goal": "median(e2e - stage_sum) <= 0.05 x median(stage_sum) + 2 ms",
            "sequential_modes": list(sequential), "presets": presets}
