"""In-flight prefix sharing: a prompt becomes a prefix-cache entry as soon as its prefill
completes, requests that share a long prefix with one still prefilling wait for it, and an
aborted request leaves what it computed. The scheduling rules on fakes; on the bundled pair,
16 clients sharing one long system prompt prefill it about once and answer as cold starts."""

from __future__ import annotations

import asyncio

import pytest
from test_prefix_cache import DRAFTER, TARGET, _checked, _fields, _idle, _prompts, bundled

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.bundled.workloads import load_workloads
from engine.step.prefix_cache import PrefixIndex
from engine.step.sampling import SamplingParams as Params
from engine.step.stopping import StopChecker
from scheduler.depth import FixedDepthPolicy
from scheduler.plan import StepResult
from scheduler.request import Request
from scheduler.scheduler import HOLD_MIN_TOKENS, Scheduler, SchedulerLimits

SYSTEM = list(range(3, 3 + 100))  # a shared "system prompt" of 100 tokens


# --------------------------------------------------------------------------- scheduling
def _request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    params = Params(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, StopChecker(params))


def _scheduler(share: bool = True, whole_only: bool = False, max_num_seqs: int = 8) -> Scheduler:
    limits = SchedulerLimits(max_num_seqs=max_num_seqs, prefill_chunk_tokens=32)
    index = PrefixIndex(1 << 20, 1, whole_only=whole_only)
    return Scheduler(limits, FixedDepthPolicy(0), 0, {}, index, share_in_flight=share)


def _prefill(scheduler: Scheduler, rid: str) -> None:
    """Plan and 'run' steps until `rid`'s prompt is prefilled (its first token applied)."""
    request = scheduler.requests[rid]
    while True:
        plan = scheduler.plan()
        last = [c for c in plan.prefills if c.request_id == rid and c.last]
        if last:
            scheduler.apply(StepResult(first_tokens={rid: 1}))
            assert request in scheduler.running
            return
        scheduler.apply(StepResult())


def test_requests_sharing_a_prefix_being_prefilled_wait_for_it_then_hit():
    scheduler = _scheduler()
    for rid, tail in (("a", [500, 501]), ("b", [600]), ("c", [700, 701, 702])):
        scheduler.add(_request(rid, SYSTEM + tail))
    plan = scheduler.plan()
    assert [a.request_id for a in plan.admissions] == ["a"]
    assert scheduler.held == {"b", "c"} and scheduler.holds == 2
    scheduler.apply(StepResult())
    _prefill(scheduler, "a")
    plan = scheduler.plan()
    # a's prompt is published (copied before this step's admissions), b and c hit it.
    assert [(s.request_id, s.length) for s in plan.prefix_saves] == [("a", 102)]
    assert {a.request_id: a.prefix_tokens for a in plan.admissions} == {"b": 100, "c": 100}
    assert all(a.prefix_entry == plan.prefix_saves[0].entry_id for a in plan.admissions)
    assert scheduler.held == set() and scheduler.holds == 2  # each counted once
    # Their own tokens go through in this step's chunks: no entry of their own in flight.
    last = {c.request_id for c in plan.prefills if c.last}
    assert last == {"b", "c"}
    scheduler.apply(StepResult(first_tokens={"b": 1, "c": 1}))
    assert not scheduler.plan().prefix_saves


def test_without_in_flight_sharing_everyone_prefills_and_nothing_is_published():
    scheduler = _scheduler(share=False)
    for rid in "ab":
        scheduler.add(_request(rid, SYSTEM + [ord(rid)]))
    plan = scheduler.plan()
    assert [a.request_id for a in plan.admissions] == ["a", "b"]
    while scheduler.prefilling:
        scheduler.apply(StepResult(first_tokens={c.request_id: 1 for c in plan.prefills if c.last}))
        plan = scheduler.plan()
        assert not plan.prefix_saves
    assert len(scheduler.running) == 2 and scheduler.holds == 0


def test_short_shared_prefixes_are_not_held_and_do_not_block_the_queue():
    scheduler = _scheduler()
    short = SYSTEM[: HOLD_MIN_TOKENS - 1]
    scheduler.add(_request("a", SYSTEM + [1]))
    scheduler.add(_request("b", SYSTEM + [2]))  # held
    scheduler.add(_request("c", short + [9, 9]))  # shares too little: admitted
    scheduler.add(_request("d", [42] * 10))  # shares nothing: goes ahead of the held b
    plan = scheduler.plan()
    assert [a.request_id for a in plan.admissions] == ["a", "c", "d"]
    assert scheduler.held == {"b"}
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_a_prefix_already_cached_is_not_worth_a_hold():
    scheduler = _scheduler()
    scheduler.prefix.save(SYSTEM[:-10])
    scheduler.add(_request("a", SYSTEM + [1]))
    scheduler.add(_request("b", SYSTEM + [2]))  # would gain only 10 positions by waiting
    plan = scheduler.plan()
    assert [a.prefix_tokens for a in plan.admissions] == [90, 90]


def test_an_abort_mid_prefill_leaves_its_positions_and_releases_the_held():
    scheduler = _scheduler()
    scheduler.add(_request("a", SYSTEM + [1]))
    scheduler.add(_request("b", SYSTEM + [2]))
    scheduler.plan()  # a: [0, 32)
    scheduler.apply(StepResult())
    scheduler.plan()  # a: [32, 64)
    assert scheduler.held == {"b"}
    scheduler.abort("a")  # while that step runs: it has run by the time the save does
    plan = scheduler.plan()
    assert plan.removals == ["a"]
    assert [(s.request_id, s.length) for s in plan.prefix_saves] == [("a", 64)]
    (admission,) = plan.admissions
    assert (admission.request_id, admission.prefix_tokens) == ("b", 64)


