"""Is a decode across the split exact? ``verify-split --decode-tokens N``.

At every split layer K the prefix, the suffix and the LM head are loaded (each reading its own tensors), a greedy
decode of N tokens runs with a KV cache on each side (:func:`hybrid_vla_ros.model.decode.decode_in_process`), and
each token and each step's logits are compared with transformers' own ``generate`` on the unsplit model
(:meth:`~hybrid_vla_ros.model.kinds.SplitModel.decode_referee`). The referee uses transformers' static cache of the
same length as the split's caches: the attention then runs over the same keys, and the logits agree to the bit
(transformers' default dynamic cache attends over fewer, unpadded keys: 1-2 ulp of the logits apart). A K passes
when every token is the referee's and every step's logits are within ``tolerance`` (1e-5).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..model.checkpoint import open_checkpoint, parse_dtype
from ..model.decode import (DecodeSettings, SideCache, SuffixDecoding, conversation_ids, decode_in_process,
                            split_decodes)
from ..model.modeling import DEFAULT_COMMAND
from .verify import BagFrames

#: Largest allowed max abs difference of a step's logits (fp32).
LOGITS_TOLERANCE = 1e-5
#: Largest allowed max abs difference of the waypoints read after a decode (m, fp32).
WAYPOINT_TOLERANCE = 1e-5


class CannotDecode(ValueError):
    """The checkpoint has no language-model head to decode with."""


@dataclass
class DecodeRow:
    """One K: ``tokens_equal``; ``first_mismatch`` (step index, or -1); ``logits`` (max abs difference over every
    step compared); ``readout`` (a decoding driving model's waypoints after the decode against the referee's, max
    abs difference in m); ``ok``."""

    k: int
    tokens: list[int]
    tokens_equal: bool
    first_mismatch: int
    logits: float
    ok: bool = False
    readout: float | None = None  # max abs difference (m) of the planning head after the decode; None: none


@dataclass
class DecodeReport:
    model: str
    reference: str
    prompt_tokens: int
    new_tokens: int
    reference_tokens: list[int]
    dtype: str
    tolerance: float
    rows: list[DecodeRow] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    def to_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}


def verify_decode(path: str | Path, new_tokens: int, dtype: str = "fp32", *, tolerance: float = LOGITS_TOLERANCE,
                  prompt_ids: list[int] | None = None, layers: list[int] | None = None, log=None) -> DecodeReport:
    """Check a greedy decode of ``new_tokens`` tokens at every K in ``layers`` (default all) of the checkpoint at
    ``path``, on the CPU. ``prompt_ids``: the prompt (default 16 fixed ids). Raises CannotDecode for a checkpoint
    without a language-model head, ValueError for a bad count or split layer, and what ``open_checkpoint``
    raises."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"--decode-tokens must be an integer >= 1, got {new_tokens!r}")
    torch_dtype = parse_dtype(dtype)
    ck = open_checkpoint(path, prompt_ids=prompt_ids, tokens=len(prompt_ids) if prompt_ids else 16)
    ck.check_tensors()  # this package's own refusal of a bad checkpoint, before the referee's loader meets it
    sm = ck.split_model(prompt_ids)
    if not sm.decodes:
        raise CannotDecode(f"{path}: cannot decode: {sm.NO_DECODE}")
    L = ck.num_layers
    ks = list(range(L + 1)) if layers is None else sorted(set(layers))
    if not ks or any(not 0 <= k <= L for k in ks):
        raise ValueError(f"split layers {ks} outside [0, {L}] for {path}")
    say = log or (lambda _line: None)
    with torch.inference_mode():
        inputs = sm.example_inputs(BagFrames(), dtype=torch_dtype)
        prompt = int(sm.prompt_tokens(inputs))
        placed = getattr(ck.cfg, "decode_placed_token_ids", []) if sm.takes_cameras else []
        spec = getattr(ck.cfg, "decode_spec", None) if sm.takes_cameras else None
        turns = spec.turns if spec is not None else ()  # questions between decodes (ORION's QA)
        probe = DecodeSettings(max_new_tokens=new_tokens)
        bound = SuffixDecoding.bound(prompt, probe, len(placed), turns)  # generate's static length, + placed ones
        limit = getattr(sm.text_config(), "max_position_embeddings", None)
        if isinstance(limit, int) and bound + 1 > limit:
            raise ValueError(f"--decode-tokens {new_tokens}: the prompt ({prompt} tokens), "
                             f"{1 + len(turns)} decode(s) of {new_tokens} tokens, the turns and the placed tokens "
                             f"need {bound + 1} positions, the LLM has {limit} (max_position_embeddings)")
        answers = f" in each of {1 + len(turns)} answers" if turns else ""
        say(f"transformers' generate of {new_tokens} tokens{answers} on the unsplit model ...")
        ref_tokens, ref_logits, stop, name = sm.decode_referee(torch_dtype, inputs, new_tokens, cache_len=bound)
        settings = DecodeSettings(max_new_tokens=new_tokens, stop_token_ids=stop)
        report = DecodeReport(str(ck.path), name, prompt, new_tokens, ref_tokens, dtype, float(tolerance))
        head = ck.load("lm_head", dtype=torch_dtype)
        config = sm.text_config()
        if placed:
            say("transformers' forward over the prompt, those tokens and the read-out tokens placed after them ...")
            conversation = conversation_ids(split_decodes(ref_tokens, stop, new_tokens, 1 + len(turns)), turns)
            ref_modes = sm.decode_readout_referee(torch_dtype, inputs, conversation, DEFAULT_COMMAND)
        for k in ks:
            prefix, suffix = ck.load("prefix", k, dtype=torch_dtype), ck.load("suffix", k, dtype=torch_dtype)
            got = decode_in_process(sm, prefix, suffix, head, SideCache(config, bound, 0), SideCache(config, bound, k),
                                    inputs, settings, placed=placed, command=DEFAULT_COMMAND, turns=turns)
            row = _row(k, got.tokens, got.logits, ref_tokens, ref_logits, tolerance)
            if placed:
                row.readout = (got.plan.modes - ref_modes).abs().max().item()
                row.ok = row.ok and row.readout <= WAYPOINT_TOLERANCE
            report.rows.append(row)
            say(format_row(row))
    return report


