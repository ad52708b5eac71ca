"""A journal of per-step feature arrays, gathered now and then into one array per owner.

Each decode step's target features hold one block of rows per decoding request, and several
parts keep a request's rows for later (a parked DFlash session until it drafts; the prefix
cache's log until the request finishes). Slicing each row out every step cost one MLX op per
request per step, on the host beside the next forward, and a slice keeps its whole step
array alive anyway. So a step is journalled once, whole, with whose rows are where, and
every `MERGE_EVERY` steps (or when an owner's rows are needed sooner) each owner's rows are
gathered into one array of its own: a handful of ops per owner per 64 steps instead of 64.
Each owner gets a separate array (a take, not a slice of a shared one), so one long-lived
owner never keeps the other owners' rows alive.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import mlx.core as mx

MERGE_EVERY = 64

Owner = TypeVar("Owner", bound=Hashable)


class FeatureJournal(Generic[Owner]):
    """Step feature arrays [N, F] and the (owner, start, count) row blocks each holds."""

    def __init__(self, every: int = MERGE_EVERY) -> None:
        self.every = every
        self._steps: list[tuple[mx.array, list[tuple[Owner, int, int]]]] = []
        self.rows: dict[Owner, int] = {}  # journalled rows per owner, not yet gathered

    def __len__(self) -> int:
        return len(self._steps)

    def record(self, features: mx.array, blocks: list[tuple[Owner, int, int]]) -> bool:
        """Keep a step's `features` [N, F], whose rows start..start+count-1 belong to each
        block's owner (in position order per owner). True when a gather is due."""
        if blocks:
            self._steps.append((features, blocks))
            rows = self.rows
            for owner, _, count in blocks:
                rows[owner] = rows.get(owner, 0) + count
        return len(self._steps) >= self.every

    def gather(self, keep: Callable[[Owner], bool] | None = None) -> dict[Owner, mx.array]:
        """Every owner's journalled rows in step order, one lazy [n, F] array each, for the
        owners `keep` accepts (all by default; the rest are dropped unread); the journal is
        emptied."""
        steps, self._steps, self.rows = self._steps, [], {}
        if not steps:
            return {}
        picks: dict[Owner, list[int]] = {}
        kept: dict[Owner, bool] = {}
        offset = 0
        for features, blocks in steps:
            for owner, start, count in blocks:
                wanted = kept.get(owner)
                if wanted is None:
                    wanted = kept[owner] = keep is None or keep(owner)
                if wanted:
                    first = offset + start
                    picks.setdefault(owner, []).extend(range(first, first + count))
            offset += features.shape[0]
        if not picks:
            return {}
        flat = steps[0][0] if len(steps) == 1 else mx.concatenate([f for f, _ in steps])
        return {owner: flat[mx.array(rows, dtype=mx.int32)] for owner, rows in picks.items()}
