"""Where a c=1 step's time goes in the engine loop: drafting off against DFlash at a fixed depth.

    PYTHONPATH=<repo> python loop_trace.py [workload] [depth]

Four held-out mix prompts, 32 greedy tokens each, one request at a time, on two engines (off,
fixed DFlash depth); per engine the medians over decode steps of the loop's cadence, the
runner's step (`step_seconds`), its forward and commit phases, and the loop's own share
(cadence - step), split by whether the step drafted.
"""

from __future__ import annotations

import asyncio
import statistics
import sys

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


async def main(workload: str, depth: int) -> None:
    for name, d in (("off", 0), (f"dflash depth {depth}", depth), ("off", 0)):
        config = EngineConfig(
            target=TARGET, drafter=str(default_drafter(TARGET)), prefix_cache_bytes=0,
            num_speculative_tokens=d, draft_sources="dflash",
        )  # fmt: skip
        async with AsyncEngine(config) as eng:
            steps = []
            params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            prompts = cell_prompts(eng.tokenizer, workload, 4, 384, "mix")
            async for _ in eng.generate(prompts[0], params):  # warm-up
                pass
            eng.step_hooks.append(steps.append)
            for prompt in prompts:
                async for _ in eng.generate(prompt, params):
                    pass
        for drafted in (False, True):
            sel = [s for s in steps if not s.prefill_tokens and s.cadence_seconds
                   and bool(s.drafted_rows or s.lookup_rows) == drafted]  # fmt: skip
            if not sel:
                continue

            def med(f, sel=sel):
                return round(1e3 * statistics.median(f(s) for s in sel), 2)

            tokens = statistics.mean(1 + sum(o.accepted for o in s.outcomes.values()) for s in sel)
            print(
                f"{name:>16} {'drafted' if drafted else 'plain':>8} n={len(sel):3d}: "
                f"cadence {med(lambda s: s.cadence_seconds)} "
                f"step {med(lambda s: s.step_seconds)} "
                f"forward {med(lambda s: s.forward_seconds)} commit "
                f"{med(lambda s: s.phase_seconds.get('commit', 0))} loop "
                f"{med(lambda s: s.cadence_seconds - s.step_seconds)} tokens {tokens:.2f}"
            )


if __name__ == "__main__":
    asyncio.run(
        main(
            sys.argv[1] if len(sys.argv) > 1 else "chat",
            int(sys.argv[2]) if len(sys.argv) > 2 else 1,
        )
    )
