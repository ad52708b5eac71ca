"""Target taps: the features are the tapped layers' outputs, and nothing else changes."""

from __future__ import annotations

import mlx.core as mx
import pytest
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
    request asks for prompt logprobs (then every position of its chunk, riding too)."""
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
    assert shapes == [(1, 3 + 7, 64)]  # riding: the rows' 3 positions and every one of d's


# Beyond llama/qwen2/qwen3 (`engine.step.target.HEAD_SEPARABLE_MODULES`): the tiny configs of
# `factories.family_config`, untied, and Gemma 3 tied as the real gemma-3-270m is.
SEPARABLE_FAMILIES = [
    ("gemma3_text", False), ("gemma3_text", True), ("qwen3_moe", False), ("gpt_oss", False),
    ("qwen3_next", False), ("lfm2", True), ("qwen3_5", False), ("qwen3_5_moe", False),
]  # fmt: skip


@pytest.mark.parametrize(("model_type", "tied"), SEPARABLE_FAMILIES)
def test_families_whose_head_is_separable_give_the_forwards_logits(model_type, tied):
    """A prefill runs the head on its last position only where the model's logits are exactly
    `unembed` of its inner model's output: for each family listed, on a cache as the engine's
    prefill uses it (two rows, a chunk after a chunk), the logits equal the stock forward's."""
    import importlib

    import factories

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = factories.family_config(model_type, 97, tie_word_embeddings=tied)
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    if tied and model_type == "gemma3_text":
        model.sanitize({})  # a checkpoint without `lm_head.weight`: the embedding is the head
    target = TargetAdapter(model, [1])
    assert target.head_separable
    tokens = mx.array([[5, 17, 90, 20, 31, 7, 11], [9, 8, 7, 6, 5, 4, 3]])
    stock, split = target.new_cache(2), target.new_cache(2)
    for chunk in (tokens[:, :4], tokens[:, 4:]):
        logits, features = target(chunk, stock)
        hidden, hidden_features = target.hidden_states(chunk, split)
        assert mx.allclose(target.unembed(hidden), logits, atol=1e-5), model_type
        assert mx.allclose(hidden_features, features, atol=1e-6)


def test_a_soft_capped_head_is_not_separable():
    """Gemma 2 soft-caps its logits after the head: its prefill keeps the whole forward."""
    from mlx_lm.models import gemma2

    config = dict(
        model_type="gemma2", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
        vocab_size=50, rope_theta=10000.0,
    )  # fmt: skip
    target = TargetAdapter(gemma2.Model(gemma2.ModelArgs.from_dict(config)), [])
    assert not target.head_separable
