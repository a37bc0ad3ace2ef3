"""Checkpoint configuration of a split VLA (``config.json`` in a checkpoint directory).

A checkpoint directory holds ``config.json`` (this schema) and ``model.safetensors`` (weights whose
keys are the parameter names of :class:`hybrid_vla_ros.core.model.VLAModel`). ``vision`` holds
transformers ``SiglipVisionConfig`` arguments, ``llm`` transformers ``LlamaConfig`` arguments, so a
user's checkpoint is described with the same keys as the Hugging Face configs it came from.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MODEL_TYPE = "hybrid_vla"

# CLIP image statistics (Radford et al., 2021), used by EVA / Orion-style vision encoders.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VLAConfig:
    """Architecture and I/O contract of a checkpoint.

    Attributes:
        preset: name of the preset it was made from ("" for a user checkpoint).
        random_init: True when the weights are random (trajectories are not driving advice).
        n_cameras: cameras per frame C; images arrive in camera-index order.
        image_size: square model input S in pixels (each camera is resized to S x S).
        image_mean, image_std: per-channel RGB normalisation on [0, 1] pixels.
        vision: SiglipVisionConfig kwargs (``image_size`` must equal ``image_size``).
        llm: LlamaConfig kwargs (hidden_size H, num_hidden_layers L, heads, vocab_size, ...).
        prompt_token_ids: fixed text prompt token ids embedded before the vision tokens.
        planning_token_id: id of the waypoint query token, always the last token.
        n_waypoints: N future waypoints produced by the head.
        waypoint_dt_s: time step between waypoints in seconds.
    """

    preset: str = ""
    random_init: bool = False
    n_cameras: int = 6
    image_size: int = 64
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    vision: dict = field(default_factory=dict)
    llm: dict = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)
    planning_token_id: int = 0
    n_waypoints: int = 6
    waypoint_dt_s: float = 0.5

    def __post_init__(self) -> None:
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        problems = []
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
            if key not in self.llm:
                problems.append(f"llm.{key} missing")
        for key in ("hidden_size", "patch_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in self.vision:
                problems.append(f"vision.{key} missing")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        if self.vision.get("image_size", self.image_size) != self.image_size:
            problems.append("vision.image_size differs from image_size")
        if self.image_size % self.vision["patch_size"]:
            problems.append("image_size is not a multiple of vision.patch_size")
        vocab = self.llm["vocab_size"]
        if not all(0 <= t < vocab for t in self.prompt_token_ids + [self.planning_token_id]):
            problems.append("a prompt or planning token id is outside the vocabulary")
        if self.n_cameras < 1 or self.n_waypoints < 1 or not self.waypoint_dt_s > 0:
            problems.append("n_cameras, n_waypoints and waypoint_dt_s must be positive")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            problems.append("image_mean / image_std must be 3 values, std > 0")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    @property
    def num_layers(self) -> int:
        """L, the number of LLM decoder blocks; valid split layers are 0..L."""
        return int(self.llm["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        """H, the LLM width."""
        return int(self.llm["hidden_size"])

    @property
    def tokens_per_camera(self) -> int:
        """P, vision tokens per camera: (S / patch)^2 (SigLIP has no class token)."""
        return (self.image_size // int(self.vision["patch_size"])) ** 2

    @property
    def num_tokens(self) -> int:
        """T = prompt + C * P + 1 planning token."""
        return len(self.prompt_token_ids) + self.n_cameras * self.tokens_per_camera + 1

    @property
    def prefix_state_shape(self) -> tuple[int, int]:
        """Shape (T, H) of the hidden states that cross the split."""
        return (self.num_tokens, self.hidden_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return {"model_type": MODEL_TYPE, "format_version": FORMAT_VERSION, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "VLAConfig":
        """Build from a parsed config.json. Raises ValueError on a foreign or newer format."""
        d = dict(d)
        if d.pop("model_type", None) != MODEL_TYPE:
            raise ValueError(f"config.json is not a {MODEL_TYPE} config")
        version = d.pop("format_version", None)
        if version != FORMAT_VERSION:
            raise ValueError(f"config.json format_version {version!r}; this package reads {FORMAT_VERSION}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown keys in config.json: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> "VLAConfig":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))


def preset(name: str) -> VLAConfig:
    """Architecture of a named preset. Raises ValueError for an unknown name.

    ``tiny``: 6 cameras at 64x64, SigLIP-style ViT (patch 16, width 64, 2 blocks) giving 16 tokens a
    camera, a LLaMA-style LLM of 4 blocks at width 128 (4 heads, 2 KV heads), 8 prompt tokens:
    T = 8 + 96 + 1 = 105 tokens. Small enough for tests and the demo on 2 CPU cores.
    """
    if name == "tiny":
        return VLAConfig(
            preset="tiny",
            n_cameras=6,
            image_size=64,
            vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        image_size=64, patch_size=16, vision_use_head=False),
            llm=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=512,
                     rope_theta=10000.0),
            prompt_token_ids=[1, 12, 34, 56, 78, 90, 123, 45],
            planning_token_id=255,
            n_waypoints=6,
            waypoint_dt_s=0.5,
        )
    raise ValueError(f"unknown preset {name!r}; available: tiny")


PRESETS = ("tiny",)
