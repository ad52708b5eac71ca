"""The adaptive depth controller on synthetic cost curves and seeded acceptance streams (no MLX).

A small simulator plays the engine: each step the controller picks depths, acceptance is drawn
per position from each request's true per-position probability, and the step time comes from a
synthetic cost curve: of the padded verify shape (batch x (widest depth + 1)) for a controller
told the verify is padded, or of the packed verify (plain step + per drafted position)."""

from __future__ import annotations

import math
import random

import numpy as np

from engine.step.sampling import SamplingParams
from engine.step.stopping import StopChecker
from scheduler.adaptive import (
    PRIOR_ACCEPTANCE,
    PROBE_BUDGET,
    PROBE_MAX,
    PROBE_ROWS,
    AcceptanceModel,
    AdaptiveDepthPolicy,
    CostCurve,
    MakespanValue,
    acceptance_group,
)
from scheduler.plan import RowOutcome, StepResult
from scheduler.request import Request
from scheduler.sources import DFLASH, LOOKUP, DraftOptions

DECAYING = [0.90, 0.82, 0.72, 0.60, 0.48, 0.40, 0.35, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]


def make_requests(n: int, cap: int | None = None) -> list[Request]:
    out = []
    for i in range(n):
        params = SamplingParams(max_tokens=10**6, num_speculative_tokens=cap)
        out.append(Request(f"r{i}", [1, 2, 3], params, StopChecker(params)))
    return out


def padded_policy() -> AdaptiveDepthPolicy:
    return AdaptiveDepthPolicy(packed=False)


def busy(policy: AdaptiveDepthPolicy) -> AdaptiveDepthPolicy:
    """A controller told that requests wait behind the batch, as in a busy server: a row that
    finishes early is replaced, so every committed token is worth the same (the steady state
    these never-ending simulated requests stand for)."""
    policy.observe_queue(4)
    return policy


class Simulator:
    def __init__(
        self, cost, acceptance, seed: int = 0, drafter_cost: float = 0.0, packed: bool = False
    ) -> None:
        # padded: (batch, width) -> seconds; packed: (batch, depths) -> seconds
        self.cost = cost
        self.acceptance = acceptance  # request id -> per-position probabilities
        self.rng = random.Random(seed)
        self.drafter_cost = drafter_cost
        self.packed = packed
        self.seconds = 0.0  # simulated time so far

    def step(self, policy, requests, outlier: float = 1.0) -> dict[str, int]:
        depths = policy.choose(requests, 15)
        width = max(depths.values()) + 1
        outcomes = {}
        for r in requests:
            d = depths[r.request_id]
            accepted = 0
            for p in self.acceptance(r.request_id)[:d]:
                if self.rng.random() >= p:
                    break
                accepted += 1
            outcomes[r.request_id] = RowOutcome([0] * (accepted + 1), d, accepted)
        drafting = any(depths.values())
        if self.packed:
            seconds = self.cost(len(requests), list(depths.values()))
            verify_tokens = sum(1 + d for d in depths.values())
        else:
            seconds = self.cost(len(requests), width)
            verify_tokens = len(requests) * width
        seconds += self.drafter_cost if drafting else 0.0
        self.seconds += seconds * outlier
        committed = sum(len(o.tokens) for o in outcomes.values())
        self.tokens = getattr(self, "tokens", 0) + committed
        result = StepResult(
            outcomes=outcomes, batch_size=len(requests), verify_tokens=verify_tokens,
            drafted_rows=sum(1 for d in depths.values() if d), step_seconds=seconds * outlier,
            phase_seconds={"forward": seconds * outlier},
        )  # fmt: skip
        policy.observe(result)
        return depths

    def run(self, policy, requests, steps: int) -> list[dict[str, int]]:
        return [self.step(policy, requests) for _ in range(steps)]


def settled_width(history: list[dict[str, int]], last: int = 50) -> float:
    tail = history[-last:]
    return sum(max(d.values()) for d in tail) / len(tail)


def test_deep_when_the_cost_is_flat():
    sim = Simulator(lambda b, w: 0.210 + 0.0026 * b * w, lambda _: DECAYING)
    history = sim.run(padded_policy(), make_requests(1), 300)
    assert settled_width(history) >= 5


def test_shallow_when_the_cost_is_steep():
    sim = Simulator(lambda b, w: 0.030 + 0.019 * b * w, lambda _: DECAYING)
    history = sim.run(padded_policy(), make_requests(1), 300)
    assert 0 < settled_width(history) <= 4


def test_zero_when_drafting_does_not_pay_and_the_plain_path_runs():
    sim = Simulator(lambda b, w: 0.030 + 0.019 * b * w, lambda _: [0.05] * 15)
    policy = padded_policy()
    history = sim.run(policy, make_requests(2), 400)
    parked = [d for d in history[-100:] if not any(d.values())]
    assert len(parked) >= 95  # only rare probes draft
    assert policy.parked_reasons and set(policy.parked_reasons.values()) <= {
        "low_acceptance", "not_worth_it"
    }  # fmt: skip


def test_explores_before_the_cost_is_known_and_climbs_one_position_at_a_time():
    sim = Simulator(lambda b, w: 0.210 + 0.0026 * b * w, lambda _: [1.0] * 15)
    policy = padded_policy()
    history = sim.run(policy, make_requests(1), 40)
    widths = [max(d.values()) for d in history]
    assert widths[0] == 0  # nothing measured yet: plain decoding first
    seen = 0
    for w in widths:
        assert w <= seen + 1  # never beyond the widest measured depth + 1
        seen = max(seen, w)
    assert widths[-1] == 15


def test_one_outlier_step_does_not_flip_the_choice():
    sim = Simulator(lambda b, w: 0.100 + 0.004 * b * w, lambda _: DECAYING, seed=3)
    policy = padded_policy()
    requests = make_requests(1)
    sim.run(policy, requests, 200)
    before = settled_width(sim.run(policy, requests, 30), 30)
    sim.step(policy, requests, outlier=3.0)  # one 3x stall
    after = settled_width(sim.run(policy, requests, 30), 30)
    assert abs(after - before) <= 1.5


