"""A batched recurrent-state cache (one instance per state layer of a hybrid target).

Hybrid models (Qwen3.5/3.6 GatedDeltaNet, LFM2 short convolutions, ...) keep, for some layers,
a fixed-size state per row instead of keys and values: mlx-lm's `ArraysCache` (a conv window
and, for GatedDeltaNet, a ``[heads, dv, dk]`` matrix). This class speaks the same protocol as
`ArraysCache` (`cache[i]`, `lengths`, `advance`, `make_mask`), so stock mlx-lm layer code runs
on it unchanged, and the batch operations of `engine.step.kv_cache.RaggedKVCache` (rows leave,
join, are taken out and snapshotted), so the runner treats both kinds alike.

Why no free row slots as in the KV cache: every forward replaces the state arrays whole (the
recurrence writes a new ``[B, ...]`` state each step), so a join's concatenation costs what one
step's state write costs anyway, where a KV join copying the whole (growing) cache did not.

A state cannot be trimmed: rolling a row back needs the state before the positions it drops
(`engine.step.recurrent` replays a verify's accepted positions from the state before it).

``lengths`` keeps mlx-lm's meaning (None, or per row how many of this call's positions are
real: right-padded rows of a batched prefill); the host-side row length lives in the
attention layers' caches.
"""

from __future__ import annotations

import mlx.core as mx

from engine.step.kv_cache import removal_order


class RaggedStateCache:
    """Per-layer batched recurrent state; see the module docstring."""

    def __init__(self, size: int, batch_size: int = 0) -> None:
        self.cache: list[mx.array | None] = [None] * size
        self.rows = batch_size
        self.lengths: mx.array | None = None  # mlx-lm: real positions left in this call
        self.left_padding: mx.array | None = None  # never set (rows are right-padded)
        # Set by the runner around a verify forward: the layer's mixer then records its
        # input and the state before it (`engine.step.recurrent`), for the rollback.
        self.recording = False
        self.recorded: tuple | None = None

    # ----------------------------------------------------------------- mlx-lm protocol
    def __getitem__(self, index: int) -> mx.array | None:
        return self.cache[index]

    def __setitem__(self, index: int, value: mx.array) -> None:
        self.cache[index] = value

    def __bool__(self) -> bool:  # mlx-lm tests `if cache` before reading the state
        return True

    def advance(self, n: int) -> None:
        if self.lengths is not None:
            self.lengths = self.lengths - n

    def make_mask(self, n: int) -> mx.array | None:
        """[B, n] real positions of this call (None: all are real)."""
        if self.lengths is None:
            return None
        return mx.arange(n)[None, :] < self.lengths[:, None]

    @property
    def state(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]

    def empty(self) -> bool:
        return all(a is None for a in self.cache)

    def is_trimmable(self) -> bool:
        return False

    # ----------------------------------------------------------------- batch operations
    @property
    def batch_size(self) -> int:
        return self.rows

    def arrays(self) -> list[mx.array]:
        return self.state

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def trim_rows(self, counts: list[int]) -> None:
        """Only a no-op trim is possible (see the module docstring)."""
        if any(counts):
            raise ValueError("a recurrent state cannot be trimmed; roll it back by replay")

    def snapshot(self) -> list[mx.array | None]:
        """The state as it is now (the arrays are immutable: holding them is the copy)."""
        return list(self.cache)

    def restore(self, snapshot: list[mx.array | None]) -> None:
        self.cache = list(snapshot)
        batch = next((a.shape[0] for a in self.cache if a is not None), None)
        if batch is not None:
            self.rows = batch

    def remove_rows(self, leaving: list[int]) -> list[int]:
        """Rows `leaving` leave; the same new order as `RaggedKVCache.remove_rows` (the last
        staying rows move into the holes), so every layer's rows stay aligned."""
        order = removal_order(self.rows, leaving)
        self.rows = len(order)
        if order == list(range(len(order))):
            self.cache = [None if a is None else a[: len(order)] for a in self.cache]
        else:
            index = mx.array(order, dtype=mx.int32)
            self.cache = [None if a is None else a[index] for a in self.cache]
        if not order:
            self.cache = [None] * len(self.cache)
        return order

    def extend_many(self, others: list[RaggedStateCache]) -> None:
        """Append the rows of `others` (requests joining in the same step)."""
        parts = [c for c in [self, *others] if c.rows]
        total = sum(c.rows for c in parts)
        merged: list[mx.array | None] = []
        for slot in range(len(self.cache)):
            filled = [c.cache[slot] for c in parts if c.cache[slot] is not None]
            if not filled:
                merged.append(None)
                continue
            like = filled[0]
            pieces = [
                c.cache[slot]
                if c.cache[slot] is not None
                else mx.zeros((c.rows, *like.shape[1:]), like.dtype)
                for c in parts
            ]
            merged.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0))
        self.cache, self.rows = merged, total

    def take_rows(self, rows: list[int]) -> RaggedStateCache:
        """A new cache of `rows` (in that order)."""
        taken = RaggedStateCache(len(self.cache), len(rows))
        if len(rows) == 1:
            r = rows[0]
            taken.cache = [None if a is None else a[r : r + 1] for a in self.cache]
        else:
            index = mx.array(rows, dtype=mx.int32)
            taken.cache = [None if a is None else a[index] for a in self.cache]
        return taken

    def row_state(self, row: int) -> list[mx.array | None]:
        """Row `row`'s state arrays (each [1, ...]), copied out (a prefix-cache entry)."""
        return [None if a is None else mx.contiguous(a[row : row + 1]) for a in self.cache]

    @classmethod
    def from_state(cls, state: list[mx.array | None]) -> RaggedStateCache:
        """A one-row cache starting from a saved state (never written: arrays are replaced)."""
        cache = cls(len(state), 1)
        cache.cache = list(state)
        return cache
