"""The adaptive controller's choices at c=1 on SmolLM2 (DFlash only), traced lightly.

    PYTHONPATH=<repo> python light_trace.py [workload] [guard|noguard]

`c1-run-pricing/trace_run.py` priced candidates inside its step hook; that Python ran on the
loop after every step, overlapped by a plain step's lookahead but not by a drafting step, so it
made drafting steps look ~20 ms dearer than they are. Here the hook only keeps references
(the result, the policy's last choice, the entry price), and the summary comes after the run.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


async def main(workload: str, guard: bool) -> None:
    config = EngineConfig(
        target=TARGET, drafter=str(default_drafter(TARGET)), prefix_cache_bytes=0,
        drafting_guard=guard, draft_sources="dflash",
    )  # fmt: skip
    async with AsyncEngine(config) as eng:
        pol = eng._policy
        rows = []

        def hook(r) -> None:
            rows.append((r, pol.last_choice.get("candidates"), pol._lookahead_pending,
                         pol.entry_price(1), pol.catchup_row_seconds))  # fmt: skip

        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        prompts = cell_prompts(eng.tokenizer, workload, 4, 384, "mix")
        async for _ in eng.generate(prompts[0], params):  # warm-up, as the bench does
            pass
        eng.step_hooks.append(hook)
        for _round in range(2):
            for prompt in prompts:
                start = time.perf_counter()
                async for _ in eng.generate(prompt, params):
                    pass
                print("request", round(32 / (time.perf_counter() - start), 1), "tok/s")
        decode = [x for x in rows if x[0].batch_size and not x[0].prefill_tokens]
        drafted = [x for x in decode if x[0].drafted_rows]
        tokens = [1 + sum(o.accepted for o in x[0].outcomes.values()) for x in drafted]
        print(
            f"decode steps {len(decode)}, drafted {len(drafted)}, tokens/drafted step "
            f"{statistics.mean(tokens or [0]):.2f}"
        )
        plain = [x for x in decode if not x[0].drafted_rows]
        for label, sel in (("plain", plain), ("drafted", drafted)):
            cad = [x[0].cadence_seconds for x in sel if x[0].cadence_seconds]
            print(f"{label}: cadence median {1e3 * statistics.median(cad):.1f} ms")
        for r, cands, pending, entry, catchup in decode:
            c = [(d, round(t, 2), round(1e3 * s, 1)) for d, t, s, *_ in (cands or [])[:3]]
            print(
                f"{'D' if r.drafted_rows else '.'} cad {1e3 * r.cadence_seconds:5.1f} "
                f"acc {sum(o.accepted for o in r.outcomes.values())} pending {pending:d} "
                f"entry {1e3 * entry:5.1f} catchup {1e3 * catchup:.3f} {c}"
            )
        state = pol.state()
        keys = ("prior", "cost_plain", "cost_extra", "exit_seconds", "discard_share", "run_length")
        for key in keys:
            print(key, state.get(key))


if __name__ == "__main__":
    asyncio.run(
        main(
            sys.argv[1] if len(sys.argv) > 1 else "chat",
            (sys.argv[2] if len(sys.argv) > 2 else "guard") == "guard",
        )
    )
