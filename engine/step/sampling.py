"""Sampling parameters and the target-side sampler used for plain and speculative decoding.

The sampler is the definition of "the target's own distribution": temperature first, then
top-k, top-p and min-p on the tempered distribution (vLLM's order). Speculative verification
samples every verify row with this same function and accepts a draft token only where it equals
the sample, which keeps sampled output exactly distributed as plain sampling.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections.abc import Sequence

import mlx.core as mx
import msgspec
import numpy as np

from engine.backend.cpu_kernels import fast_exp
from engine.errors import InvalidRequest
from engine.step import penalties, structured
from engine.step.logprobs import MAX_TOP_LOGPROBS
from engine.step.penalties import TokenHistory
from engine.step.structured import StructuredOutput
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
    # OpenAI's penalties on the logits (`engine.step.penalties`): token id -> bias in [-100, 100];
    # frequency and presence in [-2, 2]; repetition (vLLM's extension) > 0, 1 = off.
    logit_bias: dict[int, float] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # The output must match this JSON schema / JSON object / regex / Lark grammar
    # (`engine.step.structured`: per-row masks at every verify position).
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def host_bound(self) -> bool:
        """Whether each forward needs the row's committed tokens on the host first (penalty
        counts, grammar state): no step is built on a previous step's lazy tokens."""
        return self.penalised or self.structured is not None

    @property
    def penalised(self) -> bool:
        """Whether the logits are adjusted before sampling (a per-row token history)."""
        return bool(
            self.logit_bias
            or self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
        )

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
        if self.structured is not None and self.ignore_eos:
            raise InvalidRequest(
                "ignore_eos cannot be combined with structured output: a finished grammar "
                "ends the output with EOS",
                param="ignore_eos",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value!r}", param=name)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequest(
                f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
                param="repetition_penalty",
            )
        for token, value in (self.logit_bias or {}).items():
            if not (isinstance(value, (int, float)) and -100.0 <= value <= 100.0):
                raise InvalidRequest(
                    f"logit_bias values must be in [-100, 100], got {value!r} for {token}",
                    param="logit_bias",
                )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    f"stop_token_ids {bad} outside the vocabulary (0..{vocab_size - 1})"
                )
            bad = [t for t in self.logit_bias or {} if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    f"logit_bias token ids {bad} outside the vocabulary (0..{vocab_size - 1})",
                    param="logit_bias",
                )


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def _splitmix64(z):
    """splitmix64's output mix, on a Python int or a numpy uint64 array (wrapping)."""
    if isinstance(z, int):
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class RandomStream:
    """One request's sampling randomness: its i-th uniform is a hash of (seed, i) (splitmix64,
    counter-based), so what a request draws depends on its seed and on how many it drew
    before, never on its neighbours in the batch. A whole batch's uniforms are one vectorised
    hash on the host (`draw_uniforms`): an MLX key split and draw per row cost ~80 us a row on
    the CPU backend, 2.5 ms a step at 32 rows. `drawn` is the whole state, so a discarded
    lookahead gives its draws back by restoring it."""

    __slots__ = ("_base", "drawn")

    def __init__(self, seed: int) -> None:
        self._base = _splitmix64(seed & _MASK64)
        self.drawn = 0


def request_stream(seed: int | None) -> RandomStream:
    """The random stream a request samples from (a random seed when none is given)."""
    return RandomStream(secrets.randbits(63) if seed is None else seed)


def draw_uniforms(streams: Sequence[RandomStream], counts: Sequence[int]) -> mx.array:
    """The next `counts[b]` uniforms in [0, 1) of each stream, concatenated [sum(counts)]
    (float32, 24 random bits each); advances the streams."""
    bases, firsts = [], []
    for stream, count in zip(streams, counts):
        bases += [stream._base] * count
        firsts += range(stream.drawn + 1, stream.drawn + count + 1)
        stream.drawn += count
    index = np.array(firsts, dtype=np.uint64)
    z = _splitmix64(np.array(bases, dtype=np.uint64) + index * np.uint64(_GOLDEN))
    return mx.array((z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24))


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


def sample(
    logits: mx.array,
    params: SamplingParams,
    stream: RandomStream | None,
    history: TokenHistory | None = None,
    drafts: mx.array | None = None,
    mask: np.ndarray | None = None,
) -> mx.array:
    """One token per row of `logits` [N, V], rows drawn independently (row j penalised as if
    `drafts[:j]` were generated, where a `history` is given; constrained to the grammar's
    `mask` bitmasks [N, words]). Lazy (no sync)."""
    drafts = None if drafts is None else drafts[None]
    return sample_rows(logits, [params], [stream], [logits.shape[0]], [history], drafts, [mask])


