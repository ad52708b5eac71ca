"""Choosing a draft source per row and per step (no MLX): the adaptive controller on a
simulator with two sources, and the scheduler's source bookkeeping."""

from __future__ import annotations

import random

import pytest

from engine.step.sampling import SamplingParams
from engine.step.stopping import StopChecker
from scheduler.adaptive import AdaptiveDepthPolicy
from scheduler.depth import FixedDepthPolicy
from scheduler.plan import RowOutcome, StepResult
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler, SchedulerLimits
from scheduler.sources import (
    DFLASH,
    LOOKUP,
    engine_sources,
    parse_sources,
    row_options,
)

DEPTHS = {DFLASH: 15, LOOKUP: 15}


def requests(n: int) -> list[Request]:
    out = []
    for i in range(n):
        params = SamplingParams(max_tokens=10**6)
        out.append(Request(f"r{i}", [1, 2, 3], params, StopChecker(params)))
    return out


class TwoSourceSimulator:
    """Per (request, source) true acceptance per position; lookup usable only for requests
    with a match; step time from a verify cost curve plus the drafter forward's cost when any
    row drafts by DFlash. The verify is padded (`cost(batch, widest + 1)`) or packed
    (`cost(1, positions)`: every row only its own 1 + depth positions)."""

    def __init__(self, acceptance, matched: set[str], cost, drafter_cost: float, seed=0,
                 packed: bool = False):  # fmt: skip
        self.acceptance, self.matched = acceptance, matched
        self.cost, self.drafter_cost = cost, drafter_cost
        self.rng = random.Random(seed)
        self.packed = packed

    def policy(self) -> AdaptiveDepthPolicy:
        """A controller told the verify's shape this simulator prices, and that requests wait
        behind the batch (the steady state these never-ending requests stand for: a row that
        finishes early is replaced, so every committed token is worth the same)."""
        policy = AdaptiveDepthPolicy(packed=self.packed)
        policy.observe_queue(4)
        return policy

    def step(self, policy, reqs):
        options = {
            r.request_id: row_options(
                (DFLASH, LOOKUP), 3 if r.request_id in self.matched else 0, DEPTHS
            )
            for r in reqs
        }
        depths, sources = policy.choose_drafts(reqs, options)
        outcomes = {}
        for r in reqs:
            d = depths[r.request_id]
            source = sources.get(r.request_id) if d else None
            if d:
                assert source in options[r.request_id].sources
            accepted = 0
            for p in (self.acceptance[(r.request_id, source)] if d else [])[:d]:
                if self.rng.random() >= p:
                    break
                accepted += 1
            outcomes[r.request_id] = RowOutcome([0] * (accepted + 1), d, accepted, source)
        width = max(depths.values()) + 1
        dflash_rows = sum(
            1 for r in reqs if depths[r.request_id] and sources[r.request_id] == DFLASH
        )
        positions = sum(1 + d for d in depths.values()) if self.packed else len(reqs) * width
        verify = self.cost(1, positions) if self.packed else self.cost(len(reqs), width)
        seconds = verify + (self.drafter_cost if dflash_rows else 0.0)
        policy.observe(StepResult(
            outcomes=outcomes, batch_size=len(reqs), verify_tokens=positions,
            drafted_rows=dflash_rows, step_seconds=seconds, phase_seconds={"forward": seconds},
        ))  # fmt: skip
        return depths, sources, dflash_rows


def run(sim, policy, reqs, steps):
    return [sim.step(policy, reqs) for _ in range(steps)]


@pytest.mark.parametrize("packed", [False, True])
def test_each_row_takes_the_source_that_commits_more(packed):
    good, bad = [0.9] * 15, [0.05] * 15
    acceptance = {("r0", LOOKUP): good, ("r0", DFLASH): bad,
                  ("r1", LOOKUP): bad, ("r1", DFLASH): good}  # fmt: skip
    sim = TwoSourceSimulator(
        acceptance, {"r0", "r1"}, lambda b, w: 0.1 + 0.002 * b * w, 0.005, packed=packed
    )
    history = run(sim, sim.policy(), requests(2), 300)
    tail = history[-50:]
    assert sum(1 for _, s, _ in tail if s.get("r0") == LOOKUP) >= 45
    assert sum(1 for _, s, _ in tail if s.get("r1") == DFLASH) >= 45


@pytest.mark.parametrize("packed", [False, True])
def test_lookup_alone_runs_without_the_drafter_when_its_forward_does_not_pay(packed):
    """r0 copies (lookup good); r1 has no match and DFlash helps it only a little, less than the
    drafter forward costs: r0 drafts by lookup, r1 decodes plainly, no drafter forward runs."""
    acceptance = {("r0", LOOKUP): [0.95] * 15, ("r0", DFLASH): [0.3] * 15,
                  ("r1", DFLASH): [0.3] * 15}  # fmt: skip
    sim = TwoSourceSimulator(
        acceptance, {"r0"}, lambda b, w: 0.05 + 0.001 * b * w, 0.2, packed=packed
    )
    history = run(sim, sim.policy(), requests(2), 300)
    tail = history[-50:]
    lookup_only = [h for h in tail if h[1].get("r0") == LOOKUP and h[2] == 0]
    assert len(lookup_only) >= 45
    assert all(h[0]["r1"] == 0 for h in lookup_only)


