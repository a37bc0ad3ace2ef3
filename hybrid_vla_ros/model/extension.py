"""Own model code: a team's PyTorch VLA split at K without forking this package.

A checkpoint directory of own code holds its weights (``model.safetensors``, or shards with
``model.safetensors.index.json``, under the model's own state-dict names) and a ``config.json``::

    {"model_type": "hybrid_vla_code", "format_version": 1,
     "model_class": "my_team.vla:DrivingVLA",       # importable module : class
     "config": {...}}                                 # passed to the class as is

The class follows :class:`SplitModelCode`. To run on the nodes it also declares a ``driving`` dict
(:data:`DRIVING_KEYS`); without it the model runs in ``verify-split``, ``plan`` and ``profile`` only.

**Importing the class runs its code**: opt in with ``trust_model_code=True`` (``--trust-model-code``) or
``HYBRID_VLA_TRUST_MODEL_CODE=1``; otherwise the checkpoint is refused before anything is imported. The module
must be importable (installed or on ``PYTHONPATH``); nothing is imported from the checkpoint directory.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from .config import NAV_COMMANDS, RESIZE_FILTERS
from .sources import CheckpointError
from .stages import PlanOutput, PrefixSide, SuffixSide, check_split_layer

#: ``model_type`` of an own-code checkpoint's config.json.
CODE_MODEL_TYPE = "hybrid_vla_code"
CODE_FORMAT_VERSION = 1
#: Environment variable that opts in to importing own model code (value ``1``).
TRUST_ENV = "HYBRID_VLA_TRUST_MODEL_CODE"


@runtime_checkable
class SplitModelCode(Protocol):
    """A team's VLA (an ``nn.Module``) as the ordered stages of the split.

    ``cls(config)`` is called under ``torch.device("meta")``, so it must not allocate or initialise weights
    itself. Parameter bytes per stage and block are counted from the modules.

    Attributes:
        front_modules: child modules used before decoder block 0 (the prefix's side).
        block_list: the ``nn.ModuleList`` attribute holding the L decoder blocks in order.
        tail_modules: child modules used after block L-1 (the suffix's side).
    """

    front_modules: tuple[str, ...]
    block_list: str
    tail_modules: tuple[str, ...]

    def hidden_state_shape(self) -> tuple[int, ...]:
        """Shape of the hidden states that cross the split (e.g. (T, H)); the same at every K."""

    def embed(self, *inputs) -> torch.Tensor:
        """Inputs -> hidden states before block 0 (``hidden_state_shape``), using only ``front_modules``."""

    def run_blocks(self, blocks: nn.ModuleList, hidden_states: torch.Tensor, first: int) -> torch.Tensor:
        """Run ``blocks`` (global indices ``first``, ``first + 1``, ...) over the hidden states; same shape."""

    def readout(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states after block L-1 -> the model's output, using only ``tail_modules``."""

    def forward(self, *inputs) -> torch.Tensor:
        """The model's own monolithic forward: ``verify-split``'s reference."""

    def example_inputs(self, seed: int = 0) -> tuple:
        """Inputs for ``embed`` / ``forward`` (CPU tensors), deterministic for a seed."""


def trusted(trust_model_code: bool | None) -> bool:
    """The opt-in: ``trust_model_code`` when given, else ``HYBRID_VLA_TRUST_MODEL_CODE == "1"``."""
    if trust_model_code is not None:
        return bool(trust_model_code)
    return os.environ.get(TRUST_ENV, "") == "1"


def import_model_class(path: Path, spec: str, trust_model_code: bool | None = None) -> type:
    """The class ``spec`` (``package.module:Name``) of ``path``/config.json, imported only when trusted.

    Raises CheckpointError: not trusted (nothing imported), a malformed spec, an import error, or missing
    :class:`SplitModelCode` members.
    """
    where = Path(path) / "config.json"
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise CheckpointError(f"{where}: model_class must be 'package.module:ClassName', got {spec!r}")
    if not trusted(trust_model_code):
        raise CheckpointError(f"{where} names own model code {spec!r}; importing it runs that code. Opt in once you "
                              "trust it: --trust-model-code (verify-split, plan, profile), or "
                              f"{TRUST_ENV}=1 in the environment (every command, and the nodes)")
    cls = _import_module_class(spec, f"{where}: model_class")
    missing = [m for m in ("front_modules", "block_list", "tail_modules", "hidden_state_shape", "embed", "run_blocks",
                           "readout", "forward", "example_inputs") if not hasattr(cls, m)]
    if missing:
        raise CheckpointError(f"{where}: {spec!r} lacks {', '.join(missing)} (see SplitModelCode in "
                              "hybrid_vla_ros/model/extension.py)")
    return cls


def import_head_class(spec: str, trust_model_code: bool | None = None) -> type:
    """The team's read-out head class ``spec`` (a ``readout`` of type ``module``), imported only when trusted.

    Built ``cls(hidden_size=H, n_waypoints=N, n_modes=M, **config)``, called on the suffix's final-norm hidden
    states (T, H); returns (M, N, 2) waypoints (metres, ego frame). Raises CheckpointError as
    :func:`import_model_class`, or when the class is not an nn.Module."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise CheckpointError(f"readout.class must be 'package.module:ClassName', got {spec!r}")
    if not trusted(trust_model_code):
        raise CheckpointError(f"the read-out head {spec!r} is the team's own code; importing it runs that code. Opt "
                              f"in once you trust it: {TRUST_ENV}=1 in the environment (init-model, every command "
                              "and the nodes read it)")
    return _import_module_class(spec, "the read-out head")


def _import_module_class(spec: str, what: str) -> type:
    """The nn.Module class ``spec`` (already trusted); CheckpointError naming ``what`` otherwise."""
    module_name, class_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CheckpointError(f"{what} {spec!r}: cannot import {module_name!r} ({e}); install it or put it on "
                              "PYTHONPATH") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise CheckpointError(f"{what} {spec!r} is not an nn.Module class")
    return cls


class CodeModel:
    """An own-code checkpoint's model class and config; builds its stages.

    ``num_layers`` and ``prefix_state_shape`` come from a meta-device instance. Raises CheckpointError when
    building it fails or the block list is not an ``nn.ModuleList``.
    """

    llm_passes = 1
    preset = ""

    def __init__(self, path: Path, cls: type, config: dict, spec: str):
        self.path, self.cls, self.config, self.spec = Path(path), cls, dict(config), spec
        with torch.device("meta"):
            probe = self.new_model()
        self.num_layers = len(getattr(probe, probe.block_list))
        self.prefix_state_shape = tuple(int(s) for s in probe.hidden_state_shape())
        #: The declared driving I/O (:data:`DRIVING_KEYS`), or None: not runnable on the nodes.
        self.driving = _driving(probe, Path(path) / "config.json", spec)

    # The driving I/O, under the names the nodes read from a driving config (model.config.VLAConfig).
    @property
    def drives(self) -> bool:
        """True when the nodes can run the model (it declares driving I/O)."""
        return self.driving is not None

    def _io(self, key: str):
        if self.driving is None:
            raise AttributeError(f"{self.spec} declares no driving I/O ('driving')")
        return self.driving[key]

    n_cameras = property(lambda self: int(self._io("cameras")))
    image_size = property(lambda self: int(self._io("image_size")))
    image_mean = property(lambda self: tuple(float(v) for v in self._io("image_mean")))
    image_std = property(lambda self: tuple(float(v) for v in self._io("image_std")))
    image_resize = property(lambda self: str(self.driving.get("image_resize", "area")) if self.driving else "area")
    n_waypoints = property(lambda self: int(self._io("n_waypoints")))
    waypoint_dt_s = property(lambda self: float(self._io("waypoint_dt_s")))
    n_modes = property(lambda self: int(self._io("n_modes")))
    random_init = property(lambda self: bool(self.driving.get("random_init", False)) if self.driving else False)
    ego_state_input = False
    planning_head = property(lambda self: self.drives)
    projector = property(lambda self: {"type": "code"})
    side: tuple = ()
    query_count = 0
    readout_type = "code"
    decision_token_ids: tuple = ()
    vlm_type = ""

    @property
    def num_tokens(self) -> int:
        """T: the second-to-last dim of the hidden states."""
        return int(self.prefix_state_shape[-2])

    def new_model(self) -> nn.Module:
        """A fresh instance (on the current default device; meta when building stages)."""
        try:
            model = self.cls(self.config)
        except Exception as e:  # the user's constructor: say whose it is
            raise CheckpointError(f"{self.path / 'config.json'}: {self.spec}(config) failed: "
                                  f"{type(e).__name__}: {e}") from e
        if not isinstance(getattr(model, model.block_list, None), nn.ModuleList):
            raise CheckpointError(f"{self.spec}: attribute {model.block_list!r} is not an nn.ModuleList")
        return model

    def to_dict(self) -> dict:
        """The config a profile records (config.json without format_version)."""
        return {"model_type": CODE_MODEL_TYPE, "model_class": self.spec, "config": self.config}

    def build_stage(self, role: str, split_layer: int | None, stop: int | None = None) -> nn.Module:
        """``prefix`` / ``suffix`` at ``split_layer``, ``blocks`` [split_layer, stop), or ``full``.

        Raises ValueError for an unknown role or a K out of range."""
        if role == "full":
            return CodeFull(self, self.new_model())
        if role not in ("prefix", "suffix", "blocks"):
            raise ValueError(f"unknown role {role!r}; use prefix, suffix or full")
        check_split_layer(self, split_layer)
        if role == "blocks":
            check_split_layer(self, stop)
            return CodeBlocks(self, self.new_model(), split_layer, stop)
        return (CodePrefix if role == "prefix" else CodeSuffix)(self, self.new_model(), split_layer)


#: Required keys of a model's ``driving`` dict: cameras (in ``camera_topics`` order), image_size (px, square:
#: ``embed`` gets (C, 3, S, S) float pixels), image_mean / image_std (3 values, [0, 1], RGB), n_waypoints,
#: waypoint_dt_s (s), n_modes (1 or 6). Optional: random_init (bool: trajectories are not driving advice),
#: image_resize (RESIZE_FILTERS, default ``area``). ``readout`` returns (n_modes, n_waypoints, 2) metres, ego frame.
DRIVING_KEYS = ("cameras", "image_size", "image_mean", "image_std", "n_waypoints", "waypoint_dt_s", "n_modes")


def _driving(model: nn.Module, where: Path, spec: str) -> dict | None:
    """The model's checked ``driving`` dict, or None; CheckpointError naming what is missing or wrong."""
    io = getattr(model, "driving", None)
    if io is None:
        return None
    if not isinstance(io, dict):
        raise CheckpointError(f"{where}: {spec}.driving must be a dict ({', '.join(DRIVING_KEYS)})")
    missing = [k for k in DRIVING_KEYS if k not in io]
    if missing:
        raise CheckpointError(f"{where}: {spec}.driving lacks {', '.join(missing)}")
    if int(io["n_modes"]) not in (1, 6) or int(io["cameras"]) < 1 or int(io["n_waypoints"]) < 1 \
            or not float(io["waypoint_dt_s"]) > 0 or len(io["image_mean"]) != 3 or len(io["image_std"]) != 3:
        raise CheckpointError(f"{where}: {spec}.driving: n_modes must be 1 or 6, cameras and n_waypoints >= 1, "
                              "waypoint_dt_s > 0, image_mean / image_std 3 values each")
    if io.get("image_resize", "area") not in RESIZE_FILTERS:
        raise CheckpointError(f"{where}: {spec}.driving: image_resize must be one of {', '.join(RESIZE_FILTERS)}, "
                              f"got {io['image_resize']!r}")
    return dict(io)


def _attach(stage: nn.Module, model: nn.Module, names) -> None:
    for name in names:
        stage.add_module(name, getattr(model, name))


class _CodeStage(nn.Module):
    """Base of own-code stages: owned modules under their own names, blocks as ``layers``; the model itself is
    not registered, so its unused parts stay on meta."""

    def __init__(self, spec: CodeModel, model: nn.Module, split_layer: int):
        super().__init__()
        object.__setattr__(self, "code", model)
        self.cfg, self.split_layer = spec, split_layer
        self._block_list = model.block_list

    def _block_key(self, local_key: str, offset: int) -> str:
        if local_key.startswith("layers."):
            _, idx, rest = local_key.split(".", 2)
            return f"{self._block_list}.{int(idx) + offset}.{rest}"
        return local_key

    def rebuild_buffers(self, device: torch.device) -> None:
        """Call the model's optional ``rebuild_buffers(device)`` hook."""
        hook = getattr(self.code, "rebuild_buffers", None)
        if hook is not None:
            hook(device)


class CodePrefix(_CodeStage):
    """Own code's prefix: ``front_modules`` and blocks [0, K). ``forward(*inputs) -> hidden states``."""

    role = "prefix"

    def __init__(self, spec: CodeModel, model: nn.Module, split_layer: int):
        super().__init__(spec, model, split_layer)
        _attach(self, model, model.front_modules)
        self.layers = nn.ModuleList(list(getattr(model, model.block_list))[:split_layer])

    def checkpoint_key(self, local_key: str) -> str:
        return self._block_key(local_key, 0)

    def forward(self, *inputs) -> torch.Tensor:
        return self.code.run_blocks(self.layers, self.code.embed(*inputs), 0)

    def move_split(self, split_layer: int, load_blocks) -> None:
        """As :meth:`hybrid_vla_ros.model.modeling.PrefixStage.move_split`."""
        PrefixSide.move_split(self, split_layer, load_blocks)


class CodeSuffix(_CodeStage):
    """Own code's suffix: blocks [K, L) and ``tail_modules``. ``forward(h_K, split_layer=None) -> output``."""

    role = "suffix"

    def __init__(self, spec: CodeModel, model: nn.Module, split_layer: int):
        super().__init__(spec, model, split_layer)
        self.layers = nn.ModuleList(list(getattr(model, model.block_list))[split_layer:])
        _attach(self, model, model.tail_modules)

    def checkpoint_key(self, local_key: str) -> str:
        return self._block_key(local_key, self.split_layer)

    def plan_all(self, hidden_states: torch.Tensor, command: int = 3, split_layer: int | None = None):
        """Waypoints of every mode as :class:`~hybrid_vla_ros.model.stages.PlanOutput`; ``command`` picks the mode.

        Raises ValueError without driving I/O, for a bad command or readout shape, or as :meth:`forward`."""

        if not self.cfg.drives:
            raise ValueError(f"{self.cfg.spec} declares no driving I/O: it gives its own output, not waypoints")
        if isinstance(command, bool) or not 0 <= int(command) < len(NAV_COMMANDS):
            raise ValueError(f"navigation command index {command!r} out of range [0, {len(NAV_COMMANDS)})")
        modes = self.forward(hidden_states, split_layer).float()
        want = (self.cfg.n_modes, self.cfg.n_waypoints, 2)
        if tuple(modes.shape) != want:
            raise ValueError(f"{self.cfg.spec}.readout gave {tuple(modes.shape)}, its driving I/O declares {want}")
        mode = int(command) if modes.shape[0] > 1 else 0
        return PlanOutput(modes[mode], modes, None, mode)

    def forward(self, hidden_states: torch.Tensor, split_layer: int | None = None) -> torch.Tensor:
        expected = self.cfg.prefix_state_shape
        if tuple(hidden_states.shape) != expected:
            raise ValueError(f"hidden states shape {tuple(hidden_states.shape)} != expected {expected}")
        k = self.split_layer if split_layer is None else split_layer
        layers = SuffixSide._layers_from(self, split_layer)
        return self.code.readout(self.code.run_blocks(layers, hidden_states, k))

    def move_split(self, split_layer: int, load_blocks) -> None:
        """As :meth:`hybrid_vla_ros.model.modeling.SuffixStage.move_split`."""
        SuffixSide.move_split(self, split_layer, load_blocks)


class CodeBlocks(_CodeStage):
    """Blocks [start, stop) of own code, for moving a split layer."""

    def __init__(self, spec: CodeModel, model: nn.Module, start: int, stop: int):
        super().__init__(spec, model, start)
        self.start = start
        self.layers = nn.ModuleList(list(getattr(model, model.block_list))[start:stop])

    def checkpoint_key(self, local_key: str) -> str:
        return self._block_key(local_key, self.start)


class CodeFull(nn.Module):
    """The whole own-code model, keys as in the checkpoint; ``forward`` is the model's own."""

    role = "full"

    def __init__(self, spec: CodeModel, model: nn.Module):
        super().__init__()
        self.cfg = spec
        self.model = model

    def checkpoint_key(self, local_key: str) -> str:
        return local_key.removeprefix("model.")

    def rebuild_buffers(self, device: torch.device) -> None:
        hook = getattr(self.model, "rebuild_buffers", None)
        if hook is not None:
            hook(device)

    def forward(self, *inputs) -> torch.Tensor:
        return self.model(*inputs)
