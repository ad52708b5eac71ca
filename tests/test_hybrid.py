"""Hybrid drafting: prompt lookup beside DFlash, chosen per row and per step.

Greedy output equals plain mlx-lm decoding whatever mix of sources a batch drafts from;
sampled output keeps the target's distribution; lookup rows never enter the drafter forward;
and a row that switches sources keeps its DFlash session level with the target."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from test_engine import (
    _CHI2_CRITICAL,
    _chi_square,
    check_invariants,
    plain_greedy,
    run_all,
    wait_idle,
)

from engine import AsyncEngine, EngineConfig, SamplingParams, load_pair
from engine.bundled.pair import bundled_paths
from engine.bundled.workloads import load_workloads
from engine.models.loading import load_target_model
from engine.step.kv_cache import RaggedKVCache
from scheduler.sources import DFLASH, LOOKUP, DraftOptions

TARGET, DRAFTER = bundled_paths()
needs_bundle = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFTER / "config.json").is_file(),
    reason="the bundled pair is not built in this checkout (python -m engine.bundled.build)",
)


def repetitive_prompt(rng_base: int, vocab: int, unit: int = 6, times: int = 4) -> list[int]:
    """A short unit repeated: lookup always has a match, so it drafts every step."""
    block = [3 + (rng_base * 7 + 11 * j) % (vocab - 3) for j in range(unit)]
    return block * times


def copy_heavy_prompts(tokenizer, n: int) -> list[list[int]]:
    """Bundled workload texts given twice (with the second copy cut short), so the trained
    target continues by copying and lookup drafts get accepted."""
    texts = load_workloads()["editing"][:n]
    out = []
    for text in texts:
        ids = list(tokenizer.encode(text))[-90:]
        out.append(ids + ids[: len(ids) // 3])
    return out


@pytest.mark.parametrize("depth", [5, None])
async def test_lookup_only_engine_equals_plain_greedy_on_any_target(target_dir, vocab_size, depth):
    """No DFlash drafter at all: lookup or nothing, for a qwen3 and a llama target, at a fixed
    depth and adaptive."""
    requests = [
        (f"l{i}", repetitive_prompt(i, vocab_size, unit=3 + i % 4), 6 + 3 * i, None, 0.01 * i)
        for i in range(8)
    ]
    requests.append(("plain", [7, 8, 9], 10, None, 0))  # no match anywhere: verifies plainly
    config = EngineConfig(target=str(target_dir), max_num_seqs=6, num_speculative_tokens=depth)
    async with AsyncEngine(config) as engine:
        assert engine.draft_sources == (LOOKUP,) and engine._runner.drafter is None
        failures = check_invariants(engine)
        lookup_rows = []
        engine.step_hooks.append(lambda r: lookup_rows.append(r.lookup_rows))
        results = await run_all(engine, requests)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    model, _ = load_target_model(target_dir)
    for (request_id, prompt, max_tokens, _, _), (tokens, last) in zip(requests, results):
        assert tokens == plain_greedy(model, prompt, max_tokens), request_id
        assert set(last.drafted_by_source) <= {LOOKUP}
        assert last.drafted_tokens == sum(last.drafted_by_source.values())
    if depth is not None:  # random targets leave the prompt's pattern soon: a few drafts only
        assert sum(lookup_rows) > 0
        assert sum(last.drafted_by_source.get(LOOKUP, 0) for _, last in results) > 0


@needs_bundle
async def test_mixed_sources_in_one_batch_equal_plain_greedy_and_skip_the_drafter():
    """Rows drafting from DFlash, from lookup, from either and from nothing share steps; greedy
    output equals mlx-lm's, and on steps where no row takes DFlash no drafter forward runs."""
    pair = load_pair(TARGET, DRAFTER)
    prompts = copy_heavy_prompts(pair.tokenizer, 8)
    choices = [[DFLASH], [LOOKUP], None, [], [LOOKUP], [LOOKUP], [DFLASH], None]
    # Rows that may take DFlash finish early, so the later steps draft by lookup alone.
    lengths = [12 if c is None or DFLASH in c else 40 for c in choices]
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=8,
                          num_speculative_tokens=4)  # fmt: skip
    async with AsyncEngine(config) as engine:
        drafter = engine._runner.drafter
        forwards = []  # drafter calls (proposals and context writes) during the current step
        for name in ("propose", "flush"):
            original = getattr(drafter, name)

            def counted(*a, _original=original, **k):
                forwards.append(1)
                return _original(*a, **k)

            setattr(drafter, name, counted)
        steps = []

        def hook(result) -> None:
            steps.append((result.drafted_rows, result.lookup_rows, len(forwards)))
            forwards.clear()

        engine.step_hooks.append(hook)
        failures = check_invariants(engine)

        async def one(i: int):
            params = SamplingParams(max_tokens=lengths[i], ignore_eos=True,
                                    draft_sources=choices[i])  # fmt: skip
            last, tokens = None, []
            async for out in engine.generate(prompts[i], params, request_id=f"m{i}"):
                tokens += out.token_ids
                last = out
            return tokens, last

        results = await asyncio.gather(*[one(i) for i in range(len(prompts))])
        await wait_idle(engine)
    assert not failures, failures[:5]
    for prompt, n, (tokens, _) in zip(prompts, lengths, results):
        assert tokens == plain_greedy(pair.target.model, prompt, n)
    for allowed, (_, last) in zip(choices, results):
        used = set(last.drafted_by_source)
        assert used <= set(allowed if allowed is not None else (DFLASH, LOOKUP))
        assert last.accepted_tokens == sum(last.accepted_by_source.values())
    accepted = {
        s: sum(last.accepted_by_source.get(s, 0) for _, last in results) for s in (DFLASH, LOOKUP)
    }
    assert accepted[DFLASH] > 0 and accepted[LOOKUP] > 20, accepted
    assert any(d and k for d, k, _ in steps), "no step mixed DFlash and lookup rows"
    lookup_only = [(d, k, f) for d, k, f in steps if k and not d]
    assert lookup_only, "no step drafted by lookup alone"
    assert all(f == 0 for _, _, f in lookup_only), lookup_only
    assert all(f >= 1 for d, _, f in steps if d)


