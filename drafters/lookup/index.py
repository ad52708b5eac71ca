"""An incremental n-gram index over one request's tokens, for prompt-lookup drafting.

For every n in [min_n, max_n] a dict maps an n-gram to the position right after its most
recent occurrence that has a continuation. Indexing a token adds one entry per n (the n-gram
that ends just before it now has a known next token), so the work per token is constant and
nothing is ever rescanned.

A proposal takes the longest suffix (n from max_n down to min_n) that occurred before and
continues its most recent earlier occurrence. The continuation may run into the drafts
themselves (copying as if they were already appended, as LZ77 does): a periodic tail such as
``a b a b`` then proposes ``a b a b ...`` to any depth instead of stopping after one period.

A proposal may be capped by its match: at most ``depth_per_token x n`` tokens for an n-token
match. A long match copies on for long; a 2-token one is often a coincidence. Replaying the
SmolLM2 data records (`bench/lookup_oracle.py`), ``2n`` with suffixes up to 8 tokens commits
2.94 tokens a step on code edits, against 2.73 for a flat depth 7 with suffixes up to 4, and
with fewer positions verified.
"""

from __future__ import annotations

from collections.abc import Iterable

# From this many new tokens `catch_up` indexes a table at a time (measured: 2.6x faster on
# 350-token prompts, about even at 3; for one token the setup makes it 3x slower).
_BULK_FROM = 4


class NGramIndex:
    """Hashed n-grams of one token sequence; see the module docstring.

    Indexing is lazy: `append` and `extend` only store tokens, and the first `match` or
    `propose` after them indexes what arrived since, a table at a time. A request whose
    drafting is held for many steps then pays a list append per token on each, and the
    tokens it gathered are indexed together (at C speed) when a match is asked for again,
    or never if it finishes held."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.indexed = 0  # positions whose preceding n-grams are in the tables
        # tables[n - min_n]: n-gram -> position of the token that followed its latest occurrence
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(map(int, tokens))

    def catch_up(self) -> None:
        """Index every position stored since the last call: position p maps the n-grams
        ending just before it to p (later occurrences overwrite earlier ones)."""
        tokens, old, length = self.tokens, self.indexed, len(self.tokens)
        if old == length:
            return
        self.indexed = length
        min_n, max_n, tables = self.min_n, self.max_n, self._tables
        if length - old < _BULK_FROM:  # a step's few tokens: the loop is cheaper
            for position in range(max(old, min_n), length):
                # One tuple of the longest n-gram; the shorter ones are its tails (tuple
                # slices are C-speed; a list slice and tuple() per n cost twice as much).
                top = min(max_n, position)
                gram = tuple(tokens[position - top : position])
                for n in range(min_n, top + 1):
                    tables[n - min_n][gram[top - n :]] = position
            return
        # The n-grams before each new position built by `zip` over shifted slices and
        # stored by one `dict.update` per table: a prompt's thousands of tokens at C speed,
        # not ~7 dict writes each in Python.
        for n in range(min_n, max_n + 1):
            first = max(n, old)  # positions first..length-1 gain the n-gram before them
            if first >= length:
                continue
            grams = zip(*(tokens[first - n + k : length - n + k] for k in range(n)))
            tables[n - min_n].update(zip(grams, range(first, length)))

    def match(self) -> tuple[int, int]:
        """(n, position): the longest suffix n-gram seen before and the position of the token
        that followed its latest earlier occurrence; (0, -1) when no suffix of at least min_n
        tokens occurred before."""
        self.catch_up()
        tokens, length = self.tokens, len(self.tokens)
        # An n-gram seen before with a continuation ends in a min_n-gram seen before with the
        # same continuation: when the shortest suffix has no match, none has (one lookup,
        # not max_n - min_n + 1; most rows on most steps, on the runner's critical path).
        if length < self.min_n or tuple(tokens[length - self.min_n :]) not in self._tables[0]:
            return 0, -1
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            position = self._tables[n - self.min_n].get(tuple(tokens[length - n :]))
            if position is not None:
                return n, position
        return 0, -1

    def propose(self, depth: int, depth_per_token: int | None = None) -> tuple[list[int], int]:
        """Up to `depth` draft tokens continuing the longest earlier match (and, with
        `depth_per_token`, at most that many per matched token), and the match length n
        (0 and no drafts when nothing matches)."""
        n, position = self.match()
        if depth_per_token is not None:
            depth = min(depth, depth_per_token * n)
        if n == 0 or depth <= 0:
            return [], n
        tokens, length = self.tokens, len(self.tokens)
        drafts: list[int] = []
        for i in range(depth):
            source = position + i
            drafts.append(tokens[source] if source < length else drafts[source - length])
        return drafts, n
