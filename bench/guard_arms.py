"""Adaptive against drafting off at one concurrency, round by round, split by the guard's arm.

    python bench/guard_arms.py [--workload editing] [--rounds 6] [--concurrency 32]
        [--requests 64] [--max-tokens 128] [--warmup short|full]

Two `AsyncEngine`s on the bundled pair in one process, drafting off and adaptive, serve the
same closed-loop load in alternating rounds (the order flips every round), as `bench run`
does but without clearing MLX's buffer cache between runs. Per round it prints each engine's
wall and plain-step median, and the adaptive engine's plain steps split by the guard's arm
for the batch size they ran at (free: the controller may draft; held: parked): what holding
draft sessions costs a plain step (held against off), what the controller's free arm adds
(free against held), and how many steps each arm took. `--warmup short` warms each engine
with two 4-token requests (as `bench run`); `full` with one round of the load, so the guard
has settled before anything is measured.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import statistics
import time

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.bundled.pair import bundled_paths
from scheduler.guard import DraftingGuard


def _config(off: bool, concurrency: int) -> EngineConfig:
    target, drafter = bundled_paths()
    return EngineConfig(
        target=str(target), drafter=str(drafter), max_num_seqs=concurrency,
        max_waiting_requests=100_000, num_speculative_tokens=0 if off else None,
        prefix_cache_bytes=0,  # as `bench run`: prompts repeat across rounds
    )  # fmt: skip


def _plain(result) -> bool:
    return not result.prefill_tokens and result.verify_tokens == result.batch_size


def _median_ms(seconds: list[float]) -> str:
    return f"{1e3 * statistics.median(seconds):5.1f} ms" if seconds else "    -   "


async def _serve(eng: AsyncEngine, texts: list[str], args: argparse.Namespace,
                 requests: int, max_tokens: int) -> float:  # fmt: skip
    gate = asyncio.Semaphore(args.concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(i: int) -> None:
        async with gate:
            async for _ in eng.generate(texts[i % len(texts)], params):
                pass

    started = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(requests)])
    return time.perf_counter() - started


async def run(args: argparse.Namespace) -> None:
    from bench.suite import workload_texts

    texts = workload_texts(args.workload)
    engines = {"off": AsyncEngine(_config(True, args.concurrency)),
               "adaptive": AsyncEngine(_config(False, args.concurrency))}  # fmt: skip
    steps: dict[str, list[tuple[object, str]]] = {name: [] for name in engines}
    walls: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for name, eng in engines.items():
            await eng.start()

            guard = getattr(eng.scheduler.policy, "guard", None)

            def record(result, name=name, guard=guard) -> None:
                # The arm of the step's batch-size octave, read after the step's observe
                # (straight from the guard: building the policy's state dict every step would
                # charge the adaptive engine's loop for it).
                arms = guard.arms.get(DraftingGuard.bucket(result.batch_size)) if guard else None
                steps[name].append((result, arms.arm if arms is not None else "-"))

            eng.step_hooks.append(record)
            if args.warmup == "full":
                await _serve(eng, texts, args, args.requests, args.max_tokens)
            else:
                await _serve(eng, texts, args, 2, 4)
        for round_index in range(args.rounds):
            order = list(engines) if round_index % 2 == 0 else list(engines)[::-1]
            for name in order:
                steps[name].clear()
                wall = await _serve(engines[name], texts, args, args.requests, args.max_tokens)
                walls[name].append(wall)
                plain = [(r.step_seconds, arm) for r, arm in steps[name] if _plain(r)]
                drafting = sum(1 for r, _ in steps[name] if r.verify_tokens > r.batch_size)
                line = (f"round {round_index} {name:8s} wall {wall:6.2f} s, plain steps "
                        f"{len(plain):4d} median {_median_ms([s for s, _ in plain])}")  # fmt: skip
                if name == "adaptive":
                    for arm in ("free", "held"):
                        of_arm = [s for s, a in plain if a == arm]
                        line += f"; {arm} {len(of_arm):4d} median {_median_ms(of_arm)}"
                    line += f"; drafting steps {drafting}"
                print(line, flush=True)
    finally:
        for eng in engines.values():
            await eng.shutdown()
    ratios = [off / adaptive for off, adaptive in zip(walls["off"], walls["adaptive"])]
    print(f"adaptive / off throughput per round: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"all rounds {sum(walls['off']) / sum(walls['adaptive']):.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="editing", help="completion, editing, prose")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--warmup", choices=["short", "full"], default="short")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
