"""The never-slower guard's arms at c=1 on chat (DFlash only), request by request.

    PYTHONPATH=<repo> python guard_trace.py

Four rounds of the bench's four chat prompts (32 greedy tokens each) through one engine;
after each request: its tok/s and the guard's arm and smoothed speeds for batch size 1.
"""

import asyncio
import time

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

T = "smollm2-135m-instruct"


async def main():
    cfg = EngineConfig(
        target=T, drafter=str(default_drafter(T)), prefix_cache_bytes=0, draft_sources="dflash"
    )
    async with AsyncEngine(cfg) as eng:
        pol = eng._policy
        g = pol.guard
        log = []

        def hook(r):
            a = g.arms.get(0)
            if a is not None:
                log.append((a.arm, {k: round(v, 3) for k, v in a.speed.items()}, r.drafted_rows))

        eng.step_hooks.append(hook)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        prompts = cell_prompts(eng.tokenizer, "chat", 4, 384, "mix")
        for rnd in range(4):
            for p in prompts:
                t = time.perf_counter()
                async for _ in eng.generate(p, params):
                    pass
                print(rnd, round(32 / (time.perf_counter() - t), 1), log[-1] if log else None)
        print(g.state())


asyncio.run(main())
