"""What a checkpoint's decode is: how many tokens, how they are chosen, and what the decoded tokens drive.

A driving checkpoint composed on a transformers VLM decodes every frame when its ``config.json`` has a ``decode``
mapping (:class:`DecodeSpec`; docs/models.md "Decoding"). Its keys:

- ``max_new_tokens``: tokens decoded at most per frame (int >= 1, default 16);
- ``stop_token_ids``: ids that end the decode early (kept as its last token); empty: always ``max_new_tokens``;
- ``temperature``: 0 (default) greedy; > 0 sampling with ``top_p`` (nucleus mass in (0, 1], default 1) and ``seed``
  (default 0, plus the frame's sequence number);
- ``drives``: what gives the trajectory: ``head`` (default; the planning head at read-out tokens placed after the
  decode), ``text_waypoints`` (waypoints written in the decoded text) or ``action_codebook``;
- ``turns``: token-id lists, each placed after a decode that ended (its stop token or ``max_new_tokens``) and followed
  by another decode of up to ``max_new_tokens``: a conversation's next questions (ORION's critical-QA turns, each
  answered before the next is asked); empty (default): one decode per frame;
- ``after_token_ids`` (``head``): token ids placed after the (last) decode, before the read-out tokens (ORION's
  planning prompt after its answers);
- ``text`` (``text_waypoints``): the grammar (:class:`TextWaypoints`; its defaults when left out);
- ``codebook`` (``action_codebook``): AutoVLA's shape, action tokens each a short motion from a codebook file shipped
  with the checkpoint (:class:`ActionCodebook`; its defaults when left out).

Pure Python (no torch), so a config can be checked where torch is not imported.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: ``decode.drives`` values.
DRIVES_HEAD, DRIVES_TEXT, DRIVES_CODEBOOK = "head", "text_waypoints", "action_codebook"
DRIVES = (DRIVES_HEAD, DRIVES_TEXT, DRIVES_CODEBOOK)
#: ``decode.text.axes`` values: base_link (x forward, y left) or the published planners' frame (x right, y forward).
AXES = ("x_forward_y_left", "x_right_y_forward")


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
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))


@dataclass(frozen=True)
class TextWaypoints:
    """The grammar of waypoints written in decoded text (Impromptu-VLA's, OpenEMMA's shape): every match of
    ``pair`` (a regular expression with two groups: x, y) after the first ``start`` marker ("" : from the start of
    the text), in order, is one waypoint ``waypoint_dt_s`` after the previous. ``axes``: :data:`AXES` (the frame
    of the numbers; the published frame is turned to base_link); ``scale``: metres per written unit (1 for metres).
    Raises ValueError for an invalid grammar."""

    pair: str = r"\(\s*([-+]?\d+(?:\.\d+)?)\s*,\s*([-+]?\d+(?:\.\d+)?)\s*\)"
    start: str = ""
    axes: str = AXES[0]
    scale: float = 1.0

    def __post_init__(self):
        try:
            groups = re.compile(self.pair).groups
        except (re.error, TypeError) as e:
            raise ValueError(f"decode.text.pair is not a regular expression: {e}") from None
        if groups != 2:
            raise ValueError(f"decode.text.pair must have two groups (x, y), it has {groups}")
        if not isinstance(self.start, str):
            raise ValueError(f"decode.text.start must be a string, got {self.start!r}")
        if self.axes not in AXES:
            raise ValueError(f"decode.text.axes must be one of {', '.join(AXES)}, got {self.axes!r}")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not self.scale > 0:
            raise ValueError(f"decode.text.scale must be a number > 0, got {self.scale!r}")

    def parse(self, text: str, n_waypoints: int) -> list[tuple[float, float]]:
        """``text`` -> ``n_waypoints`` (x forward, y left) points in metres, base_link axes. Raises ValueError
        (:class:`UnparseableWaypoints`) when the text holds another count of pairs or a number that is not
        finite."""
        body = text
        if self.start:
            at = text.find(self.start)
            if at < 0:
                raise UnparseableWaypoints(f"no {self.start!r} in the decoded text")
            body = text[at + len(self.start):]
        points = []
        for m in re.finditer(self.pair, body):
            try:
                x, y = float(m.group(1)) * self.scale, float(m.group(2)) * self.scale
            except (TypeError, ValueError):
                raise UnparseableWaypoints(f"a waypoint is not two numbers: {m.group(0)!r}") from None
            if not (math.isfinite(x) and math.isfinite(y)):
                raise UnparseableWaypoints(f"a waypoint is not finite: {m.group(0)!r}")
            points.append((x, y) if self.axes == AXES[0] else (y, -x))
        if len(points) != n_waypoints:
            raise UnparseableWaypoints(f"the decoded text holds {len(points)} waypoint(s), the model declares "
                                       f"{n_waypoints}")
        return points


class UnparseableWaypoints(ValueError):
    """Decoded text that does not hold the waypoints its grammar declares (a counted drop, never a trajectory)."""


@dataclass(frozen=True)
class ActionCodebook:
    """Action tokens to waypoints (AutoVLA's action tokenizer, facts of its published ``ActionTokenizer``): token id
    ``first_token_id + i`` is action ``i`` of ``file`` (a ``.npy`` beside config.json, read without pickle), an array
    (A, S, 4, 2): per action the ego box's 4 corners (x, y, metres, in the frame of the pose where the action starts:
    x forward, y left) at each of its S sub-steps. The decode's action tokens, in order, are rolled out from the
    origin: each one's corners are placed at the current pose; the next position is the mean of the last sub-step's
    corners, the next heading the direction from corner 3 to corner 0 there. Each action gives one waypoint; other
    tokens (reasoning, the stop token) are not actions. Raises ValueError for an invalid mapping."""

    file: str = "codebook.npy"
    first_token_id: int = 0

    def __post_init__(self):
        if not isinstance(self.file, str) or not self.file.endswith(".npy") or "/" in self.file or "\\" in self.file:
            raise ValueError(f"decode.codebook.file must be a .npy file name beside config.json, got {self.file!r}")
        if isinstance(self.first_token_id, bool) or not isinstance(self.first_token_id, int) \
                or self.first_token_id < 0:
            raise ValueError(f"decode.codebook.first_token_id must be a token id, got {self.first_token_id!r}")

    def load(self, checkpoint_dir) -> "object":
        """The codebook (A, S, 4, 2) float64 from the checkpoint directory. Raises ValueError (missing, another
        shape, not finite)."""
        from pathlib import Path

        import numpy as np

        path = Path(checkpoint_dir) / self.file
        try:
            book = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - numpy raises OSError, ValueError, EOFError, ... for a bad file
            why = "an object array (pickled data), which is never loaded" if "pickle" in str(e) else str(e) or \
                type(e).__name__
            raise ValueError(f"the action codebook {path} does not load as a .npy array: {why}") from None
        if not isinstance(book, np.ndarray) or book.dtype.kind not in "fiu":
            raise ValueError(f"the action codebook {path} holds {getattr(book, 'dtype', type(book))}, not real "
                             "numbers")
        if book.ndim != 4 or book.shape[2:] != (4, 2) or min(book.shape[:2]) < 1 or not np.isfinite(book).all():
            raise ValueError(f"the action codebook {path} is {book.shape}, not (actions >= 1, sub-steps >= 1, 4, 2) "
                             "of finite corner positions")
        return book.astype(np.float64)

    def waypoints(self, book, tokens: list[int], n_waypoints: int) -> list[tuple[float, float]]:
        """The decoded ``tokens``' actions rolled out (class docstring) -> ``n_waypoints`` (x, y) m, base_link axes.
        Raises :class:`UnparseableWaypoints` when the decode holds another number of action tokens."""
        import numpy as np

        actions = [t - self.first_token_id for t in tokens if 0 <= t - self.first_token_id < len(book)]
        if len(actions) != n_waypoints:
            raise UnparseableWaypoints(f"the decode holds {len(actions)} action token(s), the model declares "
                                       f"{n_waypoints}")
        pos, heading, points = np.zeros(2), 0.0, []
        for a in actions:
            c, s = np.cos(heading), np.sin(heading)
            corners = book[a, -1] @ np.array([[c, s], [-s, c]]) + pos  # the last sub-step, placed at the pose
            pos = corners.mean(axis=0)
            dx, dy = corners[0] - corners[3]
            heading = float(np.arctan2(dy, dx))
            points.append((float(pos[0]), float(pos[1])))
        return points


@dataclass(frozen=True)
class DecodeSpec:
    """A checkpoint's ``decode`` mapping (the module docstring's table): ``settings`` (:class:`DecodeSettings`),
    ``drives`` (:data:`DRIVES`), ``after_token_ids``, ``text`` (:class:`TextWaypoints` or None), ``codebook``
    (:class:`ActionCodebook` or None) and ``turns`` (token-id tuples placed between decodes)."""

    settings: DecodeSettings
    drives: str = DRIVES_HEAD
    after_token_ids: tuple[int, ...] = ()
    text: TextWaypoints | None = None
    codebook: ActionCodebook | None = None
    turns: tuple[tuple[int, ...], ...] = ()

    KEYS = ("max_new_tokens", "stop_token_ids", "temperature", "top_p", "seed", "drives", "after_token_ids", "text",
            "codebook", "turns")

    @property
    def decodes_per_frame(self) -> int:
        """Decodes a frame runs: one, and one more after each turn."""
        return 1 + len(self.turns)

    @property
    def turn_tokens(self) -> int:
        """Tokens of every turn together."""
        return sum(len(t) for t in self.turns)

    @classmethod
    def from_dict(cls, d: dict, vocab_size: int) -> "DecodeSpec":
        """Parse a ``decode`` mapping; token ids must lie in [0, ``vocab_size``). Raises ValueError naming what is
        wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"decode must be a mapping, got {d!r}")
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"unknown decode key(s) {unknown}; known: {', '.join(cls.KEYS)}")
        settings = DecodeSettings(**{k: d[k] for k in ("max_new_tokens", "stop_token_ids", "temperature", "top_p",
                                                       "seed") if k in d})
        drives = d.get("drives", DRIVES_HEAD)
        if drives not in DRIVES:
            raise ValueError(f"decode.drives must be one of {', '.join(DRIVES)}, got {drives!r}")
        after = d.get("after_token_ids", [])
        if not isinstance(after, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in after):
            raise ValueError(f"decode.after_token_ids must be a list of token ids, got {after!r}")
        turns = d.get("turns", [])
        if not isinstance(turns, (list, tuple)) or not all(
                isinstance(turn, (list, tuple)) and turn and all(isinstance(t, int) and not isinstance(t, bool)
                                                                 for t in turn) for turn in turns):
            raise ValueError(f"decode.turns must be a list of non-empty token-id lists, got {turns!r}")
        bad = [t for t in list(after) + list(settings.stop_token_ids) + [t for turn in turns for t in turn]
               if not 0 <= t < int(vocab_size)]
        if bad:
            raise ValueError(f"decode token id(s) {bad} outside the vocabulary of {vocab_size}")
        if after and drives != DRIVES_HEAD:
            raise ValueError("decode.after_token_ids are placed before a planning head's read-out (drives: head)")
        text = d.get("text")
        if text is None and drives == DRIVES_TEXT:  # the default grammar unless given
            text = {}
        if text is not None and drives != DRIVES_TEXT:
            raise ValueError("decode.text (the waypoint grammar) goes with drives: text_waypoints, and only there")
        if text is not None:
            if not isinstance(text, dict) or set(text) - {"pair", "start", "axes", "scale"}:
                raise ValueError("decode.text must be a mapping of pair, start, axes, scale")
            text = TextWaypoints(**text)
        book = d.get("codebook")
        if book is None and drives == DRIVES_CODEBOOK:  # codebook.npy, ids from 0, unless given
            book = {}
        if book is not None and drives != DRIVES_CODEBOOK:
            raise ValueError("decode.codebook goes with drives: action_codebook, and only there")
        if book is not None:
            if not isinstance(book, dict) or set(book) - {"file", "first_token_id"}:
                raise ValueError("decode.codebook must be a mapping of file, first_token_id")
            book = ActionCodebook(**book)
            if book.first_token_id >= int(vocab_size):
                raise ValueError(f"decode.codebook.first_token_id {book.first_token_id} is outside the vocabulary "
                                 f"of {vocab_size}")
        return cls(settings, drives, tuple(int(t) for t in after), text, book,
                   tuple(tuple(int(t) for t in turn) for turn in turns))

    def with_tokens(self, max_new_tokens: int) -> "DecodeSpec":
        """The same spec with another ``max_new_tokens`` (a node parameter's override). Raises ValueError."""
        s = self.settings
        return DecodeSpec(DecodeSettings(max_new_tokens, s.stop_token_ids, s.temperature, s.top_p, s.seed),
                          self.drives, self.after_token_ids, self.text, self.codebook, self.turns)
