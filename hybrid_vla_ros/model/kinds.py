"""One interface for every kind of model the package splits: :class:`SplitModel` and its adapters.

split/, runtime/ and tools/ ask a model through this interface and never look at its kind; adding a kind is one
adapter here plus its tests (docs/design.md). The kinds, as :func:`split_model` picks them:

=================  =============================================================================================
:class:`DrivingVLA` this package's driving model with its own vision side (presets, a composition on a
                   transformers LLM or LLaVA, Orion / MindDrive as published): pixels in, waypoints out
:class:`VLMFront`  a transformers VLM directory, or a driving composition on one: the family's processor in
:class:`TextLM`    a bare transformers causal LM: token ids in
:class:`OwnCode`   a team's own model code (:mod:`.extension`)
=================  =============================================================================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from . import activations as act
from . import modeling
from .config import MODEL_TYPE, LMConfig, VLAConfig, VLMSpec
from .modeling import DEFAULT_COMMAND, example_scene, llava_input_ids, plan

#: The ego state fed to example frames of models that take one: 8.3 m/s, -0.4 m/s^2, 0.05 rad/s.
EGO_STATE = (8.3, -0.4, 0.05)


class CameraFrames(Protocol):
    """Camera images from the caller (e.g. the embedded bag's first frame): ``images(n, size)`` -> ``n`` RGB uint8
    (H, W, 3) arrays in camera order, resized to ``size`` (width, height) when given; ``pixels(cfg)`` -> (C, 3, S,
    S) float32, preprocessed as the prefix node does."""

    def images(self, cameras: int, size: tuple[int, int] | None = None) -> list: ...

    def pixels(self, cfg) -> torch.Tensor: ...


@dataclass
class Referee:
    """A referee's run on one frame: ``states`` each decoder block's input, then the final-norm states (L + 1,
    batch dimension dropped; None for own code); ``output`` what own code compares instead; ``name`` what ran;
    ``h0`` the hybrid's h_0 it ran on, to rerun in another dtype on the same input."""

    states: list[torch.Tensor] | None
    output: torch.Tensor | None
    name: str
    h0: torch.Tensor | None = None


class SplitModel:
    """A model as split/, runtime/ and tools/ see it. ``ck``: its opened :class:`~.checkpoint.Checkpoint`, None
    for a preset (then only the plan's methods apply)."""

    #: Whether a profile measures its own front part by part (:func:`hybrid_vla_ros.split.profiler.profile`).
    profile_detailed = False
    #: Whether it takes camera images and drives (a planning head).
    takes_cameras = False

    @property
    def preprocess_config(self):
        """The driving config whose camera preprocessing a profile measures, or None."""
        return self.cfg if isinstance(self.cfg, VLAConfig) else None

    def __init__(self, cfg, ck=None):
        self.cfg, self.ck = cfg, ck

    @property
    def num_layers(self) -> int:
        return int(self.cfg.num_layers)

    def build_stage(self, role: str, split_layer: int | None = None, stop: int | None = None):
        """A stage on the current default device (e.g. ``meta``): ``prefix`` / ``suffix`` at ``split_layer``,
        ``blocks`` [split_layer, stop) or ``full``; each maps its keys with ``checkpoint_key``. Raises ValueError
        for an unknown role, a K out of range or a role the kind lacks."""
        from .modeling import BlockRange

        if role == "blocks":
            return BlockRange(self.cfg, split_layer, stop)
        if role == "lm_head":
            if not self.decodes:
                raise ValueError(self.NO_DECODE)
            from .decode import LMHead

            tied = None if self.ck is None else "lm_head.weight" not in self.ck.source()
            return LMHead(self.text_config(), tied, self.logit_factors())
        if role not in self.STAGES:
            raise ValueError(f"unknown role {role!r}; use prefix, suffix, full, blocks or lm_head")
        cls = self.STAGES[role]
        if cls is None:
            raise ValueError(self.NO_FULL)
        return cls(self.cfg) if role == "full" else cls(self.cfg, split_layer)

    #: role -> the stage class (``full``: None where the kind has no monolithic model, :attr:`NO_FULL` says why).
    STAGES: dict = {}
    NO_FULL = ""
    #: Whether it decodes across the split (:mod:`.decode`; role ``lm_head``), and why not where it does not.
    decodes = False
    NO_DECODE = "this model has no language-model head to decode with (a planning head reads fixed positions)"

    def text_config(self):
        """The transformers config of its decoder blocks (what its KV caches are built for)."""
        return modeling.llm_config(self.cfg)

    def logit_factors(self) -> frozenset | None:
        """The logit factors its LM head applies (:class:`~.decode.LMHead`): a VLM's generation class's
        (:func:`~.vlm.logit_factors`), None (all its text config sets) otherwise."""
        vlm_type = getattr(self.cfg, "vlm_type", "")
        if not vlm_type:
            return None
        from .vlm import logit_factors

        return logit_factors(vlm_type)

    def tokenizer(self):
        """The tokenizer that turns its decoded ids into text (local files only), or None where it has none."""
        return None

    # ----------------------------------------------------------------------------------------- inputs
    def example_inputs(self, frames: CameraFrames | None = None, device="cpu", dtype=torch.float32) -> tuple:
        """The prefix stage's arguments for one frame (``frames`` None: made-up inputs, for timing)."""
        raise NotImplementedError

    def describe_inputs(self, inputs: tuple) -> str:
        """One phrase for reports: what :meth:`example_inputs` gave."""
        raise NotImplementedError

    def vision_layers(self) -> int:
        """Blocks of a driving config's vision encoder, 1 for any other kind."""
        return int(self.cfg.vision["num_hidden_layers"]) if isinstance(self.cfg, VLAConfig) else 1

    def camera_description(self) -> str:
        """How its cameras reach the model, for ``init-model``'s line ("" where it takes none)."""
        return ""

    # -------------------------------------------------------------------------------- stage outputs
    def run_prefix(self, stage, inputs: tuple, cache=None, chunk_rows: int = 0):
        """Its prefix stage on :meth:`example_inputs`' arguments (``cache``: the prefix's KV cache, a decode;
        ``chunk_rows`` > 0: a chunked prefill, where the stage has one: a VLM's)."""
        if cache is None:
            return stage(*inputs)
        return stage(*inputs, cache=cache, chunk_rows=chunk_rows) if chunk_rows else stage(*inputs, cache=cache)

    # ----------------------------------------------------------------------------------------- decode
    def prefix_step(self, stage, token_ids: torch.Tensor, prefill, cache, position: int,
                    queries: tuple[int, int] = (0, 0)):
        """A decode step on the prefix: new token ids (k,) int64 at sequence positions ``position`` .. -> what
        crosses (h_K rows, or a SplitState with their rotary positions); ``prefill``: the frame's prefill output;
        ``queries`` (first, count): learned query embeddings for the last rows, where the model has them."""
        return stage(token_ids, cache=cache)

    def prompt_tokens(self, inputs: tuple) -> int:
        """Tokens of one frame's prefill from :meth:`example_inputs`' arguments."""
        return int(inputs[0].numel())

    #: Rows of rotary positions a decode step carries across the split (0: positions continue from the cache).
    step_position_rows = 0

    def step_crossing(self, out) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a decode step's prefix output sends down: h_K rows (k, H) and their rotary positions
        (:attr:`step_position_rows`, 1, k) int64, or None."""
        return self.hidden(out), None

    def step_arrived(self, rows: torch.Tensor, positions: torch.Tensor | None):
        """The suffix's input for a step from the rows and positions that crossed (:meth:`step_crossing`)."""
        return rows

    def suffix_rows(self, suffix, out, cache, split_layer: int | None = None):
        """The suffix's final-norm rows (rows, H) of a prefill or a decode step, extending its KV cache; the frame
        crossed at ``split_layer`` (default the stage's K)."""
        return suffix.final_hidden_states(out, split_layer, cache=cache)

    def placed_rows(self, suffix, out, cache, split_layer: int | None) -> torch.Tensor:
        """A step of tokens placed after a decode through the suffix's blocks, extending its KV cache: the rows
        before the final norm (k, H), for :meth:`plan_placed`. Raises ValueError where the model reads no tokens
        placed after a decode."""
        raise ValueError("this model's planning head does not read tokens placed after a decode")

    def plan_placed(self, suffix, rows: torch.Tensor, command: int):
        """The planning head on every placed token's rows (:meth:`placed_rows`, in order; the read-out tokens
        last) -> :class:`~.modeling.PlanOutput`."""
        from .modeling import plan

        return plan(suffix, rows, command)

    def output(self, suffix, out) -> torch.Tensor | None:
        """What the check compares at the end: waypoints (M, N, 2) or own code's output; None without a head."""
        return self.waypoints(suffix, out)

    def hidden(self, out) -> torch.Tensor:
        """h_K from what its prefix returns (a tensor, or a SplitState's hidden states)."""
        return out

    def final_states(self, suffix, out) -> torch.Tensor | None:
        """The suffix's final-norm states of every token, from the prefix's output; None for own code."""
        return suffix.final_hidden_states(out)

    def waypoints(self, suffix, out) -> torch.Tensor | None:
        """Every mode's waypoints (M, N, 2) the suffix plans from the prefix's output; None without a head."""
        return suffix.plan_all(out).modes if hasattr(suffix, "head") else None

    def readout_rows(self, final: torch.Tensor) -> torch.Tensor:
        """The final states the read-outs take ((R, H)): the last token by default."""
        return final[..., -1, :].reshape(-1, final.shape[-1])

    def profile_tail(self, tail, out):
        """A zero-argument callable running the suffix at K = L on the prefix's output."""
        return lambda: tail.final_hidden_states(out)

    def timing_inputs(self, frames: CameraFrames, device="cpu", dtype=torch.float32) -> tuple:
        """The prefix's arguments for a profile; made-up where the kind allows."""
        return self.example_inputs(None, device, dtype)

    def block_driver(self, stage, out, device):
        """How a profile runs one decoder block alone, given the prefix ``stage`` at K = 0 and its output: (a
        zero-argument callable computing rotary tables and masks, or None; a callable ``(block, i)`` running block
        i on h_0)."""
        from . import text
        from .modeling import llm_config, llm_family

        from .contract import SplitState

        h = self.hidden(out)
        with torch.device(device):
            rotary = text.make_rotary(llm_family(self.cfg), llm_config(self.cfg))
        x = h if h.dim() == 3 else h.unsqueeze(0)
        kinds = text.attention_kinds(rotary.config)
        state = out if isinstance(out, SplitState) else SplitState(h)
        family = llm_family(self.cfg)
        if family.captured:  # what the family's own forward hands each block (recorded once)
            with torch.inference_mode():
                calls = text.captured_block_inputs(family, rotary, x, state.position_ids).calls
            return (lambda: text.captured_block_inputs(family, rotary, x, state.position_ids),
                    lambda block, i: calls[i].run(block, x))
        extra = {"image_blocks": state.image_blocks}  # what the blocks read besides h (as run_blocks passes it)
        if state.image_blocks is not None:
            from .vlm import block_mask_rule

            extra["block_rule"] = block_mask_rule(self.cfg.vlm_type)
        if state.cross_states is not None:
            extra["cross"] = {"cross_attention_states": state.cross_states, "cross_attention_mask": state.cross_mask,
                              "full_text_row_masked_out_mask": state.cross_rows}
        with torch.inference_mode():
            inputs = text.block_inputs(rotary.config, rotary, x, set(kinds), state.position_ids, **extra)
        return (lambda: text.block_inputs(rotary.config, rotary, x, set(kinds), state.position_ids, **extra),
                lambda block, i: block(x, **inputs.for_block(block, kinds[i])))

    # --------------------------------------------------------------------------------------- runtime
    #: Whether its prefix can produce h_K in place (the last op writes into a ring slot: ``out=``), on a CPU.
    produces_in_place = False
    #: Whether the prefix node may decode its JPEGs scaled down to the model input (it resizes them itself).
    decodes_scaled = False

    def frame_args(self, frames: CameraFrames, ego_state=None, scene=None, device="cpu", dtype=torch.float32) -> tuple:
        """The prefix stage's arguments for one live frame. Raises ValueError for what the front refuses (camera
        count, image sizes)."""
        raise NotImplementedError(f"{type(self).__name__} does not run on the nodes")

    def split_state(self, out):
        """What its prefix returned, as the :class:`~.contract.SplitState` that crosses the split."""
        from .contract import SplitState

        return out if isinstance(out, SplitState) else SplitState(out)

    def copy_reason(self, stage) -> str:
        """Why h_K is copied into the ring slot instead of produced there (for the configure log)."""
        block = type(stage.layers[-1]).__name__ if len(stage.layers) else "embeddings"
        if _state_blocks(self.cfg):
            return f"{block}: hybrid blocks run with the inputs their family's forward hands them"
        return f"{block}: its forward is not the layout produced in place"

    # --------------------------------------------------------------------------------------- referee
    def referee(self, dtype: torch.dtype, inputs: tuple, h0: torch.Tensor | None = None) -> Referee:
        """The independent forward of the same weights on ``inputs`` in ``dtype``."""
        raise NotImplementedError

    def head_on_final(self, suffix, final: torch.Tensor) -> torch.Tensor | None:
        """The suffix's read-out head on the referee's final states; None without a head."""
        return suffix.head(final[-1]) if hasattr(suffix, "head") else None

    # ------------------------------------------------------------------------------------------ plan
    def activation_phases(self, split_layer: int, e: int, role: str) -> list[act.Phase]:
        """The phases of one frame through its stage ``role`` at ``split_layer``, in ``e``-byte elements."""
        raise NotImplementedError

    def arch_key(self) -> dict:
        """The architecture a profile of it is matched on: its config and the shape crossing the split."""
        return {"config": {k: v for k, v in self.cfg.to_dict().items() if k != "num_tokens"},
                "prefix_state_shape": list(self.cfg.prefix_state_shape)}

    #: What its plan says beyond the figures.
    plan_notes: tuple[str, ...] = ()


def _reference_states(out) -> list[torch.Tensor]:
    return [h.squeeze(0) if h.shape[0] == 1 else h for h in out.hidden_states]


def _static_cache(ref, cache_len: int | None) -> dict:
    """``generate``'s keyword arguments for a static KV cache: its own length, or ``cache_len`` tokens."""
    if cache_len is None:
        return {"cache_implementation": "static"}
    import inspect

    from transformers.cache_utils import StaticCache

    # transformers renamed past_key_values to cache (it warns about the old name; older releases know only it)
    name = "cache" if "cache" in inspect.signature(type(ref).forward).parameters else "past_key_values"
    return {name: StaticCache(config=ref.config, max_cache_len=int(cache_len))}


def causal_lm_class(model_type: str):
    """transformers' causal LM class of a text family (``Qwen3ForCausalLM``, ...), from its own registry."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


def _state_blocks(cfg) -> bool:
    """Whether ``cfg``'s decoder blocks keep recurrent or convolution state (a hybrid family,
    :attr:`~.text.TextFamily.captured`): a decode across the split would have to carry it."""
    return modeling.llm_family(cfg).captured


#: Why a model with hybrid blocks does not decode across the split.
NO_STATE_DECODE = ("its blocks keep recurrent, convolution or linear-attention state (a hybrid family), which a "
                   "decode across the split does not carry yet: one prefill")


class TextLM(SplitModel):
    """A bare transformers causal LM (:class:`~.config.LMConfig`): token ids in, final states out."""

    STAGES = {"prefix": modeling.TokenPrefixStage, "suffix": modeling.LMSuffixStage, "full": None}
    NO_FULL = "a bare language model has no monolithic driving model: load its prefix and suffix"

    @property
    def decodes(self) -> bool:
        """True, unless its blocks keep state a decode across the split would carry (a hybrid family)."""
        return not _state_blocks(self.cfg)

    @property
    def NO_DECODE(self) -> str:
        return NO_STATE_DECODE

    def __init__(self, cfg, ck=None, prompt_ids: list[int] | None = None):
        super().__init__(cfg, ck)
        self.prompt_ids = prompt_ids

    def example_inputs(self, frames=None, device="cpu", dtype=torch.float32) -> tuple:
        from .hf import lm_prompt_ids

        vocab = int(self.cfg.llm["vocab_size"])
        if frames is None:
            return (torch.arange(self.cfg.num_tokens, device=device) % vocab,)
        ids = torch.tensor(self.prompt_ids if self.prompt_ids else lm_prompt_ids(vocab), device=device)
        if int(ids.max()) >= vocab:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary [0, {vocab})")
        return (ids,)

    def describe_inputs(self, inputs) -> str:
        return f"{len(inputs[0])} token ids"

    def referee(self, dtype, inputs, h0=None) -> Referee:
        ref = causal_lm_class(self.cfg.llm_type).from_pretrained(str(self.ck.path), dtype=dtype).eval()
        return Referee(_reference_states(ref(inputs[0].unsqueeze(0), output_hidden_states=True)), None,
                       f"transformers {self.ck.hf.architecture}.from_pretrained({self.ck.path})")

    def decode_referee(self, dtype, inputs: tuple, max_new_tokens: int, cache_len: int | None = None):
        """transformers' own greedy ``generate`` on the unsplit model with a static KV cache (``generate``'s own
        length, or ``cache_len`` tokens: the split's cache class and length, so the same attention over the same
        keys), stopping at the generation config's end tokens. Returns (new token ids, logits of each step (V,)
        float32, those stop ids, what it is)."""
        ref = causal_lm_class(self.cfg.llm_type).from_pretrained(str(self.ck.path), dtype=dtype).eval()
        stop = ref.generation_config.eos_token_id
        stop = () if stop is None else ((stop,) if isinstance(stop, int) else tuple(stop))
        ids = inputs[0].unsqueeze(0)
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           **_static_cache(ref, cache_len), output_logits=True, return_dict_in_generate=True,
                           pad_token_id=stop[0] if stop else 0)  # every prompt token attended, pad id or not
        return (out.sequences[0, ids.shape[1]:].tolist(), [x[0].float() for x in out.logits], stop,
                f"transformers {self.ck.hf.architecture}.generate (greedy, static cache)")

    def activation_phases(self, split_layer, e, role):
        if role == "prefix":
            return act.llm_prefix_phases(self.cfg, e, split_layer, [act.token_embed_phase(self.cfg, e)])
        return act.llm_suffix_phases(self.cfg, e, split_layer, act.norm_phase(self.cfg, e))


class VLMFront(SplitModel):
    """A transformers VLM directory (:class:`~.config.VLMSpec`), or a driving composition on one: camera images
    through the family's processor; its stages pass a :class:`~.contract.SplitState`."""

    NO_FULL = "a composition on a transformers VLM has no monolithic model here: load its prefix and suffix"

    def __init__(self, cfg, ck=None):
        super().__init__(cfg, ck)
        self.takes_cameras = isinstance(cfg, VLAConfig)
        self._processor = None
        self.STAGES = {"prefix": modeling.VLMPrefixStage, "full": None,
                       "suffix": modeling.VLMDriveSuffixStage if self.takes_cameras else modeling.VLMSuffixStage}

    def processor(self):
        """The family's processor of the checkpoint's VLM directory (loaded once)."""
        from .vlm import load_processor

        if self._processor is None:
            self._processor = load_processor(self.ck.hf.path, self.cfg.vlm_type)
        return self._processor

    def tokenizer(self):
        return getattr(self.processor(), "tokenizer", None)

    def frame_inputs(self, images: list):
        """One frame's :class:`~.vlm.VLMInputs` from camera images already of ``cfg.camera_size``."""
        from .vlm import frame_inputs

        return frame_inputs(self.processor(), self.cfg, images)

    def example_inputs(self, frames=None, device="cpu", dtype=torch.float32) -> tuple:
        if frames is None:
            raise ValueError("a VLM's example frame needs camera images (its processor sizes the input)")
        inputs = self.frame_inputs(frames.images(self.cfg.cameras, self.cfg.camera_size))
        return (inputs.to(device, dtype),)

    def timing_inputs(self, frames, device="cpu", dtype=torch.float32) -> tuple:
        return self.example_inputs(frames, device, dtype)

    def describe_inputs(self, inputs) -> str:
        cfg = self.cfg
        return (f"camera frame of {cfg.cameras} camera(s) from the embedded bag at {cfg.camera_size[0]} x "
                f"{cfg.camera_size[1]} px through the family's processor, {inputs[0].tokens} tokens (prompt "
                f"{cfg.prompt!r})" + (f"; side tensors {', '.join(cfg.side)}" if cfg.side else ""))

    def camera_description(self) -> str:
        return f"{self.cfg.camera_size[0]} x {self.cfg.camera_size[1]} px through the {self.cfg.vlm_type} processor"

    def frame_args(self, frames, ego_state=None, scene=None, device="cpu", dtype=torch.float32) -> tuple:
        return (self.frame_inputs(frames.images(self.cfg.cameras, self.cfg.camera_size)),)

    def copy_reason(self, stage) -> str:
        from .contract import side_specs

        names = [name for name, _, _ in side_specs(self.cfg, torch.float32)]
        return f"h_K{' and side tensors ' + ', '.join(names) if names else ''} of a {self.cfg.vlm_type} VLM"

    def hidden(self, out):
        """h_K of a SplitState, or the tensor itself (what crosses for a VLM without side tensors, InternVL)."""
        return out if isinstance(out, torch.Tensor) else out.hidden_states

    def profile_tail(self, tail, out):
        return lambda: tail.final_hidden_states(out)

    def referee(self, dtype, inputs, h0=None) -> Referee:
        """transformers' own ForConditionalGeneration: each text block's input (pre-hooks) and the
        last_hidden_state."""
        from .vlm import vlm_family

        ck = self.ck
        family = vlm_family(self.cfg.vlm_type)
        ref = family.generation_class.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
        text = getattr(ref.model, family.text_attribute)
        states = []

        def keep(module, args, kwargs):
            states.append((args[0] if args else kwargs["hidden_states"])[0].clone())

        hooks = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in text.layers]
        queries = getattr(self.cfg, "query_count", 0)
        if queries:  # a queries read-out: the composition's own learned query embeddings in the copies' rows
            learned = ck.load("prefix", 0, dtype=dtype).query_tokens.detach()

            def swap(module, args, out):
                return torch.cat([out[:, :-queries], learned.to(out.dtype).unsqueeze(0)], dim=1)

            hooks.append(text.get_input_embeddings().register_forward_hook(swap))
        frame = inputs[0]
        try:
            last = ref.model(input_ids=frame.input_ids, **frame.to("cpu", dtype).images).last_hidden_state[0]
        finally:
            for h in hooks:
                h.remove()
        return Referee(states + [last], None, f"transformers {family.generation_class.__name__}.from_pretrained("
                                              f"{ck.hf.path}) (each text block's input, and last_hidden_state)")

    def head_on_final(self, suffix, final):
        return DrivingVLA.head_on_final(self, suffix, final)

    @property
    def decodes(self) -> bool:
        """A bare VLM decodes; a driving composition when its config says so (``decode``), else its planning head
        reads fixed positions of one prefill. Not a VLM whose images attend both ways (Gemma 3, PaliGemma: their
        masks against a KV cache split in two are not built here yet)."""
        from .contract import CROSS_STATES, IMAGE_BLOCKS

        if IMAGE_BLOCKS in self.cfg.side or CROSS_STATES in self.cfg.side or _state_blocks(self.cfg):
            return False
        return not self.takes_cameras or bool(self.cfg.decode)

    @property
    def NO_DECODE(self) -> str:
        from .contract import CROSS_STATES, IMAGE_BLOCKS

        if _state_blocks(self.cfg):
            return NO_STATE_DECODE
        if CROSS_STATES in self.cfg.side:
            return ("its cross-attention blocks keep the vision states' keys and values in their own cache layers, "
                    "which a decode across the split does not build yet: one prefill and a planning head only")
        if IMAGE_BLOCKS in self.cfg.side:
            return ("its images' tokens attend to each other both ways (Gemma 3's images, PaliGemma's prefix), and "
                    "the masks of a decode against a KV cache split in two are not built for that yet: one prefill "
                    "and a planning head only")
        return SplitModel.NO_DECODE

    def placed_rows(self, suffix, out, cache, split_layer):
        return suffix.step_rows(out, cache, split_layer)

    def prompt_tokens(self, inputs) -> int:
        return int(inputs[0].tokens)

    @property
    def step_position_rows(self) -> int:
        from .contract import POSITION_IDS

        return 3 if POSITION_IDS in self.cfg.side else 0

    def step_crossing(self, out):
        return out.hidden_states, out.position_ids

    def step_arrived(self, rows, positions):
        from .contract import SplitState

        return SplitState(rows, positions)

    def prefix_step(self, stage, token_ids, prefill, cache, position: int, queries: tuple[int, int] = (0, 0)):
        """The token's multimodal rotary positions continue after the prefill's largest, as ``generate`` does
        (Qwen-VL's ``rope_deltas``); a family with plain positions continues from the cache. ``queries``: as
        :meth:`~.modeling.VLMPrefixStage.step`."""
        positions = None
        if prefill.position_ids is not None:
            rotary = prefill.position_ids[-3:]
            start = int(rotary.max()) + 1 + position - int(prefill.hidden_states.shape[-2])
            steps = torch.arange(start, start + token_ids.numel(), device=rotary.device)
            positions = steps.view(1, 1, -1).expand(3, rotary.shape[1], -1)
        return stage.step(token_ids, positions, cache, queries)

    def decode_referee(self, dtype, inputs: tuple, max_new_tokens: int, cache_len: int | None = None):
        """The family's ForConditionalGeneration ``generate`` on the processor's outputs (greedy, static cache of
        ``cache_len`` tokens, default ``generate``'s own), stopping at the generation config's end tokens, or at a
        decoding composition's own ``decode.stop_token_ids`` (what its nodes stop at; none: never)."""
        import copy

        from .vlm import vlm_family

        family = vlm_family(self.cfg.vlm_type)
        ref = family.generation_class.from_pretrained(str(self.ck.hf.path), dtype=dtype).eval()
        generation = copy.deepcopy(ref.generation_config)
        if self.takes_cameras and self.cfg.decode:
            generation.eos_token_id = list(self.cfg.decode_spec.settings.stop_token_ids) or None
        stop = generation.eos_token_id
        stop = () if stop is None else ((stop,) if isinstance(stop, int) else tuple(stop))
        frame = inputs[0]
        generation.update(max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=stop[0] if stop else 0)
        out = ref.generate(input_ids=frame.input_ids, attention_mask=torch.ones_like(frame.input_ids),
                           generation_config=generation, **frame.to("cpu", dtype).images,
                           **_static_cache(ref, cache_len))
        return (out.sequences[0, frame.input_ids.shape[1]:].tolist(), [x[0].float() for x in out.logits], stop,
                f"transformers {family.generation_class.__name__}.generate (greedy, static cache)")

    def decode_readout_referee(self, dtype, inputs: tuple, tokens: list[int], command: int) -> torch.Tensor:
        """The planning head after a decode, by transformers: the family's ForConditionalGeneration forward over the
        frame's prompt + ``tokens`` (decoded) + the placed tokens (``cfg.decode_placed_token_ids``; a ``queries``
        read-out's learned queries in its last rows' embeddings), the text model's final-norm input, then this
        checkpoint's norm and head (:func:`~.modeling.plan`, on the read-out rows) -> modes (M, N, 2) float32 m."""
        from .modeling import plan
        from .vlm import vlm_family, with_token

        family = vlm_family(self.cfg.vlm_type)
        ref = family.generation_class.from_pretrained(str(self.ck.hf.path), dtype=dtype).eval()
        frame = inputs[0]
        for t in [*tokens, *self.cfg.decode_placed_token_ids]:
            frame = with_token(frame, int(t))
        kept = []
        text = getattr(ref.model, family.text_attribute)
        hooks = [text.norm.register_forward_pre_hook(lambda module, args: kept.append(args[0][0].clone()))]
        queries = self.cfg.query_count
        if queries:  # the composition's learned queries in place of the last planning-token copies
            learned = self.ck.load("prefix", 0, dtype=dtype).query_tokens.detach()
            hooks.append(text.get_input_embeddings().register_forward_hook(
                lambda module, args, out: torch.cat([out[:, :-queries], learned.to(out.dtype).unsqueeze(0)], dim=1)))
        try:
            ref.model(input_ids=frame.input_ids, **frame.to("cpu", dtype).images)
        finally:
            for h in hooks:
                h.remove()
        return plan(self.ck.load("suffix", self.num_layers, dtype=dtype), kept[-1], command).modes

    def activation_phases(self, split_layer, e, role):
        d = act.llm_dims(self.cfg)
        state = d["B"] * d["T"] * d["H"] * e
        if role == "prefix":
            return act.llm_prefix_phases(self.cfg, e, split_layer, act.vlm_front_phases(self.cfg, e, state))
        tail = act.head_phase(self.cfg) if self.takes_cameras else act.norm_phase(self.cfg, e)
        return act.llm_suffix_phases(self.cfg, e, split_layer, tail)

    def arch_key(self) -> dict:
        return DrivingVLA.arch_key(self) if self.takes_cameras else super().arch_key()


