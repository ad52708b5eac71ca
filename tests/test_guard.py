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
from scheduler.request import Request, RequestStatus

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


def _hold_at(guard: DraftingGuard, clock: Clock, batch: int) -> None:
    """Play epochs where drafting loses until `batch`'s octave is held with a long gap."""
    play(guard, clock, batch, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 30)
    arms = guard.arms[guard.bucket(batch)]
    for _ in range(EPOCH_STEPS * 20):  # stop inside a held epoch of the winner
        if arms.arm == HELD and not arms.exploring:
            break
        play(guard, clock, batch, free=(1.0, 0.012), held=(1.0, 0.010), steps=1)
    assert arms.gap == MAX_EXPLORE_GAP


def test_copying_requests_that_turn_a_held_batch_over_have_drafting_measured_at_once():
    """Drafting lost (on chat, say), so the octave is held and would re-measure it only after
    MAX_EXPLORE_GAP epochs. Requests that copy (a lookup match at their first step) then
    join: once they add up to the whole batch, a free epoch starts at once; if drafting now
    wins it stays on, and if it loses again the hold returns."""
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    _hold_at(guard, clock, 1)
    held_epochs = guard.arms[0].speed[HELD]
    guard.note_copying_request(1)  # c=1: one request is the whole batch
    assert guard.allows_drafting(1) and guard.arms[0].steps == 0  # the held epoch dropped
    assert guard.arms[0].speed[HELD] == held_epochs
    arms = play(guard, clock, 1, free=(2.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS * 8)
    assert all(arms)  # editing: drafting wins clearly and stays on

    _hold_at(guard, clock, 8)
    for _ in range(7):  # seven of eight rows turned over: not yet
        guard.note_copying_request(8)
        assert not guard.allows_drafting(8)
    guard.note_copying_request(8)
    assert guard.allows_drafting(8)
    arms = play(guard, clock, 8, free=(1.0, 0.012), held=(1.0, 0.010), steps=EPOCH_STEPS)
    assert not guard.allows_drafting(8)  # lost again: held, and counted afresh
    assert guard.arms[3].turnover == 0.0


def test_a_held_epoch_that_re_measures_plain_is_not_cut_short_by_copying_requests():
    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    wins = (2.0, 0.0182)  # 1.1 plain steps' worth a step: a win, not a clear one
    play(guard, clock, 1, free=wins, held=(1.0, 0.010), steps=EPOCH_STEPS * 4)
    arms = guard.arms[0]
    for _ in range(EPOCH_STEPS * 20):  # drafting wins; plain is re-measured now and then
        if arms.arm == HELD and arms.exploring:
            break
        play(guard, clock, 1, free=wins, held=(1.0, 0.010), steps=1)
    assert arms.arm == HELD and arms.exploring
    guard.note_copying_request(1)
    assert not guard.allows_drafting(1) and arms.turnover == 0.0


def _joining(rid: str, match: int, **params) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=1000, **params),
                      StopChecker(SamplingParams(max_tokens=1000)))  # fmt: skip
    request.status = RequestStatus.RUNNING
    request.lookup_match = match
    return request


def test_the_scheduler_plans_a_copying_request_that_ends_a_hold_with_its_options():
    """One request at a time, the batch held. A request without a match joins: still held,
    no options worked out. One that opted out of lookup: held. One with a match joins: the
    guard measures drafting at once, so the very step it joins is planned with every row's
    options and the runner asked for lookup matches again."""
    from scheduler.scheduler import Scheduler, SchedulerLimits
    from scheduler.sources import DFLASH, LOOKUP

    clock = Clock()
    guard = DraftingGuard(clock, epoch_seconds=0.0)
    policy = AdaptiveDepthPolicy(guard=guard)
    _hold_at(guard, clock, 1)
    scheduler = Scheduler(SchedulerLimits(), policy, 15, {DFLASH: 15, LOOKUP: 6})

    def join(request: Request):
        scheduler.running[:] = [request]
        scheduler.requests = {request.request_id: request}
        return scheduler.plan()

    assert not join(_joining("chat", 0)).match_lookup
    assert not join(_joining("opted-out", 4, draft_sources=["dflash"])).match_lookup
    assert not join(_joining("off", 4, num_speculative_tokens=0)).match_lookup
    plan = join(_joining("editing", 4))
    assert plan.match_lookup and guard.allows_drafting(1)
    assert "measured_slower" not in scheduler.last_parked.values()


@pytest.mark.asyncio
async def test_in_the_engine_a_copying_request_has_drafting_measured_despite_an_earned_hold():
    """The bundled pair at c=1, lookup drafting only. The guard's clock is a fake one on which
    a free step costs 1.2 plain steps, and its batch-1 octave is held with a whole gap to go,
    as after a stretch of chat. A request without a lookup match at its first step stays held
    throughout; one with a match (this completion prompt's continuation repeats it at once)
    has drafting measured at once: a free epoch, in which the controller may draft by lookup
    (whether it does is its own call, on this machine's costs), where the gap would have held
    all of its 48 tokens. Both equal plain greedy decoding."""
    from engine import AsyncEngine, EngineConfig
    from engine.bundled.pair import bundled_paths
    from engine.bundled.workloads import load_workloads

    target, _ = (str(p) for p in bundled_paths())
    texts = load_workloads()
    requests = [("prose", texts["prose"][0], 48, None, 0.0),
                ("copying", texts["completion"][1], 48, None, 0.0)]  # fmt: skip

    async with AsyncEngine(EngineConfig(target=target, num_speculative_tokens=0, draft_sources=[],
                                        prefix_cache_bytes=0)) as engine:  # fmt: skip
        plain = {rid: tokens for (rid, *_), (tokens, _) in
                 zip(requests, await run_all(engine, requests, temperature=0.0))}  # fmt: skip

    config = EngineConfig(target=target, draft_sources=["lookup"], prefix_cache_bytes=0)
    async with AsyncEngine(config) as engine:
        guard = engine._policy.guard
        guard.epoch_seconds = 0.0
        clock = Clock()
        guard.clock = clock
        _hold_at(guard, clock, 1)
        guard.arms[0].since_explore = 0  # a whole gap (8 epochs, 128 steps) before a re-measure

        def step_clock() -> float:  # what a step took: free ones cost 1.2 plain steps
            clock.now += 0.012 if guard.allows_drafting(1) else 0.010
            return clock.now

        guard.clock = step_clock
        free_steps: list[bool] = []
        first_match: dict[str, int] = {}

        def record(result: StepResult) -> None:
            free_steps.append(guard.allows_drafting(1))
            for rid in result.first_tokens:
                first_match[rid] = result.lookup_matches.get(rid, 0)

        engine.step_hooks.append(record)
        outputs = {}
        for request in requests:  # one at a time: c=1
            free_steps.clear()
            ((tokens, last),) = await run_all(engine, [request], temperature=0.0)
            outputs[request[0]] = tokens, sum(free_steps), last.drafted_by_source
    assert first_match["prose"] == 0 and first_match["copying"] > 0  # the premise
    assert outputs["prose"] == (plain["prose"], 0, {})
    tokens, free, _ = outputs["copying"]
    assert tokens == plain["copying"]
    assert free >= EPOCH_STEPS - 1  # one whole free epoch (its last step closes it)
