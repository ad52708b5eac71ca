"""A plain decode step: flashbatch's `ModelRunner` against mlx-lm's `BatchGenerator`.

    python bench/plain_step.py [--target DIR] [--rows 8] [--temperature 1]
        [--workload prose] [--blocks 30] [--block 10] [--against batch-generator|held]
        [--drafter DIR|none]

Both decode the same `rows` workload prompts on the same loaded weights, one plain step per
row at a time (no drafting, no joins), in alternating blocks of `block` steps (the order
flips every block), so the host's drift falls on both alike. Reports each one's median step
and the paired ratio of step times, runner / BatchGenerator, per block (geometric mean, 90%
interval): what the engine's step costs beyond the forward both make, without the event loop.
The runner looks ahead as the engine does (`--no-lookahead` turns it off).

`--against held` compares instead a bare runner with one that holds every row's draft
sessions (the DFlash drafter's, fed each step's features, and a lookup index, extended each
step but not matched, as the engine plans a held step) and logs features for the prefix
cache (the engine's default), while every row decodes at depth 0: what a held adaptive
engine pays per step for being ready to draft. Defaults to the bundled pair.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import statistics
import time
from collections.abc import Callable

from bench.packed_step import _admit  # one prefill admits all
from bench.paired import paired_ratio
from drafters.lookup import LookupDrafter
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.bundled.pair import bundled_paths
from engine.config import EngineConfig
from engine.models.loading import load_pair, load_target_model
from engine.models.resolve import resolve_target
from engine.step.runner import ModelRunner
from engine.step.sampling import SamplingParams
from scheduler.plan import StepPlan


def runner_stepper(pair, prompts: list[list[int]], temperature: float, lookahead: bool,
                   held: bool = False) -> Callable[[], None]:  # fmt: skip
    """A `ModelRunner` holding `prompts` as decoding rows; the function runs one plain step.
    `held`: with the pair's drafter and a lookup index (the engine's defaults), unused."""
    lookup = None
    if held:
        defaults = EngineConfig(target="")
        lookup = LookupDrafter(defaults.lookup_min_ngram, defaults.lookup_max_ngram,
                               defaults.lookup_max_depth,
                               defaults.lookup_depth_per_match or None)  # fmt: skip
    runner = ModelRunner(pair.target, pair.drafter if held else None, lookup=lookup)
    runner.prefix_caching = True  # as the engine's default (it logs features with a drafter)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=temperature)
    ids = _admit(runner, prompts, params)

    def step() -> None:
        plan = StepPlan(depths={r: 0 for r in ids})
        plan.lookahead = lookahead
        plan.match_lookup = not held  # a held engine asks for no lookup match
        runner.execute(plan)

    return step


def batch_generator_stepper(model, prompts: list[list[int]], temperature: float):
    """mlx-lm `BatchGenerator` decoding `prompts` (prefilled first); one call, one step."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    generator = BatchGenerator(
        model, max_tokens=1 << 20, completion_batch_size=len(prompts),
        prefill_batch_size=min(len(prompts), 8), sampler=make_sampler(temp=temperature),
    )  # fmt: skip
    generator.insert(prompts, max_tokens=[1 << 20] * len(prompts))
    while len(generator.next_generated() or ()) < len(prompts):  # until every row decodes
        pass
    return generator, generator.next_generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(bundled_paths()[0]))
    parser.add_argument("--drafter", default=str(bundled_paths()[1]),
                        help="with --against held ('none': lookup drafting alone)")  # fmt: skip
    parser.add_argument("--against", choices=["batch-generator", "held"],
                        default="batch-generator")  # fmt: skip
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--workload", default="prose")
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    from bench.engine_core import load_prompts

    tune_process_if_wanted()  # the engine's process settings
    target = str(resolve_target(args.target))
    pair = load_pair(target, None)
    tune_for_backend(pair)  # what the engine runs on this backend
    prompts = load_prompts(pair.tokenizer, args.workload, args.rows)
    ours = runner_stepper(pair, prompts, args.temperature, args.lookahead)
    if args.against == "held":
        drafted = load_pair(target, None if args.drafter == "none" else args.drafter)
        tune_for_backend(drafted)
        generator, theirs = None, runner_stepper(drafted, prompts, args.temperature,
                                                 args.lookahead, held=True)  # fmt: skip
        other = "held runner"
    else:
        model, _ = load_target_model(target)  # mlx-lm's own copy, as `bench run` gives it
        generator, theirs = batch_generator_stepper(model, prompts, args.temperature)
        other = "BatchGenerator"
    for _ in range(5):  # warm-up
        ours(), theirs()
    seconds: dict[str, list[float]] = {"runner": [], "batch": []}
    for block in range(args.blocks):
        order = [("runner", ours), ("batch", theirs)]
        for name, step in order if block % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            for _ in range(args.block):
                step()
            seconds[name].append((time.perf_counter() - started) / args.block)
    if generator is not None:
        generator.close()
    # Step times paired per block: runner / BatchGenerator, or held runner / bare runner.
    slow, fast = ("batch", "runner") if args.against == "held" else ("runner", "batch")
    ratio = paired_ratio([1 / s for s in seconds[fast]], [1 / s for s in seconds[slow]])
    label = f"{other} / runner" if args.against == "held" else f"runner / {other}"
    print(f"{target}, {args.rows} rows, T={args.temperature:g}, {args.workload}, "
          f"lookahead {'on' if args.lookahead else 'off'}: step median runner "
          f"{statistics.median(seconds['runner']) * 1e3:.2f} ms, {other} "
          f"{statistics.median(seconds['batch']) * 1e3:.2f} ms; {label} "
          f"step time {ratio.text()} over {args.blocks} blocks of {args.block}")  # fmt: skip


if __name__ == "__main__":
    main()
