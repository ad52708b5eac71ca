"""What process tuning (`engine/backend/process_tuning.py`) buys: fresh processes, tuned and
untuned.

    python bench/process_tuning.py [--target smollm2-135m-instruct] [--workload completion]
        [--concurrency 1] [--policy off|adaptive] [--requests 8] [--max-tokens 48] [--pairs 4]

The settings are process-wide and one-way (a heap that has grown stays grown), so they cannot
be compared inside one process. Each pair starts two fresh processes one after the other, one
with ``FLASHBATCH_PROCESS_TUNING=0`` and one without (the order alternates by pair); each loads
an `AsyncEngine`, serves the requests once to warm up, then `--runs` times, timing each run and
counting the minor page faults it took (`getrusage`). Reported: each side's median run time
and faults per run, and tuned/untuned throughput paired by pair (`bench/paired.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


async def _serve(args: argparse.Namespace) -> list[dict[str, float]]:
    """Child: load the engine, serve the requests `1 + runs` times; the runs after the first."""
    import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
    from bench.suite import cell_prompts
    from engine.async_engine import AsyncEngine
    from engine.bundled.pair import bundled_paths
    from engine.config import EngineConfig
    from engine.step.sampling import SamplingParams

    target, drafter = args.target, None
    if target is None:
        bundled_target, bundled_drafter = bundled_paths()
        target, drafter = str(bundled_target), str(bundled_drafter)
    config = EngineConfig(target=target, drafter=drafter, max_num_seqs=args.concurrency,
                          max_waiting_requests=100_000, prefix_cache_bytes=0,
                          num_speculative_tokens=0 if args.policy == "off" else None)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    runs = []
    async with AsyncEngine(config) as served:
        prompts = cell_prompts(served.tokenizer, args.workload, args.requests,
                               args.max_prompt_tokens,
                               "bundled" if args.target is None else "mix")  # fmt: skip
        gate = asyncio.Semaphore(args.concurrency)

        async def one(prompt: list[int]) -> int:
            async with gate:
                return sum([len(out.token_ids) async for out in served.generate(prompt, params)])

        for run in range(1 + args.runs):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            tokens = sum(await asyncio.gather(*[one(p) for p in prompts]))
            seconds = time.perf_counter() - started
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if run > 0:
                runs.append({"seconds": seconds, "tokens": tokens, "faults": faults})
    return runs


def _child_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, __file__, "--child", "--workload", args.workload,
               "--concurrency", str(args.concurrency), "--policy", args.policy,
               "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
               "--runs", str(args.runs),
               "--max-prompt-tokens", str(args.max_prompt_tokens)]  # fmt: skip
    return command + (["--target", args.target] if args.target else [])


def _one_process(args: argparse.Namespace, tuned: bool) -> list[dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), FLASHBATCH_PROCESS_TUNING="1" if tuned else "0")
    done = subprocess.run(_child_command(args), env=env, cwd=REPO, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="model name or directory (default: the bundled pair)")
    parser.add_argument("--workload", default="completion")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--policy", choices=("off", "adaptive"), default="off")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-prompt-tokens", type=int, default=384)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per process (2)")
    parser.add_argument("--pairs", type=int, default=4, help="tuned/untuned process pairs (4)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_serve(args))))
        return

    from bench.paired import paired_ratio

    rates: dict[bool, list[float]] = {True: [], False: []}
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for pair in range(args.pairs):
        for tuned in (True, False) if pair % 2 == 0 else (False, True):
            measured = _one_process(args, tuned)
            runs[tuned] += measured
            rates[tuned].append(statistics.median(r["tokens"] / r["seconds"] for r in measured))
            print(f"pair {pair} {'tuned' if tuned else 'untuned'}: "
                  + ", ".join(f"{r['seconds']:.2f} s {r['faults']} faults" for r in measured),
                  flush=True)  # fmt: skip
    print(f"\n{args.target or 'bundled'} {args.workload} c={args.concurrency} {args.policy}, "
          f"{args.requests} requests x {args.max_tokens} tokens, {args.pairs} pairs x "
          f"{args.runs} runs")  # fmt: skip
    print("| process | median run s | median faults/run |\n|---|---:|---:|")
    for tuned in (False, True):
        seconds = statistics.median(r["seconds"] for r in runs[tuned])
        faults = statistics.median(r["faults"] for r in runs[tuned])
        print(f"| {'tuned' if tuned else 'untuned'} | {seconds:.3f} | {faults:,.0f} |")
    ratio = paired_ratio(rates[True], rates[False])
    if ratio is not None:
        print(f"\ntuned / untuned throughput, paired by pair: {ratio.text()}")


if __name__ == "__main__":
    main()
