"""What every stage shares, whatever builds it (this package's model, a VLM, own code): the owned block range and
how it moves (:class:`PrefixSide`, :class:`SuffixSide`), and the planner's output (:class:`PlanOutput`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def check_split_layer(cfg, split_layer: int) -> None:
    """Raise ValueError unless 0 <= split_layer <= L (an int, not a bool)."""
    if isinstance(split_layer, bool) or not isinstance(split_layer, int):
        raise ValueError(f"split_layer must be an integer, got {split_layer!r}")
    if not 0 <= split_layer <= cfg.num_layers:
        raise ValueError(f"split_layer {split_layer} out of range [0, {cfg.num_layers}] for this model")


def _shift_layer_key(key: str, offset: int) -> str:
    if key.startswith("layers."):
        _, idx, rest = key.split(".", 2)
        return f"layers.{int(idx) + offset}.{rest}"
    return key



@dataclass
class PlanOutput:
    """Planner output of one frame; tensors float32, positions in metres.

    waypoints: (N, 2), ``modes[mode]`` with ``mode`` chosen by the navigation command; modes: (M, N, 2).
    decision_logits (two-pass models, else None): (6,) over NAV_COMMANDS, or with ``decision_token_ids``
    (MindDrive) the (D,) LM-head logits of those tokens, whose argmax is ``speed_mode`` (else None).
    """

    waypoints: torch.Tensor
    modes: torch.Tensor
    decision_logits: torch.Tensor | None = None
    mode: int = 0
    speed_mode: int | None = None
    #: ``vae_speed_path`` only (base_link axes, float32 metres): the speed planner's positions of the decided
    #: speed mode (N, 2) at dt .. N dt, and the path planner's points of the commanded path mode (P, 2).
    speed_waypoints: torch.Tensor | None = None
    path: torch.Tensor | None = None


class PrefixSide(nn.Module):
    """What every prefix stage shares: it owns decoder blocks [0, K) in ``layers`` (``split_layer`` = K)."""

    role = "prefix"

    def checkpoint_key(self, local_key: str) -> str:
        """Map a key of this stage's state dict to the checkpoint's (canonical) key."""
        return _shift_layer_key(local_key, 0)

    def move_split(self, split_layer: int, load_blocks) -> None:
        """Re-split in place to own blocks [0, split_layer); new blocks come from ``load_blocks(start, stop) ->
        nn.ModuleList`` (on this stage's device and dtype), dropped ones are freed. Raises ValueError out of range.
        """
        check_split_layer(self.cfg, split_layer)
        if split_layer > self.split_layer:
            self.layers.extend(load_blocks(self.split_layer, split_layer))
        else:
            del self.layers[split_layer:]
        self.split_layer = split_layer


class SuffixSide(nn.Module):
    """What every suffix stage shares: it owns decoder blocks [K, L) in ``layers`` (``split_layer`` = K)."""

    role = "suffix"

    def checkpoint_key(self, local_key: str) -> str:
        """Map a key of this stage's state dict to the checkpoint's (canonical) key."""
        return _shift_layer_key(local_key, self.split_layer)

    def _layers_from(self, split_layer: int | None) -> nn.ModuleList:
        """Blocks to run for h at ``split_layer`` (default K). Raises ValueError for one below K or above L."""
        k = self.split_layer if split_layer is None else split_layer
        if isinstance(k, bool) or not self.split_layer <= k <= self.cfg.num_layers:
            raise ValueError(f"hidden states at split layer {k}: this suffix holds blocks "
                             f"[{self.split_layer}, {self.cfg.num_layers})")
        return self.layers if k == self.split_layer else self.layers[k - self.split_layer:]

    def move_split(self, split_layer: int, load_blocks) -> None:
        """As :meth:`PrefixSide.move_split`, for blocks [split_layer, L)."""
        check_split_layer(self.cfg, split_layer)
        if split_layer < self.split_layer:
            self.layers = nn.ModuleList([*load_blocks(split_layer, self.split_layer), *self.layers])
        else:
            self.layers = self.layers[split_layer - self.split_layer:]
        self.split_layer = split_layer
