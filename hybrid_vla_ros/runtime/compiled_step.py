"""The suffix's decode step compiled with TorchInductor: one row through blocks [K, L), the final norm and the LM head.

A decode step on the CPU suffix is one row per token: every weight of blocks [K, L) and the head is read once, and
the eager path spends as long again in Python and in per-operator dispatch (about 100 operators per block). Compiled
by ``torch.compile`` (:data:`INDUCTOR_OPTIONS`: weights frozen into the graph and packed once, for oneDNN or for
inductor's own CPU GEMM, whichever timed faster at build; the linear layers that share an input concatenated; the
C++ wrapper; where the family's attention is SDPA, its math kernel, which inductor fuses into one loop a block, in
about 0.6 of the CPU flash kernel's time for one query row), the step reads its weights at near the memory
bandwidth: docs/performance.md ("Decode") has the bench's figures (SmolLM2-135M at K = 15 on one Intel AMX core,
eager -> compiled: bf16 19.3 -> 12.0 ms per token, fp32 28.2 -> 21.3 on one day's host, before the math kernel;
bf16 15.3-16.0, fp32 24.3-25.3 with it on a slower day).

What it costs, said where it is chosen (``decode_step`` of the suffix node):

* **Memory**: each K built holds a packed copy of the weights of blocks [K, L) and the head, and inductor keeps it
  for the life of the process (its generated module holds the frozen weights), plus a KV cache of its own for
  blocks [K, L); the blocks it was built from stay alive with it after a re-split frees them from the stage. At most
  :attr:`DecodeStepBuilder.MAX_SPLIT_LAYERS` Ks per runner (a node that is cleaned up and configured again builds
  anew: the earlier copies stay).
* **Start-up**: a build takes 25-65 s for SmolLM2 on this host (less when inductor's on-disk cache holds its
  kernels); it runs on a background thread, sharing the suffix's cores (and the interpreter) with the frames that
  decode eagerly meanwhile, and again after a live re-split to a K not built yet.
* **The eager path unpacked**: with ``inductor`` a bf16 suffix does not pack its eager linear layers for oneDNN
  (:mod:`.packed_linear`: inductor traces plain ones), so the prefill, a conversation's turns, the tokens placed
  after the decode and every step before the build ends run at torch's unpacked bf16 speed.
* **Rounding**: the compiled kernels sum in another order, and which kernel runs a product is chosen by timing at
  each build, so two builds may round differently. fp32: in the tests the same tokens as the eager step, logits
  within 1e-5 of their scale; bf16: the logits move by bf16 rounding (0.3 at a scale of 27), so a greedy decode may
  choose another token where two are within that. ``verify-split`` checks the eager path, which stays the reference.

The graph is bound to the KV cache it was compiled against: with freezing, what the graph reads besides its inputs
may become constants of it (a compiled function handed another cache wrote the first one, in an experiment here).
So the step owns its cache (:attr:`CompiledDecodeStep.cache`), takes no cache argument and serves one decoding: the
suffix runs the frame's prefill, turns and placed tokens eagerly into that same cache and the compiled step extends
it. After its build the step never compiles again: a guard that fails (another shape, dtype or cache state) raises
:class:`StepRecompile` instead of a silent rebuild on the decode thread, and the decoding falls back to the eager
step for that K (:meth:`DecodeStepBuilder.failed`).

Supported where a step is plain hidden-state rows at text positions: a bare language model, a driving VLA and a VLM
whose steps take text positions (InternVL; not Qwen-VL's multimodal ones), with causal attention in every block
(a sliding window is refused: transformers' sliding static cache branches on a Python count of the tokens it
holds, so the graph would be rebuilt every token) and its linear layers not packed (:mod:`.packed_linear` replaces
them by oneDNN calls inductor cannot trace). :func:`compile_support` says why not elsewhere, and the decode runs
eagerly there.
"""
from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..model import text
from ..model.decode import LMHead, SideCache