@needs_bundle
async def test_all_lookup_rows_run_no_drafter_forward():
    pair = load_pair(TARGET, DRAFTER)
    prompts = copy_heavy_prompts(pair.tokenizer, 4)
    # A fixed depth, so lookup surely drafts (an adaptive engine may park it on a loaded machine).
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4,
                          num_speculative_tokens=4)  # fmt: skip
    async with AsyncEngine(config) as engine:
        drafter = engine._runner.drafter
        calls = []
        drafter.propose = lambda *a, **k: calls.append("propose")
        drafter.model.append_context = lambda *a, **k: calls.append("context")
        requests = [(f"a{i}", p, 32, None, 0) for i, p in enumerate(prompts)]
        results = await run_all(engine, requests, draft_sources=[LOOKUP])
    assert calls == []
    assert sum(last.drafted_by_source.get(LOOKUP, 0) for _, last in results) > 0
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == plain_greedy(pair.target.model, prompt, 32)


class LookupOnly:
    """Depth 3 by lookup wherever a row matches, else nothing: DFlash is never chosen, though
    every request has a DFlash session."""

    def choose(self, requests, max_depth):
        raise AssertionError("the engine should ask choose_drafts")

    def choose_drafts(self, requests, options: dict[str, DraftOptions]):
        usable = [r.request_id for r in requests if LOOKUP in options[r.request_id].sources]
        depths = {r.request_id: 3 if r.request_id in usable else 0 for r in requests}
        return depths, dict.fromkeys(usable, LOOKUP)

    def observe(self, result) -> None:
        pass


@needs_bundle
async def test_requests_that_never_draft_with_dflash_never_run_the_drafter():
    """The drafter writes a request's context only when it drafts: while the controller
    chooses lookup or nothing, no drafter forward runs, not even for the prompts at their
    joins, and each DFlash session holds every committed position as pending rows."""
    pair = load_pair(TARGET, DRAFTER)
    # Prompts of 400-600 tokens: longer than a flush at the join used to allow.
    prompts = [(p * 8)[: 400 + 50 * i] for i, p in enumerate(copy_heavy_prompts(pair.tokenizer, 4))]
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4)
    async with AsyncEngine(config, depth_policy=LookupOnly()) as engine:
        runner = engine._runner
        forwards = []
        real_append = runner.drafter.model.append_context
        runner.drafter.model.append_context = lambda *a: forwards.append(1) or real_append(*a)
        held = []
        engine.step_hooks.append(lambda _: held.append(runner.draft_rows()))
        engine.step_hooks.append(lambda _: held.append(runner.cache_lengths()))
        requests = [(f"p{i}", p, 24, None, 0) for i, p in enumerate(prompts)]
        results = await run_all(engine, requests)
    assert forwards == []
    assert sum(last.drafted_by_source.get(LOOKUP, 0) for _, last in results) > 0
    pairs = list(zip(held[::2], held[1::2]))
    assert any(rows for rows, _ in pairs)
    for rows, lengths in pairs:
        for request_id, (context, pending) in rows.items():
            assert context == 0 and pending == lengths[request_id]
    for prompt, (tokens, _) in zip(prompts, results):
        assert tokens == plain_greedy(pair.target.model, prompt, 24)


