"""The VAE planner of Orion and MindDrive: a Gaussian latent from the LLM's planning-token state, a GRU rolling it
out over the future steps, and an MLP decoding each step's displacement per mode.

Sources: Fu et al., 2025 (Orion) and the published code (MindDrive, Apache-2.0), whose structure and parameter
names this follows, so a converted checkpoint loads one to one. The published test samples ``noise`` from N(0, 1)
every frame; here it defaults to zero (z = mu), so a frame's trajectory is reproducible.
"""
from __future__ import annotations

import torch
from torch import nn

#: Width of the latent (the published ``latent_dim``), its log-sigma clamp and the GRU depth (``layer_dim``).
LATENT_DIM = 32
LOG_SIGMA_RANGE = (-5.0, 5.0)
GRU_LAYERS = 4


class DistributionEncoder(nn.Module):
    """Three 1 x 1 convolutions with ReLU between: (B, D, 1) -> (B, D/2, 1)."""

    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv1d(width, 2 * width, kernel_size=1)
        self.conv2 = nn.Conv1d(2 * width, 2 * width, kernel_size=1)
        self.conv3 = nn.Conv1d(2 * width, width // 2, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Output in the parameters' dtype."""
        return self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))


class GaussianLatent(nn.Module):
    """The ``present_distribution``: (B, D) state -> (mu, log_sigma), each (B, LATENT_DIM)."""

    def __init__(self, width: int):
        super().__init__()
        self.encoder = DistributionEncoder(width)
        self.last_conv = nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Conv1d(width // 2, 2 * LATENT_DIM, kernel_size=1))

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.last_conv(self.encoder(state.unsqueeze(-1))).squeeze(-1)  # (B, 2 LATENT_DIM)
        return out[:, :LATENT_DIM], out[:, LATENT_DIM:].clamp(*LOG_SIGMA_RANGE)


class LatentRollout(nn.Module):
    """The ``predict_model``: a GRU over the N steps, the latent at every step as input, its initial hidden state
    the planning-token state cut into GRU_LAYERS consecutive pieces (layer l: dims [l D/4, (l+1) D/4)), then an
    MLP D/4 -> D."""

    def __init__(self, width: int):
        super().__init__()
        hidden = width // GRU_LAYERS
        self.gru = nn.GRU(input_size=LATENT_DIM, hidden_size=hidden, num_layers=GRU_LAYERS)
        self.linear1 = nn.Linear(hidden, 2 * hidden)
        self.linear2 = nn.Linear(2 * hidden, 4 * hidden)
        self.linear3 = nn.Linear(4 * hidden, width)

    def forward(self, z: torch.Tensor, state: torch.Tensor, steps: int) -> torch.Tensor:
        """z (B, LATENT_DIM), state (B, D) -> (steps, B, D)."""
        b, d = state.shape
        h0 = state.reshape(b, GRU_LAYERS, d // GRU_LAYERS).transpose(0, 1).contiguous()  # (layers, B, D/4)
        x, _ = self.gru(z.unsqueeze(0).expand(steps, -1, -1).contiguous(), h0)
        return self.linear3(torch.relu(self.linear2(torch.relu(self.linear1(x)))))


class VAEPlanner(nn.Module):
    """Waypoints of M modes over N steps from the planning token's final-norm state.

    ``forward(h, noise=None)``: h (H,) or (B, H) -> float32 (M, N, 2) or (B, M, N, 2) metres, cumulative, in the
    published planning frame (see :func:`published_to_base_link`). ``noise`` (LATENT_DIM,) or (B, LATENT_DIM),
    default zero. Raises ValueError unless H is a multiple of 8.

    The last decoder layer starts scaled by ``untrained_output_scale`` and without bias (as
    :attr:`~.modeling.PlanningHead.UNTRAINED_OUTPUT_SCALE`): untrained, centimetres of noise around the ego.
    """

    def __init__(self, hidden_size: int, n_waypoints: int, n_modes: int = 1, untrained_output_scale: float = 0.05):
        super().__init__()
        if hidden_size % (2 * GRU_LAYERS):
            raise ValueError(f"the VAE planner needs a width that is a multiple of {2 * GRU_LAYERS}, got "
                             f"{hidden_size}")
        self.n_waypoints, self.n_modes = n_waypoints, n_modes
        self.present_distribution = GaussianLatent(hidden_size)
        self.predict_model = LatentRollout(hidden_size)
        w = 2 * hidden_size
        self.ego_fut_decoder = nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                                             nn.Linear(w, 2 * n_modes))
        with torch.no_grad():
            self.ego_fut_decoder[4].weight.mul_(untrained_output_scale)
            self.ego_fut_decoder[4].bias.zero_()

    def mu_log_sigma(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H) -> (mu, log_sigma), each (B, LATENT_DIM)."""
        return self.present_distribution(h)

    def forward(self, h: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """See the class docstring."""
        single = h.dim() == 1
        state = h.unsqueeze(0) if single else h
        state = state.to(self.ego_fut_decoder[0].weight.dtype)
        mu, log_sigma = self.present_distribution(state)
        z = mu if noise is None else mu + log_sigma.exp() * noise.to(mu.dtype).reshape(mu.shape)
        rolled = self.predict_model(z, state, self.n_waypoints)  # (N, B, D)
        steps = torch.cat([state.unsqueeze(0).expand_as(rolled), rolled], dim=-1)  # (N, B, 2D)
        deltas = self.ego_fut_decoder(steps).float().unflatten(-1, (self.n_modes, 2))  # (N, B, M, 2)
        modes = torch.cumsum(deltas.permute(1, 2, 0, 3), dim=-2)  # (B, M, N, 2)
        return modes[0] if single else modes


def published_to_base_link(xy: torch.Tensor) -> torch.Tensor:
    """(..., 2) positions in the published planning frame (Bench2Drive's "lidar": x right, y forward) -> REP 103
    base_link axes, as the published CARLA agents rotate them (xiaomi-mlab/MindDrive, team_code). Their origin
    offset (0.39 m behind the vehicle's centre) is not applied: a trajectory starts at base_link's origin."""
    return torch.stack((xy[..., 1], -xy[..., 0]), dim=-1)


#: The published names of a planner's training-only part (the posterior over the latent given the future, used
#: to train): left out by the converter on purpose.
TRAINING_ONLY = ("future_distribution", "pw_future_distribution")


#: MindDrive's path mode for each navigation command (NAV_COMMANDS order, CARLA RoadOption - 1: LEFT, RIGHT,
#: STRAIGHT, LANE_FOLLOW, CHANGE_LANE_LEFT, CHANGE_LANE_RIGHT), from its published PATH_MAPPING / PA_MAPPING
#: (path modes: 0 lane follow, 1 straight, 2 turn left, 3 change lane left, 4 turn right, 5 change lane right).
PATH_MODE_OF_COMMAND = (2, 4, 1, 0, 3, 5)


class SpeedPathPlanner(nn.Module):
    """MindDrive's two planners: ``speed`` on ``<waypoint_ego>``'s state (a mode per meta-action, N steps of
    ``waypoint_dt_s``), ``path`` (``pw_*``) on ``<path_waypoint_ego>``'s (a mode per path kind, P points about 1 m
    apart). ``forward`` -> ((Ms, N, 2), (Mp, P, 2)) float32 metres in the published frame."""

    def __init__(self, hidden_size: int, n_waypoints: int, speed_modes: int, path_points: int, path_modes: int):
        super().__init__()
        self.speed = VAEPlanner(hidden_size, n_waypoints, speed_modes)
        self.path = VAEPlanner(hidden_size, path_points, path_modes)

    def forward(self, speed_state: torch.Tensor, path_state: torch.Tensor,
                noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.speed(speed_state, noise), self.path(path_state, noise)


def follow_path(speed_xy: torch.Tensor, path_xy: torch.Tensor) -> torch.Tensor:
    """The float32 positions (N, 2) reached along ``path_xy`` (P, 2; a polyline from the origin) at the times of
    ``speed_xy`` (N, 2), whose step lengths, whatever their direction (as the published speed controller reads
    them), are the distances travelled. This package's fusion (the published agents feed two controllers). The
    last segment extends beyond the end; a zero-length path gives the origin; non-finite plans stay non-finite."""
    speed_xy, path_xy = speed_xy.float(), path_xy.float()
    origin = speed_xy.new_zeros(1, 2)
    travelled = torch.cat([origin, speed_xy]).diff(dim=0).norm(dim=-1).cumsum(0)  # (N,)
    points = torch.cat([origin, path_xy])  # (P + 1, 2)
    seg = points.diff(dim=0)  # (P, 2)
    seg_len = seg.norm(dim=-1)
    start = torch.cat([seg_len.new_zeros(1), seg_len.cumsum(0)])  # arc length at each point, (P + 1,)
    j = (torch.searchsorted(start, travelled, right=True) - 1).clamp(0, seg.shape[0] - 1)  # segment of each step
    frac = (travelled - start[j]) / seg_len[j].clamp_min(1e-9)
    frac = torch.where(j < seg.shape[0] - 1, frac.clamp(max=1.0), frac)  # only the last segment extends
    pos = points[j] + frac.unsqueeze(-1) * seg[j]
    return torch.where(start[-1] == 0, torch.zeros_like(pos), pos)  # non-finite plans stay non-finite (dropped)
