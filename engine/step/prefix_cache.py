"""Automatic prefix caching: requests leave their KV for the prompts that follow.

Chat clients and agents resend the whole conversation every turn; with this cache only the new
part is prefilled. Two halves, split like the scheduler and the runner:

- `PrefixIndex` (asyncio loop, plain Python): which token sequences are cached, their sizes,
  LRU order and pins. It matches a new prompt against them and decides what to save and what
  to evict under the byte budget. The scheduler owns it.
- `PrefixEntry` (MLX thread): one entry's arrays, held by the runner by entry id: each target
  layer's K/V of the entry's positions and, with a drafter, the target features of those
  positions. A hit hands the features to the new DFlash session exactly as a cold prefill
  would (same rows, same commit), so its drafts equal a cold start's.

Entries come from three places (the scheduler plans each): a prompt whose prefill just
completed is published while its request decodes on (in-flight sharing: requests that arrive
meanwhile, or were held back for it, reuse it); a finished request; an aborted request (the
positions it had computed, mid-prefill or in the batch). An entry of a finished request
covers its prompt and output except the newest token (the target cache holds committed - 1
positions). A hit reuses at most len(prompt) - 1 positions:
the last prompt token must go through the target to give the first token's logits. Entries are
immutable: a hit copies the prefix into the request's own cache before anything is written,
and an entry pinned by an admission in flight is never evicted.

Hybrid targets (`whole_only`): a recurrent state exists only at the position it was saved at,
so an entry holds the state at its end and is reused only when it is a whole prefix of the new
prompt (the chat follow-up: the earlier turn's prompt and answer, then the new message). A
partial match is a miss: the prompt is prefilled cold. Such an entry covers exactly what the
row's cache held (the prompt and every committed token but the newest, tokens past a stop
included), and a new entry never replaces a shorter one (that one still serves its own
follow-ups).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

_COMPARE_CHUNK = 256  # list slices compare in C; chunks keep a mismatch from costing a full scan


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of `a` and `b` (at most `limit`)."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    i = 0
    while i < n:
        j = min(n, i + _COMPARE_CHUNK)
        if a[i:j] == b[i:j]:
            i = j
            continue
        while a[i] == b[i]:
            i += 1
        return i
    return n


@dataclass
class _Indexed:
    entry_id: int
    tokens: list[int]
    pins: int = 0


@dataclass
class PrefixSave:
    """Plan item: keep the first `length` cached positions of a request (finished, aborted,
    or whose prompt prefill just completed) as entry `entry_id`."""

    request_id: str
    entry_id: int
    length: int


class PrefixIndex:
    """The host-side index of cached prefixes; see the module docstring."""

    def __init__(self, budget_bytes: int, bytes_per_token: int, bytes_per_entry: int = 0,
                 whole_only: bool = False) -> None:  # fmt: skip
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.bytes_per_entry = bytes_per_entry  # a hybrid target's recurrent states
        self.whole_only = whole_only  # see the module docstring
        self._entries: OrderedDict[int, _Indexed] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entry_tokens(self) -> dict[int, list[int]]:
        return {e.entry_id: e.tokens for e in self._entries.values()}

    def pins(self, entry_id: int) -> int:
        return self._entries[entry_id].pins

    # ----------------------------------------------------------------- admission
    def match(self, prompt: list[int]) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with `prompt` and that length, capped at
        len(prompt) - 1 (one prompt token must still be prefilled); (None, 0) on a miss."""
        best, best_length = self._best(prompt)
        if best is None:
            return None, 0
        self._entries.move_to_end(best.entry_id)
        return best.entry_id, best_length

    def peek(self, prompt: list[int]) -> int:
        """The length `match` would give, leaving the LRU order as it is."""
        return self._best(prompt)[1]

    def _best(self, prompt: list[int]) -> tuple[_Indexed | None, int]:
        best, best_length = None, 0
        limit = len(prompt) - 1
        for entry in self._entries.values():
            if entry.tokens[0] != prompt[0]:
                continue
            length = common_prefix(entry.tokens, prompt, limit)
            if self.whole_only and length != len(entry.tokens):
                continue  # a state exists only at the entry's end
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    def pin(self, entry_id: int) -> None:
        self._entries[entry_id].pins += 1

    def unpin(self, entry_id: int) -> None:
        entry = self._entries.get(entry_id)
        if entry is not None:
            entry.pins -= 1

    # ----------------------------------------------------------------- saving
    def save(self, tokens: list[int]) -> tuple[int | None, list[int]]:
        """Index a request's cached `tokens` (finished, aborted, or a prompt just prefilled);
        returns the new entry's id (None when
        it is not worth keeping or cannot fit) and the ids of the entries it evicts."""
        size = self._size(len(tokens))
        if not tokens or size > self.budget_bytes:
            return None, []
        for entry in self._entries.values():
            if self.whole_only and entry.tokens != tokens:
                continue  # a longer entry does not serve this one's follow-ups
            if len(entry.tokens) >= len(tokens) and common_prefix(entry.tokens, tokens) == len(
                tokens
            ):
                self._entries.move_to_end(entry.entry_id)  # already cached (or more of it)
                return None, []
        # Entries the new one extends are redundant: every match they give, it gives too
        # (not so with whole-only matching).
        drops = [
            e.entry_id
            for e in self._entries.values()
            if not e.pins
            and not self.whole_only
            and common_prefix(e.tokens, tokens) == len(e.tokens)
        ]
        used = self.used_bytes - sum(self._size(len(self._entries[i].tokens)) for i in drops)
        victims = iter(
            [e for e in self._entries.values() if not e.pins and e.entry_id not in drops]
        )
        while used + size > self.budget_bytes:  # evict least recently used first
            victim = next(victims, None)
            if victim is None:
                return None, []  # what is left is pinned by admissions in flight
            drops.append(victim.entry_id)
            used -= self._size(len(victim.tokens))
        for entry_id in drops:
            self._drop(entry_id)
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = _Indexed(entry_id, list(tokens))
        self.used_bytes += size
        return entry_id, drops

    def _size(self, tokens: int) -> int:
        return tokens * self.bytes_per_token + self.bytes_per_entry

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        assert not entry.pins, "a pinned prefix entry is never evicted"
        self.used_bytes -= self._size(len(entry.tokens))


@dataclass
class PrefixEntry:
    """One cached prefix's arrays (MLX thread): per attention layer K and V [1, H, L, D], the
    target features [L, F] of the same positions when a drafter needs them, and for a hybrid
    target each state layer's state arrays after the entry's last position."""

    keys: list[mx.array]
    values: list[mx.array]
    features: mx.array | None
    length: int
    states: list[list[mx.array | None]] | None = None

    def arrays(self) -> list[mx.array]:
        extra = [] if self.features is None else [self.features]
        saved = [a for state in self.states or [] for a in state if a is not None]
        return [*self.keys, *self.values, *extra, *saved]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())
