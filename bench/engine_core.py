"""Engine-core benchmark: flashbatch against mlx-lm's BatchGenerator, side by side in one run.

    python bench/engine_core.py [--target DIR --drafter DIR] [--workload completion]
        [--concurrency 1,4,8,16] [--depths 0,3,7,15] [--rounds 3] [--max-tokens 64]

For each concurrency C, `requests` prompts of the workload are served with at most C in flight
(closed loop), greedy, by: mlx-lm `BatchGenerator` (completion batch C), flashbatch with drafting
off (depth 0) and at each fixed depth. Rounds interleave the engines and the table reports
medians of aggregate output tokens/s and each one's ratio to BatchGenerator. At concurrency 1
the engine is also compared with the single-request reference loop (`engine.speculative`).
Defaults to the bundled pair and its code-completion workload.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import statistics
import time
from pathlib import Path

import mlx.core as mx


def load_prompts(tokenizer, workload: str, count: int) -> list[list[int]]:
    from engine.bundled.workloads import load_workloads

    texts = load_workloads()[workload]
    return [list(tokenizer.encode(t)) for t in (texts * (count // len(texts) + 1))[:count]]


def run_batch_generator(
    model, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> float:
    """Aggregate tokens/s of mlx-lm's continuous batching, closed loop at `concurrency`."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(
        model, max_tokens=max_tokens, completion_batch_size=concurrency,
        prefill_batch_size=min(concurrency, 8), prefill_step_size=256,
    )  # fmt: skip
    queue = list(prompts)
    in_flight = 0
    produced = 0
    started = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            generator.insert([queue.pop(0)], max_tokens=[max_tokens])
            in_flight += 1
        for response in generator.next_generated():
            produced += 1
            if response.finish_reason is not None:
                in_flight -= 1
    elapsed = time.perf_counter() - started
    generator.close()
    return produced / elapsed


async def run_flashbatch(
    flashbatch, prompts: list[list[int]], concurrency: int, max_tokens: int, depth: int
) -> tuple[float, float]:
    """Aggregate tokens/s and tau of the engine, closed loop at `concurrency`."""
    from engine.sampling import SamplingParams

    gate = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=depth)
    produced = committed = steps = 0

    async def one(prompt: list[int]) -> None:
        nonlocal produced, committed, steps
        async with gate:
            async for out in flashbatch.generate(prompt, params):
                produced += len(out.token_ids)
            committed += out.completion_tokens - 1  # the first token comes from the prefill
            steps += out.verify_steps

    started = time.perf_counter()
    await asyncio.gather(*[one(p) for p in prompts])
    elapsed = time.perf_counter() - started
    return produced / elapsed, (committed / steps if steps else 0.0)


def run_oracle(pair, prompts: list[list[int]], max_tokens: int, depth: int) -> float:
    from engine.sampling import SamplingParams
    from engine.speculative import generate

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=depth)
    produced = 0
    started = time.perf_counter()
    for prompt in prompts:
        produced += len(generate(pair.target, prompt, params, drafter=pair.drafter).token_ids)
    return produced / (time.perf_counter() - started)


async def main_async(args: argparse.Namespace) -> str:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.loading import load_pair

    pair = load_pair(args.target, args.drafter)  # for mlx-lm and the reference loop
    prompts = load_prompts(pair.tokenizer, args.workload, args.requests)
    config = EngineConfig(
        target=str(args.target), drafter=str(args.drafter), max_num_seqs=max(args.concurrency),
        max_waiting_requests=10_000,
    )  # fmt: skip
    rows = []
    async with AsyncEngine(config) as eng:
        for concurrency in args.concurrency:
            samples: dict[str, list[float]] = {"BatchGenerator": []}
            taus: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                samples["BatchGenerator"].append(
                    run_batch_generator(pair.target.model, prompts, concurrency, args.max_tokens)
                )
                for depth in args.depths:
                    rate, tau = await run_flashbatch(
                        eng, prompts, concurrency, args.max_tokens, depth
                    )
                    samples.setdefault(f"flashbatch d={depth}", []).append(rate)
                    taus.setdefault(f"flashbatch d={depth}", []).append(tau)
                if concurrency == 1:
                    depth = max(args.depths)
                    rate = run_oracle(pair, prompts[: args.oracle_requests], args.max_tokens, depth)
                    samples.setdefault(f"reference loop d={depth}", []).append(rate)
                mx.clear_cache()
            base = statistics.median(samples["BatchGenerator"])
            for name, values in samples.items():
                rate = statistics.median(values)
                tau = statistics.median(taus[name]) if name in taus else float("nan")
                rows.append((concurrency, name, rate, rate / base, tau))
            print(f"concurrency {concurrency} done", flush=True)
    lines = [
        f"workload {args.workload}, {args.requests} requests x {args.max_tokens} tokens, greedy, "
        f"median of {args.rounds} interleaved rounds",
        "",
        "| concurrency | engine | tokens/s | vs BatchGenerator | tau |",
        "|---:|---|---:|---:|---:|",
    ]
    for concurrency, name, rate, ratio, tau in rows:
        lines.append(f"| {concurrency} | {name} | {rate:.1f} | {ratio:.2f}x | {tau:.2f} |")
    return "\n".join(lines)


def main() -> None:
    from engine.bundled.pair import bundled_paths

    target, drafter = bundled_paths()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--target", type=Path, default=target)
    parser.add_argument("--drafter", type=Path, default=drafter)
    parser.add_argument("--workload", default="completion")
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16]
    )
    parser.add_argument(
        "--depths", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3, 7, 15]
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--oracle-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args()
    table = asyncio.run(main_async(args))
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