def test_probe_backoff_while_parked_and_prompt_reengagement():
    quality = {"p": [0.02] * 15}
    sim = Simulator(lambda b, w: 0.050 + 0.004 * b * w, lambda _: quality["p"], seed=1)
    policy = padded_policy()
    requests = make_requests(1)
    history = sim.run(policy, requests, 4096)
    probes = sum(1 for d in history[-3000:] if any(d.values()))
    assert probes <= 12
    assert policy.state()["probe_interval"]["dflash"] == PROBE_MAX
    quality["p"] = [0.95] * 15  # acceptance returns
    history = sim.run(policy, requests, 2 * PROBE_MAX + 200)
    assert settled_width(history, 100) >= 5


def test_tracks_acceptance_drift():
    quality = {"p": DECAYING}
    sim = Simulator(lambda b, w: 0.050 + 0.004 * b * w, lambda _: quality["p"], seed=2)
    policy = padded_policy()
    requests = make_requests(1)
    high = settled_width(sim.run(policy, requests, 300))
    quality["p"] = [0.25] * 15
    low = settled_width(sim.run(policy, requests, 300))
    assert low < high


def test_depth_shrinks_as_the_batch_grows_under_compute_bound_cost():
    cost = lambda b, w: 0.020 + 0.006 * b * w  # noqa: E731
    widths = {}
    for batch in (1, 4, 32):
        sim = Simulator(cost, lambda _: DECAYING, seed=batch)
        widths[batch] = settled_width(sim.run(padded_policy(), make_requests(batch), 300))
    assert widths[1] > widths[4] >= widths[32]
    assert widths[32] < 1


def test_high_acceptance_requests_get_depth_first():
    rates = {"r0": [0.95] * 15, "r1": [0.3] * 15}
    sim = Simulator(lambda b, w: 0.200 + 0.003 * b * w, lambda rid: rates[rid], seed=4)
    policy = busy(padded_policy())
    history = sim.run(policy, make_requests(2), 300)
    tail = history[-50:]
    assert sum(d["r0"] for d in tail) > 2 * sum(d["r1"] for d in tail)


def test_request_caps_and_budgets_are_respected():
    sim = Simulator(lambda b, w: 0.210 + 0.001 * b * w, lambda _: [1.0] * 15)
    policy = padded_policy()
    capped = make_requests(2, cap=3)
    history = sim.run(policy, capped, 100)
    assert max(max(d.values()) for d in history) <= 3
    off = make_requests(1, cap=0)
    assert all(d["r0"] == 0 for d in sim.run(padded_policy(), off, 50))


def test_parked_policy_predicts_the_next_step_plain_except_probes():
    """`expects_plain_next` (the runner's lookahead hint) is right on almost every parked step
    and false exactly before the steps that probe."""
    sim = Simulator(lambda b, w: 0.030 + 0.019 * b * w, lambda _: [0.05] * 15)
    policy = padded_policy()
    requests = make_requests(2)
    sim.run(policy, requests, 200)
    misses = probes = 0
    for _ in range(600):
        predicted_plain = policy.expects_plain_next()
        depths = sim.step(policy, requests)
        probes += any(depths.values())
        misses += predicted_plain == any(depths.values())
    assert misses == 0 and probes >= 2


# ------------------------------------------------------------------ packed verify
def packed_cost(plain_base: float, per_row: float, drafter: float, per_position: float):
    """A packed step: the plain step of B rows, plus (when anyone drafts) a drafter forward
    and a cost per drafted position."""

    def cost(batch: int, depths: list[int]) -> float:
        extra = drafter + per_position * sum(depths) if any(depths) else 0.0
        return plain_base + per_row * batch + extra

    return cost


def tokens_per_second(sim: Simulator, policy, requests, steps: int) -> float:
    sim.seconds, sim.tokens = 0.0, 0
    sim.run(policy, requests, steps)
    return sim.tokens / sim.seconds


class DraftingOff:
    def choose(self, requests, max_depth):
        return {r.request_id: 0 for r in requests}

    def observe(self, result) -> None:
        pass


def test_packed_gives_depth_to_the_request_that_earns_it():
    """One request accepts almost everything, seven almost nothing: only the first drafts
    (deeply), the others decode plainly in the same steps — nobody pays for its depth."""
    rates = {f"r{i}": [0.95] * 15 if i == 0 else [0.05] * 15 for i in range(8)}
    cost = packed_cost(0.010, 0.0014, 0.002, 0.0008)
    sim = Simulator(cost, lambda rid: rates[rid], seed=5, packed=True)
    history = sim.run(busy(AdaptiveDepthPolicy()), make_requests(8), 400)
    tail = history[-100:]
    assert sum(d["r0"] for d in tail) / len(tail) >= 4
    others = sum(d[f"r{i}"] for d in tail for i in range(1, 8))
    assert others <= len(tail) // 10


def test_packed_probes_draft_one_position_for_a_few_rows_in_turn():
    """Parked at 32 rows, a probe drafts depth 1 for at most PROBE_ROWS rows (a few packed
    positions, not a batch-wide width), and successive probes visit different rows."""
    cost = packed_cost(0.010, 0.0014, 0.004, 0.0015)
    sim = Simulator(cost, lambda _: [0.05] * 15, seed=6, packed=True)
    policy = AdaptiveDepthPolicy()
    history = sim.run(policy, make_requests(32), 1500)
    probes = [d for d in history[100:] if any(d.values())]
    assert probes
    probed = set()
    for depths in probes:
        drafting = {rid: d for rid, d in depths.items() if d}
        assert len(drafting) <= PROBE_ROWS and set(drafting.values()) == {1}
        probed |= set(drafting)
    assert len(probed) >= min(32, 2 * len(probes)) // 2


def test_packed_explores_at_most_twice_the_positions_measured():
    sim = Simulator(packed_cost(0.2, 0.001, 0.0, 0.001), lambda _: [1.0] * 15, packed=True)
    policy = AdaptiveDepthPolicy()
    history = sim.run(policy, make_requests(1), 60)
    seen = 0
    for depths in history:
        extra = sum(depths.values())
        assert extra <= max(1, 2 * seen)
        seen = max(seen, extra)
    assert sum(history[-1].values()) == 15


