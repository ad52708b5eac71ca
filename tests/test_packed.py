"""The packed verify forward: each row's own 1 + depth positions, one packed sequence.

Its logits and features must equal the padded forward's and mlx-lm's own single-row forward
(float32) for rows of different depths and lengths in one forward, leave each row's cache as
the padded forward does, and never let a row see another row: a deliberately broken attention
(rows mixed) or mask (later verify positions visible) must fail the same equality check.
"""

from __future__ import annotations

import importlib
import logging
import random

import mlx.core as mx
import pytest
from factories import target_config

import engine.step.packed as packed
from engine import RaggedKVCache, TargetAdapter
from engine.bundled.pair import bundled_paths
from engine.models.loading import load_target_model
from engine.step.packed import PackedLayout, PackedVerifier, make_packed_verifier

TOLERANCE = 1e-4  # float32: the packed and padded forwards sum in different orders
VOCAB = 300


def _tiny_model(model_type: str, seed: int, tied: bool = False):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = target_config(model_type, VOCAB, layers=4)
    config["tie_word_embeddings"] = tied
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


@pytest.fixture(
    scope="module",
    params=["llama", "qwen2", "qwen3", "qwen3-tied", "bundled", "llama-cpu", "bundled-cpu"],
)
def target(request) -> TargetAdapter:
    """A target per family; "-cpu": on the CPU kernels (engine.backend.cpu_kernels), which the
    packed attention then uses too."""
    if request.param.startswith("bundled"):
        model, _ = load_target_model(bundled_paths()[0])
        adapter = TargetAdapter(model, [1, 3, 5])
    else:
        model_type = request.param.split("-")[0]
        model = _tiny_model(model_type, seed=7, tied=request.param.endswith("tied"))
        adapter = TargetAdapter(model, [0, 2])
    if request.param.endswith("-cpu"):
        assert adapter.use_cpu_kernels() is None
    return adapter


def _batch(target: TargetAdapter, seed: int, depths: list[int]):
    """Prompts of different lengths prefilled into one ragged cache, and verify tokens."""
    rng = random.Random(seed)
    vocab = min(target.vocab_size, VOCAB)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))] for _ in depths]
    verify = [[rng.randrange(3, vocab) for _ in range(1 + d)] for d in depths]
    return prompts, verify


def _prefilled(target: TargetAdapter, prompts: list[list[int]]) -> list[RaggedKVCache]:
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    cache = [RaggedKVCache(len(prompts)) for _ in target.layers]
    target(mx.array([p + [0] * (longest - len(p)) for p in prompts]), cache)
    for layer_cache in cache:
        layer_cache.trim_rows([longest - n for n in lengths])
    return cache


def _packed(target: TargetAdapter, prompts, verify, attention: str = packed.AUTO):
    cache = _prefilled(target, prompts)
    layout = PackedLayout.build([len(v) for v in verify], [len(p) for p in prompts])
    tokens = mx.array([t for v in verify for t in v], dtype=mx.int32)
    logits, features = PackedVerifier(target, attention)(tokens, layout, cache)
    return layout, logits, features, cache


def _padded(target: TargetAdapter, prompts, verify):
    cache = _prefilled(target, prompts)
    width = max(len(v) for v in verify)
    ids = mx.array([v + [0] * (width - len(v)) for v in verify], dtype=mx.int32)
    logits, features = target(ids, cache)
    for layer_cache in cache:
        layer_cache.trim_rows([width - len(v) for v in verify])
    return logits, features, cache


def _max_error(target: TargetAdapter, prompts, verify, attention: str = packed.AUTO) -> float:
    """Largest difference of the packed forward (its attention in `attention`'s layout) from
    the padded forward and from mlx-lm's cache-free single-row forward, over every row's real
    positions (logits and features)."""
    layout, logits, features, _ = _packed(target, prompts, verify, attention)
    padded_logits, padded_features, _ = _padded(target, prompts, verify)
    error = 0.0
    for b, (prompt, tokens) in enumerate(zip(prompts, verify)):
        w = len(tokens)
        rows = slice(layout.starts[b], layout.starts[b] + w)
        alone, alone_features = target(mx.array([prompt + tokens]))
        for reference, got in (
            (padded_logits[b, :w], logits[rows]),
            (alone[0, -w:], logits[rows]),
            (padded_features[b, :w], features[rows]),
            (alone_features[0, -w:], features[rows]),
        ):
            error = max(error, float(mx.abs(reference - got).max()))
    return error


@pytest.mark.parametrize("attention", [packed.SPLIT, packed.PADDED])
@pytest.mark.parametrize("depths", [[0, 3, 1, 0, 7, 2], [3] + [0] * 7, [2, 2, 5], [0, 0, 0, 0]])
def test_packed_logits_equal_padded_and_single_row(target, depths, attention):
    prompts, verify = _batch(target, seed=len(depths), depths=depths)
    assert _max_error(target, prompts, verify, attention) < TOLERANCE


