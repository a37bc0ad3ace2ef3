"""The query heads (model/query_heads.py) against the published MindDrive heads (../shared/reference/minddrive,
loaded by test/minddrive_reference.py): same random weights, same image features and 3-D position embedding, same
ego motion, frame after frame, so the memory of both is exercised; fp32, relative difference <= 1e-4.

Sizes are reduced (2 decoder layers, 12 object and 20 lane queries, memories of 16) so a frame takes
milliseconds; n_control (11), the can-bus layout (89 inputs) and every code path are the published ones. The
published flash-attention kernel (CUDA fp16 only) is replaced by torch's attention with the same projections and
scale (minddrive_reference._sdpa_flash_attention).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from hybrid_vla_ros.model.camera_rays import RayEmbeddingConfig
from hybrid_vla_ros.model.query_heads import (EgoFrame, QueryHeads, QueryHeadsConfig,
                                              place_published_heads)
from minddrive_reference import published_heads_state, reference_heads

CFG = QueryHeadsConfig(embed_dims=256, in_channels=24, out_dims=48, num_layers=2, num_heads=8, feedforward_dims=64,
                       num_extra=8, num_query=12, memory_len=16, topk_proposals=8, num_propagated=8, num_memory=4,
                       scene_memory_len=8, memory_ffn_dims=64, num_lane=20, num_lanes_one2one=10, map_memory_len=16,
                       map_topk=8)
RAYS = RayEmbeddingConfig(embed_dims=256, depth_num=8)
CAMERAS, GRID_H, GRID_W = 2, 3, 4


def _reference_heads(monkeypatch):
    """(detection head, map head, shared encoders) of the reference at CFG's sizes (minddrive_reference)."""
    return reference_heads(monkeypatch, CFG)


def _published_state(det_head, map_head, shared, position_encoder) -> dict:
    return published_heads_state(det_head, map_head, shared, position_encoder, RAYS)


def _pose(yaw: float, x: float, y: float) -> torch.Tensor:
    c, s = math.cos(yaw), math.sin(yaw)
    return torch.tensor([[c, -s, 0, x], [s, c, 0, y], [0, 0, 1, 0.5], [0, 0, 0, 1]], dtype=torch.float32)


