"""The CPU kernels (engine.backend.cpu_kernels, engine.backend.cpu_layers) equal MLX's own to
float32 rounding."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine import RaggedKVCache
from engine.async_engine import AsyncEngine
from engine.backend import cpu_kernels
from engine.config import EngineConfig
from engine.models.loading import load_pair
from engine.step.sampling import SamplingParams


def test_fast_exp_has_float32_precision_and_underflows_to_zero():
    x = mx.concatenate([mx.linspace(-87.0, 88.0, 200_001), mx.array([0.0, 1.0, -0.5, 0.5])])
    exact = mx.exp(x)
    relative = mx.abs(cpu_kernels.fast_exp(x) - exact) / exact
    assert relative.max().item() < 3e-7
    tiny = cpu_kernels.fast_exp(mx.array([-mx.inf, -1e4, -100.0])).tolist()
    assert all(0.0 <= t < 1e-37 for t in tiny)


@pytest.mark.parametrize("shape", [(3, 1000), (2, 7, 49152), (300, 4096)])
def test_logsumexp_equals_mlx_in_one_piece_and_in_blocks_of_rows(shape):
    """Small inputs in one piece, large ones in blocks of rows (a padded last block too)."""
    x = mx.random.normal(shape, key=mx.random.key(len(shape))) * 8.0
    x[..., 0] = 90.0  # exp would overflow without the max taken out
    got = cpu_kernels.logsumexp(x)
    assert got.shape == (*shape[:-1], 1)
    assert mx.allclose(got, mx.logsumexp(x, axis=-1, keepdims=True), rtol=1e-6, atol=1e-5)


def test_swiglu_equals_silu_times_x():
    gate, x = mx.random.normal((4, 7, 300)) * 6, mx.random.normal((4, 7, 300))
    expected = nn.silu(gate) * x
    assert mx.allclose(cpu_kernels.swiglu(gate, x), expected, rtol=1e-5, atol=1e-6).item()


def test_softmax_and_swiglu_carry_mlx_gradients():
    """Training differentiates them (`fast_exp`'s integer bit tricks have no gradient of their
    own): values and gradients equal MLX's softmax and silu to float32 rounding."""
    mx.random.seed(3)
    scores, weights = mx.random.normal((3, 5, 40)) * 4, mx.random.normal((3, 5, 40))
    scores = mx.where(mx.arange(40) < 33, scores, mx.finfo(mx.float32).min)  # masked keys

    def through(softmax):
        return mx.value_and_grad(lambda s: (softmax(s) * weights).sum())(scores)

    (value, grad), (expected_value, expected_grad) = (
        through(cpu_kernels.softmax),
        through(lambda s: mx.softmax(s, axis=-1, precise=True)),
    )
    assert abs(value.item() - expected_value.item()) < 1e-5
    assert mx.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7).item()
    assert mx.abs(cpu_kernels.softmax(scores)[..., 33:]).max().item() < 1e-30

    gate, x, w = (
        mx.random.normal((4, 300)) * 6,
        mx.random.normal((4, 300)),
        mx.random.normal((4, 300)),
    )
    grads = mx.grad(lambda g, y: (cpu_kernels.swiglu(g, y) * w).sum(), argnums=(0, 1))(gate, x)
    expected = mx.grad(lambda g, y: (nn.silu(g) * y * w).sum(), argnums=(0, 1))(gate, x)
    for got, want in zip(grads, expected):
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    # Mutation check: the plain sigmoid as silu's derivative (a likely slip) is caught.
    wrong = w * x / (1.0 + mx.exp(-gate))
    assert not mx.allclose(wrong, expected[0], rtol=1e-5, atol=1e-6).item()


def _qkv(B: int, H: int, KV: int, L: int, T: int, D: int = 32):
    mx.random.seed(B * 1000 + L * 10 + T)
    return (mx.random.normal((B, H, L, D)), mx.random.normal((B, KV, T, D)),
            mx.random.normal((B, KV, T, D)))  # fmt: skip


@pytest.mark.parametrize("keys_first", [True, False])  # a decode step's scores as k @ q
@pytest.mark.parametrize("block_scores", [1 << 18, 1 << 10])  # small: many query blocks
@pytest.mark.parametrize(
    "shape",
    [(1, 6, 2, 1, 40), (5, 9, 3, 1, 70), (3, 4, 4, 4, 50), (2, 6, 2, 64, 64), (1, 6, 2, 90, 200)],
)
def test_attention_equals_mlx_sdpa_for_every_mask_kind(
    monkeypatch, keys_first, block_scores, shape
):
    """No mask (decode), "causal" (a prompt chunk after a cached prefix: L < T), a ragged
    boolean mask (rows of different lengths, as `RaggedKVCache.make_mask` builds it) and an
    additive one, with grouped-query heads; with one block and with many query blocks."""
    monkeypatch.setattr(cpu_kernels, "_DECODE_KEYS_FIRST", keys_first)
    monkeypatch.setattr(cpu_kernels, "_BLOCK_SCORES", block_scores)
    monkeypatch.setattr(cpu_kernels, "_FUSED_SCORES", 0)  # small shapes too, not MLX's
    monkeypatch.setattr(cpu_kernels, "_FUSED_SCORES_QUERIES", 0)
    B, H, KV, L, T = shape
    q, k, v = _qkv(B, H, KV, L, T)
    lengths = [T - L - (3 * b) % max(1, T - L) for b in range(B)]
    key_pos = mx.arange(T)[None, None, None, :]
    ragged = key_pos <= mx.array(lengths)[:, None, None, None] + mx.arange(L)[None, None, :, None]
    additive = mx.where(ragged, 0.0, -1e9)
    for mask in (None, "causal", ragged, additive):
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
        got = cpu_kernels.attention(q, k, v, 0.3, mask)
        assert got.shape == expected.shape
        assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item(), (shape, mask)


