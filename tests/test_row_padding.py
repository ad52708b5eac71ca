"""Matmul row padding (engine.step.row_padding): chosen from timings, invisible in every output."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.async_engine import AsyncEngine
from engine.bundled.pair import bundled_paths
from engine.config import EngineConfig
from engine.models.loading import load_pair, load_target_model
from engine.step import row_padding
from engine.step.kv_cache import RaggedKVCache
from engine.step.packed import PackedLayout
from engine.step.row_padding import RowPadding
from tests.test_engine import plain_greedy, random_requests, run_all

# Pads every count it can: 1..15 rows are computed as 16, 17..31 as 32.
EVERYTHING = RowPadding({r: 16 * (r // 16 + 1) for r in range(1, 32) if r % 16})


def test_the_table_keeps_only_clear_gains_within_twice_the_rows():
    # The sawtooth measured with OpenBLAS: 8 and 12 rows slow, 16 fast, 17 a little slower.
    seconds = {1: 1.0, 2: 1.3, 8: 1.5, 12: 2.0, 16: 1.0, 17: 1.1, 24: 1.8, 32: 1.2}
    padding = RowPadding.from_timings(seconds, min_gain=0.15)
    # 1 never pads to the slower 2; 16 -> 17 and 17 -> 32 gain less than 15%; 2 has no
    # count within twice its rows.
    assert padding.padded == {8: 16, 12: 16, 24: 32}
    assert [padding.rows(n) for n in (1, 8, 24, 40)] == [1, 16, 32, 40]
    with pytest.raises(ValueError):
        RowPadding({4: 4})


def _logits(model, tokens: mx.array) -> mx.array:
    cache = [RaggedKVCache(tokens.shape[0]) for _ in model.layers]
    return model(tokens, cache=cache)


@pytest.mark.parametrize("which", ["test-qwen3", "bundled"])
def test_padded_layers_give_the_unpadded_outputs(which, qwen3_target_dir):
    """Every float linear layer, and a tied head, is covered; logits of the stock forward
    and of the packed verify equal those of the same weights unpadded."""
    directory = qwen3_target_dir if which == "test-qwen3" else bundled_paths()[0]
    padded_pair, plain_pair = load_pair(str(directory), None), load_pair(str(directory), None)
    covered = row_padding.install(padded_pair.target.model, EVERYTHING)
    layers = len(padded_pair.target.layers)
    assert covered >= 7 * layers + 1  # q, k, v, o, gate, up, down per layer; the head
    tokens = mx.array([[5, 9, 2, 7], [3, 3, 8, 1], [4, 6, 6, 2]])  # 3 rows: 12 rows -> 16
    expected = _logits(plain_pair.target.model, tokens)
    got = _logits(padded_pair.target.model, tokens)
    assert mx.allclose(got, expected, rtol=1e-5, atol=1e-5).item()

    results = []
    for pair in (padded_pair, plain_pair):  # the packed verify: 3 rows of widths 1, 4, 2
        cache = [RaggedKVCache(3) for _ in pair.target.layers]
        pair.target(tokens, cache)
        layout = PackedLayout.build([1, 4, 2], list(cache[0].lengths))
        packed = pair.target.packed_verifier()
        logits, _ = packed(mx.array([1, 2, 3, 4, 5, 6, 7]), layout, cache)
        results.append(logits)
    assert mx.allclose(results[0], results[1], rtol=1e-5, atol=1e-5).item()


async def test_an_engine_padding_every_count_decodes_exactly(monkeypatch, qwen3_target_dir,
                                                             drafter_dir, vocab_size):  # fmt: skip
    """Greedy output with every matmul padded (decode, drafter and verify forwards, prefill
    heads) equals plain decoding, with drafts from both sources."""
    monkeypatch.setattr(row_padding, "measure", lambda hidden, dtype: EVERYTHING)
    monkeypatch.setattr(row_padding, "wanted", lambda: True)
    calls = []
    rows = EVERYTHING.rows
    monkeypatch.setattr(EVERYTHING, "rows", lambda n: calls.append(n) or rows(n))
    requests = random_requests(12, vocab_size, seed=11)
    config = EngineConfig(target=str(qwen3_target_dir), drafter=str(drafter_dir), max_num_seqs=6,
                          num_speculative_tokens=3)  # fmt: skip
    async with AsyncEngine(config) as engine:
        results = await run_all(engine, requests)
    assert any(rows(n) != n for n in calls)  # padding happened
    model, _ = load_target_model(qwen3_target_dir)
    for (request_id, prompt, max_tokens, _, _), (tokens, _) in zip(requests, results):
        assert tokens == plain_greedy(model, prompt, max_tokens), request_id
