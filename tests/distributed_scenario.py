"""One distributed-mode scenario, run on every rank by `mlx.launch` (or alone, for the
single-process reference): `python tests/distributed_scenario.py SPEC.json OUT.json`.

Rank 0 (or the lone process) runs the engine through the public API and writes what it saw to
OUT.json; other ranks follow (`engine.distributed.rank.serve_follower`). Used by
`tests/test_distributed.py`, which compares the two runs token for token.

SPEC keys: target, drafter (or null), parallel (null: one process), draft_sources,
num_speculative_tokens, prompts (token ids), max_tokens, seeded (adds a sampled round),
abort (adds a round that aborts half its requests mid-stream, then drains).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
from engine import AsyncEngine, EngineConfig, SamplingParams


async def _generate(engine_: AsyncEngine, prompt: list[int], params: SamplingParams) -> dict:
    tokens: list[int] = []
    drafted: dict[str, int] = {}
    async for out in engine_.generate(prompt, params):
        tokens += out.token_ids
        for source, n in out.drafted_by_source.items():
            drafted[source] = drafted.get(source, 0) + n
    return {"tokens": tokens, "drafted": drafted}


async def _abort_round(engine_: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Half the requests are aborted after their first tokens; the rest run to the end."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    finished: dict[str, str | None] = {}

    async def one(i: int, prompt: list[int]) -> None:
        request_id, stream = engine_.add_request(prompt, params)
        seen = 0
        async for out in engine_.outputs(request_id, stream):
            seen += len(out.token_ids)
            if i % 2 and seen >= 3 and not out.finished:
                engine_.abort(request_id)
            if out.finished:
                finished[str(i)] = out.finish_reason

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return finished


async def run(spec: dict) -> dict:
    config = EngineConfig(
        target=spec["target"], drafter=spec.get("drafter"), max_num_seqs=8,
        parallel=spec.get("parallel"), draft_sources=spec.get("draft_sources"),
        num_speculative_tokens=spec.get("num_speculative_tokens"),
        prefix_cache_bytes=spec.get("prefix_cache_bytes", 512 << 20),
    )  # fmt: skip
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out: dict = {}
    async with AsyncEngine(config) as engine_:
        out["c1"] = [await _generate(engine_, p, greedy) for p in prompts[:2]]
        out["c8"] = await asyncio.gather(*(_generate(engine_, p, greedy) for p in prompts))
        if spec.get("seeded"):
            sampled = [SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95,
                                      seed=100 + i, ignore_eos=True)
                       for i in range(len(prompts))]  # fmt: skip
            out["seeded"] = await asyncio.gather(
                *(_generate(engine_, p, s) for p, s in zip(prompts, sampled))
            )
        if spec.get("abort"):
            out["aborted"] = await _abort_round(engine_, prompts, max_tokens * 4)
        runner = engine_._runner
    # After the shutdown: the finished rows' removal runs as the engine's last step.
    out["rows_left"] = len(runner.rows)
    out["kv_bytes_left"] = runner.kv_bytes
    return out


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as file:
        spec = json.load(file)
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    if spec.get("parallel"):
        from engine import is_leader, serve_follower

        if not is_leader():  # the public API's way: every other rank follows rank 0
            return serve_follower()
    result = asyncio.run(run(spec))
    with open(out_path, "w") as file:
        json.dump(result, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
