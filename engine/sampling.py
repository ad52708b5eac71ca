"""Sampling parameters and the target-side sampler used for plain and speculative decoding.

The sampler is the definition of "the target's own distribution": temperature first, then
top-k, top-p and min-p on the tempered distribution (vLLM's order). Speculative verification
samples every verify row with this same function and accepts a draft token only where it equals
the sample, which keeps sampled output exactly distributed as plain sampling.
"""

from __future__ import annotations

import math
import secrets

import mlx.core as mx
import msgspec

from engine.errors import InvalidRequest
from engine.logprobs import MAX_TOP_LOGPROBS
from scheduler.sources import ALL_SOURCES


class SamplingParams(msgspec.Struct, kw_only=True):
    """How one request is decoded. ``temperature == 0`` means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # per-request draft cap; None = automatic, 0 = off
    # Where this request may take drafts from ("dflash", "lookup"); None = all the engine
    # serves, [] = no drafting.
    draft_sources: list[str] | None = None
    # Return each generated token's log-probability and this many most likely alternatives
    # (raw target log-softmax, before temperature/top-p); None = no logprobs (no cost).
    logprobs: int | None = None
    # Also each prompt token's log-probability (the first has none) and this many
    # alternatives, from the prefill's logits; such requests skip the prefix cache.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first parameter that is out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequest(f"seed must be a non-negative 63-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise InvalidRequest(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens!r}"
            )
        if self.draft_sources is not None:
            unknown = [s for s in self.draft_sources if s not in ALL_SOURCES]
            if unknown:
                raise InvalidRequest(
                    f"unknown draft_sources {unknown}: choose from {list(ALL_SOURCES)}"
                )
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequest(
                f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequest(
                f"prompt_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, "
                f"got {self.prompt_logprobs!r}"
            )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    f"stop_token_ids {bad} outside the vocabulary (0..{vocab_size - 1})"
                )


def request_key(seed: int | None) -> mx.array:
    """The PRNG key a request's sampling starts from (random when no seed is given)."""
    return mx.random.key(secrets.randbits(63) if seed is None else seed)


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities [N, V] of the distribution `params` samples from."""
    logprobs = logits.astype(mx.float32) / params.temperature
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    vocab = logprobs.shape[-1]
    if 0 < params.top_k < vocab:
        kth = mx.sort(logprobs, axis=-1)[..., vocab - params.top_k][..., None]
        logprobs = mx.where(logprobs < kth, -mx.inf, logprobs)
    if params.top_p < 1.0:
        descending = -mx.sort(-logprobs, axis=-1)
        mass_before = mx.cumsum(mx.exp(descending), axis=-1) - mx.exp(descending)
        kept = (mass_before < params.top_p).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(descending, kept - 1, axis=-1)
        logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
    if params.min_p > 0.0:
        floor = logprobs.max(axis=-1, keepdims=True) + math.log(params.min_p)
        logprobs = mx.where(logprobs < floor, -mx.inf, logprobs)
    if 0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0:
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    return logprobs


def sample(logits: mx.array, params: SamplingParams, key: mx.array | None) -> mx.array:
    """One token per row of `logits` [N, V], rows drawn independently. Lazy (no sync)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.random.categorical(filtered_logprobs(logits, params), key=key).astype(mx.int32)
