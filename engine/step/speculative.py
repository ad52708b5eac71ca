"""Single-request speculative generation: the readable reference loop (and the oracle the
batched engine is tested against).

    prefill (with taps) -> first token
    loop: draft a block -> verify [anchor, drafts] in one target forward -> accept the longest
          prefix where draft == the target's own sample, plus one bonus token -> trim the
          target cache -> queue the committed rows' features as the drafter's next context

Verification samples every row with the request's own sampler, so the output is exactly plain
decoding's (greedy) or exactly distributed as plain sampling (sample-and-match = rejection
sampling with a point-mass draft). Depth 0 (no drafter, or `num_speculative_tokens=0`) is
plain decoding through the same loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from drafters.base import Drafter, DraftSession
from engine.errors import InvalidRequest
from engine.step.penalties import TokenHistory
from engine.step.recurrent import replay
from engine.step.sampling import SamplingParams, request_stream, sample
from engine.step.state_cache import RaggedStateCache
from engine.step.stopping import StopChecker, eos_ids_of
from engine.step.target import TargetAdapter


@dataclass
class StepStats:
    """One verify step: draft tokens offered, accepted, tokens committed (accepted + bonus)."""

    drafted: int
    accepted: int
    committed: int


@dataclass
class StepState:
    """Bookkeeping after a step, for invariant checks and tracing."""

    committed: int  # prompt + generated tokens
    target_cache_length: int
    draft_context_rows: int
    draft_pending_rows: int


@dataclass
class GenerationResult:
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: str
    steps: list[StepStats] = field(default_factory=list)

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (bonus included)."""
        return sum(s.committed for s in self.steps) / len(self.steps) if self.steps else 0.0


def generate(
    target: TargetAdapter,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    drafter: Drafter | None = None,
    tokenizer: Any | None = None,
    eos_token_ids: set[int] | None = None,
    prefill_chunk: int = 256,
    on_step: Callable[[StepState], None] | None = None,
) -> GenerationResult:
    """Generate one completion, speculatively when a drafter is given (see module docstring)."""
    params.validate(target.vocab_size)
    if params.structured is not None:  # refused, never silently unconstrained
        raise InvalidRequest("structured output needs the engine (AsyncEngine), not this loop",
                             param="structured")  # fmt: skip
    if not prompt_ids:
        raise InvalidRequest("prompt must contain at least one token")
    if eos_token_ids is None:
        eos_token_ids = eos_ids_of(tokenizer)
    stop = StopChecker(params, eos_token_ids, tokenizer if (tokenizer is not None) else None)
    depth_cap = drafter.max_depth if drafter is not None else 0
    if params.num_speculative_tokens is not None:
        depth_cap = min(depth_cap, params.num_speculative_tokens)

    # A hybrid target (recurrent-state layers) takes the engine's caches: mlx-lm's would
    # refuse the trim, and a verify's rejected positions must be replayed out of the states.
    cache = target.new_cache(1) if target.hybrid else target.make_cache()
    states = [c for c in cache if isinstance(c, RaggedStateCache)]
    attention = next(c for c in cache if not isinstance(c, RaggedStateCache))
    session: DraftSession | None = drafter.open(prompt_ids) if drafter is not None else None
    stream = None if params.greedy else request_stream(params.seed)
    history = TokenHistory(params, prompt_ids, target.vocab_size) if params.penalised else None
    steps: list[StepStats] = []

    def state() -> StepState:
        return StepState(
            committed=len(prompt_ids) + len(stop.token_ids),
            target_cache_length=(attention.lengths[0] if states else int(attention.offset)),
            draft_context_rows=session.context_rows if session is not None else 0,
            draft_pending_rows=session.pending_rows if session is not None else 0,
        )

    try:
        prompt = mx.array(prompt_ids, dtype=mx.int32)[None]
        for start in range(0, prompt.shape[1], prefill_chunk):
            logits, features = target(prompt[:, start : start + prefill_chunk], cache)
            if session is not None:
                chunk_ids = prompt_ids[start : start + prefill_chunk]
                drafter.commit(session, features[0], chunk_ids)
            mx.eval(logits[:, -1], [c.state for c in cache])
        token = sample(logits[:, -1], params, stream, history).item()
        stop.add([token])
        if history is not None:
            history.add([token])
        if on_step:
            on_step(state())

        while not stop.finished:
            remaining = params.max_tokens - len(stop.token_ids)
            depth = max(0, min(depth_cap, remaining - 1))
            verify_ids = mx.array([token], dtype=mx.int32)
            if depth > 0:
                drafts = drafter.propose([session], [token], [depth]).tokens[0, :depth]
                verify_ids = mx.concatenate([verify_ids, drafts])
            for layer_cache in states:
                layer_cache.recording = depth > 0
            logits, features = target(verify_ids[None], cache)
            for layer_cache in states:
                layer_cache.recording = False
            # verify position j counts drafts[:j] as generated (penalties stay exact)
            target_tokens = sample(logits[0], params, stream, history,
                                   drafts if depth > 0 else None)  # fmt: skip
            if depth > 0:
                matches = (drafts == target_tokens[:depth]).astype(mx.int32)
                accepted_len = mx.cumprod(matches).sum()
            else:
                accepted_len = mx.array(0)
            mx.eval(target_tokens, accepted_len)  # the step's one host sync
            accepted = int(accepted_len.item())
            if stream is not None:  # the rejected positions' draws go back (as the engine's)
                stream.drawn -= depth - accepted
            committed = target_tokens[: accepted + 1].tolist()
            if states:
                for layer_cache in cache:
                    if isinstance(layer_cache, RaggedStateCache):
                        if depth > 0:
                            replay(layer_cache, [accepted + 1])
                    else:
                        layer_cache.trim_rows([depth - accepted])
            else:
                trim_prompt_cache(cache, depth - accepted)
            if session is not None:
                # positions now in the target cache: the anchor and the accepted drafts
                cached_tokens = [token] + committed[:accepted]
                drafter.commit(session, features[0, : accepted + 1], cached_tokens)
            steps.append(StepStats(drafted=depth, accepted=accepted, committed=accepted + 1))
            stop.add(committed)
            if history is not None:
                history.add(committed)
            token = committed[-1]
            if on_step:
                on_step(state())
    finally:
        if session is not None:
            drafter.close(session)

    return GenerationResult(
        prompt_tokens=len(prompt_ids),
        token_ids=list(stop.token_ids),
        text=stop.text,
        finish_reason=stop.finish_reason or "length",
        steps=steps,
    )
