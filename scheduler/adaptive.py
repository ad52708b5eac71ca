"""Adaptive draft depth: each step, choose every request's verify depth to maximise goodput.

    goodput(D) = sum_i E_i[committed tokens | depth d_i(D)] / predicted step cost(B, D)

- **Acceptance model.** Per request and draft position j, the conditional probability that
  draft j is accepted given drafts 1..j-1 were, learned online (EWMA) and starting from a prior
  shared by all requests (itself an EWMA over everyone's observations). A request's expected
  committed tokens at depth d are 1 + sum_k prod_{j<=k} q[j].
- **Cost model.** The verify forward runs every row at the batch's widest depth (rows are
  padded), so a step's cost is a function of the rows B*(D+1) (+ prefill tokens), with or
  without a drafter forward: two measured curves over quarter-octave buckets, EWMA per bucket
  with updates clamped to a few robust deviations (one stall cannot flip decisions).
- **Allocation.** For each candidate width D (0..max), every request drafts
  min(D, its cap, its token budget, its own useful depth) — the depth past which its marginal
  acceptance is negligible — and the D with the best predicted goodput wins. Requests with
  high acceptance therefore get depth first; when no D > 0 beats plain decoding everyone
  decodes plainly (no drafter forward at all).
- **Exploration and recovery.** Until the cost of a width has been seen the controller climbs
  one position at a time from the widest measured one. While parked it probes at depth 1 with
  exponential backoff (4, 8, ... 512 steps), so acceptance that returns is noticed.
- **Draft sources.** A row may draft from DFlash or from prompt lookup (`scheduler.sources`);
  acceptance is modelled per request *and per source* (one `AcceptanceModel` each). At each
  width every row takes the source with the most expected tokens, and each width is priced
  twice: with DFlash allowed (the drafter forward's cost curve, if any row takes it) and
  without (lookup drafts cost no forward, only verify positions). Ties go to lookup. Probes
  rotate through a row's usable sources, so a source that lost a request is tried again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler.depth import request_cap
from scheduler.plan import StepResult
from scheduler.request import Request
from scheduler.sources import DFLASH, LOOKUP, DraftOptions

PRIOR_ACCEPTANCE = 0.6  # before anything is observed
# Lookup drafts are right far more often than chance only on copy-heavy text: a lower start.
LOOKUP_PRIOR_ACCEPTANCE = 0.5
MIN_MARGINAL = 0.02  # a draft position is useless once its acceptance chance falls below this
PROBE_START, PROBE_MAX = 4, 512


@dataclass
class AcceptanceModel:
    """Per-position conditional acceptance: a shared prior and per-request estimates."""

    max_depth: int
    alpha: float = 0.15  # EWMA step for per-request estimates
    prior_alpha: float = 0.02  # the shared prior moves slowly
    prior: list[float] = field(default_factory=list)
    per_request: dict[str, list[float]] = field(default_factory=dict)
    initial: float = PRIOR_ACCEPTANCE

    def __post_init__(self) -> None:
        if not self.prior:
            self.prior = [self.initial] * self.max_depth

    def estimate(self, request_id: str) -> list[float]:
        return self.per_request.get(request_id, self.prior)

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """Positions 1..accepted were accepted, accepted+1 rejected, the rest not judged."""
        mine = self.per_request.setdefault(request_id, list(self.prior))
        judged = min(drafted, accepted + 1)
        for j in range(judged):
            hit = 1.0 if j < accepted else 0.0
            mine[j] += self.alpha * (hit - mine[j])
            self.prior[j] += self.prior_alpha * (hit - self.prior[j])

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


class CostCurve:
    """Measured step seconds as a function of verify rows R, on quarter-octave buckets.

    Each bucket is an EWMA whose updates are clamped to a few robust deviations (one stall
    cannot move it far); unmeasured R are interpolated between neighbours, and extrapolated
    past the largest measured R with the slope of the last two buckets (flat with only one:
    optimistic, so the controller explores rather than guessing a steep cost)."""

    def __init__(self, alpha: float = 0.2, clamp: float = 3.0) -> None:
        self.alpha, self.clamp = alpha, clamp
        self.mean: dict[int, float] = {}
        self.deviation: dict[int, float] = {}
        self.count: dict[int, int] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return int(round(4 * math.log2(max(rows, 1))))

    @staticmethod
    def center(bucket: int) -> float:
        return 2 ** (bucket / 4)

    def observe(self, rows: int, seconds: float) -> None:
        b = self.bucket(rows)
        if b not in self.mean:
            self.mean[b], self.deviation[b], self.count[b] = seconds, 0.1 * seconds, 1
            return
        delta = seconds - self.mean[b]
        if self.count[b] >= 4:
            bound = self.clamp * max(self.deviation[b], 0.02 * self.mean[b])
            delta = max(-bound, min(bound, delta))
        self.mean[b] += self.alpha * delta
        self.deviation[b] += self.alpha * (abs(delta) - self.deviation[b])
        self.count[b] += 1

    def predict(self, rows: int) -> float | None:
        if not self.mean:
            return None
        known = sorted(self.mean)
        x = float(max(rows, 1))
        b = self.bucket(rows)
        if b in self.mean:
            return self.mean[b]
        lower = [k for k in known if self.center(k) < x]
        upper = [k for k in known if self.center(k) > x]
        if lower and upper:
            lo, hi = lower[-1], upper[0]
            t = (x - self.center(lo)) / (self.center(hi) - self.center(lo))
            return self.mean[lo] + t * (self.mean[hi] - self.mean[lo])
        if upper:
            return self.mean[upper[0]]
        if len(known) == 1:
            return self.mean[known[0]]
        a, c = known[-2], known[-1]
        slope = max(0.0, (self.mean[c] - self.mean[a]) / (self.center(c) - self.center(a)))
        return self.mean[c] + slope * (x - self.center(c))

    def measured(self, rows: int) -> bool:
        return self.bucket(rows) in self.mean


class CostModel:
    """Step seconds for a padded verify of B rows x W positions (+ prefill tokens), with and
    without a drafter forward — one `CostCurve` each, indexed by total rows processed."""

    def __init__(self) -> None:
        self.plain = CostCurve()
        self.drafting = CostCurve()
        self.samples = 0
        self.widths_seen: set[int] = set()

    def predict(self, batch: int, width: int, prefill_tokens: int = 0, drafting: bool = False):
        rows = batch * width + prefill_tokens
        curve, other = (self.drafting, self.plain) if drafting else (self.plain, self.drafting)
        seconds = curve.predict(rows)
        if seconds is None:
            seconds = other.predict(rows)
        return seconds if seconds is not None else 1.0

    def observe(self, batch: int, width: int, prefill_tokens: int, drafting: bool,
                seconds: float) -> None:  # fmt: skip
        curve = self.drafting if drafting else self.plain
        curve.observe(batch * width + prefill_tokens, seconds)
        self.samples += 1
        self.widths_seen.add(width)


class AdaptiveDepthPolicy:
    """The goodput-maximising depth controller (see the module docstring)."""

    def __init__(self, max_depth: int = 15, warmup_steps: int = 3) -> None:
        self.max_depth = max_depth
        self.acceptance = AcceptanceModel(max_depth)  # DFlash's
        self.lookup_acceptance = AcceptanceModel(max_depth, initial=LOOKUP_PRIOR_ACCEPTANCE)
        self.models = {DFLASH: self.acceptance, LOOKUP: self.lookup_acceptance}
        self.cost = CostModel()
        self.warmup_steps = warmup_steps
        self.parked_reasons: dict[str, str] = {}
        self._probe_interval = PROBE_START
        self._steps_parked = 0
        self._probing = False
        self._last_width = 1
        self._active: set[str] = set()
        self._probes = 0
        self._last_batch = 1
        self.last_choice: dict = {}  # explainability: what was chosen and why
        self.last_sources: dict[str, str] = {}

    # ----------------------------------------------------------------- DepthPolicy
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
        self._last_batch = max(1, len(requests))
        caps = {r.request_id: self._caps(r, options[r.request_id]) for r in requests}
        max_depth = max((c for cap in caps.values() for c in cap.values()), default=0)
        if not requests or max_depth == 0:
            self.last_sources = {}
            return {r.request_id: 0 for r in requests}, {}
        batch = len(requests)
        frontier = max(self.cost.widths_seen, default=0) - 1  # widest depth measured
        limit = min(max_depth, frontier + 1)  # climb one position beyond what is known
        if self.cost.samples < self.warmup_steps:
            limit = min(limit, 0 if self.cost.samples == 0 else 1)
        # Price each width with DFlash allowed (drafter forward) and, when some row could
        # take it, once more without (lookup or plain rows only: no drafter forward).
        gains = self._gains(requests, caps)
        scenarios = [True] if any(DFLASH in g for g in gains.values()) else []
        if any(LOOKUP in g for g in gains.values()) or not scenarios:
            scenarios.append(False)
        best, best_rate, table = ({}, {}), -1.0, []
        for width in range(0, limit + 1):
            for allow_dflash in scenarios:
                picks = self._picks_at(gains, width, allow_dflash)
                expected = sum(e for _, _, e in picks.values())
                depths = {rid: d for rid, (_, d, _) in picks.items()}
                drafting = any(s == DFLASH and d for s, d, _ in picks.values())
                real_width = max(depths.values(), default=0)
                cost = self.cost.predict(batch, real_width + 1, 0, drafting)
                rate = expected / cost
                table.append((width, expected, cost, drafting))
                if rate > best_rate * 1.0001:
                    sources = {rid: s for rid, (s, d, _) in picks.items() if d}
                    best, best_rate = (depths, sources), rate
        choice, sources = best
        best_width = max(choice.values(), default=0)
        exploring = limit < max_depth and best_width == limit and limit > 0
        if not any(choice.values()):
            choice, sources = self._park_or_probe(requests, caps, reason="not_worth_it")
        else:
            self._steps_parked = 0
            if not self._probing:
                self._probe_interval = PROBE_START
        self.last_sources = dict(sources)
        self.last_choice = {
            "width": max(choice.values(), default=0),
            "exploring": exploring,
            "candidates": table,
            "depths": dict(choice),
            "sources": dict(sources),
        }
        return choice, sources

    def observe(self, result: StepResult) -> None:
        for request_id, outcome in result.outcomes.items():
            self._active.add(request_id)
            if outcome.drafted:
                model = self.models.get(outcome.source or DFLASH, self.acceptance)
                model.observe(request_id, outcome.drafted, outcome.accepted)
        if result.batch_size:
            width = result.verify_tokens // result.batch_size
            seconds = result.forward_seconds or result.step_seconds
            self.cost.observe(result.batch_size, width, result.prefill_tokens,
                              result.drafted_rows > 0, seconds)  # fmt: skip
            self.last_choice["measured"] = seconds
            self.last_choice["predicted"] = self.cost.predict(
                result.batch_size, width, result.prefill_tokens, result.drafted_rows > 0
            )
        if self._probing:
            self._probing = False
            drafted_any = any(o.drafted for o in result.outcomes.values())
            if drafted_any:
                self._probe_interval = min(PROBE_MAX, self._probe_interval * 2)
        finished = self._active - set(result.outcomes)
        for request_id in finished:
            for model in self.models.values():
                model.forget(request_id)
        self._active = set(result.outcomes)

    # ----------------------------------------------------------------- internals
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

    def _park_or_probe(self, requests: list[Request], caps: dict[str, dict[str, int]],
                       reason: str) -> tuple[dict[str, int], dict[str, str]]:  # fmt: skip
        self._steps_parked += 1
        if self._steps_parked % self._probe_interval == 0:
            self._probing = True
            self._probes += 1
            depths, sources = {}, {}
            for r in requests:
                usable = [s for s in (DFLASH, LOOKUP) if s in caps[r.request_id]]
                depths[r.request_id] = 1 if usable else 0
                if usable:  # rotate, so every source gets probed again in time
                    sources[r.request_id] = usable[self._probes % len(usable)]
            return depths, sources
        for r in requests:
            rid = r.request_id
            useless = all(self.models[s].useful_depth(rid) == 0 for s in caps[rid])
            self.parked_reasons[rid] = "low_acceptance" if useless else reason
        return {r.request_id: 0 for r in requests}, {}

    def wants_lookup(self, request_id: str) -> bool:
        """Would a lookup match for this request likely be drafted? (The runner skips a
        lookahead plain step when such a row gets a match.) Judged for the row alone at
        depth 1: its expected extra token against widening the latest batch's verify."""
        q = self.lookup_acceptance.estimate(request_id)[0]
        batch = max(1, self._last_batch)
        plain, wider = self.cost.predict(batch, 1), self.cost.predict(batch, 2)
        return (batch + q) / batch > wider / plain

    def expects_plain_next(self) -> bool:
        """Parked now: the next step parks too unless a probe falls due (or the measured
        costs or the batch change the decision, which the runner then absorbs)."""
        return (self._steps_parked + 1) % self._probe_interval != 0

    def seed(self, samples: list[tuple[int, int, float]]) -> None:
        """Seed the cost model with a warm-up profile: (batch, width, seconds) triples."""
        for batch, width, seconds in samples:
            self.cost.observe(batch, width, 0, False, seconds)

    def state(self) -> dict:
        """Inspectable state: prior, cost coefficients, last choice, probe cadence."""
        return {
            "prior": [round(p, 3) for p in self.acceptance.prior],
            "lookup_prior": [round(p, 3) for p in self.lookup_acceptance.prior],
            "cost_plain": {
                round(CostCurve.center(b)): round(v, 5)
                for b, v in sorted(self.cost.plain.mean.items())
            },
            "cost_drafting": {
                round(CostCurve.center(b)): round(v, 5)
                for b, v in sorted(self.cost.drafting.mean.items())
            },
            "cost_samples": self.cost.samples,
            "probe_interval": self._probe_interval,
            "steps_parked": self._steps_parked,
            "last_choice": self.last_choice,
        }
