"""Attention and SwiGLU for the CPU backend, where MLX's own are slow for a known reason.

On the CPU backend MLX evaluates `exp` one element at a time through libm: about 25 ns an
element on the 2-core machine, against about 0.3 ns for an add. Softmax inside
`mx.fast.scaled_dot_product_attention` (the CPU fallback materialises every score) and the
sigmoid of SwiGLU are then most of a prefill: measured on the bundled target, a 340-token
prompt spends about half its time in attention and a quarter in `silu`, while the matmuls run
at 110 GFLOP/s (OpenBLAS). Here:

- `fast_exp`: ``2**n * p(f)`` with ``x * log2(e) = n + f``, ``|f| <= 0.5`` and p the
  degree-7 Taylor polynomial of ``2**f`` (relative error under 2e-7, float32's own), built
  from multiplies and adds that `mx.compile` fuses into one vectorised pass: 5x `mx.exp`.
- `attention`: scores by matmul, a softmax on `fast_exp`, and for long query blocks (prefill)
  blocks of queries that keep the scores cache-sized and skip the keys a causal block cannot
  see (half the work of a whole prompt).
- `swiglu`: ``silu(g) * x`` as ``g * x / (1 + fast_exp(-g))``.
- `logsumexp`: a log-softmax's normaliser over a vocabulary (logprobs, the campaign's feature
  pass: 49,152 exps a position on SmolLM2, about 0.65 ms of MLX's).

Outputs equal MLX's to float32 rounding (tests/test_cpu_kernels.py). On Metal and CUDA the
fused kernels are fast, so `wanted` is only true on the CPU backend.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

_LOG2E = 1.4426950408889634
_POLY = [math.log(2) ** i / math.factorial(i) for i in range(8)]  # 2**f = sum c_i f**i
# Scores per query block: 2**18 float32 (1 MB) was fastest on the 2-core machine (64k-1M tried).
_BLOCK_SCORES = 1 << 18
# Up to this many scores MLX's fused attention is as fast: one query a row (a decode step),
# up to 2**14; several (a verify of drafted tokens), only up to 2**12, since MLX's path for
# them runs its slow exp (2-core machine, 9 heads: 1.2-2x slower at 4.5k-30k scores).
_FUSED_SCORES = 1 << 14
_FUSED_SCORES_QUERIES = 1 << 12
# A decode step's scores (one query a row) as keys @ queries (see `_attend`); "0" turns it off
# for side-by-side measurements (`bench/decode_attention.py`).
_DECODE_KEYS_FIRST = os.environ.get("FLASHBATCH_DECODE_KEYS_FIRST", "1") != "0"


def wanted() -> bool:
    """Whether the engine should use these kernels: on the CPU backend, unless turned off
    with ``FLASHBATCH_CPU_KERNELS=0`` (for side-by-side measurements)."""
    if os.environ.get("FLASHBATCH_CPU_KERNELS", "1") == "0":
        return False
    return mx.default_device().type == mx.DeviceType.cpu


@mx.compile
def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 x, to float32 precision; inputs below -87 give about 1e-38."""
    t = mx.maximum(x, -87.0) * _LOG2E
    n = mx.floor(t + 0.5)
    f = t - n
    p = _POLY[7]
    for c in reversed(_POLY[:7]):
        p = p * f + c
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


