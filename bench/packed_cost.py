"""What one drafting row costs a batch, on any target (no drafter needed).

    python bench/packed_cost.py --target smollm2-135m-instruct --rows 32 [--rounds 12]

Admits `rows` held-out editing prompts of the chat mix into one `ModelRunner`, then interleaves,
round after round, forwards over the same cache: a plain step (the stock forward, every row one
position), the packed verify with one row verifying 1 + depth positions (depth 3; depth 1, a
probe; depth 7; depth 0, the packed forward of a plain step; and depth 3 for every row) and
the padded verify of depth 3 for every row. Each forward's own positions
are rolled back, so every round sees the same cache. Prints median and best milliseconds and
ratios to the plain step. `bench/packed_step.py` times whole engine steps with a DFlash drafter.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import statistics
import time

import mlx.core as mx

from bench.packed_step import _admit, print_ratio_table  # one prefill admits all
from drafters.dflash.datagen import encode
from drafters.lookup import LookupDrafter
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.step.packed import PackedLayout
from engine.step.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--row-padding", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    from bench.suite import mix_prompts

    tune_process_if_wanted()  # the engine's process settings
    pair = load_pair(args.target, None)
    tune_for_backend(pair, row_padding=args.row_padding)  # what the engine runs on this backend
    runner = ModelRunner(pair.target, None, lookup=LookupDrafter())  # lookup: packed verify on
    if runner.packed is None:
        raise SystemExit(f"{args.target}: no packed verify for this architecture")
    prompts = [encode(pair.tokenizer, p) for p in mix_prompts("editing")]
    _admit(runner, (prompts * args.rows)[: args.rows])
    cache, B = runner.cache, args.rows

    def stock(width: int) -> None:  # every row `width` positions (width 1: a plain step)
        logits, _ = pair.target(mx.zeros((B, width), dtype=mx.int32), cache)
        mx.eval(mx.argmax(logits, axis=-1))
        for c in cache:
            c.trim_rows([width] * B)

    def packed(widths: list[int]) -> None:
        layout = PackedLayout.build(widths, list(cache[0].lengths))
        logits, _ = runner.packed(mx.zeros((layout.total,), dtype=mx.int32), layout, cache)
        mx.eval(mx.argmax(logits, axis=-1))
        for c in cache:
            c.trim_rows(widths)

    kinds = {"plain": lambda: stock(1), "plain, packed": lambda: packed([1] * B)}
    for depth in (3, 1, 7):
        kinds[f"1 row depth {depth}, packed"] = lambda d=depth: packed([1 + d] + [1] * (B - 1))
    for depth in (1, 3):
        kinds[f"every row depth {depth}, packed"] = lambda d=depth: packed([1 + d] * B)
        kinds[f"every row depth {depth}, padded"] = lambda d=depth: stock(1 + d)
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for name, forward in kinds.items():
            started = time.perf_counter()
            forward()
            seconds[name].append(time.perf_counter() - started)
    context = statistics.mean(cache[0].lengths)
    print(f"{args.target}: {B} rows, mean context {context:.0f} tokens, {args.rounds} rounds")
    print_ratio_table("forward", seconds)


if __name__ == "__main__":
    main()