__all__ = ["DECODE_STEPS", "CompiledDecodeStep", "DecodeStepBuilder", "DecodeStepStatus", "StepRecompile",
           "compile_support"]

#: How the suffix computes a decode step's one row: ``eager`` (torch, module by module) or ``inductor``
#: (:class:`CompiledDecodeStep`).
DECODE_STEPS = ("eager", "inductor")

#: Inductor's settings for the step's build (``torch._inductor.config``, patched around the compile): weights folded
#: and packed once (``freezing``), no Python between kernels (``cpp_wrapper``), the linear layers that read the same
#: row concatenated (q, k, v; gate, up: 4 products a block instead of 7), each product's kernel chosen by timing
#: inductor's own CPU GEMM against ATen's (oneDNN) at build (``max_autotune``), compiled in this process on one
#: thread (no worker pool beside a node).
INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True, "max_autotune": True,
                    "max_autotune_gemm_backends": "CPP,ATEN", "compile_threads": 1}


#: Held by a build while dynamo traces its step. The step's ``sdpa_kernel(MATH)`` is traced into the graph (the
#: built step never switches anything when it runs), but while dynamo traces it the switch is process-wide: frames
#: decoding eagerly on other threads in those seconds attend with the math kernel (the same float32 sums, rounded
#: differently), and two traces at once could restore each other's saved state out of order, leaving the flash
#: kernel off for the process. Builds take this lock, so their switches nest. (A built step whose guard fails is
#: traced again on the decode thread without it, and raises :class:`StepRecompile` within that trace.)
_TRACE_LOCK = threading.Lock()


class StepRecompile(RuntimeError):
    """A built decode step was asked to compile again (one of its guards failed); the decode goes on eagerly."""


class _Inductor:
    """Dynamo's backend for one step: inductor (``compile_fx``) under :data:`INDUCTOR_OPTIONS`, once; a compile
    after :attr:`sealed` is set raises :class:`StepRecompile`."""

    def __init__(self, k: int):
        self.k, self.sealed = k, False

    def __call__(self, graph, example_inputs):
        if self.sealed:
            raise StepRecompile(f"the compiled decode step at K={self.k} would compile again (a guard failed)")
        from torch._inductor.compile_fx import compile_fx

        with _inductor_options():
            return compile_fx(graph, example_inputs)