def test_decode_scores_keys_first_are_the_same_bits_on_a_sliced_cache(monkeypatch):
    """A decode step over a ragged cache's buffers sliced to the longest row (a strided view,
    as `RaggedKVCache.fetch` returns): keys @ queries gives exactly the output of queries @
    keys^T, so greedy decoding cannot change with it."""
    monkeypatch.setattr(cpu_kernels, "_FUSED_SCORES", 0)
    B, H, KV, T, capacity, D = 6, 9, 3, 300, 512, 64
    mx.random.seed(3)
    q = mx.random.normal((B, H, 1, D))
    keys, values = (
        mx.random.normal((B + 2, KV, capacity, D)),
        mx.random.normal((B + 2, KV, capacity, D)),
    )
    lengths = mx.array([T - 1 - 37 * b for b in range(B)])
    mask = mx.arange(T)[None, None, None, :] <= lengths[:, None, None, None]
    outputs = []
    for keys_first in (False, True):
        monkeypatch.setattr(cpu_kernels, "_DECODE_KEYS_FIRST", keys_first)
        outputs.append(cpu_kernels.attention(q, keys[:B, :, :T], values[:B, :, :T], 0.125, mask))
    if mx.default_device().type == mx.DeviceType.cpu:  # where the engine runs these kernels
        assert mx.array_equal(outputs[0], outputs[1]).item()
    assert mx.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6).item()


def test_a_causal_block_that_sees_a_later_key_fails_the_comparison(monkeypatch):
    """Mutation check: attending one key too far (the bug blocking could bring) is caught."""
    monkeypatch.setattr(cpu_kernels, "_BLOCK_SCORES", 1 << 10)
    monkeypatch.setattr(cpu_kernels, "_FUSED_SCORES", 0)
    monkeypatch.setattr(cpu_kernels, "_FUSED_SCORES_QUERIES", 0)
    q, k, v = _qkv(1, 6, 2, 90, 200)
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal")
    leaky = mx.arange(200)[None, :] <= (mx.arange(90) + 111)[:, None]  # one key too many
    got = cpu_kernels.attention(q, k, v, 0.3, leaky)
    assert not mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item()


def test_a_model_on_cpu_kernels_gives_the_stock_logits(target_dir, vocab_size):
    """The bundled target with the kernels installed: the same parameters, and logits equal
    the stock model's for a ragged batched prompt and a verify after it; the stock model,
    loaded apart, keeps the stock code."""
    stock, fast = load_pair(target_dir, None).target, load_pair(target_dir, None).target
    assert fast.use_cpu_kernels() is None and fast.cpu_kernels and not stock.cpu_kernels
    assert type(fast.layers[0].self_attn).__name__.startswith("Cpu")
    assert not type(stock.layers[0].self_attn).__name__.startswith("Cpu")
    assert fast.model.parameters().keys() == stock.model.parameters().keys()
    ids = mx.random.randint(0, vocab_size, (3, 150))
    outputs = []
    for target in (stock, fast):
        cache = [RaggedKVCache(3) for _ in target.layers]
        prompt, _ = target(ids, cache)
        for c in cache:
            c.trim_rows([0, 40, 77])  # ragged rows, as after rollbacks
        verify, _ = target(ids[:, :4], cache)
        outputs.append((prompt, verify))
    for a, b in zip(*outputs):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()


async def test_the_engine_runs_on_cpu_kernels_unless_turned_off(qwen3_target_dir, drafter_dir):
    """Its target and its DFlash drafter; greedy output is the same either way."""
    outputs = {}
    for enabled in (True, False):
        config = EngineConfig(
            target=str(qwen3_target_dir), drafter=str(drafter_dir), cpu_kernels=enabled
        )
        async with AsyncEngine(config) as engine:
            runner = engine._runner
            assert runner.target.cpu_kernels is enabled
            assert type(runner.target.layers[0].mlp).__name__.startswith("Cpu") is enabled
            assert runner.drafter.model.layers[0].self_attn.cpu_kernels is enabled
            params = SamplingParams(temperature=0.0, max_tokens=24, num_speculative_tokens=3)
            outputs[enabled] = tokens = []
            async for delta in engine.generate([5, 6, 7, 8, 9], params):
                tokens += delta.token_ids
    assert outputs[True] == outputs[False] and len(outputs[True]) == 24
