"""The Drafter protocol: what the decode loop and the scheduler ask of any drafter.

A drafter lives as long as the model; each request opens a session on it. Proposals are made
for many sessions in one batched call and come back as lazy MLX arrays, so the draft forward,
the target verify and the acceptance test are evaluated together with a single host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx


@dataclass(frozen=True)
class TargetShape:
    """What pairing validation needs to know about a target model."""

    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int


@dataclass
class Candidates:
    """Draft tokens for a batch of sessions: row b's first depths[b] entries are meaningful."""

    tokens: mx.array  # [B, D] int32, D = max depth of the call
    probs: mx.array  # [B, D] float32, the drafter's probability of each draft token
    depths: list[int]


class DraftSession(Protocol):
    """Per-request drafter state."""

    @property
    def context_rows(self) -> int:
        """Target positions already written into the drafter's context cache."""
        ...

    @property
    def pending_rows(self) -> int:
        """Committed target positions whose features wait to be written."""
        ...


class Drafter(Protocol):
    block_size: int

    @property
    def max_depth(self) -> int:
        """The most draft tokens one proposal can hold."""
        ...

    def open(self, prompt_ids: Sequence[int] = ()) -> DraftSession:
        """A session for a request with this prompt (token-based drafters read it)."""
        ...

    def commit(self, session: DraftSession, features: mx.array, tokens: Sequence[int] = ()) -> None:
        """Report committed target positions, in position order: their features [n, F] and
        the tokens at those positions (the anchor and accepted drafts of a verify step)."""
        ...

    def commit_step(
        self, features: mx.array, blocks: list[tuple[DraftSession, int, Sequence[int]]]
    ) -> None:
        """`commit` for a decode step's rows at once: `features` [N, F] holds the whole step,
        and each block (session, start, tokens) puts that session's committed positions at
        rows start..start+len(tokens)-1 (so a drafter need not slice each row apart)."""
        ...

    def propose(
        self, sessions: list[DraftSession], anchors: list[int], depths: list[int]
    ) -> Candidates:
        """One batched draft forward for `sessions` (all depths > 0). Lazy: no host sync."""
        ...

    def take_unevaluated(self) -> list[mx.array]:
        """Arrays the drafter built lazily outside a proposal (gathered buffers), for the
        caller to compute with its next evaluation; [] when there are none."""
        ...

    def close(self, session: DraftSession) -> None: ...
