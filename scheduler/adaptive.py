"""Adaptive draft depth: each step, choose every request's verify depth to maximise goodput.

    goodput(D) = sum_i E_i[committed tokens | depth d_i(D)] / predicted step cost(B, D)

- **Acceptance model.** Per request and draft position j, the conditional probability that
  draft j is accepted given drafts 1..j-1 were, learned online (a running mean shrunk to the
  prior over its first few judgements, then an EWMA) and starting from a prior
  shared by the requests of its acceptance group (greedy, or a band of temperatures: sampling
  hotter accepts less, so greedy rows must not set a sampled request's start). A prior is the
  shrunk mean of its group's recent observations:
  (PRIOR_WEIGHT x the starting value + hits) / (PRIOR_WEIGHT + trials), with hits and trials
  decaying at 2% per observation (a window of about 50). So a fresh engine stops believing the
  starting 0.6 after a dozen rejections, where an EWMA at that slow rate still said 0.47.
  A request's expected committed tokens at depth d are 1 + sum_k prod_{j<=k} q[j].
- **Cost model.** With the packed verify (the default for llama/qwen2/qwen3 targets) a row
  pays for its own ``1 + depth`` positions, so a step's cost is the plain step of its B rows
  (+ prefill tokens) plus the extra cost of its E = sum(depths) drafted positions, drafter
  forward included. Two kinds of measured curve on quarter-octave buckets: the plain step by
  rows, and the extra by E, one per octave of batch size (an extra position costs more in a
  large batch than next to a single row). With the padded verify (other models) E is
  B * widest depth instead. EWMA per bucket, updates clamped to a few robust deviations (one
  stall cannot flip decisions). A step's seconds are the event loop's cadence where the
  loop measured it (what the step takes from throughput: a plain step's forward overlaps
  the loop's work through the lookahead, a drafting step's does not); the forward's time
  otherwise (prefill steps, and steps after an idle loop).
- **What a drafting choice costs beyond its positions.** Three one-offs are priced at the
  choice, not learned into the curves. Entering drafting from a plain step: the plain step
  the runner launched ahead, which drafting now throws away (learned as a share of a plain
  step from the runner's timing of it, and taken off the step's charged cadence), and the
  end of the drafting run it starts: the plain step after a draft runs without a lookahead,
  and its excess over a plain step is learned per batch size (`exit_price`). The end comes
  once a run, so a start pays it over the steps runs have lasted (`run_length`, learned;
  at first 1). A step that continues a run pays neither. A parked valuation that loses only
  the lookahead it would throw away has the runner launch none (`expects_plain_next`), so the
  next step starts the run without throwing a step away. Charged to every drafting step,
  the end of a run made a run's every step look dearer than it is: SmolLM2 at c=1 drafting
  DFlash at depth 1 cost 14.5 ms more than a plain step in a run and was priced at 21.7, so
  the controller stayed plain on chat, where a fixed depth 1 read 1.12x in one run (the
  change's own effect on wall time stayed within the host's noise). And the backlog
  each DFlash row's drafter forward
  writes first (rows committed while it sat out, the prompt at its first proposal; seconds
  per row learned from catch-up steps as a ratio of decayed sums, only where a drafting step
  of that batch size was measured, so the drafter forward's own cost is not read as the
  rows'). Unpriced, single drafting steps between parked ones looked worth it at 8 rows and
  cost 30-40 ms against the 12 predicted.
- **Allocation.** Every draft position (request i, position k) has an expected gain: the
  chance that drafts 1..k of request i are all accepted. Packed, positions are taken in
  order of gain, best first, and the number E of positions with the best predicted goodput
  wins — so depth goes to the requests where it buys the most tokens per packed position,
  and a batch can give depth to one request without taxing the others. Padded, the
  candidates are one width D for everyone (capped per request), as the verify pays for the
  widest row anyway. When nothing beats plain decoding everyone decodes plainly (no
  drafter forward at all).
- **What the tokens are worth.** With requests waiting, a row that finishes early is replaced
  at once, so every committed token is worth the same and a choice is judged by its expected
  tokens per second. With none waiting the batch is all the work there is: drafting for some
  rows only makes them end first, while the batch runs on for its longest rows at nearly the
  same step cost. Then a choice is judged by the step time it saves later. With rows sorted by
  remaining tokens R (longest first), the batch still costs about F(R) = sum_k m(k) * R_k,
  where m(k) = plain(k) - plain(k-1) is what the k-th row adds to a step. A choice is worth
  F(R) - F(R - E), E being its expected committed tokens per row. A plain step is worth a
  whole plain step, and so is every row's extra token. One extra token for one of 8 rows in
  lockstep is worth only m(8), which on this CPU is next to nothing.
- **Exploration and recovery.** Until a larger E has been measured the controller tries at most
  twice the largest measured one, or one position per row if that is more (with nobody waiting,
  drafting for every row may be the only choice that pays). While parked it probes with
  exponential backoff (4, 8, ... 512 steps without drafting from a source; one backoff per source,
  so lookup drafting now and then neither resets nor blocks the re-trying of DFlash; a new request
  with a lookup match resets lookup's, since whether lookup pays depends on whether that request
  copies, and where the never-slower guard holds the batch it is told to the guard, which may
  measure drafting at once: `scheduler.guard`); a probe drafts one position for a few rows
  (those that drafted least recently), so it costs a few packed positions, not a batch-wide
  width. The backoff never goes below what keeps probing within PROBE_BUDGET (2%) of the time
  at the measured costs: a probe that costs half a plain step (a drafter forward and an
  attention group of its own, on the bundled pair at 8 rows) comes at most every 25 steps;
  one that costs a tenth of a step (SmolLM2 at 8 rows) leaves the backoff to decide. (At 3%
  the probes alone could take all of "never slower"'s allowance where nothing pays; at 1% a
  batch whose noisy acceptance estimates parked it wrongly took hundreds of steps to find
  drafting again.)
- **Draft sources.** A row may draft from DFlash or from prompt lookup (`scheduler.sources`);
  acceptance is modelled per request *and per source* (one `AcceptanceModel` each). Every
  row takes the source with the most expected tokens, and every choice is priced twice: with
  DFlash allowed (extra-cost curves of steps with a drafter forward) and without (lookup
  drafts cost no forward, only verify positions). Ties go to lookup. Each source has its own
  probe backoff, so a source that lost a request is tried again.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from scheduler.depth import request_cap
from scheduler.guard import DraftingGuard
from scheduler.plan import StepResult
from scheduler.request import Request
from scheduler.sources import DFLASH, LOOKUP, DraftOptions, may_draft

PRIOR_ACCEPTANCE = 0.6  # before anything is observed
# Lookup drafts are right far more often than chance only on copy-heavy text: a lower start.
LOOKUP_PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0  # pseudo-observations the starting acceptance counts for in the shared prior
# Pseudo-observations a request's group prior counts for in its own estimate: its first
# observations are averaged with the prior at weight 1/(n + this), until that falls to the
# EWMA's step (see `AcceptanceModel.observe`).
REQUEST_PRIOR_WEIGHT = 2.0
MIN_MARGINAL = 0.02  # a draft position is useless once its acceptance chance falls below this
PROBE_START, PROBE_MAX = 4, 512
UNPARK_MARGIN = 0.03  # predicted goodput gain needed to start drafting again once parked
PARKED_REUSE = 4  # a parked verdict serves this many steps when nothing it saw changed
PROBE_ROWS = 2  # rows a probe drafts for (packed verify; padded probes every row)
# The most of the decoding time probing may take: a source is probed at most once every
# (a probe's predicted extra over a plain step) / (PROBE_BUDGET x a plain step) steps.
PROBE_BUDGET = 0.02
CATCHUP_ALPHA = 0.2  # EWMA step of the learned seconds per drafter backlog row
DISCARD_ALPHA = 0.2  # EWMA step of a thrown-away lookahead's share of a plain step
EXIT_ALPHA = 0.2  # EWMA step of what ending a drafting run costs (`exit_price`)
RUN_ALPHA = 0.2  # EWMA step of a drafting run's length in steps (`run_length`)


GREEDY = "greedy"  # the acceptance group of T=0 requests, and of requests never enrolled


def acceptance_group(temperature: float) -> str:
    """The shared prior a request learns from and starts at. Acceptance depends on how a
    request samples: a greedy row accepts a draft when it is the argmax, a sampled one by
    p/q, and the hotter the target's distribution the less mass any one draft carries. One
    prior for all let greedy rows' high acceptance send every new T=1 request (bundled pair,
    tau 1.00) into depth-3 drafts and a prompt catch-up before its own rejections parked it."""
    if temperature == 0.0:
        return GREEDY
    if temperature <= 0.5:
        return "T<=0.5"
    return "T<=1" if temperature <= 1.0 else "T>1"


@dataclass
class SharedPrior:
    """One group's prior: the shrunk mean of its requests' recent observations (decayed
    hits and trials per position)."""

    initial: float
    prior: list[float]
    hits: list[float]
    trials: list[float]

    @classmethod
    def fresh(cls, initial: float, depth: int) -> SharedPrior:
        return cls(initial, [initial] * depth, [0.0] * depth, [0.0] * depth)

    def learn(self, position: int, hit: float, keep: float) -> None:
        self.hits[position] = self.hits[position] * keep + hit
        self.trials[position] = self.trials[position] * keep + 1.0
        self.prior[position] = (PRIOR_WEIGHT * self.initial + self.hits[position]) / (
            PRIOR_WEIGHT + self.trials[position]
        )


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance: shared priors (one per acceptance group, see
    `acceptance_group`) and per-request estimates that start at their group's prior."""

    max_depth: int
    alpha: float = 0.15  # EWMA step for per-request estimates
    prior_alpha: float = 0.02  # a shared prior's decay per observation (its memory)
    per_request: dict[str, list[float]] = field(default_factory=dict)
    observed: dict[str, list[int]] = field(default_factory=dict)  # judgements per position
    initial: float = PRIOR_ACCEPTANCE
    groups: dict[str, SharedPrior] = field(default_factory=dict)
    group_of: dict[str, str] = field(default_factory=dict)  # request id -> its group

    def _shared(self, group: str) -> SharedPrior:
        shared = self.groups.get(group)
        if shared is None:
            shared = self.groups[group] = SharedPrior.fresh(self.initial, self.max_depth)
        return shared

    @property
    def prior(self) -> list[float]:
        """The greedy group's prior (requests never enrolled learn from it too)."""
        return self._shared(GREEDY).prior

    def enroll(self, request_id: str, group: str) -> None:
        """Put a request in an acceptance group (before its first estimate)."""
        self.group_of[request_id] = group

    def estimate(self, request_id: str) -> list[float]:
        mine = self.per_request.get(request_id)
        if mine is not None:
            return mine
        return self._shared(self.group_of.get(request_id, GREEDY)).prior

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """Positions 1..accepted were accepted, accepted+1 rejected, the rest not judged.

        A request's estimate is a running mean of its judgements shrunk to its group's prior
        (weight REQUEST_PRIOR_WEIGHT) until it has seen a window's worth, then an EWMA. A
        plain EWMA from the prior kept a drafter rejected 5 times out of 5 at 0.27 (0.6 x
        0.85^5): worth a drafter forward whenever a noisy step made drafting look free."""
        shared = self._shared(self.group_of.get(request_id, GREEDY))
        mine = self.per_request.setdefault(request_id, list(shared.prior))
        seen = self.observed.setdefault(request_id, [0] * len(mine))
        judged = min(drafted, accepted + 1)
        keep = 1.0 - self.prior_alpha
        for j in range(judged):
            hit = 1.0 if j < accepted else 0.0
            seen[j] += 1
            step = max(self.alpha, 1.0 / (seen[j] + REQUEST_PRIOR_WEIGHT))
            mine[j] += step * (hit - mine[j])
            shared.learn(j, hit, keep)

    def expected_tokens(self, request_id: str, depth: int) -> float:
        q = self.estimate(request_id)
        total, chain = 1.0, 1.0
        for j in range(depth):
            chain *= q[j]
            total += chain
        return total

    def useful_depth(self, request_id: str) -> int:
        """Positions worth verifying for this request at all (marginal chance >= MIN_MARGINAL)."""
        chain, depth = 1.0, 0
        for p in self.estimate(request_id):
            chain *= p
            if chain < MIN_MARGINAL:
                break
            depth += 1
        return depth

    def forget(self, request_id: str) -> None:
        self.per_request.pop(request_id, None)
        self.observed.pop(request_id, None)
        self.group_of.pop(request_id, None)

    def priors(self) -> dict[str, list[float]]:
        return {group: [round(p, 3) for p in shared.prior]
                for group, shared in sorted(self.groups.items())}  # fmt: skip


