"""RaggedKVCache: stock mlx-lm models run on it unchanged, and ragged rollback is exact."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from engine import RaggedKVCache
from engine.models.loading import load_target_model

ATOL = 2e-5


def _per_sequence_logits(model, sequence: list[int]) -> mx.array:
    cache = [KVCache() for _ in model.layers]
    return model(mx.array([sequence]), cache=cache)[0]


def test_ragged_prefill_and_verify_match_per_sequence_reference(target_dir):
    """Right-padded prefill, then verify blocks of different accepted lengths per row."""
    model, _ = load_target_model(target_dir)
    prompts = [[5, 17, 99, 200, 31], [7, 8], [40, 41, 42, 43]]
    cache = [RaggedKVCache(len(prompts)) for _ in model.layers]
    longest = max(map(len, prompts))
    padded = mx.array([p + [0] * (longest - len(p)) for p in prompts])
    logits = model(padded, cache=cache)
    for c in cache:
        c.trim_rows([longest - len(p) for p in prompts])
    sequences = [list(p) for p in prompts]
    for row, p in enumerate(prompts):
        reference = _per_sequence_logits(model, p)
        assert mx.allclose(logits[row, : len(p)], reference, atol=ATOL)

    # three verify steps of 4 tokens each; each row keeps a different number (rollback)
    keep_plan = [[1, 4, 2], [3, 1, 4], [2, 2, 1]]
    for step, keeps in enumerate(keep_plan):
        block = [[(11 * step + 3 * row + j) % 300 + 3 for j in range(4)] for row in range(3)]
        logits = model(mx.array(block), cache=cache)
        for row in range(3):
            reference = _per_sequence_logits(model, sequences[row] + block[row])
            assert mx.allclose(logits[row], reference[-4:], atol=ATOL), (step, row)
        for c in cache:
            c.trim_rows([4 - k for k in keeps])
        for row, k in enumerate(keeps):
            sequences[row] += block[row][:k]
        assert cache[0].lengths == [len(s) for s in sequences]


def test_filter_and_extend_keep_rows_intact(qwen3_target_dir):
    model, _ = load_target_model(qwen3_target_dir)
    sequences = {"a": [5, 6, 7, 8, 9], "b": [10, 11], "c": [12, 13, 14]}

    def prefill(seq):
        cache = [RaggedKVCache(1) for _ in model.layers]
        model(mx.array([seq]), cache=cache)
        return cache

    caches = {name: prefill(seq) for name, seq in sequences.items()}
    batch = caches["a"]
    for name in ("b", "c"):
        for mine, theirs in zip(batch, caches[name]):
            mine.extend(theirs)
    assert batch[0].lengths == [5, 2, 3]
    for c in batch:
        c.filter([2, 0])  # "b" leaves; order c, a
    logits = model(mx.array([[21], [22]]), cache=batch)
    assert mx.allclose(
        logits[0, 0], _per_sequence_logits(model, sequences["c"] + [21])[-1], atol=ATOL
    )
    assert mx.allclose(
        logits[1, 0], _per_sequence_logits(model, sequences["a"] + [22])[-1], atol=ATOL
    )
    assert batch[0].nbytes > 0
    for c in batch:
        c.filter([])
    assert batch[0].nbytes == 0 and batch[0].batch_size == 0


def test_extend_many_joins_several_rows_in_one_copy(qwen3_target_dir):
    """`extend_many` (the runner's per-step join) equals one-by-one `extend`, including an
    empty batch, a short cache joining a long one, and a cache with no keys yet."""
    model, _ = load_target_model(qwen3_target_dir)
    sequences = [[5, 6, 7, 8, 9] * 60, [10, 11], [12, 13, 14]]  # 300 > one capacity step

    def prefill(seq):
        cache = [RaggedKVCache(1) for _ in model.layers]
        model(mx.array([seq]), cache=cache)
        return cache

    one_by_one = [RaggedKVCache(0) for _ in model.layers]
    at_once = [RaggedKVCache(0) for _ in model.layers]
    for layer in range(len(model.layers)):
        for seq in sequences:
            one_by_one[layer].extend(prefill(seq)[layer])
    caches = [prefill(seq) for seq in sequences]
    for layer, batch_cache in enumerate(at_once):
        batch_cache.extend_many([c[layer] for c in caches] + [RaggedKVCache(1)])
    assert at_once[0].lengths == [300, 2, 3, 0]
    for a, b in zip(one_by_one, at_once):
        assert a.lengths == b.lengths[:3]
        for x, y in zip(a.state, b.state):  # the active rows (buffers may have free slots)
            assert mx.array_equal(x[:3], y[:3, :, : x.shape[2]])
    logits = model(mx.array([[21], [22], [23], [24]]), cache=at_once)
    for row, seq in enumerate(sequences):
        reference = _per_sequence_logits(model, seq + [21 + row])[-1]
        assert mx.allclose(logits[row, 0], reference, atol=ATOL)
    assert mx.allclose(logits[3, 0], _per_sequence_logits(model, [24])[-1], atol=ATOL)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=3, max_size=3)),
        min_size=1,
        max_size=8,
    )
)
def test_random_write_and_rollback_sequences_track_a_model(steps):
    """Any sequence of uniform writes and per-row rollbacks leaves exactly the expected rows."""
    cache = RaggedKVCache(3)
    rows: list[list[float]] = [[], [], []]
    counter = 0.0
    for width, trims in steps:
        values = mx.arange(counter, counter + 3 * width, dtype=mx.float32).reshape(3, 1, width, 1)
        counter += 3 * width
        cache.write(values, values)
        for r in range(3):
            rows[r] += values[r, 0, :, 0].tolist()
        trims = [min(t, len(rows[r])) for r, t in enumerate(trims)]
        cache.trim_rows(trims)
        for r, t in enumerate(trims):
            rows[r] = rows[r][: len(rows[r]) - t]
        assert cache.lengths == [len(r) for r in rows]
        keys, _ = cache.fetch()
        for r in range(3):
            assert keys[r, 0, : len(rows[r]), 0].tolist() == rows[r]


def test_mask_marks_each_rows_own_history():
    cache = RaggedKVCache(2)
    cache.write(mx.zeros((2, 1, 3, 1)), mx.zeros((2, 1, 3, 1)), counts=[3, 1])
    mask = cache.make_mask(2)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    assert mask[1, 0].tolist() == [
        [True, True, False, False, False],
        [True, True, True, False, False],
    ]
    with pytest.raises(ValueError):
        cache.trim_rows([4, 0])


def test_take_rows_then_put_rows_round_trips_through_growth():
    """`take_rows` copies rows out (one row as a slice, several gathered); writes to the copy
    that outgrow the original's capacity land back in place with `put_rows`."""
    cache = RaggedKVCache(3)
    first = mx.arange(3 * 4, dtype=mx.float32).reshape(3, 1, 4, 1)
    cache.write(first, first, counts=[4, 2, 3])
    one = cache.take_rows([1])
    assert one.lengths == [2] and one.fetch()[0][0, 0, :, 0].tolist() == [4, 5]
    taken = cache.take_rows([2, 0])
    assert taken.lengths == [3, 4]
    grow = mx.full((2, 1, 300, 1), 7.0)  # past the 256-position capacity step
    taken.write(grow, grow, counts=[300, 1])
    cache.put_rows([2, 0], taken)
    assert cache.lengths == [5, 2, 303]
    keys, _ = cache.fetch()
    assert keys[0, 0, :5, 0].tolist() == [0, 1, 2, 3, 7]
    assert keys[1, 0, :2, 0].tolist() == [4, 5]  # untouched row
    assert keys[2, 0, :303, 0].tolist() == [8, 9, 10] + [7] * 300
    assert cache.offset.tolist() == [5, 2, 303]


def test_put_rows_of_a_contiguous_run_writes_those_rows_only():
    """A run of adjacent rows goes back by a slice update (in place); others stay intact."""
    cache = RaggedKVCache(4)
    first = mx.arange(4 * 3, dtype=mx.float32).reshape(4, 1, 3, 1)
    cache.write(first, first)
    taken = cache.take_rows([1, 2])
    extra = mx.full((2, 1, 2, 1), -1.0)
    taken.write(extra, extra, counts=[2, 1])
    cache.put_rows([1, 2], taken)
    assert cache.lengths == [3, 5, 4, 3]
    keys, values = cache.fetch()
    assert keys[0, 0, :3, 0].tolist() == [0, 1, 2] and keys[3, 0, :3, 0].tolist() == [9, 10, 11]
    assert keys[1, 0, :5, 0].tolist() == [3, 4, 5, -1, -1]
    assert values[2, 0, :4, 0].tolist() == [6, 7, 8, -1]


def test_restore_drops_writes_built_since_the_snapshot_unrun():
    """An early lookahead called off before it runs: the cache goes back to the very arrays
    it held (so the dropped writes are never computed) and to its lengths, and a write after
    the restore lands where it would have without the dropped one."""
    cache = RaggedKVCache(2)
    first = mx.ones((2, 1, 3, 4))
    cache.write(first, first, [3, 2])
    mx.eval(cache.keys, cache.values)
    before = cache.snapshot()
    keys, values = cache.keys, cache.values
    cache.write(mx.full((2, 1, 1, 4), 7.0), mx.full((2, 1, 1, 4), 7.0))
    assert cache.lengths == [4, 3] and cache.keys is not keys
    cache.restore(before)
    assert cache.keys is keys and cache.values is values and cache.lengths == [3, 2]
    cache.write(mx.full((2, 1, 1, 4), 5.0), mx.full((2, 1, 1, 4), 5.0))
    fetched, _ = cache.fetch()
    assert cache.lengths == [4, 3]
    assert fetched[0, 0, 3].tolist() == [5.0] * 4 and fetched[1, 0, 2].tolist() == [5.0] * 4


def _row_cache(values: list[int]) -> RaggedKVCache:
    """A one-row cache whose positions hold `values` (keys) and their negatives (values)."""
    cache = RaggedKVCache(1)
    k = mx.array(values, dtype=mx.float32).reshape(1, 1, len(values), 1)
    cache.write(k, -k)
    return cache


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "leave", "write"]), st.integers(0, 1 << 30)),
                min_size=1, max_size=25))  # fmt: skip
