"""Live rebalancing of the split layer K from measured stage times: ``split_layer: auto`` with ``auto_rebalance``.

The plan (:mod:`.planner`) chooses K once from a quiet-machine profile; on a vehicle the load beside each stage
changes, and with it the latency-best K. :class:`LatencyBalancer` keeps the plan's per-K shape and rescales it
by the load factors ``a_p = P / P_plan(K)`` and ``a_s = S / S_plan(K)`` measured at the current K
(:class:`StageSample`: prefix cycle P, suffix stage time S and cycle, camera period T). The predicted latency is

    e2e(K') = age + P'(K') + h(K') + S'(K') + o + wait(K'),   P' = a_p P_plan, S' = a_s S_plan,
    age = T / 2 when P' > T (a busy prefix starts on a camera frame half a period old), else 0,
    wait(K') = max(P', T) / 2 when S'(K') + o > max(P', T) and the prefix does not pace itself, else 0

with ``o`` the suffix's cycle minus its stage time (publishing, odometry; the same at every K). ``wait`` is the
average age of the newest frame a slower suffix takes (``ring.delivery: newest``); ``pace_to_suffix`` removes it.
The balancer moves K towards the best K' the GPU budget allows, with hysteresis:

* it judges only samples measured at the current K on both sides (``settle`` frames after a move), using the median
  of the last ``window``;
* the best K must beat the current one by ``min_gain_rel`` and ``min_gain_ms`` on ``confirm`` frames in a row; K then
  moves straight to it (``max_step`` 0) or by at most ``max_step`` blocks. Moving one block at a time would cost
  about 5 frames per block in a load step (docs/performance.md, "Load step");
* the first judgement after a move checks it against what was measured: K goes straight back, and no latency move
  that way is made for ``hold`` judged frames (doubling per further such move, up to 32 x; ended early when the load
  factor of the side such a move takes blocks from rises by :data:`HOLD_RELEASE` at the K it held), when the
  latency is
  slower than before the move by the same margin *and* the side that took the blocks measured slower than predicted
  for it by more than the gain the move was predicted to bring (:class:`MoveCheck`). A load that changed on the
  other side at the same time (a co-tenant arriving as K moves away from it, or the memory bus it shares) is not
  the move's fault: comparing latencies alone sent such a move back to the K the load had just made slow;
* a move back towards the K the last move left needs that K itself predicted faster by the margin (no ping-pong);
* a side whose planned time at the current K is under :data:`TRUST_SHARE` of the stage sum keeps its last trusted
  load factor.

:class:`SplitPolicy` adds memory pressure on a CUDA prefix (:class:`~.planner.AutoResplitPolicy`), which sets the
highest K allowed and wins over latency. Pure: no ROS, no device call.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from .planner import AutoResplitPolicy, Plan


#: Minimum share of the stage sum a side's planned time at the current K needs for its load factor to be trusted.
TRUST_SHARE = 0.1
#: A hold on moves one way (after such a move measured slower) ends early when the load factor of the side those
#: moves take blocks from rises this much over its value when the failed move was decided, measured at that same K
#: (factors of different Ks differ by the plan's shape error, up to 30 % on an AVX2 host): a co-tenant arrived,
#: which the failed move was not judged under (the bench's load step on an AVX2 host, 2026-12-07: a quiet move up
#: measured slower, and the hold then kept K down through a co-tenant on the suffix's core).
HOLD_RELEASE = 1.3


@dataclass(frozen=True)
class StageSample:
    """One frame's measured times as the prefix sees them after publishing it (ms).

    ``k``: the K the suffix's time was measured at (-1: unknown); ``prefix_ms``: start to publish of the newest
    frame; ``suffix_ms``: median stage time (blocks [K, L) and read-out); ``suffix_cycle_ms``: take to next ask;
    ``camera_period_ms``: None when unknown (cameras taken as faster than both stages). None: not announced."""

    k: int
    prefix_ms: float
    suffix_ms: float | None
    suffix_cycle_ms: float | None = None
    camera_period_ms: float | None = None


@dataclass(frozen=True)
class Move:
    """A decision of the policy: move to ``k`` (None: stay), why, and its ``kind`` (``latency`` or ``memory``)."""

    k: int | None
    reason: str
    kind: str = "latency"


@dataclass(frozen=True)
class MoveCheck:
    """What a latency move expected, judged on the first frames measured after it.

    ``k_left`` / ``latency_ms``: the K left and the latency measured there; ``side``: ``"prefix"`` (K moved up: the
    prefix took blocks) or ``"suffix"``; ``side_ms``: that side's time predicted at the new K (ms, the load factor of
    the move's judgement); ``gain_ms``: the latency the move was predicted to save (ms); ``giver_load``: the load
    factor of the side that gave the blocks, measured at ``k_left`` (the load the move was decided under)."""

    k_left: int
    latency_ms: float
    side: str
    side_ms: float
    gain_ms: float
    giver_load: float


@dataclass(frozen=True)
class StageTimes:
    """Quiet-machine times (ms) at one K: prefix (to block K-1), hand-off, suffix (blocks K..L-1 and read-out)."""

    prefix_ms: float
    handoff_ms: float
    suffix_ms: float


@dataclass
class LatencyBalancer:
    """Moves K towards the lowest predicted latency at the measured load (model and rules: module docstring).

    ``times``: :class:`StageTimes` of every K in [0, L]. Raises ValueError for fewer than two entries, a negative
    time or a parameter out of range."""

    times: list[StageTimes]
    window: int = 2
    confirm: int = 2
    settle: int = 2
    min_gain_rel: float = 0.05
    min_gain_ms: float = 2.0
    paced: bool = True
    max_step: int = 0
    hold: int = 10
    _samples: list[StageSample] = field(default_factory=list, repr=False)
    _votes: int = field(default=0, repr=False)
    _came_from: int | None = field(default=None, repr=False)  # the K the last move left
    _vote_k: int | None = field(default=None, repr=False)
    _settling: int = field(default=0, repr=False)
    _check: MoveCheck | None = field(default=None, repr=False)  # the last latency move, judged once
    _holds: dict[int, int] = field(default_factory=lambda: {1: 0, -1: 0}, repr=False)  # judged frames left, per way
    _a: tuple[float, float] = field(default=(1.0, 1.0), repr=False)  # the last trusted load factors (a_p, a_s)
    _hold_next: int = field(default=-1, repr=False)  # the hold after the next slower move (doubles, see observe)
    #: per way, the load factor of the side that would give blocks that way (up: the suffix's) when the hold began
    #: per way, (K, factor): the load factor of the side a move that way takes blocks from, as the failed move was
    #: decided at that K (compared only with factors measured at the same K: the plan's shape error differs by K)
    _hold_load: dict[int, tuple[int, float] | None] = field(default_factory=lambda: {1: None, -1: None}, repr=False)

    @classmethod
    def from_plan(cls, plan: Plan, **kwargs) -> "LatencyBalancer":
        """The balancer of a plan's per-K times; ValueError when the plan has none (made without a profile)."""
        if any(r.prefix_ms is None or r.suffix_ms is None for r in plan.rows):
            raise ValueError("live rebalancing needs the plan's per-K stage times: give the prefix a profile "
                             "(profile_path, from `hybrid-vla profile`)")
        return cls([StageTimes(r.prefix_ms, r.handoff_ms or 0.0, r.suffix_ms) for r in plan.rows], **kwargs)

    @property
    def num_layers(self) -> int:
        """L: the largest split layer."""
        return len(self.times) - 1

    def __post_init__(self):
        if len(self.times) < 2 or any(min(t.prefix_ms, t.handoff_ms, t.suffix_ms) < 0 for t in self.times):
            raise ValueError(f"times must give every K in [0, L] (L >= 1) non-negative times, got {self.times}")
        if self.window < 1 or self.confirm < 1 or self.settle < 0:
            raise ValueError(f"window and confirm must be >= 1 and settle >= 0, got {self.window}, {self.confirm}, "
                             f"{self.settle}")
        if not 0 <= self.min_gain_rel < 1 or self.min_gain_ms < 0:
            raise ValueError(f"min_gain_rel must be in [0, 1) and min_gain_ms >= 0, got {self.min_gain_rel}, "
                             f"{self.min_gain_ms}")
        if self.max_step < 0 or self.hold < 0:
            raise ValueError(f"max_step and hold must be >= 0, got {self.max_step}, {self.hold}")
        self._hold_next = self.hold

    def moved(self) -> None:
        """Forget what was measured: K just moved (a memory move is not checked against the latency before it)."""
        self._samples.clear()
        self._votes, self._vote_k = 0, None
        self._settling = self.settle
        self._check = None

    def predict(self, k: int, a_p: float, a_s: float, camera_period_ms: float | None,
                overhead_ms: float = 0.0) -> float:
        """Predicted camera-to-trajectory latency (ms) at ``k``; ``overhead_ms`` is ``o`` of the module docstring."""
        row = self.times[k]
        return self._latency(a_p * row.prefix_ms, row.handoff_ms, a_s * row.suffix_ms, camera_period_ms, overhead_ms)

    def _latency(self, p: float, h: float, s: float, camera_period_ms: float | None, overhead_ms: float) -> float:
        """The latency model of stage times p, h, s (ms)."""
        period = max(camera_period_ms or 0.0, 0.0)
        cycle_p = max(p, period)
        age = period / 2 if p > period else 0.0  # a busy prefix starts on a camera frame half a period old
        wait = cycle_p / 2 if not self.paced and s + overhead_ms > cycle_p else 0.0
        return age + p + h + s + overhead_ms + wait

    def observe(self, sample: StageSample, current_k: int, k_max: int) -> Move:
        """Take one frame's sample; the :class:`Move` it leads to, within ``k_max`` (the highest K allowed now).

        Samples of another K, without a suffix time or with a time that is not a positive finite number are left out;
        a move that paid resets the hold to ``hold``.
        Raises ValueError for ``current_k`` outside [0, L] or ``k_max`` < 0."""
        if not 0 <= current_k <= self.num_layers or k_max < 0:
            raise ValueError(f"current_k must be in [0, {self.num_layers}] and k_max >= 0, got {current_k}, {k_max}")
        if sample.k != current_k or sample.suffix_ms is None or not (0 < sample.prefix_ms < math.inf) \
                or not (0 < sample.suffix_ms < math.inf):  # NaN fails both comparisons
            return Move(None, "waiting for frames measured at the current K on both sides")
        if self._settling > 0:
            self._settling -= 1
            return Move(None, "settling after a move")
        self._samples.append(sample)
        del self._samples[:-self.window]
        if len(self._samples) < self.window:
            return Move(None, f"measuring ({len(self._samples)}/{self.window} frames)")
        row = self.times[current_k]
        p = statistics.median(s.prefix_ms for s in self._samples)
        s = statistics.median(s.suffix_ms for s in self._samples)
        periods = [x.camera_period_ms for x in self._samples if x.camera_period_ms]
        period = statistics.median(periods) if periods else None
        cycles = [x.suffix_cycle_ms - x.suffix_ms for x in self._samples if x.suffix_cycle_ms]
        overhead = max(0.0, statistics.median(cycles)) if cycles else 0.0
        # a near-zero plan time (the suffix at K = L: the read-out alone) gave factors of x250: keep the last trusted
        m_p = p / row.prefix_ms if row.prefix_ms > 0 else 1.0
        m_s = s / row.suffix_ms if row.suffix_ms > 0 else 1.0
        total = row.prefix_ms + row.suffix_ms
        self._a = (m_p if row.prefix_ms >= TRUST_SHARE * total else self._a[0],
                   m_s if row.suffix_ms >= TRUST_SHARE * total else self._a[1])
        a_p, a_s = self._a
        predicted = [self.predict(k, a_p, a_s, period, overhead) for k in range(self.num_layers + 1)]
        predicted[current_k] = now = self._latency(p, row.handoff_ms, s, period, overhead)  # as measured
        best_all = min(range(len(predicted)), key=predicted.__getitem__)
        best = min(range(min(k_max, self.num_layers) + 1), key=predicted.__getitem__)
        where = (f"prefix {p:.0f} ms (x{a_p:.2f} of the plan), suffix {s:.0f} ms (x{a_s:.2f}), predicted "
                 f"{now:.0f} ms at K={current_k}")
        if self._check is not None:  # the first judgement after a latency move: did it pay, as measured?
            check = self._check
            k_left, before = check.k_left, check.latency_ms
            self._check = None
            side_error = (p if check.side == "prefix" else s) - check.side_ms
            if k_left <= k_max and now > before + max(self.min_gain_rel * before, self.min_gain_ms) \
                    and side_error > check.gain_ms:
                self.moved()
                way = 1 if current_k > k_left else -1
                self._came_from, self._holds[way] = current_k, self._hold_next
                self._hold_load[way] = (k_left, check.giver_load)
                self._hold_next = min(2 * self._hold_next, 32 * self.hold)  # the model stays wrong: try less often
                return Move(k_left, f"{where}; measured slower than the {before:.0f} ms at K={k_left} before the "
                                    f"move, the {check.side} {side_error:.0f} ms over its prediction (the move was "
                                    f"to save {check.gain_ms:.0f} ms): back to K={k_left}, no latency move "
                                    f"{'up' if way > 0 else 'down'} for {self._holds[way]} frames")
            if k_left <= k_max:
                self._hold_next = self.hold  # it paid (a K left above the budget now is not judged)
        released = ""
        for way in self._holds:
            self._holds[way] = max(0, self._holds[way] - 1)
            giver = a_s if way > 0 else a_p  # the side a move that way takes blocks from
            if not self._holds[way] or self._hold_load[way] is None:
                continue
            k_held, base = self._hold_load[way]
            if k_held == current_k and giver > HOLD_RELEASE * base:  # a new load at the same K: the hold is stale
                self._holds[way] = 0
                released = (f"; the {'suffix' if way > 0 else 'prefix'} load rose x{giver / base:.2f} at K={k_held} "
                            f"since a move {'up' if way > 0 else 'down'} measured slower: that hold ended")
        where += released
        gain = now - predicted[best]
        if best == current_k or gain <= 0 or gain < max(self.min_gain_rel * now, self.min_gain_ms):
            self._votes, self._vote_k = 0, None
            held = best_all > k_max and best_all > current_k
            return Move(None, f"{where}; " + (f"the GPU budget holds K at {k_max} (K={best_all} would be faster)"
                                              if held else "balanced"))
        step = best - current_k
        if self.max_step:
            step = max(-self.max_step, min(self.max_step, step))
        k_new = current_k + step
        left = self._holds[1 if step > 0 else -1]
        if left > 0:  # the way a move measured slower: not yet
            self._votes, self._vote_k = 0, None
            return Move(None, f"{where}; holding after a move that measured slower ({left} frames left)")
        back = self._came_from
        if back is not None and (k_new - current_k) * (back - current_k) > 0 and \
                predicted[back] > now - max(self.min_gain_rel * now, self.min_gain_ms):
            # the far best K can flip sides with the measurement (e.g. across the camera period's step)
            self._votes, self._vote_k = 0, None
            return Move(None, f"{where}; holding: back to K={back} is predicted {predicted[back]:.0f} ms")
        self._votes = self._votes + 1 if self._vote_k == k_new else 1
        self._vote_k = k_new
        goal = f"K={best} predicted {predicted[best]:.0f} ms"
        if self._votes < self.confirm:
            return Move(None, f"{where}; {goal} ({self._votes}/{self.confirm})")
        self.moved()
        side = "prefix" if k_new > current_k else "suffix"
        row_new = self.times[k_new]
        self._came_from = current_k
        self._check = MoveCheck(current_k, now, side, a_p * row_new.prefix_ms if side == "prefix"
                                else a_s * row_new.suffix_ms, now - predicted[k_new],
                                a_s if side == "prefix" else a_p)
        return Move(k_new, f"{where}; towards {goal}")