def test_packed_adaptive_is_never_slower_than_drafting_off():
    """Simulated goodput (tokens per simulated second) at 32 rows where drafting does not pay
    however good the drafts (the bundled pair's costs on the 2-core CPU), and at 1 row where
    it does: adaptive is within 3% of drafting off, and ahead where drafting pays."""
    cases = [
        (32, packed_cost(0.010, 0.0014, 0.006, 0.0015)),
        (1, packed_cost(0.006, 0.0008, 0.0015, 0.0006)),
    ]
    for batch, cost in cases:
        rates = {}
        for name, policy in (("off", DraftingOff()), ("adaptive", AdaptiveDepthPolicy())):
            sim = Simulator(cost, lambda _: DECAYING, seed=batch, packed=True)
            requests = make_requests(batch)
            sim.run(policy, requests, 100)  # warm up (the controller learns the costs)
            rates[name] = tokens_per_second(sim, policy, requests, 600)
        assert rates["adaptive"] >= 0.97 * rates["off"], (batch, rates)
        if batch == 1:
            assert rates["adaptive"] > 1.2 * rates["off"], rates


def test_a_drafting_step_beside_an_unmeasured_prefill_does_not_poison_the_extra_cost():
    """The extra cost of drafts is the step's time less a plain step of the same size; beside
    a prefill chunk of a size never measured plainly, that residual is a guess and is not
    learned."""
    from scheduler.adaptive import CostModel

    cost = CostModel(packed=True)
    for _ in range(5):
        cost.observe(8, 8, 0, False, 0.25)  # plain steps of 8 rows
        cost.observe(8, 10, 0, False, 0.30)  # 2 extra positions
    before = cost.predict_extra(8, 19, drafting=False)
    cost.observe(8, 27, 1024, False, 2.3)  # drafts beside an unmeasured 1024-token chunk
    assert cost.predict_extra(8, 19, drafting=False) == before
    for _ in range(5):
        cost.observe(8, 8, 1024, False, 1.0)  # that chunk size measured plainly
    cost.observe(8, 27, 1024, False, 1.2)
    assert cost.extra[(3, False)].measured(19)


def run_wave(policy, rates, cost, tokens: int, seed: int) -> tuple[float, int]:
    """Serve one wave of requests of `tokens` tokens each to the end, none waiting behind
    them: (simulated seconds until the last one finished, steps where anyone drafted)."""
    rng = random.Random(seed)
    requests = []
    for rid in rates:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        requests.append(Request(rid, [1, 2, 3], params, StopChecker(params)))
    seconds, drafting_steps = 0.0, 0
    while requests:
        depths = policy.choose(requests, 15)
        outcomes = {}
        for r in requests:
            d, accepted = depths[r.request_id], 0
            for p in rates[r.request_id][:d]:
                if rng.random() >= p:
                    break
                accepted += 1
            committed = [0] * min(accepted + 1, r.params.max_tokens - r.generated)
            r.stop.add(committed)
            outcomes[r.request_id] = RowOutcome(committed, d, accepted)
        step = cost(len(requests), list(depths.values()))
        seconds += step
        drafting_steps += any(depths.values())
        policy.observe(StepResult(
            outcomes=outcomes, batch_size=len(requests),
            verify_tokens=sum(1 + d for d in depths.values()),
            drafted_rows=sum(1 for d in depths.values() if d), step_seconds=step,
            phase_seconds={"forward": step},
        ))  # fmt: skip
        requests = [r for r in requests if r.generated < r.params.max_tokens]
    return seconds, drafting_steps


def test_with_nobody_waiting_a_lockstep_batch_is_not_desynchronised_for_nothing():
    """Eight requests of 48 tokens in lockstep, nobody waiting, on a CPU-like curve where 8 rows
    cost little more than 4: drafting for the four predictable rows only makes them end first,
    and the batch runs on for the other four at nearly the same cost. Valued by the step time
    it saves, it is (almost) never chosen, and the wave ends no later than with drafting off
    (valuing every token alike, it drafts on ~15 steps and the wave takes 5-11% longer). Told
    that requests wait (a finished row is replaced at once), the same rows draft: then their
    tokens are worth a row's share of the step."""
    rates = {f"r{i}": [0.9] * 15 if i < 4 else [0.05] * 15 for i in range(8)}
    cost = packed_cost(0.200, 0.003, 0.02, 0.004)
    off, _ = run_wave(DraftingOff(), rates, cost, 48, seed=1)
    profile = [(b, 1, cost(b, [0] * b)) for b in (1, 2, 4, 8)]
    for waiting in (0, 3):
        policy = AdaptiveDepthPolicy()
        policy.seed(profile)
        policy.observe_queue(waiting)
        run_wave(policy, rates, cost, 48, seed=0)  # learns the costs and the acceptance prior
        adaptive, drafting_steps = run_wave(policy, rates, cost, 48, seed=1)
        if waiting:
            assert drafting_steps >= 10
        else:
            assert adaptive <= 1.02 * off, (adaptive, off)
            assert drafting_steps <= 4  # probes


def test_with_nobody_waiting_every_row_drafting_is_still_worth_a_whole_step():
    """The same lockstep wave, but every row predictable: drafting for all of them shortens
    the whole batch, so it is chosen and the wave ends well before drafting off's."""
    rates = {f"r{i}": [0.9] * 15 for i in range(8)}
    cost = packed_cost(0.200, 0.005, 0.010, 0.004)
    off, _ = run_wave(DraftingOff(), rates, cost, 48, seed=2)
    policy = AdaptiveDepthPolicy()
    policy.seed([(b, 1, cost(b, [0] * b)) for b in (1, 2, 4, 8)])
    adaptive, _ = run_wave(policy, rates, cost, 48, seed=2)
    assert adaptive < 0.6 * off, (adaptive, off)


