"""Automatic prefix caching: the index's bookkeeping (LRU under a byte budget, pins), and the
engine on the bundled pair, where a hit must give exactly what a cold start gives."""

from __future__ import annotations

import asyncio

import anyio
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.bundled.pair import bundled_paths
from engine.bundled.workloads import load_workloads
from engine.step.prefix_cache import PrefixIndex, common_prefix

TARGET, DRAFTER = bundled_paths()
bundled = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFTER / "config.json").is_file(),
    reason="the bundled pair is not built in this checkout (python -m engine.bundled.build)",
)


# --------------------------------------------------------------------------- the index
def test_match_leaves_one_prompt_token_to_prefill():
    index = PrefixIndex(budget_bytes=1000, bytes_per_token=1)
    entry, _ = index.save([1, 2, 3, 4, 5])
    assert index.match([1, 2, 3, 4, 5]) == (entry, 4)  # the last token still goes through
    assert index.match([1, 2, 3, 9, 9, 9]) == (entry, 3)
    assert index.match([1, 2, 3, 4, 5, 6, 7]) == (entry, 5)
    assert index.match([2, 2, 3]) == (None, 0)
    assert index.match([1]) == (None, 0)


def test_lru_eviction_keeps_pinned_entries_and_the_budget():
    index = PrefixIndex(budget_bytes=10, bytes_per_token=1)
    a, _ = index.save([1] * 4)
    b, _ = index.save([2] * 4)
    assert index.match([1] * 6)[0] == a  # a is now the most recently used
    c, dropped = index.save([3] * 4)
    assert dropped == [b] and index.used_bytes == 8
    index.pin(a)
    d, dropped = index.save([4] * 5)
    assert dropped == [c] and sorted(index.entry_tokens()) == [a, d]
    assert index.save([5] * 7) == (None, [])  # only room by evicting the pinned entry
    index.unpin(a)
    e, dropped = index.save([5] * 7)
    assert set(dropped) == {a, d} and list(index.entry_tokens()) == [e]
    assert index.save([6] * 11) == (None, [])  # larger than the whole budget


def test_saving_a_longer_sequence_replaces_the_entries_it_extends():
    index = PrefixIndex(budget_bytes=100, bytes_per_token=1)
    a, _ = index.save([1, 2, 3])
    assert index.save([1, 2]) == (None, [])  # already covered by a
    b, dropped = index.save([1, 2, 3, 4, 5])
    assert dropped == [a] and index.entry_tokens() == {b: [1, 2, 3, 4, 5]}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["save", "match", "unpin"]),
                          st.lists(st.integers(0, 3), min_size=1, max_size=9)),
                max_size=40))  # fmt: skip
def test_index_never_exceeds_its_budget_nor_drops_a_pinned_entry(operations):
    index = PrefixIndex(budget_bytes=20, bytes_per_token=2)
    pinned: list[int] = []
    for op, tokens in operations:
        if op == "save":
            before = dict(index.entry_tokens())
            entry, dropped = index.save(tokens)
            assert not set(dropped) & set(pinned)
            assert set(before) - set(index.entry_tokens()) == set(dropped)
            if entry is not None:
                assert index.entry_tokens()[entry] == tokens
        elif op == "match":
            entry, length = index.match(tokens)
            assert length <= len(tokens) - 1
            if entry is not None:
                assert common_prefix(index.entry_tokens()[entry], tokens) >= length > 0
                index.pin(entry)
                pinned.append(entry)
        elif pinned:
            index.unpin(pinned.pop(0))
        sizes = sum(len(t) for t in index.entry_tokens().values()) * 2
        assert index.used_bytes == sizes <= 20
        assert set(pinned) <= set(index.entry_tokens())


# --------------------------------------------------------------------------- the engine
def _prompts(n: int, kinds: tuple[str, ...] = ("prose", "completion")) -> list[list[int]]:
    from engine.models.loading import load_target_model

    _, tokenizer = load_target_model(TARGET)
    texts = [t for w in kinds for t in load_workloads()[w]]
    return [list(tokenizer.encode(t)) for t in texts[:n]]


