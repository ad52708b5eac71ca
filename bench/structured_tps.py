"""Constrained (json_schema) against unconstrained decoding, side by side in one process:
tok/s at each concurrency, and lookup's tau on the JSON answers.

    python bench/structured_tps.py [--target DIR] [--concurrency 1 8] [--requests 8]
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import json
import time

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.pull import pull
from engine.models.registry import DEFAULT_MODEL
from engine.step.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 32},
                      "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
}  # fmt: skip
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Quito", "Rome", "Seoul"]


async def run(eng, prompts, concurrency, structured) -> tuple[float, int, float]:
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i, prompt):
        async with semaphore:
            sp = SamplingParams(max_tokens=64, temperature=1.0, seed=i, structured=structured)
            last = None
            async for out in eng.generate(prompt, sp):
                last = out
            return last

    started = time.perf_counter()
    outs = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - started
    tokens = sum(o.completion_tokens for o in outs)
    steps = sum(o.verify_steps for o in outs)
    return tokens / seconds, tokens, tokens / max(steps, 1)


async def main(args) -> None:
    target = args.target or str(pull(DEFAULT_MODEL))
    config = EngineConfig(target=target, max_num_seqs=max(args.concurrency),
                          num_speculative_tokens=4, draft_sources=["lookup"])  # fmt: skip
    constrained = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
    async with AsyncEngine(config) as eng:
        tok = eng.tokenizer
        ask = "as JSON with city, country, population_millions and landmarks."
        questions = [f"Describe {CITIES[i % len(CITIES)]} {ask}" for i in range(args.requests)]
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True))
                   for q in questions]  # fmt: skip
        await run(eng, prompts[:2], 2, constrained)  # warm-up (tokenizer, kernels)
        print("| concurrency | unconstrained tok/s | constrained tok/s | ratio | tau (u / c) |")
        print("|---:|---:|---:|---:|---:|")
        for c in args.concurrency:
            free = await run(eng, prompts, c, None)
            bound = await run(eng, prompts, c, constrained)
            print(f"| {c} | {free[0]:.1f} | {bound[0]:.1f} | {bound[0] / free[0]:.2f} | "
                  f"{free[2]:.2f} / {bound[2]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=8)
    asyncio.run(main(parser.parse_args()))
