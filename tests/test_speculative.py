"""The single-request speculative loop: lossless, invariant-keeping, stopping at the right token."""

from __future__ import annotations

import mlx.core as mx
import pytest
from factories import ScriptedDrafter
from mlx_lm.generate import generate_step

from engine import SamplingParams, TargetAdapter, generate, load_pair
from engine.step.speculative import StepState

PROMPTS = [
    "def add(a, b):\n    return",
    "import os\n",
    'class Config:\n    """Settings for the',
    "x",
]


def plain_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference: mlx-lm's own greedy decoding of the same prompt."""
    steps = generate_step(
        mx.array(prompt_ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


def load_tapped(target_dir):
    """A target without a real drafter, tapped at one layer so the loop has features to report."""
    pair = load_pair(target_dir)
    pair.target = TargetAdapter(pair.target.model, [1])
    return pair


def check_invariants(states: list[StepState], finished_early: bool = False) -> None:
    checked = states[:-1] if finished_early else states
    for s in checked:
        assert s.target_cache_length == s.committed - 1
        assert s.draft_context_rows + s.draft_pending_rows == s.target_cache_length


@pytest.mark.parametrize("depth", [None, 3, 1, 0])
def test_dflash_greedy_equals_plain_greedy(target_dir, drafter_dir, depth):
    pair = load_pair(target_dir, drafter_dir)
    for prompt in PROMPTS:
        ids = pair.tokenizer.encode(prompt)
        reference = plain_greedy(pair.target.model, ids, 48)
        states: list[StepState] = []
        params = SamplingParams(max_tokens=48, ignore_eos=True, num_speculative_tokens=depth)
        result = generate(
            pair.target, ids, params, drafter=pair.drafter, tokenizer=pair.tokenizer,
            on_step=states.append,
        )  # fmt: skip
        assert result.token_ids == reference, prompt
        check_invariants(states)
        expected_depth = pair.drafter.max_depth if depth is None else depth
        assert max(s.drafted for s in result.steps) == min(expected_depth, 47)


@pytest.mark.parametrize("script", [[7], [0], [2, 5, 0, 7, 1], [3]])
def test_scripted_acceptance_is_lossless_and_counted(qwen3_target_dir, vocab_size, script):
    pair = load_tapped(qwen3_target_dir)
    ids = pair.tokenizer.encode(PROMPTS[0])
    reference = plain_greedy(pair.target.model, ids, 60)
    drafter = ScriptedDrafter([ids + reference], vocab_size, script)
    states: list[StepState] = []
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    result = generate(pair.target, ids, params, drafter=drafter, on_step=states.append)
    assert result.token_ids == reference
    check_invariants(states)
    for step, depth, right in zip(result.steps, drafter.calls, script * 100):
        assert step.drafted == depth
        assert step.accepted == min(right, depth)
        assert step.committed == step.accepted + 1
    if script == [7]:
        assert result.tau > 6.0  # full blocks: 7 drafts + bonus per step


def test_max_tokens_inside_a_block(qwen3_target_dir, vocab_size):
    pair = load_tapped(qwen3_target_dir)
    ids = pair.tokenizer.encode(PROMPTS[1])
    reference = plain_greedy(pair.target.model, ids, 30)
    for max_tokens in (1, 2, 5, 9, 17):
        drafter = ScriptedDrafter([ids + reference], vocab_size, [7])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        result = generate(pair.target, ids, params, drafter=drafter)
        assert result.token_ids == reference[:max_tokens]
        assert result.finish_reason == "length"
        # the draft never runs past the budget: drafted + bonus fits what was left
        assert sum(s.committed for s in result.steps) + 1 == max_tokens


def test_stop_token_inside_a_block(qwen3_target_dir, vocab_size):
    pair = load_tapped(qwen3_target_dir)
    ids = pair.tokenizer.encode(PROMPTS[0])
    reference = plain_greedy(pair.target.model, ids, 40)
    stop_at = 5  # a token deep inside the first full block
    stop_token = reference[stop_at]
    first = reference.index(stop_token)
    drafter = ScriptedDrafter([ids + reference], vocab_size, [7])
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop_token])
    result = generate(pair.target, ids, params, drafter=drafter, tokenizer=pair.tokenizer)
    assert result.token_ids == reference[: first + 1]
    assert result.finish_reason == "stop"
    assert result.text == pair.tokenizer.decode(reference[:first])