def test_attention_layout_pads_when_many_rows_draft():
    """The measured rule: a lone drafting row (a probe) in a large batch stays split, as does
    a deep one in a small batch; a batch that mostly drafts pads, so does a shallow probe
    among 8 rows (split measured 1.4-1.7x padded there); a plain step never pads."""
    assert not packed.padded_attention_pays(32, 1, 4)
    assert not packed.padded_attention_pays(8, 1, 8)
    assert packed.padded_attention_pays(8, 1, 2) and packed.padded_attention_pays(32, 4, 2)
    assert packed.padded_attention_pays(8, 8, 2) and packed.padded_attention_pays(32, 16, 4)
    assert packed.padded_attention_pays(32, 32, 8)
    assert not packed.padded_attention_pays(8, 0, 1)
    with pytest.raises(ValueError):
        PackedVerifier(TargetAdapter(_tiny_model("qwen3", seed=7), [0]), "sideways")


def test_packed_forward_leaves_each_row_cache_as_the_padded_one(target):
    """After the verify and a per-row rollback, the next step sees the same cache."""
    depths = [0, 4, 1, 2]
    prompts, verify = _batch(target, seed=11, depths=depths)
    accepted = [0, 2, 1, 0]
    layout, _, _, packed_cache = _packed(target, prompts, verify)
    _, _, padded_cache = _padded(target, prompts, verify)
    expected = [len(p) + len(v) for p, v in zip(prompts, verify)]
    assert packed_cache[0].lengths == expected == padded_cache[0].lengths
    for cache in (packed_cache, padded_cache):
        for layer_cache in cache:
            layer_cache.trim_rows([d - a for d, a in zip(depths, accepted)])
    step = mx.array([[5], [6], [7], [8]], dtype=mx.int32)
    after_packed, _ = target(step, packed_cache)
    after_padded, _ = target(step, padded_cache)
    assert float(mx.abs(after_packed - after_padded).max()) < TOLERANCE


def test_layout_maps_rows_to_packed_positions():
    layout = PackedLayout.build([1, 4, 2], [10, 3, 7])
    assert layout.total == 7 and layout.max_width == 4 and layout.drafting_rows == [1, 2]
    assert [layout.index(1, i) for i in range(4)] == [1, 2, 3, 4]
    assert layout.index(2, 1) == 6
    assert layout.positions() == [10, 3, 4, 5, 6, 7, 8]
    assert layout.padded_index([0, 2], 0, 3) == [0, 0, 0, 5, 6, 6]
    with pytest.raises(IndexError):
        layout.index(0, 1)
    with pytest.raises(ValueError):
        PackedLayout.build([0, 1], [1, 1])


def _rows_mixed(queries, keys, values, mask, scale, cpu=False):
    """Broken: every row attends to its neighbour row's keys and values."""
    keys, values = mx.roll(keys, 1, axis=0), mx.roll(values, 1, axis=0)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _sees_later_positions(lengths, first, width, key_length):
    """Broken: a verify position also sees its row's later verify positions."""
    return mx.broadcast_to(
        mx.arange(key_length)[None, None, None, :]
        < mx.array(lengths)[:, None, None, None] + first + width + 3,
        (len(lengths), 1, width, key_length),
    )


@pytest.mark.parametrize("attention", [packed.SPLIT, packed.PADDED])
@pytest.mark.parametrize("cpu", [False, True])
@pytest.mark.parametrize("broken", ["row_attention", "verify_mask"])
def test_a_broken_row_boundary_fails_the_equality_check(monkeypatch, broken, cpu, attention):
    """Mutation test: the equality check above catches attention across rows and attention to
    later verify positions (so it is not vacuous), with MLX's attention and the CPU kernels,
    in both attention layouts."""
    target = TargetAdapter(_tiny_model("qwen3", seed=7), [0, 2])
    if cpu:
        assert target.use_cpu_kernels() is None
    prompts, verify = _batch(target, seed=6, depths=[0, 3, 1, 0, 7, 2])
    assert _max_error(target, prompts, verify, attention) < TOLERANCE
    variant = _rows_mixed if broken == "row_attention" else _sees_later_positions
    monkeypatch.setattr(packed, broken, variant)
    assert _max_error(target, prompts, verify, attention) > 100 * TOLERANCE


def test_other_models_fall_back_to_the_padded_forward_with_a_reason(caplog):
    gemma = importlib.import_module("mlx_lm.models.gemma")
    config = target_config("gemma", VOCAB, layers=2)
    model = gemma.Model(gemma.ModelArgs.from_dict(config))
    target = TargetAdapter(model, [1])
    with caplog.at_level(logging.INFO, logger="engine.step.packed"):
        assert make_packed_verifier(target) is None
    assert "padded forward" in caplog.text and "mlx_lm.models.gemma" in caplog.text
    # A supported family with a sliding-window layer falls back too.
    llama = _tiny_model("llama", seed=1)
    llama.model.layers[1].use_sliding = True
    reason = packed.packed_unsupported_reason(llama, llama.model)
    assert reason is not None and "sliding" in reason
    assert TargetAdapter(_tiny_model("qwen2", seed=1), [1]).packed_verifier() is not None


