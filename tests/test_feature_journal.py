"""The feature journal: steps kept whole, each owner's rows gathered into its own array."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.step.feature_journal import FeatureJournal

# A step: its row count and, per owner (0-3), the (start, count) of its block, if any.
steps = st.lists(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.dictionaries(
                st.integers(0, 3),
                st.integers(0, n - 1).flatmap(
                    lambda s: st.tuples(st.just(s), st.integers(1, n - s))
                ),
                max_size=4,
            ),
        )
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=100, deadline=None)
@given(steps=steps)
def test_gathered_rows_equal_each_owners_slices_in_step_order(steps):
    journal: FeatureJournal[int] = FeatureJournal(every=4)
    expected: dict[int, list[np.ndarray]] = {}
    got: dict[int, list[np.ndarray]] = {}
    rng = np.random.default_rng(0)
    for n, blocks in steps:
        features = rng.standard_normal((n, 3)).astype(np.float32)
        for owner, (start, count) in blocks.items():
            expected.setdefault(owner, []).append(features[start : start + count])
        due = journal.record(mx.array(features), [(o, s, c) for o, (s, c) in blocks.items()])
        assert due == (len(journal) >= 4)
        if due:
            for owner, rows in journal.gather().items():
                got.setdefault(owner, []).append(np.array(rows))
            assert len(journal) == 0 and journal.rows == {}
    for owner, rows in journal.gather().items():
        got.setdefault(owner, []).append(np.array(rows))
    assert set(got) == set(expected)
    for owner, pieces in expected.items():
        np.testing.assert_array_equal(np.concatenate(got[owner]), np.concatenate(pieces))


def test_owner_row_counts_and_an_empty_gather():
    journal: FeatureJournal[str] = FeatureJournal(every=64)
    assert journal.gather() == {}
    journal.record(mx.zeros((4, 2)), [("a", 0, 2), ("b", 2, 1)])
    journal.record(mx.ones((2, 2)), [("a", 1, 1)])
    assert journal.rows == {"a": 3, "b": 1}
    gathered = journal.gather()
    assert gathered["a"].tolist() == [[0, 0], [0, 0], [1, 1]] and gathered["b"].shape == (1, 2)


def test_owners_not_kept_are_dropped_unread():
    journal: FeatureJournal[str] = FeatureJournal(every=64)
    journal.record(mx.arange(6).reshape(3, 2), [("a", 0, 1), ("gone", 1, 2)])
    journal.record(mx.arange(4).reshape(2, 2), [("gone", 0, 1), ("a", 1, 1)])
    asked: list[str] = []

    def keep(owner: str) -> bool:
        asked.append(owner)
        return owner != "gone"

    gathered = journal.gather(keep)
    assert set(gathered) == {"a"} and gathered["a"].tolist() == [[0, 1], [2, 3]]
    assert sorted(asked) == ["a", "gone"]  # each owner asked once
    assert len(journal) == 0 and journal.rows == {}
    journal.record(mx.zeros((1, 2)), [("gone", 0, 1)])
    assert journal.gather(keep) == {}
