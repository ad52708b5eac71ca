"""The packed verify's attention layout, measured: which one to run on this backend.

    python bench/packed_attention.py [--rows 32] [--context 200] [--drafting 1] [--depth 3]

One layer's attention (the bundled target's heads: 6 query, 2 KV, head size 64) for `rows`
decoding rows whose KV caches hold `context` tokens, `drafting` of them verifying `depth`
drafts. Compared, min of many repeats:

Attention runs as the engine runs it on this backend (`engine.backend.cpu_kernels` on the CPU).

- padded: one SDPA over the [B, heads, 1 + depth, T] layout with a per-row causal mask;
- split (what `engine.step.packed` runs): every row's anchor in one [B, heads, 1, T] SDPA over the
  cache as it lies, plus the drafted positions of the drafting rows in one
  [S, heads, depth, T] SDPA over just those rows' cache;
- plain: the anchors alone (a step where nobody drafts), for scale.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import time

import mlx.core as mx

from engine.backend import cpu_kernels
from engine.step.packed import row_attention

HEADS, KV_HEADS, HEAD_DIM, CAPACITY_STEP = 6, 2, 64, 256


def _best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--drafting", type=int, default=1)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    B, S, d, T = args.rows, args.drafting, args.depth, args.context + args.depth + 1
    capacity = -(-T // CAPACITY_STEP) * CAPACITY_STEP
    keys = mx.random.normal((B, KV_HEADS, capacity, HEAD_DIM))[..., :T, :]
    values = mx.random.normal((B, KV_HEADS, capacity, HEAD_DIM))[..., :T, :]
    lengths = mx.array([args.context] * B)
    key_pos = mx.arange(T)[None, None, None, :]

    def mask(rows: int, first: int, width: int) -> mx.array:
        query = lengths[:rows, None, None, None] + first + mx.arange(width)[None, None, :, None]
        return key_pos <= query

    padded_q = mx.random.normal((B, HEADS, 1 + d, HEAD_DIM))
    anchor_q = mx.random.normal((B, HEADS, 1, HEAD_DIM))
    draft_q = mx.random.normal((S, HEADS, d, HEAD_DIM))
    padded_mask, anchor_mask, draft_mask = mask(B, 0, 1 + d), mask(B, 0, 1), mask(S, 1, d)
    mx.eval(keys, values, padded_q, anchor_q, draft_q, padded_mask, anchor_mask, draft_mask)
    scale, cpu = HEAD_DIM**-0.5, cpu_kernels.wanted()  # the attention the engine runs here

    rows = mx.arange(S)  # the drafting rows' cache, gathered (a slice when adjacent)

    def plain():
        return row_attention(anchor_q, keys, values, anchor_mask, scale, cpu)

    def padded():
        return row_attention(padded_q, keys, values, padded_mask, scale, cpu)

    def split():
        drafted = row_attention(draft_q, keys[rows], values[rows], draft_mask, scale, cpu)
        return [plain(), drafted]

    results = {}
    for _ in range(2):  # interleaved rounds; the best of each
        for name, fn in (("plain", plain), ("padded", padded), ("split", split)):
            results[name] = min(results.get(name, 1e9), _best_ms(fn, args.repeats))
    print(f"{B} rows, context {args.context}, {S} drafting {d}: one layer's attention, ms")
    for name, ms in results.items():
        print(f"  {name:7s} {ms:7.3f}  ({ms / results['plain']:.2f}x plain)")


if __name__ == "__main__":
    main()