def test_the_plain_estimate_keeps_the_least_of_its_first_samples_and_rises_slowly():
    """Step-time noise only adds time (a stall, a join's copies): a slow first plain step must
    not stand for the plain cost (it made every draft look free at 32 clients)."""
    from scheduler.adaptive import CostModel

    cost = CostModel()
    cost.observe(32, 32, 0, False, 0.22)  # the first step after a join
    cost.observe(32, 32, 0, False, 0.105)
    assert abs(cost.predict_plain(32) - 0.105) < 1e-9
    for _ in range(3):
        cost.observe(32, 32, 0, False, 0.105)
    cost.observe(32, 32, 0, False, 0.5)  # one stall later moves it only a little
    assert cost.predict_plain(32) < 0.2


def test_an_extra_cost_curve_that_first_saw_free_extras_still_learns_a_costly_one():
    from scheduler.adaptive import CostModel

    cost = CostModel()
    for _ in range(5):
        cost.observe(32, 32, 0, False, 0.105)
    for _ in range(4):  # 63 lookup positions measured as free (against a wrong plain)
        cost.observe(32, 95, 0, False, 0.105)
    for _ in range(4):  # then as they are: 170 ms more than a plain step
        cost.observe(32, 95, 0, False, 0.275)
    assert cost.predict_extra(32, 63, drafting=False) > 0.1


def test_a_drafting_step_faster_than_the_plain_estimate_lowers_it_and_prices_nothing():
    """A step that drafted cannot cost less than a plain step of its rows: one that does says
    the plain estimate is stale (taken while the machine was slower), not that drafting is
    free. Read as a free extra, it kept drafts accepted 3% of the time looking worth a drafter
    forward (bundled pair, 4 rows, while nobody waits)."""
    from scheduler.adaptive import CostModel

    cost = CostModel()
    for _ in range(4):
        cost.observe(4, 4, 0, False, 0.0055)  # plain steps while the machine was busy
    for _ in range(6):
        cost.observe(4, 12, 0, True, 0.005)  # drafting steps, after it sped up
    assert cost.predict_plain(4) < 0.0051
    assert not cost.extra  # no residual learned from a step faster than the plain estimate
    cost.observe(4, 12, 0, True, 0.0075)
    assert abs(cost.predict_extra(4, 8) - (0.0075 - cost.predict_plain(4))) < 1e-9


def test_a_drafting_step_is_charged_its_cadence_and_a_run_its_end_once():
    """With the loop's cadence known, a step costs what it takes from the loop: a plain step
    its (overlapped) cadence, a drafting step its own cadence. The plain step right after a
    draft runs without a lookahead: its excess is what ending the drafting run costs, learned
    apart and priced once per run, when a choice starts one."""
    policy = AdaptiveDepthPolicy()

    def step(verify_tokens: int, drafted_rows: int, cadence: float, forward: float) -> None:
        policy.observe(StepResult(batch_size=8, verify_tokens=verify_tokens,
                                  drafted_rows=drafted_rows, cadence_seconds=cadence,
                                  forward_seconds=forward))  # fmt: skip

    for _ in range(4):
        step(8, 0, 0.0129, 0.0141)  # plain: the forward overlaps the loop's work
    assert abs(policy.cost.predict_plain(8) - 0.0129) < 1e-9
    assert policy.exit_price(8) == 0.0  # no run has ended yet
    step(24, 8, 0.0242, 0.0204)  # drafting: charged its own cadence
    assert abs(policy.cost.predict_extra(8, 16) - (0.0242 - 0.0129)) < 1e-9
    assert policy.entry_price(8) == 0.0  # a draft now continues the run
    step(8, 0, 0.0180, 0.0141)  # the plain step after it, without its lookahead
    assert abs(policy.exit_price(8) - 0.0051) < 1e-9  # the run's end
    assert abs(policy.cost.predict_extra(8, 16) - (0.0242 - 0.0129)) < 1e-9  # not the draft's
    assert abs(policy.cost.predict_plain(8) - 0.0129) < 1e-9  # nor a plain step's
    assert abs(policy.entry_price(8) - 0.0051) < 1e-9  # a draft now starts a run: pays its end
    step(24, 8, 0.0242, 0.0204)
    step(24, 8, 0.0250, 0.0204)  # drafting after drafting: each its own cadence
    first = 0.0242 - 0.0129
    assert abs(policy.cost.predict_extra(8, 16) - (first + 0.2 * (0.0121 - first))) < 1e-9
    step(8, 0, 0.0160, 0.0141)  # another run's end
    assert abs(policy.exit_price(8) - (0.0051 + 0.2 * (0.0031 - 0.0051))) < 1e-9
    step(8, 0, 0.0, 0.0141)  # the loop idled before this step: no cadence, its forward
    extra, plain = policy.cost.predict_extra(8, 16), policy.cost.predict_plain(8)
    step(24, 8, 0.0300, 0.0204)
    policy.observe(StepResult(batch_size=0, prefill_tokens=64, cadence_seconds=0.2))
    assert abs(policy.cost.predict_extra(8, 16) - (extra + 0.2 * (0.03 - plain - extra))) < 1e-9
    ended = policy.exit_price(8)
    policy.observe(StepResult(batch_size=8, verify_tokens=8, prefill_tokens=16,
                              cadence_seconds=0.05, forward_seconds=0.05))  # fmt: skip
    assert policy.exit_price(8) == ended  # a prefill step after a draft says nothing of it
    # Before any run ended at a batch size, the nearest size's end, scaled by plain steps.
    _plain_steps(policy, 16, 0.0258)
    assert abs(policy.exit_price(16) - ended * 0.0258 / policy.cost.predict_plain(8)) < 1e-9


def _one_dflash_row(first: float):
    """A controller that measured a 58 ms plain step of one row, and that row (DFlash up to
    depth 3, first-draft acceptance `first`, 0.4 then 0.3 after); (policy, requests, id,
    options, step), where step(seconds, drafted, looked_ahead=False) observes a step."""
    requests = make_requests(1)
    rid = requests[0].request_id
    options = {rid: DraftOptions((DFLASH,), 0, {DFLASH: 3})}
    policy = AdaptiveDepthPolicy(warmup_steps=0)
    _plain_steps(policy, 1, 0.058)
    policy.acceptance.per_request[rid] = [first, 0.4, 0.3] + [0.3] * (policy.max_depth - 3)

    def step(seconds: float, drafted: bool, looked_ahead: bool = False) -> None:
        policy.observe(StepResult(
            batch_size=1, verify_tokens=2 if drafted else 1, drafted_rows=int(drafted),
            cadence_seconds=seconds, forward_seconds=0.0725 if drafted else 0.058,
            looked_ahead=looked_ahead,
        ))  # fmt: skip

    return policy, requests, rid, options, step


