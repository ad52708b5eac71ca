"""z-lab's current drafter config: per-layer `layer_types` with a `sliding_window`.

A random drafter with one sliding layer (window 4) and one full layer is saved in the z-lab
layout, loaded through the normal path, and its drafts on a 12-position context are compared
with a reference written here from the weights alone (hand-written RMSNorm, RoPE and masked
attention, z-lab PyTorch's rule: a query at position p sees keys at positions > p - window)."""

from __future__ import annotations

import json

import factories
import mlx.core as mx
import pytest

from drafters.dflash.checkpoint import load_dflash_model
from drafters.dflash.config import DFlashConfig, DrafterConfigError
from drafters.dflash.drafter import DFlashDrafter
from engine.models.loading import load_pair

WINDOW = 4


@pytest.fixture(scope="module")
def sliding_drafter_dir(model_root, vocab_size):
    config = factories.drafter_config(
        vocab_size, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW
    )
    return factories.build_drafter(model_root / "sliding-drafter", config, seed=41)


def _rms(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


def _rope(x: mx.array, positions: mx.array, theta: float) -> mx.array:
    """Non-interleaved rotary embedding of x [H, T, D] at `positions` [T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-mx.arange(half, dtype=mx.float32) * 2 / x.shape[-1])
    angles = positions[:, None].astype(mx.float32) * freqs[None, :]
    cos, sin = mx.cos(angles), mx.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _reference_hidden(model, config: DFlashConfig, features, block_embeddings) -> mx.array:
    """The drafter forward for one row, from its weights: context rows at positions
    0..S-1, the block at S..S+Q-1, no causal mask, sliding layers windowed."""
    eps, theta, hd = config.rms_norm_eps, config.rope_theta, config.head_dim
    S, Q = features.shape[0], block_embeddings.shape[0]
    context = _rms(features @ model.fc.weight.T, model.hidden_norm.weight, eps)
    h = block_embeddings
    query_pos = mx.arange(S, S + Q)
    key_pos = mx.concatenate([mx.arange(S), query_pos])
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, eps)

        def heads(y, n):
            return y.reshape(y.shape[0], n, hd).transpose(1, 0, 2)

        q = _rope(_rms(heads(x @ attn.q_proj.weight.T, config.num_attention_heads),
                       attn.q_norm.weight, eps), query_pos, theta)  # fmt: skip
        both = mx.concatenate([context, x], axis=0)
        k = _rope(_rms(heads(both @ attn.k_proj.weight.T, config.num_key_value_heads),
                       attn.k_norm.weight, eps), key_pos, theta)  # fmt: skip
        v = heads(both @ attn.v_proj.weight.T, config.num_key_value_heads)
        repeat = config.num_attention_heads // config.num_key_value_heads
        k, v = mx.repeat(k, repeat, axis=0), mx.repeat(v, repeat, axis=0)
        scores = (q @ k.transpose(0, 2, 1)) * hd**-0.5
        window = config.window_of(index)
        if window is not None:
            visible = key_pos[None, :] > query_pos[:, None] - window
            scores = mx.where(visible[None], scores, -mx.inf)
        out = mx.softmax(scores, axis=-1) @ v
        h = h + out.transpose(1, 0, 2).reshape(Q, -1) @ attn.o_proj.weight.T
        y = _rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        gate, up = y @ mlp.gate_proj.weight.T, y @ mlp.up_proj.weight.T
        h = h + (gate * mx.sigmoid(gate) * up) @ mlp.down_proj.weight.T
    return _rms(h, model.norm.weight, eps)


def test_layer_types_and_sliding_window_round_trip(sliding_drafter_dir):
    raw = json.loads((sliding_drafter_dir / "config.json").read_text())
    assert raw["layer_types"] == ["sliding_attention", "full_attention"]
    assert raw["sliding_window"] == WINDOW
    model = load_dflash_model(sliding_drafter_dir)
    assert [layer.window for layer in model.layers] == [WINDOW, None]
    # block_size nested in dflash_config is read as well as at top level.
    nested = dict(raw, dflash_config={**raw["dflash_config"], "block_size": 5})
    del nested["block_size"]
    assert DFlashConfig.from_dict(nested).block_size == 5
    with pytest.raises(DrafterConfigError, match="sliding_window"):
        DFlashConfig.from_dict(dict(raw, sliding_window=None))
    with pytest.raises(DrafterConfigError, match="layer_types"):
        DFlashConfig.from_dict(dict(raw, layer_types=["sliding_attention"]))


def test_sliding_drafts_equal_an_independent_reference_past_the_window(
    qwen3_target_dir, sliding_drafter_dir
):
    """Context of 12 target positions (3 windows), a full block of 8: the drafter's hidden
    states and its proposal equal the reference's; without the window they would differ."""
    pair = load_pair(qwen3_target_dir, sliding_drafter_dir)
    drafter = DFlashDrafter(pair.drafter.model, pair.target, truncate_block=False)
    model, config = drafter.model, drafter.model.config
    prompt = [5, 17, 99, 3, 42, 8, 8, 120, 77, 6, 31, 200]
    _, features = pair.target(mx.array([prompt]))
    anchor = 64
    session = drafter.open(prompt)
    drafter.commit(session, features[0], prompt)
    proposal = drafter.propose([session], [anchor], [config.block_size - 1])

    block = mx.array([anchor] + [config.mask_token_id] * (config.block_size - 1))
    embeddings = pair.target.embed(block)
    reference = _reference_hidden(model, config, features[0], embeddings)
    ours = model(embeddings[None], model.make_cache(1), features, [len(prompt)])[0]
    assert mx.allclose(ours, reference, atol=1e-4).item()
    expected = mx.argmax(pair.target.unembed(reference[1:]), axis=-1)
    assert proposal.tokens[0].tolist() == expected.tolist()

    full = DFlashConfig.from_dict(dict(config.to_dict(), layer_types=None, sliding_window=None))
    unwindowed = _reference_hidden(model, full, features[0], embeddings)
    assert not mx.allclose(unwindowed, reference, atol=1e-4).item()  # the window mattered


def test_sliding_mask_follows_each_rows_own_length(qwen3_target_dir, sliding_drafter_dir):
    """Two rows of 12 and 7 context positions in one ragged batch: each row's block sits
    after its own context and its window ends there, as when it drafts alone."""
    pair = load_pair(qwen3_target_dir, sliding_drafter_dir)
    model = pair.drafter.model
    config = model.config
    prompt = [5, 17, 99, 3, 42, 8, 8, 120, 77, 6, 31, 200]
    _, features = pair.target(mx.array([prompt]))
    block = mx.array([[64] + [config.mask_token_id] * 4, [70] + [config.mask_token_id] * 4])
    embeddings = pair.target.embed(block)
    both = mx.concatenate([features, features], axis=0)
    ours = model(embeddings, model.make_cache(2), both, [12, 7])
    for row, length in enumerate((12, 7)):
        reference = _reference_hidden(model, config, features[0, :length], embeddings[row])
        assert mx.allclose(ours[row], reference, atol=1e-4).item(), row
