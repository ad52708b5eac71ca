"""One DFlash proposal for one session at c=1 (SmolLM2's drafter): two committed rows written,
then a block of 1 + depth rows, timed to its sync; median of 30 after a 40-row context.

    PYTHONPATH=. python bench/results/2026-12-07f/c1-step-costs/propose.py
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import asyncio
import statistics
import time

import mlx.core as mx

from engine import AsyncEngine, EngineConfig
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


async def main() -> None:
    config = EngineConfig(target=TARGET, drafter=str(default_drafter(TARGET)))
    async with AsyncEngine(config) as eng:
        drafter = eng._runner.drafter
        width = drafter.model.fc.weight.shape[1]  # the tapped features' width
        session = drafter.open([1] * 40)
        drafter.commit(session, mx.random.normal((40, width)), [1] * 40)
        drafter.propose([session], [5], [2])
        for depth in (1, 2, 4):
            seconds = []
            for _ in range(30):
                drafter.commit(session, mx.random.normal((2, width)), [1, 2])
                mx.eval(session.pending)
                start = time.perf_counter()
                drafts = drafter.propose([session], [5], [depth])
                cache = [a for layer in drafter.cache for a in layer.state]
                mx.eval(drafts.tokens, drafts.probs, cache)
                seconds.append(time.perf_counter() - start)
            print(f"depth {depth}: propose {1e3 * statistics.median(seconds):.2f} ms "
                  f"(best {1e3 * min(seconds):.2f})")  # fmt: skip


asyncio.run(main())
