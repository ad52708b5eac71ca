"""The "never slower" guard (`scheduler.guard`): whole-loop measurements decide whether the
adaptive controller may draft, per batch size. Unit tests drive it with a fake clock; the last
test runs it inside the engine on the bundled pair."""

from __future__ import annotations

import pytest
from test_engine import run_all

from engine.step.sampling import SamplingParams
from engine.step.stopping import StopChecker
from scheduler.adaptive import AdaptiveDepthPolicy
from scheduler.guard import (
    CLEAR_WIN,
    EPOCH_STEPS,
    FREE,
    FREE_MARGIN,
    HELD,
    MAX_EXPLORE_GAP,
    DraftingGuard,
)
from scheduler.plan import RowOutcome, StepResult
from scheduler.request import Request

PLAIN = 0.010  # the cost model's plain step (seconds)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def play(guard: DraftingGuard, clock: Clock, batch: int, free: tuple[float, float],
         held: tuple[float, float], steps: int) -> list[bool]:  # fmt: skip
    """Run `steps` clean steps of `batch` rows; each arm commits `tokens per row` in `seconds`
    (free: drafting allowed, held: plain). Returns whether each step was free."""
    arms = []
    guard.observe(batch, batch, PLAIN, clean=False)  # (sets the clock)
    for _ in range(steps):
        allowed = guard.allows_drafting(batch)
        per_row, seconds = free if allowed else held
        clock.now += seconds
        guard.observe(batch, round(per_row * batch), PLAIN, clean=True)
        arms.append(allowed)
    return arms


def epochs(arms: list[bool]) -> list[str]:
    return [FREE if arms[i] else HELD for i in range(0, len(arms), EPOCH_STEPS)]


def test_drafting_that_loses_whole_loop_time_is_held_off_and_rarely_retried():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    # Drafting commits 5% more tokens a step but each step takes 15% longer: a loss the
    # controller's own models may miss (its planning, a lost lookahead).
    arms = play(guard, clock, 8, free=(1.05, 0.0115), held=(1.0, 0.0100), steps=EPOCH_STEPS * 60)
    seen = epochs(arms)
    assert seen[:3] == [FREE, HELD, HELD]  # both measured, then the winner kept
    assert not guard.allows_drafting(8)
    # The loser is re-measured ever more rarely: after 2 epochs, then 4, then every 8.
    free_epochs = [i for i, arm in enumerate(seen) if arm == FREE]
    gaps = [b - a - 1 for a, b in zip(free_epochs, free_epochs[1:])]
    assert gaps[:4] == [3, 4, 8, 8] and set(gaps[2:]) == {MAX_EXPLORE_GAP}
    assert sum(arm == FREE for arm in seen) / len(seen) < 0.15


def test_drafting_that_wins_narrowly_stays_on_and_plain_is_only_re_measured():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    arms = play(guard, clock, 8, free=(1.25, 0.0110), held=(1.0, 0.0100), steps=EPOCH_STEPS * 40)
    seen = epochs(arms)
    assert seen[:3] == [FREE, HELD, FREE]  # 1.14 against 1.0
    assert guard.allows_drafting(8)
    assert sum(arm == HELD for arm in seen) <= 6  # the first, then after 4, then every 8


@pytest.mark.parametrize("edge", [0.99, 1.01])
def test_drafting_within_the_margin_is_held_and_beyond_it_kept(edge):
    """Never slower: drafting that scores the same as plain decoding, or a little better
    (within FREE_MARGIN, what an epoch's noise alone can give), is held; just beyond, kept."""
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    speed = edge * FREE_MARGIN  # tokens per row in the same seconds as a plain step
    rows = 256  # tokens are whole: enough rows to resolve a percent
    arms = play(guard, clock, rows, free=(speed, 0.01), held=(1.0, 0.01), steps=EPOCH_STEPS * 40)
    seen = epochs(arms)
    assert seen[:2] == [FREE, HELD]
    kept = FREE if edge > 1 else HELD
    assert seen[2] == kept and guard.allows_drafting(rows) == (kept == FREE)
    assert sum(arm == kept for arm in seen) / len(seen) > 0.7


def test_drafting_that_wins_clearly_never_spends_an_epoch_held():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    arms = play(guard, clock, 1, free=(2.0, 0.0140), held=(1.0, 0.0100), steps=EPOCH_STEPS * 40)
    assert all(arms)


