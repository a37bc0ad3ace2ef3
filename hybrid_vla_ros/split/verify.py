"""Is the split exact? The hybrid at every split layer K against transformers' own forward (``verify-split``).

For every K in [0, L] the prefix and suffix are loaded at K (each reading only its own tensors, as the nodes do)
and compared with an **independent reference** sharing none of the split path's code or loaders:

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

Per K, three max abs differences against the referee: ``prefix`` (h_K, every token, against ``hidden_states[K]``;
none at K = L, where transformers' last entry is already normed), ``final`` (final-norm states at
``readout_positions``) and ``output`` (every mode's waypoints: the planning head on the referee's final states; own
code: its output). Each must stay within the referee's own rounding, from a second referee run in float64:

    allowed = max(ROUNDING_FACTOR x max|referee - referee in float64|, ULP_FLOOR x eps(dtype) x max|referee in fp64|)

so kernel summation order passes and a wrong mask, bias or rotary table (1e-2 relative and up) fails;
``tolerance`` replaces it by one fixed maximum. Against the **same code unsplit** (prefix at K = L, its block
inputs giving h_K; suffix at L) the difference (``unsplit``) must be exactly 0, except for own code.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.checkpoint import Checkpoint, open_checkpoint, parse_dtype
from ..model.kinds import EGO_STATE, SplitModel  # noqa: F401  (EGO_STATE: the example frame's ego state)

#: Factors of the allowed difference (module docstring).
ROUNDING_FACTOR = 8.0
ULP_FLOOR = 16.0


@dataclass
class VerifyRow:
    """Split layer ``k``: the differences of the module docstring (None where not applicable), their ``allowed_*``,
    ``unsplit`` (None for own code) and whether all hold."""

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
        self.ok = all(d is None or d <= a for d, a in self._pairs()) and self.unsplit in (None, 0.0)
        return self

    def _pairs(self):
        return ((self.prefix, self.allowed_prefix), (self.final, self.allowed_final),
                (self.output, self.allowed_output))

    @property
    def fraction(self) -> float:
        """The largest difference as a fraction of its allowed one (0 when all are 0)."""
        return max((d / a if a else (0.0 if d == 0 else math.inf) for d, a in self._pairs() if d is not None),
                   default=0.0)


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_split`, one row per K; ``tolerance`` None: the rounding basis (``basis``)."""

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


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise RuntimeError(f"shapes differ: split {tuple(a.shape)} vs reference {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item()


def _allowed(ref: torch.Tensor, ref64: torch.Tensor | None, dtype: torch.dtype, fixed: float | None) -> float:
    """The allowed max abs difference for ``ref`` given its float64 run ``ref64`` (None: ulp floor), or ``fixed``."""
    if fixed is not None:
        return fixed
    floor = ULP_FLOOR * torch.finfo(dtype).eps * (ref if ref64 is None else ref64).double().abs().max().item()
    if ref64 is None:
        return floor
    return max(ROUNDING_FACTOR * (ref.double() - ref64.double()).abs().max().item(), floor)


class BagFrames:
    """The embedded bag's (data/dgp_scene02_6cam_mcap) first frame as
    :class:`~hybrid_vla_ros.model.kinds.CameraFrames`, cameras cycled past its 6."""

    def __init__(self):
        from rosbags.typesys import Stores, get_typestore

        from ..util.bags import read_bag
        from ..util.paths import embedded_bag

        store = get_typestore(Stores.ROS2_KILTED)
        first = {}
        for m in read_bag(embedded_bag()):
            if m.topic.endswith("/image_raw/compressed") and m.topic not in first:
                first[m.topic] = store.deserialize_cdr(m.raw, m.msgtype)
        self._msgs = [first[t] for t in sorted(first)]

    def _decoded(self, cameras: int) -> list:
        from ..vehicle.image import decode_compressed

        return [decode_compressed(self._msgs[i % len(self._msgs)].format, self._msgs[i % len(self._msgs)].data)
                for i in range(cameras)]

    def images(self, cameras: int, size: tuple[int, int] | None = None) -> list:
        """RGB uint8 (H, W, 3), resized to ``size`` (width, height) as the prefix node does when given."""
        from ..vehicle.image import resize_rgb

        images = self._decoded(cameras)
        return [resize_rgb(im, size) for im in images] if size else images

    def pixels(self, cfg) -> torch.Tensor:
        """(C, 3, S, S) float32 for a driving config's own front, as the prefix node preprocesses them."""
        from ..vehicle.image import preprocess

        return preprocess(self._decoded(cfg.n_cameras), cfg.image_size, cfg.image_mean, cfg.image_std,
                          resize=cfg.image_resize)


def bag_pixels(cfg) -> torch.Tensor:
    """:meth:`BagFrames.pixels` of the embedded bag's first frame for ``cfg``: (C, 3, S, S) float32."""
    return BagFrames().pixels(cfg)


def bag_images(cameras: int, camera_size: tuple[int, int] | None = None) -> list:
    """:meth:`BagFrames.images` of the embedded bag's first frame."""
    return BagFrames().images(cameras, camera_size)


class _Unsplit:
    """The same code unsplit: ``states[k]`` is h_k, ``final`` every token's final-norm states (None for own code)."""

    def __init__(self, ck: Checkpoint, sm: SplitModel, dtype, inputs: tuple):
        L = ck.num_layers
        prefix = ck.load("prefix", L, dtype=dtype)
        kept: list[torch.Tensor] = []
        hooks = [layer.register_forward_pre_hook(
            lambda module, args, kwargs: kept.append((args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True) for layer in prefix.layers]
        try:
            out = sm.run_prefix(prefix, inputs)
        finally:
            for h in hooks:
                h.remove()
        del prefix
        hidden = sm.hidden(out)
        self.states = [s.reshape(hidden.shape) for s in kept] + [hidden]
        suffix = ck.load("suffix", L, dtype=dtype)
        self.final, self.output = sm.final_states(suffix, out), sm.output(suffix, out)

    def diff(self, k: int, h: torch.Tensor, final, output) -> float:
        """Max abs difference of the split at K = k (h_K, final states, output) against this run."""
        out = [_diff(h, self.states[k])]
        out += [_diff(a, b) for a, b in ((final, self.final), (output, self.output)) if a is not None]
        return max(out)


def verify_split(path: str | Path, dtype: str = "fp32", *, tolerance: float | None = None,
                 prompt_ids: list[int] | None = None, cameras: int | None = None,
                 trust_model_code: bool | None = None, layers: list[int] | None = None, log=None,
                 prompt: str | None = None, camera_size: tuple[int, int] | None = None) -> VerifyReport:
    """Check the split of the checkpoint at ``path`` at every K in ``layers`` (default all), on the CPU.

    ``prompt_ids``: token ids for a bare language model (default 16 fixed ids) or a LLaVA prompt (one image
    placeholder per camera); ``cameras``: images per frame for a LLaVA directory (default 1). Each K costs a
    whole forward (minutes for 30 blocks on 81 tokens on a small CPU). Raises what
    :func:`hybrid_vla_ros.model.checkpoint.open_checkpoint` raises, and ValueError for a tolerance that is not a
    positive number or a split layer outside [0, L].
    """
    torch_dtype = parse_dtype(dtype)
    if tolerance is not None and not (tolerance > 0 and math.isfinite(tolerance)):
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}")
    fixed = None if tolerance is None else float(tolerance)
    ck = open_checkpoint(path, trust_model_code=trust_model_code, cameras=cameras, prompt_ids=prompt_ids,
                         tokens=len(prompt_ids) if prompt_ids else 16, prompt=prompt, camera_size=camera_size)
    L = ck.num_layers
    ks = list(range(L + 1)) if layers is None else sorted(set(layers))
    bad = [k for k in ks if not 0 <= k <= L]
    if bad or not ks:
        raise ValueError(f"split layers {bad or ks} outside [0, {L}] for {path}")
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[torch_dtype]
    say = log or (lambda _line: None)
    ck.check_tensors()  # this package's own refusal of a bad checkpoint, before the referee's loader meets it
    with torch.inference_mode():
        sm = ck.split_model(prompt_ids)
        inputs = sm.example_inputs(BagFrames(), dtype=torch_dtype)
        say(f"reference forward ({ck.description}) ...")
        ref = sm.referee(torch_dtype, inputs)
        if ref.states is not None and len(ref.states) != L + 1:
            raise RuntimeError(f"the reference gave {len(ref.states)} hidden states, expected L + 1 = {L + 1}")
        ref64, note = None, ""
        if fixed is None:
            say("reference forward in float64 (its own rounding) ...")
            try:
                ref64 = sm.referee(torch.float64, inputs, h0=ref.h0)
            except (RuntimeError, TypeError, ValueError) as e:  # own code need not run in float64
                note = f" (the referee did not run in float64: {type(e).__name__}; {ULP_FLOOR:g} ulp only)"
        say("the same code unsplit ...")
        unsplit = _Unsplit(ck, sm, torch_dtype, inputs)
        report = VerifyReport(str(ck.path), ck.description, ref.name, sm.describe_inputs(inputs), name, fixed,
                              _basis(name, fixed, note))
        columns = None
        for k in ks:
            suffix = ck.load("suffix", k, dtype=torch_dtype)
            out = sm.run_prefix(ck.load("prefix", k, dtype=torch_dtype), inputs)
            h, final, output = sm.hidden(out), sm.final_states(suffix, out), sm.output(suffix, out)
            if columns is None:
                columns = _Columns(sm, suffix, ref, ref64, torch_dtype, fixed)
            row = columns.row(k, h, final, output, None if ref.states is None else unsplit.diff(k, h, final, output))
            report.rows.append(row)
            say(format_row(row))
            del suffix, out
    return report


class _Columns:
    """What each K is compared with, and each column's allowed difference, from ``ref`` and ``ref64``."""

    def __init__(self, sm: SplitModel, suffix, ref, ref64, dtype, fixed):
        self.sm, self.ref = sm, ref
        L = sm.num_layers
        self.ref_output = ref.output if ref.output is not None else sm.head_on_final(suffix, ref.states[L])
        self.allowed_prefix, self.allowed_final = [], None
        if ref.states is not None:
            s64 = ref64.states if ref64 is not None else [None] * (L + 1)
            self.allowed_prefix = [_allowed(a, b, dtype, fixed) for a, b in zip(ref.states[:L], s64[:L])]
            self.ref_rows = sm.readout_rows(ref.states[L])
            self.allowed_final = _allowed(self.ref_rows, None if ref64 is None else sm.readout_rows(s64[L]), dtype,
                                          fixed)
        self.allowed_output = None
        if self.ref_output is not None:
            if ref.output is not None:  # own code: its float64 output
                out64 = None if ref64 is None else ref64.output
            else:  # the head on the float64 run's final states: how far the referee's rounding moves it
                out64 = None if ref64 is None else sm.head_on_final(suffix, ref64.states[L].to(dtype))
            self.allowed_output = _allowed(self.ref_output, out64, dtype, fixed)

    def row(self, k: int, h, final, output, unsplit) -> VerifyRow:
        L, states = self.sm.num_layers, self.ref.states
        prefix = _diff(h, states[k]) if states is not None and k < L else None
        fin = _diff(self.sm.readout_rows(final), self.ref_rows) if states is not None and final is not None else None
        out = _diff(output, self.ref_output) if output is not None and self.ref_output is not None else None
        return VerifyRow(k, prefix, fin, out, self.allowed_prefix[k] if prefix is not None else None,
                         self.allowed_final if fin is not None else None,
                         self.allowed_output if out is not None else None, unsplit).judge()


def _basis(dtype_name: str, fixed: float | None, note: str = "") -> str:
    if fixed is not None:
        return f"a fixed max abs difference of {fixed:g} (--tolerance)"
    return (f"{ROUNDING_FACTOR:g} x the referee's own {dtype_name} rounding (its run against its float64 run on the "
            f"same input), at least {ULP_FLOOR:g} ulp of the tensor's largest value{note}")


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
