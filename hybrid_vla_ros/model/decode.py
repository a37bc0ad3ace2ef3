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

import torch
from torch import nn

#: Why a frame's decode ended.
STOP_TOKEN, MAX_TOKENS = "stop_token", "max_new_tokens"


@dataclass(frozen=True)
class DecodeSettings:
    """How a frame decodes: at most ``max_new_tokens`` tokens, ending early at any of ``stop_token_ids`` (kept as the
    last token); ``temperature`` 0 is greedy, else sampling with ``top_p`` and ``seed`` (+ the frame's seq). Raises
    ValueError for values out of range."""

    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


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
    ``lm_head.weight``, or ``embed_tokens.weight`` when tied (``tied``; None: as the config says); Gemma's
    ``final_logit_softcapping`` (``tanh(logits / cap) * cap``) as ``Gemma2ForCausalLM.forward``."""

    def __init__(self, config, tied: bool | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.tied = bool(getattr(config, "tie_word_embeddings", False)) if tied is None else bool(tied)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def checkpoint_key(self, local_key: str) -> str:
        return "embed_tokens.weight" if self.tied else "lm_head.weight"

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(rows, self.weight)
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
    (the prefill's last row first), ``ended`` (:data:`STOP_TOKEN` or :data:`MAX_TOKENS`; "" while it goes on)."""

    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    ended: str = ""


class PrefixDecoding:
    """The prefix side of a frame's decode: the prefill and each step's embedding + blocks [0, K) against the
    prefix's KV cache ``cache`` (:class:`SideCache`), through the model's
    :class:`~hybrid_vla_ros.model.kinds.SplitModel` ``sm``. What each returns is what crosses the split."""

    def __init__(self, sm, stage, cache: SideCache):
        self.sm, self.stage, self.cache = sm, stage, cache
        self._prefill = None
        self.position = 0  # the sequence position of the next token

    def prefill(self, inputs: tuple):
        """Reset the cache and run the frame's prefill (the prefix's output: h_K, or a SplitState)."""
        self.cache.reset()
        self._prefill = out = self.sm.run_prefix(self.stage, inputs, cache=self.cache.cache)
        self.position = int(self.sm.hidden(out).shape[-2])
        return out

    def step(self, tokens) -> object:
        """The chosen ``tokens`` (a sequence of ids) through embedding + blocks [0, K) at the next positions.
        Raises ValueError when the cache has no room left."""
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        self.cache.room_for(ids.numel())
        out = self.sm.prefix_step(self.stage, ids, self._prefill, self.cache.cache, self.position)
        self.position += ids.numel()
        return out


class SuffixDecoding:
    """The suffix side of a frame's decode: blocks [K, L) and the final norm against the suffix's KV cache
    ``cache``, the LM head ``head`` on the last row, and the choice of the next token (:class:`TokenChooser`)."""

    def __init__(self, sm, stage, head: LMHead, cache: SideCache, settings: DecodeSettings):
        self.sm, self.stage, self.head, self.cache, self.settings = sm, stage, head, cache, settings
        self.chooser = TokenChooser(settings)
        self.result = DecodeResult()

    def begin(self, frame_seq: int = 0) -> None:
        """A new frame: an empty cache and result, the draws seeded for ``frame_seq``."""
        self.cache.reset()
        self.chooser.start(frame_seq)
        self.result = DecodeResult()

    def take(self, out) -> int:
        """The prefill's or a step's output (what crossed) -> the next token, appended to ``result`` (whose
        ``ended`` says whether it was the last). Raises ValueError when the cache has no room left."""
        self.cache.room_for(self.sm.hidden(out).shape[-2])
        final = self.sm.suffix_rows(self.stage, out, self.cache.cache)
        logits = self.head(final[..., -1:, :]).reshape(-1)
        token = self.chooser.choose(logits)
        r = self.result
        r.tokens.append(token)
        r.logits.append(logits)
        if token in self.settings.stop_token_ids:
            r.ended = STOP_TOKEN
        elif len(r.tokens) >= self.settings.max_new_tokens:
            r.ended = MAX_TOKENS
        return token


def decode_in_process(sm, prefix, suffix, head: LMHead, prefix_cache: SideCache, suffix_cache: SideCache,
                      inputs: tuple, settings: DecodeSettings, frame_seq: int = 0) -> DecodeResult:
    """Decode one frame with both sides in this process (what crosses handed over directly; the reference the
    ring's decode is checked against). Returns a :class:`DecodeResult`."""
    front = PrefixDecoding(sm, prefix, prefix_cache)
    back = SuffixDecoding(sm, suffix, head, suffix_cache, settings)
    back.begin(frame_seq)
    with torch.inference_mode():
        token = back.take(front.prefill(inputs))
        while not back.result.ended:
            token = back.take(front.step([token]))
    return back.result