class DrivingVLA(SplitModel):
    """This package's driving model (:class:`~.config.VLAConfig`). Its referee is transformers' LLM on the hybrid's
    own h_0, or a whole LLaVA where the composition adds nothing to it."""

    takes_cameras = True
    STAGES = {"prefix": modeling.PrefixStage, "suffix": modeling.SuffixStage, "full": modeling.VLAModel}

    @property
    def profile_detailed(self) -> bool:
        return self.cfg.projector["type"] != "llava"

    def example_inputs(self, frames=None, device="cpu", dtype=torch.float32) -> tuple:
        cfg = self.cfg
        if frames is None:
            pixels = torch.rand((cfg.n_cameras, 3, cfg.image_size, cfg.image_size), device=device, dtype=dtype)
            return pixels, torch.zeros(3, device=device) if cfg.ego_state_input else None, None
        ego = torch.tensor(EGO_STATE) if cfg.ego_state_input else None
        return frames.pixels(cfg).to(device, dtype), ego, example_scene(cfg)

    produces_in_place = True
    decodes_scaled = True

    @property
    def NO_DECODE(self) -> str:
        if self.cfg.decode:
            return NO_STATE_DECODE
        return ("this model has no language-model head to decode with: its planning head reads fixed positions of "
                "one prefill (a 'decode' mapping in its config.json makes it decode)")

    @property
    def decodes(self) -> bool:
        """Whether its config decodes (``decode``: ORION's questions answered before its planning token), on blocks
        without state a decode would carry."""
        return bool(self.cfg.decode) and not _state_blocks(self.cfg)

    def run_prefix(self, stage, inputs, out=None, cache=None, chunk_rows: int = 0):
        if cache is not None:
            return stage(inputs[0], inputs[1], scene=inputs[2], cache=cache, chunk_rows=chunk_rows)
        return stage(inputs[0], inputs[1], scene=inputs[2], out=out)

    def prompt_tokens(self, inputs) -> int:
        return int(self.cfg.num_tokens)

    def prefix_step(self, stage, token_ids, prefill, cache, position: int, queries: tuple[int, int] = (0, 0)):
        return stage.step(token_ids, cache)

    def placed_rows(self, suffix, out, cache, split_layer):
        return suffix.step_rows(out, cache, split_layer)

    def tokenizer(self):
        """The tokenizer beside the referred LLM's config (a converted ORION's), or None."""
        from .published_prompts import _load_tokenizer, has_tokenizer

        hf = None if self.ck is None else self.ck.hf
        if hf is None or not has_tokenizer(hf.path):
            return None
        return _load_tokenizer(hf.path)

    def _causal_lm(self, dtype):
        """transformers' causal LM of its LLM: the referred directory's (``from_pretrained``), or built from
        ``llm`` with the checkpoint's own LLM tensors (LM head tied to the token embeddings, as the split reads it).
        Returns (model, what it is)."""
        ck, cfg = self.ck, self.cfg
        cls = causal_lm_class(cfg.llm_type)
        if ck.hf is not None and ck.hf.kind == "llm":
            return (cls.from_pretrained(str(ck.hf.path), dtype=dtype).eval(),
                    f"transformers {ck.hf.architecture}.from_pretrained({ck.hf.path})")
        from safetensors.torch import load_file
        from transformers import AutoConfig

        conf = AutoConfig.for_model(cfg.llm_type, **{k: v for k, v in cfg.llm.items() if k != "model_type"})
        ref = cls(conf).to(dtype).eval()
        stored = load_file(str(ck.own_weights))
        parts = {k: v.to(dtype) for k, v in stored.items() if k.split(".")[0] in ("embed_tokens", "layers", "norm")}
        ref.model.load_state_dict(parts, strict=True)
        ref.lm_head.weight = ref.model.embed_tokens.weight
        return ref, f"transformers {type(ref).__name__} with the checkpoint's LLM tensors (LM head tied)"

    def decode_referee(self, dtype, inputs: tuple, max_new_tokens: int, cache_len: int | None = None):
        """ORION's own decode (its ``simple_test_pts``): for each decode of the frame, transformers' ``generate``
        (greedy, a static cache of ``cache_len`` tokens) on the whole history as input embeddings -- h_0 from this
        package's front (the referee of :meth:`referee`), then the token embeddings of the earlier answers and
        turns -- stopping at ``decode.stop_token_ids``. Returns (every decode's new token ids in order, logits of
        each step (V,) float32, the stop ids, what it is)."""
        spec = self.cfg.decode_spec
        stop = tuple(spec.settings.stop_token_ids)
        ref, name = self._causal_lm(dtype)
        h0 = self.run_prefix(self.ck.load("prefix", 0, dtype=dtype), inputs).to(dtype)
        embed = ref.get_input_embeddings()
        history: list[int] = []
        tokens, logits = [], []
        for i in range(spec.decodes_per_frame):
            rows = torch.cat([h0, embed(torch.tensor(history, dtype=torch.long))]) if history else h0
            out = ref.generate(inputs_embeds=rows.unsqueeze(0), attention_mask=torch.ones(1, rows.shape[0],
                                                                                          dtype=torch.long),
                               max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(stop) or None,
                               pad_token_id=stop[0] if stop else 0, output_logits=True,
                               return_dict_in_generate=True, **_static_cache(ref, cache_len))
            new = out.sequences[0].tolist()  # generate on input embeddings returns the new tokens only
            tokens += new
            logits += [x[0].float() for x in out.logits]
            if i < len(spec.turns):
                history += new + list(spec.turns[i])
        return tokens, logits, stop, f"{name}: generate per decode on the history (greedy, static cache)"

    def decode_readout_referee(self, dtype, inputs: tuple, tokens: list[int], command: int) -> torch.Tensor:
        """The planning head after the decode, by transformers: its LLM's forward on h_0 + the token embeddings of
        ``tokens`` (the answers and turns in order) + the placed tokens, the final-norm input, then this
        checkpoint's norm and head (:func:`~.modeling.plan`) -> modes (M, N, 2) float32 m."""
        ref, _ = self._causal_lm(dtype)
        h0 = self.run_prefix(self.ck.load("prefix", 0, dtype=dtype), inputs).to(dtype)
        ids = torch.tensor([*tokens, *self.cfg.decode_placed_token_ids], dtype=torch.long)
        rows = torch.cat([h0, ref.get_input_embeddings()(ids)])
        kept = []
        hook = ref.model.norm.register_forward_pre_hook(lambda module, args: kept.append(args[0][0].clone()))
        try:
            ref.model(inputs_embeds=rows.unsqueeze(0))
        finally:
            hook.remove()
        return plan(self.ck.load("suffix", self.num_layers, dtype=dtype), kept[-1], command).modes

    def frame_args(self, frames, ego_state=None, scene=None, device="cpu", dtype=torch.float32) -> tuple:
        ego = None if ego_state is None else torch.as_tensor(ego_state, dtype=torch.float32)
        return frames.pixels(self.cfg).to(device, dtype, non_blocking=True), ego, scene

    def describe_inputs(self, inputs) -> str:
        cfg = self.cfg
        return (f"camera frame of {cfg.n_cameras} camera(s) from the embedded bag at {cfg.image_size} px, "
                f"{cfg.num_tokens} tokens" + (", ego state" if inputs[1] is not None else "")
                + (", made-up camera geometry and ego frame (query heads)" if inputs[2] is not None else ""))

    def camera_description(self) -> str:
        return f"{self.cfg.image_size}px"

    def readout_rows(self, final):
        at = self.cfg.readout_positions
        if final.dim() == 3 and at.decision is not None:
            return torch.stack([final[-1, at.planning], final[0, at.decision]])
        return final[..., at.planning, :].reshape(-1, final.shape[-1])

    def profile_tail(self, tail, out):
        return lambda: plan(tail, out, DEFAULT_COMMAND)

    def referee(self, dtype, inputs, h0=None) -> Referee:
        ck, cfg = self.ck, self.cfg
        if ck.hf is not None and ck.hf.kind == "llava" and not cfg.ego_state_input and cfg.llm_passes == 1:
            from transformers import LlavaForConditionalGeneration

            ref = LlavaForConditionalGeneration.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
            out = ref(input_ids=torch.tensor([llava_input_ids(cfg)]), pixel_values=inputs[0].to(dtype),
                      output_hidden_states=True)
            return Referee(_reference_states(out), None,
                           f"transformers LlavaForConditionalGeneration.from_pretrained({ck.hf.path})")
        if h0 is None:
            h0 = self.run_prefix(ck.load("prefix", 0, dtype=dtype), inputs)
        states, name = self._llm_on_embeddings(h0.to(dtype), dtype)
        return Referee(states, None, name, h0)

    def _llm_on_embeddings(self, h0: torch.Tensor, dtype) -> tuple[list, str]:
        """transformers' language model (the referred directory's, or built from ``llm``) on h_0: its hidden
        states, and what ran."""
        ck, cfg = self.ck, self.cfg
        batch = h0 if h0.dim() == 3 else h0.unsqueeze(0)
        if ck.hf is not None and ck.hf.kind == "llm" and getattr(cfg, "pass_lora_rank", 0):
            return self._per_pass(batch, dtype)
        if ck.hf is not None and ck.hf.kind == "llm":
            ref = causal_lm_class(cfg.llm_type).from_pretrained(str(ck.hf.path), dtype=dtype).eval()
            out = ref.model(inputs_embeds=batch, output_hidden_states=True)
            return _reference_states(out), f"transformers {ck.hf.architecture}.from_pretrained({ck.hf.path}) on h_0"
        if ck.hf is not None:
            from transformers import LlavaForConditionalGeneration

            ref = LlavaForConditionalGeneration.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
            out = ref.model.language_model(inputs_embeds=batch, output_hidden_states=True)
            return _reference_states(out), (f"the language model of transformers LlavaForConditionalGeneration "
                                            f"({ck.hf.path}) on h_0")
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel

        conf = AutoConfig.for_model(cfg.llm_type, **{k: v for k, v in cfg.llm.items() if k != "model_type"})
        ref = AutoModel.from_config(conf).to(dtype).eval()  # the attention transformers picks for the family
        stored = load_file(str(ck.own_weights))
        llm_parts = ("embed_tokens", "layers", "norm")
        ref.load_state_dict({k: v.to(dtype) for k, v in stored.items() if k.split(".")[0] in llm_parts}, strict=True)
        out = ref(inputs_embeds=batch, output_hidden_states=True)
        return _reference_states(out), f"transformers {type(ref).__name__} with the checkpoint's LLM tensors on h_0"

    def _per_pass(self, batch: torch.Tensor, dtype) -> tuple[list, str]:
        """A converted MindDrive checkpoint: per pass p, the LLM with ``adapters/<pass_adapters[p]>`` merged by peft
        on h_0[p]; hidden states (P, T, H). Raises RuntimeError without peft or an adapter directory."""
        try:
            from peft import PeftModel
        except ImportError:
            raise RuntimeError("verifying per-pass LoRA adapters needs peft (pip install peft): the reference merges "
                               "each adapter with peft itself") from None
        ck, cfg = self.ck, self.cfg
        per_pass = []
        for p, name in enumerate(cfg.pass_adapters):
            adapter = ck.path / "adapters" / name
            if not (adapter / "adapter_config.json").is_file():
                raise RuntimeError(f"{adapter}: adapter directory missing (written by `hybrid-vla convert`)")
            base = causal_lm_class(cfg.llm_type).from_pretrained(str(ck.hf.path), dtype=dtype)
            merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()
            per_pass.append(merged.model(inputs_embeds=batch[p:p + 1], output_hidden_states=True).hidden_states)
            del merged, base
        states = [torch.cat([hs[i] for hs in per_pass], dim=0) for i in range(len(per_pass[0]))]
        return states, (f"transformers {ck.hf.architecture}.from_pretrained({ck.hf.path}) with peft merging adapter "
                        f"{', '.join(cfg.pass_adapters)} (pass 0, 1, ...) on h_0 of each pass")

    def head_on_final(self, suffix, final):
        """The read-out on the referee's final states, as ``plan`` reads it (``vae`` in base_link axes)."""
        cfg = self.cfg
        if not hasattr(suffix, "head"):  # a transformers LLaVA directory as it is: no planning head
            return None
        at = cfg.readout_positions
        if cfg.readout_type == "vae_speed_path":
            from .modeling import speed_path_plan

            decision = suffix.decision_head(final[0, at.decision] if final.dim() == 3 else final[at.decision]).float()
            action = final[-1] if final.dim() == 3 else final
            return speed_path_plan(suffix, action[[at.planning, at.path]], DEFAULT_COMMAND, decision,
                                   int(decision.argmax())).modes
        if cfg.readout_type == "queries":
            return suffix.head(final[-cfg.query_count:])
        if cfg.readout_type == "module":
            return suffix.head(final)
        last = final[..., at.planning, :]
        modes = suffix.head(last[-1] if last.dim() == 2 else last)
        if cfg.readout_type == "vae":
            from .vae_planner import published_to_base_link

            modes = published_to_base_link(modes)
        return modes

    def activation_phases(self, split_layer, e, role):
        cfg = self.cfg
        if role == "suffix":
            return act.llm_suffix_phases(cfg, e, split_layer, act.head_phase(cfg))
        front = act.own_front_phases(cfg, e)
        return act.llm_prefix_phases(cfg, e, split_layer, front, held={"pixels": front[0].live["pixels"]})

    def arch_key(self) -> dict:
        cfg = self.cfg
        return {"llm": dict(cfg.llm), "vision": dict(cfg.vision), "projector": dict(cfg.projector),
                "n_cameras": cfg.n_cameras, "image_size": cfg.image_size,
                "prefix_state_shape": list(cfg.prefix_state_shape), "n_modes": cfg.n_modes,
                "n_waypoints": cfg.n_waypoints}