def test_a_drafting_run_is_continued_where_starting_one_would_not_pay():
    """Drafting that pays step by step is kept up once started (by a probe), even where
    starting it after a plain step, which pays for the run's end, would not pay: SmolLM2 at
    c=1 drafted DFlash at depth 1 for 1.12x of plain on chat in one run, but with every
    drafting step charged the run's end the controller stayed plain (0.96x)."""
    policy, requests, rid, options, step = _one_dflash_row(0.4)
    for _ in range(4):  # a run of depth-1 drafts, 14.5 ms dearer than a plain step
        step(0.0725, True)
    step(0.093, False)  # the run's end: 35 ms lost
    depths, _ = policy.choose_drafts(requests, options)
    # after a plain step: 1.4 tokens in 72.5 ms + the end's share (35 ms over runs of 1.6
    # steps) against 1 in 58
    assert depths[rid] == 0
    step(0.0725, True)  # a probe drafts
    depths, sources = policy.choose_drafts(requests, options)
    assert depths[rid] >= 1 and sources[rid] == DFLASH  # continued: 1.4 tokens in 72.5 ms


def test_a_run_that_pays_but_for_the_pending_lookahead_starts_without_one():
    """A parked valuation that loses only the lookahead it would throw away tells the runner
    to launch none, so the next step starts the run at the price of the run's end alone. Each
    parked step used to launch one, so every start of a run paid a whole thrown-away plain
    step on top: SmolLM2 at c=1 on chat drafted on 3% of steps, where depth 1 in a run pays."""
    policy, requests, rid, options, step = _one_dflash_row(0.7)
    for _ in range(4):  # a run of depth-1 drafts, 14.5 ms dearer than a plain step
        step(0.0725, True)
    step(0.078, False, looked_ahead=True)  # the run's end (20 ms lost), a lookahead after it
    depths, _ = policy.choose_drafts(requests, options)
    # 1.7 tokens in 72.5 + 20 ms beats 1 in 58, but not with 58 more thrown away
    assert depths[rid] == 0
    assert not policy.expects_plain_next()  # so no lookahead now
    step(0.058, False)
    depths, sources = policy.choose_drafts(requests, options)
    assert depths[rid] >= 1 and sources[rid] == DFLASH


def test_a_run_start_pays_its_end_over_the_length_runs_have_lasted():
    """The end of a drafting run comes once a run: where runs have lasted several steps, a
    start pays a share of it, and a run that gains step by step is started after a plain
    step (charged its whole end, such a run started only where one step paid for it)."""
    policy, requests, rid, options, step = _one_dflash_row(0.4)
    assert policy.run_length == 1.0
    for _ in range(6):  # runs of 8 depth-1 drafts (14.5 ms dearer), each ended (20 ms lost)
        for _ in range(8):
            step(0.0725, True)
        step(0.078, False)
    assert 5 < policy.run_length < 8
    depths, sources = policy.choose_drafts(requests, options)
    # 1.4 tokens in 72.5 + 20 / 6 ms against 1 in 58 (with the whole end: 92.5 ms, plain)
    assert depths[rid] >= 1 and sources[rid] == DFLASH


def test_a_new_batch_size_is_first_measured_plain():
    """Drafts are judged against the plain step of the batch's size: the controller takes
    that step plain before it drafts, however good the drafts (else a guessed plain cost
    stands for ever, as drafting steps never measure it)."""
    sim = Simulator(lambda b, w: 0.030 + 0.001 * b * w, lambda _: [0.95] * 15)
    policy = busy(AdaptiveDepthPolicy())
    for size in (1, 4, 16):
        requests = make_requests(size)
        first = sim.step(policy, requests)
        assert not any(first.values()), size
        later = [sim.step(policy, requests) for _ in range(6)]
        assert any(any(d.values()) for d in later), size


def test_the_shared_prior_leaves_its_starting_value_after_a_few_observations():
    """A fresh engine's prior is a shrunk mean of everyone's recent observations: a dozen
    rejections (or acceptances) move it most of the way, and over many it tracks the rate."""
    for hit, check in ((0, lambda p: p < 0.2), (1, lambda p: p > 0.85)):
        model = AcceptanceModel(4)
        assert model.prior[0] == PRIOR_ACCEPTANCE
        for i in range(12):
            model.observe(f"r{i % 3}", 1, hit)
        assert check(model.prior[0]), model.prior
        assert model.prior[1] == PRIOR_ACCEPTANCE  # position 2 was never judged
    model = AcceptanceModel(4)
    for i in range(1000):  # accepted 3 times in 10
        model.observe("r", 1, int(i % 10 < 3))
    assert abs(model.prior[0] - 0.3) < 0.06, model.prior


def test_a_request_estimate_averages_its_first_judgements_then_follows_an_ewma():
    """A request's first judgements count fully against its group's prior (2 pseudo-counts),
    so 4 rejections out of 4 leave 0.2, not the 0.31 an EWMA from the prior kept (0.6 x
    0.85^4); past a window's worth it is the EWMA, so it still tracks drift."""
    model = AcceptanceModel(4)
    for _ in range(4):
        model.observe("bad", 1, 0)
    assert abs(model.estimate("bad")[0] - 2 * PRIOR_ACCEPTANCE / 6) < 1e-9
    assert model.estimate("bad")[1] == PRIOR_ACCEPTANCE  # never judged
    start = model.estimate("good")[0]  # the group's prior, which learned those rejections
    assert start < PRIOR_ACCEPTANCE
    model.observe("good", 1, 1)
    assert abs(model.estimate("good")[0] - (2 * start + 1) / 3) < 1e-9
    for _ in range(40):  # drift: the bad request starts being accepted
        model.observe("bad", 1, 1)
    assert model.estimate("bad")[0] > 0.95
    before = model.estimate("bad")[0]
    model.observe("bad", 1, 0)  # settled: one rejection moves it by the EWMA step (0.15)
    assert abs(model.estimate("bad")[0] - 0.85 * before) < 1e-9
    model.forget("bad")
    assert "bad" not in model.observed


