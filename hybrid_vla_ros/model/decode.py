"""Autoregressive decoding across the split: each side keeps a KV cache of its own decoder blocks.

A frame is one prefill (as without decoding) and then one step per new token: the prefix embeds the token(s) and
runs blocks [0, K) against its cache, (k, H) rows cross, the suffix runs blocks [K, L), the final norm and the LM
head against its cache and chooses the next token, which goes back to the prefix. Nothing but those rows and the
token crosses: each cache holds its own blocks' keys and values (the other side's layers stay empty), so what reads
a side's cache later (an action expert, drafting) runs on that side.

The caches are transformers' ``StaticCache`` of the text config, bounded by prompt + ``max_new_tokens`` - 1 (the
last token is chosen, never cached; ``generate``'s static length): the layers
a side uses are allocated at its first frame, on its device, and reset for every frame. The choice of the next
token follows ``generate``: greedy, or ``temperature`` then ``top_p`` (``TemperatureLogitsWarper``,
``TopPLogitsWarper``) and a draw from a generator seeded per frame.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .decode_spec import DecodeSettings  # what a decode is told (re-exported for callers)

#: Why a frame's decode ended.
STOP_TOKEN, MAX_TOKENS = "stop_token", "max_new_tokens"


class TokenChooser:
    """The next token from one step's logits (V,) float32, as :class:`DecodeSettings` says."""

    def __init__(self, settings: DecodeSettings):
        self.settings = settings
        self.generator = torch.Generator()

    def start(self, frame_seq: int = 0) -> None:
        """Seed the draws of one frame (``seed + frame_seq``): the same frame samples the same tokens at any K."""
        self.generator.manual_seed(int(self.settings.seed) + int(frame_seq))

    def choose(self, logits: torch.Tensor) -> int:
        s = self.settings
        scores = logits.detach().float().reshape(-1).cpu()
        if s.temperature == 0.0:
            return int(torch.argmax(scores))
        scores = scores / s.temperature
        if s.top_p < 1.0:  # keep the smallest set whose probability reaches top_p (at least the best token)
            order = torch.argsort(scores)
            cumulative = torch.softmax(scores[order], dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1.0 - s.top_p
            drop[-1] = False
            scores = scores.clone()
            scores[order[drop]] = -float("inf")
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator))


class LMHead(nn.Module):
    """The family's causal-LM head: final-norm rows (k, H) -> logits (k, V) float32. ``weight`` (V, H) is
    ``lm_head.weight``, or ``embed_tokens.weight`` when tied (``tied``; None: as the config says); the config's
    logit factors as the families' ``ForCausalLM.forward`` apply them: Cohere's ``logit_scale`` (times), Granite's
    ``logits_scaling`` (divided by), Gemma's ``final_logit_softcapping`` (``tanh(logits / cap) * cap``).
    ``factors``: the names of those the model's generation class applies (a VLM's ``ForConditionalGeneration``
    may apply none of its text model's, e.g. Aya Vision's Cohere 2 scale: :func:`~.vlm.logit_factors`); None:
    all the config sets."""

    def __init__(self, config, tied: bool | None = None, factors: frozenset | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.tied = bool(getattr(config, "tie_word_embeddings", False)) if tied is None else bool(tied)

        def factor(name):
            return getattr(config, name, None) if factors is None or name in factors else None

        self.softcap = factor("final_logit_softcapping")
        self.times = factor("logit_scale")
        self.divided_by = factor("logits_scaling")
        #: The projection in place of ``weight`` once packed (``runtime.packed_linear.pack_lm_head_``), else None.
        self.packed = None

    def checkpoint_key(self, local_key: str) -> str:
        return "embed_tokens.weight" if self.tied else "lm_head.weight"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.packed(rows) if self.packed is not None else nn.functional.linear(rows, self.weight)
        if self.times is not None:
            logits = logits * self.times
        if self.divided_by is not None:
            logits = logits / self.divided_by
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()


class SideCache:
    """One side's KV cache: transformers' ``StaticCache`` of ``config`` holding ``max_len`` tokens (prompt + new
    tokens - 1). ``first_layer``: the first decoder block this side runs (the layer its length is read at)."""

    def __init__(self, config, max_len: int, first_layer: int):
        from transformers.cache_utils import StaticCache

        self.cache = StaticCache(config=config, max_cache_len=int(max_len))
        self.max_len, self.first_layer = int(max_len), int(first_layer)

    @property
    def tokens(self) -> int:
        """Tokens it holds now (0 on a side without blocks)."""
        if self.first_layer >= len(self.cache.layers):
            return 0
        return int(self.cache.get_seq_length(self.first_layer))

    def room_for(self, rows: int) -> None:
        """Raise ValueError when ``rows`` more tokens would not fit."""
        if self.tokens + rows > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} tokens: {self.tokens} + {rows} do not fit "
                             "(raise the decode's prompt or max_new_tokens bound)")

    def reset(self) -> None:
        self.cache.reset()