class OwnCode(SplitModel):
    """A team's own model code (:class:`~.extension.CodeModel`); its referee is its own forward, and its
    activations are not modelled."""

    plan_notes = ("own model code: activations are not estimated (weights are exact); add your own margin to the "
                  "budget",)

    def build_stage(self, role, split_layer=None, stop=None):
        return self.cfg.build_stage(role, split_layer, stop)  # the own code builds its own stages

    @property
    def takes_cameras(self) -> bool:
        return self.cfg.drives

    def example_inputs(self, frames=None, device="cpu", dtype=torch.float32) -> tuple:
        with torch.device("meta"):  # built without weights; its example_inputs makes CPU tensors
            model = self.cfg.new_model()
        return tuple(x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype) if torch.is_tensor(x)
                     else x for x in model.example_inputs(0))

    def describe_inputs(self, inputs) -> str:
        return "the model's example_inputs(0)"

    def run_prefix(self, stage, inputs):
        """Its prefix on the inputs; RuntimeError when the hidden states are not the shape the model declares."""
        h = stage(*inputs)
        if tuple(h.shape) != self.cfg.prefix_state_shape:
            raise RuntimeError(f"the prefix at K={stage.split_layer} gave hidden states {tuple(h.shape)}, the model "
                               f"declares {self.cfg.prefix_state_shape}")
        return h

    def frame_args(self, frames, ego_state=None, scene=None, device="cpu", dtype=torch.float32) -> tuple:
        return (frames.pixels(self.cfg).to(device, dtype, non_blocking=True),)

    def copy_reason(self, stage) -> str:
        return f"own model code {self.cfg.spec}"

    def final_states(self, suffix, out):
        return None

    def output(self, suffix, out):
        return suffix(out)

    def profile_tail(self, tail, out):
        return lambda: tail(out)

    def block_driver(self, stage, out, device):
        from torch import nn

        return None, lambda block, i: stage.code.run_blocks(nn.ModuleList([block]), out, i)

    def referee(self, dtype, inputs, h0=None) -> Referee:
        """The model's own forward. Raises ValueError when a driving model's output is not its (M, N, 2)."""
        full = self.ck.load("full", dtype=dtype)
        cast = tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
        out = full(*cast)
        code = self.cfg
        if code.drives and tuple(out.shape) != (code.n_modes, code.n_waypoints, 2):
            raise ValueError(f"{code.spec}.forward gives {tuple(out.shape)}; its driving I/O declares waypoints "
                             f"{(code.n_modes, code.n_waypoints, 2)} (n_modes, n_waypoints, 2): the nodes would drop "
                             "every frame")
        return Referee(None, out, f"{code.spec}.forward (the model's own)")

    def activation_phases(self, split_layer, e, role):
        return []


