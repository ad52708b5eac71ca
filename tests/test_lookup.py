"""The n-gram lookup index and drafter: incremental equals brute force (property-based)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafters.lookup import LookupDrafter, NGramIndex


def brute_force_match(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int]:
    """The longest suffix n-gram (max_n down to min_n) with an earlier occurrence that has a
    next token, and the position of that token at its latest such occurrence: a full scan."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n :]
        for position in range(length - 1, n - 1, -1):  # continuation position, latest first
            if tokens[position - n : position] == suffix:
                return n, position
    return 0, -1


def brute_force_drafts(tokens: list[int], min_n: int, max_n: int, depth: int) -> list[int]:
    """Continue the match by copying, as if each draft were appended before the next."""
    n, position = brute_force_match(tokens, min_n, max_n)
    if n == 0:
        return []
    extended = list(tokens)
    for i in range(depth):
        extended.append(extended[position + i])
    return extended[len(tokens) :]


# Small alphabets make repeats (and so matches of every length) common.
random_tokens = st.lists(st.integers(0, 5), max_size=80)
repetitive_tokens = st.builds(
    lambda unit, times, tail: unit * times + tail,
    st.lists(st.integers(0, 50), min_size=1, max_size=7),
    st.integers(1, 8),
    st.lists(st.integers(0, 50), max_size=6),
)
bounds = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(tokens=st.one_of(random_tokens, repetitive_tokens), bounds=bounds,
       depth=st.integers(1, 12), per_token=st.one_of(st.none(), st.integers(1, 3)))  # fmt: skip
def test_incremental_index_equals_brute_force_after_every_token(tokens, bounds, depth, per_token):
    min_n, max_n = bounds
    index = NGramIndex(min_n, max_n)
    for length, token in enumerate(tokens, start=1):
        index.append(token)
        prefix = tokens[:length]
        assert index.match() == brute_force_match(prefix, min_n, max_n), prefix
        drafts, n = index.propose(depth, per_token)
        assert n == brute_force_match(prefix, min_n, max_n)[0]
        # The cap by match length: at most per_token tokens per matched suffix token.
        capped = depth if per_token is None else min(depth, per_token * n)
        assert drafts == brute_force_drafts(prefix, min_n, max_n, capped), prefix
        assert len(drafts) in (0, capped)


@settings(max_examples=200, deadline=None)
@given(tokens=st.one_of(random_tokens, repetitive_tokens), bounds=bounds,
       cuts=st.lists(st.integers(0, 40), max_size=4))  # fmt: skip
def test_bulk_extend_equals_appending_token_by_token(tokens, bounds, cuts):
    """`extend` (a table at a time) leaves the same index as `append` per token, whatever
    chunks the sequence arrives in (a prompt, then steps of one or several tokens)."""
    one_by_one, in_chunks = NGramIndex(*bounds), NGramIndex(*bounds)
    for token in tokens:
        one_by_one.append(token)
    edges = sorted({0, len(tokens), *(min(c, len(tokens)) for c in cuts)})
    for start, end in zip(edges, edges[1:]):
        in_chunks.extend(tokens[start:end])
        assert in_chunks.match() == brute_force_match(tokens[:end], *bounds)
    assert in_chunks.tokens == one_by_one.tokens
    one_by_one.catch_up()
    assert in_chunks._tables == one_by_one._tables


def test_index_is_built_only_when_a_match_is_asked_for():
    """Appending stores tokens and nothing else (a held request pays no more); the next
    match indexes them all, and finds what an index built token by token finds."""
    lazy, eager = NGramIndex(2, 4), NGramIndex(2, 4)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4, 1]
    for token in tokens:
        lazy.append(token)
        eager.append(token)
        eager.match()
        assert all(not table for table in lazy._tables), "indexed before a match was asked for"
    assert lazy.match() == eager.match() == brute_force_match(tokens, 2, 4)
    assert lazy._tables == eager._tables


def test_proposal_continues_the_most_recent_longest_match():
    index = NGramIndex(2, 3)
    # "7 8 9 1" early, "7 8 9 2" later, then suffix "7 8 9": the later occurrence wins.
    index.extend([7, 8, 9, 1, 5, 7, 8, 9, 2, 6, 7, 8, 9])
    assert index.propose(3) == ([2, 6, 7], 3)
    # A periodic tail copies past its own end.
    periodic = NGramIndex(2, 4)
    periodic.extend([4, 5, 4, 5])
    assert periodic.propose(5) == ([4, 5, 4, 5, 4], 2)
    assert NGramIndex(2, 4).propose(3) == ([], 0)
    # Capped by the match: 2 tokens per matched suffix token.
    assert index.propose(15, depth_per_token=2) == ([2, 6, 7, 8, 9, 2], 3)
    assert periodic.propose(15, depth_per_token=1) == ([4, 5], 2)


def test_session_follows_the_runners_commit_order_and_counts_acceptance():
    drafter = LookupDrafter(min_n=2, max_n=3, max_depth=4)
    session = drafter.open([1, 2, 3])
    drafter.commit(session, None, [1, 2, 3, 1, 2])  # prompt in the target cache
    assert drafter.match_length(session, 3) == 3  # anchor 3: suffix "1 2 3" seen before
    candidates = drafter.propose([session], [3], [4])
    assert candidates.tokens.tolist() == [[1, 2, 3, 1]]
    drafter.record(session, drafted=4, accepted=2)
    # the verify step commits the anchor (already indexed) and two accepted drafts
    drafter.commit(session, None, [3, 1, 2])
    assert session.cached == 8 and len(session.index) == 8
    assert session.acceptance_rate == 0.5
    drafter.match_length(session, 5)  # anchor 5 indexed early at position 8 ...
    with pytest.raises(ValueError, match="out of sync"):
        drafter.commit(session, None, [6])  # ... so the cache cannot hold another token there
    with pytest.raises(ValueError):
        LookupDrafter(min_n=3, max_n=2)
