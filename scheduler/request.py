"""A request's life on the scheduler side: waiting -> prefilling -> running -> finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.step.logprobs import TokenLogprob
from engine.step.sampling import SamplingParams
from engine.step.stopping import StopChecker


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no engine resources
    PREFILLING = "prefilling"  # admitted; prompt going through the target chunk by chunk
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    status: RequestStatus = RequestStatus.WAITING
    prefilled: int = 0  # prompt positions already through the target (or from the cache)
    cached_tokens: int = 0  # prompt positions reused from the prefix cache
    # Every token the runner committed, those past a stop too (what the row's cache holds:
    # a hybrid target's prefix entry must be exactly that).
    committed: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # speculation stats
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    drafted_by: dict[str, int] = field(default_factory=dict)  # per draft source
    accepted_by: dict[str, int] = field(default_factory=dict)
    lookup_match: int = 0  # the latest step's lookup match length (for the next plan)
    draft_backlog: int = 0  # feature rows its DFlash session holds unwritten (latest step)
    # timestamps (time.monotonic) for metrics
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # one per generated token when the request asked for logprobs (aligned with the ids)
    logprobs: list[TokenLogprob] | None = None
    # one per prompt token when asked for (None for the first: nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # what has been streamed to the consumer so far
    sent_tokens: int = 0
    sent_text: int = 0

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def generated(self) -> int:
        return len(self.stop.token_ids)

    @property
    def reserved_tokens(self) -> int:
        """Cache positions this request may come to hold (for the KV admission budget)."""
        return len(self.prompt_ids) + self.params.max_tokens

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finished_time = time.monotonic()
