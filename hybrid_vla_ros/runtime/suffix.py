"""The suffix stage without ROS: ring slot -> decoder blocks [K, L), norm, planning head -> waypoints.

With :mod:`hybrid_vla_ros.runtime.prefix` in another process it forms the cross-frame pipeline: the suffix
computes frame t from one slot while the prefix computes t+1 into another. Timings (ms): ``handoff`` (start of the
write into the slot -> the suffix holds a view of it in its dtype) and ``suffix`` (blocks K..L-1, norm, head).

The ring's contract is checked once at attach (``contract_error``), not per frame. The wait for a frame spins
briefly before the one the prefix's period predicts (:class:`~hybrid_vla_ros.transport.wake.SpinPolicy`). On each
take the suffix announces when it will ask for the next (median take-to-poll cycle), so a faster prefix can pace
itself (``PrefixRunner.pacing_delay_s``).
"""
from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..model.checkpoint import load_stage, model_id, open_checkpoint, parse_dtype
from ..util.precision import CpuFeatures, inference_precision
from ..model.decode import SideCache, SuffixDecoding, conversation_ids, split_at
from ..model.decode_spec import DRIVES_CODEBOOK, DRIVES_TEXT, UnparseableWaypoints
from ..split.planner import ring_side
from ..model.modeling import DEFAULT_COMMAND
from ..split.resplit import StageSplit
from ..transport.ring import (
    ConsumerStats, FrameMeta, RingConsumer, RingConsumerConflict, RingContractError, RingError, SpinPolicy,
    ros_domain_id, segment_name,
)
from ..transport.layout import MAX_DECODE_ROWS
from .compiled_step import DECODE_STEPS, DecodeStepBuilder, DecodeStepStatus, compile_support
from .decoding import NO_STEP, SuffixDecodeLoop
from .packed_linear import (ExpertsWorkspace, fused_experts_count, pack_experts_, pack_linears_, pack_lm_head_,
                            packing_supported)
from .peer import PeerStatus, producer_status
from .settings import SuffixRunnerSettings
from .suffix_backend import SuffixBackend


class StaleFrame(RuntimeError):
    """A frame published before this consumer attached (left in the ring from before a restart)."""


class DecodeDropped(RuntimeError):
    """A frame whose decode gave no trajectory: ``cause`` (``decode_no_step``: the prefix stopped sending steps;
    ``unparseable_waypoints``: the text holds no waypoints of the declared grammar), the decoded ``text`` and the
    frame's :class:`DecodeOutcome` (``outcome``)."""

    def __init__(self, cause: str, message: str, text: str = "", outcome=None):
        super().__init__(message)
        self.cause, self.text = cause, text
        self.outcome = outcome  # the frame's DecodeOutcome (its tokens were decoded all the same)


#: Longest wait for the prefix's next decode step (s): beyond it the frame ends ``no_step`` (a dead prefix ends it at
#: once; one step is embedding + blocks [0, K) for one token, milliseconds even for a 7B prefix on a GPU).
DECODE_STEP_TIMEOUT_S = 10.0


@dataclass
class DecodeOutcome:
    """One frame's decode on the suffix: ``tokens`` decoded (the stop token included), their ``text`` (the model's
    tokenizer; "" without one; with turns the whole conversation after the prompt: answers and the questions
    between them), ``ended`` (``stop_token`` / ``max_new_tokens``), per token the suffix's compute and
    the prefix's (ms; the prefix's from each step's header), the suffix's wait per step (ms: the prefix's compute and
    both crossings) and the read-out after the decode (ms; 0 without one)."""

    tokens: list[int]
    text: str
    ended: str
    suffix_token_ms: list[float]
    prefix_token_ms: list[float]
    step_wait_ms: list[float]
    readout_ms: float = 0.0


