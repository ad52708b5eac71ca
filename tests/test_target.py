"""Target taps: the features are the tapped layers' outputs, and nothing else changes."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import TargetAdapter
from engine.loading import load_target_model


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
