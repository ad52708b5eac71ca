"""The distributed process group and the two ways rank 0's values reach the other ranks.

- `Group.broadcast_object`: a pickled message (a step plan, a call) from rank 0, as one
  uint8 array summed over the group (the followers add zeros). Two collectives: the length,
  then the bytes. Used on the host, between steps.
- `Decisions.share`: an array computed inside a step (drafts, sampled tokens) made rank 0's on
  every rank, lazily, inside the step's graph: an `all_sum` where the followers add
  `value * 0`. The product keeps the follower's operand downstream of the same forward as
  rank 0's, so every rank reaches its collectives in the same order.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger("flashbatch.distributed")

# What `mlx.launch` sets in every rank's environment, by backend.
_LAUNCH_VARS = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_RANK")


class DistributedError(RuntimeError):
    """A rank died, could not be reached or disagreed: the engine cannot go on."""


class ShardingError(DistributedError, ValueError):
    """This target cannot be split this way over this many ranks (the message says why)."""


def launched() -> bool:
    """Whether this process was started by `mlx.launch` (or mpirun) as one of several ranks."""
    return any(name in os.environ for name in _LAUNCH_VARS)


@dataclass
class Group:
    """The ranks of one distributed engine; rank 0 leads."""

    group: Any  # mx.distributed.Group
    # The newest in-graph collective (`chained_sum`): the next one depends on it.
    _last: mx.array | None = None

    @classmethod
    def init(cls, backend: str = "any") -> Group:
        """Join the group `mlx.launch` started (strict: a lone process is an error here).
        Once per process: later calls return the same group."""
        global _joined
        if _joined is not None:
            return _joined
        if not launched():
            raise DistributedError(
                "--parallel needs ranks started by mlx.launch, e.g. "
                "`mlx.launch -n 2 --backend ring -- flashbatch serve --parallel tensor`"
            )
        group = mx.distributed.init(strict=True, backend=backend)
        if group.size() < 2:
            raise DistributedError("--parallel needs at least two ranks")
        log.info("rank %d pid %d joined a group of %d", group.rank(), os.getpid(), group.size())
        _joined = cls(group)
        return _joined

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group)

    def chained_sum(self, x: mx.array) -> mx.array:
        """`all_sum` inside a step's graph, ordered after the previous one. MLX evaluates a
        graph's independent branches in an order that follows the graph's shape, and the
        ranks' graphs differ in shape (a pipeline rank skips the layers it does not hold;
        rank 0 drafts, the followers do not). Two forwards in one evaluation could then reach
        their sums in different orders on different ranks, and a sum paired with the wrong
        one silently mixes rows. Chaining every sum to the one built before it (the same
        order on every rank: the same runner code builds them) fixes the order."""
        if self._last is not None:
            x = mx.depends(x, self._last)
        self._last = out = self.all_sum(x)
        return out

    def broadcast_object(self, value: Any = None) -> Any:
        """Rank 0's `value` on every rank (pickled; the followers pass nothing). One collective
        of `FIRST_BYTES` (the length, then the start of the payload) carries a step's plan
        whole; a longer payload (admissions with long prompts) takes a second for the rest."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if self.leader else b""
        first = np.zeros(FIRST_BYTES, dtype=np.uint8)
        if self.leader:
            first[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), dtype=np.uint8)
            head = payload[: FIRST_BYTES - 4]
            first[4 : 4 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        received = np.array(_checked(self.all_sum(mx.array(first))))
        n = int.from_bytes(received[:4].tobytes(), "little")
        rest = n - (FIRST_BYTES - 4)
        if rest > 0:
            if self.leader:
                tail = mx.array(np.frombuffer(payload[FIRST_BYTES - 4 :], dtype=np.uint8))
            else:
                tail = mx.zeros((rest,), dtype=mx.uint8)
            tail_bytes = np.array(_checked(self.all_sum(tail))).tobytes()
        else:
            tail_bytes = b""
        if self.leader:
            return value
        return pickle.loads(received[4 : 4 + min(n, FIRST_BYTES - 4)].tobytes() + tail_bytes)

    def barrier(self) -> None:
        """Every rank reaches this point (a one-element sum)."""
        _checked(self.all_sum(mx.array([1], dtype=mx.int32)))


_joined: Group | None = None
# A step's plan with 32 rows pickles to 2-3 KB: one collective of this size carries it whole.
FIRST_BYTES = 4096


def _checked(x: mx.array) -> mx.array:
    """Evaluate a collective now; a lost peer becomes a `DistributedError`."""
    try:
        mx.eval(x)
    except RuntimeError as exc:
        raise DistributedError(f"a rank was lost: {exc}") from exc
    return x


class Decisions:
    """Where a step's decisions come from. Single process: this process's own values."""

    def share(self, value: mx.array) -> mx.array:
        return value


class SharedDecisions(Decisions):
    """Distributed: rank 0's values on every rank, inside the step's lazy graph."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def share(self, value: mx.array) -> mx.array:
        mine = value if self.group.leader else value * 0
        return self.group.chained_sum(mine)
