"""Second chat turn's time to first token, with and without the prefix cache.

    python bench/prefix_ttft.py [--target DIR --drafter DIR] [--history-tokens 1500]
        [--rounds 3] [--prefix-cache-bytes 268435456]

A conversation's first turn sends a long history (code files of the bundled workloads joined
into one user message) and gets an answer; the second turn resends history, answer and a new
question through the chat template, as chat clients do. Each round uses a fresh history, so
only the second turn can hit the cache. The same engine configuration runs with the cache off
and on, rounds interleaved; the table gives the median TTFT of the second turn (arrival to
its first token, through `AsyncEngine`) and the ratio on/off.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import statistics
import time


def histories(tokenizer, tokens: int, rounds: int) -> list[str]:
    """`rounds` distinct histories of about `tokens` tokens each."""
    from engine.bundled.workloads import load_workloads

    files = load_workloads()["completion"]
    out = []
    for r in range(rounds):
        parts, count, i = [], 0, r
        while count < tokens:
            text = files[i % len(files)]
            parts.append(text)
            count += len(tokenizer.encode(text))
            i += rounds
        out.append("\n\n".join(parts))
    return out


async def second_turn_ttft(engine_, history: str, answer_tokens: int) -> tuple[float, int, int]:
    from engine import SamplingParams

    tokenizer = engine_.tokenizer
    messages = [{"role": "user", "content": "Review this code:\n" + history}]
    first = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0)
    answer = []
    async for out in engine_.generate(first, params):
        answer += out.token_ids
    while not engine_.idle:  # the first turn's entry is saved before the second turn arrives
        await asyncio.sleep(0.005)
    messages += [
        {"role": "assistant", "content": tokenizer.decode(answer)},
        {"role": "user", "content": "Now add type hints to the first function."},
    ]
    second = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    started = time.perf_counter()
    async for out in engine_.generate(second, SamplingParams(max_tokens=1, temperature=0.0)):
        ttft = time.perf_counter() - started
        cached = out.cached_tokens
    return ttft, len(second), cached


async def run(args: argparse.Namespace) -> None:
    from engine import AsyncEngine, EngineConfig
    from engine.bundled.pair import bundled_paths

    target, drafter = args.target, args.drafter
    if target is None:
        bundled_target, bundled_drafter = bundled_paths()
        target, drafter = str(bundled_target), drafter or str(bundled_drafter)
    engines = {}
    for name, budget in (("off", 0), ("on", args.prefix_cache_bytes)):
        config = EngineConfig(target=target, drafter=drafter, prefix_cache_bytes=budget)
        engines[name] = AsyncEngine(config)
        await engines[name].start()
    try:
        texts = histories(engines["off"].tokenizer, args.history_tokens, args.rounds + 1)
        samples: dict[str, list[float]] = {"off": [], "on": []}
        for r, text in enumerate(texts):
            for name, engine_ in engines.items():
                ttft, prompt, cached = await second_turn_ttft(engine_, text, args.answer_tokens)
                if r:  # round 0 warms both engines up
                    samples[name].append(ttft)
                    print(f"round {r} cache {name}: second turn {prompt} tokens, "
                          f"{cached} cached, TTFT {ttft * 1000:.1f} ms")  # fmt: skip
    finally:
        for engine_ in engines.values():
            await engine_.shutdown()
    off, on = (statistics.median(samples[k]) for k in ("off", "on"))
    print()
    print("| prefix cache | median TTFT, second turn (ms) |")
    print("|---|---:|")
    print(f"| off | {off * 1000:.1f} |")
    print(f"| on | {on * 1000:.1f} |")
    print(f"| on / off | {on / off:.3f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("--history-tokens", type=int, default=1500)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-cache-bytes", type=int, default=256 << 20)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
