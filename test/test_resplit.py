"""Live re-split without ROS: both runners move K while frames flow; every output stays exact."""
import uuid

import pytest
import torch

from hybrid_vla_ros.model.checkpoint import load_stage
from hybrid_vla_ros.runtime.prefix import PrefixRunner
from hybrid_vla_ros.runtime.settings import PrefixRunnerSettings, SuffixRunnerSettings
from hybrid_vla_ros.runtime.suffix import SuffixRunner
from hybrid_vla_ros.vehicle.image import compressed_msg_to_rgb, preprocess


@pytest.fixture(scope="module")
def references(tiny_checkpoint, frames):
    full = load_stage(tiny_checkpoint, "full")
    cfg = full.cfg
    out = {}
    with torch.inference_mode():
        for stamp, items in frames:
            pixels = preprocess([compressed_msg_to_rgb(m) for _, m in items], cfg.image_size, cfg.image_mean,
                                cfg.image_std)
            out[stamp] = full(pixels).double().numpy()
    return out


def _pair(tiny_checkpoint, k):
    ns = f"/rs_{uuid.uuid4().hex[:6]}"
    return (PrefixRunner(str(tiny_checkpoint), PrefixRunnerSettings(k, device="cpu", namespace=ns, ring_slots=8)),
            SuffixRunner(str(tiny_checkpoint),  # frames wait in the ring here
                         SuffixRunnerSettings(k, namespace=ns, delivery="fifo")))


def test_resplit_up_and_down_keeps_every_frame_exact(tiny_checkpoint, frames, references):
    prefix, suffix = _pair(tiny_checkpoint, 2)
    L = prefix.cfg.num_layers
    try:
        assert suffix.poll(0.05) is None  # attach
        schedule = {3: 4, 6: 0, 9: 1}  # frame index -> new K asked of the prefix before that frame
        seen = []
        for i in range(12):
            stamp, items = frames[i % len(frames)]  # the bag holds 3 synchronized frames: loop it
            event = None
            if i in schedule:
                prefix.request_split_layer(schedule[i])
                event = prefix.apply_split_request(timeout=None)  # as the node's idle worker does
            published = prefix.run(items, stamp)
            assert published.resplit is None, "applied before the frame"
            result = suffix.poll(5.0)
            assert result.meta.seq == published.seq and result.meta.split_layer == published.split_layer
            assert abs(result.waypoints - references[stamp]).max() <= 1e-5, f"frame {i} at K={published.split_layer}"
            assert len(prefix.stage.layers) == published.split_layer
            seen.append((published.split_layer, event, result.resplits))
        assert [k for k, _, _ in seen] == [2] * 3 + [4] * 3 + [0] * 3 + [1] * 3
        up = seen[3][1]
        assert (up.old_split_layer, up.new_split_layer, up.blocks_loaded) == (2, 4, 2) and up.load_ms > 0
        assert up.stage_bytes_after > up.stage_bytes_before
        down = seen[6][1]
        assert (down.blocks_freed, down.stage_bytes_after < down.stage_bytes_before) == (4, True)
        # The suffix was not told: it freed blocks when K went up, loaded them on demand when it went down.
        assert [e.new_split_layer for e in seen[3][2]] == [4] and seen[3][2][0].blocks_freed == 2
        assert seen[6][2][0].on_demand and seen[6][2][0].blocks_loaded == 4
        assert len(suffix.stage.layers) == L - 1 and suffix.stage.split_layer == 1
    finally:
        suffix.close()
        prefix.close()


def test_frames_in_flight_finish_with_the_k_they_started_with(tiny_checkpoint, frames, references):
    """Three frames wait in the ring at K=3 when the prefix moves to K=1; the suffix was asked to get
    ready for K=1 first, so it loads blocks once, before any frame, and keeps them through the old frames."""
    prefix, suffix = _pair(tiny_checkpoint, 3)
    try:
        assert suffix.poll(0.05) is None
        for stamp, items in frames[:3]:
            prefix.run(items, stamp)
        suffix.request_split_layer(1)
        prefix.request_split_layer(1)
        for stamp, items in frames[:2]:
            prefix.run(items, stamp)
        results = [suffix.poll(5.0) for _ in range(5)]
        assert [r.meta.split_layer for r in results] == [3, 3, 3, 1, 1]
        for r in results:
            assert abs(r.waypoints - references[r.meta.stamp_ns]).max() <= 1e-5
        loads = [e for r in results for e in r.resplits]
        assert len(loads) == 1 and not loads[0].on_demand and loads[0].blocks_loaded == 2
        assert any(loads[0] in r.resplits for r in results[:4]) and not any(r.resplits for r in results[4:]), \
            "loaded in the background, swapped in by the first K=1 frame at the latest"
    finally:
        suffix.close()
        prefix.close()