def _checked(engine: AsyncEngine) -> list[str]:
    """After every step: prefix entries stay within the budget, the index and the runner agree
    on what is cached, and the target cache of each row = committed - 1."""
    failures: list[str] = []

    def hook(result) -> None:
        runner, scheduler = engine._runner, engine.scheduler
        if runner.prefix_cache_bytes > engine.config.prefix_cache_bytes:
            failures.append(f"prefix cache {runner.prefix_cache_bytes} over budget")
        if set(runner.prefix_entries) != set(scheduler.prefix.entry_tokens()):
            failures.append("index and runner disagree on the entries")
        if runner.prefix_cache_bytes != scheduler.prefix.used_bytes:
            failures.append("the index miscounts the entries' bytes")
        lengths = runner.cache_lengths()
        for request in scheduler.running:
            committed = len(request.prompt_ids) + request.generated
            if lengths[request.request_id] != committed - 1:
                failures.append(f"{request.request_id}: cache != committed - 1")

    engine.step_hooks.append(hook)
    return failures


async def _idle(engine: AsyncEngine) -> None:
    while not engine.idle or engine.scheduler.has_work:
        await asyncio.sleep(0.01)


async def _generate(engine, ids, max_tokens=16, **params):
    tokens, last = [], None
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    async for out in engine.generate(ids, sp):
        tokens += out.token_ids
        last = out
    assert last.finish_reason == "length"
    return tokens, last


NEW_TOKENS = 12  # a turn's new text


async def _conversation(budget: int, depth: int | None, turns: int = 3, **params):
    """A chat-like session: every turn resends the history (prompt + answer) plus new text."""
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4,
                          num_speculative_tokens=depth, prefix_cache_bytes=budget)  # fmt: skip
    extra = _prompts(turns + 1)
    async with AsyncEngine(config) as engine:
        failures = _checked(engine) if budget else []
        history, outs = extra[0], []
        for turn in range(turns):
            tokens, last = await _generate(engine, history, **params)
            outs.append((tokens, last))
            history = history + tokens + extra[turn + 1][:NEW_TOKENS]
            await _idle(engine)  # the finished turn is saved before the next arrives
    assert not failures, failures[:5]
    return outs


@bundled
@pytest.mark.parametrize(
    ("depth", "params"),
    [(3, {}), (None, {}), (0, {}), (3, {"temperature": 0.8, "seed": 7}),
     (0, {"temperature": 0.8, "top_p": 0.9, "seed": 3})],
    ids=["greedy-depth3", "greedy-adaptive", "greedy-off", "sampled-depth3", "sampled-off"],
)  # fmt: skip
def test_hits_give_what_a_cold_start_gives(depth, params):
    cold = asyncio.run(_conversation(0, depth, **params))
    warm = asyncio.run(_conversation(64 << 20, depth, **params))
    assert [t for t, _ in warm] == [t for t, _ in cold]
    assert warm[0][1].cached_tokens == 0
    for turn, (_, last) in enumerate(warm[1:], start=1):
        # the whole history except the previous answer's newest token is reused
        assert last.cached_tokens == last.prompt_tokens - NEW_TOKENS - 1, turn
    if depth == 3:  # the drafter's context was rebuilt exactly: the same drafts got accepted
        assert [o.accepted_tokens for _, o in warm] == [o.accepted_tokens for _, o in cold]
        assert sum(o.accepted_tokens for _, o in warm) > 0
    if not params:
        from engine.models.loading import load_target_model

        model, _ = load_target_model(TARGET)
        prompt = _prompts(1)[0]
        steps = generate_step(mx.array(prompt), model, max_tokens=16,
                              sampler=lambda x: mx.argmax(x, -1))  # fmt: skip
        assert warm[0][0] == [int(t) for t, _ in steps]


