"""MLX's fused attention against the CPU kernels for 1-3 queries (SmolLM2's 9 query and 3 key
heads, head dim 64) at contexts of 100-1100 keys; interleaved, best of 3 medians of 25 calls.

    PYTHONPATH=<repo> python attention_op.py
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from engine.backend import cpu_kernels

CALLS = 30  # distinct query arrays per timing, so no call finds its inputs in cache


def median_us(fn: Callable[[], None], repeats: int = 25) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6 / CALLS


def compare(keys: int, queries: int) -> tuple[float, float]:
    k = mx.random.normal((1, 3, keys + 64, 64))[:, :, :keys]  # a cache's view, as in serving
    v = mx.random.normal((1, 3, keys + 64, 64))[:, :, :keys]
    qs = [mx.random.normal((1, 9, queries, 64)) for _ in range(CALLS)]
    visible = mx.arange(keys)[None, :] <= (mx.arange(queries) + (keys - queries))[:, None]
    mask = None if queries == 1 else visible
    mx.eval(k, v, qs, visible)

    def fused() -> None:
        mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask) for q in qs])

    def kernels() -> None:
        mx.eval([cpu_kernels._attend(q, k, v, 0.125, mask) for q in qs])

    rounds = [(median_us(fused), median_us(kernels)) for _ in range(3)]
    return min(r[0] for r in rounds), min(r[1] for r in rounds)


if __name__ == "__main__":
    for keys in (100, 250, 400, 543, 800, 1100):
        for queries in (1, 2, 3):
            fused, kernels = compare(keys, queries)
            print(
                f"keys {keys} queries {queries} scores {9 * queries * keys}: fused {fused:.0f} us"
                f"  kernels {kernels:.0f} us  fused/kernels {fused / kernels:.2f}",
                flush=True,
            )
