"""A batched KV cache whose rows have their own lengths (one instance per attention layer).

Rows are right-padded: row ``b`` holds its tokens at ``[0, lengths[b])`` and the space after
is free. New tokens are written at each row's own offset, so rows can be rolled back by
different amounts in O(1) (only the lengths change). It speaks mlx-lm's cache protocol
(`offset`, `update_and_fetch`, `make_mask`, `trim`, `state`), so stock mlx-lm model code runs
on it unchanged: RoPE already accepts a per-row offset vector.

Host-side lengths are the source of truth (the engine knows every row's length without a
device sync); the `offset` array is rebuilt from them lazily.

Membership changes copy rows, not the batch: the buffers may hold more rows than the batch
(free slots at the end). `remove_rows` moves the last rows into the holes the leavers left and
`extend_many` writes joiners into free slots, both in place. Rebuilding the buffers instead
(a gather to drop a row, a concatenation to add one) copied every row of every layer: with
SmolLM2 at 32 rows of ~600 positions, 0.3-1.3 s a join or a removal, several steps' worth.
"""

from __future__ import annotations

import mlx.core as mx


class RaggedKVCache:
    """Per-layer KV cache with per-row lengths; see the module docstring."""

    step = 256  # capacity grows in chunks of this many positions

    def __init__(self, batch_size: int = 1) -> None:
        self.keys: mx.array | None = None  # [>= B, H, capacity, D]: rows past B are free
        self.values: mx.array | None = None
        self.lengths: list[int] = [0] * batch_size
        self._offset: mx.array | None = None

    # ----------------------------------------------------------------- mlx-lm protocol
    @property
    def offset(self) -> mx.array:
        """Per-row lengths as an int32 array of shape [B] (what RoPE and masks need)."""
        if self._offset is None:
            self._offset = mx.array(self.lengths, dtype=mx.int32)
        return self._offset

    def __bool__(self) -> bool:  # mlx-lm tests `if cache` before calling make_mask
        return True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append N positions to every row at its own offset; return the valid key span."""
        self.write(keys, values)
        return self.fetch()

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        """Mask for N new queries per row, from the lengths *before* this step's write.

        Query i of row b may see key j iff ``j <= lengths[b] + i`` (and within the window).
        """
        uniform = len(set(self.lengths)) <= 1
        if uniform and window_size is None and not return_array:
            return None if N == 1 else "causal"
        start = max(self.lengths) if self.lengths else 0
        key_pos = mx.arange(start + N)[None, None, None, :]
        query_pos = self.offset[:, None, None, None] + mx.arange(N)[None, None, :, None]
        mask = key_pos <= query_pos
        if window_size is not None:
            mask = mask & (key_pos > query_pos - window_size)
        return mask

    def trim(self, n: int) -> int:
        """Roll every row back by n positions (mlx-lm protocol)."""
        n = min(n, min(self.lengths) if self.lengths else 0)
        self.trim_rows([n] * len(self.lengths))
        return n

    def is_trimmable(self) -> bool:
        return True

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values

    # ----------------------------------------------------------------- ragged operations
    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def write(self, keys: mx.array, values: mx.array, counts: list[int] | None = None) -> None:
        """Write ``keys``/``values`` ([B, H, N, D]) at each row's offset.

        Row b advances by ``counts[b]`` (default N): rows padded to a common N keep only
        their real positions; the padding lands in free space and is overwritten later.
        """
        B, H, N, D = keys.shape
        if B != self.batch_size:
            raise ValueError(f"cache has {self.batch_size} rows, got a write for {B}")
        counts = [N] * B if counts is None else counts
        if any(c < 0 or c > N for c in counts):
            raise ValueError(f"per-row counts {counts} must lie in [0, {N}]")
        self._ensure_capacity(max(self.lengths) + N, keys, values)
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[:B, :, start : start + N, :] = keys
            self.values[:B, :, start : start + N, :] = values
        else:
            positions = self.offset[:, None] + mx.arange(N)[None, :]  # [B, N]
            free = self.keys.shape[0] - B
            if free:  # free slots take a write at position 0 (never read; a join overwrites)
                positions = mx.concatenate([positions, mx.zeros((free, N), positions.dtype)])
                keys, values = _pad_rows(keys, free), _pad_rows(values, free)
            index = mx.broadcast_to(positions[:, None, :, None], (B + free, H, N, D))
            self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
            self.values = mx.put_along_axis(self.values, index, values, axis=2)
        self.lengths = [length + c for length, c in zip(self.lengths, counts)]
        self._offset = None

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Keys and values up to the longest row (shorter rows are masked by the caller)."""
        end, B = (max(self.lengths) if self.lengths else 0), self.batch_size
        return self.keys[:B, :, :end, :], self.values[:B, :, :end, :]  # free slots left out

    def snapshot(self) -> tuple[mx.array | None, mx.array | None, list[int]]:
        """The cache as it is now, to `restore` if lazily built writes are dropped unrun.
        Holding it keeps the arrays alive, so a later write cannot update them in place:
        hold it only until the decision."""
        return self.keys, self.values, list(self.lengths)

    def restore(self, snapshot: tuple[mx.array | None, mx.array | None, list[int]]) -> None:
        """Back to `snapshot`: writes built since then (not yet computed) are never run."""
        self.keys, self.values, lengths = snapshot
        self.lengths = list(lengths)
        self._offset = None

    def trim_rows(self, counts: list[int]) -> None:
        """Roll row b back by ``counts[b]`` positions. O(1): no data moves."""
        if len(counts) != self.batch_size:
            raise ValueError(f"need {self.batch_size} trim counts, got {len(counts)}")
        if any(c < 0 or c > length for c, length in zip(counts, self.lengths)):
            raise ValueError(f"cannot trim {counts} from rows of lengths {self.lengths}")
        if any(counts):
            self.lengths = [length - c for length, c in zip(self.lengths, counts)]
            self._offset = None

    def filter(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order): a request left the batch. Copies the cache."""
        self.lengths = [self.lengths[r] for r in rows]
        self._offset = None
        if self.keys is not None:
            if not rows:
                self.keys = self.values = None
                return
            index = mx.array(rows, dtype=mx.int32)
            end = self._shrunk_capacity()
            self.keys = self.keys[index, :, :end, :]
            self.values = self.values[index, :, :end, :]

    def remove_rows(self, leaving: list[int]) -> list[int]:
        """Rows `leaving` leave the batch. The last staying rows move into the holes below the
        new batch size (one row copied per hole, in place); the rest stay where they are.
        Returns the new row order: ``order[new_row] = old_row`` (not sorted when rows moved)."""
        B = self.batch_size
        order = removal_order(B, leaving)
        kept = len(order)
        holes = [r for r in range(kept) if order[r] != r]
        movers = [order[r] for r in holes]
        self.lengths = [self.lengths[r] for r in order]
        self._offset = None
        if self.keys is None:
            return order
        if not kept:
            self.keys = self.values = None
            return order
        if holes:
            # Materialised first: a slice of the buffer itself as the update would keep the
            # buffer shared, and the update would then copy all of it.
            moved = [(mx.contiguous(self.keys[m : m + 1]), mx.contiguous(self.values[m : m + 1]))
                     for m in movers]  # fmt: skip
            mx.eval(moved)
            for hole, (k, v) in zip(holes, moved):
                self.keys[hole : hole + 1] = k
                self.values[hole : hole + 1] = v
        if kept * 4 <= self.keys.shape[0] and self.keys.shape[0] > 8:
            # Far fewer rows than slots: give the memory back (a copy of the kept rows only).
            self.keys = mx.contiguous(self.keys[: 2 * kept])
            self.values = mx.contiguous(self.values[: 2 * kept])
        return order

    def extend_many(self, others: list[RaggedKVCache]) -> None:
        """Append the rows of every cache in ``others`` (requests joining the batch in the
        same step): written into free slots in place, the buffers growing (one copy) only
        when the slots run out."""
        parts = [c for c in others if c.batch_size]
        lengths = self.lengths + [n for c in parts for n in c.lengths]
        if self.keys is not None and parts and all(c.keys is not None for c in parts):
            B, n = self.batch_size, sum(c.batch_size for c in parts)
            cap = max(c.keys.shape[2] for c in [self, *parts])
            if cap > self.keys.shape[2]:
                self.keys = _pad_capacity(self.keys, cap)
                self.values = _pad_capacity(self.values, cap)
            if self.keys.shape[0] < B + n:
                rows = 1 << (B + n - 1).bit_length()  # the next power of two: few growths
                free = rows - self.keys.shape[0]
                self.keys, self.values = _pad_rows(self.keys, free), _pad_rows(self.values, free)
            keys = [_pad_capacity(c.keys[: c.batch_size], cap) for c in parts]
            values = [_pad_capacity(c.values[: c.batch_size], cap) for c in parts]
            self.keys[B : B + n] = keys[0] if len(keys) == 1 else mx.concatenate(keys)
            self.values[B : B + n] = values[0] if len(values) == 1 else mx.concatenate(values)
            self.lengths = lengths
            self._offset = None
            return
        parts = [c for c in [self, *others] if c.batch_size]
        filled = [c for c in parts if c.keys is not None]
        if filled and len(parts) > 1:
            cap = max(c.keys.shape[2] for c in filled)
            shape_k, shape_v = filled[0].keys.shape[1:], filled[0].values.shape[1:]
            dtype = filled[0].keys.dtype
            keys, values = [], []
            for c in parts:
                if c.keys is None:
                    keys.append(mx.zeros((c.batch_size, shape_k[0], cap, shape_k[2]), dtype))
                    values.append(mx.zeros((c.batch_size, shape_v[0], cap, shape_v[2]), dtype))
                else:
                    keys.append(_pad_capacity(c.keys[: c.batch_size], cap))
                    values.append(_pad_capacity(c.values[: c.batch_size], cap))
            self.keys = mx.concatenate(keys, axis=0)
            self.values = mx.concatenate(values, axis=0)
        elif filled:
            c = filled[0]
            self.keys, self.values = c.keys[: c.batch_size], c.values[: c.batch_size]
        self.lengths = lengths
        self._offset = None

    def take_rows(self, rows: list[int]) -> RaggedKVCache:
        """A new cache of ``rows`` (in that order); one row is a slice, more are gathered."""
        taken = RaggedKVCache(len(rows))
        taken.lengths = [self.lengths[r] for r in rows]
        if self.keys is not None:
            if len(rows) == 1:
                r = rows[0]
                taken.keys, taken.values = self.keys[r : r + 1], self.values[r : r + 1]
            else:
                index = mx.array(rows, dtype=mx.int32)
                taken.keys, taken.values = self.keys[index], self.values[index]
        return taken

    @classmethod
    def from_prefix(cls, keys: mx.array, values: mx.array, length: int,
                    capacity: int) -> RaggedKVCache:  # fmt: skip
        """A one-row cache holding the first ``length`` positions of ``keys``/``values``
        ([1, H, >= length, D], e.g. a cached prefix), copied once into a buffer with room for
        ``capacity`` positions. The source arrays are never written."""
        cache = cls(1)
        room = max(capacity, length)
        room = ((room + cls.step - 1) // cls.step) * cls.step
        cache.keys = _pad_capacity(keys[:, :, :length, :], room)
        cache.values = _pad_capacity(values[:, :, :length, :], room)
        cache.lengths = [length]
        return cache

    def put_rows(self, rows: list[int], taken: RaggedKVCache) -> None:
        """Write ``taken`` (from `take_rows`, since grown) back into ``rows``."""
        if taken.keys is not None:
            self._ensure_capacity(taken.keys.shape[2], taken.keys, taken.values)
            taken._ensure_capacity(self.keys.shape[2], taken.keys, taken.values)
            if rows == list(range(rows[0], rows[0] + len(rows))):
                # A contiguous run of rows (often one): a slice update writes in place, where
                # an index scatter copies the whole cache.
                self.keys[rows[0] : rows[0] + len(rows)] = taken.keys
                self.values[rows[0] : rows[0] + len(rows)] = taken.values
            else:
                index = mx.array(rows, dtype=mx.int32)
                self.keys[index] = taken.keys
                self.values[index] = taken.values
        lengths = list(self.lengths)
        for r, length in zip(rows, taken.lengths):
            lengths[r] = length
        self.lengths = lengths
        self._offset = None

    def extend(self, other: RaggedKVCache) -> None:
        """Append the rows of ``other`` (a request joined the batch). Copies both caches."""
        self.extend_many([other])

    def arrays(self) -> list[mx.array]:
        """The buffers (to compute pending copies into them)."""
        return [] if self.keys is None else [self.keys, self.values]

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value buffers (allocated capacity)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    # ----------------------------------------------------------------- internals
    def _ensure_capacity(self, needed: int, keys: mx.array, values: mx.array) -> None:
        if self.keys is not None and self.keys.shape[2] >= needed:
            return
        B, H = self.batch_size, keys.shape[1]
        capacity = ((needed + self.step - 1) // self.step) * self.step
        if self.keys is None:
            self.keys = mx.zeros((B, H, capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((B, H, capacity, values.shape[3]), values.dtype)
        else:
            self.keys = _pad_capacity(self.keys, capacity)
            self.values = _pad_capacity(self.values, capacity)

    def _shrunk_capacity(self) -> int:
        longest = max(self.lengths) if self.lengths else 0
        return max(self.step, ((longest + self.step - 1) // self.step) * self.step)


def removal_order(batch: int, leaving: list[int]) -> list[int]:
    """The row order after rows `leaving` leave a batch of `batch`: ``order[new] = old``. The
    last staying rows move into the holes below the new batch size; the rest stay put. (One
    rule for every kind of layer cache, so all layers keep their rows aligned.)"""
    gone = set(leaving)
    if any(r < 0 or r >= batch for r in gone):
        raise ValueError(f"rows {sorted(gone)} are not all in a batch of {batch}")
    kept = batch - len(gone)
    holes = sorted(r for r in gone if r < kept)
    movers = [r for r in range(kept, batch) if r not in gone]  # as many as holes
    order = list(range(kept))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    return order


def _pad_rows(x: mx.array, extra: int) -> mx.array:
    """`x` with `extra` zero rows appended (free slots)."""
    if extra <= 0:
        return x
    return mx.concatenate([x, mx.zeros((extra, *x.shape[1:]), x.dtype)], axis=0)


def _pad_capacity(x: mx.array, capacity: int) -> mx.array:
    extra = capacity - x.shape[2]
    if extra <= 0:
        return x
    pad = mx.zeros((x.shape[0], x.shape[1], extra, x.shape[3]), x.dtype)
    return mx.concatenate([x, pad], axis=2)