@pytest.mark.parametrize("packed", [False, True])
def test_a_row_whose_lookup_fails_moves_to_dflash_and_both_park_when_neither_pays(packed):
    acceptance = {("r0", LOOKUP): [0.02] * 15, ("r0", DFLASH): [0.85] * 15}
    sim = TwoSourceSimulator(
        acceptance, {"r0"}, lambda b, w: 0.1 + 0.002 * b * w, 0.005, packed=packed
    )
    tail = run(sim, sim.policy(), requests(1), 300)[-50:]
    assert sum(1 for _, s, _ in tail if s.get("r0") == DFLASH) >= 45
    hopeless = {("r0", LOOKUP): [0.02] * 15, ("r0", DFLASH): [0.02] * 15}
    sim = TwoSourceSimulator(
        hopeless, {"r0"}, lambda b, w: 0.03 + 0.02 * b * w, 0.01, packed=packed
    )
    policy = sim.policy()
    tail = run(sim, policy, requests(1), 400)[-100:]
    assert sum(1 for d, _, _ in tail if d["r0"]) <= 5  # parked, with rare probes
    assert not policy.wants_lookup("r0")


def test_source_names_and_defaults():
    assert parse_sources("lookup, dflash") == [DFLASH, LOOKUP]
    assert parse_sources("none") == [] and parse_sources(None) is None
    with pytest.raises(ValueError, match="unknown draft sources"):
        parse_sources("eagle")
    assert engine_sources(None, has_dflash=True) == (DFLASH, LOOKUP)
    assert engine_sources(None, has_dflash=False) == (LOOKUP,)
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        engine_sources([DFLASH], has_dflash=False)


def test_scheduler_gives_lookup_only_to_matching_rows_within_each_requests_sources():
    limits = SchedulerLimits()
    scheduler = Scheduler(limits, FixedDepthPolicy(4), 15, {DFLASH: 15, LOOKUP: 6})
    asked = {"a": None, "b": [LOOKUP], "c": [DFLASH], "d": [LOOKUP], "e": []}
    for rid, sources in asked.items():
        params = SamplingParams(max_tokens=100, draft_sources=sources)
        request = Request(rid, [1, 2], params, StopChecker(params))
        request.status = RequestStatus.RUNNING
        scheduler.requests[rid] = request
        scheduler.running.append(request)
    matches = {"a": 3, "b": 2, "c": 4, "d": 0, "e": 4}
    scheduler.apply(StepResult(lookup_matches=matches, draft_backlogs={"a": 40, "c": 2}))
    assert [scheduler.requests[r].draft_backlog for r in "abc"] == [40, 0, 2]
    plan = scheduler.plan()
    assert plan.sources == {"a": LOOKUP, "b": LOOKUP, "c": DFLASH}
    assert plan.depths == {"a": 4, "b": 4, "c": 4, "d": 0, "e": 0}
    assert scheduler.last_parked == {"d": "no_match", "e": "request_disabled"}
    assert plan.lookup_watch == {"a", "b", "d"}