def test_a_workload_that_turns_profitable_is_noticed():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    play(guard, clock, 8, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 12)
    assert not guard.allows_drafting(8)
    arms = play(guard, clock, 8, free=(2.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 40)
    assert epochs(arms)[-10:].count(FREE) >= 7


def test_prefill_steps_joins_and_idle_gaps_are_not_measured():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    guard.observe(8, 8, PLAIN, clean=True)
    for _ in range(EPOCH_STEPS * 3):
        clock.now += 0.5  # a prefill step's time, or an engine that waited for work
        guard.observe(8, 8, PLAIN, clean=False)
    clock.now += 60.0
    guard.observe(8, 8, PLAIN, clean=True)  # idle: dropped
    assert guard.arms.get(guard.bucket(8)) is None or guard.arms[guard.bucket(8)].steps == 0
    assert guard.allows_drafting(8)


def test_an_epoch_lasts_long_enough_to_be_more_than_one_stall():
    clock = Clock()
    guard = DraftingGuard(clock)  # the default: at least 0.4 s an epoch
    arms = play(guard, clock, 1, free=(1.0, 0.010), held=(1.0, 0.010), steps=39)
    assert all(arms) and guard.arms[0].steps == 39  # 0.39 s: still the first epoch
    play(guard, clock, 1, free=(1.0, 0.010), held=(1.0, 0.010), steps=2)
    assert not guard.allows_drafting(1)  # closed: plain is measured next


def test_each_batch_size_octave_has_its_own_verdict():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    play(guard, clock, 8, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 8)
    play(guard, clock, 1, free=(2.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 8)
    assert not guard.allows_drafting(8) and not guard.allows_drafting(15)
    assert guard.allows_drafting(1)
    assert guard.allows_drafting(2)  # never measured, above a free octave: free
    assert "batch 2-3" not in guard.state()  # asking did not create its arms


def test_a_new_batch_size_above_a_held_one_starts_held_and_still_measures_drafting():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    play(guard, clock, 8, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 8)
    assert not guard.allows_drafting(8)
    # 32 rows: never measured, and more compute-bound than 8, where drafting lost.
    arms = play(guard, clock, 32, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 6)
    assert epochs(arms)[:4] == [HELD, HELD, FREE, HELD]  # drafting measured after 2 epochs
    assert not guard.allows_drafting(32)
    # Where drafting pays at 32 rows after all, it is found and kept.
    arms = play(guard, clock, 32, free=(2.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 24)
    assert epochs(arms)[-6:] == [FREE] * 6


def _request(i: int) -> Request:
    params = SamplingParams(max_tokens=1000)
    return Request(f"r{i}", [1, 2, 3], params, StopChecker(params))


def test_a_held_batch_size_parks_the_controller_and_lets_the_runner_look_ahead():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    policy = AdaptiveDepthPolicy(guard=guard)
    requests = [_request(i) for i in range(8)]
    policy.seed([(8, 1, 0.010), (8, 2, 0.0105), (8, 4, 0.011), (8, 8, 0.012)])  # cheap drafts
    play(guard, clock, 8, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 3)
    assert not guard.allows_drafting(8)
    # High acceptance everywhere: unguarded, this controller would draft.
    for request in requests:
        for _ in range(20):
            policy.acceptance.observe(request.request_id, 4, 4)
    depths = policy.choose(requests, 7)
    assert set(depths.values()) == {0}
    assert set(policy.parked_reasons.values()) == {"measured_slower"}
    assert policy.expects_plain_next()
    assert not policy.wants_lookup("r0")
    policy.guard = None
    assert any(policy.choose(requests, 7).values())  # the same state, unguarded, drafts


def test_the_policy_feeds_the_guard_clean_steps_only():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    policy = AdaptiveDepthPolicy(guard=guard)
    outcomes = {f"r{i}": RowOutcome([5], 0, 0) for i in range(4)}
    for prefill in (0, 0, 300, 0):
        clock.now += 0.01
        result = StepResult(outcomes=dict(outcomes), batch_size=4, verify_tokens=4,
                            prefill_tokens=prefill, step_seconds=0.01)  # fmt: skip
        policy.observe(result)
    assert guard.arms[guard.bucket(4)].steps == 2  # the first sets the clock; the prefill is out


@pytest.mark.asyncio
async def test_in_the_engine_the_guard_measures_both_arms_and_output_stays_exact():
    """The bundled pair at 8 clients, greedy: the guard runs (drafting measured at batch 8,
    and held decoding unless drafting won clearly) and every request's tokens equal drafting
    off's."""
    from engine import AsyncEngine, EngineConfig
    from engine.bundled.pair import bundled_paths
    from engine.bundled.workloads import load_workloads

    target, drafter = (str(p) for p in bundled_paths())
    # Long enough for several epochs of 0.4 s at batch 8 on a fast machine and a slow one
    # (96 tokens gave 3, and the held arm's first turn came too late once in CI).
    requests = [
        (f"p{i}", text, 192, None, 0.0) for i, text in enumerate(load_workloads()["prose"][:8])
    ]

    async def run(config: EngineConfig) -> tuple[list[list[int]], AsyncEngine]:
        async with AsyncEngine(config) as engine:
            results = await run_all(engine, requests, temperature=0.0)
            return [tokens for tokens, _ in results], engine

    plain, _ = await run(EngineConfig(target=target, num_speculative_tokens=0, draft_sources=[],
                                      prefix_cache_bytes=0))  # fmt: skip
    guarded, engine = await run(EngineConfig(target=target, drafter=drafter, prefix_cache_bytes=0))
    assert guarded == plain
    arms = engine._policy.guard.arms[DraftingGuard.bucket(8)]
    assert FREE in arms.speed and (HELD in arms.speed or arms.speed[FREE] >= CLEAR_WIN)
    assert all(0.2 < speed < 5.0 for speed in arms.speed.values())