class CostCurve:
    """Measured step seconds as a function of verify rows R, on quarter-octave buckets.

    Each bucket is an EWMA whose updates are clamped to a few robust deviations (one stall
    cannot move it far); unmeasured R are interpolated between neighbours, and extrapolated
    past the largest measured R (flat with only one bucket: optimistic, so the controller
    explores rather than guessing a steep cost) with the steeper of two slopes: the last two
    buckets', and a least-squares line's through every bucket (weighted by its samples). The
    last two alone are a few noisy positions apart: at 32 rows on the CPU (bundled pair) 57
    lookup positions read 58 ms and 64 read 45 ms, a slope of ~0, and 107 positions were then
    priced at 38 ms; they cost 158.

    `through_origin` (the extra curves: no extra position costs nothing): below the smallest
    measured R the cost is scaled down along the line through the origin, again optimistic,
    so a small draft gets tried and measured. Held flat instead, one measurement of 19
    lookup positions at 8 rows on SmolLM2 (77 ms) priced a single position at 77 ms: no
    smaller draft was ever chosen, so none was measured, and lookup never drafted at c=8 on
    editing (a position costs about 4 ms there).

    `one_sided` (the plain curve): step-time noise on a shared CPU only ever adds time (a
    stall, the copies of a join or a removal computed in that step's sync), so a bucket
    keeps the least of its first samples and then follows a drop faster than a rise. Left
    symmetric, one slow first plain step kept the plain estimate at twice its cost; every
    drafting step's extra was then read as free, and adaptive at 32 clients ran 1.5x
    longer than drafting off."""

    def __init__(self, alpha: float = 0.2, clamp: float = 3.0, one_sided: bool = False,
                 through_origin: bool = False) -> None:  # fmt: skip
        self.alpha, self.clamp, self.one_sided = alpha, clamp, one_sided
        self.through_origin = through_origin
        self.mean: dict[int, float] = {}
        self.deviation: dict[int, float] = {}
        self.count: dict[int, int] = {}
        # The measured buckets in order, and their centers (predict runs per candidate, per
        # step: it bisects these instead of sorting the buckets every call).
        self._known: list[int] = []
        self._centers: list[float] = []
        self._slope: float | None = None  # past the largest bucket; None: not yet computed

    @staticmethod
    def bucket(rows: int) -> int:
        return int(round(4 * math.log2(max(rows, 1))))

    @staticmethod
    def center(bucket: int) -> float:
        return 2 ** (bucket / 4)

    def observe(self, rows: int, seconds: float) -> None:
        self._slope = None
        b = self.bucket(rows)
        if b not in self.mean:
            self.mean[b], self.deviation[b], self.count[b] = seconds, 0.1 * seconds, 1
            self._known = sorted(self.mean)
            self._centers = [self.center(k) for k in self._known]
            return
        delta, alpha = seconds - self.mean[b], self.alpha
        if self.one_sided and delta < 0:
            alpha = 1.0 if self.count[b] < 4 else min(1.0, 2.5 * self.alpha)
        elif self.count[b] >= 4 and self.clamp != math.inf:  # (inf * 0 would be nan)
            bound = self.clamp * max(self.deviation[b], 0.02 * self.mean[b])
            delta = max(-bound, min(bound, delta))
        self.mean[b] += alpha * delta
        self.deviation[b] += self.alpha * (abs(delta) - self.deviation[b])
        self.count[b] += 1

    def predict(self, rows: int) -> float | None:
        if not self.mean:
            return None
        b = self.bucket(rows)
        if b in self.mean:
            return self.mean[b]
        known, centers, x = self._known, self._centers, float(max(rows, 1))
        above = bisect.bisect_left(centers, x)  # known[:above] lie below x, the rest above
        if 0 < above < len(known):
            lo, hi = known[above - 1], known[above]
            t = (x - centers[above - 1]) / (centers[above] - centers[above - 1])
            return self.mean[lo] + t * (self.mean[hi] - self.mean[lo])
        if above == 0:
            first = self.mean[known[0]]
            return first * x / centers[0] if self.through_origin else first
        if len(known) == 1:
            return self.mean[known[0]]
        if self._slope is None:
            self._slope = self._extrapolation_slope()
        return self.mean[known[-1]] + self._slope * (x - centers[-1])

    def _extrapolation_slope(self) -> float:
        """Seconds per row past the largest bucket (see the class docstring); 0 at least."""
        known, centers = self._known, self._centers
        last_two = (self.mean[known[-1]] - self.mean[known[-2]]) / (centers[-1] - centers[-2])
        weights = [self.count[k] for k in known]
        total = sum(weights)
        x_mean = sum(w * x for w, x in zip(weights, centers)) / total
        y_mean = sum(w * self.mean[k] for w, k in zip(weights, known)) / total
        spread = sum(w * (x - x_mean) ** 2 for w, x in zip(weights, centers))
        covariance = sum(
            w * (x - x_mean) * (self.mean[k] - y_mean) for w, x, k in zip(weights, centers, known)
        )
        fitted = covariance / spread if spread > 0 else 0.0
        return max(0.0, last_two, fitted)

    def measured(self, rows: int) -> bool:
        return self.bucket(rows) in self.mean


