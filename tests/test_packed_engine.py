"""The engine verifying packed: greedy output under mixed depths equals plain decoding at
concurrency 1, 8 and 32, and seeded sampling of a row does not depend on its neighbours'
depths (each row samples only its own positions)."""

from __future__ import annotations

import random

import pytest
from test_engine import ScriptedEngine, check_invariants, plain_greedy, run_all, wait_idle

from engine import EngineConfig
from engine.models.loading import load_target_model


def _record_layouts(engine) -> list:
    """Every packed verify layout the runner builds."""
    runner = engine._runner
    layouts, original = [], runner._verify_packed

    def verify_packed(*args):
        decode = original(*args)
        layouts.append(decode.layout)
        return decode

    runner._verify_packed = verify_packed
    return layouts


def _record_head_on_rows(engine) -> list:
    """Every padded verify whose LM head ran on the rows' own positions only."""
    runner = engine._runner
    calls, original = [], runner._head_on_rows

    def head_on_rows(*args):
        calls.append(len(args[1]))
        return original(*args)

    runner._head_on_rows = head_on_rows
    return calls


def _mixed_requests(n: int, vocab: int, seed: int, spread: float):
    rng = random.Random(seed)
    return [
        (
            f"m{i}",
            [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))],
            rng.randint(4, 20),
            rng.choice([0, 1, 2, 3, 7, None]),  # per-request cap on the engine's depth 7
            rng.uniform(0, spread),
        )
        for i in range(n)
    ]


async def _greedy_at(
    concurrency: int, count: int, qwen3_target_dir, vocab_size, spread=0.1, packed=True
):
    requests = _mixed_requests(count, vocab_size, seed=concurrency, spread=spread)
    model, _ = load_target_model(qwen3_target_dir)
    references = [p + plain_greedy(model, p, m) for _, p, m, _, _ in requests]
    config = EngineConfig(
        target=str(qwen3_target_dir), max_num_seqs=concurrency, prefill_chunk_tokens=1024,
        num_speculative_tokens=7, packed_verify=packed,
    )  # fmt: skip
    engine = ScriptedEngine(config, references, vocab_size, [7, 2, 0, 5, 1, 3])
    async with engine:
        assert (engine._runner.packed is not None) == packed
        layouts = _record_layouts(engine)
        failures = check_invariants(engine)
        results = await run_all(engine, requests)
        await wait_idle(engine)
        assert engine.kv_bytes() == 0
    assert not failures, failures[:5]
    for reference, (request_id, prompt, _, _, _), (tokens, _) in zip(references, requests, results):
        assert tokens == reference[len(prompt) :], request_id
    assert sum(last.accepted_tokens for _, last in results) > count
    return layouts


async def test_greedy_mixed_depths_equal_plain_decoding_at_1(qwen3_target_dir, vocab_size):
    layouts = await _greedy_at(1, 6, qwen3_target_dir, vocab_size)
    assert layouts and all(layout.rows == 1 for layout in layouts)


async def test_greedy_mixed_depths_equal_plain_decoding_at_8(qwen3_target_dir, vocab_size):
    layouts = await _greedy_at(8, 24, qwen3_target_dir, vocab_size)
    # Rows of different widths verified in one forward, each paying only its own positions.
    assert any(len(set(layout.widths)) > 2 for layout in layouts)
    assert any(layout.total < layout.rows * layout.max_width for layout in layouts)


async def test_the_padded_fallback_stays_exact_under_mixed_depths(qwen3_target_dir, vocab_size):
    layouts = await _greedy_at(8, 16, qwen3_target_dir, vocab_size, packed=False)
    assert layouts == []  # every drafting step verified padded


async def test_greedy_mixed_depths_equal_plain_decoding_at_32(qwen3_target_dir, vocab_size):
    layouts = await _greedy_at(32, 40, qwen3_target_dir, vocab_size, spread=0.0)
    assert max(layout.rows for layout in layouts) > 16
    assert any(len(set(layout.widths)) > 2 for layout in layouts)


