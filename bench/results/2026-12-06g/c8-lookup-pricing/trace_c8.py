"""SmolLM2 at c=8: every step's batch, prefill, guard arm and controller reason, per round.

    PYTHONPATH=<repo> python trace_c8.py SOURCES WORKLOADS ROUNDS [MAX_TOKENS]

SOURCES: `lookup`, `dflash`, or `all` (the engine's default); WORKLOADS: comma-separated, in
the bench's order (e.g. `chat,completion,editing`), 16 held-out mix prompts each. With
TRACE_CHOICES=N in the environment, the first N valued choices at 8 rows print their
candidates (extra positions, value, predicted cost)."""

import asyncio
import collections
import os
import sys

import engine  # noqa: F401
from bench.suite import cell_prompts
from engine import AsyncEngine, EngineConfig, SamplingParams
from scheduler.guard import DraftingGuard

CHOICES = int(os.environ.get("TRACE_CHOICES", "0"))


async def eng_one(eng, p):
    async for _ in eng.generate(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)):
        pass


async def main(sources, workload, rounds):
    extra = {} if sources == "all" else {"draft_sources": sources.split(",")}
    config = EngineConfig(target="smollm2-135m-instruct", prefix_cache_bytes=0, **extra)
    async with AsyncEngine(config) as eng:
        pol = eng._policy
        rows = []

        def hook(r):
            g = (
                pol.guard.arms.get(DraftingGuard.bucket(r.batch_size))
                if pol.guard and r.batch_size
                else None
            )
            matched = sum(1 for m in r.lookup_matches.values() if m)
            rows.append(
                (
                    r.batch_size,
                    r.prefill_tokens,
                    g.arm if g else "-",
                    pol.last_choice.get("reason"),
                    r.lookup_rows,
                    r.drafted_rows,
                    r.verify_tokens,
                    matched,
                    round(r.step_seconds * 1e3),
                )
            )

        eng.step_hooks.append(hook)
        dumps = []

        def dump(r):
            lc = pol.last_choice
            if (
                not r.prefill_tokens
                and r.batch_size == 8
                and "reason" not in lc
                and len(dumps) < CHOICES
                and len(rows) > 10
            ):
                dumps.append(1)
                cands = lc.get("candidates", [])
                print(
                    "CHOICE step",
                    len(rows),
                    "positions",
                    lc.get("positions"),
                    "lookahead_pending",
                    pol._lookahead_pending,
                    "discard_share",
                    round(pol.discard_share, 3),
                    "waiting",
                    pol._waiting,
                    "valuer",
                    pol._value_of is not None,
                )
                for e, v, c, d in cands[:12]:
                    print(
                        f"    extra {e:3d} value {v:7.3f} cost {c * 1e3:7.1f} ms "
                        f"rate {v / c:7.1f} dflash {d}"
                    )

        eng.step_hooks.append(dump)
        warm = cell_prompts(eng.tokenizer, "chat", 2, 384, "mix")
        await asyncio.gather(*[eng_one(eng, p) for p in warm])
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(sys.argv[4]) if len(sys.argv) > 4 else 32,
            ignore_eos=True,
        )
        gate = asyncio.Semaphore(8)

        async def one(p):
            async with gate:
                async for _ in eng.generate(p, params):
                    pass

        for wl in workload.split(","):
            prompts = cell_prompts(eng.tokenizer, wl, 16, 384, "mix")
            for rnd in range(rounds):
                print("==", wl, rnd)
                rows.clear()
                await asyncio.gather(*[one(p) for p in prompts])
                c = collections.Counter(
                    (b, bool(pf), arm, reason) for b, pf, arm, reason, *_ in rows
                )
                print(
                    f"round {rnd}: {len(rows)} steps; "
                    "decode steps by (batch, prefill, arm, reason):"
                )
                for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:12]:
                    print("   ", k, v)
                dec = [x for x in rows if not x[1]]
                print(
                    "  lookup rows drafted",
                    sum(x[4] for x in rows),
                    "rows with a match (sum over steps)",
                    sum(x[7] for x in rows),
                    "decode-only steps",
                    len(dec),
                    "median ms",
                    sorted(x[8] for x in dec)[len(dec) // 2] if dec else None,
                )
                print("  guard", pol.guard.state() if pol.guard else None, flush=True)
                print(
                    "  lookup prior",
                    [round(x, 2) for x in pol.lookup_acceptance.priors()["greedy"][:3]],
                    "probe",
                    pol._probe_interval,
                    "floor",
                    {s_: pol.probe_floor(s_) for s_ in ("dflash", "lookup")},
                    flush=True,
                )


asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
