"""Sampling parameters are validated before any work; the sampler's filters do what they say."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from engine import InvalidRequest, SamplingParams
from engine.step.sampling import (
    draw_uniforms,
    filtered_logprobs,
    request_stream,
    sample,
    sample_rows,
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": -3}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"stop_token_ids": [10_000]}, "stop_token_ids"),
    ],
)
def test_invalid_parameters_are_rejected_by_name(fields, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**fields).validate(vocab_size=100)


LOGITS = mx.log(mx.array([[0.5, 0.25, 0.15, 0.07, 0.03]]))


def _kept(params: SamplingParams) -> list[int]:
    lp = filtered_logprobs(LOGITS, params)[0]
    return [i for i, v in enumerate(lp.tolist()) if v > -math.inf]


def test_filters_keep_the_right_tokens():
    assert _kept(SamplingParams(temperature=1.0)) == [0, 1, 2, 3, 4]
    assert _kept(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert _kept(SamplingParams(temperature=1.0, top_p=0.7)) == [0, 1]
    assert _kept(SamplingParams(temperature=1.0, top_p=0.8)) == [0, 1, 2]
    assert _kept(SamplingParams(temperature=1.0, min_p=0.3)) == [0, 1, 2]
    lp = filtered_logprobs(LOGITS, SamplingParams(temperature=1.0, top_k=2))[0]
    assert mx.allclose(mx.exp(lp[:2]), mx.array([2 / 3, 1 / 3]), atol=1e-6)


def test_sampling_follows_the_distribution_and_seeds_reproduce():
    params = SamplingParams(temperature=1.0)
    logits = mx.broadcast_to(LOGITS, (20_000, 5))
    tokens = sample(logits, params, request_stream(5))
    freq = [(tokens == i).sum().item() / 20_000 for i in range(5)]
    for got, want in zip(freq, [0.5, 0.25, 0.15, 0.07, 0.03]):
        assert abs(got - want) < 0.015
    again = sample(logits, params, request_stream(5))
    assert mx.array_equal(tokens, again)
    assert sample(LOGITS, SamplingParams(), None).item() == 0


def _frequencies(tokens: mx.array, vocab: int) -> list[float]:
    return [(tokens == i).sum().item() / tokens.size for i in range(vocab)]


@pytest.mark.parametrize("filtered", [False, True], ids=["temperatures", "with-top-k"])
def test_a_batch_samples_each_row_from_its_own_tempered_and_filtered_distribution(filtered):
    """One `sample_rows` pass over rows of different temperatures, filters and widths draws
    each row from its own distribution; greedy rows take the argmax. (Temperatures alone go
    through one batched pass; a filtering row sends the batch row by row.)"""
    n = 20_000
    last = SamplingParams(temperature=2.0, top_k=3 if filtered else 0)
    rows = [
        (SamplingParams(temperature=1.0), n),
        (SamplingParams(temperature=0.5), n),
        (SamplingParams(), 3),  # greedy
        (last, n),
    ]
    params = [p for p, _ in rows]
    widths = [w for _, w in rows]
    streams = [None if p.greedy else request_stream(i) for i, p in enumerate(params)]
    # The greedy row's logits reversed, so its argmax (token 4) is nobody else's likeliest.
    logits = mx.concatenate([
        mx.broadcast_to(LOGITS[:, ::-1] if p.greedy else LOGITS, (w, 5)) for p, w in rows
    ])  # fmt: skip
    tokens = sample_rows(logits, params, streams, widths)
    starts = [0, n, 2 * n, 2 * n + 3]
    for (p, w), start in zip(rows, starts):
        mine = tokens[start : start + w]
        if p.greedy:
            assert mine.tolist() == [4] * w
            continue
        want = mx.exp(filtered_logprobs(LOGITS, p))[0].tolist()
        for got, expected in zip(_frequencies(mine, 5), want):
            assert abs(got - expected) < 0.015, (p, got, expected)


def test_a_rows_draws_ignore_its_neighbours_and_filtered_tokens_are_never_drawn():
    params = SamplingParams(temperature=1.0, top_p=0.7)  # keeps tokens 0 and 1 only
    logits = mx.broadcast_to(LOGITS, (4000, 5))
    alone = sample_rows(logits, [params], [request_stream(9)], [4000])
    assert set(alone.tolist()) == {0, 1}
    other = SamplingParams(temperature=0.7)
    noise = mx.random.normal((37, 5))
    batched = sample_rows(
        mx.concatenate([noise, logits]), [other, params], [request_stream(1), request_stream(9)],
        [37, 4000],
    )  # fmt: skip
    assert mx.array_equal(batched[37:], alone)


def test_a_random_stream_is_its_seed_and_count_alone():
    """A request's uniforms depend on its seed and how many it drew, not on what is drawn
    beside it in the same call; rewinding `drawn` replays them; they lie in [0, 1)."""
    alone = request_stream(7)
    first = draw_uniforms([alone], [5]).tolist()
    beside = request_stream(7)
    together = draw_uniforms([request_stream(8), beside, request_stream(9)], [3, 2, 4]).tolist()
    assert together[3:5] == first[:2]
    assert draw_uniforms([beside], [3]).tolist() == first[2:]
    alone.drawn = 1
    assert draw_uniforms([alone], [4]).tolist() == first[1:]
    assert draw_uniforms([request_stream(8)], [5]).tolist() != first
    many = draw_uniforms([request_stream(3)], [100_000])
    assert 0.0 <= mx.min(many).item() and mx.max(many).item() < 1.0
    assert abs(mx.mean(many).item() - 0.5) < 0.005
    deciles = [((many >= i / 10) & (many < (i + 1) / 10)).mean().item() for i in range(10)]
    assert all(abs(d - 0.1) < 0.005 for d in deciles), deciles
