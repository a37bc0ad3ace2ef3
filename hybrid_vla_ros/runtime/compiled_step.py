"""The suffix's decode step compiled with TorchInductor: one row through blocks [K, L), the final norm and the LM head.

A decode step on the CPU suffix is one row per token: every weight of blocks [K, L) and the head is read once, and
the eager path spends as long again in Python and in per-operator dispatch (about 100 operators per block). Compiled
by ``torch.compile`` (:data:`INDUCTOR_OPTIONS`: weights frozen into the graph and packed once, the linear layers
that share an input concatenated, each matrix product's kernel chosen by timing at build, the C++ wrapper), the step
reads its weights at near the memory bandwidth. Measured on the 2-vCPU Intel Xeon with AMX, one thread, SmolLM2-135M
at K = 15 (15 blocks + head), 64 new tokens after 128: bf16 21.6 ms/token eager (packed), 15.6 compiled with
freezing alone, 13.3 with the concatenation and the timed kernel choice (AMX micro-kernels); fp32 29.2 eager, 22.3
compiled (docs/performance.md has the bench's figures).

What it costs, said where it is chosen (``decode_step`` of the suffix node):

* **Memory**: the frozen graph holds its own packed copy of the weights of blocks [K, L) and the head, beside the
  eager ones (the prefill, tokens placed after the decode and a conversation's turns run eagerly), and inductor
  keeps it for the life of the process (its generated module holds the frozen weights): the suffix's weights
  once more per split layer built, for at most :attr:`DecodeStepBuilder.MAX_SPLIT_LAYERS` of them.
* **Start-up**: a build takes tens of seconds on one core (10-50 s for SmolLM2 on this host, less when inductor's
  cache holds its kernels); it runs on a background thread, frames decode eagerly meanwhile, and the same after a
  live re-split to a K not built yet. The build shares the suffix's cores with the frames decoding meanwhile.
* **Rounding**: the compiled kernels sum in another order, and which kernel runs a product is chosen by timing at
  each build, so two builds may round differently. fp32: the same tokens as the eager step, logits within a
  few ulp of their scale (2.7e-6 relative over 64 tokens here); bf16: the logits move by bf16 rounding (0.3 at a
  scale of 27), so a greedy decode may choose another token where two are within that. ``verify-split`` checks the
  eager path, which stays the reference.

The graph is bound to the KV cache it was compiled against: with freezing, what the graph reads besides its inputs
may become constants of it (a compiled function handed another cache wrote the first one, in an experiment here).
So the step owns its cache (:attr:`CompiledDecodeStep.cache`) and takes no cache argument: the suffix runs the
frame's prefill eagerly into that same cache and the compiled step extends it.

Supported where a step is plain hidden-state rows at text positions: a bare language model, a driving VLA and a
VLM whose steps take text positions (InternVL; not Qwen-VL's multimodal ones), with one attention kind (causal, or
sliding on every block) and a shared rotary table, its linear layers not packed (:mod:`.packed_linear` replaces
them by oneDNN calls inductor cannot trace). :func:`compile_support` says why not elsewhere, and the decode runs
eagerly there.
"""
from __future__ import annotations

import threading
import time
import types

import torch

from ..model import text
from ..model.decode import LMHead, SideCache

__all__ = ["DECODE_STEPS", "CompiledDecodeStep", "DecodeStepBuilder", "compile_support", "plain_step"]

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


