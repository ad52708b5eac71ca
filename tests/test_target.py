"""Target taps: the features are the tapped layers' outputs, and nothing else changes."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import TargetAdapter
from engine.models.loading import load_target_model


def _manual_forward(model, tokens, layer_ids):
    """Reference: loop over the decoder layers by hand, keeping the tapped outputs."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    mask = "causal" if tokens.shape[1] > 1 else None
    taps = []
    for i, layer in enumerate(inner.layers):
        h = layer(h, mask, None)
        if i in layer_ids:
            taps.append(h)
    return mx.concatenate(taps, axis=-1)


def test_features_are_the_tapped_layer_outputs(target_dir):
    model, _ = load_target_model(target_dir)
    tokens = mx.array([[5, 17, 99, 200, 31, 7]])
    plain_logits = model(tokens)
    names_before = [name for name, _ in tree_flatten(model.parameters())]
    target = TargetAdapter(model, [0, 2, 5])
    logits, features = target(tokens)
    assert features.shape == (1, 6, 3 * 64)
    assert mx.allclose(logits, plain_logits, atol=1e-5)
    assert mx.allclose(features, _manual_forward(model, tokens, [0, 2, 5]), atol=1e-5)
    # parameter names (checkpoint paths) are untouched by tapping
    assert [name for name, _ in tree_flatten(model.parameters())] == names_before
    # outside the adapter's own forward nothing is recorded or kept
    model(tokens)
    assert target._store.outputs == [None, None, None]


def test_features_follow_the_cache(qwen3_target_dir):
    """Prefill then a step with a cache gives the same features as one forward."""
    model, _ = load_target_model(qwen3_target_dir)
    target = TargetAdapter(model, [1, 4])
    tokens = mx.array([[5, 17, 99, 200, 31, 7]])
    _, whole = target(tokens)
    cache = target.make_cache()
    _, first = target(tokens[:, :4], cache)
    _, rest = target(tokens[:, 4:], cache)
    assert mx.allclose(mx.concatenate([first, rest], axis=1), whole, atol=1e-5)


def test_embedding_and_head(target_dir):
    model, _ = load_target_model(target_dir)
    target = TargetAdapter(model, [1])
    tokens = mx.array([[3, 4, 5]])
    assert mx.array_equal(target.embed(tokens), model.model.embed_tokens(tokens))
    h = mx.random.normal((1, 3, 64))
    expected = (
        model.lm_head(h) if hasattr(model, "lm_head") else model.model.embed_tokens.as_linear(h)
    )
    assert mx.allclose(target.unembed(h), expected)
    assert target.hidden_size == 64 and target.num_layers == 6 and target.vocab_size > 300
    assert target.dtype == mx.float32  # compute dtype on the CPU backend


def test_hidden_states_then_head_equal_the_forward(target_dir):
    """A prefill may run the LM head on the positions it reads only: the inner model's output
    and `unembed` give the forward's logits and the same features (llama and qwen3)."""
    model, _ = load_target_model(target_dir)
    target = TargetAdapter(model, [1, 3])
    assert target.head_separable
    tokens = mx.array([[5, 17, 99, 200, 31, 7], [9, 8, 7, 6, 5, 4]])
    logits, features = target(tokens)
    hidden, hidden_features = target.hidden_states(tokens)
    assert mx.allclose(target.unembed(hidden), logits, atol=1e-5)
    assert mx.allclose(hidden_features, features, atol=1e-6)


def test_a_prompt_chunk_runs_the_head_on_one_position_per_row(qwen3_target_dir):
    """Prefill (one chunk, short prompts together, and chunks riding in a decoding step's
    packed forward) unembeds one position per prompt, not every prompt token, unless the
    request asks for prompt logprobs."""
    from engine.step.runner import ModelRunner
    from engine.step.sampling import SamplingParams
    from scheduler.plan import Admission, PrefillChunk, StepPlan

    model, _ = load_target_model(qwen3_target_dir)
    target = TargetAdapter(model, [1])
    shapes = []
    unembed = target.unembed
    target.unembed = lambda h: shapes.append(tuple(h.shape)) or unembed(h)

    def prefill(runner, prompts: dict[str, list[int]], prompt_logprobs=None, decoding=()):
        shapes.clear()
        params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
        plan = StepPlan(
            admissions=[Admission(rid, ids, params) for rid, ids in prompts.items()],
            prefills=[PrefillChunk(rid, 0, len(ids), True) for rid, ids in prompts.items()],
            depths=dict.fromkeys(decoding, 0),
        )
        return runner.execute(plan)

    runner = ModelRunner(target, None)
    result = prefill(runner, {"a": [5, 6, 7, 8, 9, 10, 11]})
    assert shapes == [(1, 1, 64)] and set(result.first_tokens) == {"a"}
    # No row decodes: whole prompts prefill together, one position each.
    together = ModelRunner(target, None)
    result = prefill(together, {"b": [5, 6, 7, 8, 9], "c": [3, 4, 5, 6, 7, 8, 9, 10]})
    assert shapes == [(2, 1, 64)] and set(result.first_tokens) == {"b", "c"}
    # "a" decodes: the prompts ride in its packed forward, the head on a's position and one
    # position per prompt.
    result = prefill(runner, {"e": [5, 6, 7, 8, 9], "f": [3, 4, 5, 6, 7, 8, 9, 10]},
                     decoding=["a"])  # fmt: skip
    assert shapes == [(1, 3, 64)] and set(result.first_tokens) == {"e", "f"}
    assert set(result.outcomes) == {"a"}
    prefill(runner, {"d": [5, 6, 7, 8, 9, 10, 11]}, prompt_logprobs=1, decoding=["a", "e", "f"])
    assert (1, 7, 64) in shapes  # apart, every position; the rows' step is a forward of its own