def test_each_acceptance_group_keeps_its_own_prior():
    """Greedy rows' acceptance does not set where a sampled request starts: each group
    (greedy, temperature bands) learns its own prior, and a request starts at its group's."""
    assert acceptance_group(0.0) == "greedy"
    assert acceptance_group(0.3) != acceptance_group(1.0) != acceptance_group(1.5)
    model = AcceptanceModel(4)
    for i in range(40):
        model.enroll(f"g{i}", "greedy")
        model.observe(f"g{i}", 1, 1)  # greedy drafts accepted
        model.enroll(f"s{i}", "T<=1")
        model.observe(f"s{i}", 1, 0)  # sampled drafts rejected
    assert model.prior[0] > 0.85 and model.groups["T<=1"].prior[0] < 0.15
    model.enroll("new-greedy", "greedy")
    model.enroll("new-sampled", "T<=1")
    assert model.estimate("new-greedy")[0] > 0.85
    assert model.estimate("new-sampled")[0] < 0.15
    model.forget("new-sampled")
    assert "new-sampled" not in model.group_of


def test_a_sampled_request_does_not_draft_on_the_greedy_rows_record():
    """Served one after another (c=1, as the benchmark's cells run), greedy requests whose
    drafts are accepted and sampled ones whose drafts are not: once each group has learned,
    a new sampled request starts parked instead of drafting deep on the greedy record (with
    one prior for all, every new T=1 request drafted until its own rejections parked it)."""
    truth = {"greedy": [0.9] * 15, "T<=1": [0.02] * 15}
    group_of: dict[str, str] = {}
    sim = Simulator(
        lambda b, depths: 0.010 + 0.004 * sum(depths), lambda rid: truth[group_of[rid]],
        packed=True,
    )  # fmt: skip
    policy = AdaptiveDepthPolicy()
    first_steps = []
    for i in range(12):
        for temperature, group in ((0.0, "greedy"), (1.0, "T<=1")):
            params = SamplingParams(max_tokens=10**6, temperature=temperature)
            request = Request(f"{group}-{i}", [1, 2, 3], params, StopChecker(params))
            group_of[request.request_id] = group
            depths = [sim.step(policy, [request]) for _ in range(30)]
            if group == "T<=1" and i >= 6:  # its first 5 steps: one probe position at most
                first_steps.append(sum(d[request.request_id] for d in depths[:5]))
            policy.observe(StepResult())  # the request leaves
    assert max(first_steps) <= 1, first_steps


def test_a_drafter_catch_up_teaches_the_cost_model_nothing():
    """A step whose drafter forward also wrote a session's backlog (its prompt at its first
    proposal, or rows committed while it sat out) is left out of the cost model: its one-off
    cost is not what one more draft costs. (The guard still counts it: a held batch never
    pays it.)"""
    policy = AdaptiveDepthPolicy(warmup_steps=0)

    def step(context_rows: int, seconds: float, depth: int = 3) -> None:
        policy.observe(StepResult(
            outcomes={"r": RowOutcome([1, 2][: 1 + bool(depth)], depth, int(bool(depth)))},
            batch_size=1, verify_tokens=1 + depth, drafted_rows=int(bool(depth)),
            draft_context_rows=context_rows, step_seconds=seconds, forward_seconds=seconds,
        ))  # fmt: skip

    for _ in range(3):
        step(context_rows=0, seconds=0.010, depth=0)  # plain steps
    step(context_rows=2, seconds=0.020)  # steady drafting: 2 rows since the last proposal
    learned = policy.cost.predict(1, [3], drafting=True)
    step(context_rows=400, seconds=0.500)  # a 400-row catch-up
    assert policy.cost.predict(1, [3], drafting=True) == learned
    step(context_rows=4, seconds=0.500)  # as slow without a catch-up: that is learned
    assert policy.cost.predict(1, [3], drafting=True) > learned


def test_a_dflash_probe_is_priced_with_the_catch_up_of_the_rows_it_probes():
    """A parked DFlash probe drafts for the rows that drafted least recently, and their first
    proposal writes their backlog (the prompt, the steps they sat out). The controller learns
    a backlog row's cost from catch-up steps and spaces probes so that, catch-ups included,
    they stay within PROBE_BUDGET of the time."""
    policy = AdaptiveDepthPolicy(warmup_steps=0)
    requests = make_requests(8)

    def step(verify_tokens: int, drafted_rows: int, context_rows: int, seconds: float) -> None:
        outcomes = {r.request_id: RowOutcome([1], 0, 0) for r in requests}
        for r in requests[:drafted_rows]:
            outcomes[r.request_id] = RowOutcome([1], 1, 0, "dflash")
        policy.observe(StepResult(outcomes=outcomes, batch_size=8, verify_tokens=verify_tokens,
                                  drafted_rows=drafted_rows, draft_context_rows=context_rows,
                                  forward_seconds=seconds))  # fmt: skip

    for _ in range(4):
        step(8, 0, 0, 0.010)  # plain steps of 10 ms
    step(10, 2, 4, 0.013)  # a probe of two rows without a backlog: 3 ms more
    assert policy.catchup_row_seconds == 0.0
    policy._last_batch = 8  # the batch a floor is priced at (each choice sets it; none yet)
    floor_without = policy.probe_floor("dflash")
    assert abs(floor_without - 0.003 / (PROBE_BUDGET * 0.010)) <= 1  # (rounded up)
    step(10, 2, 400, 0.053)  # the same writing 400 backlog rows: 40 ms more, 0.1 ms a row
    assert abs(policy.catchup_row_seconds - 1e-4) < 1e-9
    assert policy.cost.predict(8, [1, 1] + [0] * 6, drafting=True) < 0.0131  # one-off: not here

    for r in requests:  # parked (nothing accepted) with a prompt of 150 rows each unwritten
        r.draft_backlog = 150
        for model in policy.models.values():
            model.per_request[r.request_id] = [0.0] * policy.max_depth
    policy.choose(requests, 3)
    floor = policy.state()["probe_floor"]["dflash"]
    catch_up = 2 * 149 * 1e-4  # beyond the one row every proposal writes
    assert abs(floor - (0.003 + catch_up) / (PROBE_BUDGET * 0.010)) <= 1
    assert floor > 10 * floor_without
    assert policy.probe_floor("lookup") <= floor_without  # lookup writes no backlog
    # Once lookup is usable too, the two sources share the budget: each probes half as often.
    both = DraftOptions((DFLASH, LOOKUP), 4, {DFLASH: 3, LOOKUP: 3})
    policy.choose_drafts(requests, dict.fromkeys((r.request_id for r in requests), both))
    shared = (0.003 + catch_up) / (PROBE_BUDGET / 2 * 0.010)
    assert abs(policy.probe_floor(DFLASH) - shared) <= 1