@dataclass
class DecodeResult:
    """One frame's decode: ``tokens`` chosen in order (the stop token included), ``logits`` of each step (V,) float32
    (the prefill's last row first), ``ended`` (:data:`STOP_TOKEN` or :data:`MAX_TOKENS`; "" while it goes on) and,
    where the planning head reads tokens placed after the decode, its ``plan``
    (:class:`~.modeling.PlanOutput`). With turns (``decode.turns``): ``turn_starts`` holds the index in ``tokens``
    where each later decode starts, ``decode_ends`` how each decode ended (the last one is ``ended``)."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    ended: str = ""
    plan: object = None
    turn_starts: list[int] = field(default_factory=list)
    decode_ends: list[str] = field(default_factory=list)

    def decodes(self) -> list[list[int]]:
        """The chosen tokens split into the frame's decodes (one list without turns)."""
        return split_at(self.tokens, self.turn_starts)


def split_at(tokens: list[int], turn_starts: list[int]) -> list[list[int]]:
    """A frame's chosen ``tokens`` split into its decodes at ``turn_starts`` (the index where each decode after a
    turn starts, :attr:`DecodeResult.turn_starts`); one list without turns."""
    cuts = [0, *turn_starts, len(tokens)]
    return [tokens[a:b] for a, b in zip(cuts, cuts[1:])]


def split_decodes(tokens: list[int], stop_token_ids, max_new_tokens: int, decodes: int) -> list[list[int]]:
    """A frame's chosen ``tokens`` split into its ``decodes`` decodes, each ending at a stop token or after
    ``max_new_tokens`` (as :class:`SuffixDecoding` ends them); the last holds the rest."""
    out: list[list[int]] = [[]]
    for t in tokens:
        out[-1].append(t)
        if len(out) < decodes and (t in stop_token_ids or len(out[-1]) >= max_new_tokens):
            out.append([])
    return out


def conversation_ids(decodes: list[list[int]], turns) -> list[int]:
    """The token ids after the prompt in order: each decode's tokens, then the turn placed after it. Raises
    IndexError when ``turns`` holds fewer than ``len(decodes) - 1`` turns."""
    ids: list[int] = []
    for i, chosen in enumerate(decodes):
        ids += chosen
        if i < len(decodes) - 1:
            ids += list(turns[i])
    return ids


