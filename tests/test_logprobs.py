"""Logprobs under speculation, on the bundled pair: every committed token's log-probability
and its top alternatives equal mlx-lm's own forward log-softmax at that position, whatever the
draft depth (fixed, adaptive, off), greedy or sampled."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams, load_pair
from engine.bundled.pair import bundled_paths
from engine.bundled.workloads import load_workloads

TARGET, DRAFTER = bundled_paths()
pytestmark = pytest.mark.skipif(
    not (TARGET / "config.json").is_file() or not (DRAFTER / "config.json").is_file(),
    reason="the bundled pair is not built in this checkout (python -m engine.bundled.build)",
)
TOLERANCE = 1e-4  # float32: verify forwards of other widths and batch sizes round differently


@pytest.fixture(scope="module")
def pair():
    return load_pair(TARGET, DRAFTER)


def reference_logprobs(model, prompt: list[int], output: list[int]) -> mx.array:
    """mlx-lm's forward over prompt + output, log-softmax at each output token's position."""
    logits = model(mx.array([prompt + output]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logprobs[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def check_against_reference(model, prompt, tokens, entries, wanted) -> None:
    assert len(entries) == len(tokens) > 0
    reference = reference_logprobs(model, prompt, tokens)
    for j, entry in enumerate(entries):
        row = reference[j]
        assert entry.token_id == tokens[j]
        assert abs(entry.logprob - row[tokens[j]].item()) < TOLERANCE, (j, entry)
        assert len(entry.top) == wanted
        best = mx.sort(row)[::-1][:wanted].tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        for (token, value), expected in zip(entry.top, best):
            assert abs(value - row[token].item()) < TOLERANCE
            assert abs(value - expected) < TOLERANCE  # they are the most likely ones


async def _run(prompts, depth, wanted, **params):
    config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4,
                          num_speculative_tokens=depth)  # fmt: skip
    async with AsyncEngine(config) as engine:

        async def one(ids, k):
            sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=k, **params)
            tokens, entries, last = [], [], None
            async for out in engine.generate(ids, sp):
                if k is None:
                    assert out.logprobs is None
                else:
                    assert len(out.logprobs) == len(out.token_ids)  # each delta its own
                    entries += out.logprobs
                tokens += out.token_ids
                last = out
            return tokens, entries, last

        return await asyncio.gather(*[one(p, k) for p, k in zip(prompts, wanted)])


@pytest.mark.parametrize("depth", [3, None, 0], ids=["depth3", "adaptive", "off"])
def test_logprobs_equal_the_target_forward_at_any_depth(pair, depth):
    texts = load_workloads()["completion"][:2] + load_workloads()["prose"][:1]
    prompts = [list(pair.tokenizer.encode(t)) for t in texts]
    wanted = [0, 5, 20]
    results = asyncio.run(_run(prompts, depth, wanted))
    drafted = 0
    for prompt, k, (tokens, entries, last) in zip(prompts, wanted, results):
        check_against_reference(pair.target.model, prompt, tokens, entries, k)
        drafted += last.accepted_tokens
    if depth == 3:
        assert drafted > 0  # accepted drafts took their logprobs from verify positions > 0


def test_sampled_logprobs_are_raw_and_requests_without_them_pay_nothing(pair):
    """Sampled at temperature 0.7 with top-p: the values are the raw distribution's, not the
    tempered one's; a request in the same batch that did not ask gets none."""
    texts = load_workloads()["editing"][:2]
    prompts = [list(pair.tokenizer.encode(t)) for t in texts]
    results = asyncio.run(_run(prompts, 3, [2, None], temperature=0.7, top_p=0.9, seed=5))
    (tokens, entries, _), (other_tokens, other_entries, _) = results
    check_against_reference(pair.target.model, prompts[0], tokens, entries, 2)
    assert other_entries == [] and len(other_tokens) == 20