@bundled
def test_a_long_answer_then_a_hit_drafts_as_a_cold_start():
    """A 150-token answer (over 64 verify steps, so the features kept for the entry are merged
    along the way), then a turn that reuses it: drafts accepted as in a cold start."""

    async def run(budget: int):
        config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), num_speculative_tokens=2,
                              prefix_cache_bytes=budget)  # fmt: skip
        async with AsyncEngine(config) as engine:
            history, outs = _prompts(1)[0], []
            for _ in range(2):
                tokens, last = await _generate(engine, history, max_tokens=150)
                outs.append((tokens, last.cached_tokens, last.drafted_tokens, last.accepted_tokens))
                history = history + tokens + history[:4]
                await _idle(engine)
            return outs

    cold, warm = asyncio.run(run(0)), asyncio.run(run(64 << 20))
    assert warm[1][1] > 150 and cold[1][1] == 0
    assert [o[0] for o in warm] == [o[0] for o in cold]
    assert [o[2:] for o in warm] == [o[2:] for o in cold]
    assert warm[0][3] > 0


@bundled
async def test_concurrent_requests_share_one_entry_that_stays_unchanged():
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=8,
                          num_speculative_tokens=3, prefix_cache_bytes=64 << 20)  # fmt: skip
    prompts = _prompts(6)
    shared = prompts[0]
    followers = [shared + p[:8] for p in prompts[1:]]
    async with AsyncEngine(config) as engine:
        failures = _checked(engine)
        first, _ = await _generate(engine, shared, max_tokens=4)
        await _idle(engine)
        ((entry_id, entry),) = engine._runner.prefix_entries.items()
        snapshot = [np.array(a) for a in entry.arrays()]
        results = await asyncio.gather(*[_generate(engine, ids) for ids in followers])
        await _idle(engine)
        # every follower copied from it, none wrote into it
        assert [np.array_equal(a, np.array(b)) for a, b in zip(snapshot, entry.arrays())] == [
            True
        ] * len(snapshot)
    assert not failures, failures[:5]
    assert all(last.cached_tokens >= len(shared) for _, last in results)
    async with AsyncEngine(EngineConfig(**{**_fields(config), "prefix_cache_bytes": 0})) as cold:
        expected = await asyncio.gather(*[_generate(cold, ids) for ids in followers])
    assert [t for t, _ in results] == [t for t, _ in expected]


def _fields(config: EngineConfig) -> dict:
    return {f: getattr(config, f) for f in config.__struct_fields__}


@bundled
async def test_eviction_under_a_small_budget_loses_nothing():
    """A budget of about two entries: eight prompts evict one another (never an entry an
    admission is copying from); every output equals a cold start's, and only the prompts
    whose entries survived hit."""
    length = 40  # equal lengths make the entries equal in size: the budget holds two
    prompts = [p[:length] for p in _prompts(8, ("completion",))]
    assert all(len(p) == length for p in prompts)
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4,
                          num_speculative_tokens=3, prefix_cache_bytes=0)  # fmt: skip
    async with AsyncEngine(config) as cold:
        per_token = cold._runner.prefix_bytes_per_token()
        expected = [await _generate(cold, ids, max_tokens=8) for ids in prompts]
        followers = [ids + tokens[:5] for ids, (tokens, _) in zip(prompts, expected)]
        expected_followers = [await _generate(cold, ids, max_tokens=8) for ids in followers]
    budget = int(2.5 * (length + 7) * per_token)
    warm_config = EngineConfig(**{**_fields(config), "prefix_cache_bytes": budget})
    async with AsyncEngine(warm_config) as engine:
        failures = _checked(engine)
        got = [await _generate(engine, ids, max_tokens=8) for ids in prompts]
        await _idle(engine)
        assert len(engine._runner.prefix_entries) == 2  # the older ones were evicted
        got_followers = [None] * len(followers)
        for i in reversed(range(len(followers))):  # the newest entries first
            got_followers[i] = await _generate(engine, followers[i], max_tokens=8)
            await _idle(engine)
        hits = [last.cached_tokens for _, last in got_followers]
    assert not failures, failures[:5]
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [t for t, _ in got_followers] == [t for t, _ in expected_followers]
    assert hits[-2:] == [len(f) - 1 for f in followers[-2:]]  # their entries survived
    assert all(h < len(p) for h, p in zip(hits[:-2], prompts))  # theirs were evicted