class PrefixDecoding:
    """The prefix side of a frame's decode: the prefill and each step's embedding + blocks [0, K) against the
    prefix's KV cache ``cache`` (:class:`SideCache`), through the model's
    :class:`~hybrid_vla_ros.model.kinds.SplitModel` ``sm``. What each returns is what crosses the split."""

    def __init__(self, sm, stage, cache: SideCache, chunk_rows: int = 0, placed: int = 0):
        self.sm, self.stage, self.cache = sm, stage, cache
        #: > 0: the prefill runs its tokens through the blocks this many at a time (a VLM's chunked prefill).
        self.chunk_rows = int(chunk_rows)
        #: Tokens placed after the decode (the decoding's ``placed``); with a ``queries`` read-out the last
        #: ``query_count`` of them take the learned query embeddings.
        self.placed = int(placed)
        self.query_count = int(getattr(sm.cfg, "query_count", 0)) if placed else 0
        self._prefill = None
        self._placed_run = 0  # placed tokens run so far this frame (the decode's last token first)
        self.position = 0  # the sequence position of the next token

    def prefill(self, inputs: tuple):
        """Reset the cache and run the frame's prefill (the prefix's output: h_K, or a SplitState)."""
        self.cache.reset()
        self._placed_run = 0
        self._prefill = out = self.sm.run_prefix(self.stage, inputs, cache=self.cache.cache,
                                                 chunk_rows=self.chunk_rows)
        self.position = int(self.sm.hidden(out).shape[-2])
        return out

    def step(self, tokens, placed: bool = False) -> object:
        """The chosen ``tokens`` (a sequence of ids) through embedding + blocks [0, K) at the next positions;
        ``placed``: tokens placed after the decode (the decode's last token, then :attr:`placed` ones, in order).
        Raises ValueError when the cache has no room left."""
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        self.cache.room_for(ids.numel())
        queries = (0, 0)
        if placed and self.query_count:  # the placed run's last query_count rows are the learned queries
            first_query = 1 + self.placed - self.query_count
            start = max(self._placed_run, first_query)
            count = self._placed_run + ids.numel() - start
            if count > 0:
                queries = (start - first_query, count)
        if placed:
            self._placed_run += ids.numel()
        out = self.sm.prefix_step(self.stage, ids, self._prefill, self.cache.cache, self.position, queries)
        self.position += ids.numel()
        return out


class CompiledStep(Protocol):
    """One decode row through blocks [K, L), the norm and the LM head, computed outside the eager modules, against
    its own :class:`SideCache` ``cache`` (the frame's other rows are run eagerly into that same cache)."""

    cache: SideCache

    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """Row (1, H) in the stage dtype -> the next token's logits (V,) float32, extending ``cache``. Raises
        ValueError when the cache is full."""


class CompiledSteps(Protocol):
    """Where a :class:`SuffixDecoding` finds its frame's :class:`CompiledStep`
    (:class:`~hybrid_vla_ros.runtime.compiled_step.DecodeStepBuilder`)."""

    def for_frame(self, stage, k: int) -> CompiledStep | None:
        """The step for a frame at split layer ``k`` of suffix ``stage``, or None (the frame decodes eagerly)."""

    def failed(self, k: int, why: str) -> None:
        """The step at ``k`` failed (``why``): frames at ``k`` decode eagerly from now on."""


def plain_step(out) -> bool:
    """Whether what crossed for a decode step (rows (k, H), or a :class:`~.contract.SplitState`) is rows at text
    positions only (no multimodal positions, no DeepStack features): what a :class:`CompiledStep` computes."""
    if isinstance(out, torch.Tensor):
        return True
    return getattr(out, "position_ids", None) is None and getattr(out, "deepstack", None) is None


