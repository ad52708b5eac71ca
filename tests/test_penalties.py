"""logit_bias and the frequency/presence/repetition penalties: against OpenAI's documented
formula, through the sampler at every verify position, and lossless under speculation."""

from __future__ import annotations

import asyncio
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from test_engine import ScriptedEngine

from engine import AsyncEngine, EngineConfig, InvalidRequest, SamplingParams
from engine.models.loading import load_target_model
from engine.step.penalties import TokenHistory
from engine.step.sampling import sample


def openai_reference(logits: np.ndarray, generated: list[int], prompt: list[int],
                     params: SamplingParams) -> np.ndarray:  # fmt: skip
    """One position's logits as OpenAI (and vLLM, for the extension) document them:
    bias added, repetition penalty on seen tokens, then
    mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty."""
    mu = logits.astype(np.float64).copy()
    for token, value in (params.logit_bias or {}).items():
        mu[token] += value
    counts = Counter(generated)
    if params.repetition_penalty != 1.0:
        for token in set(generated) | set(prompt):
            p = params.repetition_penalty
            mu[token] = mu[token] / p if mu[token] > 0 else mu[token] * p
    for token, c in counts.items():
        mu[token] -= c * params.frequency_penalty + (c > 0) * params.presence_penalty
    return mu


@pytest.mark.parametrize(
    "penalties",
    [
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-1.3),
        dict(
            frequency_penalty=1.5,
            presence_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias={3: -100.0, 7: 5.0, 11: 2.5},
        ),  # fmt: skip
        dict(repetition_penalty=0.8),
    ],
)
def test_every_verify_position_matches_the_documented_formula(penalties):
    """Position j counts the committed tokens plus drafts[:j], exactly as if they were
    generated before it."""
    rng = np.random.default_rng(0)
    vocab, width = 40, 5
    params = SamplingParams(**penalties)
    prompt = [1, 2, 3, 2]
    committed = [5, 7, 7, 9, 2]
    drafts = [7, 5, 12, 30]
    history = TokenHistory(params, prompt, vocab)
    history.add(committed)
    logits = rng.normal(0, 3, size=(width, vocab)).astype(np.float32)
    got = np.array(history.adjust(mx.array(logits), mx.array(drafts)))
    for j in range(width):
        want = openai_reference(logits[j], committed + drafts[:j], prompt, params)
        np.testing.assert_allclose(got[j], want, rtol=1e-5, atol=1e-5)


def test_validation_names_the_parameter():
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(frequency_penalty=2.5).validate()
    assert caught.value.param == "frequency_penalty"
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(logit_bias={5: 101.0}).validate()
    assert caught.value.param == "logit_bias"
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(logit_bias={500: 1.0}).validate(vocab_size=100)
    assert caught.value.param == "logit_bias"
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(repetition_penalty=0.0).validate()
    assert caught.value.param == "repetition_penalty"


def test_sampler_applies_the_bias_to_greedy_and_sampled_rows():
    logits = mx.array([[0.0, 5.0, 1.0, 0.5]] * 3)
    greedy = SamplingParams(logit_bias={1: -100.0})
    history = TokenHistory(greedy, [], 4)
    assert sample(logits, greedy, None, history).tolist() == [2, 2, 2]
    from engine.step.sampling import request_stream

    sampled = SamplingParams(temperature=1.0, logit_bias={1: -100.0}, seed=3)
    history = TokenHistory(sampled, [], 4)
    drawn = sample(mx.repeat(logits[:1], 500, axis=0), sampled, request_stream(3), history)
    assert 1 not in drawn.tolist()