@pytest.mark.parametrize("packed", [True, False])
async def test_seeded_sampling_of_a_row_ignores_its_neighbours_depths(
    qwen3_target_dir, vocab_size, packed
):
    """Rows with drafting off sample exactly as in a batch where nobody drafts, while their
    neighbours draft: packed, and padded where the head is separable (the padded forward's
    LM head and samplers then run on each row's own positions only, `_head_on_rows`)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 12))] for _ in range(8)]
    requests = [(f"s{i}", p, 12, 0 if i % 2 else None, 0) for i, p in enumerate(prompts)]
    model, _ = load_target_model(qwen3_target_dir)
    references = [p + plain_greedy(model, p, 24) for p in prompts]

    async def run(depth: int) -> list[list[int]]:
        config = EngineConfig(
            target=str(qwen3_target_dir), max_num_seqs=8, num_speculative_tokens=depth,
            packed_verify=packed,
        )  # fmt: skip
        async with ScriptedEngine(config, references, vocab_size, [3, 1]) as engine:
            layouts = _record_layouts(engine)
            heads = _record_head_on_rows(engine)
            results = await run_all(engine, requests, temperature=1.0, seed=5)
        assert bool(layouts) == (depth > 0 and packed)
        assert bool(heads) == (depth > 0 and not packed)
        return [tokens for tokens, _ in results]

    drafting, plain = await run(3), await run(0)
    for i in range(1, 8, 2):  # the rows with drafting off
        assert drafting[i] == plain[i], i


def _record_riding(engine) -> list:
    """Every prefill chunk that rode in a decoding step's packed forward."""
    runner = engine._runner
    chunks, original = [], runner._segment_done

    def segment_done(segment, first_tokens):
        chunks.append(segment.chunk)
        return original(segment, first_tokens)

    runner._segment_done = segment_done
    return chunks


def _arrivals(vocab: int, seed: int) -> list:
    """Requests arriving together, three times the engine's slots (`max_num_seqs=4`): the
    later ones wait and join while others decode, whatever the machine's speed (arrivals
    spread over time raced the steps: on a slow machine the queue never built). Some
    prompts are longer than a chunk."""
    rng = random.Random(seed)
    return [
        (f"j{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))],
         rng.randint(16, 32), None, 0.001 * i)
        for i in range(12)
    ]  # fmt: skip


async def test_prefill_chunks_ride_in_the_decoding_step_and_stay_exact(
    qwen3_target_dir, vocab_size
):
    """Requests that arrive while others decode prefill inside the decoding step's packed
    forward (whole prompts and chunks of longer ones), with drafting off and with mixed
    depths: greedy output equals plain decoding, the invariants hold after every step, and
    seeded sampling equals an engine that prefills every chunk in a forward of its own."""
    requests = _arrivals(vocab_size, seed=9)
    model, _ = load_target_model(qwen3_target_dir)
    references = [p + plain_greedy(model, p, m) for _, p, m, _, _ in requests]

    async def run(depth: int, packed: bool = True, **params) -> tuple[list, list]:
        config = EngineConfig(
            target=str(qwen3_target_dir), max_num_seqs=4, prefill_chunk_tokens=16,
            num_speculative_tokens=depth, packed_verify=packed,
        )  # fmt: skip
        async with ScriptedEngine(config, references, vocab_size, [3, 0, 7, 1]) as engine:
            riding = _record_riding(engine)
            failures = check_invariants(engine)
            results = await run_all(engine, requests, **params)
            await wait_idle(engine)
            assert engine.kv_bytes() == 0
        assert not failures, failures[:5]
        return [tokens for tokens, _ in results], riding

    for depth in (0, 7):
        outputs, riding = await run(depth)
        for reference, (request_id, prompt, *_), tokens in zip(references, requests, outputs):
            assert tokens == reference[len(prompt) :], (depth, request_id)
        assert any(c.start == 0 and c.last for c in riding), depth  # whole prompts
        assert any(c.start > 0 for c in riding), depth  # later chunks of a long prompt
        assert any(not c.last for c in riding), depth  # a first chunk, the rest to come

    sampled, riding = await run(0, temperature=1.0, seed=3)
    apart, none_rode = await run(0, packed=False, temperature=1.0, seed=3)
    assert riding and not none_rode
    assert sampled == apart