def test_membership_changes_keep_every_row_and_move_only_the_last_rows(ops):
    """Joins into free slots, removals that move the last rows into the holes, and ragged
    writes between them: every row keeps exactly its own positions, whatever the order of
    operations; `remove_rows` says where each row went, and rows below the holes stay put."""
    cache, rows, next_value = RaggedKVCache(0), [], 1  # rows: each row's values, batch order
    for op, seed in ops:
        if op == "join":
            joining = [[next_value + 1000 * i + j for j in range(1 + (seed >> i) % 300)]
                       for i in range(1 + seed % 3)]  # fmt: skip
            next_value += 1000 * len(joining)
            cache.extend_many([_row_cache(r) for r in joining])
            rows += joining
        elif op == "leave" and rows:
            gone = sorted({(seed >> (4 * i)) % len(rows) for i in range(1 + seed % 3)})
            order = cache.remove_rows(gone)
            assert sorted(order) == [i for i in range(len(rows)) if i not in gone]
            kept = len(rows) - len(gone)
            assert all(order[i] == i for i in range(kept) if i not in gone)  # not moved
            assert all(i >= kept for i in order if i not in range(kept))  # movers came from the end
            rows = [rows[i] for i in order]
        elif op == "write" and rows:
            counts = [(seed >> i) % 3 for i in range(len(rows))]
            new = [[next_value + 1000 * b + j for j in range(3)] for b in range(len(rows))]
            next_value += 1000 * len(rows)
            k = mx.array(new, dtype=mx.float32).reshape(len(rows), 1, 3, 1)
            cache.write(k, -k, counts)
            rows = [r + n[:c] for r, n, c in zip(rows, new, counts)]
        assert cache.lengths == [len(r) for r in rows]
        if rows and cache.keys is not None:
            keys, values = cache.fetch()
            assert keys.shape[0] == len(rows)
            for b, r in enumerate(rows):
                assert keys[b, 0, : len(r), 0].tolist() == r
                assert values[b, 0, : len(r), 0].tolist() == [-x for x in r]


def test_a_removal_copies_the_moved_rows_not_the_batch():
    """Removing one row of a 16-row cache moves the last row into its place: the buffers keep
    their slots (no rebuilt batch), and the rows below the hole are the very same data."""
    cache = RaggedKVCache(0)
    cache.extend_many([_row_cache([100 * b + j for j in range(40)]) for b in range(16)])
    mx.eval(cache.keys)
    slots = cache.keys.shape[0]
    assert cache.remove_rows([3]) == [0, 1, 2, 15, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert cache.keys.shape[0] == slots  # the freed slot stays for the next join
    keys, _ = cache.fetch()
    assert keys[3, 0, :3, 0].tolist() == [1500, 1501, 1502]
    # A join fills the free slot in place; the batch does not grow.
    cache.extend_many([_row_cache([7, 8])])
    assert cache.keys.shape[0] == slots and cache.lengths[-1] == 2
    assert cache.fetch()[0][15, 0, :2, 0].tolist() == [7, 8]
