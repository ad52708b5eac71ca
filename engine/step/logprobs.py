"""Log-probabilities of committed tokens, as the target computed them.

Values are the raw log-softmax of the target's logits at the position that produced each
token (vLLM's default: before temperature, top-k/p or min-p). Under speculation a committed
token at verify position j was produced by the verify forward's logits at j, whose context is
exactly the committed prefix, so the values equal plain decoding's whatever the draft depth.

`compute` builds lazy arrays (no host sync; the step's one `mx.eval` resolves them) for the
rows that asked only; `to_host` turns the resolved arrays into `TokenLogprob`s.
"""

from __future__ import annotations

import mlx.core as mx
import msgspec

from engine.backend import cpu_kernels

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; completions allow 5


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token: its id, its log-probability and the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # (token id, logprob), most likely first


class LazyLogprobs:
    """Lazy log-probabilities of `rows` (request ids) over W positions: chosen [R, W] and,
    when any row asked for alternatives, the top-k ids and values [R, W, k]."""

    def __init__(self, rows: list[str], tokens: mx.array, chosen: mx.array,
                 top_ids: mx.array | None, top_values: mx.array | None,
                 wanted: list[int]) -> None:  # fmt: skip
        self.rows = rows
        self.tokens = tokens
        self.chosen = chosen
        self.top_ids = top_ids
        self.top_values = top_values
        self.wanted = wanted  # alternatives each row asked for

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def to_host(self) -> dict[str, list[TokenLogprob]]:
        """Every row's TokenLogprob per position (call after the step's sync)."""
        tokens = self.tokens.tolist()
        chosen = self.chosen.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_values = self.top_values.tolist() if self.top_values is not None else None
        out: dict[str, list[TokenLogprob]] = {}
        for r, request_id in enumerate(self.rows):
            k = self.wanted[r]
            row = []
            for j, value in enumerate(chosen[r]):
                top: list[tuple[int, float]] = []
                if k and top_ids is not None:
                    pairs = sorted(zip(top_ids[r][j], top_values[r][j]), key=lambda p: -p[1])
                    top = pairs[:k]
                row.append(TokenLogprob(tokens[r][j], value, top))
            out[request_id] = row
        return out


def compute(logits: mx.array, tokens: mx.array, rows: list[str], wanted: list[int]) -> LazyLogprobs:
    """Log-probabilities of `tokens` [R, W] under `logits` [R, W, V] (raw, float32) and the
    top max(wanted) alternatives per position. Lazy."""
    logits = logits.astype(mx.float32)
    # Only the entries read are normalised: the whole [R, W, V] log-softmax is never written,
    # a pass over the vocabulary as long as the normaliser's own (the same values: each is
    # its logit less the normaliser either way).
    norm = log_normaliser(logits)
    chosen = mx.take_along_axis(logits, tokens[..., None].astype(mx.int32), axis=-1) - norm
    chosen = chosen[..., 0]
    k = max(wanted)
    top_ids = top_values = None
    if k:
        # A block-wise partition, not a full sort: only k entries per position are needed,
        # ordered on the host (prompt logprobs ask it of every prompt position).
        top_ids = top_k_ids(logits, k)
        top_values = mx.take_along_axis(logits, top_ids, axis=-1) - norm
    return LazyLogprobs(rows, tokens, chosen, top_ids, top_values, wanted)


def log_normaliser(logits: mx.array) -> mx.array:
    """logsumexp over the last axis, kept: what a log-softmax subtracts. On the CPU backend
    on the vectorised exp (`engine.backend.cpu_kernels`), where MLX's own runs one libm call
    an element (about 0.65 ms a SmolLM2 position)."""
    if cpu_kernels.wanted():
        return cpu_kernels.logsumexp(logits)
    return mx.logsumexp(logits, axis=-1, keepdims=True)


def top_k_ids(x: mx.array, k: int, width: int = 64) -> mx.array:
    """Indices of the k largest entries of x [..., V] along the last axis, in no order (of
    equal entries, any). The k largest lie in the k blocks of `width` entries whose maxima are
    largest, so only those k * width entries are partitioned: a vocabulary-wide partition is
    about a third of a SmolLM2 forward over a prompt on the CPU, a max per block a fiftieth."""
    lead, vocab = x.shape[:-1], x.shape[-1]
    if vocab <= k * width:
        return mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    if vocab % width:  # pad the last block with -inf (never chosen over a real entry)
        pad = mx.full((*lead, width - vocab % width), -mx.inf, dtype=x.dtype)
        x = mx.concatenate([x, pad], axis=-1)
    block_max = x.reshape(*lead, -1, width).max(axis=-1)
    blocks = mx.argpartition(-block_max, k - 1, axis=-1)[..., :k]
    candidates = (blocks[..., None] * width + mx.arange(width)).reshape(*lead, k * width)
    chosen = mx.argpartition(-mx.take_along_axis(x, candidates, axis=-1), k - 1, axis=-1)
    return mx.take_along_axis(candidates, chosen[..., :k], axis=-1)
