"""What OpenBLAS's thread count does to one forward, by size (the CPU backend).

    python bench/blas_threads.py --target smollm2-135m-instruct [--rows 1,8,32] [--rounds 8]

Times, interleaved round after round at each thread count (1 and the library's own): a decode
step of `rows` rows over a 160-token context (the stock forward, `RaggedKVCache`) and a
512-token prefill. Single forwards in turn; `bench/step_trace.py` with
``FLASHBATCH_BLAS_THREADS`` set and unset measures whole engine steps, which is what decides.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import os
import statistics
import time

import mlx.core as mx

from engine.backend.blas_threads import THREADS_ENV_VAR, blas_threads
from engine.models.loading import load_target_model
from engine.step.kv_cache import RaggedKVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault(THREADS_ENV_VAR, "1")  # any count: the control is what is needed
    control = blas_threads()
    if control is None:
        raise SystemExit(
            "no OpenBLAS thread control in this process (see engine/backend/blas_threads.py)"
        )
    model, _ = load_target_model(args.target)
    layers = len(model.model.layers)
    forwards = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        cache = [RaggedKVCache(rows) for _ in range(layers)]
        mx.eval(model(mx.random.randint(0, 1000, (rows, 160)), cache=cache))
        token = mx.zeros((rows, 1), dtype=mx.int32)

        def step(cache=cache, token=token, rows=rows) -> None:
            mx.eval(mx.argmax(model(token, cache=cache)[:, -1], axis=-1))
            for c in cache:
                c.trim_rows([1] * rows)

        forwards[f"decode, {rows} rows"] = step
    prompt = mx.random.randint(0, 1000, (1, 512))
    forwards["prefill, 512 tokens"] = lambda: mx.eval(model.model(prompt))
    counts = sorted({1, control.default})
    seconds = {(name, n): [] for name in forwards for n in counts}
    for _ in range(args.rounds):
        for name, forward in forwards.items():
            for n in counts:
                control.use(n)
                forward()  # one untimed: the count's first call may start threads
                started = time.perf_counter()
                forward()
                seconds[(name, n)].append(time.perf_counter() - started)
    print(f"{args.target}, {args.rounds} rounds, median ms by OpenBLAS threads")
    print("| forward | " + " | ".join(f"{n} thread{'s' * (n > 1)}" for n in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    for name in forwards:
        cells = [f"{1e3 * statistics.median(seconds[(name, n)]):.1f}" for n in counts]
        print(f"| {name} | " + " | ".join(cells) + " |")
    control.restore()


if __name__ == "__main__":
    main()