@needs_bundle
async def test_a_first_proposal_writes_the_prompt_and_reports_it():
    """A request's first DFlash proposal writes its whole prompt into the drafter and the step
    says so (`draft_context_rows`, which keeps the catch-up out of the cost model); drafting
    on every step after it, each proposal writes only the rows the last step committed."""
    pair = load_pair(TARGET, DRAFTER)
    (prompt,) = copy_heavy_prompts(pair.tokenizer, 1)
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=1,
                          num_speculative_tokens=3, draft_sources=[DFLASH])  # fmt: skip
    async with AsyncEngine(config) as engine:
        steps = []
        engine.step_hooks.append(steps.append)
        ((tokens, _),) = await run_all(engine, [("s", prompt, 24, None, 0)])
    drafting = [r for r in steps if r.drafted_rows]
    assert drafting[0].draft_context_rows == len(prompt)
    for before, step in zip(drafting, drafting[1:]):
        assert step.draft_context_rows == len(before.outcomes["s"].tokens)
    assert tokens == plain_greedy(pair.target.model, prompt, 24)


class AlternatingSources:
    """Lookup on two steps, DFlash on the third, ... at depth 4 (depth 0 where lookup has no
    match); records the committed sequence each time DFlash is chosen."""

    def __init__(self) -> None:
        self.steps = 0
        self.dflash_contexts: list[list[int]] = []

    def choose(self, requests, max_depth):
        raise AssertionError("the engine should ask choose_drafts")

    def choose_drafts(self, requests, options: dict[str, DraftOptions]):
        self.steps += 1
        depths, sources = {}, {}
        for r in requests:
            source = DFLASH if self.steps % 3 == 0 else LOOKUP
            usable = source in options[r.request_id].sources
            depths[r.request_id] = 4 if usable else 0
            if usable:
                sources[r.request_id] = source
                if source == DFLASH:
                    self.dflash_contexts.append(r.prompt_ids + r.stop.token_ids)
        return depths, sources

    def observe(self, result) -> None:
        pass


@needs_bundle
async def test_switching_sources_keeps_the_dflash_session_in_sync():
    """Each DFlash proposal after lookup steps equals the proposal of a fresh session that was
    given every committed position at once."""
    pair = load_pair(TARGET, DRAFTER)
    (prompt,) = copy_heavy_prompts(pair.tokenizer, 1)
    policy = AlternatingSources()
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=1)
    async with AsyncEngine(config, depth_policy=policy) as engine:
        drafter = engine._runner.drafter
        proposals = []
        original = drafter.propose

        def recorded(sessions, anchors, depths):
            candidates = original(sessions, anchors, depths)
            proposals.append((candidates.tokens.tolist()[0], depths[0]))  # an extra sync: fine
            return candidates

        drafter.propose = recorded
        failures = check_invariants(engine)
        steps = []
        engine.step_hooks.append(steps.append)
        ((tokens, last),) = await run_all(engine, [("s", prompt, 48, None, 0)])
    assert not failures, failures[:5]
    # A step without a drafter forward (lookup, or plain) wrote no drafter context: a count
    # left over from the last DFlash step would keep every later step out of the cost model.
    first = next(i for i, r in enumerate(steps) if r.drafted_rows)
    others = [r for r in steps[first:] if r.batch_size and not r.drafted_rows]
    assert others and all(r.draft_context_rows == 0 for r in others)
    # Each step reports the row's DFlash backlog; the next DFlash proposal writes exactly it.
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if b.drafted_rows and a.draft_backlogs]
    assert len(pairs) >= 3
    assert all(b.draft_context_rows == sum(a.draft_backlogs.values()) for a, b in pairs)
    assert tokens == plain_greedy(pair.target.model, prompt, 48)
    assert last.drafted_by_source.get(LOOKUP, 0) > 0 and len(proposals) >= 4
    assert len(proposals) == len(policy.dflash_contexts)
    # The reference: one target forward over all cached positions, one commit, one proposal.
    reference = load_pair(TARGET, DRAFTER)
    for (drafts, depth), sequence in zip(proposals, policy.dflash_contexts):
        cache = [RaggedKVCache(1) for _ in reference.target.layers]
        _, features = reference.target(mx.array([sequence[:-1]]), cache)
        session = reference.drafter.open(sequence)
        reference.drafter.commit(session, features[0], sequence[:-1])
        expected = reference.drafter.propose([session], [sequence[-1]], [depth]).tokens.tolist()[0]
        reference.drafter.close(session)
        assert drafts == expected, len(sequence)


