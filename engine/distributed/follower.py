"""What a rank other than 0 runs: the same model runner on its shard, driven by rank 0.

The follower builds the runner from rank 0's own configuration (sent at start), then replays
every call rank 0 makes on its runner (`engine.distributed.mirror`) in the same order, so both
build the same graphs and every rank reaches its collectives in the same order. It has no
HTTP server, no scheduler and no drafter: where rank 0's runner asks its DFlash drafter, the
follower's asks `StandInDrafter`, whose drafts of the right shape are replaced by rank 0's
inside the step (`Decisions.share`). Lookup drafts, grammars and rollbacks are host work on
committed tokens, which are rank 0's, so the follower computes the same ones itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from drafters.base import Candidates
from engine.distributed.group import DistributedError, Group

log = logging.getLogger("flashbatch.distributed")

# Messages from rank 0 (see `mirror.MirroredRunner`).
CALL, SET, STOP = "call", "set", "stop"


@dataclass
class StandInSession:
    """A follower's placeholder for a row's DFlash session: it only has to exist."""

    context_rows: int = 0
    pending_rows: int = 0


class StandInDrafter:
    """Rank 0's drafter as the follower's runner sees it: the same depth, no weights, no
    forward. Its proposal is zeros of the proposal's shape; rank 0's drafts replace them."""

    def __init__(self, block_size: int, max_depth: int) -> None:
        self.block_size = block_size
        self._max_depth = max_depth
        self.cache: list = []

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def open(self, prompt_ids: Sequence[int] = ()) -> StandInSession:
        return StandInSession()

    def commit(self, session: StandInSession, features: mx.array, tokens: Sequence[int] = ()):
        return None

    def commit_step(self, features: mx.array, blocks: list) -> None:
        return None

    def propose(self, sessions: list, anchors: list[int], depths: list[int]) -> Candidates:
        width = max(depths, default=0)
        return Candidates(
            tokens=mx.zeros((len(sessions), width), dtype=mx.int32),
            probs=mx.zeros((len(sessions), width), dtype=mx.float32),
            depths=list(depths),
        )

    def take_unevaluated(self) -> list[mx.array]:
        return []

    def close(self, session: StandInSession) -> None:
        return None


def follow(group: Group, runner: Any) -> int:
    """Replay rank 0's runner calls until it says stop (0) or a rank is lost (1)."""
    calls = 0
    while True:
        try:
            message = group.broadcast_object()
        except DistributedError as exc:
            log.error("rank %d: rank 0 lost after %d calls: %s", group.rank, calls, exc)
            return 1
        kind = message[0]
        if kind == STOP:  # what it leaves behind, for operators and tests to read
            log.info("rank %d: stopped by rank 0 after %d calls; rows left %d, kv bytes %d, "
                     "prefix entries %d", group.rank, calls, len(runner.rows), runner.kv_bytes,
                     len(runner.prefix_entries))  # fmt: skip
            return 0
        if kind == SET:
            _, name, value = message
            setattr(runner, name, value)
            continue
        _, name, args, kwargs = message
        calls += 1
        try:
            getattr(runner, name)(*args, **kwargs)
            if name == "execute" and runner.lookahead_pending:
                runner.advance()  # as rank 0's engine does (`AsyncEngine._execute_then_advance`)
        except DistributedError as exc:
            log.error("rank %d: a rank was lost during %s: %s", group.rank, name, exc)
            return 1
        except RuntimeError as exc:
            if "[ring]" in str(exc) or "peer" in str(exc):
                log.error("rank %d: a rank was lost during %s: %s", group.rank, name, exc)
                return 1
            raise