@dataclass
class SuffixResult:
    """Waypoints of one frame with its slot metadata, timings (ms) and instants (CLOCK_MONOTONIC ns).

    ``waypoints == modes[mode]``, the mode the navigation command selected (M = 1 or 6). Only ``waypoints`` is
    checked for finiteness; the other modes are the caller's to judge.
    """

    waypoints: np.ndarray  # (N, 2) float64 metres, ego frame
    meta: FrameMeta
    handoff_ms: float
    suffix_ms: float
    t_ready_ns: int = 0  # the suffix holds the view of the slot
    t_suffix_end_ns: int = 0  # the suffix stage returned the waypoints
    resplits: tuple = ()  # Resplit events applied while taking this frame (blocks loaded / freed)
    superseded: int = 0  # older unread frames freed when this one was taken (newest-first delivery)
    modes: np.ndarray | None = None  # (M, N, 2) float64 metres, ego frame, every planner mode
    mode: int = 0  # index of the selected mode in modes
    decode: DecodeOutcome | None = None  # the frame's decode (a decoding model)

    @property
    def preprocess_ms(self) -> float:
        """The prefix's preprocessing of this frame (ms, slot header); NaN when not sent."""
        return self.meta.timings.preprocess_ms

    @property
    def prefix_ms(self) -> float:
        """The prefix stage of this frame (ms, slot header); NaN when not sent."""
        return self.meta.timings.prefix_ms

    @property
    def t_prefix_start_ns(self) -> int:
        """When the prefix started on this frame (CLOCK_MONOTONIC ns, slot header); 0 when not sent."""
        return self.meta.timings.prefix_start_ns


#: The suffix announces the median compute time of its last this many frames at a K (for rebalancing): one outlier
#: does not move it, and a load step shows after 2 loaded frames (5 frames took 3: the balancer then moved K about
#: 7 frames after a co-tenant arrived, half of a 16-frame step in the bench's load-step part, 2026-12-07).
ANNOUNCED_FRAMES = 3


