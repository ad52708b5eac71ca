"""What the scheduler asks the model runner to do in one step, and what comes back.

The plan crosses from the asyncio loop to the MLX thread and the result comes back; both are
plain data. Request ids are the only link between the two sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.step.logprobs import TokenLogprob
from engine.step.prefix_cache import PrefixSave
from engine.step.sampling import SamplingParams


@dataclass
class Admission:
    """A request entering the runner: it will be prefilled, then join the decode batch."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # A prefix cache hit: the first `prefix_tokens` positions come from that entry (one copy)
    # and prefill starts after them.
    prefix_entry: int | None = None
    prefix_tokens: int = 0


@dataclass
class PrefillChunk:
    """Prompt positions [start, end) of one request to run through the target this step."""

    request_id: str
    start: int
    end: int
    last: bool  # the prompt's final chunk: sample the first token and join the batch


@dataclass
class StepPlan:
    removals: list[str] = field(default_factory=list)  # finished or aborted: free their rows
    # Prefix cache: finished rows to keep as entries (read before the rows go), entries to
    # free (after this step's admissions copied theirs).
    prefix_saves: list[PrefixSave] = field(default_factory=list)
    prefix_drops: list[int] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    depths: dict[str, int] = field(default_factory=dict)  # every decoding request's verify depth
    # Where each drafting row (depth > 0) takes its drafts from: "dflash" or "lookup".
    sources: dict[str, str] = field(default_factory=dict)
    # The scheduler expects the next step to be plain decoding for every row, so the runner
    # may launch it early (a hint: a wrong guess costs one forward, never correctness).
    lookahead: bool = False
    # Rows the policy would draft for by lookup as soon as their suffix matches: the runner
    # launches no lookahead when one of them has a match after this step.
    lookup_watch: set[str] = field(default_factory=set)
    # Report every row's lookup match for the next plan. False while the policy holds
    # drafting: nobody reads the matches then, and the lookup indexes only store tokens.
    match_lookup: bool = True

    @property
    def empty(self) -> bool:
        return not (self.removals or self.admissions or self.prefills or self.depths)


@dataclass
class RowOutcome:
    """One decoding request's step: tokens committed (accepted drafts + bonus)."""

    tokens: list[int]
    drafted: int
    accepted: int
    source: str | None = None  # where the drafts came from (None: no drafts)
    logprobs: list[TokenLogprob] | None = None  # one per token, for requests that asked


@dataclass
class StepResult:
    first_tokens: dict[str, int] = field(default_factory=dict)  # prefill finished this step
    first_logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # of first tokens
    # prompt tokens' logprobs of this step's prefill chunks (requests that asked)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    outcomes: dict[str, RowOutcome] = field(default_factory=dict)
    batch_size: int = 0  # decoding rows this step
    verify_tokens: int = 0  # rows x verify width actually run through the target
    drafted_rows: int = 0  # rows in the drafter forward (0: no drafter forward ran)
    # Context rows that forward wrote into the drafter: each drafting session's positions
    # committed since its last proposal (more than the step's verify positions: a catch-up
    # after the session sat out, whose one-off cost says nothing about a draft's own).
    draft_context_rows: int = 0
    lookup_rows: int = 0  # rows verifying lookup drafts (no forward of their own)
    # Every decoding row's lookup match length for its next step (0: no match).
    lookup_matches: dict[str, int] = field(default_factory=dict)
    # Every decoding row's DFlash backlog: the feature rows its session holds unwritten, which
    # its next DFlash proposal writes first (its prompt, then every step it sat out).
    draft_backlogs: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0  # drafter + target + sampling up to the sync
    # The loop's cadence: seconds from the previous step's result reaching the event loop to
    # this one's (the loop's own work between them included, a lookahead's overlap taken
    # off); 0 when unknown (the loop sat idle in between, or no loop measured it).
    cadence_seconds: float = 0.0
    # A plain step looked ahead for this one and thrown away (this step drafted after all):
    # the seconds it took to build and compute, which the cadence paid for nothing.
    discarded_seconds: float = 0.0
    looked_ahead: bool = False  # the next plain step was launched after this one
    # "forward" (drafter + target + sampling, up to the one sync) and "commit" (rollback and
    # bookkeeping); with phase profiling on, "forward" splits into "draft" and "verify".
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # With the engine's `keep_features`: each row that left this step, its target features
    # [n, F] (float32) of its n cache positions: the prompt and every committed token but the
    # last (which never went through the target).
    released_features: dict[str, np.ndarray] = field(default_factory=dict)
    kv_bytes: int = 0
    memory_active: int | None = None  # MLX allocator, bytes
    memory_peak: int | None = None
