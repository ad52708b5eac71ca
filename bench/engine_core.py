"""Engine benchmark: flashbatch policies against mlx-lm's BatchGenerator, side by side in one run.

    python bench/engine_core.py [--target DIR --drafter DIR] [--workload completion]
        [--concurrency 1,4,8,16] [--policies off,3,7,15,adaptive] [--rounds 3]
        [--max-tokens 64] [--temperature 0] [--no-batch-generator] [--reference-loop]

For each concurrency C, `requests` prompts of the workload ("mixed" = half editing, half prose)
are served with at most C in flight (closed loop) by mlx-lm `BatchGenerator` (completion batch
C) and by one flashbatch engine per policy: `off` (drafting off), a fixed depth, or `adaptive`.
Rounds interleave the engines; the table reports medians of aggregate output tokens/s, each
one's ratio to BatchGenerator and to flashbatch with drafting off, and tau. With
`--reference-loop`, concurrency 1 also runs the single-request reference loop.
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

    workloads = load_workloads()
    if workload == "mixed":
        texts = [t for pair in zip(workloads["editing"], workloads["prose"]) for t in pair]
    else:
        texts = workloads[workload]
    return [list(tokenizer.encode(t)) for t in (texts * (count // len(texts) + 1))[:count]]


def run_batch_generator(
    model, prompts: list[list[int]], concurrency: int, max_tokens: int, temperature: float
) -> float:
    """Aggregate tokens/s of mlx-lm's continuous batching, closed loop at `concurrency`."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    generator = BatchGenerator(
        model, max_tokens=max_tokens, completion_batch_size=concurrency,
        prefill_batch_size=min(concurrency, 8), prefill_step_size=256,
        sampler=make_sampler(temp=temperature),
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
    flashbatch, prompts: list[list[int]], concurrency: int, max_tokens: int, temperature: float
) -> tuple[float, float]:
    """Aggregate tokens/s and tau of the engine, closed loop at `concurrency`."""
    from engine.step.sampling import SamplingParams

    gate = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
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
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=depth)
    produced = 0
    started = time.perf_counter()
    for prompt in prompts:
        produced += len(generate(pair.target, prompt, params, drafter=pair.drafter).token_ids)
    return produced / (time.perf_counter() - started)


def _policy_config(args: argparse.Namespace, policy: str, max_concurrency: int):
    from engine.config import EngineConfig

    depth = None if policy == "adaptive" else 0 if policy == "off" else int(policy)
    return EngineConfig(
        target=str(args.target), drafter=str(args.drafter), max_num_seqs=max_concurrency,
        max_waiting_requests=10_000, num_speculative_tokens=depth,
        prefix_cache_bytes=0,  # rounds repeat the prompts: hits would measure the cache
    )  # fmt: skip


async def main_async(args: argparse.Namespace) -> str:
    from engine.async_engine import AsyncEngine
    from engine.models.loading import load_pair

    pair = load_pair(args.target, args.drafter)  # for mlx-lm and the reference loop
    prompts = load_prompts(pair.tokenizer, args.workload, args.requests)
    engines = {}
    for policy in args.policies:
        engines[policy] = AsyncEngine(_policy_config(args, policy, max(args.concurrency)))
        await engines[policy].start()
    rows = []
    try:
        # Warm-up (not measured): first calls allocate buffers and build caches.
        warm = prompts[: max(2, max(args.concurrency))]
        if args.batch_generator:
            run_batch_generator(pair.target.model, warm, max(args.concurrency), 8, args.temperature)
        for eng in engines.values():
            await run_flashbatch(eng, warm, max(args.concurrency), 8, args.temperature)
        for concurrency in args.concurrency:
            samples: dict[str, list[float]] = {}
            taus: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                if args.batch_generator:
                    rate = run_batch_generator(pair.target.model, prompts, concurrency,
                                               args.max_tokens, args.temperature)  # fmt: skip
                    samples.setdefault("BatchGenerator", []).append(rate)
                for policy, eng in engines.items():
                    rate, tau = await run_flashbatch(
                        eng, prompts, concurrency, args.max_tokens, args.temperature
                    )
                    samples.setdefault(f"flashbatch {policy}", []).append(rate)
                    taus.setdefault(f"flashbatch {policy}", []).append(tau)
                if concurrency == 1 and args.reference_loop:
                    rate = run_oracle(pair, prompts[: args.oracle_requests], args.max_tokens, 15)
                    samples.setdefault("reference loop d=15", []).append(rate)
                mx.clear_cache()
            medians = {name: statistics.median(v) for name, v in samples.items()}
            base = medians.get("BatchGenerator")
            off = medians.get("flashbatch off")
            for name, rate in medians.items():
                tau = statistics.median(taus[name]) if name in taus else float("nan")
                rows.append((concurrency, name, rate, base, off, tau))
            print(f"concurrency {concurrency} done", flush=True)
    finally:
        for eng in engines.values():
            await eng.shutdown()
    lines = [
        f"workload {args.workload}, {args.requests} requests x {args.max_tokens} tokens, "
        f"temperature {args.temperature}, median of {args.rounds} interleaved rounds",
        "",
        "| concurrency | engine | tokens/s | vs BatchGenerator | vs drafting off | tau |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for concurrency, name, rate, base, off, tau in rows:
        vs_base = f"{rate / base:.2f}x" if base else "-"
        vs_off = f"{rate / off:.2f}x" if off else "-"
        lines.append(f"| {concurrency} | {name} | {rate:.1f} | {vs_base} | {vs_off} | {tau:.2f} |")
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
    parser.add_argument("--policies", type=lambda s: s.split(","), default="off,3,7,15,adaptive")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-batch-generator", dest="batch_generator", action="store_false")
    parser.add_argument("--reference-loop", action="store_true")
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
