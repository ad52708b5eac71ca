"""The adaptive depth controller on synthetic cost curves and seeded acceptance streams (no MLX).

A small simulator plays the engine: each step the controller picks depths, acceptance is drawn
per position from each request's true per-position probability, and the step time comes from a
synthetic cost curve of the padded verify shape (batch x (widest depth + 1))."""

from __future__ import annotations

import random

from engine.sampling import SamplingParams
from engine.stopping import StopChecker
from scheduler.adaptive import PROBE_MAX, AdaptiveDepthPolicy
from scheduler.plan import RowOutcome, StepResult
from scheduler.request import Request

DECAYING = [0.90, 0.82, 0.72, 0.60, 0.48, 0.40, 0.35, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]


def make_requests(n: int, cap: int | None = None) -> list[Request]:
    out = []
    for i in range(n):
        params = SamplingParams(max_tokens=10**6, num_speculative_tokens=cap)
        out.append(Request(f"r{i}", [1, 2, 3], params, StopChecker(params)))
    return out


class Simulator:
    def __init__(self, cost, acceptance, seed: int = 0, drafter_cost: float = 0.0) -> None:
        self.cost = cost  # (batch, width) -> seconds
        self.acceptance = acceptance  # request id -> per-position probabilities
        self.rng = random.Random(seed)
        self.drafter_cost = drafter_cost

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
        seconds = self.cost(len(requests), width) + (self.drafter_cost if drafting else 0.0)
        result = StepResult(
            outcomes=outcomes, batch_size=len(requests), verify_tokens=len(requests) * width,
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
    history = sim.run(AdaptiveDepthPolicy(), make_requests(1), 300)
    assert settled_width(history) >= 5


def test_shallow_when_the_cost_is_steep():
    sim = Simulator(lambda b, w: 0.030 + 0.019 * b * w, lambda _: DECAYING)
    history = sim.run(AdaptiveDepthPolicy(), make_requests(1), 300)
    assert 0 < settled_width(history) <= 4


def test_zero_when_drafting_does_not_pay_and_the_plain_path_runs():
    sim = Simulator(lambda b, w: 0.030 + 0.019 * b * w, lambda _: [0.05] * 15)
    policy = AdaptiveDepthPolicy()
    history = sim.run(policy, make_requests(2), 400)
    parked = [d for d in history[-100:] if not any(d.values())]
    assert len(parked) >= 95  # only rare probes draft
    assert policy.parked_reasons and set(policy.parked_reasons.values()) <= {
        "low_acceptance", "not_worth_it"
    }  # fmt: skip


def test_explores_before_the_cost_is_known_and_climbs_one_position_at_a_time():
    sim = Simulator(lambda b, w: 0.210 + 0.0026 * b * w, lambda _: [1.0] * 15)
    policy = AdaptiveDepthPolicy()
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
    policy = AdaptiveDepthPolicy()
    requests = make_requests(1)
    sim.run(policy, requests, 200)
    before = settled_width(sim.run(policy, requests, 30), 30)
    sim.step(policy, requests, outlier=3.0)  # one 3x stall
    after = settled_width(sim.run(policy, requests, 30), 30)
    assert abs(after - before) <= 1.5


def test_probe_backoff_while_parked_and_prompt_reengagement():
    quality = {"p": [0.02] * 15}
    sim = Simulator(lambda b, w: 0.050 + 0.004 * b * w, lambda _: quality["p"], seed=1)
    policy = AdaptiveDepthPolicy()
    requests = make_requests(1)
    history = sim.run(policy, requests, 4096)
    probes = sum(1 for d in history[-3000:] if any(d.values()))
    assert probes <= 12
    assert policy.state()["probe_interval"] == PROBE_MAX
    quality["p"] = [0.95] * 15  # acceptance returns
    history = sim.run(policy, requests, 2 * PROBE_MAX + 200)
    assert settled_width(history, 100) >= 5


def test_tracks_acceptance_drift():
    quality = {"p": DECAYING}
    sim = Simulator(lambda b, w: 0.050 + 0.004 * b * w, lambda _: quality["p"], seed=2)
    policy = AdaptiveDepthPolicy()
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
        widths[batch] = settled_width(sim.run(AdaptiveDepthPolicy(), make_requests(batch), 300))
    assert widths[1] > widths[4] >= widths[32]
    assert widths[32] < 1


def test_high_acceptance_requests_get_depth_first():
    rates = {"r0": [0.95] * 15, "r1": [0.3] * 15}
    sim = Simulator(lambda b, w: 0.200 + 0.003 * b * w, lambda rid: rates[rid], seed=4)
    policy = AdaptiveDepthPolicy()
    history = sim.run(policy, make_requests(2), 300)
    tail = history[-50:]
    assert sum(d["r0"] for d in tail) > 2 * sum(d["r1"] for d in tail)


def test_request_caps_and_budgets_are_respected():
    sim = Simulator(lambda b, w: 0.210 + 0.001 * b * w, lambda _: [1.0] * 15)
    policy = AdaptiveDepthPolicy()
    capped = make_requests(2, cap=3)
    history = sim.run(policy, capped, 100)
    assert max(max(d.values()) for d in history) <= 3
    off = make_requests(1, cap=0)
    assert all(d["r0"] == 0 for d in sim.run(AdaptiveDepthPolicy(), off, 50))


def test_parked_policy_predicts_the_next_step_plain_except_probes():
    """`expects_plain_next` (the runner's lookahead hint) is right on almost every parked step
    and false exactly before the steps that probe."""
    sim = Simulator(lambda b, w: 0.030 + 0.019 * b * w, lambda _: [0.05] * 15)
    policy = AdaptiveDepthPolicy()
    requests = make_requests(2)
    sim.run(policy, requests, 200)
    misses = probes = 0
    for _ in range(600):
        predicted_plain = policy.expects_plain_next()
        depths = sim.step(policy, requests)
        probes += any(depths.values())
        misses += predicted_plain == any(depths.values())
    assert misses == 0 and probes >= 2
