"""Step cost of per-request depth: one decoding batch, steps timed side by side.

    python bench/packed_step.py [--target DIR --drafter DIR] [--rows 32] [--rounds 15]
        [--workload completion]

Admits `rows` workload prompts into one `ModelRunner`, then interleaves, round after round,
a plain step (every row depth 0), a step where one row drafts 3 tokens and one where one row
drafts 1 (a depth-1 probe), each with the packed verify and with the padded one. Reports the
median and best forward seconds (drafter + verify + sampling up to the step's sync) of each
kind and its ratio to the plain step's. Defaults to the bundled pair.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import statistics

from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.bundled.pair import bundled_paths
from engine.models.loading import load_pair
from engine.step.runner import ModelRunner
from engine.step.sampling import SamplingParams
from scheduler.plan import Admission, PrefillChunk, StepPlan


def _admit(runner: ModelRunner, prompts: list[list[int]],
           params: SamplingParams | None = None) -> list[str]:  # fmt: skip
    """Admit and prefill `prompts` as rows r0, r1, ... in one step (greedy, endless unless
    `params` says otherwise); their ids."""
    params = params or SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    plan = StepPlan(
        admissions=[Admission(r, p, params) for r, p in zip(ids, prompts)],
        prefills=[PrefillChunk(r, 0, len(p), True) for r, p in zip(ids, prompts)],
    )
    runner.execute(plan)
    return ids


def main() -> None:
    target_dir, drafter_dir = bundled_paths()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(target_dir))
    parser.add_argument("--drafter", default=str(drafter_dir))
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--workload", default="completion")
    parser.add_argument("--row-padding", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    from bench.engine_core import load_prompts

    tune_process_if_wanted()  # the engine's process settings
    pair = load_pair(args.target, args.drafter)
    tune_for_backend(pair, row_padding=args.row_padding)  # what the engine runs on this backend
    runner = ModelRunner(pair.target, pair.drafter)
    prompts = load_prompts(pair.tokenizer, args.workload, args.rows)
    ids = _admit(runner, prompts)
    kinds = {
        "plain": {},
        "1 row depth 3": {ids[0]: 3},
        "1 row depth 1": {ids[0]: 1},
    }
    packed = runner.packed
    seconds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, depths in kinds.items():
            for verify, verifier in (("packed", packed), ("padded", None)):
                if name == "plain" and verify == "padded":
                    continue  # a plain step is the stock forward either way
                runner.packed = verifier
                result = runner.execute(StepPlan(depths={r: depths.get(r, 0) for r in ids}))
                label = name if name == "plain" else f"{name}, {verify}"
                seconds.setdefault(label, []).append(result.forward_seconds)
    runner.packed = packed
    context = statistics.mean(runner.cache[0].lengths)
    print(f"{args.rows} rows, mean context {context:.0f} tokens, {args.rounds} rounds")
    print_ratio_table("step", seconds)


def print_ratio_table(kind: str, seconds: dict[str, list[float]]) -> None:
    """Median and best milliseconds of each entry, and their ratios to `seconds["plain"]`'s.
    The best of the rounds is shown too: on a shared machine it is the least disturbed."""
    plain, plain_best = statistics.median(seconds["plain"]), min(seconds["plain"])
    print(f"| {kind} | median ms | / plain | best ms | / plain |\n|---|---:|---:|---:|---:|")
    for label, values in seconds.items():
        median, best = statistics.median(values), min(values)
        print(
            f"| {label} | {1000 * median:.1f} | {median / plain:.2f}x "
            f"| {1000 * best:.1f} | {best / plain_best:.2f}x |"
        )


if __name__ == "__main__":
    main()
