"""Continuous batching: admission, chunked prefill under a token budget, per-request depths.

The scheduler decides, the runner executes. It runs on the asyncio loop and never touches MLX:
`plan()` builds the next step from the queues, `apply()` folds a step's result back into the
requests (stop conditions, stats) and reports which requests changed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import EngineOverloaded, InvalidRequest
from engine.step.logprobs import TokenLogprob
from engine.step.prefix_cache import PrefixIndex, PrefixSave, common_prefix
from scheduler.depth import DepthPolicy
from scheduler.plan import Admission, PrefillChunk, StepPlan, StepResult
from scheduler.request import Request, RequestStatus
from scheduler.sources import (
    DFLASH,
    LOOKUP,
    DraftOptions,
    fallback_source,
    may_draft,
    row_options,
)

# Hold a waiting request back for a prefix being prefilled only when the wait saves at least
# this many prompt positions (below it, prefilling them beside the sharer costs little), and
# publish a prompt in flight only when it prefilled at least this many positions itself
# (entries are whole copies: one that adds a few tokens to an entry it came from would copy
# the shared prefix again for little).
HOLD_MIN_TOKENS = 64


@dataclass
class SchedulerLimits:
    max_num_seqs: int = 32  # requests prefilling or decoding at once
    max_waiting_requests: int = 256
    max_waiting_prompt_tokens: int = 1 << 18
    prefill_chunk_tokens: int = 1024  # prompt tokens per step across all prefilling requests
    kv_cache_bytes: int = 4 << 30  # budget for the target KV cache of admitted requests
    bytes_per_token: int = 0  # KV bytes per cached token (0 = no memory budget)
    bytes_per_row: int = 0  # bytes a row holds whatever its length (a hybrid's states)
    max_model_len: int = 4096


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        policy: DepthPolicy,
        max_depth: int,
        source_depths: dict[str, int] | None = None,
        prefix: PrefixIndex | None = None,
        prefill_rides: bool = False,
        share_in_flight: bool = True,
    ) -> None:
        self.limits = limits
        # The runner carries prefill chunks inside a decoding step's forward (the packed
        # forward), so a step about to prefill should not be looked ahead without them.
        self.prefill_rides = prefill_rides
        self.policy = policy
        self.max_depth = max_depth
        # The draft sources served and the most one proposal of each holds (default: DFlash
        # alone, at max_depth).
        if source_depths is None:
            source_depths = {DFLASH: max_depth} if max_depth else {}
        self.source_depths = dict(source_depths)
        self.sources: Sequence[str] = tuple(self.source_depths)
        self.prefix = prefix  # None: no prefix caching
        # In-flight sharing (see `_plan_prefix_saves` and `_held`): a prompt is published as
        # an entry as soon as its prefill completes, and a waiting request that shares a long
        # prefix with one still prefilling waits for that entry.
        self.share_in_flight = share_in_flight and prefix is not None
        self._to_save: list[tuple[str, list[int]]] = []  # (request id, cached tokens to keep)
        self._to_publish: list[Request] = []  # prompts prefilled since the last plan
        self.held: set[str] = set()  # waiting requests the last plan held back
        self.holds = 0  # requests ever held back (each counted once; for the metrics)
        self._pinned: list[int] = []  # entries the last plan's admissions copy from
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._removals: list[str] = []
        self._waiting_prompt_tokens = 0
        self.last_depths: dict[str, int] = {}
        self.last_parked: dict[str, str] = {}  # request id -> why it decodes without drafting

    # ----------------------------------------------------------------- intake
    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Reject what can never be served (before it is queued)."""
        limit = self.limits.max_model_len
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty")
        if prompt_len + max_tokens > limit:
            raise InvalidRequest(
                f"this model's maximum context length is {limit} tokens, but "
                f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion); "
                "shorten the prompt or lower max_tokens",
                code="context_length_exceeded",
            )
        if self.limits.bytes_per_token:
            need = (prompt_len + max_tokens) * self.limits.bytes_per_token
            need += self.limits.bytes_per_row
            if need > self.limits.kv_cache_bytes:
                raise InvalidRequest(
                    f"the request needs {need >> 20} MiB of KV cache, more than the engine's "
                    f"whole budget of {self.limits.kv_cache_bytes >> 20} MiB"
                )

    def add(self, request: Request) -> None:
        """Queue a request, or raise EngineOverloaded at once when the queue is full."""
        self.check(len(request.prompt_ids), request.params.max_tokens)
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        if len(self.waiting) >= self.limits.max_waiting_requests:
            raise EngineOverloaded(
                f"{len(self.waiting)} requests are already waiting (limit "
                f"{self.limits.max_waiting_requests}); retry later",
                retry_after=self._retry_after(),
            )
        tokens = self._waiting_prompt_tokens + len(request.prompt_ids)
        if self.waiting and tokens > self.limits.max_waiting_prompt_tokens:
            raise EngineOverloaded(
                f"{self._waiting_prompt_tokens} prompt tokens are already waiting (limit "
                f"{self.limits.max_waiting_prompt_tokens}); retry later",
                retry_after=self._retry_after(),
            )
        self.waiting.append(request)
        self.requests[request.request_id] = request
        self._waiting_prompt_tokens += len(request.prompt_ids)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request with reason "abort"; its engine resources go at the next step."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self._waiting_prompt_tokens -= len(request.prompt_ids)
            del self.requests[request_id]
        else:
            self._keep_aborted(request)
            self._retire(request)
        request.finish("abort")
        return request

    def _keep_aborted(self, request: Request) -> None:
        """An aborted request leaves its computed prefix behind: mid-prefill, the prompt
        positions planned so far (the runner has run them by the time the save executes); in
        the decode batch (not for a hybrid target, whose row a step in flight may advance
        past the state the entry would need), what a finished request leaves."""
        if self.prefix is None:
            return
        if request.status is RequestStatus.PREFILLING:
            tokens = request.prompt_ids[: request.prefilled]
        elif self.prefix.whole_only:
            return  # its prompt was published when its prefill completed
        else:
            tokens = (request.prompt_ids + request.stop.token_ids)[:-1]
        if len(tokens) > request.cached_tokens:  # more than the entry it came from
            self._to_save.append((request.request_id, tokens))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._removals)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    # ----------------------------------------------------------------- planning
    def plan(self) -> StepPlan:
        plan = StepPlan(removals=self._removals)
        self._removals = []
        if self.prefix is not None:
            self._plan_prefix_saves(plan)
        self._admit(plan)
        budget = self.limits.prefill_chunk_tokens
        for request in self.prefilling:
            if budget <= 0:
                break
            end = min(len(request.prompt_ids), request.prefilled + budget)
            if end == request.prefilled:
                continue
            last = end == len(request.prompt_ids)
            plan.prefills.append(PrefillChunk(request.request_id, request.prefilled, end, last))
            budget -= end - request.prefilled
            request.prefilled = end
        self.last_parked = {}
        if self.running:
            observe_queue = getattr(self.policy, "observe_queue", None)
            if observe_queue is not None:  # what a token is worth depends on who waits
                observe_queue(len(self.waiting))
            observe_batch = getattr(self.policy, "observe_batch", None)
            if observe_batch is not None:  # a new row may end a hold (`AdaptiveDepthPolicy`)
                observe_batch(self.running)
            # Held: the policy drafts for no row, so no row's options are worked out and
            # the runner leaves lookup matches unasked (see `StepPlan.match_lookup`).
            held = self._drafting_held()
            options = {} if held else {r.request_id: self._options(r) for r in self.running}
            chosen, sources = self._choose(options)
            for request in self.running:
                rid = request.request_id
                remaining = request.params.max_tokens - request.generated
                depth = max(0, min(chosen[rid], remaining - 1))
                plan.depths[rid] = depth
                if depth:
                    plan.sources[rid] = sources[rid]
                else:
                    reason = self._parked_reason(request, chosen[rid], options.get(rid))
                    self.last_parked[rid] = reason
            plan.match_lookup = not held
            plan.lookup_watch = set() if held else self._lookup_watch()
        self.last_depths = dict(plan.depths)
        plan.lookahead = (
            not any(plan.depths.values())
            and any(r.params.max_tokens - r.generated > 1 for r in self.running)
            and self._expects_plain_next()
            and not (self.prefill_rides and self._prefill_next())
        )
        return plan

    def _prefill_next(self) -> bool:
        """Will the next step likely prefill? A prompt has chunks left, or a request waits and
        a slot is free or frees now (a row whose last token this plain step commits). The
        chunk then rides in that step's forward; a looked-ahead step would leave it a forward
        of its own. (A stop string or EOS that ends a row cannot be foreseen.)"""
        if any(r.prefilled < len(r.prompt_ids) for r in self.prefilling):
            return True
        if not self.waiting:
            return False
        staying = self.prefilling + [
            r for r in self.running if r.params.max_tokens - r.generated > 1
        ]
        if len(staying) >= self.limits.max_num_seqs:
            return False
        return self._fits(self.waiting[0], sum(r.reserved_tokens for r in staying), len(staying))

    def _fits(self, request: Request, reserved: int, rows: int) -> bool:
        """Whether `request`'s KV reservation fits beside `reserved` tokens of `rows` others
        (each row also holds `bytes_per_row`: a hybrid target's recurrent states)."""
        if not self.limits.bytes_per_token:
            return True
        need = (reserved + request.reserved_tokens) * self.limits.bytes_per_token
        need += (rows + 1) * self.limits.bytes_per_row
        return need <= self.limits.kv_cache_bytes

    def _options(self, request: Request) -> DraftOptions:
        allowed = [s for s in self.sources if may_draft(request.params, s)]
        return row_options(allowed, request.lookup_match, self.source_depths)

    def _choose(self, options: dict[str, DraftOptions]) -> tuple[dict[str, int], dict[str, str]]:
        """Depth and source per running request: the policy's own choice when it picks
        sources, else its depths with the fallback source (lookup when it matches)."""
        choose_drafts = getattr(self.policy, "choose_drafts", None)
        if choose_drafts is not None:
            return choose_drafts(self.running, options)
        chosen = self.policy.choose(self.running, self.max_depth)
        depths, sources = {}, {}
        for request in self.running:
            rid = request.request_id
            option = options.get(rid)  # none while drafting is held
            source = fallback_source(option) if option is not None else None
            depth = min(chosen[rid], option.depth_limit(source)) if source else 0
            depths[rid] = depth
            if depth:
                sources[rid] = source
        return depths, sources

    def _lookup_watch(self) -> set[str]:
        """Rows that would draft by lookup once they match (see `StepPlan.lookup_watch`)."""
        if LOOKUP not in self.sources:
            return set()
        candidates = [
            r.request_id for r in self.running if may_draft(r.params, LOOKUP, self.sources)
        ]
        wanted = getattr(self.policy, "lookup_wanted", None)  # priced once for all rows
        return set(candidates) if wanted is None else wanted(candidates)

    def _expects_plain_next(self) -> bool:
        """After a plain step: will the next one be plain for every row too? (The runner
        then launches it early; a wrong guess costs one forward.)"""
        if self.max_depth == 0:
            return True
        hint = getattr(self.policy, "expects_plain_next", None)
        return bool(hint is not None and hint())

    def _drafting_held(self) -> bool:
        """Does the policy hold this batch size plain (no row drafts, whatever it matches)?"""
        holds = getattr(self.policy, "holds_drafting", None)
        return bool(holds is not None and holds(len(self.running)))

    def _parked_reason(self, request: Request, chosen: int, options: DraftOptions | None) -> str:
        """Why a request decodes without drafting this step (a metric label); `options`:
        None when drafting is held for the whole batch."""
        if self.max_depth == 0:
            return "no_drafter"
        if request.params.num_speculative_tokens == 0 or request.params.draft_sources == []:
            return "request_disabled"
        if chosen > 0 or request.params.max_tokens - request.generated <= 1:
            return "token_budget"  # one token left: nothing to draft for
        if options is not None and not options.sources:
            return "no_match"  # lookup was the only source and nothing matched
        reason = getattr(self.policy, "parked_reasons", {}).get(request.request_id)
        return reason or "policy"

    def _admit(self, plan: StepPlan) -> None:
        reserved = sum(r.reserved_tokens for r in self.prefilling + self.running)
        held: set[str] = set()
        for request in list(self.waiting):
            rows = len(self.prefilling) + len(self.running)
            if rows >= self.limits.max_num_seqs:
                break
            if self.share_in_flight and self._held(request):
                held.add(request.request_id)
                continue  # later requests that share nothing go ahead
            if not self._fits(request, reserved, rows):
                break  # wait for memory to free up
            self.waiting.remove(request)
            self._waiting_prompt_tokens -= len(request.prompt_ids)
            reserved += request.reserved_tokens
            request.status = RequestStatus.PREFILLING
            request.admitted_time = time.monotonic()
            self.prefilling.append(request)
            admission = Admission(request.request_id, request.prompt_ids, request.params)
            # Prompt logprobs need every prompt position's logits: no reuse for them.
            if self.prefix is not None and request.params.prompt_logprobs is None:
                entry_id, length = self.prefix.match(request.prompt_ids)
                if entry_id is not None:
                    # Pinned until the runner has copied it (the next plan unpins).
                    self.prefix.pin(entry_id)
                    self._pinned.append(entry_id)
                    admission.prefix_entry, admission.prefix_tokens = entry_id, length
                    request.prefilled = request.cached_tokens = length
            plan.admissions.append(admission)
        self.holds += len(held - self.held)
        self.held = held

    def _held(self, request: Request) -> bool:
        """Hold `request` back while a prefilling request computes a prefix it shares of at
        least HOLD_MIN_TOKENS beyond what the cache already gives it: that prefill publishes
        the prompt as an entry when it completes (`_plan_prefix_saves`), and `request` is then
        admitted with a hit instead of prefilling the same positions beside it.

        Bounded: a prefilling request is admitted, holds its KV reservation and gets prefill
        budget every step in admission order, so its prefill completes within its remaining
        chunks; nothing it waits for is itself held (no deadlock). Aborted mid-prefill, it
        leaves the positions computed so far (`_keep_aborted`) and stops holding anyone, so
        the held request is admitted in the same plan with whatever that entry gives it."""
        if request.params.prompt_logprobs is not None or not self.prefilling:
            return False
        prompt, limit = request.prompt_ids, len(request.prompt_ids) - 1
        cached = self.prefix.peek(prompt)
        for sharer in self.prefilling:
            shared = common_prefix(sharer.prompt_ids, prompt, limit)
            if self.prefix.whole_only and shared != len(sharer.prompt_ids):
                continue  # its entry, at its prompt's end, would not be a whole prefix
            if shared >= cached + HOLD_MIN_TOKENS:
                return True
        return False

    def _plan_prefix_saves(self, plan: StepPlan) -> None:
        """Unpin the entries the previous step copied from (it has run by now), then index
        the requests that finished since: their cached positions become entries, evicting
        the least recently used ones beyond the budget."""
        for entry_id in self._pinned:
            self.prefix.unpin(entry_id)
        self._pinned = []
        # Prompts whose prefill completed since the last plan (still in the batch): the row
        # holds exactly the prompt's positions until this plan's step decodes, and the runner
        # copies them before it does. A request that already finished saves more below; one
        # that came mostly from an entry adds too little to it to be worth a copy of its own.
        published = [
            (r.request_id, r.prompt_ids)
            for r in self._to_publish
            if not r.finished and len(r.prompt_ids) - r.cached_tokens >= HOLD_MIN_TOKENS
        ]
        self._to_publish = []
        for request_id, tokens in published + self._to_save:
            entry_id, drops = self.prefix.save(tokens)
            plan.prefix_drops += drops
            if entry_id is not None:
                plan.prefix_saves.append(PrefixSave(request_id, entry_id, len(tokens)))
        self._to_save = []

    # ----------------------------------------------------------------- results
    def apply(self, result: StepResult) -> list[Request]:
        """Fold a step's result into the requests; return those with new output."""
        now = time.monotonic()
        changed: list[Request] = []
        for request_id, match in result.lookup_matches.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.lookup_match = match
        for request_id, backlog in result.draft_backlogs.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.draft_backlog = backlog
        for request_id, entries in result.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs += entries
        for request_id, token in result.first_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.finished:
                continue  # aborted while the step ran; its removal is already queued
            self.prefilling.remove(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.first_token_time = request.last_token_time = now
            if self.share_in_flight:
                self._to_publish.append(request)
            first = result.first_logprobs.get(request_id)
            self._add_tokens(request, [token], changed, None if first is None else [first])
        for request_id, outcome in result.outcomes.items():
            request = self.requests.get(request_id)
            if request is None or request.finished:
                continue
            request.drafted += outcome.drafted
            request.accepted += outcome.accepted
            if outcome.source is not None and outcome.drafted:
                by, source = request.drafted_by, outcome.source
                by[source] = by.get(source, 0) + outcome.drafted
                by = request.accepted_by
                by[source] = by.get(source, 0) + outcome.accepted
            request.verify_steps += 1
            request.last_token_time = now
            self._add_tokens(request, outcome.tokens, changed, outcome.logprobs)
        self.policy.observe(result)
        return changed

    def _add_tokens(self, request: Request, tokens: list[int], changed: list[Request],
                    logprobs: list[TokenLogprob] | None = None) -> None:  # fmt: skip
        kept = request.stop.add(tokens)
        request.committed += tokens
        if request.logprobs is not None and logprobs is not None:
            request.logprobs += logprobs[: len(kept)]  # tokens past a stop are not output
        if request.stop.finished:
            self._retire(request)
            if self.prefix is not None:
                # The runner's row holds committed - 1 positions, and may hold more: tokens
                # past a stop were committed there but are not output. This prefix is valid
                # either way (a hybrid's state exists only at the row's very end).
                output = request.committed if self.prefix.whole_only else request.stop.token_ids
                self._to_save.append((request.request_id, (request.prompt_ids + output)[:-1]))
            request.finish(request.stop.finish_reason)
        changed.append(request)

    def _retire(self, request: Request) -> None:
        """Take a request out of the batch bookkeeping and free its runner row next step."""
        if request in self.prefilling:
            self.prefilling.remove(request)
        if request in self.running:
            self.running.remove(request)
        self.requests.pop(request.request_id, None)
        self._removals.append(request.request_id)

    def _retry_after(self) -> float:
        """A rough hint for clients: seconds until the queue has likely moved on."""
        return float(max(1, min(30, len(self.waiting) // max(1, self.limits.max_num_seqs))))