def test_prompt_logprobs_over_chunked_and_batched_prefills(pair):
    """Prompt logprobs (echo's) from the prefill's logits: a long prompt prefilled in chunks
    and short prompts prefilled together in one padded forward, all equal to mlx-lm's forward;
    the first token has none. Such requests skip the prefix cache (it has no logits)."""
    long_prompt = list(pair.tokenizer.encode(load_workloads()["completion"][0]))
    short = [list(pair.tokenizer.encode(t)) for t in load_workloads()["prose"][:3]]

    async def run():
        config = EngineConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=4,
                              prefill_chunk_tokens=64, num_speculative_tokens=3)  # fmt: skip
        async with AsyncEngine(config) as engine:

            async def one(ids, k):
                params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k)
                outs = [out async for out in engine.generate(ids, params)]
                assert all(o.prompt_logprobs is None for o in outs[1:])
                return outs[0].prompt_logprobs, outs[-1].cached_tokens

            first = await one(long_prompt, 2)
            again = await one(long_prompt, 2)  # would hit the cache without prompt logprobs
            return [first, again] + list(await asyncio.gather(*[one(p, 0) for p in short]))

    results = asyncio.run(run())
    for prompt, (entries, cached) in zip([long_prompt, long_prompt] + short, results):
        assert cached == 0 and entries[0] is None and len(entries) == len(prompt)
        logits = pair.target.model(mx.array([prompt]))[0].astype(mx.float32)
        reference = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for j, entry in enumerate(entries[1:], start=1):
            assert entry.token_id == prompt[j]
            assert abs(entry.logprob - reference[j - 1, prompt[j]].item()) < TOLERANCE, j
            for token, value in entry.top:
                assert abs(value - reference[j - 1, token].item()) < TOLERANCE


def test_prompt_logprobs_of_chunks_riding_beside_decoding_rows(pair, monkeypatch):
    """A prompt-logprobs request joining a batch that decodes: its chunks ride in the rows'
    packed forward (the head on every one of their positions), and its entries still equal
    mlx-lm's forward; the decoding request's output is plain greedy decoding's."""
    from engine.step import runner as runner_module

    rode: list[int] = []
    real_done = runner_module.ModelRunner._segment_done

    def spying(self, segment, first_tokens):
        if segment.all_logits is not None:
            rode.append(segment.chunk.end - segment.chunk.start)
        real_done(self, segment, first_tokens)

    monkeypatch.setattr(runner_module.ModelRunner, "_segment_done", spying)
    long_prompt = list(pair.tokenizer.encode(load_workloads()["completion"][0]))
    other = list(pair.tokenizer.encode(load_workloads()["prose"][0]))

    async def run():
        config = EngineConfig(target=str(TARGET), max_num_seqs=4, prefill_chunk_tokens=64,
                              num_speculative_tokens=0)  # fmt: skip
        async with AsyncEngine(config) as engine:
            decoding = SamplingParams(max_tokens=48, ignore_eos=True)
            stream = engine.generate(other, decoding)
            tokens = list((await anext(stream)).token_ids)  # decoding now
            params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3)
            outs = [out async for out in engine.generate(long_prompt, params)]
            async for out in stream:
                tokens += out.token_ids
            return outs[0].prompt_logprobs, tokens

    entries, tokens = asyncio.run(run())
    assert rode  # at least one chunk rode (one computed beside a lookahead goes apart)
    logits = pair.target.model(mx.array([long_prompt]))[0].astype(mx.float32)
    reference = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert entries[0] is None and len(entries) == len(long_prompt)
    for j, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == long_prompt[j]
        assert abs(entry.logprob - reference[j - 1, long_prompt[j]].item()) < TOLERANCE, j
        assert len(entry.top) == 3
        for token, value in entry.top:
            assert abs(value - reference[j - 1, token].item()) < TOLERANCE
    expected = reference_greedy(pair.target.model, other, 48)
    assert tokens == expected


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(token) for token, _ in steps]