def test_eos_inside_a_block_stops_unless_ignored(qwen3_target_dir, vocab_size):
    pair = load_tapped(qwen3_target_dir)
    ids = pair.tokenizer.encode(PROMPTS[2])
    reference = plain_greedy(pair.target.model, ids, 40)
    eos = reference[6]
    first = reference.index(eos)
    drafter = ScriptedDrafter([ids + reference], vocab_size, [7])
    stopped = generate(
        pair.target, ids, SamplingParams(max_tokens=40), drafter=drafter, eos_token_ids={eos}
    )
    assert stopped.token_ids == reference[: first + 1] and stopped.finish_reason == "stop"
    drafter = ScriptedDrafter([ids + reference], vocab_size, [7])
    ignored = generate(
        pair.target, ids, SamplingParams(max_tokens=40, ignore_eos=True), drafter=drafter,
        eos_token_ids={eos},
    )  # fmt: skip
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


def test_stop_string_inside_a_block(qwen3_target_dir, vocab_size):
    pair = load_tapped(qwen3_target_dir)
    tok = pair.tokenizer
    ids = tok.encode(PROMPTS[0])
    reference = plain_greedy(pair.target.model, ids, 40)
    full_text = tok.decode(reference)
    stop = full_text[8:11]
    assert stop and stop in full_text
    cut = full_text.index(stop)
    drafter = ScriptedDrafter([ids + reference], vocab_size, [7])
    params = SamplingParams(max_tokens=40, stop=[stop], ignore_eos=True)
    result = generate(pair.target, ids, params, drafter=drafter, tokenizer=tok)
    assert result.finish_reason == "stop"
    assert result.text == full_text[:cut]
    # output ends at the token that completed the stop string
    assert result.token_ids == reference[: len(result.token_ids)]
    assert stop in tok.decode(result.token_ids)
    assert stop not in tok.decode(result.token_ids[:-1])


def test_seeded_sampling_is_reproducible(qwen3_target_dir, drafter_dir):
    pair = load_pair(qwen3_target_dir, drafter_dir)
    ids = pair.tokenizer.encode(PROMPTS[0])

    def run(seed: int) -> list[int]:
        params = SamplingParams(
            max_tokens=24, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True
        )
        return generate(pair.target, ids, params, drafter=pair.drafter).token_ids

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other


def test_sampled_speculation_with_full_acceptance_matches_plain_sampling_per_step(
    qwen3_target_dir, vocab_size
):
    """Sample-and-match: with top_k=1 sampling is deterministic, so a scripted drafter's output
    must equal the plain (drafter-less) sampled output token for token."""
    pair = load_tapped(qwen3_target_dir)
    ids = pair.tokenizer.encode(PROMPTS[3])
    params = SamplingParams(max_tokens=30, temperature=0.7, top_k=1, seed=1, ignore_eos=True)
    plain = generate(pair.target, ids, params).token_ids
    drafter = ScriptedDrafter([ids + plain], vocab_size, [4, 0, 7])
    speculative = generate(pair.target, ids, params, drafter=drafter)
    assert speculative.token_ids == plain
    assert speculative.accepted > 0


# chi-square critical values at alpha = 0.001 by degrees of freedom
_CHI2_CRITICAL = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26]


def _chi_square_two_sample(a: list[int], b: list[int]) -> tuple[float, int]:
    categories = sorted(set(a) | set(b))
    statistic = 0.0
    for c in categories:
        na, nb = a.count(c), b.count(c)
        expected = (na + nb) / 2
        statistic += (na - expected) ** 2 / expected + (nb - expected) ** 2 / expected
    return statistic, len(categories) - 1


def test_sampled_speculation_follows_the_target_distribution(qwen3_target_dir, vocab_size):
    """Chi-square: tokens 2-4 of seeded speculative runs (drafts often accepted, often not)
    are distributed like plain sampling's."""
    pair = load_tapped(qwen3_target_dir)
    ids = pair.tokenizer.encode(PROMPTS[3])
    greedy_path = plain_greedy(pair.target.model, ids, 6)
    params = dict(max_tokens=4, temperature=1.0, top_k=2, ignore_eos=True)
    runs = 1000  # fewer samples gave p ~ 0.01 dips on some seed ranges (RNG halves checked iid)
    plain, speculative = [], []
    accepted = 0
    for seed in range(runs):
        p = SamplingParams(seed=seed, **params)
        plain.append(generate(pair.target, ids, p).token_ids)
        drafter = ScriptedDrafter([ids + greedy_path], vocab_size, [7], strict=False)
        p = SamplingParams(seed=10_000 + seed, **params)
        result = generate(pair.target, ids, p, drafter=drafter)
        speculative.append(result.token_ids)
        accepted += result.accepted
    assert accepted > runs // 4  # the accept path is really exercised
    for position in (1, 2, 3):
        statistic, dof = _chi_square_two_sample(
            [r[position] for r in plain], [r[position] for r in speculative]
        )
        assert dof >= 1
        assert statistic < _CHI2_CRITICAL[min(dof, len(_CHI2_CRITICAL)) - 1], (position, statistic)
