"""`engine.step.logprobs.compute` over SmolLM2-shaped logits: MLX's logsumexp and the whole
log-softmax written, then read (`before`, the code until 2026-12-07), against only the read
entries normalised, by `cpu_kernels.logsumexp` on the CPU (`compute` now). Times are medians
of 7 runs after 2 warm-ups; values agree within 1e-5 (the vectorised exp's rounding).

    PYTHONPATH=. python bench/results/2026-12-07e/logprobs-normalise/time_compute.py
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import time

import mlx.core as mx
import numpy as np

from engine.step.logprobs import compute, top_k_ids

VOCAB = 49152


def before(logits: mx.array, tokens: mx.array, k: int) -> list[mx.array]:
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[..., None].astype(mx.int32), axis=-1)[..., 0]
    ids = top_k_ids(logprobs, k)
    return [chosen, ids, mx.take_along_axis(logprobs, ids, axis=-1)]


def now(logits: mx.array, tokens: mx.array, k: int) -> list[mx.array]:
    lazy = compute(logits, tokens, ["r"] * logits.shape[0], [k] * logits.shape[0])
    return lazy.arrays()


def median_ms(fn, logits: mx.array, tokens: mx.array, k: int) -> float:
    times = []
    for i in range(9):
        started = time.perf_counter()
        mx.eval(fn(logits, tokens, k))
        if i >= 2:
            times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def main() -> None:
    rng = np.random.default_rng(0)
    print("| shape [R, W] | before ms | now ms | ratio | values within 1e-5 |")
    print("|---|---:|---:|---:|---|")
    for rows, width in ((32, 1), (1, 256), (1, 1024)):
        logits = mx.array(rng.normal(size=(rows, width, VOCAB)).astype(np.float32) * 4)
        tokens = mx.array(rng.integers(0, VOCAB, size=(rows, width)).astype(np.int32))
        a, b = before(logits, tokens, 8), now(logits, tokens, 8)
        same = bool(mx.allclose(a[0], b[0], atol=1e-5)) and bool(
            mx.allclose(mx.sort(a[2], axis=-1), mx.sort(b[2], axis=-1), atol=1e-5)
        )
        t_before = median_ms(before, logits, tokens, 8)
        t_now = median_ms(now, logits, tokens, 8)
        print(f"| [{rows}, {width}] | {t_before:.2f} | {t_now:.2f} | "
              f"{t_before / t_now:.2f}x | {same} |")  # fmt: skip


if __name__ == "__main__":
    main()
