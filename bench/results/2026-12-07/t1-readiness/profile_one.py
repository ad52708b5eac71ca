"""One engine at c=8, T=1 (completion, 16 prompts, 3 rounds), for a profiler:

PYTHONPATH=<repo> py-spy record -r 250 --format raw -o OUT -- python profile_one.py adaptive|off
"""

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import trace_c8

from bench.suite import cell_prompts
from engine import AsyncEngine


async def main(depth):
    eng = AsyncEngine(trace_c8.config(depth))
    await eng.start()
    prompts = cell_prompts(eng.tokenizer, "completion", 16, 384, "mix")
    await trace_c8.run_cell(eng, prompts[:8], 999)
    steps = []
    eng.step_hooks.append(steps.append)
    t = time.perf_counter()
    for r in range(3):
        await trace_c8.run_cell(eng, prompts, 1000 * r)
    print("wall", time.perf_counter() - t)
    plain = sorted(
        s.cadence_seconds
        for s in steps
        if s.batch_size == 8 and not s.prefill_tokens and s.cadence_seconds
    )
    print("plain b8 median", plain[len(plain) // 2])
    await eng.shutdown()


asyncio.run(main(None if sys.argv[1] == "adaptive" else 0))