class SuffixRunner:
    """Suffix stage plus ring consumer (CPU), built from a checkpoint directory and
    :class:`~.settings.SuffixRunnerSettings`; ``log(level, message)`` gets backend fallbacks.

    The blocks compute in :attr:`precision`'s dtype: the configured ``dtype``, or fp32 for a bf16 / fp16 ``dtype``
    on a CPU without native units for it (``inference_precision: auto``; ``cpu`` overrides the host's features).
    Each frame is computed on a view of the slot in that dtype (zero-copy when the dtypes match) at the
    K in its slot header, so the suffix follows a live re-split. Frames arrive in sequence order: once a frame at
    a higher K is computed, the blocks below it are freed (unless :meth:`request_split_layer` keeps them); a frame
    below the first block held loads the missing blocks first, so K never mismatches. The backend
    (:mod:`hybrid_vla_ros.runtime.suffix_backend`) is compiled per K in the background, eager meanwhile.
    """

    def __init__(self, model_path: str, settings: SuffixRunnerSettings, *, log=None, cpu: CpuFeatures | None = None):
        #: What this runner was built with (:class:`~.settings.SuffixRunnerSettings`).
        self.settings = settings
        if settings.decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, got {settings.decode_step!r}")
        split_layer, delivery = settings.split_layer, settings.delivery
        spin_lead_ms, spin_max_ms = settings.spin_lead_ms, settings.spin_max_ms
        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        #: The dtype computed in and why (:class:`~hybrid_vla_ros.util.precision.InferencePrecision`): ``dtype``, or
        #: fp32 for a bf16 / fp16 ``dtype`` on a CPU (``cpu``: read from /proc/cpuinfo when None) without native units.
        self.precision = inference_precision(parse_dtype(settings.dtype), settings.inference_precision, cpu)
        self.dtype = self.precision.dtype
        self.model_path = str(model_path)
        self.stage = load_stage(model_path, "suffix", split_layer, device="cpu", dtype=self.dtype)
        self.cfg = self.stage.cfg
        self.model_id = model_id(model_path)
        #: The split layer and every move of it (split.resplit.StageSplit, side "suffix").
        self.split = StageSplit(self.stage, "suffix", model_path=self.model_path, device=torch.device("cpu"),
                                dtype=self.dtype, model_id=self.model_id)
        #: The compute path of blocks [K, L) (eager, or a compiled model per K built in the background).
        self.backend = SuffixBackend(settings.backend, self.stage, model_id=self.model_id,
                                     cache_dir=settings.backend_cache_dir or None, threads=torch.get_num_threads(),
                                     log=log, background=settings.background_build)
        self.backend.prepare(self.stage, split_layer)
        #: The checkpoint's decode (:class:`~hybrid_vla_ros.model.decode_spec.DecodeSpec`); None: one prefill a frame.
        self.decode_spec = getattr(self.cfg, "decode_spec", None)  # own model code declares none
        self._decoding: SuffixDecoding | None = None
        self._tokenizer = None
        if self.decode_spec is not None:  # eager (the compiled backend runs one prefill a frame)
            sm = open_checkpoint(model_path).split_model()
            placed = self.cfg.decode_placed_token_ids
            turns = self.decode_spec.turns
            bound = SuffixDecoding.bound(self.cfg.num_tokens, self.decode_spec.settings, len(placed), turns)
            head = load_stage(model_path, "lm_head", None, device="cpu", dtype=self.dtype)
            self._decoding = SuffixDecoding(sm, self.stage, head, SideCache(sm.text_config(), bound, split_layer),
                                            self.decode_spec.settings, placed, MAX_DECODE_ROWS, split_layer, turns)
            self._tokenizer = sm.tokenizer()
            book = self.decode_spec.codebook
            self._codebook = book.load(model_path) if book is not None else None
            self._decode_ring = (MAX_DECODE_ROWS, sm.step_position_rows)
        else:
            self._decode_ring = (0, 0)
        #: The compiled decode step (:class:`~.compiled_step.DecodeStepBuilder`), or None: every step eager.
        self.decode_steps: DecodeStepBuilder | None = None
        #: Why the ``inductor`` decode step asked for cannot run ("" when it can, or was not asked for).
        self.decode_step_refused = ""
        if self._decoding is not None and settings.decode_step == "inductor":
            d = self._decoding
            self.decode_step_refused = compile_support(d.sm, self.stage, d.head)
            if not self.decode_step_refused:
                self.decode_steps = DecodeStepBuilder(d.sm, d.head, d.cache.max_len, torch.get_num_threads(),
                                                      settings.background_build, log)
                d.compiled = self.decode_steps
        #: How the eager suffix computes its bf16 linear layers (:mod:`.packed_linear`): ``packed N (oneDNN, once)``,
        #: or why not; "" for another dtype. Logged at configure and in /diagnostics.
        self.linear_packing = self._pack_linears(settings.backend)
        #: The ROS domain of this pipeline: the ring's name carries it, and a ring that declares another is refused.
        self.domain_id = ros_domain_id(settings.domain_id)
        self.segment = segment_name(settings.ring_name, settings.namespace, self.domain_id)
        #: Navigation command index (0..5, config.NAV_COMMANDS) used for the next frame; it selects the mode
        #: of a multi-mode planner. The node sets it from its parameter and command topic.
        self.command = DEFAULT_COMMAND
        if delivery not in ("newest", "fifo"):
            raise ValueError(f"delivery must be 'newest' or 'fifo', got {delivery!r}")
        self.delivery = delivery
        self._spin_args = (float(spin_lead_ms), float(spin_max_ms)) if spin_max_ms > 0 else None
        if self._spin_args is not None:
            SpinPolicy(*self._spin_args)  # ValueError for bad values now, not at attach
        self.ring: RingConsumer | None = None
        self.attach_error = ""  # why the last attach attempt failed ("" when attached)
        #: What kind of failure that was: "" (attached, or not tried yet), 'no_ring', 'locked_out', 'contract',
        #: 'attach_error' (runtime.peer.producer_status), and for 'locked_out' the pid holding the ring.
        self.attach_failure, self.holder_pid = "", 0
        self.contract_error = ""  # the ring's contract does not fit this suffix ("" when it does or is unknown)
        self._running: bool | None = None  # what set_running last said (told to every ring attached later)
        #: Frames dropped unread because a newer one was taken (newest-first delivery), over every attach.
        self.superseded = 0
        #: From taking a frame to the next poll (ns): this side's cycle, at the K of ``_busy_k`` only (a frame at
        #: another K starts it afresh, so the cycle announced to the prefix is the one at the K it computes now).
        self._busy_ns: deque = deque(maxlen=5)
        self._busy_k = -1
        #: Compute times (ns) of the last frames at ``_stage_k`` (blocks [K, L) and the read-out), announced to the
        #: prefix with their K (the median of :data:`ANNOUNCED_FRAMES`).
        self._stage_ns: deque = deque(maxlen=ANNOUNCED_FRAMES)
        self._stage_k = -1
        self._t_taken_ns = 0
        self._taken_k = -1
        self._attached_ns = 0  # CLOCK_MONOTONIC time of the last attach
        if self.decode_steps is not None and len(self.stage.layers):
            self.decode_steps.for_frame(self.stage, split_layer)  # the configured K's build starts now, last

    def _attach(self) -> bool:
        if self.ring is not None and self.ring.producer_gone:
            self.ring.close()
            self.ring = None
        if self.ring is None:
            try:
                self.ring = RingConsumer(
                    self.segment, expected_model_id=self.model_id,
                    expected_split_layer=range(0, self.cfg.num_layers + 1), compute_dtype=self.dtype,
                    expected_shape=self.cfg.prefix_state_shape, delivery=self.delivery,
                    expected_domain_id=self.domain_id, expected_decode=self._decode_ring,
                    spin=SpinPolicy(*self._spin_args) if self._spin_args is not None else None)
            except FileNotFoundError:
                self.attach_error, self.attach_failure, self.contract_error = (
                    "the prefix has not created the ring yet", "no_ring", "")
                return False
            except RingContractError as e:  # the pair does not fit: refused before any frame is taken
                self.attach_error = self.contract_error = str(e)
                self.attach_failure = "contract"
                return False
            except RingConsumerConflict as e:  # another suffix holds the ring
                self.attach_error, self.attach_failure, self.contract_error = str(e), "locked_out", ""
                self.holder_pid = e.holder_pid
                return False
            except RingError as e:  # e.g. a foreign segment
                self.attach_error, self.attach_failure, self.contract_error = str(e), "attach_error", ""
                return False
            problems = self._side_problems(self.ring.contract)
            refused = self._pair_refused(self.ring.contract)
            if refused:  # the same pairs are refused on every host, widened here or not
                self.ring.close()
                self.ring = None
                self.attach_error = self.contract_error = refused
                self.attach_failure = "contract"
                return False
            if problems:  # the side tensors this model's blocks after K need do not fit what the prefix sends
                self.ring.close()
                self.ring = None
                self.attach_error = self.contract_error = ("ring contract does not fit: " + "; ".join(problems))
                self.attach_failure = "contract"
                return False
            self.attach_error = self.contract_error = self.attach_failure = ""
            self.holder_pid = 0
            self._attached_ns = time.monotonic_ns()
            self.ring.announce_max_age(round(self.settings.frame_age_limit_s * 1e9))
            if self._running is not None:
                self.ring.set_running(self._running)
        return True

    def _pair_refused(self, contract) -> str:
        """Why the ring's dtype and the *configured* ``dtype`` are a refused pair ("" when allowed or when nothing is
        widened): a suffix widened to fp32 could convert any ring exactly, but a launch file that pairs, say, an
        fp32 prefix with an fp16 suffix must fail on this CPU as it does on one with fp16 units."""
        from ..transport.contract import conversion_kind
        from ..transport.errors import RingContractError

        if not self.precision.widened or contract.dtype is None:
            return ""
        try:
            conversion_kind(contract.dtype, self.precision.requested)
        except RingContractError as e:
            return f"{e} (refused on every CPU, although this one computes in fp32)"
        return ""

    def _side_problems(self, contract) -> list[str]:
        """Differences between the side tensors the prefix declares and the ones this model needs."""
        from ..transport.contract import side_differences

        return side_differences(contract.side, ring_side(self.cfg, contract.dtype or self.dtype))

    def _state(self, hidden: torch.Tensor, side: dict):
        """h_K and side tensors (floating ones in this dtype) as a SplitState; the bare tensor without side tensors."""
        if not self.cfg.side:
            return hidden
        from ..model.contract import SplitState

        return SplitState.from_side(hidden, {name: t.to(self.dtype) if t.is_floating_point() else t
                                             for name, t in side.items()})

    @property
    def attached(self) -> bool:
        return self.ring is not None

    def set_running(self, running: bool) -> None:
        """Declare in the ring header, now and at every later attach, whether this suffix runs or is paused."""
        self._running = bool(running)
        if self.ring is not None and not self.ring.producer_gone:
            self.ring.set_running(self._running)

    def peer_status(self) -> PeerStatus:
        """The prefix as this suffix sees it now (:func:`~.peer.producer_status`)."""
        ring = self.ring
        if ring is not None and not ring.producer_gone:
            last_publish, cycle = ring.producer_schedule()
            return producer_status(True, "", "", self.segment, ring.owner_pid, ring.owner_alive, ring.producer_state,
                                   now_ns=time.monotonic_ns(), last_publish_ns=last_publish, cycle_ns=cycle)
        return producer_status(False, self.attach_failure or "no_ring", self.attach_error, self.segment, 0, False,
                               "not said", self.holder_pid)

    @property
    def split_layer(self) -> int:
        """The K of the last frame computed (the configured one before the first frame)."""
        return self.split.k

    def request_split_layer(self, split_layer: int) -> None:
        """Preload blocks for frames at ``split_layer`` in the background (thread-safe), so the prefix's move down
        costs no wait here. Raises ValueError for a K out of [0, L]."""
        self.split.request(split_layer)

    @torch.inference_mode()
    def wait_attached(self, timeout_s: float) -> None:
        """Attach to the ring (every 50 ms, up to ``timeout_s`` s) without taking a frame; else TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while not self._attach():
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not attach to the ring within {timeout_s:g} s: {self.attach_error}")
            time.sleep(0.05)

    def poll(self, timeout_s: float) -> SuffixResult | None:
        """Wait up to ``timeout_s`` (s) for a frame and run the suffix on it.

        The frame is the newest unread (older ones ``superseded``) or, with ``delivery="fifo"``, the oldest. Returns
        None on timeout or while the ring cannot be attached (``attach_error`` / ``contract_error`` say why; it
        retries each poll and re-attaches when the prefix replaces the ring). Raises ``SlotRejected`` for a slot
        header that fails validation, FloatingPointError for non-finite waypoints, StaleFrame for a frame from
        before this attach, and ResplitError once when requested blocks could not be loaded (no frame is lost).
        """
        if not self._attach():
            time.sleep(min(timeout_s, 0.05))  # no ring to wait on yet: retry at a modest rate
            return None
        self.split.before_frame()
        if self._t_taken_ns:
            if self._taken_k != self._busy_k:
                self._busy_ns.clear()
                self._busy_k = self._taken_k
            self._busy_ns.append(time.monotonic_ns() - self._t_taken_ns)
            self._t_taken_ns = 0
        slot = self.ring.read(timeout_s)
        if slot is None:
            return None
        self._t_taken_ns = time.monotonic_ns()
        if self._busy_ns:  # pacing hint for the prefix: when this side will ask for the next frame
            busy = sorted(self._busy_ns)[len(self._busy_ns) // 2]
            self.ring.announce_next_read(self._t_taken_ns, self._t_taken_ns + busy)
        self.superseded += slot.superseded
        with slot:
            if slot.meta.t_publish_ns < self._attached_ns:
                raise StaleFrame(f"frame seq {slot.meta.seq} was published before the suffix attached")
            k = self._taken_k = slot.meta.split_layer
            self.split.for_frame(k)  # loads the blocks a frame below the first one held needs
            hidden = slot.compute_tensor  # zero-copy, or converted to this suffix's dtype (an allowed pair)
            state = self._state(hidden, slot.side)
            t_ready = time.monotonic_ns()
            if self._decoding is not None:
                out, decode = self._decode(slot.meta.seq, state, k)
            else:
                out, decode = self.backend.plan_all(self.stage, state, self.command, k), None
            t_end = time.monotonic_ns()
            meta, superseded = slot.meta, slot.superseded
        self._announce_stage_time(k, t_end - t_ready)
        self.split.after_frame(k)
        resplits = self.split.pop_events()
        modes = out.modes.double().numpy()
        wp = modes[out.mode]
        if not np.isfinite(wp).all():
            raise FloatingPointError("suffix produced non-finite waypoints")
        return SuffixResult(wp, meta, (t_ready - meta.t_write_start_ns) / 1e6, (t_end - t_ready) / 1e6, t_ready, t_end,
                            resplits, superseded, modes, out.mode, decode)

    @property
    def has_tokenizer(self) -> bool:
        """Whether decoded ids become text (a tokenizer beside the model); else the reasoning text is the ids."""
        return self._tokenizer is not None

    def decode_step_status(self) -> DecodeStepStatus:
        """A decoding model's decode step (:class:`~.compiled_step.DecodeStepStatus`): the compiled step's where one
        is built, else eager and why not compiled; without a decode, ``line`` "" (or, with ``inductor`` asked,
        that it is ignored, also the ``error``)."""
        asked = self.settings.decode_step
        if self._decoding is None:
            why = "" if asked == "eager" else "ignored: this model does not decode"
            return DecodeStepStatus(asked, error=why, line=why)
        if self.decode_steps is not None:
            return self.decode_steps.status()
        if self.decode_step_refused:
            return DecodeStepStatus(asked, error=self.decode_step_refused,
                                    line=f"eager (not compiled: {self.decode_step_refused})")
        return DecodeStepStatus(asked, line="eager")

    def _pack_linears(self, backend: str) -> str:
        """Pack the bf16 stage's decoder blocks' linear layers and MoE experts (and the decode's LM head) for oneDNN
        once, where this CPU computes bf16 natively and the packed output is bit-identical; blocks loaded by later
        re-splits are packed as they load. The compiled backend traces the eager blocks, so they stay unpacked
        there."""
        if self.dtype != torch.bfloat16:
            return ""
        if backend != "eager":
            return f"not packed: the {backend} backend traces the eager blocks"
        if self.decode_steps is not None:
            return "not packed: the inductor decode step traces the eager blocks (and packs its own weights)"
        ok, why = packing_supported()
        if not ok:
            return f"not packed: {why}"
        workspace = ExpertsWorkspace()  # one for the stage's experts: its blocks run one after another

        def pack(blocks) -> tuple[int, int]:  # linear layers, then MoE experts (grouped_mm families)
            return pack_linears_(blocks), pack_experts_(blocks, workspace)

        candidates = fused_experts_count(self.stage.layers)
        n, experts = pack(self.stage.layers)  # the decoder blocks: the heads after them stay torch modules
        if n == 0 and any(isinstance(m, torch.nn.Linear) for m in self.stage.layers.modules()):
            return "not packed: the packed layer's output differs from the unpacked one on this CPU"
        unpacked = (", MoE experts not packed (the packed product differs from transformers' at some row counts on "
                    "this CPU and thread count)") if candidates and not experts else ""
        self.split.prefetcher.prepare = pack
        head = self._decoding.head if self._decoding is not None else None
        lm = ", and the LM head" if head is not None and pack_lm_head_(head) else ""
        lm = f", the experts of {experts} MoE block(s){lm}" if experts else lm
        return f"packed {n} linear layers of blocks [K, L){lm} (oneDNN, once){unpacked}"

    def _decode(self, seq: int, state, k: int):
        """Decode the frame in slot ``seq`` (at split layer ``k``) with the prefix over the ring's decode channel ->
        (PlanOutput, :class:`DecodeOutcome`). Raises :class:`DecodeDropped` when it gives no trajectory, and what
        the suffix stage raises."""
        from ..model.stages import PlanOutput

        d = self._decoding
        d.stage, d.command = self.stage, int(self.command)
        self.backend.frames_eager += 1  # a decode runs eagerly (the compiled suffix is one prefill's graph)
        ring = self.ring
        loop = SuffixDecodeLoop(d, ring.decode, DECODE_STEP_TIMEOUT_S, self.dtype,
                                peer_alive=lambda: not ring.producer_gone)
        with torch.inference_mode():
            answered = loop.answer(seq, state, k)
        spec = self.decode_spec
        decodes = split_at(answered.tokens, answered.turn_starts)
        text = self.decoded_text(conversation_ids(decodes, spec.turns))  # turns: the questions between answers
        outcome = DecodeOutcome(answered.tokens, text, answered.ended, answered.suffix_token_ms,
                                answered.prefix_step_ms, answered.step_wait_ms, answered.readout_ms)
        if answered.ended == NO_STEP:
            raise DecodeDropped("decode_no_step", f"frame seq {seq}: the prefix sent no decode step within "
                                f"{DECODE_STEP_TIMEOUT_S:g} s (or went away) after {len(answered.tokens)} token(s)",
                                text, outcome)
        if spec.drives in (DRIVES_TEXT, DRIVES_CODEBOOK):
            written = self.decoded_text(answered.tokens) if spec.turns else text  # what the model wrote
            try:
                points = (spec.text.parse(written, self.cfg.n_waypoints) if spec.drives == DRIVES_TEXT
                          else spec.codebook.waypoints(self._codebook, answered.tokens, self.cfg.n_waypoints))
            except UnparseableWaypoints as e:
                raise DecodeDropped("unparseable_waypoints", f"frame seq {seq}: {e}; text {text[:200]!r}",
                                    text, outcome) from None
            modes = torch.tensor([points], dtype=torch.float32)
            return PlanOutput(modes[0], modes, None, 0), outcome
        return answered.plan, outcome

    def decoded_text(self, tokens: list[int]) -> str:
        """Token ids -> text with the model's tokenizer (special tokens kept); without tokenizer files beside the
        model, the ids themselves (``token ids: 108 196 ...``), never an empty text for a decode."""
        if not tokens:
            return ""
        if self._tokenizer is None:
            return "token ids: " + " ".join(str(int(t)) for t in tokens)
        known = len(self._tokenizer)  # ids the model has beyond its tokenizer's (added read-out tokens) as <id N>
        parts, run = [], []
        for t in tokens:
            if 0 <= t < known:
                run.append(t)
                continue
            parts += [self._tokenizer.decode(run, skip_special_tokens=False)] if run else []
            parts.append(f"<id {t}>")
            run = []
        parts += [self._tokenizer.decode(run, skip_special_tokens=False)] if run else []
        return "".join(parts)


    def _announce_stage_time(self, k: int, stage_ns: int) -> None:
        """Announce the median compute time of the last frames at ``k`` in the ring header (for rebalancing)."""
        if k != self._stage_k:
            self._stage_ns.clear()
            self._stage_k = k
        self._stage_ns.append(stage_ns)
        if self.ring is not None:  # attached at this poll's start (no per-frame producer_gone system calls)
            self.ring.announce_stage_time(k, sorted(self._stage_ns)[len(self._stage_ns) // 2])

    def ring_stats(self) -> ConsumerStats:
        """The ring consumer's counters (all 0 before it attached)."""
        return self.ring.stats if self.ring is not None else ConsumerStats()

    def close(self) -> None:
        self.backend.close()
        if self.decode_steps is not None:
            self.decode_steps.close()
        self.split.close()
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        self.stage = None
        gc.collect()
