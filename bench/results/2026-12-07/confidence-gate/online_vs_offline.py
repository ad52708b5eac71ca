"""Does the served drafter accept as often as the offline measure says it should?

    PYTHONPATH=<repo> python online_vs_offline.py rows.npz [--kind completion] [--records 6]

For the eval set's first records of a kind: serve each prompt greedily through the engine at a
fixed DFlash depth of 1 (the engine's output is the record's own continuation, checked), and
compare, step by step, whether the served draft was accepted with whether the drafter's argmax
hit at the same anchor offline (`study.py`'s rows: the same weights, the target's features from
one whole-sequence forward).
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)
from drafters.dflash import evalset
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rows")
    parser.add_argument("--kind", default="completion")
    parser.add_argument("--records", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    data = np.load(args.rows)
    records = evalset.read_evalset(evalset.evalset_path(TARGET))
    config = EngineConfig(target=TARGET, drafter=str(default_drafter(TARGET)), prefix_cache_bytes=0,
                          num_speculative_tokens=1, draft_sources="dflash")  # fmt: skip
    online, offline, same = [], [], 0
    async with AsyncEngine(config) as eng:
        for index, record in enumerate(records):
            if record["kind"] != args.kind:
                continue
            if args.records <= 0:
                break
            args.records -= 1
            prompt = record["tokens"][: record["prompt_tokens"]]
            hits = data["hits"][data["records"] == index][:, 0]
            steps = []
            eng.step_hooks.append(steps.append)
            out = []
            params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
            async for chunk in eng.generate(prompt, params):
                out += chunk.token_ids
            eng.step_hooks.remove(steps.append)
            want = record["tokens"][record["prompt_tokens"] :][: len(out)]
            same += out == want
            generated = 0
            for s in steps:
                for o in s.outcomes.values():
                    if o.drafted and generated < len(hits):
                        online.append(o.accepted)
                        offline.append(bool(hits[generated]))
                    generated += len(o.tokens)
                if s.first_tokens:
                    generated += 1
    online, offline = np.array(online), np.array(offline)
    print(f"{args.kind}: {same} of the outputs equal the records; {len(online)} drafted steps")
    print(
        f"accepted online {online.mean():.3f}, offline hit at the same anchors {offline.mean():.3f}"
    )
    print(
        f"both {np.mean(online & offline):.3f}, online only {np.mean(online & ~offline):.3f}, "
        f"offline only {np.mean(~online.astype(bool) & offline):.3f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
