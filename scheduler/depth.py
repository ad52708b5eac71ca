"""Depth policies: each step, every decoding request's verify depth (draft tokens to verify).

The scheduler asks the policy, then clamps to what the request's token budget allows. The
adaptive controller plugs into the same interface.
"""

from __future__ import annotations

from typing import Protocol

from scheduler.plan import StepResult
from scheduler.request import Request


class DepthPolicy(Protocol):
    def choose(self, requests: list[Request], max_depth: int) -> dict[str, int]:
        """Verify depth per request id (0 = plain decoding for that request)."""
        ...

    def observe(self, result: StepResult) -> None:
        """Learn from a finished step (acceptance, measured cost)."""
        ...

    # Optional: ``expects_plain_next() -> bool``, asked after a step whose depths were all 0:
    # True when the next step will most likely be plain too (the runner may then launch it
    # early). Policies without it never get a lookahead (unless there is no drafter).
    #
    # Optional: ``choose_drafts(requests, options) -> (depths, sources)`` picks each row's draft
    # source too (`scheduler.sources.DraftOptions` per request id); without it the scheduler
    # asks `choose` and gives each drafting row lookup when it matches, else DFlash.
    # Optional: ``lookup_wanted(request_ids) -> set``: those whose lookup match would likely
    # be drafted (without it, all of them).
    # Optional: ``observe_queue(waiting: int)``: told before each choice how many requests wait
    # behind the batch (unadmitted).


def request_cap(request: Request, max_depth: int) -> int:
    """The most a request allows: its `num_speculative_tokens` (None = no cap) and the drafter's."""
    cap = request.params.num_speculative_tokens
    return max_depth if cap is None else min(cap, max_depth)


class FixedDepthPolicy:
    """The same depth for every request: `num_speculative_tokens` (None = the drafter's block
    size - 1, 0 = drafting off), within each request's own cap."""

    def __init__(self, num_speculative_tokens: int | None = None) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def choose(self, requests: list[Request], max_depth: int) -> dict[str, int]:
        depth = max_depth if self.num_speculative_tokens is None else self.num_speculative_tokens
        return {r.request_id: min(depth, request_cap(r, max_depth)) for r in requests}

    def observe(self, result: StepResult) -> None:
        pass

    def expects_plain_next(self) -> bool:
        return self.num_speculative_tokens == 0

    def lookup_wanted(self, request_ids: list[str]) -> set[str]:
        return set(request_ids) if self.num_speculative_tokens != 0 else set()