def _plain_steps(policy: AdaptiveDepthPolicy, batch: int, seconds: float, n: int = 4) -> None:
    for _ in range(n):
        policy.observe(StepResult(batch_size=batch, verify_tokens=batch, forward_seconds=seconds))


def test_a_looked_ahead_step_thrown_away_is_priced_into_drafting_and_not_charged_to_it():
    """When the runner launched the next plain step ahead, drafting now throws that forward
    away: a drafting choice pays for it (learned as a share of a plain step), and the cost
    curves are not charged for it (bundled pair, 8 rows: ~10 ms of a 12 ms step went to
    discarded lookaheads, which made later drafting steps look dearer, and unpriced, made
    single drafting steps between parked ones look worth it)."""
    requests = make_requests(8)
    for r in requests:
        r.lookup_match = 4
    ids = [r.request_id for r in requests]
    options = dict.fromkeys(ids, DraftOptions((LOOKUP,), 4, {LOOKUP: 4}))

    def decide(looked_ahead: bool) -> int:
        policy = AdaptiveDepthPolicy(warmup_steps=0)
        _plain_steps(policy, 8, 0.010)
        for _ in range(4):  # 8 lookup drafts cost 2 ms more a step (no drafter forward)
            policy.observe(StepResult(batch_size=8, verify_tokens=16, forward_seconds=0.012))
        for r in requests:
            policy.lookup_acceptance.per_request[r.request_id] = [0.6] * policy.max_depth
        policy.observe(StepResult(batch_size=8, verify_tokens=8, forward_seconds=0.010,
                                  looked_ahead=looked_ahead))  # fmt: skip
        depths, _ = policy.choose_drafts(requests, options)
        return sum(depths.values())

    assert decide(looked_ahead=False) > 0  # 12.8 tokens in 12 ms against 8 in 10
    assert decide(looked_ahead=True) == 0  # not with a 10 ms plain step thrown away too

    policy = AdaptiveDepthPolicy(warmup_steps=0)
    _plain_steps(policy, 8, 0.010)
    policy.observe(StepResult(batch_size=8, verify_tokens=16, drafted_rows=0, cadence_seconds=0.024,
                              forward_seconds=0.013, discarded_seconds=0.008))  # fmt: skip
    assert abs(policy.discard_share - 0.8) < 1e-9
    policy.observe(StepResult(batch_size=8, verify_tokens=8, cadence_seconds=0.010,
                              forward_seconds=0.011))  # fmt: skip
    # charged its cadence less the thrown-away forward: 24 - 8 = 16 ms, 6 ms over plain
    assert abs(policy.cost.predict_extra(8, 8, drafting=False) - 0.006) < 1e-9


def test_a_merit_choice_pays_for_the_backlog_its_dflash_rows_write_first():
    """A row whose DFlash session sat out writes its backlog in the drafter forward that
    drafts for it: a choice on the merits is priced with it, as a probe is. Without it, rows
    with a prompt or long pause unwritten were drafted at 12 ms predicted and cost 30-40."""
    requests = make_requests(4)
    ids = [r.request_id for r in requests]
    options = dict.fromkeys(ids, DraftOptions((DFLASH,), 0, {DFLASH: 3}))

    def positions(backlog: int) -> int:
        policy = AdaptiveDepthPolicy(warmup_steps=0)
        _plain_steps(policy, 4, 0.010)
        for _ in range(4):  # drafting 8 positions with a drafter forward: 5 ms more
            policy.observe(StepResult(batch_size=4, verify_tokens=12, drafted_rows=4,
                                      draft_context_rows=8, forward_seconds=0.015))  # fmt: skip
        policy.catchup_row_seconds = 1e-4
        for r in requests:
            r.draft_backlog = backlog
            policy.acceptance.per_request[r.request_id] = [0.7] * policy.max_depth
        depths, _ = policy.choose_drafts(requests, options)
        return sum(depths.values())

    assert positions(backlog=2) > 0
    assert positions(backlog=300) == 0  # 4 x 300 rows at 0.1 ms: 120 ms for a few tokens


def test_a_parked_batch_is_revalued_only_when_what_it_saw_changes_or_every_few_steps():
    """Parked, the same rows with the same usable sources are parked again without valuing
    the candidates (the valuation's Python runs beside the lookahead's forward); a row whose
    options change, or every PARKED_REUSE-th step, is valued afresh."""
    from scheduler.adaptive import PARKED_REUSE

    policy = AdaptiveDepthPolicy(warmup_steps=0)
    requests = make_requests(4)
    _plain_steps(policy, 4, 0.010)
    for r in requests:
        policy.acceptance.per_request[r.request_id] = [0.0] * policy.max_depth
        policy.lookup_acceptance.per_request[r.request_id] = [0.0] * policy.max_depth
    valued = []
    original = policy._gains
    policy._gains = lambda *a: valued.append(1) or original(*a)
    ids = [r.request_id for r in requests]
    dflash = dict.fromkeys(ids, DraftOptions((DFLASH,), 0, {DFLASH: 3}))
    for _ in range(2 * PARKED_REUSE):  # (a probe may fall due: it is no valuation)
        policy.choose_drafts(requests, dflash)
    assert len(valued) == 2
    both = dict(dflash)
    both[requests[0].request_id] = DraftOptions((DFLASH, LOOKUP), 4, {DFLASH: 3, LOOKUP: 4})
    policy.choose_drafts(requests, both)  # a lookup match appeared: valued at once
    assert len(valued) == 3