async def test_sampling_with_lookup_drafts_matches_plain_sampling(qwen3_target_dir):
    """Chi-square: tokens of seeded sampled runs drafted by lookup (often accepted, often not)
    against plain sampling; verification keeps the target's distribution."""
    # The random target's greedy text falls into a run of one token early on (it does for
    # this fixture); ending the prompt there gives lookup drafts the target often samples.
    model, _ = load_target_model(qwen3_target_dir)
    start = [5, 17, 99]
    prompt = start + plain_greedy(model, start, 8)
    runs = 600
    params = dict(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=32,
                          max_waiting_requests=runs, num_speculative_tokens=3)  # fmt: skip

    async def sample_all(engine, seed_base, depth):
        async def one(i):
            sp = SamplingParams(seed=seed_base + i, num_speculative_tokens=depth, **params)
            tokens, last = [], None
            async for out in engine.generate(prompt, sp):
                tokens += out.token_ids
                last = out
            return tokens, last.accepted_by_source.get(LOOKUP, 0)

        return await asyncio.gather(*[one(i) for i in range(runs)])

    async with AsyncEngine(config) as engine:
        plain = await sample_all(engine, 0, 0)
        drafted = await sample_all(engine, 100_000, None)
    assert sum(a for _, a in drafted) > runs // 4
    for position in (1, 2, 3):
        stat, dof = _chi_square([t[position] for t, _ in plain], [t[position] for t, _ in drafted])
        assert stat < _CHI2_CRITICAL[min(dof, 11) - 1], (position, stat, dof)


class DraftWhenMatched:
    """Depth 3 from one fixed source whenever the row's lookup index matches, else plain."""

    def __init__(self, source: str) -> None:
        self.source = source

    def choose(self, requests, max_depth):
        raise AssertionError("the engine should ask choose_drafts")

    def choose_drafts(self, requests, options: dict[str, DraftOptions]):
        depths = {r.request_id: 3 if options[r.request_id].lookup_match else 0 for r in requests}
        return depths, {rid: self.source for rid, d in depths.items() if d}

    def observe(self, result) -> None:
        pass


class MirrorEngine(AsyncEngine):
    """The DFlash slot holds a second lookup drafter (it implements the same `Drafter`
    protocol), so "dflash" drafts are exactly the drafts lookup would propose."""

    def _load(self):
        from drafters.lookup import LookupDrafter
        from engine import TargetAdapter
        from engine.step.runner import ModelRunner

        model, tokenizer = load_target_model(self.config.target)
        runner = ModelRunner(TargetAdapter(model, [1]), LookupDrafter(2, 4, 7),
                             lookup=LookupDrafter(2, 4, 7))  # fmt: skip
        return runner, tokenizer


async def test_seeded_sampling_is_unchanged_by_the_drafting_source(qwen3_target_dir):
    """The same drafts reaching the verify from the DFlash slot or from lookup give the same
    seeded samples: the source changes where drafts come from, nothing else."""
    model, _ = load_target_model(qwen3_target_dir)
    start = [5, 17, 99]
    prompt = start + plain_greedy(model, start, 8)  # ends in a run lookup continues (above)
    outputs = {}
    for source in (LOOKUP, DFLASH):
        config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=16)
        async with MirrorEngine(config, depth_policy=DraftWhenMatched(source)) as engine:
            failures = check_invariants(engine)

            async def one(seed: int):
                params = SamplingParams(max_tokens=16, temperature=1.0, top_k=2, seed=seed,
                                        ignore_eos=True)  # fmt: skip
                tokens, last = [], None
                async for out in engine.generate(prompt, params):
                    tokens += out.token_ids
                    last = out
                return tokens, last

            results = await asyncio.gather(*[one(seed) for seed in range(32)])
        assert not failures, failures[:5]
        outputs[source] = [tokens for tokens, _ in results]
        assert all(set(last.drafted_by_source) <= {source} for _, last in results)
        accepted = sum(last.accepted_by_source.get(source, 0) for _, last in results)
        assert accepted > 10
    assert outputs[LOOKUP] == outputs[DFLASH]