def test_an_aborted_decoding_request_leaves_prompt_and_output():
    scheduler = _scheduler()
    scheduler.add(_request("a", SYSTEM + [1], max_tokens=20))
    scheduler.plan()
    _prefill(scheduler, "a")
    plan = scheduler.plan()
    assert [s.length for s in plan.prefix_saves] == [101]  # the prompt, published
    scheduler.apply(StepResult(outcomes={}))
    request = scheduler.requests["a"]
    request.stop.add([5, 6, 7])
    scheduler.abort("a")
    plan = scheduler.plan()
    # prompt + output but the newest token; the published prompt entry is redundant now
    assert [s.length for s in plan.prefix_saves] == [101 + 3]
    assert len(plan.prefix_drops) == 1


def test_whole_only_holds_only_for_a_prompt_that_is_a_whole_prefix():
    scheduler = _scheduler(whole_only=True)
    scheduler.add(_request("a", SYSTEM))
    scheduler.add(_request("b", SYSTEM + [7, 8]))  # a's whole prompt, then more: held
    scheduler.add(_request("c", SYSTEM[:-1] + [9, 9]))  # part of it: no state there
    plan = scheduler.plan()
    assert [a.request_id for a in plan.admissions] == ["a", "c"]
    scheduler.apply(StepResult())
    _prefill(scheduler, "a")
    plan = scheduler.plan()
    (admission,) = plan.admissions
    assert (admission.request_id, admission.prefix_tokens) == ("b", 100)


# --------------------------------------------------------------------------- the engine
def _system_prompt(tokens: int) -> list[int]:
    from engine.models.loading import load_target_model

    _, tokenizer = load_target_model(TARGET)
    text = "\n\n".join(load_workloads()["completion"])
    ids = list(tokenizer.encode(text))
    assert len(ids) >= tokens
    return ids[:tokens]


def _prefilled(engine: AsyncEngine) -> float:
    """Prompt tokens run through the target so far (flashbatch_prompt_tokens_total)."""
    for line in engine.metrics.exposition().decode().splitlines():
        if line.startswith("flashbatch_prompt_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prompt_tokens counter")


async def _together(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int = 4):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    streams = [engine.add_request(p, params, f"q{i}") for i, p in enumerate(prompts)]

    async def drain(stream):
        tokens, last = [], None
        async with stream:
            async for out in stream:
                tokens += out.token_ids
                last = out
        return tokens, last

    return await asyncio.gather(*[drain(s) for _, s in streams])


@bundled
async def test_sixteen_clients_sharing_a_system_prompt_prefill_it_about_once():
    system = _system_prompt(1500)
    tails = [[100 + i] + p[:11] for i, p in enumerate(_prompts(16))]  # distinct from the start
    prompts = [system + t for t in tails]
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=16,
                          num_speculative_tokens=3, prefix_cache_bytes=256 << 20)  # fmt: skip
    async with AsyncEngine(config) as engine:
        failures = _checked(engine)
        got = await _together(engine, prompts)
        await _idle(engine)
        prefilled = _prefilled(engine)
        holds = engine.scheduler.holds
    assert not failures, failures[:5]
    assert holds == 15
    # The system prompt once, then each client's own tail (and the last token of a full hit).
    assert prefilled <= len(system) + sum(len(t) for t in tails) + 16, prefilled
    assert sorted(last.cached_tokens for _, last in got)[1:] == [len(system)] * 15
    async with AsyncEngine(EngineConfig(**{**_fields(config), "prefix_cache_bytes": 0})) as cold:
        expected = await _together(cold, prompts)
        assert _prefilled(cold) == sum(len(p) for p in prompts)
    assert [t for t, _ in got] == [t for t, _ in expected]


@bundled
async def test_an_aborted_first_request_leaves_its_prefix_to_the_one_it_held():
    system = _system_prompt(700)
    first, second = (system + p[:6] for p in _prompts(2))
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4,
                          num_speculative_tokens=3, prefill_chunk_tokens=256,
                          prefix_cache_bytes=64 << 20)  # fmt: skip
    async with AsyncEngine(config) as engine:
        failures = _checked(engine)
        aborted_at = []

        def abort_mid_prefill(result) -> None:
            request = engine.scheduler.requests.get("q0")
            if request is not None and not aborted_at and request.prefilled >= 512:
                aborted_at.append(request.prefilled)  # two chunks have run
                engine.abort("q0")

        engine.step_hooks.append(abort_mid_prefill)
        (_, gone), (tokens, last) = await _together(engine, [first, second], max_tokens=6)
        await _idle(engine)
        assert engine.scheduler.holds == 1
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    assert gone.finish_reason == "abort" and aborted_at and aborted_at[0] < len(system)
    assert last.cached_tokens == aborted_at[0]
    async with AsyncEngine(EngineConfig(**{**_fields(config), "prefix_cache_bytes": 0})) as cold:
        ((expected, _),) = await _together(cold, [second], max_tokens=6)
    assert tokens == expected


@pytest.mark.parametrize("share", [True, False])
def test_the_flag_reaches_the_scheduler(share, qwen3_target_dir):
    async def run():
        config = EngineConfig(target=str(qwen3_target_dir), prefix_share_in_flight=share)
        async with AsyncEngine(config) as engine:
            return engine.scheduler.share_in_flight

    assert asyncio.run(run()) is share
