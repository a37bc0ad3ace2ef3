"""Issue 21: the VAE planner as published (model/vae_planner.py), against the published code: MindDrive's
detector methods ``distribution_forward`` / ``future_states_predict`` and their ``pw_`` (path) twins, called on a
small module carrying the attributes they read, with the published ``DistributionModule`` / ``PredictModel``
(../shared/reference/minddrive, loaded by path: test/minddrive_reference.py), on the same weights, LLM feature and
noise, fp32.

The published methods hard-code the LLM width in a reshape (896 for Qwen2-0.5B, 2048, else 4096), so the
comparison runs at MindDrive 0.5B's width, 896, with its two planners' shapes: speed (7 modes x 6 steps) and path
(6 modes x 20 steps). Their per-step decoding loop sits inside the detector's test-time forward, not in a method:
the test runs those few published lines (a loop over the steps through ``ego_fut_decoder``) itself."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hybrid_vla_ros.model.vae_planner import LATENT_DIM, VAEPlanner
from minddrive_reference import load_detector

WIDTH = 896  # Qwen2-0.5B: the width the published reshape takes for lm_model_type "qwen2"


def _published_planner(distributions, modes: int, steps: int, path: bool) -> nn.Module:
    """A module with the attributes the published planner methods read, built from the published classes (its
    ``ego_fut_decoder``: Linear 2D -> 2D, ReLU, Linear 2D -> 2D, ReLU, Linear 2D -> 2M, as the detector builds it)."""
    torch.manual_seed(11 if path else 7)
    m = nn.Module()
    pre = "pw_" if path else ""
    setattr(m, f"{pre}present_distribution", distributions.DistributionModule(WIDTH, LATENT_DIM, min_log_sigma=-5.0,
                                                                              max_log_sigma=5.0))
    setattr(m, f"{pre}predict_model", distributions.PredictModel(in_channels=LATENT_DIM, out_channels=WIDTH,
                                                                 hidden_channels=WIDTH // 4, num_layers=4))
    w = 2 * WIDTH
    setattr(m, f"{pre}ego_fut_decoder", nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                                      nn.Linear(w, 2 * modes)))
    with torch.no_grad():  # a wide latent (sigma ~ e^2, as a trained planner's can be), so the noise moves the plan
        getattr(m, f"{pre}present_distribution").last_conv[1].bias[LATENT_DIM:] += 2.0
    m.latent_dim, m.layer_dim, m.with_cur, m.lm_model_type = LATENT_DIM, 4, True, "qwen2"
    m.fut_ts = m.fut_ps = steps
    return m.eval()


def _published_positions(detector, ref: nn.Module, feature: torch.Tensor, noise: torch.Tensor, modes: int,
                         steps: int, path: bool) -> torch.Tensor:
    """The published test-time planner on one LLM feature (1, D): (1, M, N, 2) positions (the per-step deltas'
    cumulative sum, as its post-processing takes of the selected mode)."""
    current = feature.unsqueeze(1)  # (1, 1, D): ego_feature[:, k].unsqueeze(1)
    if path:
        sample, _ = detector.Minddrive.pw_distribution_forward(ref, current, None, noise)
        states_hs, _ = detector.Minddrive.pw_future_states_predict(ref, 1, sample, current, current)
        decoder = ref.pw_ego_fut_decoder
    else:
        sample, _ = detector.Minddrive.distribution_forward(ref, current, None, noise)
        states_hs, _ = detector.Minddrive.future_states_predict(ref, 1, sample, current, current)
        decoder = ref.ego_fut_decoder
    query_hs = states_hs[:, :, 0, :].unsqueeze(1).permute(0, 2, 1, 3)
    deltas = torch.stack([decoder(query_hs[i]).reshape(1, modes, 2) for i in range(steps)], dim=2)
    return deltas.cumsum(-2)


@pytest.mark.parametrize("planner", ["speed", "path"])
def test_vae_planner_equals_the_published_code(monkeypatch, planner):
    """Our VAEPlanner, loaded with the published planner's tensors by their names (the path planner's without its
    ``pw_`` prefix; strict), gives the published positions for the same noise within 1e-4, and with no noise the
    published positions at zero noise (z = mu); the training-only posterior is not part of it."""
    detector, distributions = load_detector(monkeypatch)
    path = planner == "path"
    modes, steps = (6, 20) if path else (7, 6)
    ref = _published_planner(distributions, modes, steps, path)
    ours = VAEPlanner(WIDTH, steps, modes).eval()
    state = {k.removeprefix("pw_"): v for k, v in ref.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    g = torch.Generator().manual_seed(3)
    feature = torch.randn(1, WIDTH, generator=g) * 2.0
    noise = torch.randn(1, 1, LATENT_DIM, generator=g)
    with torch.no_grad():
        expected = _published_positions(detector, ref, feature, noise, modes, steps, path)[0]
        got = ours(feature[0], noise.view(LATENT_DIM))
        expected0 = _published_positions(detector, ref, feature, torch.zeros_like(noise), modes, steps, path)[0]
        got0 = ours(feature[0])
    assert got.shape == expected.shape == (modes, steps, 2) and got.dtype == torch.float32
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-4 * scale, float((got - expected).abs().max() / scale)
    assert (got0 - expected0).abs().max() <= 1e-4 * expected0.abs().max()
    # the noise moves the plan by far more than the tolerance: a planner that ignored it would fail above
    assert (got0 - expected).abs().max() > 10 * 1e-4 * scale


def test_a_batch_and_bf16_weights_and_a_bad_width():
    """A batch of states gives each state's plan; bf16 weights take an fp32 state (cast to the weights, the
    output float32); a width the GRU's four initial states cannot split evenly is refused."""
    torch.manual_seed(0)
    p = VAEPlanner(64, 6, 3).eval()
    h = torch.randn(2, 64)
    with torch.no_grad():
        both = p(h)
        assert both.shape == (2, 3, 6, 2)
        assert torch.allclose(both[1], p(h[1]), atol=1e-6)
        low = p.to(torch.bfloat16)(h[0])
    assert low.dtype == torch.float32 and low.shape == (3, 6, 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        VAEPlanner(60, 6, 3)


def test_the_vae_read_out_turns_the_published_frame_into_base_link():
    """The published planner plans in Bench2Drive's lidar frame (x right, y forward); the `vae` read-out's plan is in
    base_link axes (x forward, y left): a published step straight ahead (0, +d) becomes (+d, 0), one to the right
    (+d, 0) becomes (0, -d)."""
    from hybrid_vla_ros.model.config import preset
    from hybrid_vla_ros.model.modeling import SuffixStage, plan
    from hybrid_vla_ros.model.vae_planner import published_to_base_link

    ahead_right = torch.tensor([[0.0, 2.0], [1.5, 0.0]])
    assert torch.equal(published_to_base_link(ahead_right), torch.tensor([[2.0, 0.0], [0.0, -1.5]]))
    cfg = preset("tiny", readout={"type": "vae"})
    torch.manual_seed(0)
    suffix = SuffixStage(cfg, cfg.num_layers).eval()
    h = torch.randn(cfg.num_tokens, cfg.hidden_size)
    with torch.no_grad():
        raw = suffix.head(suffix.norm(h[-1]))
        out = plan(suffix, h, command=1)
    assert torch.equal(out.modes, published_to_base_link(raw)) and torch.equal(out.waypoints, out.modes[1])


# ------------------------------------------------------------------ MindDrive: speed and path planners together
def test_follow_path_drives_the_speed_plan_along_the_path():
    """Geometry from the path, timing from the speed plan: step lengths of the speed plan are distances along the
    path (hand-computed on an L-shaped path), beyond its end the last segment goes on, a speed plan that stays
    stays, a path of zero length gives the origin (no geometry to follow)."""
    from hybrid_vla_ros.model.vae_planner import follow_path

    path = torch.tensor([[0.0, 1.0], [0.0, 2.0], [1.0, 2.0], [2.0, 2.0]])  # 2 m ahead, then 2 m to the right
    speed = torch.tensor([[0.3, 1.4], [0.3, 2.9], [0.3, 4.4]])  # 1.5 m steps (sqrt(0.09 + 1.96) = 1.432 first)
    got = follow_path(speed, path)
    first = float(torch.tensor([0.3, 1.4]).norm())
    expected = torch.tensor([[0.0, first], [first + 1.5 - 2.0, 2.0], [first + 3.0 - 2.0, 2.0]])
    assert torch.allclose(got, expected, atol=1e-5), got
    assert torch.equal(follow_path(torch.zeros(4, 2), path), torch.zeros(4, 2))
    assert torch.equal(follow_path(speed, torch.zeros(5, 2)), torch.zeros(3, 2))
    broken = path.clone()
    broken[1, 0] = float("nan")  # a non-finite plan stays non-finite (the output guard drops it), never "stand still"
    assert not torch.isfinite(follow_path(speed, broken)).all()
    straight = torch.stack([torch.zeros(20), torch.arange(1.0, 21.0)], dim=-1)
    assert torch.allclose(follow_path(torch.tensor([[0.0, 5.0], [0.0, 30.0]]), straight),
                          torch.tensor([[0.0, 5.0], [0.0, 30.0]]))


def _speed_path_cfg(**kw):
    from hybrid_vla_ros.model.config import preset

    fields = dict(llm_passes=2, decision_token_ids=[11, 23, 35, 47, 59, 71, 83], planning_token_id=250,
                  readout={"type": "vae_speed_path", "path_token_id": 251, "path_points": 20})
    return preset("tiny", **{**fields, **kw})


def test_the_speed_path_read_out_plans_as_minddrive():
    """Two read-out tokens end the sequence (<waypoint_ego>, <path_waypoint_ego>); the speed planner reads the
    first, the path planner the second (action pass), the speed mode is the decision's argmax, the path mode the
    command's through MindDrive's mapping; the plan is the speed plan driven along the path, in base_link axes."""
    from hybrid_vla_ros.model.modeling import PrefixStage, SuffixStage, plan
    from hybrid_vla_ros.model.vae_planner import PATH_MODE_OF_COMMAND, follow_path, published_to_base_link

    cfg = _speed_path_cfg()
    mlp = _speed_path_cfg(readout={"type": "mlp"})
    assert cfg.num_tokens == mlp.num_tokens + 1 and cfg.readout_token_ids == [250, 251]
    torch.manual_seed(0)
    prefix = PrefixStage(cfg, 0).eval()
    with torch.no_grad():
        h0 = prefix(torch.randn(6, 3, 64, 64))
        ends = prefix.embed_tokens(torch.tensor([250, 251]))
    assert h0.shape == (2, cfg.num_tokens, cfg.hidden_size)
    assert torch.allclose(h0[1, -2:], ends + prefix.pass_embed.weight[1], atol=1e-6)
    suffix = SuffixStage(cfg, cfg.num_layers).eval()
    h = torch.randn(2, cfg.num_tokens, cfg.hidden_size)
    for command in range(6):
        with torch.no_grad():
            out = plan(suffix, h, command)
            decision = suffix.decision_head(suffix.norm(h[0, -2])).float()
            speed, path = suffix.head(suffix.norm(h[1, -2]), suffix.norm(h[1, -1]))
        k, j = int(decision.argmax()), PATH_MODE_OF_COMMAND[command]
        assert out.speed_mode == k and out.mode == j and out.modes.shape == (6, cfg.n_waypoints, 2)
        assert torch.allclose(out.waypoints, published_to_base_link(follow_path(speed[k], path[j])), atol=1e-6)
        assert torch.equal(out.path, published_to_base_link(path[j])) and out.path.shape == (20, 2)
        assert torch.equal(out.speed_waypoints, published_to_base_link(speed[k]))


def test_speed_path_config_errors():
    with pytest.raises(ValueError, match="path_token_id must be a token id"):
        _speed_path_cfg(readout={"type": "vae_speed_path", "path_points": 20})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pathpoints'\]"):
        _speed_path_cfg(readout={"type": "vae_speed_path", "path_token_id": 251, "pathpoints": 20})
    with pytest.raises(ValueError, match="and the decision_token_ids"):
        _speed_path_cfg(readout={"type": "vae_speed_path", "path_token_id": 23, "path_points": 20})
    with pytest.raises(ValueError, match=r"path_points must be an integer in \[1, 200\]"):
        _speed_path_cfg(readout={"type": "vae_speed_path", "path_token_id": 251, "path_points": 10**7})
    with pytest.raises(ValueError, match="path_token_id must be a token id"):
        _speed_path_cfg(readout={"type": "vae_speed_path", "path_token_id": 9999, "path_points": 20})
    with pytest.raises(ValueError, match="differ from planning_token_id"):
        _speed_path_cfg(readout={"type": "vae_speed_path", "path_token_id": 250, "path_points": 20})
    with pytest.raises(ValueError, match="needs decision_token_ids"):
        _speed_path_cfg(decision_token_ids=[])