def penalised_reference(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Plain greedy decoding (mlx-lm's loop) with the documented formula as a logits
    processor: the independent oracle."""

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens.tolist()[len(prompt) :]
        row = openai_reference(np.array(logits[0].astype(mx.float32)), generated, prompt, params)
        return mx.array(row.astype(np.float32))[None]

    steps = generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
        logits_processors=[processor],
    )  # fmt: skip
    return [int(token) for token, _ in steps]


PENALTIES = dict(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.2,
                 logit_bias={5: 3.0})  # fmt: skip
PROMPTS = [[5, 17, 99, 17, 99], [40, 41, 42, 40, 41, 42, 40, 41], [7, 8, 9, 7], [300, 12]]


async def _generate(engine, prompt, **params):
    tokens, last = [], None
    async for out in engine.generate(prompt, SamplingParams(ignore_eos=True, **params)):
        tokens += out.token_ids
        last = out
    return tokens, last


async def test_greedy_penalised_output_with_lookup_drafts_equals_drafting_off(qwen3_target_dir):
    """Lookup drafts at a fixed depth, several penalised rows and one plain row in the batch:
    every penalised row equals the oracle's penalised greedy decoding, drafting on or off."""
    model, _ = load_target_model(qwen3_target_dir)
    n = 24
    config = EngineConfig(target=str(qwen3_target_dir), num_speculative_tokens=4,
                          draft_sources=["lookup"], max_num_seqs=8)  # fmt: skip
    async with AsyncEngine(config) as engine:
        runs = []
        for depth in (0, None):
            runs.append(await asyncio.gather(
                *[_generate(engine, p, max_tokens=n, num_speculative_tokens=depth, **PENALTIES)
                  for p in PROMPTS],
                _generate(engine, PROMPTS[0], max_tokens=n, num_speculative_tokens=depth),
            ))  # fmt: skip
    off, on = runs
    for prompt, (plain, _), (drafted, _) in zip(PROMPTS, off, on):
        reference = penalised_reference(model, prompt, n, SamplingParams(**PENALTIES))
        assert plain == drafted == reference
    assert sum(last.drafted_tokens for _, last in on[:-1]) > 0
    assert sum(last.accepted_tokens for _, last in on[:-1]) > 0
    assert on[-1][0] == off[-1][0]  # the unpenalised neighbour is untouched
    assert on[-1][0] != on[0][0]  # and the penalties did change something


async def test_accepted_drafts_under_penalties_stay_exact(qwen3_target_dir, vocab_size):
    """A drafter that knows the penalised continuation (spoiled after 0..7 tokens): drafts are
    accepted in the same steps as penalised positions counting them, and output is exact."""
    model, _ = load_target_model(qwen3_target_dir)
    n = 20
    references = [p + penalised_reference(model, p, n, SamplingParams(**PENALTIES))
                  for p in PROMPTS]  # fmt: skip
    config = EngineConfig(target=str(qwen3_target_dir), num_speculative_tokens=7, max_num_seqs=8)
    async with ScriptedEngine(config, references, vocab_size, [7, 2, 0, 5, 1]) as engine:
        results = await asyncio.gather(
            *[_generate(engine, p, max_tokens=n, **PENALTIES) for p in PROMPTS]
        )
    accepted = 0
    for reference, prompt, (tokens, last) in zip(references, PROMPTS, results):
        assert tokens == reference[len(prompt) :]
        accepted += last.accepted_tokens
    assert accepted > 20, accepted


async def test_logit_bias_minus_100_keeps_a_token_out_of_200_samples(qwen3_target_dir):
    config = EngineConfig(target=str(qwen3_target_dir), num_speculative_tokens=3,
                          draft_sources=["lookup"])  # fmt: skip
    prompt = [5, 17, 99]
    async with AsyncEngine(config) as engine:
        free, _ = await _generate(engine, prompt, max_tokens=200, temperature=1.0, seed=1)
        banned = Counter(free).most_common(1)[0][0]
        assert Counter(free)[banned] >= 3
        biased, _ = await _generate(engine, prompt, max_tokens=200, temperature=1.0, seed=1,
                                    logit_bias={banned: -100.0})  # fmt: skip
        # seeded sampling under a bias is the same at every depth
        off, _ = await _generate(engine, prompt, max_tokens=200, temperature=1.0, seed=1,
                                 logit_bias={banned: -100.0}, num_speculative_tokens=0)  # fmt: skip
    assert len(biased) == 200 and banned not in biased
    assert biased == off
