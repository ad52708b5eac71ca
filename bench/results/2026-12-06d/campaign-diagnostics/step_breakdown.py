"""Where a DFlash drafting step's time goes on SmolLM2 at one request (2-core CPU).

    PYTHONPATH=<repo> python step_breakdown.py [workload]

One `ModelRunner` holding one workload prompt; 40 rounds of a plain step and steps drafting
1, 2 and 3 tokens, interleaved. Prints each kind's median forward seconds and, inside it, the
drafter's proposal (timed by wrapping `DFlashDrafter.propose` and evaluating its drafts,
which adds one sync). Then the bare mlx-lm model on 1, 2, 3, 4 and 8 query tokens at the same
context, with and without its LM head: what the verify's extra positions cost by themselves.
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from bench.engine_core import load_prompts
from bench.packed_step import _admit
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.models.resolve import resolve_target
from engine.step.runner import ModelRunner
from scheduler.plan import StepPlan

TARGET, DRAFTER = "smollm2-135m-instruct", "engine/models/smollm2_drafter"


def engine_steps(workload: str) -> None:
    tune_process_if_wanted()
    pair = load_pair(TARGET, DRAFTER)
    tune_for_backend(pair)
    runner = ModelRunner(pair.target, pair.drafter)
    ids = _admit(runner, load_prompts(pair.tokenizer, workload, 1))
    drafter, propose, proposals = pair.drafter, pair.drafter.propose, []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        drafts = propose(*args, **kwargs)
        mx.eval(drafts.tokens, drafts.probs)
        proposals.append(time.perf_counter() - t)
        return drafts

    drafter.propose = timed
    seconds: dict[str, list[tuple[float, float]]] = {}
    for _ in range(40):
        for name, depth in (("plain", 0), ("depth 1", 1), ("depth 2", 2), ("depth 3", 3)):
            before = len(proposals)
            out = runner.execute(StepPlan(depths={ids[0]: depth}))
            drafted = proposals[-1] if len(proposals) > before else 0.0
            seconds.setdefault(name, []).append((out.forward_seconds, drafted))
    print(f"engine step, 1 row, context {runner.cache[0].lengths[0]} tokens ({workload}):")
    for name, values in seconds.items():
        forward = statistics.median(v[0] for v in values)
        drafted = statistics.median(v[1] for v in values)
        print(
            f"  {name}: forward {1000 * forward:.1f} ms, of which proposal {1000 * drafted:.1f} ms"
        )


def bare_model(context: int = 535) -> None:
    model, _ = mlx_lm.load(str(resolve_target(TARGET)))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + context))]), cache=cache))

    def forward(tokens: int, head: bool) -> float:
        x = mx.array([[5] * tokens])
        t = time.perf_counter()
        mx.eval(model(x, cache=cache) if head else model.model(x, cache=cache))
        elapsed = time.perf_counter() - t
        for layer_cache in cache:
            layer_cache.trim(tokens)
        return elapsed

    print(f"bare mlx-lm model, context {context}:")
    for tokens in (1, 2, 3, 4, 8):
        with_head = statistics.median(forward(tokens, True) for _ in range(15))
        without = statistics.median(forward(tokens, False) for _ in range(15))
        print(f"  {tokens} tokens: {1000 * with_head:.1f} ms ({1000 * without:.1f} ms headless)")


if __name__ == "__main__":
    engine_steps(sys.argv[1] if len(sys.argv) > 1 else "completion")
    bare_model()