class SuffixDecoding:
    """The suffix side of a frame's decode: blocks [K, L) and the final norm against the suffix's KV cache
    ``cache``, the LM head ``head`` on the last row, and the choice of the next token (:class:`TokenChooser`).

    ``placed``: token ids placed after the decode, their last rows read by the planning head (a decoding driving
    model: ``decode.after_token_ids`` then the read-out tokens), or () when the decode drives nothing there. They
    follow the decode's last token (never run yet) in steps of at most ``rows_per_step`` rows, the read-out tokens in
    the last one (:meth:`placed_steps`). ``turns``: token-id sequences, each run after a decode ends (after its last
    token, in steps of at most ``rows_per_step`` rows) and answered by another decode (:meth:`take`). ``k``: the
    split layer the frames come at (default the stage's)."""

    def __init__(self, sm, stage, head: LMHead, cache: SideCache, settings: DecodeSettings, placed=(),
                 rows_per_step: int = 4, k: int | None = None, turns=()):
        self.sm, self.stage, self.head, self.cache, self.settings = sm, stage, head, cache, settings
        self.placed, self.rows_per_step = tuple(int(t) for t in placed), int(rows_per_step)
        self.turns = tuple(tuple(int(t) for t in turn) for turn in turns)
        self.k = stage.split_layer if k is None else int(k)
        self.command = 3  # LANE_FOLLOW (config.NAV_COMMANDS) until the runner says
        self.chooser = TokenChooser(settings)
        self.result = DecodeResult()
        self._placed_rows: list[torch.Tensor] = []
        self._pending: list[list[int]] = []  # a turn's steps still to run before the next choice
        self._in_decode = 0  # tokens chosen in the current decode
        #: Whether the ids :meth:`take` returned last are a turn's step (the first: the decode's last token, then
        #: the turn's first ids), not a chosen token to go on with.
        self.turn_step = False
        #: Where one-row steps may run compiled (:class:`CompiledSteps`); None: every step runs eagerly.
        self.compiled: CompiledSteps | None = None
        self._own_cache = cache
        self._step: CompiledStep | None = None  # this frame's compiled step

    def begin(self, frame_seq: int = 0, k: int | None = None) -> None:
        """A new frame (at split layer ``k``, default unchanged): an empty cache and result, the draws seeded for
        ``frame_seq``."""
        if k is not None:
            self.k = self._own_cache.first_layer = int(k)
        self._step = self.compiled.for_frame(self.stage, self.k) if self.compiled is not None else None
        self.cache = self._step.cache if self._step is not None else self._own_cache  # the step's graph holds its own
        self.cache.reset()
        self.chooser.start(frame_seq)
        self.result = DecodeResult()
        self._placed_rows = []
        self._pending, self._in_decode, self.turn_step = [], 0, False

    def take(self, out) -> list[int]:
        """The prefill's or a step's output (what crossed) -> the token ids the prefix runs next: the chosen token
        (appended to ``result``, whose ``ended`` says whether it was the last), or, where a decode ended and a turn
        follows, its first step (the chosen token, then the turn's first ids; :attr:`turn_step`); while a turn's
        steps remain, their rows only extend the cache and the next step's ids come back. Raises ValueError when the
        cache has no room left."""
        rows = self.sm.hidden(out)
        self.cache.room_for(rows.shape[-2])
        self.turn_step = bool(self._pending)
        logits = None
        if self._step is not None and not self._pending and rows.shape[-2] == 1 and plain_step(out):
            logits = self._compiled_logits(rows)  # blocks [K, L), norm and head compiled (None: it failed)
        if logits is None:
            final = self.sm.suffix_rows(self.stage, out, self.cache.cache, self.k)
            if self._pending:  # a turn's rows: nothing is chosen before its last step
                return self._pending.pop(0)
            logits = self.head(final[..., -1:, :]).reshape(-1)
        token = self.chooser.choose(logits)
        r = self.result
        r.tokens.append(token)
        r.logits.append(logits)
        self._in_decode += 1
        end = STOP_TOKEN if token in self.settings.stop_token_ids else \
            MAX_TOKENS if self._in_decode >= self.settings.max_new_tokens else ""
        if not end:
            return [token]
        r.decode_ends.append(end)
        turn = len(r.turn_starts)
        if turn >= len(self.turns):
            r.ended = end
            return [token]
        ids, n = [token, *self.turns[turn]], self.rows_per_step
        steps = [ids[i:i + n] for i in range(0, len(ids), n)]
        self._pending = steps[1:]
        r.turn_starts.append(len(r.tokens))
        self._in_decode, self.turn_step = 0, True
        return steps[0]

    def _compiled_logits(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The compiled step's logits for one row, or None when it failed before touching the cache: the step is
        dropped for this K (``compiled.failed``) and the eager path computes the row. Raises what failed after the
        cache was extended (the frame cannot go on), and ValueError (no room left) as the eager path would."""
        before = self.cache.tokens
        try:
            return self._step.logits(rows)
        except ValueError:
            raise
        except Exception as e:  # a compiled step that fails leaves the eager one
            if self.cache.tokens != before:
                raise
            cause = e  # the first cause (dynamo wraps a backend's error: inner_exception)
            while (inner := cause.__cause__ or getattr(cause, "inner_exception", None)) not in (None, cause):
                cause = inner
            self.compiled.failed(self.k, f"its step failed: {type(cause).__name__}: {cause}".splitlines()[0][:300])
            self._step = None
            return None

    def placed_steps(self) -> list[list[int]]:
        """After the decode ended: the tokens to run, step by step (the last decoded token, then :attr:`placed`),
        the last step holding the last ``rows_per_step`` of them; [] when nothing is placed."""
        if not self.placed:
            return []
        ids = [self.result.tokens[-1], *self.placed]
        n = self.rows_per_step
        head, last = ids[:-n] if len(ids) > n else [], ids[-n:]
        return [head[i:i + n] for i in range(0, len(head), n)] + [last]

    def take_placed(self, out, last: bool) -> None:
        """A step of placed tokens (what crossed): blocks [K, L) extend the cache and their rows are kept; after the
        ``last`` one the planning head reads every placed row (``result.plan``; the read-out rows are the last).
        Raises ValueError when the cache has no room or the head refuses."""
        self.cache.room_for(self.sm.hidden(out).shape[-2])
        self._placed_rows.append(self.sm.placed_rows(self.stage, out, self.cache.cache, self.k))
        if last:
            self.result.plan = self.sm.plan_placed(self.stage, torch.cat(self._placed_rows, dim=-2), self.command)
            self._placed_rows = []

    @staticmethod
    def bound(prompt: int, settings: DecodeSettings, placed: int = 0, turns=()) -> int:
        """Tokens a side's cache must hold: the prompt, every decoded token but the last (chosen, never cached:
        ``generate``'s static length), and with ``placed`` tokens the last decoded one and those; with ``turns``
        (token-id sequences) each one and its decode."""
        turn_tokens = sum(len(t) for t in turns)
        return prompt + (1 + len(turns)) * settings.max_new_tokens + turn_tokens - 1 + (placed + 1 if placed else 0)


def decode_in_process(sm, prefix, suffix, head: LMHead, prefix_cache: SideCache, suffix_cache: SideCache,
                      inputs: tuple, settings: DecodeSettings, frame_seq: int = 0, placed=(),
                      command: int = 3, front: "PrefixDecoding | None" = None, turns=()) -> DecodeResult:
    """Decode one frame with both sides in this process (what crosses handed over directly; the reference the
    ring's decode is checked against), with a decode after each of the ``turns``, then run the ``placed`` tokens
    (:class:`SuffixDecoding`) with navigation command index ``command``; ``front``: the prefix side to use instead
    of one made from ``prefix`` and ``prefix_cache`` (a check that alters it). Returns a :class:`DecodeResult`."""
    front = front or PrefixDecoding(sm, prefix, prefix_cache, placed=len(placed))
    back = SuffixDecoding(sm, suffix, head, suffix_cache, settings, placed, turns=turns)
    back.command = command
    back.begin(frame_seq)
    with torch.inference_mode():
        ids = back.take(front.prefill(inputs))
        while not back.result.ended:
            ids = back.take(front.step(ids))
        steps = back.placed_steps()
        for i, ids in enumerate(steps):
            back.take_placed(front.step(ids, placed=True), last=i == len(steps) - 1)
    return back.result