def test_bad_split_requests_are_refused_and_change_nothing(tiny_checkpoint, frames):
    prefix, suffix = _pair(tiny_checkpoint, 2)
    try:
        for bad in (-1, prefix.cfg.num_layers + 1, True, "2"):
            with pytest.raises(ValueError, match="split_layer"):
                prefix.request_split_layer(bad)
            with pytest.raises(ValueError, match="split_layer"):
                suffix.request_split_layer(bad)
        stamp, items = frames[0]
        assert prefix.run(items, stamp).resplit is None and prefix.split_layer == 2
    finally:
        suffix.close()
        prefix.close()


def test_a_move_up_loads_in_the_background_while_frames_continue(tiny_checkpoint, frames, references):
    """run() never waits for blocks: frames go out at the old K until the load is done, then at the new K."""
    prefix, suffix = _pair(tiny_checkpoint, 0)
    try:
        assert suffix.poll(0.05) is None
        prefix.request_split_layer(4)
        ks = []
        for i in range(40):
            stamp, items = frames[i % len(frames)]
            published = prefix.run(items, stamp)
            result = suffix.poll(5.0)
            assert abs(result.waypoints - references[stamp]).max() <= 1e-5
            ks.append(published.split_layer)
            if published.split_layer == 4:
                assert published.resplit is not None or ks.count(4) > 1
                break
        assert ks[-1] == 4 and ks == sorted(ks) and set(ks) <= {0, 4}, ks
    finally:
        suffix.close()
        prefix.close()


def test_memory_pressure_moves_k_down_by_the_shortfall():
    """split_layer auto under memory pressure (the prefix node's 2 s check, ROS-free): the orion fp16 plan,
    the prefix at K=32, another process leaves 1 GiB free under a 3 GiB threshold: giving back the 2 GiB
    shortfall needs K <= 32 - ceil(2 GiB / 0.405 GB per block) = 26."""
    from hybrid_vla_ros.split.planner import (
        budget_under_pressure,
        choose_split_layer,
        plan_for_preset,
    )

    plan = plan_for_preset("orion", dtype="fp16")
    assert budget_under_pressure(plan, 32, free_bytes=4 * 2**30, threshold_bytes=3 * 2**30) is None
    budget = budget_under_pressure(plan, 32, free_bytes=1 * 2**30, threshold_bytes=3 * 2**30)
    assert budget == plan.row(32).gpu_total_bytes - 2 * 2**30
    k, reason = choose_split_layer(plan.rows, budget)
    per_block = plan.row(32).gpu_weight_bytes - plan.row(31).gpu_weight_bytes
    assert k == 32 - -(-2 * 2**30 // per_block) == 26, reason
    assert plan.row(k).gpu_total_bytes <= budget < plan.row(k + 1).gpu_total_bytes


def test_a_move_that_is_no_longer_wanted_frees_its_blocks(tiny_checkpoint, frames):
    """K 1 -> 4 requested, then 0 before the load is taken: the loaded blocks are dropped, not kept."""
    prefix, suffix = _pair(tiny_checkpoint, 1)
    try:
        prefix.request_split_layer(4)
        assert prefix.split.prefetcher.pending == (1, 4)
        prefix.request_split_layer(0)
        assert prefix.split.prefetcher.pending is None
        event = prefix.apply_split_request(timeout=None)
        assert (event.new_split_layer, event.blocks_freed, len(prefix.stage.layers)) == (0, 1, 0)
        suffix.request_split_layer(0)
        assert suffix.split.prefetcher.pending == (0, 1)
        suffix.request_split_layer(3)
        assert suffix.split.prefetcher.pending is None
    finally:
        suffix.close()
        prefix.close()


def test_a_failed_load_drops_the_request_and_loses_no_frame(tmp_path, tiny_checkpoint, frames, references):
    import shutil

    from hybrid_vla_ros.model.checkpoint import WEIGHTS_FILE
    from hybrid_vla_ros.split.resplit import ResplitError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    prefix, suffix = _pair(ckpt, 3)
    try:
        assert suffix.poll(0.05) is None
        (ckpt / WEIGHTS_FILE).rename(tmp_path / "moved")  # the checkpoint goes away under the running nodes
        prefix.request_split_layer(4)
        with pytest.raises(ResplitError, match="not applied, K stays 3"):
            prefix.apply_split_request(timeout=None)  # the node's idle worker counts this as resplit_error
        prefix.request_split_layer(4)
        assert prefix.split.prefetcher.prefetch(3, 4).exception(timeout=10) is not None  # the load has failed
        suffix.request_split_layer(1)
        stamp, items = frames[0]
        published = prefix.run(items, stamp)  # the frame still goes out, at the K it had
        assert published.split_layer == 3 and "not applied, K stays 3" in published.resplit_error
        with pytest.raises(ResplitError, match="request dropped"):
            suffix.poll(5.0)
        result = suffix.poll(5.0)  # reported once; the frame is still there and exact
        assert result.meta.seq == published.seq and abs(result.waypoints - references[stamp]).max() <= 1e-5
        assert not prefix.split_requested and prefix.run(items, stamp).resplit_error is None
    finally:
        suffix.close()
        prefix.close()
