"""Sampling parameters are validated before any work; the sampler's filters do what they say."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from engine import InvalidRequest, SamplingParams
from engine.sampling import filtered_logprobs, request_key, sample


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
    tokens = sample(logits, params, request_key(5))
    freq = [(tokens == i).sum().item() / 20_000 for i in range(5)]
    for got, want in zip(freq, [0.5, 0.25, 0.15, 0.07, 0.03]):
        assert abs(got - want) < 0.015
    again = sample(logits, params, request_key(5))
    assert mx.array_equal(tokens, again)
    assert sample(LOGITS, SamplingParams(), None).item() == 0