def profile_arch_key(doc: dict) -> dict:
    """The :meth:`SplitModel.arch_key` of the model a profile was measured on, from its recorded config."""
    config = doc["model"]["config"]
    if config.get("model_type") == MODEL_TYPE:
        return split_model(VLAConfig.from_dict(config)).arch_key()
    return {"config": {k: v for k, v in config.items() if k not in ("num_tokens", "prefix_state_shape")},
            "prefix_state_shape": list(doc["prefix_state_shape"])}


@dataclass(frozen=True)
class ProfiledShape:
    """What a profile's tables must match; ``vision_layers`` None: not timed one by one; ``prefix_state_shape``
    None: taken as recorded."""

    num_layers: int
    vision_layers: int | None = None
    prefix_state_shape: tuple[int, ...] | None = None


def profiled_shape(doc: dict) -> ProfiledShape:
    """The :class:`ProfiledShape` of a profile document. Raises ValueError for a driving config that does not
    validate or a missing block count."""
    config = doc["model"]["config"]
    if config.get("model_type") == MODEL_TYPE:
        try:
            cfg = VLAConfig.from_dict(config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"model/config: {e}") from None
        return ProfiledShape(cfg.num_layers, int(cfg.vision["num_hidden_layers"]), tuple(cfg.prefix_state_shape))
    layers = doc.get("num_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"num_layers: a profile of a {config.get('model_type')!r} model must state its decoder "
                         "block count")
    return ProfiledShape(layers)


def split_model(cfg, ck=None, *, prompt_ids: list[int] | None = None) -> SplitModel:
    """The :class:`SplitModel` of a config: the one place the kinds are told apart. ``prompt_ids``: a bare LM's
    example token ids."""
    if isinstance(cfg, VLMSpec) or (isinstance(cfg, VLAConfig) and cfg.vlm_front):
        return VLMFront(cfg, ck)
    if isinstance(cfg, VLAConfig):
        return DrivingVLA(cfg, ck)
    if isinstance(cfg, LMConfig):
        return TextLM(cfg, ck, prompt_ids)
    return OwnCode(cfg, ck)