def _row(k: int, tokens: list[int], logits: list, ref_tokens: list[int], ref_logits: list, tolerance: float
         ) -> DecodeRow:
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), -1)
    if first < 0 and len(tokens) != len(ref_tokens):
        first = min(len(tokens), len(ref_tokens))
    steps = len(tokens) if first < 0 else first + 1  # logits up to the first mismatch are comparable
    diff = max(((a.float() - b.float()).abs().max().item() for a, b in zip(logits[:steps], ref_logits[:steps])),
               default=0.0)
    return DecodeRow(k, tokens, first < 0, first, diff, first < 0 and diff <= tolerance)


def format_row(row: DecodeRow) -> str:
    """One line of the per-K table."""
    tokens = "equal" if row.tokens_equal else f"differ from step {row.first_mismatch}"
    readout = "" if row.readout is None else f" | {row.readout:>13.2e}"
    return f"{row.k:>4} | {tokens:>24} | {row.logits:>11.2e}{readout} | {'ok' if row.ok else 'DIFFERS'}"


def format_decode_report(report: DecodeReport) -> str:
    """The report as text: what was compared, one row per K, the verdict."""
    readout = any(r.readout is not None for r in report.rows)
    lines = [f"verify-split --decode-tokens {report.new_tokens} {report.model}",
             f"  referee:  {report.reference}",
             f"  input:    {report.prompt_tokens} prompt token ids, greedy; dtype {report.dtype}",
             f"  referee tokens: {report.reference_tokens}",
             "   K |                   tokens | max |dlogit| " + ("| waypoints (m) " if readout else "")
             + "| verdict",
             "-----+--------------------------+-------------+" + ("---------------+" if readout else "")
             + "--------"]
    lines += [format_row(r) for r in report.rows]
    bad = sum(not r.ok for r in report.rows)
    worst = max((r.logits for r in report.rows), default=0.0)
    lines.append(f"{'OK' if report.ok else 'FAILED'}: {len(report.rows) - bad} of {len(report.rows)} split layers "
                 f"decode the referee's {len(report.reference_tokens)} tokens with every step's logits within "
                 f"{report.tolerance:g} (worst {worst:.2e})"
                 + (f" and the waypoints read after the decode within {WAYPOINT_TOLERANCE:g} m (worst "
                    f"{max(r.readout for r in report.rows):.2e})" if readout else ""))
    return "\n".join(lines)
