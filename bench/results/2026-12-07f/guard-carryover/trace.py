"""One engine serves 16 chat requests, then 16 completion requests, at c=1 (SmolLM2 with its
DFlash drafter); during the completion ones, every planned step is counted by whether the
never-slower guard held it, whether the row had a lookup match, and what was chosen.

    PYTHONPATH=. python bench/results/2026-12-07f/guard-carryover/trace.py dflash,lookup
    PYTHONPATH=. python bench/results/2026-12-07f/guard-carryover/trace.py lookup
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import asyncio
import collections
import sys

from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


async def main(sources: str) -> None:
    config = EngineConfig(
        target=TARGET, drafter=str(default_drafter(TARGET)),
        draft_sources=sources.split(","), prefix_cache_bytes=0,
    )  # fmt: skip
    async with AsyncEngine(config) as eng:
        params = SamplingParams(max_tokens=32, ignore_eos=True)

        async def serve(workload: str) -> None:
            for prompt in cell_prompts(eng.tokenizer, workload, 16, 384, "mix"):
                async for _ in eng.generate(prompt, params):
                    pass

        await serve("chat")
        state = eng.depth_policy_state()
        print("after chat: guard", state["guard"], "lookup prior", state["lookup_prior"])
        scheduler, policy = eng.scheduler, eng._policy
        plan_step, counts = scheduler.plan, collections.Counter()

        def counted_plan(*args, **kwargs):
            plan = plan_step(*args, **kwargs)
            held = policy.holds_drafting(len(scheduler.running))
            match = any(r.lookup_match for r in scheduler.running)
            drafted = sorted(set(plan.sources.values()))
            why = sorted(set(scheduler.last_parked.values())) if not drafted else []
            chosen = "drafts " + "+".join(drafted) if drafted else "plain"
            key = ("held" if held else "free", "match" if match else "no match", chosen)
            counts[key + (",".join(why),)] += 1
            return plan

        scheduler.plan = counted_plan
        await serve("completion")
        for key, n in counts.most_common():
            print(n, key)
        print("after completion: guard", eng.depth_policy_state()["guard"])


asyncio.run(main(sys.argv[1]))
