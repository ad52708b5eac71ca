"""Where an engine's time goes under a serving load: every step, by kind, without HTTP.

    python bench/step_trace.py --target bundled --policy adaptive [--sources lookup]
        [--requests 64] [--trace]

Runs `--requests` prompts of a workload (default: the `bench serve` load, raw-code completion
prompts, 32 in flight, 64 tokens each, greedy) through one `AsyncEngine` after a two-request
warm-up, and prints the wall time, the time between steps (the event loop's share), and, per
kind of step (plain or drafting, with or without a prefill chunk), the
steps' count, total and median seconds, mean batch, prefill tokens and verify positions.
`--trace` prints every step: batch, verify positions, lookup and DFlash rows, prefill tokens,
committed tokens, the forward's time and the controller's prediction of it.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import collections
import statistics
import time

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter


def _kind(result) -> str:
    drafting = result.verify_tokens > result.batch_size
    return ("prefill+" if result.prefill_tokens else "") + ("draft" if drafting else "plain")


async def run(args: argparse.Namespace) -> None:
    from bench.suite import cell_prompts

    cache = {} if args.prefix_cache else {"prefix_cache_bytes": 0}  # 0: as `bench run`
    sources = {} if args.sources is None else {"draft_sources": args.sources.split(",")}
    drafter = default_drafter(args.target)  # what `bench run` serves: the shipped drafter
    config = EngineConfig(
        target=args.target, drafter=str(drafter) if drafter else None,
        drafting_guard=args.policy != "unguarded", **sources, **cache,
    )  # fmt: skip
    if args.policy == "off":
        config = EngineConfig(
            target=args.target, num_speculative_tokens=0, draft_sources=[], **cache
        )
    async with AsyncEngine(config) as eng:
        steps: list = []
        eng.step_hooks.append(steps.append)
        if args.trace:
            eng.step_hooks.append(lambda r: print(_trace_line(r, eng)))
        # The prompts `bench run` sends: the bundled workloads on the bundled pair, the
        # chat-model mix on a real target, each cut to its last --max-prompt-tokens.
        prompt_set = "bundled" if args.target == "bundled" else "mix"
        texts = cell_prompts(
            eng.tokenizer, args.workload, args.requests, args.max_prompt_tokens, prompt_set
        )
        gate = asyncio.Semaphore(args.concurrency)
        params = SamplingParams(
            temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True
        )

        async def one(i: int) -> None:
            async with gate:
                async for _ in eng.generate(texts[i % len(texts)], params):
                    pass

        await asyncio.gather(*[one(i) for i in range(2)])  # warm-up
        steps.clear()
        started = time.perf_counter()
        await asyncio.gather(*[one(i) for i in range(args.requests)])
        wall = time.perf_counter() - started
        inside = sum(r.step_seconds for r in steps)
        print(f"wall {wall:.2f} s, {len(steps)} steps, {wall - inside:.2f} s between steps")
        # The plain step looked ahead (pipelined: built while the last one computed) after how
        # many steps, and how many such lookaheads a drafting choice threw away.
        ahead = sum(r.looked_ahead for r in steps)
        thrown = sum(1 for r in steps if r.discarded_seconds)
        print(f"looked ahead after {ahead} of {len(steps)} steps, {thrown} thrown away")
        kinds = collections.defaultdict(list)
        for result in steps:
            kinds[_kind(result)].append(result)
        guard = eng.depth_policy_state().get("guard")
        if guard is not None:  # the adaptive controller's verdicts per batch octave
            print(f"guard {guard}")
        for kind, rs in kinds.items():
            print(
                f"{kind:14s} n={len(rs):4d} total {sum(r.step_seconds for r in rs):6.2f} s  "
                f"median {1e3 * statistics.median(r.step_seconds for r in rs):7.1f} ms  "
                f"batch {statistics.mean(r.batch_size for r in rs):5.1f}  "
                f"prefill tok {sum(r.prefill_tokens for r in rs)}  "
                f"verify {sum(r.verify_tokens for r in rs)}"
            )


def _trace_line(result, eng) -> str:
    predicted = getattr(eng._policy, "last_choice", {}).get("predicted") or 0.0
    tokens = sum(len(o.tokens) for o in result.outcomes.values())
    return (
        f"B={result.batch_size:2d} verify={result.verify_tokens:3d} "
        f"dflash_rows={result.drafted_rows:2d} lookup_rows={result.lookup_rows:2d} "
        f"prefill={result.prefill_tokens:4d} tokens={tokens:3d} "
        f"forward={1e3 * result.forward_seconds:6.1f} ms "
        f"cadence={1e3 * result.cadence_seconds:6.1f} ms predicted={1e3 * predicted:6.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="bundled")
    parser.add_argument("--policy", choices=["adaptive", "unguarded", "off"], default="adaptive")
    parser.add_argument(
        "--sources", default=None, help="draft sources, e.g. lookup (default: all served)"
    )
    parser.add_argument("--workload", default="completion", help="completion, editing, prose")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument(
        "--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
        help="the engine's prefix cache (bench run turns it off)",
    )  # fmt: skip
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