def sample_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    streams: Sequence[RandomStream | None],
    widths: Sequence[int],
    histories: Sequence[TokenHistory | None] | None = None,
    drafts: mx.array | None = None,
    masks: Sequence[np.ndarray | None] | None = None,
    _keep: mx.array | None = None,
) -> mx.array:
    """One token per position of `logits` [N, V], where request b owns the next `widths[b]`
    positions and draws them with its own `params[b]` and `streams[b]` (None when greedy;
    advanced by its width): a whole batch's verify positions in one pass. Greedy positions
    take the argmax. Lazy.

    Drawing is by inverse CDF: one uniform per position, against the running sum of the
    position's unnormalised probabilities. That is one exponential per vocabulary entry,
    computed by the vectorised `fast_exp`, where the Gumbel-max trick of
    `mx.random.categorical` needs two logarithms and MLX's CPU backend evaluates those one
    element at a time (about 25 ns each): at a 49k vocabulary that sampler took 1.6 ms a
    position, this one a few percent of it. A request's draws depend only on its own
    logits and stream, never on its neighbours in the batch.

    `histories[b]` (None: not penalised) applies request b's logit bias and penalties
    (`engine.step.penalties`) first, position j of the request counting `drafts[b, :j]` (its
    draft tokens, [B, >= widths[b] - 1]) as generated. `masks[b]` (None: unconstrained) are
    the request's grammar bitmasks, one per position (`engine.step.structured`): disallowed
    tokens get -inf and, sampled, weigh exactly 0 (`_keep`: those masks, already unpacked)."""
    if histories is not None:
        logits = penalties.apply(logits, histories, widths, drafts)
    keep = _keep
    if keep is None and masks is not None:
        keep = structured.allowed(masks, widths, logits.shape[-1])
        if keep is not None:
            logits = mx.where(keep, logits.astype(mx.float32), -mx.inf)
    greedy = [p.greedy for p in params]
    if all(greedy):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    if any(greedy):
        # Greedy positions take the argmax; only the sampled ones pay for the weights (a
        # vocabulary-wide exp and running sum each), drawn as a batch of their own.
        starts = [0, *itertools.accumulate(widths)]
        sampled = [b for b, g in enumerate(greedy) if not g]
        index = mx.array([starts[b] + i for b in sampled for i in range(widths[b])], dtype=mx.int32)
        drawn = sample_rows(
            logits[index], [params[b] for b in sampled], [streams[b] for b in sampled],
            [widths[b] for b in sampled], _keep=None if keep is None else keep[index],
        )  # fmt: skip
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        tokens[index] = drawn
        return tokens
    uniforms = draw_uniforms(streams, widths)
    if any(_filters(p) for p in params):  # per request: filters differ
        parts, start = [], 0
        for p, w in zip(params, widths):
            parts.append(_filtered_weights(logits[start : start + w], p))
            start += w
        weights = mx.concatenate(parts)
    else:  # temperature only: the whole batch in one pass
        inverse = [1.0 / p.temperature for p in params]
        if len(set(inverse)) == 1:
            weights = _weights(logits, inverse[0])
        else:
            scale = [t for t, w in zip(inverse, widths) for _ in range(w)]
            weights = _weights(logits, mx.array(scale)[:, None])
        if keep is not None:  # masked: exactly 0 (`fast_exp(-inf)` is tiny, not 0)
            weights = mx.where(keep, weights, 0.0)
    return _inverse_cdf(weights, uniforms)


def _filters(params: SamplingParams) -> bool:
    """Whether the request narrows the tempered distribution (top-k, top-p or min-p)."""
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _weights(logits: mx.array, inverse_temperature: float | mx.array) -> mx.array:
    """Unnormalised probabilities of the tempered distribution, the largest 1 per row."""
    scaled = logits.astype(mx.float32) * inverse_temperature
    return fast_exp(scaled - scaled.max(axis=-1, keepdims=True))


def _filtered_weights(logits: mx.array, params: SamplingParams) -> mx.array:
    """Probabilities after the request's filters; filtered-out tokens weigh exactly 0."""
    logprobs = filtered_logprobs(logits, params)
    return mx.where(logprobs == -mx.inf, 0.0, fast_exp(logprobs))


def _inverse_cdf(weights: mx.array, uniforms: mx.array) -> mx.array:
    """Per row of `weights` [N, V] (non-negative, some positive), the first token whose
    running sum exceeds `uniforms` [N] times the row's total. A token of weight 0 is never
    drawn: where float rounding would land on one, the most likely token is taken instead
    (odds of about 1e-7)."""
    cdf = mx.cumsum(weights, axis=-1)
    threshold = uniforms[:, None] * cdf[:, -1:]
    drawn = mx.argmax(cdf > threshold, axis=-1).astype(mx.int32)
    chosen = mx.take_along_axis(weights, drawn[:, None], axis=-1)[:, 0]
    return mx.where(chosen > 0, drawn, mx.argmax(weights, axis=-1).astype(mx.int32))