@bundled
async def test_metrics_count_prefix_hits_in_tokens():
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), prefix_cache_bytes=64 << 20,
                          num_speculative_tokens=0)  # fmt: skip
    first, second = _prompts(2)
    async with AsyncEngine(config) as engine:
        tokens, _ = await _generate(engine, first, max_tokens=6)
        await _idle(engine)
        follow = first + tokens + second[:10]
        _, last = await _generate(engine, follow, max_tokens=6)
        text = engine.metrics.exposition().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("flashbatch_prefix_cache")}  # fmt: skip
    assert last.cached_tokens == len(first) + len(tokens) - 1
    assert values["flashbatch_prefix_cache_queries_total"] == len(first) + len(follow)
    assert values["flashbatch_prefix_cache_hits_total"] == last.cached_tokens


async def test_random_arrivals_aborts_and_evictions_stay_exact(
    qwen3_target_dir, drafter_dir, vocab_size
):
    """Requests sharing a few stems arrive at random times with random depths, some are
    aborted, and a budget of a few entries keeps evicting: every finished request equals
    plain greedy decoding, the bookkeeping holds after every step, and hits happened."""
    import random

    from engine.models.loading import load_target_model

    rng = random.Random(4)
    stems = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    requests = []
    for i in range(24):
        prompt = rng.choice(stems) + [
            rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 6))
        ]
        abort_after = rng.choice([None, None, None, 0.05, 0.2])
        requests.append((f"r{i}", prompt, rng.randint(1, 12), rng.choice([None, 0, 2, 4]),
                         rng.uniform(0, 0.6), abort_after))  # fmt: skip
    config = EngineConfig(target=str(qwen3_target_dir), drafter=str(drafter_dir), max_num_seqs=6,
                          prefill_chunk_tokens=16, prefix_cache_bytes=1)  # fmt: skip
    async with AsyncEngine(config) as engine:
        # A budget of about three entries, in the loaded model's bytes per token.
        budget = 3 * 40 * engine._runner.prefix_bytes_per_token()
        engine.config.prefix_cache_bytes = engine.scheduler.prefix.budget_bytes = budget
        failures = _checked(engine)

        async def one(request_id, prompt, max_tokens, depth, delay, abort_after):
            await asyncio.sleep(delay)
            if abort_after is not None:
                # Too long to finish in one step, and left after its first output at the
                # latest, so it is aborted mid-flight however fast the machine is.
                max_tokens = 40
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                    num_speculative_tokens=depth)  # fmt: skip
            tokens, last = [], None
            with anyio.move_on_after(abort_after if abort_after is not None else 60):
                async for out in engine.generate(prompt, params, request_id=request_id):
                    tokens += out.token_ids
                    last = out
                    if abort_after is not None:
                        break
            return tokens, last

        results = await asyncio.gather(*[one(*r) for r in requests])
        await _idle(engine)
        created = engine.scheduler.prefix._next_id
        assert created > len(engine._runner.prefix_entries) > 0  # entries came and went
        assert engine.kv_bytes() == 0  # finished and aborted rows left nothing behind
    assert not failures, failures[:5]
    model, _ = load_target_model(qwen3_target_dir)
    finished = 0
    for (request_id, prompt, max_tokens, *_), (tokens, last) in zip(requests, results):
        if last is None or not last.finished:
            continue  # aborted
        finished += 1
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                              sampler=lambda x: mx.argmax(x, -1))  # fmt: skip
        assert tokens == [int(t) for t, _ in steps], request_id
    assert 12 <= finished < len(requests)  # some were aborted mid-flight
    assert sum(last.cached_tokens for _, last in results if last is not None) > 0