def _inductor_options():
    """A context that sets :data:`INDUCTOR_OPTIONS` in inductor's configuration (restored after)."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(INDUCTOR_OPTIONS)


def plain_step(out) -> bool:
    """Whether what crossed for a step (rows, or a :class:`~hybrid_vla_ros.model.contract.SplitState`) is rows at
    text positions only, which the compiled step computes as the eager one does."""
    if isinstance(out, torch.Tensor):
        return True
    return getattr(out, "position_ids", None) is None and getattr(out, "deepstack", None) is None


def compile_support(sm, stage, head: LMHead) -> str:
    """Why the decode step of split model ``sm`` (:class:`~hybrid_vla_ros.model.kinds.SplitModel`) with suffix
    ``stage`` and LM head ``head`` cannot be compiled; "" when it can."""
    from ..model.kinds import SplitModel
    from ..model.modeling import LMSuffixStage, SuffixStage, VLMSuffixStage
    from .packed_linear import PackedLinear

    plain = (LMSuffixStage.final_hidden_states, SuffixStage.final_hidden_states, VLMSuffixStage.final_hidden_states)
    if type(stage).final_hidden_states not in plain:
        return f"a {type(stage).__name__}'s decode step is not plain rows through its blocks"
    if type(sm).suffix_rows is not SplitModel.suffix_rows or sm.step_position_rows:
        return "its decode steps take multimodal positions"
    config = stage.rotary_emb.config
    kinds = set(text.attention_kinds(config)[stage.split_layer:])
    if len(kinds) > 1:
        return f"its blocks mix attention kinds ({', '.join(sorted(kinds))})"
    if text._rotary_per_kind(type(stage.rotary_emb)):
        return "its rotary table differs per attention kind"
    if head.packed is not None or any(isinstance(m, PackedLinear) for m in (*stage.modules(), *head.modules())):
        return "its linear layers are packed for oneDNN (inductor packs them itself)"
    return ""


class CompiledDecodeStep:
    """One decode row (1, H) -> logits (V,) float32 through blocks [``k``, L) of suffix ``stage``, its final norm
    and ``head``, compiled (:data:`INDUCTOR_OPTIONS`) against :attr:`cache`, a :class:`~..model.decode.SideCache`
    of ``max_len`` tokens this object owns. Built at construction (a compile and one warm-up step, then the cache
    is emptied); raises what ``torch.compile`` raises. ``threads``: torch intra-op threads of the compiled kernels
    (0: this thread's setting)."""

    def __init__(self, sm, stage, head: LMHead, k: int, max_len: int, threads: int = 0):
        why = compile_support(sm, stage, head)
        if why:
            raise ValueError(f"the decode step cannot be compiled: {why}")
        if threads > 0:
            torch.set_num_threads(threads)
        self.k, self.dtype = int(k), head.weight.dtype
        self.hidden_size = int(head.weight.shape[1])
        self.config = stage.rotary_emb.config
        kinds = text.attention_kinds(self.config)
        self.kind = kinds[min(self.k, len(kinds) - 1)]  # the blocks' one kind (K = L: no blocks, any)
        #: The KV cache the graph is bound to: the frame's prefill runs eagerly into it, the steps extend it.
        self.cache = SideCache(sm.text_config(), max_len, self.k)
        self._rotary = stage.rotary_emb
        layers, norm, cache = list(stage._layers_from(self.k)), stage.norm, self.cache.cache
        argument = text._cache_argument(type(layers[0])) if layers else "cache"

        def step(x, mask, positions, cos, sin):
            for block in layers:
                x = block(x, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin),
                          use_cache=True, **{argument: cache})
            return head(norm(x)[:, -1])

        # A code object of its own: dynamo counts recompiles per code object, so the builds at other Ks never meet
        # its recompile limit (past which it would run the function uncompiled, silently).
        own = types.FunctionType(step.__code__.replace(co_name=f"decode_step_k{self.k}"), step.__globals__,
                                 f"decode_step_k{self.k}", None, step.__closure__)
        t0 = time.perf_counter()
        self._step = torch.compile(own, dynamic=False)
        with torch.inference_mode():
            zero = torch.zeros(1, self.hidden_size, dtype=self.dtype)
            sm.suffix_rows(stage, zero, cache, self.k)  # allocates the cache's layers before the graph binds them
            self.logits(zero)  # the compile
            self.cache.reset()
        #: Seconds the build took (compile and warm-up).
        self.build_s = time.perf_counter() - t0

    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """A decode step's row (1, H) in the stage dtype -> the next token's logits (V,) float32, extending
        :attr:`cache`. Raises ValueError for another shape or dtype, or when the cache is full."""
        if tuple(row.shape) != (1, self.hidden_size) or row.dtype != self.dtype:
            raise ValueError(f"a compiled decode step takes one row (1, {self.hidden_size}) {self.dtype}, got "
                             f"{tuple(row.shape)} {row.dtype}")
        self.cache.room_for(1)
        x = row.unsqueeze(0)
        inputs = text.block_inputs(self.config, self._rotary, x, {self.kind}, None, cache=self.cache.cache,
                                   first_layer={self.kind: self.k})
        cos, sin = inputs.cos_sin[self.kind]
        with _inductor_options():  # a recompile (a guard that fails) builds the same way as the first compile
            return self._step(x, inputs.masks[self.kind], inputs.position_ids, cos, sin).reshape(-1)