def _extra_grid(most: int) -> list[int]:
    """Extra-position counts to evaluate: every one up to 8, then quarter-octave steps (the
    cost curve's own resolution), and `most`."""
    grid = list(range(1, min(most, 8) + 1))
    step = 8.0
    while True:
        step *= 2**0.25
        if int(step) >= most:
            break
        if not grid or int(step) > grid[-1]:
            grid.append(int(step))
    if most > (grid[-1] if grid else 0):
        grid.append(most)
    return grid


def _batch_bucket(batch: int) -> int:
    return int(round(math.log2(max(batch, 1))))


class CostModel:
    """Step seconds = plain step of B rows (+ prefill tokens) + the extra of E drafted
    positions, with or without a drafter forward (see the module docstring)."""

    def __init__(self, packed: bool = True) -> None:
        self.packed = packed
        self.plain = CostCurve(one_sided=True)
        # (octave of batch size, drafter forward?) -> extra seconds by extra positions E
        self.extra: dict[tuple[int, bool], CostCurve] = {}
        self.samples = 0
        self.max_extra_seen = 0  # packed: extra positions; padded: widest depth

    def extra_positions(self, depths: list[int]) -> int:
        """Positions beyond one per row that the verify runs for these depths."""
        if not any(depths):
            return 0
        return sum(depths) if self.packed else len(depths) * max(depths)

    def predict_plain(self, batch: int, prefill_tokens: int = 0) -> float:
        seconds = self.plain.predict(batch + prefill_tokens)
        return seconds if seconds is not None else 1.0

    def predict_extra(self, batch: int, extra: int, drafting: bool = True) -> float:
        return self.extra_pricer(batch, drafting)(extra)

    def extra_pricer(self, batch: int, drafting: bool = True) -> Callable[[int], float]:
        """`predict_extra` for one batch size and drafter flag, its curve found once (the
        controller prices every candidate of a step with the same one)."""
        bucket = _batch_bucket(batch)
        known = [b for (b, d), c in self.extra.items() if d == drafting and c.mean]
        if known:  # this batch size's curve, else the nearest one measured
            nearest = min(known, key=lambda b: (abs(b - bucket), -b))
            curve = self.extra[(nearest, drafting)]
            return lambda extra: max(0.0, curve.predict(extra)) if extra > 0 else 0.0
        if drafting:  # unmeasured: as without the drafter (optimistic, so it gets explored)
            return self.extra_pricer(batch, False)
        # Verify positions alone, unmeasured: as that many more plain rows.
        plain = self.predict_plain(batch)

        def as_more_rows(extra: int) -> float:
            return max(0.0, self.predict_plain(batch + extra) - plain) if extra > 0 else 0.0

        return as_more_rows

    def predict(self, batch: int, depths: list[int], prefill_tokens: int = 0,
                drafting: bool = True) -> float:  # fmt: skip
        plain = self.predict_plain(batch, prefill_tokens)
        return plain + self.predict_extra(batch, self.extra_positions(depths), drafting)

    def observe(self, batch: int, verify_tokens: int, prefill_tokens: int, drafting: bool,
                seconds: float) -> None:  # fmt: skip
        """One measured step: `verify_tokens` positions ran through the target for `batch`
        rows (B when nobody drafted); `drafting`: a drafter forward ran."""
        self.samples += 1
        extra = verify_tokens - batch
        if extra <= 0:
            self.plain.observe(batch + prefill_tokens, seconds)
            return
        if prefill_tokens and not self.plain.measured(batch + prefill_tokens):
            # A prefill chunk beside drafts, and no plain step of that size measured: the
            # residual would be a guess (one such, 2 s for 19 positions at B=8 on SmolLM2,
            # closed the extra curve for good).
            return
        plain = self.predict_plain(batch, prefill_tokens)
        self.max_extra_seen = max(self.max_extra_seen, extra if self.packed else extra // batch)
        if seconds < plain and self.plain.measured(batch + prefill_tokens):
            # A step that drafted cannot cost less than a plain step of its rows: the plain
            # estimate is stale (measured while the machine was slower, and no plain step
            # since, as happens while drafting pays). Lower it; the step says nothing of the
            # extra. Read as a free extra instead, it made drafts that are almost never
            # accepted (bundled pair, 4 rows, 0.03 per draft) look worth a drafter forward.
            self.plain.observe(batch + prefill_tokens, seconds)
            return
        # Unclamped: a residual's clamp scales with its curve's mean, so a curve that first saw
        # free extras (mean ~0) could never learn a costly one (measured: 63 lookup positions
        # at B=32 read as 0.3 ms for 170 ms). A stall then overprices drafts: the safe side.
        key = (_batch_bucket(batch), drafting)
        curve = self.extra.setdefault(key, CostCurve(clamp=math.inf, through_origin=True))
        curve.observe(extra, max(0.0, seconds - plain))

    def measured_drafting(self, batch: int) -> bool:
        """Has a step with a drafter forward been measured at this batch size's octave?"""
        curve = self.extra.get((_batch_bucket(batch), True))
        return curve is not None and bool(curve.mean)

    def explore_limit(self, batch: int) -> int:
        """The most extra positions worth trying now: packed, twice the most measured and at
        least one per row (with nobody waiting, only drafting for every row may pay); padded,
        one depth beyond the widest measured (for every row)."""
        if self.packed:
            return max(batch, 2 * self.max_extra_seen)
        return batch * (self.max_extra_seen + 1)


class MakespanValue:
    """What a choice's expected tokens per row are worth in seconds of later step time
    saved (see "What the tokens are worth" in the module docstring): F(R) - F(R - E), where
    F(left) = sum over k of m(k) x the k-th largest of left.

    Valued for many choices at once (`rows`): one sort and one product over a [choices,
    rows] array. Valuing the ~40 candidates of a step one by one in Python took 1.7 ms at
    32 rows, beside the lookahead's forward on the same cores."""

    def __init__(self, order: list[str], remaining: list[float], slopes: list[float]) -> None:
        self.order = order  # the rows, in the column order of `rows`
        self.column = {rid: i for i, rid in enumerate(order)}
        self._remaining = np.asarray(remaining, dtype=np.float64)
        self._slopes = np.asarray(slopes, dtype=np.float64)
        self._now = float(self._later(self._remaining[None])[0])

    def _later(self, left: np.ndarray) -> np.ndarray:
        return -np.sort(-left, axis=1) @ self._slopes[: left.shape[1]]

    def rows(self, expected: np.ndarray) -> np.ndarray:
        """Values of choices given as expected tokens [choices, rows] in `order`."""
        return self._now - self._later(np.maximum(0.0, self._remaining - expected))

    def __call__(self, expected: dict[str, float]) -> float:
        """The value of one choice, given as expected tokens for every row."""
        return float(self.rows(np.array([[expected[rid] for rid in self.order]]))[0])


class AdaptiveDepthPolicy:
    """The goodput-maximising depth controller (see the module docstring)."""

    def __init__(self, max_depth: int = 15, warmup_steps: int = 3, packed: bool = True,
                 guard: DraftingGuard | None = None) -> None:  # fmt: skip
        self.max_depth = max_depth
        # Holds drafting off, per batch size, where it measurably loses (`scheduler.guard`).
        self.guard = guard
        self.acceptance = AcceptanceModel(max_depth)  # DFlash's
        self.lookup_acceptance = AcceptanceModel(max_depth, initial=LOOKUP_PRIOR_ACCEPTANCE)
        self.models = {DFLASH: self.acceptance, LOOKUP: self.lookup_acceptance}
        self.cost = CostModel(packed)
        self.warmup_steps = warmup_steps
        self.parked_reasons: dict[str, str] = {}
        # Probe backoff per source: lookup drafting on some steps must not keep resetting the
        # cadence at which a parked DFlash is re-tried (nor the other way round).
        self._probe_interval = {DFLASH: PROBE_START, LOOKUP: PROBE_START}
        # The sources a new request resets the backoff of (it may accept what its
        # predecessors did not): lookup's, where the request has a match; DFlash's too here.
        self.probe_on_arrival: tuple[str, ...] = (LOOKUP,)
        self._idle = {DFLASH: 0, LOOKUP: 0}  # steps since the source last drafted any row
        self._steps_parked = 0
        self._probing: str | None = None  # the source the step just chosen probes
        # Seconds a drafter forward spends per backlog row it writes (learned from catch-ups),
        # and the backlog rows the next DFlash probe would write (its rows' unwritten prompt
        # and the steps they sat out): a probe's price includes that catch-up.
        self.catchup_row_seconds = 0.0
        self._catchup_seconds = self._catchup_rows = 0.0  # decayed sums it is the ratio of
        self._probe_backlog = 0
        self._chosen_backlog = 0  # the backlog rows the step just chosen writes (DFlash rows)
        # A plain step launched ahead after the last step (the runner says): drafting now
        # throws it away, a forward's worth of work, so a drafting choice pays for it too.
        # Its price is learned as a share of a plain step (at first a whole one).
        self._lookahead_pending = False
        # A parked valuation found that drafting would win were no lookahead pending: the
        # runner is then told not to launch one (`expects_plain_next`), so the next step
        # starts its run without throwing a step away.
        self._draft_next = False
        self._parked_signature: tuple | None = None  # what the last parking valuation saw
        self._reuse_left = 0
        self.discard_share = 1.0
        self._discards_seen = 0
        self._usable: set[str] = set()  # sources some row could draft from on the last step
        self._probed_sources: set[str] = set()  # every source ever usable: they share the budget
        self._steps = 0
        self._last_drafted: dict[str, int] = {}  # request id -> step it last drafted
        self._active: set[str] = set()
        self._joined_held: set[str] = set()  # requests that joined while the guard held (told it)
        # Whether the loop measured the last step, where it drafted (the next step's cadence
        # then shows the run's end); whether it drafted is `_drafted_last`.
        self._draft_measured = False
        # What ending a drafting run costs, per batch-size octave: the excess over a plain
        # step of the plain step after a draft, which runs without a lookahead (seconds, EWMA).
        self._exit_seconds: dict[int, float] = {}
        # How many steps a drafting run lasts (EWMA over ended runs, from 1: a run priced as
        # if it ended at once), and the steps of the run going on now (0: the last step was
        # plain).
        self.run_length = 1.0
        self._run_steps = 0
        self._last_batch = 1
        self._waiting = 0  # requests queued behind the batch (the scheduler tells, each plan)
        # The last choice's valuation (None: every token worth the same), for `lookup_wanted`.
        self._value_of: MakespanValue | None = None
        self.last_choice: dict = {}  # explainability: what was chosen and why
        self.last_sources: dict[str, str] = {}

    # ----------------------------------------------------------------- DepthPolicy
    def observe_batch(self, requests: list[Request]) -> None:
        """The rows about to be planned (before `holds_drafting` is asked). Where the guard
        holds this batch size, each request new to it with a prompt-lookup match is told to
        the guard, which then may measure drafting at once (`DraftingGuard.note_copying_request`:
        a hold earned on other traffic must not park a request that copies)."""
        if not self.holds_drafting(len(requests)):
            return
        for r in requests:
            rid = r.request_id
            if rid in self._joined_held or rid in self.acceptance.group_of:
                continue  # told already, or enrolled while drafting was free
            self._joined_held.add(rid)
            if r.lookup_match and may_draft(r.params, LOOKUP):
                self.guard.note_copying_request(len(requests))

    def choose(self, requests: list[Request], max_depth: int) -> dict[str, int]:
        """Depths when DFlash is the only source (the plain `DepthPolicy` interface)."""
        options = DraftOptions((DFLASH,), 0, {DFLASH: max_depth}) if max_depth else DraftOptions(())
        depths, _ = self.choose_drafts(requests, {r.request_id: options for r in requests})
        return depths

    def choose_drafts(
        self, requests: list[Request], options: dict[str, DraftOptions]
    ) -> tuple[dict[str, int], dict[str, str]]:
        """Every row's depth and, where it drafts, its source (see the module docstring)."""
        self.parked_reasons = {}
        self._steps += 1
        self._last_batch = max(1, len(requests))
        # Read once: every path below either sets it anew or leaves it off.
        draft_next, self._draft_next = self._draft_next, False
        batch = len(requests)
        if self.holds_drafting(batch):  # before any per-row work: a held step asks nothing of rows
            self.last_sources = {}
            self.last_choice = {"width": 0, "positions": 0, "exploring": False,
                                "reason": "measured_slower"}  # fmt: skip
            self.parked_reasons = dict.fromkeys((r.request_id for r in requests), "measured_slower")
            return {r.request_id: 0 for r in requests}, {}
        arrived = []
        for r in requests:
            if r.request_id not in self.acceptance.group_of:  # new: join its group's prior
                arrived.append(r.request_id)
                group = acceptance_group(r.params.temperature)
                for model in self.models.values():
                    model.enroll(r.request_id, group)
        caps = {r.request_id: self._caps(r, options[r.request_id]) for r in requests}
        # Lookup pays for the requests that copy, whatever the ones before did: a new request
        # with a match resets lookup's backoff (earned by its predecessors), so it is tried as
        # soon as the budget floor allows, its row first (`_probe_rows`). DFlash keeps its
        # backoff: its probe pays a drafter forward and the prompt's catch-up (README, "probes").
        for source in self.probe_on_arrival:
            if any(source in caps[rid] for rid in arrived):
                self._probe_interval[source] = PROBE_START
        self._usable = {s for cap in caps.values() for s in cap}
        self._probed_sources |= self._usable
        max_depth = max((c for cap in caps.values() for c in cap.values()), default=0)
        # Drafting is judged against the plain step of this batch size: measure that first
        # (one plain step). Else, with drafts chosen from the first step at a new size, the
        # plain cost is never seen, only guessed (at 32 clients, guessed 3x too high).
        measuring = bool(requests) and max_depth > 0 and not self.cost.plain.measured(batch)
        if not requests or max_depth == 0 or measuring:
            self.last_sources = {}
            self._count_idle({})
            if measuring:
                self.last_choice = {"width": 0, "positions": 0, "exploring": False,
                                    "reason": "measuring_plain"}  # fmt: skip
            return {r.request_id: 0 for r in requests}, {}
        # Each row's catch-up: the feature rows its DFlash session holds unwritten, beyond the
        # one every proposal writes (the position the last step committed).
        backlogs = {r.request_id: max(0, r.draft_backlog - 1) for r in requests}
        # A parked batch whose rows and usable sources are those of the last valuation (and
        # as many requests wait) is parked again without valuing every candidate, for up to
        # PARKED_REUSE - 1 steps: while parked nothing is observed that moves acceptance, and
        # the valuation's Python runs beside the lookahead's forward, slowing it. Not after a
        # probe: it observed acceptance, and a drafting run it started may be worth going on.
        signature = (self._waiting, tuple((rid, tuple(cap)) for rid, cap in caps.items()))
        reusable = self._reuse_left and not self._drafted_last and not draft_next
        if self._steps_parked and reusable and signature == self._parked_signature:
            self._reuse_left -= 1
            choice, sources = self._park_or_probe(requests, caps, backlogs, "not_worth_it")
            return self._settle(choice, sources, backlogs, exploring=False, table=None)
        limit = self.cost.explore_limit(batch)
        if self.cost.samples < self.warmup_steps:
            limit = 0 if self.cost.samples == 0 else 1
        # Price every choice with DFlash allowed (drafter forward) and, when some row could
        # take it, once more without (lookup or plain rows only: no drafter forward).
        gains = self._gains(requests, caps)
        scenarios = [True] if any(DFLASH in g for g in gains.values()) else []
        if any(LOOKUP in g for g in gains.values()) or not scenarios:
            scenarios.append(False)
        plain = self.cost.predict_plain(batch)
        value_of = self._value_of = self._valuer(requests)
        plain_value = float(batch) if value_of is None else value_of(dict.fromkeys(gains, 1.0))
        plain_rate = plain_value / plain
        # Leaving the parked state takes a clear predicted gain: a noisy cost estimate must
        # not pull a parked batch back into drafting step after step.
        margin = 1.0 + (UNPARK_MARGIN if self._steps_parked else 0.0001)
        # What any drafting choice costs beyond its positions: starting a run (the plain step
        # looked ahead, thrown away, and the run's end), and each DFlash row's backlog its
        # drafter forward writes first.
        entry = self.entry_price(batch)
        # The thrown-away lookahead inside `entry`: the lookahead is launched because this
        # valuation parks, so whether a run would start without it decides the next one.
        discard = self._discard_price(plain) if entry else 0.0
        extra_cost = {d: self.cost.extra_pricer(batch, d) for d in (False, True)}
        best, best_rate, best_extra = None, plain_rate, 0
        best_rate_undiscarded = plain_rate
        table = [(0, plain_value, plain, False)]  # rounded only when read (state())
        for allow_dflash in scenarios:
            candidates = list(self._candidates(gains, allow_dflash, max_depth, limit, backlogs))
            if value_of is not None and candidates:  # all at once (`MakespanValue`)
                values = value_of.rows(np.stack([c[5] for c in candidates]))
            for i, (extra, expected, drafting, backlog, picks, _) in enumerate(candidates):
                if value_of is not None:
                    expected = float(values[i])
                cost = plain + extra_cost[drafting](extra) + entry
                cost += self.catchup_row_seconds * backlog
                rate = expected / cost
                table.append((extra, expected, cost, drafting))
                if rate >= plain_rate * margin and rate > best_rate * 1.0001:
                    best, best_rate, best_extra = picks, rate, extra
                best_rate_undiscarded = max(best_rate_undiscarded, expected / (cost - discard))
        choice, sources = best() if best is not None else ({r.request_id: 0 for r in requests}, {})
        exploring = best_extra >= limit > 0
        if not any(choice.values()):
            self._parked_signature, self._reuse_left = signature, PARKED_REUSE - 1
            self._draft_next = discard > 0 and best_rate_undiscarded >= plain_rate * margin
            choice, sources = self._park_or_probe(requests, caps, backlogs, "not_worth_it")
        else:
            self._steps_parked = 0
            for source in set(sources.values()):  # chosen on its merits: probe it soon again
                self._probe_interval[source] = PROBE_START
        return self._settle(choice, sources, backlogs, exploring, table[:64])

    def _settle(
        self, choice: dict[str, int], sources: dict[str, str], backlogs: dict[str, int],
        exploring: bool, table: list | None,
    ) -> tuple[dict[str, int], dict[str, str]]:  # fmt: skip
        """Book a step's choice (idle counters, the rows that drafted, what it writes, the
        explanation; `table` None: the last valuation's candidates stand) and return it."""
        self._count_idle(sources)
        self._chosen_backlog = sum(
            backlogs[rid] for rid, source in sources.items() if source == DFLASH and choice[rid]
        )
        for request_id, depth in choice.items():
            if depth:
                self._last_drafted[request_id] = self._steps
        self.last_sources = dict(sources)
        if table is None:
            table = self.last_choice.get("candidates", [])
        self.last_choice = {
            "width": max(choice.values(), default=0),
            "positions": sum(choice.values()),
            "exploring": exploring,
            "candidates": table,
            "depths": dict(choice),
            "sources": dict(sources),
        }
        return choice, sources

    def observe(self, result: StepResult) -> None:
        self._lookahead_pending = result.looked_ahead
        if result.discarded_seconds and result.batch_size:
            self._learn_discard(result)
        for request_id, outcome in result.outcomes.items():
            self._active.add(request_id)
            if outcome.drafted:
                model = self.models.get(outcome.source or DFLASH, self.acceptance)
                model.observe(request_id, outcome.drafted, outcome.accepted)
        # A drafter forward that also wrote sessions' backlogs (rows committed while they sat
        # out, the prompt at a request's first proposal) costs a one-off: learning drafting's
        # marginal price from it would make every later draft look dearer.
        catching_up = result.draft_context_rows > result.verify_tokens
        seconds, loop_measured = self._step_seconds(result) if result.batch_size else (0.0, False)
        # The loop-measured plain step right after a loop-measured draft: the run's end.
        run_end = (
            loop_measured and self._draft_measured and result.verify_tokens <= result.batch_size
        )
        if run_end:
            self._learn_exit(result.batch_size, seconds)
        if result.batch_size and not catching_up:
            self._observe_cost(result, seconds, run_end)
            drafting = result.drafted_rows > 0  # a drafter forward ran
            self.last_choice["measured"] = seconds
            depths = [o.drafted for o in result.outcomes.values()]
            self.last_choice["predicted"] = self.cost.predict(
                result.batch_size, depths, result.prefill_tokens, drafting
            )
        elif result.batch_size:
            self._learn_catchup(result)
        if result.batch_size:
            drafted = result.verify_tokens > result.batch_size
            self._draft_measured = drafted and loop_measured
            self._count_run(drafted)
        if self.guard is not None:
            tokens = sum(len(o.tokens) for o in result.outcomes.values())
            # A catch-up counts here: a held batch never pays it, so the whole-loop comparison
            # of the two arms should see it.
            clean = not result.prefill_tokens and not result.first_tokens
            plain = self.cost.predict_plain(result.batch_size) if result.batch_size else 0.0
            self.guard.observe(result.batch_size, tokens, plain, clean)
        if self._probing:
            source, self._probing = self._probing, None
            if any(o.drafted for o in result.outcomes.values()):
                self._probe_interval[source] = min(PROBE_MAX, self._probe_interval[source] * 2)
        finished = self._active - set(result.outcomes)
        for request_id in finished:
            for model in self.models.values():
                model.forget(request_id)
            self._last_drafted.pop(request_id, None)
            self._joined_held.discard(request_id)
        self._active = set(result.outcomes)

    # ----------------------------------------------------------------- internals
    def _observe_cost(self, result: StepResult, seconds: float, run_end: bool) -> None:
        """Teach the cost model one step, charged `seconds` (`_step_seconds`).

        A step costs what it takes from the loop's throughput: its cadence, where the loop
        measured one on a step without prefill (bundled pair, 8 rows: a plain step 12.9 ms
        against a forward of 14.1, as its forward overlaps the loop's work; a drafting step
        24.2 ms against 20.4). The plain step right after drafting has no such overlap (17.99
        ms, not 12.9): that excess is the price of ending a drafting run (`run_end`), learned
        apart (`_learn_exit`) and priced when a run starts, so that step teaches nothing here.
        Priced by their forwards alone, drafts that cost 2.3 plain steps of the loop's time
        looked like 1.4 and were taken for 1.9 steps' tokens.
        """
        if run_end:
            return  # its cadence is the run's end, not a plain step's
        drafting = result.drafted_rows > 0
        self.cost.observe(
            result.batch_size, result.verify_tokens, result.prefill_tokens, drafting, seconds
        )

    def _learn_exit(self, batch: int, seconds: float) -> None:
        """Learn what ending a drafting run costs from a run's end (see `observe`): that
        plain step's excess over a plain step of its rows."""
        excess = max(0.0, seconds - self.cost.predict_plain(batch))
        bucket = _batch_bucket(batch)
        known = self._exit_seconds.get(bucket)
        self._exit_seconds[bucket] = (
            excess if known is None else known + EXIT_ALPHA * (excess - known)
        )

    def exit_price(self, batch: int) -> float:
        """Seconds that ending a drafting run of this batch size costs (learned; before any
        run ended at this size, the nearest size's, scaled by the plain steps)."""
        bucket = _batch_bucket(batch)
        if bucket in self._exit_seconds:
            return self._exit_seconds[bucket]
        if not self._exit_seconds:
            return 0.0
        near = min(self._exit_seconds, key=lambda b: (abs(b - bucket), b))
        scale = self.cost.predict_plain(batch) / self.cost.predict_plain(2**near)
        return self._exit_seconds[near] * scale

    @property
    def _drafted_last(self) -> bool:
        """The last step drafted: a choice now continues its run (else it starts one)."""
        return self._run_steps > 0

    def _count_run(self, drafted: bool) -> None:
        """Count a step into the drafting run going on, or close the run it ends."""
        if drafted:
            self._run_steps += 1
        elif self._run_steps:
            self.run_length += RUN_ALPHA * (self._run_steps - self.run_length)
            self._run_steps = 0

    def start_price(self, batch: int) -> float:
        """The share of its run's end that starting a drafting run pays now: the end comes
        once a run, and runs have lasted `run_length` steps, each of which gains over plain
        steps (charged whole to the first step, a run only started where one step alone
        paid for its end: SmolLM2 at c=1 on chat needed 0.5 first-draft acceptance to start
        a run that pays from 0.25 on)."""
        return self.exit_price(batch) / max(1.0, self.run_length)

    def entry_price(self, batch: int) -> float:
        """What a drafting choice pays beyond its positions for starting a drafting run: the
        lookahead it throws away and its share of the run's end. Nothing when it continues a
        run."""
        if self._drafted_last:
            return 0.0
        return self._discard_price(self.cost.predict_plain(batch)) + self.start_price(batch)

    def _discard_price(self, plain: float) -> float:
        """What drafting now throws away: the plain step launched ahead, if one is pending."""
        return self.discard_share * plain if self._lookahead_pending else 0.0

    @staticmethod
    def _step_seconds(result: StepResult) -> tuple[float, bool]:
        """What a step cost (see `_observe_cost`): its cadence where the loop measured one on
        a step without prefill, else its forward's time; and whether the loop measured it."""
        loop_measured = result.cadence_seconds > 0 and not result.prefill_tokens
        if loop_measured and result.discarded_seconds:  # less the lookahead it threw away
            spent = result.cadence_seconds - result.discarded_seconds  # (priced at the choice)
            return max(spent, result.forward_seconds), True
        if loop_measured:
            return result.cadence_seconds, True
        return result.forward_seconds or result.step_seconds, False

    def _learn_catchup(self, result: StepResult) -> None:
        """Learn what a drafter backlog row costs from a catch-up step: its seconds beyond
        what the cost model predicts for the same step without one, per row written."""
        if not self.cost.measured_drafting(result.batch_size):
            # Nothing to subtract the drafter forward's own cost from: the first catch-up at
            # a batch size read a 6 ms drafter forward as 0.36 ms for each of its 18 rows.
            return
        seconds, _ = self._step_seconds(result)
        depths = [o.drafted for o in result.outcomes.values()]
        predicted = self.cost.predict(result.batch_size, depths, result.prefill_tokens, True)
        rows = self._chosen_backlog or result.draft_context_rows
        # A ratio of decayed sums, not a mean of per-row ratios: a catch-up of a few rows
        # divides the cost model's error by a few, and one such read 0.2 ms a row (a context
        # row costs ~10 us), which priced every fresh request's prompt out of drafting.
        keep = 1.0 - CATCHUP_ALPHA
        self._catchup_seconds = self._catchup_seconds * keep + max(0.0, seconds - predicted)
        self._catchup_rows = self._catchup_rows * keep + rows
        self.catchup_row_seconds = self._catchup_seconds / self._catchup_rows

    def _learn_discard(self, result: StepResult) -> None:
        """Learn what a thrown-away lookahead costs, as a share of a plain step of its batch
        (the runner timed its build and compute)."""
        share = result.discarded_seconds / self.cost.predict_plain(result.batch_size)
        step = DISCARD_ALPHA if self._discards_seen else 1.0
        self.discard_share += step * (min(share, 2.0) - self.discard_share)
        self._discards_seen += 1

    def holds_drafting(self, batch: int) -> bool:
        """The guard holds this batch size plain (drafting measured slower there): no row
        drafts and no row is planned."""
        return self.guard is not None and not self.guard.allows_drafting(batch)

    def _cap(self, request: Request, max_depth: int) -> int:
        """The request's own cap, further limited by its remaining token budget."""
        remaining = request.params.max_tokens - request.generated
        return max(0, min(request_cap(request, max_depth), remaining - 1))

    def _caps(self, request: Request, options: DraftOptions) -> dict[str, int]:
        """Per usable source, the most this request may draft from it now (0s left out)."""
        caps = {}
        for source in options.sources:
            cap = self._cap(request, min(self.max_depth, options.depth_limit(source)))
            if cap > 0:
                caps[source] = cap
        return caps

    def _gains(self, requests: list[Request], caps: dict[str, dict[str, int]]):
        """Per row and usable source, expected committed tokens at depths 0..d_max (d_max:
        the cap, or the useful depth if less), computed once per step, not once per width."""
        gains: dict[str, dict[str, list[float]]] = {}
        for r in requests:
            rid, table = r.request_id, {}
            for source, cap in caps[rid].items():
                model = self.models[source]
                d_max = min(cap, model.useful_depth(rid))
                if d_max:
                    q, chain, row = model.estimate(rid), 1.0, [1.0]
                    for j in range(d_max):
                        chain *= q[j]
                        row.append(row[-1] + chain)
                    table[source] = row
            gains[rid] = table
        return gains

    @staticmethod
    def _picks_at(gains: dict[str, dict[str, list[float]]], width: int,
                  allow_dflash: bool) -> dict[str, tuple[str | None, int, float]]:  # fmt: skip
        """Per row at this width: (source, depth, expected committed tokens) of its best
        source; lookup is tried first so that it wins ties (it costs no forward)."""
        picks = {}
        for rid, table in gains.items():
            best: tuple[str | None, int, float] = (None, 0, 1.0)
            for source in (LOOKUP, DFLASH):
                row = table.get(source)
                if row is None or (source == DFLASH and not allow_dflash):
                    continue
                depth = min(width, len(row) - 1)
                if depth and row[depth] > best[2]:
                    best = (source, depth, row[depth])
            picks[rid] = best
        return picks

    def _candidates(self, gains: dict[str, dict[str, list[float]]], allow_dflash: bool,
                    max_depth: int, limit: int, backlogs: dict[str, int]):  # fmt: skip
        """(extra positions, expected committed tokens, drafter forward?, backlog rows its
        DFlash rows write first, picks thunk -> (depths, sources), expected tokens per row
        in `gains` order) of the drafting choices worth comparing, in growing order of extra
        positions up to `limit`."""
        if not self.cost.packed:  # padded: one width for everyone, capped per row
            for width in range(1, max_depth + 1):
                picks = self._picks_at(gains, width, allow_dflash)
                depths = {rid: d for rid, (_, d, _) in picks.items()}
                extra = self.cost.extra_positions(list(depths.values()))
                if extra > limit:
                    return
                expected = sum(e for _, _, e in picks.values())
                drafting = any(s == DFLASH and d for s, d, _ in picks.values())
                sources = {rid: s for rid, (s, d, _) in picks.items() if d}
                backlog = sum(backlogs[rid] for rid, s in sources.items() if s == DFLASH)
                per_row = np.array([e for _, _, e in picks.values()])
                thunk = lambda d=depths, s=sources: (d, s)  # noqa: E731
                yield extra, expected, drafting, backlog, thunk, per_row
            return
        # Packed: each row's source is the one with the most expected tokens (lookup first, so
        # it wins ties); then every (row, position) by its chance of being accepted, best first
        # (a row's chain only falls with depth, so its positions come in order).
        marginals = []
        for order, (rid, table) in enumerate(gains.items()):
            source, row = None, [1.0]
            for candidate in (LOOKUP, DFLASH):
                cumulative = table.get(candidate)
                if cumulative is None or (candidate == DFLASH and not allow_dflash):
                    continue
                if cumulative[-1] > row[-1]:
                    source, row = candidate, cumulative
            for k in range(1, len(row)):
                marginals.append((row[k - 1] - row[k], order, rid, source))
        marginals.sort()
        total = min(len(marginals), limit)
        expected, drafting, backlog = [float(len(gains))], [False], [0]
        # Expected tokens per row after the first k positions (k = 0..total): a row's
        # column gains each of its positions' marginals, summed down the steps.
        column = {rid: i for i, rid in enumerate(gains)}
        steps = np.zeros((total + 1, len(gains)))
        steps[0] = 1.0
        seen: set[str] = set()
        for k, (loss, _, rid, source) in enumerate(marginals[:total], start=1):
            steps[k, column[rid]] = -loss
            expected.append(expected[-1] - loss)
            drafting.append(drafting[-1] or source == DFLASH)
            # a row's first position (its positions come in order) brings its backlog
            first = source == DFLASH and rid not in seen
            backlog.append(backlog[-1] + (backlogs[rid] if first else 0))
            seen.add(rid)

        def picks_at(extra: int) -> tuple[dict[str, int], dict[str, str]]:
            depths, sources = dict.fromkeys(gains, 0), {}
            for _, _, rid, source in marginals[:extra]:
                depths[rid] += 1
                sources[rid] = source
            return depths, sources

        grid = _extra_grid(total)
        per_row = np.cumsum(steps, axis=0)[grid] if grid else steps[:0]
        for i, extra in enumerate(grid):
            thunk = lambda e=extra: picks_at(e)  # noqa: E731
            yield extra, expected[extra], drafting[extra], backlog[extra], thunk, per_row[i]

    def observe_queue(self, waiting: int) -> None:
        """How many requests wait behind the batch (the scheduler tells before each choice)."""
        self._waiting = waiting

    def _valuer(self, requests: list[Request]) -> MakespanValue | None:
        """None when every committed token is worth the same (requests wait, or one row);
        else the valuation of expected tokens per row (`MakespanValue`)."""
        batch = len(requests)
        if self._waiting or batch == 1:
            return None
        remaining = [max(1, r.params.max_tokens - r.generated) for r in requests]
        slopes, before = [], 0.0  # m(k): what the k-th longest row adds to a step
        for k in range(1, batch + 1):
            cost = max(before, self.cost.predict_plain(k))  # a noisy curve may dip
            slopes.append(cost - before)
            before = cost
        return MakespanValue([r.request_id for r in requests], remaining, slopes)

    def _count_idle(self, sources: dict[str, str]) -> None:
        """Advance every source's steps-since-it-drafted counter (0 for those drafting now)."""
        used = set(sources.values())
        for source in self._idle:
            self._idle[source] = 0 if source in used else self._idle[source] + 1

    def _due_probe(self) -> str | None:
        """The source a parked step would probe now: one usable source whose idle steps
        reached its backoff interval (the most overdue), or None."""
        # The backoff first (a counter compare): the cost-based floor is priced only for a
        # source the backoff alone would probe, not on every parked step.
        idle = {s: self._idle[s] + 1 for s in (DFLASH, LOOKUP) if s in self._usable}
        backed_off = [s for s in idle if idle[s] >= self._probe_interval[s]]
        interval = {s: max(self._probe_interval[s], self.probe_floor(s)) for s in backed_off}
        due = [s for s in backed_off if idle[s] >= interval[s]]
        return max(due, key=lambda s: idle[s] / interval[s], default=None)

    def probe_floor(self, source: str) -> int:
        """Fewest steps between two probes of `source` that keep probing within PROBE_BUDGET
        of the time, all sources together: a probe's predicted extra over a plain step of the
        latest batch (for DFlash, with the catch-up its rows' backlogs cost), over this
        source's share of the budget of that plain step (PROBE_START at least, PROBE_MAX at
        most). The sources ever usable share the budget: each had all of it, so a hybrid could
        probe twice the budget."""
        batch = self._last_batch
        rows = min(PROBE_ROWS, batch) if self.cost.packed else batch
        plain = self.cost.predict_plain(batch)
        probe = self.cost.predict(batch, [1] * rows + [0] * (batch - rows),
                                  drafting=source == DFLASH)  # fmt: skip
        if source == DFLASH:  # and the catch-up of the rows it would probe
            probe += self.catchup_row_seconds * self._probe_backlog
        budget = PROBE_BUDGET / max(1, len(self._probed_sources))
        steps = math.ceil((probe - plain) / (budget * plain))
        return min(PROBE_MAX, max(PROBE_START, steps))

    def _park_or_probe(
        self, requests: list[Request], caps: dict[str, dict[str, int]],
        backlogs: dict[str, int], reason: str,
    ) -> tuple[dict[str, int], dict[str, str]]:  # fmt: skip
        self._steps_parked += 1
        self._probe_backlog = sum(backlogs[rid] for rid in self._probe_rows(caps, DFLASH))
        source = self._due_probe()
        if source is not None:
            self._probing = source
            probed = self._probe_rows(caps, source)
            return {r.request_id: int(r.request_id in probed) for r in requests}, dict.fromkeys(
                probed, source
            )
        for r in requests:
            rid = r.request_id
            useless = all(self.models[s].useful_depth(rid) == 0 for s in caps[rid])
            self.parked_reasons[rid] = "low_acceptance" if useless else reason
        return {r.request_id: 0 for r in requests}, {}

    def _probe_rows(self, caps: dict[str, dict[str, int]], source: str) -> list[str]:
        """The rows a probe of `source` drafts for. Packed: one position for the few rows that
        drafted least recently, so every request is re-measured in turn at the cost of a few
        positions; padded: every row that may."""
        eligible = [rid for rid, cap in caps.items() if source in cap]
        eligible.sort(key=lambda rid: self._last_drafted.get(rid, -1))
        return eligible[:PROBE_ROWS] if self.cost.packed else eligible

    def wants_lookup(self, request_id: str) -> bool:
        """Would a lookup match for this request likely be drafted? (See `lookup_wanted`.)"""
        return bool(self.lookup_wanted([request_id]))

    def lookup_wanted(self, request_ids: list[str]) -> set[str]:
        """The requests whose lookup match would likely be drafted (the runner skips a
        lookahead plain step when such a row gets a match). Judged at depth 1 against
        widening the latest batch's verify: each row alone, and the rows together, best
        first (the most likely-accepted k rows, for the best k). Together counts where a
        batch runs in lockstep with nobody waiting: one row's extra token is then worth
        next to nothing (the batch runs on for the others), all rows' extra tokens a whole
        step. Judged alone only, SmolLM2's rows at c=8 on editing, which all copy, were never
        watched, so every drafting choice paid for a thrown-away lookahead and none was
        made."""
        if self.holds_drafting(self._last_batch):
            return set()
        batch = max(1, self._last_batch)
        plain = self.cost.predict_plain(batch)
        pricer = self.cost.extra_pricer(batch, drafting=False)  # seconds for k more positions
        # A draft after a plain step starts a run, and pays its share of the run's end (not
        # the lookahead: the runner skips that for the rows wanted).
        start = 0.0 if self._drafted_last else self.start_price(batch)

        def widen(k: int) -> float:
            return pricer(k) + start

        q = {rid: self.lookup_acceptance.estimate(rid)[0] for rid in request_ids}
        gain, plain_value = dict(q), dict.fromkeys(request_ids, float(batch))  # tokens alike
        value = self._value_of
        valued = [rid for rid in request_ids if value is not None and rid in value.column]
        together = sorted(valued if valued else request_ids, key=lambda rid: -q[rid])
        sizes = _extra_grid(len(together))  # the k tried: every one to 8, then sparser
        cumulative = np.cumsum([q[rid] for rid in together])
        joint = [float(cumulative[k - 1]) for k in sizes]  # tokens alike
        joint_plain = float(batch)
        if valued:  # a plain step's tokens, each row alone with 1 + q, then the best k rows
            n = len(valued)
            choices = np.ones((n + 1 + len(sizes), len(value.order)))
            for k, rid in enumerate(valued, start=1):
                choices[k, value.column[rid]] += q[rid]
            # Row n + 1 + i: the first sizes[i] rows of `together` each with 1 + q.
            columns = [value.column[rid] for rid in together]
            first_k = np.arange(len(together)) < np.asarray(sizes)[:, None]
            choices[n + 1 :, columns] += first_k * np.array([q[rid] for rid in together])
            values = value.rows(choices)
            for k, rid in enumerate(valued, start=1):
                gain[rid], plain_value[rid] = values[k] - values[0], values[0]
            joint, joint_plain = list(values[n + 1 :] - values[0]), values[0]
        wanted = {rid for rid in request_ids if gain[rid] / plain_value[rid] > widen(1) / plain}
        if joint_plain > 0 and len(together) > 1:
            margins = [joint[i] / joint_plain - widen(k) / plain for i, k in enumerate(sizes)]
            best = int(np.argmax(margins))
            if margins[best] > 0:
                wanted.update(together[: sizes[best]])
        return wanted

    def expects_plain_next(self) -> bool:
        """Parked now: the next step parks too unless a probe falls due, or this step's
        valuation parked only for the lookahead it would have thrown away (so none is
        launched, and the next step starts a drafting run at the price of its end alone).
        The measured costs, the batch or a new lookup match may still change the decision,
        which the runner then absorbs."""
        if self.holds_drafting(self._last_batch):
            return True
        return not self._draft_next and self._due_probe() is None

    def seed(self, samples: list[tuple[int, int, float]]) -> None:
        """Seed the cost model with a warm-up profile: (batch, width, seconds) triples of
        target forwards (the one-position forward is a plain step; wider ones give the extra
        of their positions without a drafter forward: optimistic for DFlash, which falls
        back to it until measured, so the controller explores)."""
        plain = {b for b, w, _ in samples if w == 1}
        for batch, width, seconds in sorted(samples, key=lambda t: t[1]):
            if width == 1 or batch not in plain:
                self.cost.observe(batch, batch, 0, False, seconds)
            else:
                self.cost.observe(batch, batch * width, 0, False, seconds)

    def state(self) -> dict:
        """Inspectable state: prior, cost coefficients, last choice, probe cadence."""
        return {
            "prior": self.acceptance.priors(),  # per acceptance group
            "lookup_prior": self.lookup_acceptance.priors(),
            "cost_plain": {
                round(CostCurve.center(b)): round(v, 5)
                for b, v in sorted(self.cost.plain.mean.items())
            },
            "cost_extra": {
                f"batch {2**batch}{' drafter' if drafting else ''}": {
                    round(CostCurve.center(b)): round(v, 5) for b, v in sorted(curve.mean.items())
                }
                for (batch, drafting), curve in sorted(self.cost.extra.items())
            },
            "packed": self.cost.packed,
            "cost_samples": self.cost.samples,
            "probe_interval": dict(self._probe_interval),
            "probe_floor": {s: self.probe_floor(s) for s in self._probe_interval},
            "catchup_row_seconds": self.catchup_row_seconds,
            "discard_share": round(self.discard_share, 3),
            "exit_seconds": {2**b: round(v, 5) for b, v in sorted(self._exit_seconds.items())},
            "run_length": round(self.run_length, 2),
            "steps_parked": self._steps_parked,
            "last_choice": {
                **self.last_choice,
                "candidates": [
                    (e, round(v, 5), round(c, 5), d)
                    for e, v, c, d in self.last_choice.get("candidates", [])
                ],
            },
            "guard": self.guard.state() if self.guard is not None else None,
        }