# ----------------------------------------------------------------- prefill segments
def _segment_case(target: TargetAdapter, seed: int):
    """Decoding rows of mixed depths, plus prompts to prefill in the same forward: a whole
    prompt (empty cache), a second chunk (its first chunk already in its own cache), and a
    one-token chunk."""
    rng = random.Random(seed)
    vocab = min(target.vocab_size, VOCAB)
    prompts, verify = _batch(target, seed=seed, depths=[0, 3, 1, 0, 2])
    chunks = []  # (prompt, tokens already cached)
    for total, cached in ((23, 0), (31, 12), (9, 8)):
        chunks.append(([rng.randrange(3, vocab) for _ in range(total)], cached))
    return prompts, verify, chunks


def _segments_forward(target: TargetAdapter, prompts, verify, chunks, attention=packed.AUTO):
    cache = _prefilled(target, prompts)
    layout = PackedLayout.build([len(v) for v in verify], [len(p) for p in prompts])
    segments = []
    for prompt, cached in chunks:
        own = [RaggedKVCache(1) for _ in target.layers]
        if cached:
            target(mx.array([prompt[:cached]]), own)
        segments.append(packed.PrefillSegment(prompt[cached:], own))
    tokens = [t for v in verify for t in v] + [t for s in segments for t in s.tokens]
    logits, features = PackedVerifier(target, attention)(
        mx.array(tokens, dtype=mx.int32), layout, cache, tuple(segments)
    )
    return layout, segments, logits, features


def _segments_error(target: TargetAdapter, seed: int, attention: str = packed.AUTO) -> float:
    """Largest difference, over rows and segments, from each sequence's forward alone."""
    prompts, verify, chunks = _segment_case(target, seed)
    layout, segments, logits, features = _segments_forward(
        target, prompts, verify, chunks, attention
    )
    error = 0.0
    for b, (prompt, tokens) in enumerate(zip(prompts, verify)):
        w, rows = len(tokens), slice(layout.starts[b], layout.starts[b] + len(tokens))
        alone, alone_features = target(mx.array([prompt + tokens]))
        error = max(error, float(mx.abs(alone[0, -w:] - logits[rows]).max()),
                    float(mx.abs(alone_features[0, -w:] - features[rows]).max()))  # fmt: skip
    start = layout.total
    for s, ((prompt, cached), segment) in enumerate(zip(chunks, segments)):
        n = len(prompt) - cached
        alone, alone_features = target(mx.array([prompt]))
        got_features = features[start : start + n]
        error = max(error, float(mx.abs(alone[0, -1] - logits[layout.total + s]).max()),
                    float(mx.abs(alone_features[0, cached:] - got_features).max()))  # fmt: skip
        # The segment's own cache now holds the whole prompt, as a prefill alone leaves it.
        reference = [RaggedKVCache(1) for _ in target.layers]
        target(mx.array([prompt]), reference)
        assert segment.cache[0].lengths == [len(prompt)]
        for got, want in zip(segment.cache, reference):
            error = max(error, float(mx.abs(got.fetch()[0] - want.fetch()[0]).max()))
        start += n
    assert logits.shape[0] == layout.total + len(chunks)
    assert features is None or features.shape[0] == start
    return error


@pytest.mark.parametrize("attention", [packed.SPLIT, packed.PADDED])
def test_prefill_segments_in_the_packed_forward_equal_each_sequence_alone(target, attention):
    """Rows of mixed depths and prefill chunks (whole, continued, one token) in one forward:
    the rows' outputs are unchanged by the segments, each segment's last logits and every
    feature equal mlx-lm's forward of that sequence alone, and its cache equals a prefill's."""
    assert _segments_error(target, seed=3, attention=attention) < TOLERANCE


def _segment_sees_everything(queries, keys, values, mask, scale, cpu=False):
    """Broken: a segment position also sees the segment's later positions (no causal mask)."""
    if isinstance(mask, str):
        mask = None
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def test_a_broken_segment_mask_fails_the_segment_check(monkeypatch):
    """Mutation test: the check above catches a prefill segment that is not causal."""
    target = TargetAdapter(_tiny_model("llama", seed=7), [0, 2])
    assert _segments_error(target, seed=4) < TOLERANCE
    monkeypatch.setattr(packed, "row_attention", _segment_sees_everything)
    assert _segments_error(target, seed=4) > 100 * TOLERANCE


def test_a_segment_needs_its_tokens_after_the_rows(target):
    prompts, verify, chunks = _segment_case(target, seed=5)
    cache = _prefilled(target, prompts)
    layout = PackedLayout.build([len(v) for v in verify], [len(p) for p in prompts])
    segment = packed.PrefillSegment([4, 5, 6], [RaggedKVCache(1) for _ in target.layers])
    tokens = mx.array([t for v in verify for t in v], dtype=mx.int32)  # segment tokens missing
    with pytest.raises(ValueError):
        PackedVerifier(target)(tokens, layout, cache, (segment,))
