"""Prompt lookup as a `Drafter`: drafts copied from the request's own prompt and output.

No forward at all: each session keeps an `NGramIndex` over its committed tokens, and a
proposal continues the most recent earlier occurrence of the longest matching suffix. The
session also keeps what the controller needs to judge it: the current match length and how
often its drafts were accepted.

Token bookkeeping follows the runner's: `commit` reports the tokens now in the target cache,
and the anchor (the newest committed token, not yet in the cache) arrives with `propose` or
`match_length`. The anchor is indexed as soon as it is seen, because the suffix that matters
ends with it; the next `commit` then starts with that same token, which is checked and skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from drafters.base import Candidates
from drafters.lookup.index import NGramIndex

DEFAULT_MIN_N, DEFAULT_MAX_N = 2, 8
DEFAULT_MAX_DEPTH = 15
DEFAULT_DEPTH_PER_MATCH = 2  # draft tokens per matched suffix token (see `NGramIndex.propose`)


class LookupSession:
    """One request's index and lookup statistics."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.index = NGramIndex(min_n, max_n)
        self.cached = 0  # positions reported by `commit` (the target cache's length)
        self.proposals = 0
        self.drafted = 0  # draft tokens proposed and verified
        self.accepted = 0  # of those, accepted

    @property
    def context_rows(self) -> int:
        return self.cached

    @property
    def pending_rows(self) -> int:
        return 0  # nothing to write anywhere: the index is updated at commit

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def add(self, start: int, tokens: Sequence[int]) -> None:
        """Index `tokens`, which sit at positions start, start+1, ...; positions already
        indexed (an anchor seen early) must hold the same token."""
        index = self.index
        known = len(index)
        if start > known:
            raise ValueError(f"lookup session skipped positions {known}..{start - 1}")
        seen = max(0, min(len(tokens), known - start))  # already indexed (an anchor seen early)
        for offset in range(seen):
            if index.tokens[start + offset] != tokens[offset]:
                raise ValueError(
                    f"lookup session out of sync at position {start + offset}: indexed "
                    f"{index.tokens[start + offset]}, committed {tokens[offset]}"
                )
        if seen < len(tokens):
            index.extend(tokens[seen:])


class LookupDrafter:
    """Batched prompt lookup (pure Python; a proposal costs O(max_n^2) per row)."""

    def __init__(
        self,
        min_n: int = DEFAULT_MIN_N,
        max_n: int = DEFAULT_MAX_N,
        max_depth: int = DEFAULT_MAX_DEPTH,
        depth_per_match: int | None = DEFAULT_DEPTH_PER_MATCH,
    ) -> None:
        NGramIndex(min_n, max_n)  # validates the bounds here, not at the first request
        if max_depth < 1:
            raise ValueError("lookup max_depth must be >= 1")
        if depth_per_match is not None and depth_per_match < 1:
            raise ValueError("lookup depth_per_match must be >= 1 (or None: no cap)")
        self.min_n, self.max_n = min_n, max_n
        self.depth_per_match = depth_per_match
        self.block_size = max_depth + 1
        self._max_depth = max_depth

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def open(self, prompt_ids: Sequence[int] = ()) -> LookupSession:
        # The prompt arrives through `commit` once it is in the target cache, like DFlash's.
        return LookupSession(self.min_n, self.max_n)

    def commit(self, session: LookupSession, features: Any = None,
               tokens: Sequence[int] = ()) -> None:  # fmt: skip
        """Tokens now in the target cache, in position order (features are not needed)."""
        session.add(session.cached, tokens)
        session.cached += len(tokens)

    def commit_step(self, features: Any,
                    blocks: list[tuple[LookupSession, int, Sequence[int]]]) -> None:  # fmt: skip
        """A decode step's rows: only each block's tokens are read."""
        for session, _, tokens in blocks:
            self.commit(session, None, tokens)

    def match_length(self, session: LookupSession, anchor: int) -> int:
        """Length of the longest earlier match of the suffix ending at `anchor` (0: none)."""
        session.add(session.cached, [anchor])
        return session.index.match()[0]

    def draft(self, session: LookupSession, anchor: int, depth: int) -> list[int]:
        """Draft tokens for one session as a list (possibly fewer than `depth`: none on no
        match)."""
        session.add(session.cached, [anchor])
        drafts, _ = session.index.propose(depth, self.depth_per_match)
        session.proposals += 1
        return drafts

    def propose(
        self, sessions: list[LookupSession], anchors: list[int], depths: list[int]
    ) -> Candidates:
        """The `Drafter` protocol's batched call: rows without a match are padded with their
        anchor and report probability 0 for those positions."""
        width = max(depths)
        rows, probs = [], []
        for session, anchor, depth in zip(sessions, anchors, depths):
            drafts = self.draft(session, anchor, depth)
            rows.append(drafts + [anchor] * (width - len(drafts)))
            probs.append([1.0] * len(drafts) + [0.0] * (width - len(drafts)))
        return Candidates(
            tokens=mx.array(rows, dtype=mx.int32),
            probs=mx.array(probs, dtype=mx.float32),
            depths=list(depths),
        )

    def record(self, session: LookupSession, drafted: int, accepted: int) -> None:
        """Verification's verdict on the session's latest drafts (for its statistics)."""
        session.drafted += drafted
        session.accepted += accepted

    def take_unevaluated(self) -> list[mx.array]:
        return []  # nothing lazy: the index is plain Python

    def close(self, session: LookupSession) -> None:
        session.index = NGramIndex(self.min_n, self.max_n)  # release the tables now
