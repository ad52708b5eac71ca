"""Replay the c=1 bench order (workloads outer, rounds inner) on one hybrid engine and print,
per request, the guard arm of its steps, the controller's reasons and what drafted."""

import argparse
import asyncio
import collections
import time

import engine  # noqa: F401
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams


async def main(args):
    config = EngineConfig(
        target=args.target, prefix_cache_bytes=0, drafting_guard=not args.unguarded
    )
    async with AsyncEngine(config) as eng:
        pol = eng._policy
        log = []

        def hook(r):
            g = pol.guard.arms.get(0) if pol.guard else None
            src = collections.Counter(o.source for o in r.outcomes.values() if o.drafted)
            acc = sum(o.accepted for o in r.outcomes.values())
            log.append(
                (
                    g.arm if g else "-",
                    pol.last_choice.get("reason"),
                    dict(src),
                    acc,
                    {k: round(v, 3) for k, v in g.speed.items()} if g else {},
                    g.gap if g else None,
                )
            )

        eng.step_hooks.append(hook)
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        warm = cell_prompts(eng.tokenizer, "chat", 2, 384, "mix")
        for p in warm:
            async for _ in eng.generate(
                p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            ):
                pass
        for workload in args.workloads.split(","):
            prompts = cell_prompts(eng.tokenizer, workload, 4, 384, "mix")
            for rnd in range(args.rounds):
                t0 = time.perf_counter()
                for i, p in enumerate(prompts):
                    log.clear()
                    s = time.perf_counter()
                    async for _ in eng.generate(p, params):
                        pass
                    dt = time.perf_counter() - s
                    arms = collections.Counter(a for a, *_ in log)
                    reasons = collections.Counter(str(x[1]) for x in log)
                    src = collections.Counter()
                    for x in log:
                        src.update(x[2])
                    acc = sum(x[3] for x in log)
                    print(
                        f"{workload:10s} r{rnd} q{i} {32 / dt:5.1f} tok/s arms {dict(arms)} "
                        f"reasons {dict(reasons)} "
                        f"drafted rows {dict(src)} acc {acc} guard {log[-1][4]} gap {log[-1][5]} "
                        f"probe {pol._probe_interval}",
                        flush=True,
                    )
                print(
                    f"{workload} round {rnd}: {128 / (time.perf_counter() - t0):.1f} tok/s",
                    flush=True,
                )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--unguarded", action="store_true")
    p.add_argument("--workloads", default="chat,completion,editing")
    p.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(p.parse_args()))