def _inductor_options():
    """A context that sets :data:`INDUCTOR_OPTIONS` in inductor's configuration (restored after). Around the
    traced call too, not only the backend: dynamo reads ``freezing`` while it traces (parameters as constants)."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(INDUCTOR_OPTIONS)


def compile_support(sm, stage, head: LMHead) -> str:
    """Why the decode step of split model ``sm`` (:class:`~hybrid_vla_ros.model.kinds.SplitModel`) with suffix
    ``stage`` and LM head ``head`` cannot be compiled at any K; "" when it can."""
    from ..model.kinds import SplitModel
    from ..model.modeling import LMSuffixStage, SuffixStage, VLMSuffixStage
    from .packed_linear import PackedLinear

    plain = (LMSuffixStage.final_hidden_states, SuffixStage.final_hidden_states, VLMSuffixStage.final_hidden_states)
    if type(stage).final_hidden_states not in plain:
        return f"a {type(stage).__name__}'s decode step is not plain rows through its blocks"
    if type(sm).suffix_rows is not SplitModel.suffix_rows or sm.step_position_rows:
        return "its decode steps take multimodal positions"
    kinds = set(text.attention_kinds(stage.rotary_emb.config))
    if kinds != {"full_attention"}:
        return (f"its blocks use {', '.join(sorted(kinds - {'full_attention'}))} (transformers' sliding static "
                "cache counts its tokens in Python: the graph would be rebuilt every token)")
    if head.packed is not None or any(isinstance(m, PackedLinear) for m in (*stage.modules(), *head.modules())):
        return "its linear layers are packed for oneDNN (inductor packs them itself)"
    return ""


class CompiledDecodeStep:
    """One decode row (1, H) -> logits (V,) float32 through decoder blocks ``layers`` (blocks [``k``, L) of suffix
    ``stage``; default taken from it now), its final norm and ``head``, compiled (:data:`INDUCTOR_OPTIONS`) against
    :attr:`cache`, a :class:`~..model.decode.SideCache` of ``max_len`` tokens this object owns. Built at
    construction (a compile and one warm-up step, then the cache is emptied). Raises ValueError where
    :func:`compile_support` refuses, and what ``torch.compile`` raises. ``threads`` > 0: torch's intra-op threads
    (process-wide) are set to it first."""

    def __init__(self, sm, stage, head: LMHead, k: int, max_len: int, threads: int = 0, layers=None):
        why = compile_support(sm, stage, head)
        if why:
            raise ValueError(f"the decode step cannot be compiled: {why}")
        if threads > 0 and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        self.k, self.dtype = int(k), head.weight.dtype
        self.hidden_size = int(head.weight.shape[1])
        self.config = stage.rotary_emb.config
        #: The KV cache the graph is bound to: the frame's prefill runs eagerly into it, the steps extend it.
        self.cache = SideCache(sm.text_config(), max_len, self.k)
        self._rotary = stage.rotary_emb
        self._by_length: dict[int, tuple] = {}  # cache length -> (mask, position ids, cos, sin): :meth:`_inputs`
        # a dynamic rotary embedding changes its frequencies with the longest sequence it has seen: computed each time
        self._keep_inputs = "dynamic" not in str(getattr(self._rotary, "rope_type", ""))
        layers = list(stage._layers_from(self.k)) if layers is None else list(layers)
        norm, cache = stage.norm, self.cache.cache
        argument = text._cache_argument(type(layers[0])) if layers else "cache"

        def rows(x, mask, positions, cos, sin):
            for block in layers:
                x = block(x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin),
                          use_cache=True, **{argument: cache})
            return head(norm(x)[:, -1])

        def step(x, mask, positions, cos, sin):
            # one query row: where the family's attention is SDPA, its math kernel fused by inductor takes about 0.6
            # of the flash kernel's time (SmolLM2 bf16, K = 15: 1.4 -> 0.8 ms a token, docs/performance.md), its
            # sums in float32 as the flash kernel's. Only the trace sees this switch (:data:`_TRACE_LOCK`).
            with sdpa_kernel(SDPBackend.MATH):
                return rows(x, mask, positions, cos, sin)

        # A code object of its own: dynamo keeps compiled graphs and counts recompiles per code object, so the steps
        # at other Ks are not this one's guards.
        own = types.FunctionType(step.__code__.replace(co_name=f"decode_step_k{self.k}"), step.__globals__,
                                 f"decode_step_k{self.k}", None, step.__closure__)
        self._backend = _Inductor(self.k)
        t0 = time.perf_counter()
        with torch.inference_mode():
            zero = torch.zeros(1, self.hidden_size, dtype=self.dtype)
            rows(*self._inputs(zero))  # eagerly: allocates the cache's layers before the graph binds them
            self.cache.reset()
            self._step = torch.compile(own, dynamic=False, backend=self._backend)
            with _TRACE_LOCK, _inductor_options():
                self.logits(zero)  # the compile
            self.cache.reset()
        self._backend.sealed = True
        #: Seconds the build took (compile and warm-up).
        self.build_s = time.perf_counter() - t0

    def _inputs(self, row: torch.Tensor, length: int | None = None) -> tuple:
        """The step's inputs for ``row`` (1, H): (x (1, 1, H), mask, position ids, cos, sin) at the cache's length.
        The mask, positions and rotary tables depend only on that length (the cache's size, K and the dtype are
        this step's own), so each length's are computed once, as the family's base model computes them
        (:func:`~hybrid_vla_ros.model.text.block_inputs`), and kept: a frame's steps meet the lengths of the
        frame before (about 0.5 ms a token saved on SmolLM2). Not kept for a ``dynamic`` rotary embedding (its
        frequencies follow the longest sequence it has seen). ``length``: the cache's length when the caller has
        just read it (None: read here)."""
        x = row.unsqueeze(0)
        length = self.cache.tokens if length is None else length
        kept = self._by_length.get(length)
        if kept is None:
            inputs = text.block_inputs(self.config, self._rotary, x, {"full_attention"}, None,
                                       cache=self.cache.cache, first_layer={"full_attention": self.k})
            cos, sin = inputs.cos_sin["full_attention"]
            kept = (inputs.masks["full_attention"], inputs.position_ids, cos, sin)
            if self._keep_inputs:
                self._by_length[length] = kept
        return (x, *kept)

    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """A decode step's row (1, H) in the stage dtype -> the next token's logits (V,) float32, extending
        :attr:`cache`. Raises ValueError for another shape or dtype, or when the cache is full; StepRecompile
        (the cache untouched) when the graph would have to compile again."""
        if tuple(row.shape) != (1, self.hidden_size) or row.dtype != self.dtype:
            raise ValueError(f"a compiled decode step takes one row (1, {self.hidden_size}) {self.dtype}, got "
                             f"{tuple(row.shape)} {row.dtype}")
        length = self.cache.tokens  # read once a token (a tensor read): the room check and the inputs share it
        if length + 1 > self.cache.max_len:
            self.cache.room_for(1)  # raises, saying why
        return self._step(*self._inputs(row, length)).reshape(-1)


@dataclass(frozen=True)
class DecodeStepStatus:
    """Where a decoding suffix's decode step stands (:meth:`DecodeStepBuilder.status`,
    ``SuffixRunner.decode_step_status``; on /diagnostics as the ``*decode_step*`` fields of the suffix's status).

    ``requested``: the ``decode_step`` setting (:data:`DECODE_STEPS`); ``compiled_k``: the split layer whose compiled
    step serves frames at the last frame's K (None: they decode eagerly); ``building``: the split layer whose step is
    being built now (None: none); ``error``: why the requested step is not in use at the last frame's K and will not
    be ('' while it is, or may still be: before the first frame, while building); ``line``: all of it in one line
    for logs and /diagnostics (``inductor at K=k``, ``building at K=k (eager meanwhile)``, ``eager at K=k (why)``,
    ``not built yet``; ``eager`` when eager was asked; for a model that does not decode '', or with ``inductor``
    asked the ``error`` "ignored: this model does not decode")."""

    requested: str
    compiled_k: int | None = None
    building: int | None = None
    error: str = ""
    line: str = ""


class DecodeStepBuilder:  # a model.decode.CompiledSteps
    """The suffix's compiled decode steps for one decoding, one per split layer a frame came at, each built on a
    background thread (or at once, ``background`` False) while frames at that K decode eagerly, and kept: a K met
    again uses its step. At most :attr:`MAX_SPLIT_LAYERS` are built (each holds a copy of blocks [K, L) and the head
    for the life of the process); frames at further Ks decode eagerly, as do frames at a K whose build or step
    failed (:meth:`failed`).

    ``sm``, ``head``: as :class:`CompiledDecodeStep`; ``max_len``: the decode's cache bound; ``threads``: the
    suffix's torch threads; ``log(level, message)``: each build's outcome and each failure ("info" / "warning")."""

    #: Split layers with a compiled step at most.
    MAX_SPLIT_LAYERS = 3

    def __init__(self, sm, head: LMHead, max_len: int, threads: int = 0, background: bool = True, log=None):
        self.sm, self.head, self.max_len, self.threads = sm, head, int(max_len), int(threads)
        self.background, self.log = background, log or (lambda level, message: None)
        self._lock = threading.Lock()
        self._built: dict[int, CompiledDecodeStep] = {}
        self._building: int | None = None  # the K being built
        self._failed: dict[int, str] = {}  # K -> why its build or its step failed (not tried again)
        self._last_k: int | None = None  # the K of the last frame
        self._thread: threading.Thread | None = None
        self._closed = False

    def for_frame(self, stage, k: int) -> CompiledDecodeStep | None:
        """The built step at split layer ``k``, or None (the frame decodes eagerly) while it is built or when it
        cannot be; asks for its build when none is under way and fewer than :attr:`MAX_SPLIT_LAYERS` are built.
        Called on the decode thread: the blocks are taken from ``stage`` here, never while a re-split moves them."""
        k = int(k)
        with self._lock:
            self._last_k = k
            if k in self._built:
                return self._built[k]
            if (self._building is not None or k in self._failed or len(self._built) >= self.MAX_SPLIT_LAYERS
                    or self._closed):
                return None
            self._building = k
        layers = list(stage._layers_from(k))
        if self.background:
            self._thread = threading.Thread(target=self._build, args=(stage, k, layers), name="decode_step_build",
                                            daemon=True)
            self._thread.start()
            return None
        self._build(stage, k, layers)
        with self._lock:
            return self._built.get(k)

    def _build(self, stage, k: int, layers: list) -> None:
        try:
            step = CompiledDecodeStep(self.sm, stage, self.head, k, self.max_len, self.threads, layers)
        except Exception as e:  # noqa: BLE001 - a failed build leaves the eager step, said once
            with self._lock:
                self._building = None
            self.failed(k, f"the build failed: {type(e).__name__}: {e}".splitlines()[0][:300])
            return
        with self._lock:
            self._building = None
            if not self._closed:
                self._built[k] = step
        self.log("info", f"decode step: inductor at K={k} built in {step.build_s:.1f} s")

    def failed(self, k: int, why: str) -> None:
        """Frames at split layer ``k`` decode eagerly from now on (its step is dropped), ``why`` logged once."""
        with self._lock:
            self._built.pop(int(k), None)
            self._failed[int(k)] = why
        self.log("warning", f"decode step: eager at K={k} from now on ({why})")

    def status(self) -> DecodeStepStatus:
        """Where the step of the last frame's K stands (``requested`` "inductor"): built, being built, or why
        that K decodes eagerly (its build or step failed; :attr:`MAX_SPLIT_LAYERS` Ks kept already; closed);
        ``building`` may be another K's build."""
        with self._lock:
            k, building = self._last_k, self._building
            if self._closed:
                return DecodeStepStatus("inductor", error="closed", line="eager (closed)")
            if k is None:
                return DecodeStepStatus("inductor", building=building, line="not built yet")
            if k in self._built:
                return DecodeStepStatus("inductor", compiled_k=k, building=building, line=f"inductor at K={k}")
            if k in self._failed:
                return DecodeStepStatus("inductor", building=building, error=self._failed[k],
                                        line=f"eager at K={k} ({self._failed[k]})")
            if building == k:
                return DecodeStepStatus("inductor", building=k, line=f"building at K={k} (eager meanwhile)")
            if building is not None:
                return DecodeStepStatus("inductor", building=building,
                                        line=f"eager at K={k} (building at K={building} first)")
            if len(self._built) >= self.MAX_SPLIT_LAYERS:
                why = (f"steps are kept for {self.MAX_SPLIT_LAYERS} split layers already: "
                       f"{', '.join(map(str, sorted(self._built)))}")
                return DecodeStepStatus("inductor", error=why, line=f"eager at K={k} ({why})")
            # a frame at k came while another K was built: k's build starts at its next frame
            return DecodeStepStatus("inductor", line=f"eager at K={k} (not built yet: builds at its next frame)")

    @property
    def state(self) -> str:
        """:meth:`status` in one line (its ``line``)."""
        return self.status().line

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for a background build to end; True when none runs now."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def close(self) -> None:
        """Drop every step; a build under way is discarded when it ends (its thread cannot be stopped)."""
        with self._lock:
            self._closed = True
            self._built.clear()
