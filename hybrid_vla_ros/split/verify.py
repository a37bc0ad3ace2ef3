"""Is the split exact? The hybrid at every split layer K against transformers' own forward (``verify-split``).

For a checkpoint directory and every K in [0, L], the prefix is loaded at K and the suffix at K (each reading
only its own tensors, as the nodes do) and run on the same input; the result is compared with an
**independent reference**, a forward that shares none of the split path's code (no ``embed`` / ``run_blocks``
/ ``plan``, no tensor loader of this package where transformers has its own):

============================  ===========================================================================
checkpoint                    reference
============================  ===========================================================================
transformers LLaMA / Qwen2    ``LlamaForCausalLM`` / ``Qwen2ForCausalLM.from_pretrained(DIR)`` on token ids
transformers LLaVA            ``LlavaForConditionalGeneration.from_pretrained(DIR)`` on a camera frame of the
                              embedded bag and a prompt (``input_ids`` with LLaVA's expanded image tokens)
composed on an LLM            the package's own vision side gives h_0 (its own part); the LLM is
                              ``<Arch>ForCausalLM.from_pretrained(llm_path).model(inputs_embeds=h_0)``
composed on a LLaVA           ``LlavaForConditionalGeneration.from_pretrained(vlm_path)`` on the frame (with
                              ego / pass embeddings, which LLaVA does not have: its language model on h_0)
converted MindDrive           per pass p: ``from_pretrained(llm_path)`` with the peft adapter directory
(per-pass LoRA adapters)      ``adapters/<pass_adapters[p]>`` merged by peft itself, on h_0[p]
this package's own format     transformers ``LlamaModel`` / ``Qwen2Model`` built from ``llm``, its weights
                              read with ``safetensors.torch.load_file``, on h_0
own model code                the model's own ``forward`` (:mod:`hybrid_vla_ros.model.extension`)
transformers VLM (Qwen2-VL,   ``<Family>ForConditionalGeneration.from_pretrained(DIR)`` on the embedded bag's
Qwen2.5-VL, Qwen3-VL,         camera images and the prompt through the family's own processor (both sides
InternVL, LLaVA-NeXT /        get the same processor outputs); h_K against the input of its text model's
OneVision, Idefics3, SmolVLM) block K (a forward pre-hook: for Qwen3-VL, after the DeepStack features of the
                              blocks before K), the final state against its text model's last_hidden_state
============================  ===========================================================================

Per K it reports, against the referee, three maximum absolute differences: ``prefix`` (h_K, every token, against
its ``hidden_states[K]``; none at K = L, where transformers' last entry is already normed), ``final`` (the final-norm
hidden states the read-outs use, at ``readout_positions``: the planning token, the last unless the prompts put it
elsewhere) and ``output`` (waypoints of every mode: the planning head on the referee's final states; own code: the
model's output). Each is judged against its own **allowed** difference, the referee's own rounding measured in the
same run: the referee is run a second time in float64 on the same input, and

    allowed = max(ROUNDING_FACTOR x max|referee - referee in float64|, ULP_FLOOR x eps(dtype) x max|referee in fp64|)

per compared tensor (for ``output``: the head on the float64 run's final states). So a difference of rounding
size passes whatever order the host's kernels sum in, and a wrong mask, bias or rotary table (1e-2 relative and
up, far above fp32 rounding) fails; ``tolerance`` replaces it by one fixed maximum.

It also runs the **same code unsplit** (the prefix at K = L, whose block inputs give h_K, and the suffix at L) and
reports the largest difference of h_K, the final states and the waypoints against it (``unsplit``): splitting
must change no bit, so anything but 0 fails (not for own code, whose own forward is its referee).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.checkpoint import Checkpoint, open_checkpoint, parse_dtype
from ..model.config import VLAConfig, VLMSpec
from ..model.modeling import example_scene, llava_input_ids

#: allowed = ROUNDING_FACTOR x the referee's own rounding error (its run against its float64 run), at least
#: ULP_FLOOR units in the last place of the tensor's largest value (module docstring).
ROUNDING_FACTOR = 8.0
ULP_FLOOR = 16.0
#: The ego state fed to models that take one: speed 8.3 m/s, acceleration -0.4 m/s^2, yaw rate 0.05 rad/s.
EGO_STATE = (8.3, -0.4, 0.05)


@dataclass
class VerifyRow:
    """Split layer ``k``: max abs differences against the referee (``prefix`` h_K, ``final``, ``output``; None where
    not applicable), each one's ``allowed_*`` difference, ``unsplit`` (max abs difference of the same three against
    the same code unsplit; None for own code) and whether all hold."""

    k: int
    prefix: float | None
    final: float | None
    output: float | None
    allowed_prefix: float | None = None
    allowed_final: float | None = None
    allowed_output: float | None = None
    unsplit: float | None = None
    ok: bool = False

    def judge(self) -> "VerifyRow":
        """Set ``ok``: each difference within its allowed one, and bit-exact against the unsplit model."""
        pairs = ((self.prefix, self.allowed_prefix), (self.final, self.allowed_final),
                 (self.output, self.allowed_output))
        self.ok = all(d is None or d <= a for d, a in pairs) and (self.unsplit is None or self.unsplit == 0.0)
        return self

    @property
    def fraction(self) -> float:
        """The largest difference as a fraction of its allowed one (0 when all are 0)."""
        pairs = ((self.prefix, self.allowed_prefix), (self.final, self.allowed_final),
                 (self.output, self.allowed_output))
        return max((d / a if a else (0.0 if d == 0 else math.inf) for d, a in pairs if d is not None), default=0.0)


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_split`: what was checked against what, one row per K in [0, L]. ``tolerance``: a
    fixed max abs difference the user gave, or None for the rounding basis described by ``basis``."""

    model: str
    description: str
    reference: str
    inputs: str
    dtype: str
    tolerance: float | None
    basis: str = ""
    rows: list[VerifyRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def worst(self) -> float:
        """The largest difference against the referee, any K and column."""
        return max((v for r in self.rows for v in (r.prefix, r.final, r.output) if v is not None), default=0.0)

    @property
    def worst_fraction(self) -> float:
        """The largest difference as a fraction of its allowed one."""
        return max((r.fraction for r in self.rows), default=0.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "worst": self.worst, "worst_fraction": self.worst_fraction}


@dataclass
class _Allowed:
    """The allowed difference of each column (per K for h_K), from the referee and its float64 run."""

    prefix: list[float | None]
    final: float
    output: float | None

    def row(self, k: int, prefix, final, output, unsplit) -> VerifyRow:
        return VerifyRow(k, prefix, final, output, self.prefix[k] if prefix is not None else None, self.final,
                         self.output if output is not None else None, unsplit).judge()


def _allowed(ref: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype, fixed: float | None) -> float:
    """The allowed max abs difference from ``ref`` (the referee in ``dtype``) given its float64 run ``ref64``
    (module docstring), or ``fixed`` when the user gave a tolerance."""
    if fixed is not None:
        return fixed
    spread = (ref.double() - ref64.double()).abs().max().item()
    scale = ref64.double().abs().max().item()
    return max(ROUNDING_FACTOR * spread, ULP_FLOOR * torch.finfo(dtype).eps * scale)


def _basis(dtype_name: str, fixed: float | None, note: str = "") -> str:
    if fixed is not None:
        return f"a fixed max abs difference of {fixed:g} (--tolerance)"
    return (f"{ROUNDING_FACTOR:g} x the referee's own {dtype_name} rounding (its run against its float64 run on the "
            f"same input), at least {ULP_FLOOR:g} ulp of the tensor's largest value{note}")


class _Unsplit:
    """The same code unsplit: the prefix at K = L (the input of each block kept: h_K for K < L) and the suffix at L.
    ``states[k]`` is h_k (for a VLM, its SplitState's hidden states), ``final`` the final-norm states of every token,
    ``output`` the waypoints (None without a head)."""

    def __init__(self, ck: Checkpoint, dtype, run_prefix):
        L = ck.num_layers
        prefix = ck.load("prefix", L, dtype=dtype)
        kept: list[torch.Tensor] = []
        hooks = [layer.register_forward_pre_hook(
            lambda module, args, kwargs: kept.append((args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True) for layer in prefix.layers]
        try:
            out = run_prefix(prefix)
        finally:
            for h in hooks:
                h.remove()
        del prefix
        hidden = out.hidden_states if hasattr(out, "hidden_states") else out
        self.states = [s.reshape(hidden.shape) for s in kept] + [hidden]
        suffix = ck.load("suffix", L, dtype=dtype)
        self.final = suffix.final_hidden_states(out)
        self.output = suffix.plan_all(out).modes if hasattr(suffix, "head") else None

    def diff(self, k: int, h: torch.Tensor, final: torch.Tensor, output: torch.Tensor | None) -> float:
        """Max abs difference of the split at K = k (h_K, final states, waypoints) against this run."""
        out = [_diff(h, self.states[k]), _diff(final, self.final)]
        if output is not None:
            out.append(_diff(output, self.output))
        return max(out)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise RuntimeError(f"shapes differ: split {tuple(a.shape)} vs reference {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item()


def _readout_rows(cfg, final: torch.Tensor) -> torch.Tensor:
    """The final-norm states the heads read (``cfg.readout_positions``): the planning token of the last pass and,
    with two passes, the decision pass's read-out token (never a pass's padding); the last token where the config
    has no read-out positions. (R, H)."""
    at = getattr(cfg, "readout_positions", None)
    if at is None:
        return final[..., -1, :].reshape(-1, final.shape[-1])
    if final.dim() == 3 and at.decision is not None:
        return torch.stack([final[-1, at.planning], final[0, at.decision]])
    return final[..., at.planning, :].reshape(-1, final.shape[-1])


def bag_pixels(cfg: VLAConfig) -> torch.Tensor:
    """One synchronized frame of the embedded bag (data/dgp_scene02_6cam_mcap), cameras in index order (cycled
    when the model takes more than the bag's 6), decoded and preprocessed for ``cfg``: (C, 3, S, S) float32."""
    from rosbags.typesys import Stores, get_typestore

    from ..util.bags import read_bag
    from ..util.paths import embedded_bag
    from ..vehicle.image import decode_compressed, preprocess

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(embedded_bag()):
        if m.topic.endswith("/image_raw/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    msgs = [first[t] for t in sorted(first)]
    images = [decode_compressed(msgs[i % len(msgs)].format, msgs[i % len(msgs)].data) for i in range(cfg.n_cameras)]
    return preprocess(images, cfg.image_size, cfg.image_mean, cfg.image_std, resize=cfg.image_resize)


def bag_images(cameras: int, camera_size: tuple[int, int] | None = None) -> list:
    """One synchronized frame of the embedded bag as RGB uint8 arrays (H, W, 3), cameras in index order (cycled
    past the bag's 6), each resized to ``camera_size`` (width, height) when given (PIL bilinear, as the prefix
    node does, :func:`~hybrid_vla_ros.vehicle.image.resize_rgb`)."""
    from rosbags.typesys import Stores, get_typestore

    from ..util.bags import read_bag
    from ..util.paths import embedded_bag
    from ..vehicle.image import decode_compressed, resize_rgb

    store = get_typestore(Stores.ROS2_KILTED)
    first = {}
    for m in read_bag(embedded_bag()):
        if m.topic.endswith("/image_raw/compressed") and m.topic not in first:
            first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
    msgs = [first[t] for t in sorted(first)]
    images = [decode_compressed(msgs[i % len(msgs)].format, msgs[i % len(msgs)].data) for i in range(cameras)]
    return [resize_rgb(im, camera_size) for im in images] if camera_size else images


def head_on_reference(suffix, final: torch.Tensor) -> torch.Tensor:
    """The suffix's read-out head applied to the reference's final-norm hidden states ``final`` ((T, H), or
    (P, T, H) with P passes): ``mlp`` / ``vae`` on the planning token of the action (last) pass,
    ``vae_speed_path`` on its planning and path tokens with the decision pass's decision (token positions:
    ``cfg.readout_positions``), ``queries`` on the
    last ``query_count`` tokens, ``module`` on every token. Returns its (M, N, 2) waypoints."""
    cfg = suffix.cfg
    at = cfg.readout_positions
    if cfg.readout_type == "vae_speed_path":  # MindDrive: the decided speed plan along each path, as plan() does
        from ..model.modeling import DEFAULT_COMMAND, speed_path_plan

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
    if cfg.readout_type == "vae":  # plan() gives the published planner's positions in base_link axes
        from ..model.vae_planner import published_to_base_link

        modes = published_to_base_link(modes)
    return modes


def _vlm_reference(ck: Checkpoint, dtype, inputs) -> tuple[list, str]:
    """transformers' own ForConditionalGeneration of a VLM directory on the processor's outputs: the input of
    each text block (forward pre-hooks on the text model's layers; L entries) and the text model's
    last_hidden_state (the final norm's output), batch dim dropped."""
    from ..model.vlm import vlm_family

    family = vlm_family(ck.model.vlm_type)
    ref = family.generation_class.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
    text = getattr(ref.model, family.text_attribute)
    states = []

    def keep(module, args, kwargs):
        states.append((args[0] if args else kwargs["hidden_states"])[0].clone())

    hooks = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in text.layers]
    queries = getattr(ck.model, "query_count", 0)
    if queries:  # a queries read-out: the composition's own learned query embeddings in the copies' rows
        learned = ck.load("prefix", 0, dtype=dtype).query_tokens.detach()

        def swap(module, args, out):
            return torch.cat([out[:, :-queries], learned.to(out.dtype).unsqueeze(0)], dim=1)

        hooks.append(text.get_input_embeddings().register_forward_hook(swap))
    try:
        last = ref.model(input_ids=inputs.input_ids, **inputs.to("cpu", dtype).images).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    return states + [last], (f"transformers {family.generation_class.__name__}.from_pretrained({ck.hf.path}) "
                             "(each text block's input, and last_hidden_state)")


def _causal_lm_class(model_type: str):
    """transformers' causal LM class of a text family (``Qwen3ForCausalLM``, ``Gemma3ForCausalLM``, ...), from
    transformers' own ``MODEL_FOR_CAUSAL_LM_MAPPING``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


def _hidden_states(out) -> list[torch.Tensor]:
    return [h.squeeze(0) if h.shape[0] == 1 else h for h in out.hidden_states]


def _llm_reference_on_embeddings(ck: Checkpoint, cfg: VLAConfig, h0: torch.Tensor, dtype) -> tuple[list, str]:
    """transformers' language model (of the referred directory, or built from ``llm`` for this package's own
    format) run on the hybrid's h_0: its hidden_states, and a description."""
    batch = h0 if h0.dim() == 3 else h0.unsqueeze(0)
    if ck.hf is not None and ck.hf.kind == "llm" and getattr(cfg, "pass_lora_rank", 0):
        return _per_pass_reference(ck, cfg, batch, dtype)
    if ck.hf is not None and ck.hf.kind == "llm":
        ref = _causal_lm_class(cfg.llm_type).from_pretrained(str(ck.hf.path), dtype=dtype).eval()
        out = ref.model(inputs_embeds=batch, output_hidden_states=True)
        return _hidden_states(out), f"transformers {ck.hf.architecture}.from_pretrained({ck.hf.path}) on h_0"
    if ck.hf is not None:
        from transformers import LlavaForConditionalGeneration

        ref = LlavaForConditionalGeneration.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
        out = ref.model.language_model(inputs_embeds=batch, output_hidden_states=True)
        return _hidden_states(out), f"the language model of transformers LlavaForConditionalGeneration " \
                                    f"({ck.hf.path}) on h_0"
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel

    conf = AutoConfig.for_model(cfg.llm_type, **{k: v for k, v in cfg.llm.items() if k != "model_type"})
    ref = AutoModel.from_config(conf).to(dtype).eval()  # the attention transformers picks for the family
    model_cls = type(ref)
    stored = load_file(str(ck.own_weights))
    llm_parts = ("embed_tokens", "layers", "norm")
    ref.load_state_dict({k: v.to(dtype) for k, v in stored.items() if k.split(".")[0] in llm_parts}, strict=True)
    out = ref(inputs_embeds=batch, output_hidden_states=True)
    return _hidden_states(out), f"transformers {model_cls.__name__} with the checkpoint's LLM tensors on h_0"


def _per_pass_reference(ck: Checkpoint, cfg: VLAConfig, batch: torch.Tensor, dtype) -> tuple[list, str]:
    """A converted MindDrive checkpoint (one LoRA adapter a pass): for pass p, transformers' model of the
    referred (unmerged base) directory with the peft adapter ``adapters/<pass_adapters[p]>`` merged by peft
    itself (``PeftModel.from_pretrained(...).merge_and_unload()``), run on h_0[p]; hidden states stacked to
    (P, T, H). Raises RuntimeError when peft is not installed or an adapter directory is missing."""
    try:
        from peft import PeftModel
    except ImportError:
        raise RuntimeError("verifying per-pass LoRA adapters needs peft (pip install peft): the reference merges "
                           "each adapter with peft itself") from None
    per_pass = []
    for p, name in enumerate(cfg.pass_adapters):
        adapter = ck.path / "adapters" / name
        if not (adapter / "adapter_config.json").is_file():
            raise RuntimeError(f"{adapter}: adapter directory missing (written by `hybrid-vla convert`)")
        base = _causal_lm_class(cfg.llm_type).from_pretrained(str(ck.hf.path), dtype=dtype)
        merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()
        out = merged.model(inputs_embeds=batch[p:p + 1], output_hidden_states=True)
        per_pass.append(out.hidden_states)
        del merged, base
    states = [torch.cat([hs[i] for hs in per_pass], dim=0) for i in range(len(per_pass[0]))]
    return states, (f"transformers {ck.hf.architecture}.from_pretrained({ck.hf.path}) with peft merging adapter "
                    f"{', '.join(cfg.pass_adapters)} (pass 0, 1, ...) on h_0 of each pass")


def _reference(ck: Checkpoint, dtype, pixels, ego, ids, scene=None, h0=None) -> tuple[list, str]:
    """The referee's hidden_states (L + 1 entries, the last after the final norm) for this checkpoint's input;
    ``h0``: the hybrid's own h_0 where the referee runs on it (default: computed here in ``dtype``)."""
    cfg = ck.model
    if ck.kind == "transformers" and ck.hf.kind == "llm":
        ref = _causal_lm_class(cfg.llm_type).from_pretrained(str(ck.path), dtype=dtype).eval()
        return _hidden_states(ref(ids.unsqueeze(0), output_hidden_states=True)), \
            f"transformers {ck.hf.architecture}.from_pretrained({ck.path})"
    if ck.hf is not None and ck.hf.kind == "llava" and not cfg.ego_state_input and cfg.llm_passes == 1:
        from transformers import LlavaForConditionalGeneration

        ref = LlavaForConditionalGeneration.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
        out = ref(input_ids=torch.tensor([llava_input_ids(cfg)]), pixel_values=pixels.to(dtype),
                  output_hidden_states=True)
        return _hidden_states(out), f"transformers LlavaForConditionalGeneration.from_pretrained({ck.hf.path})"
    if h0 is None:
        h0 = ck.load("prefix", 0, dtype=dtype)(pixels, ego, scene=scene)
    return _llm_reference_on_embeddings(ck, cfg, h0.to(dtype), dtype)


def verify_split(path: str | Path, dtype: str = "fp32", *, tolerance: float | None = None,
                 prompt_ids: list[int] | None = None, cameras: int | None = None,
                 trust_model_code: bool | None = None, layers: list[int] | None = None, log=None,
                 prompt: str | None = None, camera_size: tuple[int, int] | None = None) -> VerifyReport:
    """Run the split of the checkpoint at ``path`` at every K against its referee and the same code unsplit
    (module docstring).

    ``dtype``: of both sides (fp32, bf16, fp16; the referee also runs once in float64 for its rounding);
    ``tolerance``: a fixed max abs difference instead of the rounding basis; ``prompt_ids``: token ids for a bare
    language model (default 16 fixed ids) or a LLaVA directory's prompt (one image placeholder per camera);
    ``cameras``: images per frame for a LLaVA directory (default 1); ``layers``: the split layers to check
    (default: every K in [0, L]; each K costs a whole forward, so a 30-block model on 81 tokens takes minutes on a
    small CPU); ``log``: a callable for progress lines. Everything runs on the CPU.

    Returns a :class:`VerifyReport` (``.ok``). Raises what :func:`hybrid_vla_ros.model.checkpoint.open_checkpoint`
    and the loaders raise (FileNotFoundError, ValueError), and ValueError for a tolerance that is not a positive
    number or a split layer outside [0, L].
    """
    torch_dtype = parse_dtype(dtype)
    if tolerance is not None and not (tolerance > 0 and math.isfinite(tolerance)):
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}")
    fixed = None if tolerance is None else float(tolerance)
    ck = open_checkpoint(path, trust_model_code=trust_model_code, cameras=cameras, prompt_ids=prompt_ids,
                         tokens=len(prompt_ids) if prompt_ids else 16, prompt=prompt, camera_size=camera_size)
    ks = list(range(ck.num_layers + 1)) if layers is None else sorted(set(layers))
    bad = [k for k in ks if not 0 <= k <= ck.num_layers]
    if bad or not ks:
        raise ValueError(f"split layers {bad or ks} outside [0, {ck.num_layers}] for {path}")
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[torch_dtype]
    say = log or (lambda _line: None)
    with torch.inference_mode():
        if ck.kind == "model_code":
            return _verify_code(ck, torch_dtype, name, fixed, say, ks)
        if isinstance(ck.model, VLMSpec) or (isinstance(ck.model, VLAConfig)
                                             and ck.model.projector.get("type") == "vlm"):
            return _verify_vlm(ck, torch_dtype, name, fixed, say, ks)
        return _verify_llm(ck, torch_dtype, name, fixed, say, ks, prompt_ids)


def _verify_llm(ck: Checkpoint, dtype, name: str, fixed: float | None, say, ks: list[int],
                prompt_ids: list[int] | None) -> VerifyReport:
    cfg = ck.model
    pixels = ego = ids = scene = None
    if isinstance(cfg, VLAConfig):
        pixels = bag_pixels(cfg).to(dtype)
        ego = torch.tensor(EGO_STATE) if cfg.ego_state_input else None
        scene = example_scene(cfg)
        inputs = (f"camera frame of {cfg.n_cameras} camera(s) from the embedded bag at {cfg.image_size} px, "
                  f"{cfg.num_tokens} tokens" + (", ego state" if ego is not None else "")
                  + (", made-up camera geometry and ego frame (query heads)" if scene is not None else ""))
    else:
        from ..model.hf import lm_prompt_ids

        vocab = int(cfg.llm["vocab_size"])
        ids = torch.tensor(prompt_ids if prompt_ids else lm_prompt_ids(vocab))
        if int(ids.max()) >= vocab:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary [0, {vocab}) of {ck.path}")
        inputs = f"{len(ids)} token ids"

    def run_prefix(prefix):
        return prefix(pixels, ego, scene=scene) if pixels is not None else prefix(ids)

    say(f"reference forward ({ck.description}) ...")
    h0 = None if pixels is None else ck.load("prefix", 0, dtype=dtype)(pixels, ego, scene=scene)
    ref_states, ref_name = _reference(ck, dtype, pixels, ego, ids, scene, h0)
    L = ck.num_layers
    if len(ref_states) != L + 1:
        raise RuntimeError(f"the reference gave {len(ref_states)} hidden states, expected L + 1 = {L + 1}")
    say("reference forward in float64 (its own rounding) ...")
    ref64 = None if fixed is not None else _reference(ck, torch.float64, pixels, ego, ids, scene, h0)[0]
    say("the same code unsplit ...")
    unsplit = _Unsplit(ck, dtype, run_prefix)
    report = VerifyReport(str(ck.path), ck.description, ref_name, inputs, name, fixed, _basis(name, fixed))
    allowed = head_ref = None
    for k in ks:
        prefix = ck.load("prefix", k, dtype=dtype)
        suffix = ck.load("suffix", k, dtype=dtype)
        h = run_prefix(prefix)
        del prefix
        final = suffix.final_hidden_states(h)
        output = suffix.plan_all(h).modes if hasattr(suffix, "head") else None
        if allowed is None:
            allowed, head_ref = _allowed_columns(cfg, suffix, ref_states, ref64, dtype, fixed)
        row = allowed.row(k, _diff(h, ref_states[k]) if k < L else None,
                          _diff(_readout_rows(cfg, final), _readout_rows(cfg, ref_states[L])),
                          None if output is None else _diff(output, head_ref), unsplit.diff(k, h, final, output))
        report.rows.append(row)
        say(format_row(row))
        del suffix
    return report


def _allowed_columns(cfg, suffix, ref: list, ref64: list | None, dtype, fixed) -> tuple[_Allowed, torch.Tensor]:
    """The allowed difference of every column, and the read-out head on the referee's final states (None without
    a head). ``ref64``: the referee's float64 hidden states (None with a fixed tolerance)."""
    L = len(ref) - 1
    if ref64 is None:
        ref64 = ref
    head = head_on_reference(suffix, ref[L]) if hasattr(suffix, "head") else None
    out = None
    if head is not None:  # the head on the float64 run's final states: how far the referee's rounding moves it
        out = _allowed(head, head_on_reference(suffix, ref64[L].to(dtype)), dtype, fixed)
    return _Allowed([_allowed(ref[k], ref64[k], dtype, fixed) for k in range(L)] + [None],
                    _allowed(_readout_rows(cfg, ref[L]), _readout_rows(cfg, ref64[L]), dtype, fixed), out), head


def _verify_vlm(ck: Checkpoint, dtype, name: str, fixed: float | None, say, ks: list[int]) -> VerifyReport:
    from ..model.vlm import frame_inputs, load_processor

    cfg = ck.model
    processor = load_processor(ck.hf.path, cfg.vlm_type)
    inputs = frame_inputs(processor, cfg, bag_images(cfg.cameras, cfg.camera_size))  # + planning token (driving)
    say(f"reference forward ({ck.description}) ...")
    ref_states, ref_name = _vlm_reference(ck, dtype, inputs)
    L = ck.num_layers
    if len(ref_states) != L + 1:
        raise RuntimeError(f"the reference gave {len(ref_states)} hidden states, expected L + 1 = {L + 1}")
    say("reference forward in float64 (its own rounding) ...")
    ref64 = None if fixed is not None else _vlm_reference(ck, torch.float64, inputs)[0]
    say("the same code unsplit ...")
    unsplit = _Unsplit(ck, dtype, lambda prefix: prefix(inputs))
    described = (f"camera frame of {cfg.cameras} camera(s) from the embedded bag at {cfg.camera_size[0]} x "
                 f"{cfg.camera_size[1]} px through the family's processor, {inputs.tokens} tokens (prompt "
                 f"{cfg.prompt!r})" + (f"; side tensors {', '.join(cfg.side)}" if cfg.side else ""))
    report = VerifyReport(str(ck.path), ck.description, ref_name, described, name, fixed, _basis(name, fixed))
    allowed = head_ref = None
    last = _LastToken()
    for k in ks:
        state = ck.load("prefix", k, dtype=dtype)(inputs)
        suffix = ck.load("suffix", k, dtype=dtype)
        final = suffix.final_hidden_states(state)
        output = suffix.plan_all(state).modes if hasattr(suffix, "head") else None
        if allowed is None:
            allowed, head_ref = _allowed_columns(last, suffix, ref_states, ref64, dtype, fixed)
        row = allowed.row(k, _diff(state.hidden_states, ref_states[k]) if k < L else None,
                          _diff(final[-1], ref_states[L][-1]), None if output is None else _diff(output, head_ref),
                          unsplit.diff(k, state.hidden_states, final, output))
        report.rows.append(row)
        say(format_row(row))
    return report


class _LastToken:
    """A config stand-in whose read-out is the last token (a VLM's planning or last prompt token)."""

    readout_positions = None


def _verify_code(ck: Checkpoint, dtype, name: str, fixed: float | None, say, ks: list[int]) -> VerifyReport:
    full = ck.load("full", dtype=dtype)
    inputs = tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x
                   for x in full.model.example_inputs(0))
    reference = full(*inputs)
    del full
    note = ""
    allowed = fixed
    if fixed is None:
        try:  # the model's own forward in float64, for its rounding; own code need not run in float64
            full64 = ck.load("full", dtype=torch.float64)
            ref64 = full64(*(x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs))
            allowed = _allowed(reference, ref64, dtype, None)
        except (RuntimeError, TypeError, ValueError) as e:
            note = f" (the model did not run in float64: {type(e).__name__}; {ULP_FLOOR:g} ulp only)"
            allowed = ULP_FLOOR * torch.finfo(dtype).eps * reference.double().abs().max().item()
    report = VerifyReport(str(ck.path), ck.description, f"{ck.model.spec}.forward (the model's own)",
                          "the model's example_inputs(0)", name, fixed, _basis(name, fixed, note))
    if ck.model.drives:  # the waypoints its driving I/O declares, as the nodes will check each frame
        want = (ck.model.n_modes, ck.model.n_waypoints, 2)
        if tuple(reference.shape) != want:
            raise ValueError(f"{ck.model.spec}.forward gives {tuple(reference.shape)}; its driving I/O declares "
                             f"waypoints {want} (n_modes, n_waypoints, 2): the nodes would drop every frame")
    for k in ks:
        h = ck.load("prefix", k, dtype=dtype)(*inputs)
        if tuple(h.shape) != ck.model.prefix_state_shape:
            raise RuntimeError(f"the prefix at K={k} gave hidden states {tuple(h.shape)}, the model declares "
                               f"{ck.model.prefix_state_shape}")
        out = ck.load("suffix", k, dtype=dtype)(h)
        row = VerifyRow(k, None, None, _diff(out, reference), allowed_output=allowed).judge()
        report.rows.append(row)
        say(format_row(row))
    return report


def _fmt(v: float | None, allowed: float | None = None) -> str:
    if v is None:
        return "-"
    return f"{v:.2e}" if allowed is None else f"{v:.2e} / {allowed:.1e}"


def format_row(row: VerifyRow) -> str:
    """One line of the per-K table: each difference / its allowed one, the unsplit difference, the verdict."""
    return (f"{row.k:>4} | {_fmt(row.prefix, row.allowed_prefix):>19} | {_fmt(row.final, row.allowed_final):>19} | "
            f"{_fmt(row.output, row.allowed_output):>19} | {_fmt(row.unsplit):>9} | {'ok' if row.ok else 'DIFFERS'}")


def format_report(report: VerifyReport) -> str:
    """The report as text: what was compared, one row per K, and the verdict."""
    lines = [f"verify-split {report.model}: {report.description}",
             f"  referee:  {report.reference}",
             f"  input:    {report.inputs}; dtype {report.dtype}",
             f"  allowed:  {report.basis}",
             "   K |  prefix h_K / allowed |       final / allowed |   waypoints / allowed |   unsplit | verdict",
             "-----+---------------------+---------------------+---------------------+-----------+--------"]
    lines += [format_row(r) for r in report.rows]
    lines.append("  prefix: h_K (every token) vs the referee's hidden_states[K]; final: the read-out tokens' "
                 "final-norm hidden states; waypoints: the planning head's modes (- where the model has none); "
                 "unsplit: the largest of the three vs the same code unsplit (must be 0)")
    n_bad = sum(not r.ok for r in report.rows)
    unsplit = [r.unsplit for r in report.rows if r.unsplit is not None]
    exact = "; bit-exact against the same code unsplit" if unsplit and max(unsplit) == 0.0 else ""
    lines.append(f"{'OK' if report.ok else 'FAILED'}: {len(report.rows) - n_bad} of {len(report.rows)} split layers "
                 f"within the allowed difference (worst {report.worst:.3e}, {report.worst_fraction:.2g} of its "
                 f"allowed){exact}")
    return "\n".join(lines)