def test_cost_past_the_measured_extras_follows_every_bucket_not_the_noisy_last_two():
    # Extra positions at 32 rows cost ~1 ms each, but the two largest measured counts read
    # out of order (a stall, or a lucky step): their slope alone is negative.
    curve = CostCurve(clamp=math.inf)
    for extra, seconds in [(2, 0.002), (4, 0.004), (8, 0.008), (16, 0.016), (23, 0.026),
                           (27, 0.024)]:  # fmt: skip
        curve.observe(extra, seconds)
    assert 0.055 < curve.predict(64) < 0.075  # not 0.024: flat, as the last two say
    curve.observe(64, 0.064)
    assert 0.1 < curve.predict(107) < 0.12
    # One bucket only: flat (optimistic, so the controller explores).
    single = CostCurve()
    single.observe(2, 0.003)
    assert single.predict(50) == 0.003


def test_an_extra_cost_below_the_smallest_measured_count_scales_down_to_nothing():
    """An extra curve is priced below its smallest measured count along the line through the
    origin (no extra position costs nothing); the plain curve stays flat there."""
    extra = CostCurve(clamp=math.inf, through_origin=True)
    extra.observe(19, 0.077)
    assert abs(extra.predict(1) - 0.077 / CostCurve.center(CostCurve.bucket(19))) < 1e-9
    assert extra.predict(19) == 0.077 and extra.predict(8) < 0.035
    plain = CostCurve(one_sided=True)
    plain.observe(8, 0.081)
    assert plain.predict(1) == 0.081


def test_a_batch_whose_only_measured_draft_was_large_prices_small_drafts_as_small():
    """SmolLM2 at 8 rows on the CPU: a plain step 81 ms, and the one drafting step measured
    drafted 19 lookup positions for 77 ms more (4 ms each). Priced flat below 19 positions, a
    single position cost 77 ms: a row's lookup match was never worth skipping the lookahead
    for (`lookup_wanted`), and a probe of two positions was priced like 19, so probes came
    every 48 steps, not at the budget's pace (SmolLM2 editing at c=8: lookup drafted on
    under 1% of steps). Every row copies (lookup accepted 75%): they draft."""
    policy = AdaptiveDepthPolicy(warmup_steps=0)
    policy.observe_queue(0)
    requests = make_requests(8)
    for _ in range(4):
        policy.cost.observe(8, 8, 0, False, 0.081)
    policy.cost.observe(8, 8 + 19, 0, False, 0.081 + 0.077)
    one_position = policy.cost.predict(8, [1] + [0] * 7, drafting=False) - 0.081
    assert 0.003 < one_position < 0.0045
    for r in requests:
        for _ in range(10):
            policy.lookup_acceptance.enroll(r.request_id, "greedy")
            policy.lookup_acceptance.observe(r.request_id, 4, 3)
    lookup = DraftOptions((LOOKUP,), 4, {LOOKUP: 8})
    depths, sources = policy.choose_drafts(requests, dict.fromkeys(policy_ids(requests), lookup))
    assert sum(depths.values()) >= 8 and set(sources.values()) == {LOOKUP}, depths
    two = 2 * 0.077 / CostCurve.center(CostCurve.bucket(19))
    assert policy.probe_floor(LOOKUP) == math.ceil(two / (PROBE_BUDGET * 0.081))


def test_rows_in_lockstep_that_all_copy_are_watched_together_for_a_lookup_match():
    """The same batch of 8 (plain steps 53 ms at 1 row, 81 ms at 8; a lookup position 4 ms),
    nobody waiting, the rows in lockstep. One row's extra token alone is worth little (the
    batch runs on for the others), so no row is worth skipping the lookahead for on its own;
    all eight rows' extra tokens together are worth most of a step for 8 positions, so all
    are watched. Rows that rarely copy are not."""
    policy = AdaptiveDepthPolicy(warmup_steps=0)
    policy.observe_queue(0)
    requests = make_requests(8)
    ids = policy_ids(requests)
    for _ in range(4):
        policy.cost.observe(1, 1, 0, False, 0.053)
        policy.cost.observe(8, 8, 0, False, 0.081)
    policy.cost.observe(8, 8 + 19, 0, False, 0.081 + 0.077)
    lookup = DraftOptions((LOOKUP,), 4, {LOOKUP: 8})
    for accepted, watched in ((3, set(ids)), (0, set())):
        for r in requests:
            policy.lookup_acceptance.forget(r.request_id)
            policy.lookup_acceptance.enroll(r.request_id, "greedy")
            for _ in range(10):
                policy.lookup_acceptance.observe(r.request_id, 4, accepted)
        policy.choose_drafts(requests, dict.fromkeys(ids, lookup))  # values this batch
        assert policy.lookup_wanted(ids) == watched
        assert not any(policy.lookup_wanted([rid]) for rid in ids)  # none alone


def policy_ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def test_makespan_value_of_many_choices_equals_valuing_each_alone():
    """`MakespanValue.rows` (one sort and product for all candidates) gives what the formula
    gives per choice: F(R) - F(max(0, R - E)), F(left) = sum of m(k) x k-th largest left."""
    rng = random.Random(5)
    for _ in range(50):
        rows = rng.randint(1, 12)
        order = [f"r{i}" for i in range(rows)]
        remaining = [float(rng.randint(1, 40)) for _ in range(rows)]
        slopes = [rng.uniform(0.0, 2.0) for _ in range(rows)]
        choices = [[rng.uniform(1.0, 6.0) for _ in range(rows)] for _ in range(rng.randint(1, 5))]

        def later(left, slopes=slopes):
            return sum(m * r for m, r in zip(slopes, sorted(left, reverse=True)))

        value = MakespanValue(order, remaining, slopes)
        batched = value.rows(np.array(choices))
        for choice, got in zip(choices, batched):
            want = later(remaining) - later([max(0.0, r - e) for r, e in zip(remaining, choice)])
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
            assert math.isclose(value(dict(zip(order, choice))), want, rel_tol=1e-9, abs_tol=1e-9)