class DecodeStepBuilder:
    """The suffix's compiled decode steps, one per split layer a frame came at, each built on a background thread
    (or at once, ``background`` False) while frames at that K decode eagerly, and kept: a K met again uses its step.
    At most :attr:`MAX_SPLIT_LAYERS` are built (inductor keeps a compiled graph's frozen weights for the life of the
    process, so each K built holds a copy of blocks [K, L) and the head); frames at further Ks decode eagerly.

    ``sm``, ``head``: as :class:`CompiledDecodeStep`; ``max_len``: the decode's cache bound; ``threads``: the
    suffix's torch threads; ``log(level, message)``: each build's outcome ("info" / "warning")."""

    #: Split layers with a compiled step at most.
    MAX_SPLIT_LAYERS = 3

    def __init__(self, sm, head: LMHead, max_len: int, threads: int = 0, background: bool = True, log=None):
        self.sm, self.head, self.max_len, self.threads = sm, head, int(max_len), int(threads)
        self.background, self.log = background, log or (lambda level, message: None)
        self._lock = threading.Lock()
        self._built: dict[int, CompiledDecodeStep] = {}
        self._building: int | None = None  # the K being built
        self._failed: dict[int, str] = {}  # K -> why its build failed (not tried again)
        self._last_k: int | None = None  # the K of the last frame
        self._thread: threading.Thread | None = None

    def for_frame(self, stage, k: int) -> CompiledDecodeStep | None:
        """The built step at split layer ``k``, or None (the frame decodes eagerly) while it is built or when it
        cannot be; asks for its build when none is under way and fewer than :attr:`MAX_SPLIT_LAYERS` are built."""
        k = int(k)
        with self._lock:
            self._last_k = k
            if k in self._built:
                return self._built[k]
            if self._building is not None or k in self._failed or len(self._built) >= self.MAX_SPLIT_LAYERS:
                return None
            self._building = k
        if self.background:
            self._thread = threading.Thread(target=self._build, args=(stage, k), name="decode_step_build",
                                            daemon=True)
            self._thread.start()
            return None
        self._build(stage, k)
        with self._lock:
            return self._built.get(k)

    def _build(self, stage, k: int) -> None:
        try:
            step = CompiledDecodeStep(self.sm, stage, self.head, k, self.max_len, self.threads)
        except Exception as e:  # noqa: BLE001 - a failed build leaves the eager step, said once
            with self._lock:
                self._failed[k] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                self._building = None
            self.log("warning", f"decode step: the inductor build at K={k} failed, decoding eagerly "
                                f"({self._failed[k]})")
            return
        with self._lock:
            self._built[k], self._building = step, None
        self.log("info", f"decode step: inductor at K={k} built in {step.build_s:.1f} s")

    plain = staticmethod(plain_step)

    @property
    def state(self) -> str:
        """One line for status and logs, of the last frame's K: ``inductor at K=k``, ``building at K=k`` or
        ``eager at K=k (why)``; ``not built yet`` before a frame."""
        with self._lock:
            k = self._last_k
            if k is None:
                return "not built yet"
            if k in self._built:
                return f"inductor at K={k}"
            if self._building is not None:
                return f"building at K={self._building} (eager meanwhile)"
            if k in self._failed:
                return f"eager at K={k} (its build failed: {self._failed[k]})"
            return (f"eager at K={k} (steps are kept for {self.MAX_SPLIT_LAYERS} split layers already: "
                    f"{', '.join(map(str, sorted(self._built)))})")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for a background build to end; True when none runs now."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()
