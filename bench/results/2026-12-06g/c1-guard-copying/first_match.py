import engine  # noqa
import asyncio
from engine import AsyncEngine, EngineConfig, SamplingParams
from bench.suite import cell_prompts


async def main():
    async with AsyncEngine(
        EngineConfig(target="smollm2-135m-instruct", prefix_cache_bytes=0)
    ) as eng:
        seen = {}

        def hook(r):
            for rid in r.first_tokens:
                seen[rid] = r.lookup_matches.get(rid)

        eng.step_hooks.append(hook)
        for kind in ("chat", "completion", "editing", "prose"):
            prompts = cell_prompts(eng.tokenizer, kind, 16, 384, "mix")
            ms = []
            for i, p in enumerate(prompts):
                rid = f"{kind}{i}"
                async for _ in eng.generate(
                    p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id=rid
                ):
                    pass
                ms.append(seen.get(rid))
            print(kind, ms, flush=True)


asyncio.run(main())