def _lidar2img(gen) -> torch.Tensor:
    """Two plausible cameras: focal 40 px, centre of the 64 x 48 image, looking along +y and -y of the model
    frame, 1.6 m up."""
    out = []
    for sign in (1.0, -1.0):
        k = torch.tensor([[40.0, 0, 32, 0], [0, 40.0, 24, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
        r = torch.tensor([[sign, 0, 0, 0], [0, 0, -1, 1.6], [0, sign, 0, 0], [0, 0, 0, 1.0]])
        out.append(k @ r)
    return torch.stack(out)


def _frames(n: int, gaps: list[float]):
    """``n`` frames: image features, an EgoFrame; the vehicle drives and turns a little between frames."""
    gen = torch.Generator().manual_seed(3)
    t, yaw, x, y = 1000.0, 0.3, 12.5, -4.0
    out = []
    for i in range(n):
        if i:
            t += gaps[i - 1]
            yaw, x, y = yaw + 0.02, x + 0.8 * math.cos(yaw), y + 0.8 * math.sin(yaw)
        feats = torch.randn(CAMERAS, CFG.in_channels, GRID_H, GRID_W, generator=gen)
        can_bus = torch.randn(18, generator=gen)
        can_bus[:3] = torch.tensor([x, y, 0.5])
        out.append((feats, EgoFrame(timestamp=t, ego_pose=_pose(yaw, x, y).double(), can_bus=can_bus.double(),
                                    command=3)))
    return out


def _reference_frame(det_head, map_head, pos_embed, feats, frame: EgoFrame, scene="s"):
    pose = frame.ego_pose.float()
    data = dict(img_feats=feats.unsqueeze(0), timestamp=torch.tensor([frame.timestamp], dtype=torch.float64),
                ego_pose=pose.unsqueeze(0), ego_pose_inv=torch.linalg.inv(frame.ego_pose).float().unsqueeze(0),
                can_bus=frame.can_bus.float().unsqueeze(0), command=torch.tensor([float(frame.command)]))
    metas = [{"scene_token": scene}]
    with torch.no_grad():
        lane_outs, map_tokens = map_head(metas, pos_embed.unsqueeze(0), **data)
        _, obj_tokens = det_head(metas, pos_embed.unsqueeze(0), lane_outs, **data)
    return torch.cat([obj_tokens[0], map_tokens[0]])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _rows_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Like _rel for two memories whose rows may come in another order among near-equal scores (the order of the
    kept queries does not change any result: attention does not depend on the order of its keys and queries)."""
    a, b = a.double().flatten(1), b.double().flatten(1)
    d = torch.cdist(a, b, p=float("inf"))  # the largest element difference of each pair of rows
    return float(max(d.min(dim=1).values.max(), d.min(dim=0).values.max()) / b.abs().max())


@pytest.fixture
def pair(monkeypatch):
    """(ours, the reference's (detection head, map head)) with the same weights."""
    det_head, map_head, shared = _reference_heads(monkeypatch)
    ours = QueryHeads(CFG, RAYS).eval()
    gen = torch.Generator().manual_seed(11)
    for p in ours.rays.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.1
    state = _published_state(det_head, map_head, shared, ours.rays.position_encoder)
    placed = place_published_heads(state, CFG, RAYS)
    ours.load_state_dict(placed.tensors, strict=True)
    return ours, (det_head, map_head), placed


def test_published_keys_are_all_placed_or_named(pair):
    ours, _, placed = pair
    # the output-only traffic-light branch and the loss weights are named, not placed; the six copies of each
    # branch and the three of each shared encoder were compared and placed once
    assert set(placed.left_out) >= {"pts_bbox_head.code_weights", "map_head.match_costs"}
    assert any(k.startswith("pts_bbox_head.tl_branches.") for k in placed.left_out)
    assert "pts_bbox_head.cls_branches.5.6.weight" in placed.checked
    assert {"query_pos.0.weight", "pts_bbox_head.query_pos.0.weight", "coords_d"} <= set(placed.checked)
    assert set(placed.tensors) == set(ours.state_dict())


def _kept(out_tokens, ref_tokens, ours, det_head, map_head) -> dict:
    """What both sides hold after a frame: name -> (ours, published, whether rows may come in another order)."""
    mem, lanes = ours.object_memory, ours.map_memory
    return {"tokens": (out_tokens, ref_tokens, False),
            "object memory": (mem.embedding, det_head.memory_embedding[0], True),
            "object centres": (mem.reference, det_head.memory_reference_point[0], True),
            "object poses": (mem.egopose, det_head.memory_egopose[0], True),
            "can-bus memory": (mem.can_bus, det_head.memory_canbus[0], False),
            "scene history": (mem.scene_query, det_head.memory_scene_query[0], True),
            "lane points": (lanes.reference, map_head.memory_reference_point[0], True),
            "lane memory": (lanes.embedding, map_head.memory_embedding[0], True)}


def _difference(a, b, rows: bool) -> float:
    return _rows_rel(a, b) if rows else _rel(a, b)


def test_scene_tokens_and_memory_follow_the_published_heads_frame_after_frame(pair):
    """Ours against the published heads, frame after frame, twice: in float64 (both lifted, test/float64_lift.py)
    they must agree to 1e-9 relative -- the same algorithm, any wrong mask, sign or transform is 1e-3 and up; in
    float32 (as they run) each kept tensor must be within 1e-4 relative, or within 8 x the published code's own
    float32 rounding of it (its float32 run against its float64 run), the larger. The second clause is needed:
    with these random weights the second decoder layer's self-attention over [queries; memory] has logits up to
    +-1400 with the two best keys 0.25 apart, so the rounding a remembered query carries from the last frame is
    amplified ~50x there: on an Intel AMX host the published code's own float32 memory is 2.8e-3 (relative) from
    its float64 result at frame 2, ours 4.2e-3 (docs/models.md, "Exactness on every host")."""
    from float64_lift import as_float64, float64_everywhere

    ours, (det_head, map_head), _ = pair
    ours64 = as_float64(copy.deepcopy(ours))
    det64, map64 = as_float64(copy.deepcopy(det_head)), as_float64(copy.deepcopy(map_head))
    lidar2img = _lidar2img(None)
    # 0.1 s apart, then a 2.5 s gap (the published memory restarts), then 0.1 s again
    frames = _frames(5, [0.1, 0.1, 2.5, 0.1])
    with torch.no_grad():
        pos_embed = ours.rays(lidar2img, GRID_H, GRID_W, GRID_H * 16, GRID_W * 16)
        with float64_everywhere():
            pos64 = ours64.rays(lidar2img.double(), GRID_H, GRID_W, GRID_H * 16, GRID_W * 16)
        for i, (feats, frame) in enumerate(frames):
            out = ours(feats, lidar2img, frame)
            ref = _reference_frame(det_head, map_head, pos_embed, feats, frame)
            with float64_everywhere():
                out64 = ours64(feats.double(), lidar2img.double(), frame)
                ref64 = _reference_frame(det64, map64, pos64, feats.double(), frame)
            assert out.tokens.shape == (CFG.scene_tokens, CFG.out_dims) == ref.shape
            assert out.memory_reset == out64.memory_reset == (i in (0, 3)), i
            kept = _kept(out.tokens, ref, ours, det_head, map_head)
            kept64 = _kept(out64.tokens, ref64, ours64, det64, map64)
            for name, (a, b, rows) in kept.items():
                a64, b64, _ = kept64[name]
                assert _difference(a64, b64, rows) <= 1e-9, (i, name, "float64", _difference(a64, b64, rows))
                allowed = max(1e-4, 8 * _difference(b, b64, rows))
                assert _difference(a, b, rows) <= allowed, (i, name, "float32", _difference(a, b, rows), allowed)
            assert torch.allclose(ours.object_memory.timestamp, det_head.memory_timestamp[0].double(), atol=1e-6)
    # the memory mattered: the same last frame on fresh heads gives other tokens
    fresh = QueryHeads(CFG, RAYS).eval()
    fresh.load_state_dict(ours.state_dict())
    with torch.no_grad():
        alone = fresh(*frames[-1][:1], lidar2img, frames[-1][1])
    assert _rel(alone.tokens, out.tokens) > 1e-2


def test_time_going_back_restarts_the_memory_and_bad_input_leaves_it_as_it_was(pair):
    ours, _, _ = pair
    lidar2img = _lidar2img(None)
    frames = _frames(3, [0.1, 0.1])
    with torch.no_grad():
        ours(frames[0][0], lidar2img, frames[0][1])
        ours(frames[1][0], lidar2img, frames[1][1])
        held = ours.object_memory.embedding.clone()
        # a frame with a broken pose, NaN can-bus or a bad command is refused, the memory untouched
        feats, frame = frames[2]
        scaled = torch.diag(torch.tensor([2.0, 2.0, 2.0, 1.0], dtype=torch.float64))  # not a rigid pose
        for bad in (dict(ego_pose=torch.zeros(4, 4, dtype=torch.float64)), dict(ego_pose=scaled),
                    dict(can_bus=torch.full((18,), float("nan"), dtype=torch.float64)), dict(command=9)):
            with pytest.raises(ValueError):
                ours(feats, lidar2img, EgoFrame(**{**frame.__dict__, **bad}))
            assert torch.equal(ours.object_memory.embedding, held)
        # a bag loop: the first frame again, earlier than the last one -> a fresh memory, as on fresh heads
        again = ours(frames[0][0], lidar2img, frames[0][1])
        fresh = QueryHeads(CFG, RAYS).eval()
        fresh.load_state_dict(ours.state_dict())
        first = fresh(frames[0][0], lidar2img, frames[0][1])
    assert again.memory_reset and torch.equal(again.tokens, first.tokens)


def test_place_published_heads_refuses_differing_copies_and_partial_checkpoints(pair):
    ours, (det_head, map_head), _ = pair
    shared = {n: getattr(det_head, n) for n in ("query_pos", "time_embedding", "ego_pose_pe")}
    state = _published_state(det_head, map_head, shared, ours.rays.position_encoder)
    broken = dict(state)
    broken["map_head.cls_branches.3.0.weight"] = broken["map_head.cls_branches.3.0.weight"] + 1
    with pytest.raises(ValueError, match="differs from the other copy"):
        place_published_heads(broken, CFG, RAYS)
    partial = {k: v for k, v in state.items() if not k.startswith("map_head.transformer.")}
    with pytest.raises(ValueError, match="partial checkpoint"):
        place_published_heads(partial, CFG, RAYS)
    wrong = dict(state)
    wrong["pts_bbox_head.pc_range"] = torch.tensor([-50.0, -50.0, -5.0, 50.0, 50.0, 3.0])
    with pytest.raises(ValueError, match="pc_range"):
        place_published_heads(wrong, CFG, RAYS)


def test_config_sizes_follow_the_published_heads():
    published = QueryHeadsConfig()
    assert (published.object_tokens, published.scene_tokens, published.can_bus_input) == (273, 529, 89)
    orion = QueryHeadsConfig(num_memory=0, out_dims=4096)
    assert orion.scene_tokens == 513
    with pytest.raises(ValueError, match="num_heads"):
        QueryHeadsConfig.from_dict({"num_heads": 7})
    with pytest.raises(ValueError, match="topk_proposals"):
        QueryHeadsConfig.from_dict({"memory_len": 500})


def test_the_heads_stay_float32_in_a_bf16_stage(pair):
    """A bf16 stage (a GPU prefix's dtype) keeps the heads in float32, as published: converting them changes no
    parameter's dtype, they take bf16 feature maps, and over three frames their tokens equal the float32 heads'
    on the same (bf16-rounded) features. The whole model casts the tokens to the stage's dtype."""
    ours, _, _ = pair
    half = QueryHeads(CFG, RAYS).eval()
    half.load_state_dict(ours.state_dict())
    half = half.to(torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.float32}
    half.half()
    assert {p.dtype for p in half.parameters()} == {torch.float32}
    lidar2img = _lidar2img(None)
    with torch.no_grad():
        for feats, frame in _frames(3, [0.1, 0.1]):
            rounded = feats.to(torch.bfloat16)
            want = ours(rounded.float(), lidar2img, frame).tokens
            got = half(rounded, lidar2img, frame).tokens
            assert got.dtype == torch.float32 and torch.equal(got, want)


def test_a_frame_with_non_finite_tokens_is_not_remembered(pair):
    ours, _, _ = pair
    lidar2img = _lidar2img(None)
    frames = _frames(3, [0.1, 0.1])
    with torch.no_grad():
        ours(frames[0][0], lidar2img, frames[0][1])
        held, last = ours.object_memory.embedding.clone(), ours.last_timestamp
        bad = frames[1][0].clone()
        bad[0, 0, 0, 0] = float("nan")  # a broken feature map: the runner refuses the frame's hidden states
        assert not torch.isfinite(ours(bad, lidar2img, frames[1][1]).tokens).all()
        assert torch.equal(ours.object_memory.embedding, held) and ours.last_timestamp == last
        assert torch.isfinite(ours(frames[2][0], lidar2img, frames[2][1]).tokens).all()  # the next frame is fine


def test_bad_sizes_and_frames_are_value_errors():
    from dataclasses import replace

    from hybrid_vla_ros.model.query_heads import example_scene_inputs

    for bad, needle in (({"num_memroy": 0}, "unknown key"), ({"num_extra": 700}, "num_extra"),
                        ({"embed_dims": 9, "num_heads": 3}, "even"), ({"num_propagated": 1.5}, "num_propagated"),
                        ({"num_propagated": None}, "num_propagated"), ({"pc_range": "abcdef"}, "pc_range"),
                        ({"with_mask": "no"}, "with_mask"), ({"num_memory": 1.5}, "num_memory")):
        with pytest.raises(ValueError, match=needle):
            QueryHeadsConfig.from_dict(bad)
    frame = example_scene_inputs(2, 64).frame
    import numpy as np

    for bad in (dict(command=2.7), dict(command=True), dict(timestamp=None), dict(ego_pose=np.eye(4))):
        with pytest.raises(ValueError):
            replace(frame, **bad).check()
