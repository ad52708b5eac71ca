"""What a request's first DFlash draft costs at c=1 on SmolLM2: the prompt's context rows written.

    PYTHONPATH=<repo> python catchup.py [--workload chat] [--requests 6]

Per held-out mix prompt, one after another on one `ModelRunner`: admit and prefill it, run a
plain step, then a depth-1 step (its first draft: the drafter writes the prompt's feature rows
into its context first), then five more depth-1 steps, then a plain one; prints the prompt's
length and the forward milliseconds of each, so the first draft's excess over the later ones
is the catch-up's cost (ms a row).
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse

from bench.suite import cell_prompts
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.models.resolve import default_drafter, resolve_target
from engine.step.runner import ModelRunner
from engine.step.sampling import SamplingParams
from scheduler.plan import Admission, PrefillChunk, StepPlan

TARGET = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument(
        "--sit-out",
        default="0",
        help="plain steps before the first draft, per request (comma list, cycled)",
    )
    args = parser.parse_args()
    tune_process_if_wanted()
    pair = load_pair(resolve_target(TARGET), default_drafter(TARGET))
    tune_for_backend(pair)
    runner = ModelRunner(pair.target, pair.drafter)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    prompts = cell_prompts(pair.tokenizer, args.workload, args.requests, 384, "mix")
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        runner.execute(StepPlan(admissions=[Admission(rid, prompt, params)],
                                prefills=[PrefillChunk(rid, 0, len(prompt), True)]))  # fmt: skip
        sit_out = [int(x) for x in args.sit_out.split(",")]
        ms = [
            runner.execute(StepPlan(depths={rid: 0})).forward_seconds
            for _ in range(1 + sit_out[i % len(sit_out)])
        ][-1:]
        ms += [runner.execute(StepPlan(depths={rid: 1})).forward_seconds for _ in range(6)]
        ms.append(runner.execute(StepPlan(depths={rid: 0})).forward_seconds)
        first, later = ms[1], sorted(ms[2:7])[2]
        print(
            f"sat out {sit_out[i % len(sit_out)]:2d}, prompt {len(prompt):4d}: "
            f"plain {1e3 * ms[0]:.1f}, first draft {1e3 * first:.1f}, "
            f"later drafts {1e3 * later:.1f} (median) -> catch-up "
            f"{1e3 * (first - later) / len(prompt):.3f} ms a row"
        )
        runner.execute(StepPlan(removals=[rid]))


if __name__ == "__main__":
    main()