class IntermittentMatchSimulator(TwoSourceSimulator):
    """Lookup matches only on the steps `matches(step)` says (copy-heavy spans now and then)."""

    def __init__(self, matches, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.matches, self.steps, self.all = matches, 0, None

    def step(self, policy, reqs):
        self.all = self.all or {r.request_id for r in reqs}
        self.matched = self.all if self.matches(self.steps) else set()
        self.steps += 1
        return super().step(policy, reqs)


@pytest.mark.parametrize("gap", [2, 5])
def test_lookup_now_and_then_neither_resets_nor_blocks_the_dflash_probe_backoff(gap):
    """Lookup drafts (and is accepted) on 3 steps, then has no match for `gap` steps; DFlash is
    useless. Its probes back off all the same (lookup steps do not reset the cadence), and
    once DFlash turns good it is re-tried and drafts again (lookup steps do not block it)."""
    acceptance = {("r0", LOOKUP): [0.95] * 15, ("r0", DFLASH): [0.02] * 15}
    sim = IntermittentMatchSimulator(
        lambda step: step % (3 + gap) < 3, acceptance, set(),
        lambda b, w: 0.05 + 0.001 * b * w, 0.004, packed=True,
    )  # fmt: skip
    policy, reqs = sim.policy(), requests(1)
    history = run(sim, policy, reqs, 3000)
    dflash_probes = sum(1 for _, _, dflash_rows in history[-2500:] if dflash_rows)
    assert dflash_probes <= 25, dflash_probes  # a chance hit may re-engage it briefly
    assert policy.state()["probe_interval"][DFLASH] >= 256
    acceptance[("r0", DFLASH)] = [0.95] * 15
    history = run(sim, policy, reqs, 1500)
    assert sum(1 for _, _, dflash_rows in history[-200:] if dflash_rows) >= 100


def test_a_held_batch_plans_no_row_and_asks_for_no_lookup_match():
    """A policy holding drafting for this batch size: every row parks for the policy's
    reason, no row's options are worked out, nobody is watched for a lookup match, and
    the runner is told not to match (`StepPlan.match_lookup`)."""

    class Held(FixedDepthPolicy):
        parked_reasons: dict[str, str] = {}

        def holds_drafting(self, batch: int) -> bool:
            return batch >= 2

        def choose_drafts(self, requests, options):
            if self.holds_drafting(len(requests)):
                assert options == {}, "a held step works out no row's options"
                self.parked_reasons = dict.fromkeys(
                    (r.request_id for r in requests), "measured_slower"
                )
                return {r.request_id: 0 for r in requests}, {}
            return {r.request_id: 0 for r in requests}, {}

    scheduler = Scheduler(SchedulerLimits(), Held(4), 15, {DFLASH: 15, LOOKUP: 6})
    for rid in "ab":
        params = SamplingParams(max_tokens=100)
        request = Request(rid, [1, 2], params, StopChecker(params))
        request.status = RequestStatus.RUNNING
        scheduler.requests[rid] = request
        scheduler.running.append(request)
    scheduler.apply(StepResult(lookup_matches={"a": 3, "b": 2}))
    plan = scheduler.plan()
    assert plan.depths == {"a": 0, "b": 0} and not plan.match_lookup
    assert plan.lookup_watch == set()
    assert scheduler.last_parked == {"a": "measured_slower", "b": "measured_slower"}
    scheduler.running.pop()  # one row: not held, planned as before
    plan = scheduler.plan()
    assert plan.match_lookup and plan.lookup_watch == {"a"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_new_request_is_probed_early_whatever_earlier_requests_taught(seed):
    """One request at a time, as a client running a chat benchmark and then an editing one:
    twelve requests whose lookup drafts are nearly always rejected back the lookup probes off,
    then a request that copies (lookup accepted 95%) arrives. Its own acceptance is unknown,
    so it is probed within its first steps and drafts by lookup for most of the rest, instead
    of waiting out a backoff its predecessors earned (seen at c=1 on SmolLM2: editing at
    1.06x mlx-lm in two rounds of three, 1.9x in the third)."""
    acceptance: dict[tuple[str, str], list[float]] = {}
    sim = TwoSourceSimulator(acceptance, set(), lambda b, w: 0.05 + 0.005 * w, 0.004,
                             seed=seed, packed=True)  # fmt: skip
    policy = sim.policy()
    for n in range(13):
        rid = f"q{n}"
        copies = n == 12
        acceptance[(rid, LOOKUP)] = [0.95 if copies else 0.03] * 15
        acceptance[(rid, DFLASH)] = [0.03] * 15
        sim.matched = {rid}
        params = SamplingParams(max_tokens=10**6)
        history = run(sim, policy, [Request(rid, [1, 2, 3], params, StopChecker(params))], 40)
    first_lookup = next(i for i, (_, sources, _) in enumerate(history) if sources.get("q12"))
    assert first_lookup < 8, first_lookup  # FIRST_PROBE_STEPS
    assert sum(1 for _, sources, _ in history if sources.get("q12") == LOOKUP) >= 20


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probe_on_arrival_can_reset_dflash_backoff_too(seed):
    """`probe_on_arrival` with DFlash: after twelve requests whose DFlash drafts were nearly
    always rejected (its backoff grown), a request whose drafts are accepted is probed by
    DFlash within its first steps and drafts from it for most of the rest. (The shipped
    rule resets lookup's backoff only: bench/results/2026-12-07f/dflash-arrival-probe.)"""
    acceptance: dict[tuple[str, str], list[float]] = {}
    sim = TwoSourceSimulator(acceptance, set(), lambda b, w: 0.05 + 0.005 * w, 0.004,
                             seed=seed, packed=True)  # fmt: skip
    policy = sim.policy()
    assert policy.probe_on_arrival == (LOOKUP,)
    policy.probe_on_arrival = (LOOKUP, DFLASH)
    for n in range(13):
        rid = f"q{n}"
        acceptance[(rid, DFLASH)] = [0.9 if n == 12 else 0.03] * 15
        acceptance[(rid, LOOKUP)] = [0.03] * 15
        params = SamplingParams(max_tokens=10**6)
        history = run(sim, policy, [Request(rid, [1, 2, 3], params, StopChecker(params))], 40)
        if n == 11:
            assert policy.state()["probe_interval"][DFLASH] > 8  # backed off by now
    first = next(i for i, (_, sources, _) in enumerate(history) if sources.get("q12"))
    assert first < 8, first
    assert sum(1 for _, sources, _ in history if sources.get("q12") == DFLASH) >= 20