@dataclass
class SplitPolicy:
    """The one policy of ``split_layer: auto``: memory pressure (CUDA) and measured latency.

    ``plan`` None: a latency balancer alone over every K; ``memory`` / ``latency`` None: that part is off.
    ``k_max``: the highest K allowed now (the budget's, lowered by a memory move down). Raises ValueError for a
    memory part without a plan.
    """

    plan: Plan | None
    memory: AutoResplitPolicy | None = None
    latency: LatencyBalancer | None = None
    k_max: int = -1
    last: Move = field(default_factory=lambda: Move(None, ""))

    def __post_init__(self):
        if self.plan is None and self.memory is not None:
            raise ValueError("the memory part of the policy needs the plan's bytes per K")
        if self.k_max < 0 and self.plan is None:  # per-K times alone (the bench): every K
            self.k_max = self.latency.num_layers if self.latency is not None else 0
        elif self.k_max < 0:
            fitting = [r.k for r in self.plan.rows if r.fits]
            self.k_max = max(fitting) if fitting else self.plan.chosen_k

    def on_memory(self, current_k: int, free_bytes: int) -> Move:
        """A reading of free device memory (bytes). A move down sets ``k_max`` and wins; on recovery ``k_max`` rises
        to every K leaving the recover threshold free, and without a balancer K moves back up (at most to the plan's
        K). Raises ValueError when no K fits."""
        if self.memory is None:
            return Move(None, "", "memory")
        k, reason = self.memory.decide(current_k, free_bytes)
        if k is None or k >= current_k:  # no pressure: every K of the budget that leaves the recover threshold free
            need = self.plan.row(current_k).gpu_total_bytes
            room = [r.k for r in self.plan.rows
                    if r.fits and free_bytes - (r.gpu_total_bytes - need) >= self.memory.high_bytes]
            self.k_max = max([self.k_max, current_k, *room] + ([k] if k is not None else []))
        if k is None:
            return Move(None, reason, "memory")
        if k < current_k:
            self.k_max = k  # the K the memory policy moved down to; it rises again when memory recovers
        elif self.latency is not None:  # recovered: the balancer moves up when it is faster, within the room
            self.last = Move(None, f"{reason}: K may move up to {self.k_max}", "memory")
            return self.last
        if self.latency is not None:
            self.latency.moved()
        self.last = Move(k, reason, "memory")
        return self.last

    def on_frame(self, sample: StageSample, current_k: int) -> Move:
        """One frame's measured stage times: a latency move within ``k_max``; never one without a balancer."""
        if self.latency is None:
            return Move(None, "", "latency")
        if current_k > self.k_max:  # a memory move down is pending: nothing to judge until it is applied
            return Move(None, f"waiting for the move down to K <= {self.k_max}")
        self.last = self.latency.observe(sample, current_k, self.k_max)
        return self.last
