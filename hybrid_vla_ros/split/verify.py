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

Per K it reports three maximum absolute differences: ``prefix`` (h_K, every token, against transformers'
``hidden_states[K]``; none at K = L, where transformers' last entry is already normed), ``final`` (the final-norm
hidden state of the planning token -- what the planning head reads, at ``readout_positions.planning`` (the last
token unless the prompts put it elsewhere) -- against transformers' ``hidden_states[L]``) and ``output`` (waypoints
of every mode, the planning head applied to the reference's final state; own code: the model's output). Every K
must be within ``tolerance``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.checkpoint import Checkpoint, open_checkpoint, parse_dtype
from ..model.config import VLAConfig, VLMSpec
from ..model.modeling import example_scene, llava_input_ids

#: Default tolerance on every max abs difference, by dtype (the split and the reference run in that dtype).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
#: The ego state fed to models that take one: speed 8.3 m/s, acceleration -0.4 m/s^2, yaw rate 0.05 rad/s.
EGO_STATE = (8.3, -0.4, 0.05)


@dataclass
class VerifyRow:
    """Max abs differences at split layer ``k`` (None where not applicable) and whether all are in tolerance."""

    k: int
    prefix: float | None
    final: float | None
    output: float | None
    ok: bool = False


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_split`: what was checked against what, one row per K in [0, L]."""

    model: str
    description: str
    reference: str
    inputs: str
    dtype: str
    tolerance: float
    rows: list[VerifyRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def worst(self) -> float:
        return max((v for r in self.rows for v in (r.prefix, r.final, r.output) if v is not None), default=0.0)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "worst": self.worst}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise RuntimeError(f"shapes differ: split {tuple(a.shape)} vs reference {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item()


def _final_diff(cfg, final: torch.Tensor, ref_final: torch.Tensor) -> float:
    """The ``final`` column: the largest difference of the final-norm states the heads read
    (``cfg.readout_positions``): the planning token of the last pass and, with two passes, the decision pass's
    read-out token (never a pass's padding); the last token where the config has no read-out positions."""
    at = getattr(cfg, "readout_positions", None)
    if at is None:
        return _diff(final[..., -1, :], ref_final[..., -1, :])
    if final.dim() == 3 and at.decision is not None:
        return max(_diff(final[-1, at.planning], ref_final[-1, at.planning]),
                   _diff(final[0, at.decision], ref_final[0, at.decision]))
    return _diff(final[..., at.planning, :], ref_final[..., at.planning, :])


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


def _reference(ck: Checkpoint, dtype, pixels, ego, ids, scene=None) -> tuple[list, str]:
    """transformers' hidden_states (L + 1 entries, the last after the final norm) for this checkpoint's input."""
    cfg = ck.model
    if ck.kind == "transformers" and ck.hf.kind == "llm":
        ref = _causal_lm_class(cfg.llm_type).from_pretrained(str(ck.path), dtype=dtype).eval()
        return _hidden_states(ref(ids.unsqueeze(0), output_hidden_states=True)), \
            f"transformers {ck.hf.architecture}.from_pretrained({ck.path})"
    if ck.hf is not None and ck.hf.kind == "llava" and not cfg.ego_state_input and cfg.llm_passes == 1:
        from transformers import LlavaForConditionalGeneration

        ref = LlavaForConditionalGeneration.from_pretrained(str(ck.hf.path), dtype=dtype).eval()
        out = ref(input_ids=torch.tensor([llava_input_ids(cfg)]), pixel_values=pixels, output_hidden_states=True)
        return _hidden_states(out), f"transformers LlavaForConditionalGeneration.from_pretrained({ck.hf.path})"
    h0 = ck.load("prefix", 0, dtype=dtype)(pixels, ego, scene=scene)
    return _llm_reference_on_embeddings(ck, cfg, h0, dtype)


def verify_split(path: str | Path, dtype: str = "fp32", *, tolerance: float | None = None,
                 prompt_ids: list[int] | None = None, cameras: int | None = None,
                 trust_model_code: bool | None = None, layers: list[int] | None = None, log=None,
                 prompt: str | None = None, camera_size: tuple[int, int] | None = None) -> VerifyReport:
    """Run the split of the checkpoint at ``path`` at every K against its independent reference (module docstring).

    ``dtype``: of both sides (fp32, bf16, fp16); ``tolerance``: on every max abs difference (default
    :data:`TOLERANCE` of the dtype); ``prompt_ids``: token ids for a bare language model (default 16 fixed ids)
    or a LLaVA directory's prompt (one image placeholder per camera); ``cameras``: images per frame for a
    LLaVA directory (default 1); ``layers``: the split layers to check (default: every K in [0, L]; each K
    costs a whole forward, so a 30-block model on 81 tokens takes minutes on a small CPU); ``log``: a callable
    for progress lines. Everything runs on the CPU.

    Returns a :class:`VerifyReport` (``.ok``). Raises what :func:`hybrid_vla_ros.model.checkpoint.open_checkpoint`
    and the loaders raise (FileNotFoundError, ValueError), and ValueError for a tolerance that is not a positive
    number or a split layer outside [0, L].
    """
    torch_dtype = parse_dtype(dtype)
    tol = TOLERANCE[torch_dtype] if tolerance is None else float(tolerance)
    if not (tol > 0 and math.isfinite(tol)):
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}")
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
            return _verify_code(ck, torch_dtype, name, tol, say, ks)
        if isinstance(ck.model, VLMSpec) or (isinstance(ck.model, VLAConfig)
                                             and ck.model.projector.get("type") == "vlm"):
            return _verify_vlm(ck, torch_dtype, name, tol, say, ks)
        cfg = ck.model
        pixels = ego = ids = scene = None
        if isinstance(cfg, VLAConfig):
            pixels = bag_pixels(cfg).to(torch_dtype)
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
                raise ValueError(f"token id {int(ids.max())} is outside the vocabulary [0, {vocab}) of {path}")
            inputs = f"{len(ids)} token ids"
        say(f"reference forward ({ck.description}) ...")
        ref_states, ref_name = _reference(ck, torch_dtype, pixels, ego, ids, scene)
        L = ck.num_layers
        if len(ref_states) != L + 1:
            raise RuntimeError(f"the reference gave {len(ref_states)} hidden states, expected L + 1 = {L + 1}")
        ref_final = ref_states[L]
        report = VerifyReport(str(path), ck.description, ref_name, inputs, name, tol)
        head_ref = None
        for k in ks:
            prefix = ck.load("prefix", k, dtype=torch_dtype)
            suffix = ck.load("suffix", k, dtype=torch_dtype)
            h = prefix(pixels, ego, scene=scene) if pixels is not None else prefix(ids)
            del prefix
            d_prefix = _diff(h, ref_states[k]) if k < L else None
            final = suffix.final_hidden_states(h)
            d_final = _final_diff(cfg, final, ref_final)
            d_out = None
            if hasattr(suffix, "head"):
                if head_ref is None:  # the read-out head on the reference's final states
                    head_ref = head_on_reference(suffix, ref_final)
                d_out = _diff(suffix.plan_all(h).modes, head_ref)
            row = VerifyRow(k, d_prefix, d_final, d_out)
            row.ok = all(v is None or v <= tol for v in (d_prefix, d_final, d_out))
            report.rows.append(row)
            say(format_row(row))
            del suffix
    return report


def _verify_vlm(ck: Checkpoint, dtype, name: str, tol: float, say, ks: list[int]) -> VerifyReport:
    from ..model.vlm import frame_inputs, load_processor

    cfg = ck.model
    processor = load_processor(ck.hf.path, cfg.vlm_type)
    inputs = frame_inputs(processor, cfg, bag_images(cfg.cameras, cfg.camera_size))  # + planning token (driving)
    say(f"reference forward ({ck.description}) ...")
    ref_states, ref_name = _vlm_reference(ck, dtype, inputs)
    L = ck.num_layers
    if len(ref_states) != L + 1:
        raise RuntimeError(f"the reference gave {len(ref_states)} hidden states, expected L + 1 = {L + 1}")
    described = (f"camera frame of {cfg.cameras} camera(s) from the embedded bag at {cfg.camera_size[0]} x "
                 f"{cfg.camera_size[1]} px through the family's processor, {inputs.tokens} tokens (prompt "
                 f"{cfg.prompt!r})" + (f"; side tensors {', '.join(cfg.side)}" if cfg.side else ""))
    report = VerifyReport(str(ck.path), ck.description, ref_name, described, name, tol)
    head_ref = None
    for k in ks:
        state = ck.load("prefix", k, dtype=dtype)(inputs)
        d_prefix = _diff(state.hidden_states, ref_states[k]) if k < L else None
        suffix = ck.load("suffix", k, dtype=dtype)
        final = suffix.final_hidden_states(state)
        d_out = None
        if hasattr(suffix, "head"):  # the read-out head on the reference's final states
            head_ref = head_on_reference(suffix, ref_states[L]) if head_ref is None else head_ref
            d_out = _diff(suffix.plan_all(state).modes, head_ref)
        row = VerifyRow(k, d_prefix, _diff(final[-1], ref_states[L][-1]), d_out)
        row.ok = all(v is None or v <= tol for v in (row.prefix, row.final, row.output))
        report.rows.append(row)
        say(format_row(row))
    return report


def _verify_code(ck: Checkpoint, dtype, name: str, tol: float, say, ks: list[int]) -> VerifyReport:
    full = ck.load("full", dtype=dtype)
    inputs = tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x
                   for x in full.model.example_inputs(0))
    reference = full(*inputs)
    del full
    report = VerifyReport(str(ck.path), ck.description, f"{ck.model.spec}.forward (the model's own)",
                          "the model's example_inputs(0)", name, tol)
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
        row = VerifyRow(k, None, None, _diff(out, reference))
        row.ok = row.output <= tol
        report.rows.append(row)
        say(format_row(row))
    return report


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3e}"


def format_row(row: VerifyRow) -> str:
    """One line of the per-K table."""
    return (f"{row.k:>4} | {_fmt(row.prefix):>11} | {_fmt(row.final):>11} | {_fmt(row.output):>11} | "
            f"{'ok' if row.ok else 'DIFFERS'}")


def format_report(report: VerifyReport) -> str:
    """The report as text: what was compared, one row per K, and the verdict."""
    lines = [f"verify-split {report.model}: {report.description}",
             f"  reference: {report.reference}",
             f"  input:     {report.inputs}; dtype {report.dtype}; tolerance {report.tolerance:g} (max abs)",
             "   K |  prefix h_K |       final |   waypoints | verdict",
             "-----+-------------+-------------+-------------+--------"]
    lines += [format_row(r) for r in report.rows]
    lines.append("  prefix: h_K (every token) vs the reference's hidden_states[K]; final: the last token's "
                 "final-norm hidden state; waypoints: the planning head's modes (- where the model has none)")
    n_bad = sum(not r.ok for r in report.rows)
    lines.append(f"{'OK' if report.ok else 'FAILED'}: {len(report.rows) - n_bad} of {len(report.rows)} split layers "
                 f"within {report.tolerance:g} (worst {report.worst:.3e})")
    return "\n".join(lines)
