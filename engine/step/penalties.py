"""Logit bias and repetition penalties, applied per verify position inside the sampler.

OpenAI documents the penalties on the logits `mu` before sampling:

    mu[j] -> mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty

where `c[j]` counts how often token j was generated before the position. `logit_bias` adds its
value to a token's logit first; `repetition_penalty` (vLLM's and HF's extension) divides a
positive logit and multiplies a negative one by the penalty for every token seen in the prompt
or the output. The order (bias, repetition, frequency and presence) is vLLM's.

Speculation stays lossless for the penalised distribution because verify position j of a row
counts the row's drafts before j as generated: where those drafts are accepted they *are* the
generated tokens, so the position is penalised exactly as plain decoding would penalise it.
The committed counts live on the host (the runner adds what each step commits); the drafts'
share is computed on the device, so lazy DFlash drafts need no sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np


class TokenHistory:
    """One request's penalty state: its bias vector, its prompt's tokens (for the repetition
    penalty) and the counts of the tokens it generated so far."""

    __slots__ = ("bias", "counts", "frequency", "presence", "prompt_seen", "repetition", "vocab")

    def __init__(self, params, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.vocab = vocab_size
        self.frequency = float(params.frequency_penalty)
        self.presence = float(params.presence_penalty)
        self.repetition = float(params.repetition_penalty)
        self.counts = np.zeros(vocab_size, dtype=np.float32)
        self.bias: mx.array | None = None
        if params.logit_bias:
            bias = np.zeros(vocab_size, dtype=np.float32)
            for token, value in params.logit_bias.items():
                bias[int(token)] = value
            self.bias = mx.array(bias)
        self.prompt_seen: mx.array | None = None
        if self.repetition != 1.0:
            seen = np.zeros(vocab_size, dtype=np.bool_)
            seen[np.asarray(list(prompt_ids), dtype=np.int64)] = True
            self.prompt_seen = mx.array(seen)

    def add(self, tokens: Sequence[int]) -> None:
        """Count committed tokens (the runner calls this with every step's commits)."""
        np.add.at(self.counts, np.asarray(tokens, dtype=np.int64), 1.0)

    def adjust(self, logits: mx.array, drafts: mx.array | None = None) -> mx.array:
        """`logits` [W, V] of one row's verify positions, penalised; position j counts
        `drafts[:j]` (lazy, [>= W - 1]) as generated after the committed tokens."""
        width, vocab = logits.shape
        logits = logits.astype(mx.float32)
        if vocab != self.vocab:  # a padded head: the extra entries are never sampled anyway
            raise ValueError(f"logits of width {vocab} for a vocabulary of {self.vocab}")
        if self.bias is not None:
            logits = logits + self.bias
        if not (self.frequency or self.presence or self.prompt_seen is not None):
            return logits
        counts = mx.array(self.counts)[None]
        if width > 1 and drafts is not None:
            before = drafts[: width - 1].astype(mx.int32)
            onehot = (before[:, None] == mx.arange(vocab, dtype=mx.int32)[None]).astype(mx.float32)
            earlier = mx.concatenate([mx.zeros((1, vocab)), mx.cumsum(onehot, axis=0)])
            counts = counts + earlier
        seen = counts > 0
        if self.prompt_seen is not None:
            penalised = mx.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = mx.where(seen | self.prompt_seen[None], penalised, logits)
        if self.frequency:
            logits = logits - counts * self.frequency
        if self.presence:
            logits = logits - seen.astype(mx.float32) * self.presence
        return logits


def apply(
    logits: mx.array,
    histories: Sequence[TokenHistory | None],
    widths: Sequence[int],
    drafts: mx.array | None = None,
) -> mx.array:
    """Penalise the rows of `logits` [N, V] (request b owns the next `widths[b]` positions)
    whose history is not None; `drafts` [B, >= max width - 1] holds each request's drafts
    first (the verify ids after the anchor). Rows without a history pass unchanged."""
    if all(h is None for h in histories):
        return logits
    parts, start = [], 0
    for b, (history, width) in enumerate(zip(histories, widths)):
        part = logits[start : start + width]
        if history is not None:
            part = history.adjust(part, None if drafts is None else drafts[b])
        parts.append(part.astype(mx.float32))
        start += width
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]
