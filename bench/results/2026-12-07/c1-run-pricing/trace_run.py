"""Trace the controller's DFlash choices at c=1 on SmolLM2, step by step.

    PYTHONPATH=<repo> python trace_run.py [guard|noguard] [chat|completion|editing]

Runs four held-out mix prompts of the workload (32 tokens each, greedy) one after another
through an engine drafting from DFlash only, and prints per step: the drafter's learned
seconds per backlog row and its extra-cost price of one position (ms), the verify positions,
cadence and forward (ms), what drafted and was accepted, the first three candidates
(extra positions, expected tokens, predicted seconds, drafter forward?), whether the last
step drafted, whether a lookahead is pending, the entry price (ms), the parked-step count
and the request's first three acceptance estimates. Then the policy's learned state.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


async def main(guard: bool, workload: str) -> None:
    config = EngineConfig(
        target=TARGET, drafter=str(default_drafter(TARGET)), prefix_cache_bytes=0,
        drafting_guard=guard, draft_sources="dflash",
    )  # fmt: skip
    async with AsyncEngine(config) as eng:
        pol = eng._policy
        rows = []

        def hook(r) -> None:
            lc = pol.last_choice
            src = collections.Counter(o.source for o in r.outcomes.values() if o.drafted)
            rid = next(iter(r.outcomes), "")
            rows.append((
                round(pol.catchup_row_seconds * 1e3, 3),
                round(pol.cost.extra_pricer(1, True)(1) * 1e3, 1),
                r.verify_tokens, round(r.cadence_seconds * 1e3, 1),
                round(r.forward_seconds * 1e3, 1), dict(src),
                sum(o.accepted for o in r.outcomes.values()),
                [tuple(round(x, 4) if isinstance(x, float) else x for x in c)
                 for c in (lc.get("candidates") or [])[:3]],
                pol._drafted_last, pol._lookahead_pending,
                round(pol.entry_price(1) * 1e3, 1), pol._steps_parked,
                [round(x, 2) for x in pol.acceptance.estimate(rid)[:3]],
            ))  # fmt: skip

        eng.step_hooks.append(hook)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        for prompt in cell_prompts(eng.tokenizer, workload, 4, 384, "mix"):
            start = time.perf_counter()
            async for _ in eng.generate(prompt, params):
                pass
            print("request", round(32 / (time.perf_counter() - start), 1), "tok/s")
        for row in rows:
            print(row)
        state = pol.state()
        for key in ("prior", "cost_plain", "cost_extra", "exit_seconds", "discard_share"):
            print(key, state.get(key))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] == "guard", sys.argv[2] if len(sys.argv) > 2 else "chat"))