class PlainPolicy:
    """Never drafts and always expects a plain next step; `wants` answers `lookup_wanted`
    for every row."""

    def __init__(self, wants: bool) -> None:
        self.wants = wants

    def choose(self, requests, max_depth):
        return {r.request_id: 0 for r in requests}

    def observe(self, result) -> None:
        pass

    def expects_plain_next(self) -> bool:
        return True

    def lookup_wanted(self, request_ids: list[str]) -> set[str]:
        return set(request_ids) if self.wants else set()


async def test_no_lookahead_while_a_row_that_would_take_lookup_has_a_match(
    qwen3_target_dir, vocab_size
):
    """A looked-ahead plain step is wasted when the next plan drafts: the runner keeps none
    after a step that leaves a row the policy would give lookup drafts with a match (one
    built early, before the match was known, is dropped unrun and the cache restored), and
    keeps them as before when the policy would not."""
    prompt = repetitive_prompt(1, vocab_size, unit=2, times=6)
    model, _ = load_target_model(qwen3_target_dir)
    kept, matched, unbuilt = {}, {}, {}
    for wants in (True, False):
        config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=2)
        async with AsyncEngine(config, depth_policy=PlainPolicy(wants)) as engine:
            runner = engine._runner
            kept[wants], matched[wants], unbuilt[wants] = [], [], []
            original_unbuild = runner._unbuild
            runner._unbuild = lambda la, w=wants, f=original_unbuild: unbuilt[w].append(1) or f(la)
            engine.step_hooks.append(
                lambda r, w=wants: matched[w].append(any(r.lookup_matches.values()))
            )
            original_execute = runner.execute

            def execute(plan, w=wants, run=runner, f=original_execute):
                result = f(plan)
                if run._lookahead is not None:  # read on the MLX thread, before `advance`
                    kept[w].append(1)
                return result

            runner.execute = execute
            results = await run_all(engine, [("w", prompt, 24, None, 0)])
        assert results[0][0] == plain_greedy(model, prompt, 24)
    assert matched[True] == matched[False] and sum(matched[True]) >= 2
    assert len(kept[True]) <= matched[True].count(False)
    assert len(kept[False]) >= len(kept[True]) + sum(matched[True]) - 1
    assert unbuilt[True] and not unbuilt[False]


class HeldPolicy(PlainPolicy):
    """Never drafts; `held` answers `holds_drafting` (a guard holding every batch size)."""

    def __init__(self, held: bool) -> None:
        super().__init__(wants=False)
        self.held = held

    def holds_drafting(self, batch: int) -> bool:
        return self.held


async def test_a_held_engine_asks_for_no_lookup_match_and_indexes_nothing(
    qwen3_target_dir, vocab_size
):
    """While the policy holds drafting nobody reads lookup matches: the runner reports 0 for
    every row and the lookup index only stores tokens (indexed at the join, then no further);
    not held, the same run matches and indexes every step. Output is plain greedy both ways."""
    prompt = repetitive_prompt(1, vocab_size, unit=2, times=6)
    model, _ = load_target_model(qwen3_target_dir)
    matched, indexed = {}, {}
    for held in (True, False):
        config = EngineConfig(target=str(qwen3_target_dir), max_num_seqs=2)
        async with AsyncEngine(config, depth_policy=HeldPolicy(held)) as engine:
            runner = engine._runner
            matched[held], indexed[held] = [], []

            def seen(result, h=held, run=runner):
                matched[h].append(any(result.lookup_matches.values()))
                indexed[h] += [s.index.indexed for s in run.lookup_sessions().values()]

            engine.step_hooks.append(seen)
            results = await run_all(engine, [("w", prompt, 24, None, 0)])
        assert results[0][0] == plain_greedy(model, prompt, 24)
    assert not any(matched[True]) and sum(matched[False]) >= 2
    assert len(set(indexed[True])) == 1  # the join's, never more
    assert len(set(indexed[False])) > 10
