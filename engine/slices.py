"""Per-step slices kept for later (a row's features), merged now and then into one array.

A slice of a step's output keeps that whole output alive. Whoever keeps such slices appends
them one step at a time and, every `MERGE_EVERY` appends, replaces the ones since the last
merge by their concatenation: the step outputs are then released once it is computed, and no
row is copied twice (merging the whole list would copy the oldest rows at every merge).
"""

from __future__ import annotations

import mlx.core as mx

MERGE_EVERY = 64


def merge_tail(pieces: list[mx.array], tail: int) -> mx.array:
    """Replace the last `tail` arrays of `pieces` by their concatenation along axis 0, in
    place, and return it (lazy: the caller has it computed with its next evaluation)."""
    merged = mx.concatenate(pieces[-tail:], axis=0)
    pieces[-tail:] = [merged]
    return merged
