"""Where being ready to draft costs at c=8, T=1, on SmolLM2: every step of drafting off and of
the hybrid, side by side on the same prompts and seeds.

    PYTHONPATH=<repo> python trace_c8.py [workload ...] [--rounds N]

Runs the bench's c=8 cell (16 held-out mix prompts, 8 in flight, 32 tokens, seeded T=1) on two
engines, alternating rounds, and prints per engine: wall seconds, steps, the cadence summed by
kind of step (prefill in it / drafted (lookup, dflash) / plain), the plain steps' mean cadence
per batch size, drafter context rows written, and lookahead discards.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import sys
import time

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


def config(depth: int | None) -> EngineConfig:
    return EngineConfig(
        target=TARGET, drafter=str(default_drafter(TARGET)), max_num_seqs=8,
        max_waiting_requests=100_000, num_speculative_tokens=depth, prefix_cache_bytes=0,
    )  # fmt: skip


async def run_cell(eng: AsyncEngine, prompts: list[list[int]], seed0: int) -> float:
    gate = asyncio.Semaphore(8)

    async def one(i: int, prompt: list[int]) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=seed0 + i)
        async with gate:
            async for _ in eng.generate(prompt, params):
                pass

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start


def summary(name: str, walls: list[float], steps: list) -> None:
    kinds: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    plain_by_batch = collections.defaultdict(list)
    ctx_rows = discards = 0
    for s in steps:
        drafted = collections.Counter(o.source for o in s.outcomes.values() if o.drafted)
        kind = ("prefill" if s.prefill_tokens else
                "+".join(sorted(drafted)) if drafted else "plain")  # fmt: skip
        kinds[kind] += s.cadence_seconds
        counts[kind] += 1
        if kind == "plain" and s.cadence_seconds:
            plain_by_batch[s.batch_size].append(s.cadence_seconds)
        ctx_rows += s.draft_context_rows
        discards += s.discarded_seconds
    print(f"== {name}: wall {statistics.mean(walls):.2f} s/round {[round(w, 2) for w in walls]}")
    print("   steps by kind:", {k: (counts[k], round(kinds[k], 2)) for k in counts})
    by_batch = sorted(plain_by_batch.items())
    print(
        "   plain cadence ms by batch:",
        {b: (len(v), round(1e3 * statistics.median(v), 1)) for b, v in by_batch},
    )
    print(f"   drafter context rows {ctx_rows}, discarded {discards:.2f} s")
    if "--prefill" in sys.argv:
        for s in steps:
            if s.prefill_tokens:
                print(
                    "   prefill",
                    s.prefill_tokens,
                    s.batch_size,
                    round(1e3 * s.forward_seconds, 1),
                    round(1e3 * s.cadence_seconds, 1),
                    round(1e3 * s.step_seconds, 1),
                    {k: round(1e3 * v, 1) for k, v in s.phase_seconds.items()},
                )


async def main(workloads: list[str], rounds: int) -> None:
    engines = {"off": AsyncEngine(config(0)), "adaptive": AsyncEngine(config(None))}
    for eng in engines.values():
        await eng.start()
    try:
        for workload in workloads:
            prompts = cell_prompts(engines["off"].tokenizer, workload, 16, 384, "mix")
            walls = {n: [] for n in engines}
            steps = {n: [] for n in engines}
            for eng in engines.values():  # warm-up
                await run_cell(eng, prompts[:8], 999)
            for r in range(rounds):
                for n, eng in engines.items() if r % 2 == 0 else reversed(engines.items()):
                    hook = steps[n].append
                    eng.step_hooks.append(hook)
                    walls[n].append(await run_cell(eng, prompts, 1000 * r))
                    eng.step_hooks.remove(hook)
            print(f"# {workload}")
            for n in engines:
                summary(n, walls[n], steps[n])
    finally:
        for eng in engines.values():
            await eng.shutdown()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    asyncio.run(main([a for a in args if not a.isdigit()] or ["completion"], rounds))