@mx.compile
def _logsumexp(x: mx.array) -> mx.array:
    peak = x.max(axis=-1, keepdims=True)
    return peak + mx.log(fast_exp(x - peak).sum(axis=-1, keepdims=True))


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis, kept, for float32 x with a finite entry in every
    row (logits), on `fast_exp`, in blocks of rows of about `_BLOCK_SCORES` entries: their
    temporaries stay in cache (over 1,024 SmolLM2 positions, 2.3x MLX's own; whole, 1.0x)."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows, step = math.prod(lead), max(1, _BLOCK_SCORES // width)
    if rows <= step:
        return _logsumexp(x)
    flat = x.reshape(rows, width)
    parts = [_logsumexp(flat[i : i + step]) for i in range(0, rows, step)]
    return mx.concatenate(parts).reshape(*lead, 1)


@mx.compile
def _softmax(scores: mx.array) -> mx.array:
    e = fast_exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@mx.compile
def _softmax_where(scores: mx.array, mask: mx.array) -> mx.array:
    return _softmax(mx.where(mask, scores, -mx.inf))


@mx.compile
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return gate * x / (1.0 + fast_exp(-gate))


@mx.compile
def _swiglu_grads(gate: mx.array, x: mx.array, grad: mx.array) -> tuple[mx.array, mx.array]:
    s = 1.0 / (1.0 + fast_exp(-gate))  # d silu(g) / dg = s * (1 + g * (1 - s))
    return grad * x * s * (1.0 + gate * (1.0 - s)), grad * gate * s


@mx.custom_function
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x (mlx-lm's `swiglu`) on `fast_exp`; differentiable (training uses it)."""
    return _swiglu(gate, x)


@swiglu.vjp
def _swiglu_vjp(primals: tuple, grad: mx.array, output: mx.array) -> tuple[mx.array, mx.array]:
    # The integer bit tricks inside `fast_exp` have no gradient of their own: spell it out.
    return _swiglu_grads(*primals, grad)


@mx.compile
def _softmax_grad(probs: mx.array, grad: mx.array) -> mx.array:
    return probs * (grad - (grad * probs).sum(axis=-1, keepdims=True))


@mx.custom_function
def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis on `fast_exp` (float32); differentiable. A score of -inf or
    the float32 minimum gets a probability of at most 1e-37 times its row's largest, not 0."""
    return _softmax(scores)


@softmax.vjp
def _softmax_vjp(primals: tuple, grad: mx.array, output: mx.array) -> mx.array:
    return _softmax_grad(output, grad)


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None):
    """One block: q [B, H, L, D] over k, v [B, KV, T, D]; mask broadcastable to
    [B, 1, L, T] (bool: True = visible; float: added to the scores) or None."""
    B, H, L, D = q.shape
    KV, T = k.shape[1], k.shape[2]
    rep = H // KV  # grouped-query heads share their key head: one matmul per key head
    queries = (q * scale).reshape(B, KV, rep * L, D)
    if L == 1 and _DECODE_KEYS_FIRST:
        # One query a row (a decode step): keys times queries, then the small scores
        # transposed, is 1.3-1.4x faster from 512 keys on at 8 and 32 rows, with the same
        # scores bit for bit (`bench/decode_attention.py`); with several queries a row (a
        # verify) the transpose costs more than it saves.
        scores = (k @ queries.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    else:
        scores = queries @ k.transpose(0, 1, 3, 2)
    scores = scores.reshape(B, KV, rep, L, T)
    if mask is None:
        probs = _softmax(scores)
    else:
        mask = mask.reshape(mask.shape[0], 1, 1, *mask.shape[-2:]) if mask.ndim == 4 else mask
        probs = _softmax_where(scores, mask) if mask.dtype == mx.bool_ else _softmax(scores + mask)
    return (probs.reshape(B, KV, rep * L, T) @ v).reshape(B, H, L, v.shape[-1])


def attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)` for the CPU:
    q [B, H, L, D], k and v [B, KV, T, D]; mask None, "causal" (query i sees keys up to
    ``T - L + i``), or an array broadcastable to [B, 1, L, T] (bool or additive)."""
    B, H, L, _ = q.shape
    T = k.shape[2]
    causal = isinstance(mask, str)
    if causal and mask != "causal":
        raise ValueError(f"unknown attention mask {mask!r}")
    if B * H * L * T <= (_FUSED_SCORES if L == 1 else _FUSED_SCORES_QUERIES):  # few scores
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    block = max(16, _BLOCK_SCORES // max(1, B * H * T))
    if L <= block:
        if causal:
            mask = mx.arange(T)[None, :] <= (mx.arange(L) + (T - L))[:, None]
        return _attend(q, k, v, scale, mask)
    outputs = []
    for start in range(0, L, block):
        end = min(L, start + block)
        keys = T - L + end if causal else T  # a causal block sees no key past its last query
        if causal:
            part = mx.arange(keys)[None, :] <= (mx.arange(start, end) + (T - L))[:, None]
        else:
            rows_vary = mask is not None and mask.shape[-2] != 1
            part = mask[..., start:end, :] if rows_vary else mask
        outputs.append(_attend(q[:, :, start:end], k[:, :, :keys], v[:, :, :keys], scale, part))
    return mx.concatenate(outputs, axis=2)
