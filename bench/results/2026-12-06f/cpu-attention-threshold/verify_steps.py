"""A verify step's attention on MLX's fused op or on the CPU kernels (SmolLM2, one request).

    PYTHONPATH=<repo> python verify_steps.py [workload] [rounds]

One `ModelRunner` row holding one workload prompt (the shipped DFlash drafter attached), a
plain step and steps drafting 1, 2 and 3 tokens, each under the old limit for several-query
attention on MLX's fused op (2**14 scores) and the new one (2**12), interleaved round by
round. Prints each kind's median forward ms under both and their ratio.
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import statistics
import sys

from bench.engine_core import load_prompts
from bench.packed_step import _admit
from engine.backend import cpu_kernels
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.step.runner import ModelRunner
from scheduler.plan import StepPlan

LIMITS = {"old 2**14": 1 << 14, "new 2**12": 1 << 12}


def main(workload: str, rounds: int) -> None:
    tune_process_if_wanted()
    pair = load_pair("smollm2-135m-instruct", "engine/models/smollm2_drafter")
    tune_for_backend(pair)
    runner = ModelRunner(pair.target, pair.drafter)
    ids = _admit(runner, load_prompts(pair.tokenizer, workload, 1))
    seconds: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for limit_name, limit in LIMITS.items():
            cpu_kernels._FUSED_SCORES_QUERIES = limit
            for depth in (0, 1, 2, 3):
                out = runner.execute(StepPlan(depths={ids[0]: depth}))
                seconds.setdefault((limit_name, depth), []).append(out.forward_seconds)
    context = runner.cache[0].lengths[0]
    print(f"{workload}: 1 row, context about {context} tokens, {rounds} rounds, median forward ms")
    for depth in (0, 1, 2, 3):
        old, new = (statistics.median(seconds[(name, depth)]) * 1000 for name in LIMITS)
        print(f"  depth {depth}: old {old:.1f}  new {new:.1f}  new/old {new / old:.3f}")


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "completion",
        int(sys.argv[2]) if len(sys.argv) > 2 else 40,
    )
