"""Drafter training data from the target itself, generated in batches through `AsyncEngine`.

The single-request `train.generate_data` decodes one prompt at a time; a real target on a CPU
makes that hours per 100k tokens. Here `concurrency` requests decode together (drafting off) and
each finished one is appended to a JSONL file at once, so an interrupted run loses at most the
requests in flight and the next run skips every prompt already done (by key).

Records: ``{"key", "kind", "prompt", "chat", "prompt_tokens", "tokens"}`` with tokens = prompt +
continuation, the layout `train.load_sequences` reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from drafters.dflash.prompt_mix import Prompt
from drafters.dflash.train import read_jsonl_records

log = logging.getLogger(__name__)


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A chat prompt in the target's chat template; raw text otherwise, and for a base model
    whose tokenizer has no template (gemma-3-270m), which reads every prompt as text."""
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt.text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt.text))


def done_keys(path: Path) -> set[str]:
    return {r["key"] for r in read_jsonl_records(path) if "key" in r}


def shortest_first_by_window(
    items: list[Prompt], ids_of: Callable[[Prompt], list[int]], window: int
) -> Iterator[tuple[Prompt, list[int]]]:
    """`items` with their token ids, window by window (in their order), each window's
    shortest first; ids are made a window at a time, as the consumer reaches it.

    The rows decoding together then have contexts of similar length: a decode step's
    attention runs every row to the longest row's length, and the mix's prompts run from ~40
    tokens (chat) to ~950 (completion). A window of a few hundred keeps the kinds interleaved
    as the mix has them, so a run stopped early still leaves every kind its share."""
    window = max(1, window)  # 0 or 1: in order
    for start in range(0, len(items), window):
        chunk = items[start : start + window]
        ids = [ids_of(item) for item in chunk]
        for i in sorted(range(len(chunk)), key=lambda i: len(ids[i])):
            yield chunk[i], ids[i]


async def generate_mix(
    target: str,
    prompts: list[Prompt],
    out_path: str | Path,
    *,
    max_tokens: dict[str, int] | int = 192,
    concurrency: int = 32,
    max_prompt_tokens: int = 1536,
    temperature: float = 0.0,
    length_window: int = 256,
) -> int:
    """Append the target's continuation of every prompt not yet in `out_path`; return how many.
    Prompts go in `length_window`s, each shortest first (`shortest_first_by_window`; 0 or
    1: in order)."""
    from engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.step.sampling import SamplingParams

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = done_keys(out_path)
    todo = [p for p in dict.fromkeys(prompts) if p.key not in done]
    log.info("%d prompts, %d done, %d to generate", len(prompts), len(done), len(todo))
    # Adaptive drafting by prompt lookup (no drafter exists yet): greedy output is lossless, so
    # the data is the same, and the editing kinds (mostly copies) generate several times faster.
    config = EngineConfig(
        target=target, max_num_seqs=concurrency, num_speculative_tokens=None,
        draft_sources=["lookup"], max_waiting_requests=max(256, 2 * concurrency),
    )  # fmt: skip
    written = 0
    tokens_out = 0
    start = time.perf_counter()
    async with AsyncEngine(config) as engine:

        def ids_of(prompt: Prompt) -> list[int]:
            return encode(engine.tokenizer, prompt)[-max_prompt_tokens:]

        # One source for every worker (no await inside it, so no two workers step it at once).
        source = shortest_first_by_window(todo, ids_of, length_window)
        with out_path.open("a") as out:

            async def worker() -> None:
                nonlocal written, tokens_out
                for prompt, ids in source:
                    limit = max_tokens if isinstance(max_tokens, int) else max_tokens[prompt.kind]
                    params = SamplingParams(max_tokens=limit, temperature=temperature)
                    generated: list[int] = []
                    async for delta in engine.generate(ids, params):
                        generated += delta.token_ids
                    record = {
                        "key": prompt.key, "kind": prompt.kind, "prompt": prompt.text,
                        "chat": prompt.chat, "prompt_tokens": len(ids), "tokens": ids + generated,
                    }  # fmt: skip
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    written += 1
                    tokens_out += len(generated)
                    if written % 50 == 0:
                        rate = tokens_out / (time.perf_counter() - start)
                        log.info("%d/%d written, %d tokens (%.1f tok/s)", written, len(todo),
                                 tokens_out, rate)  # fmt: skip

            await asyncio.gather(*(worker() for _ in range(concurrency)))
    return written


DEFAULT_MAX_TOKENS = {"completion": 128, "editing": 256, "chat": 192, "prose": 128}


def main(argv: list[str] | None = None) -> int:
    """`python -m drafters.dflash.datagen --target T --out F [--split train] [--per-kind N]`."""
    import argparse

    import engine  # noqa: F401  (fast BLAS before mlx)
    from drafters.dflash.prompt_mix import build_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target model (directory, .gguf or name)")
    parser.add_argument("--out", required=True, help="JSONL to append to (resumes)")
    parser.add_argument("--split", default="train", choices=("train", "held_out"))
    parser.add_argument("--per-kind", type=int, default=2000, help="prompts of each kind")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--length-window", type=int, default=256,
        help="prompts a window, each window shortest first (0: in order)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    prompts = build_prompts(args.split, args.per_kind, args.seed)
    written = asyncio.run(
        generate_mix(
            args.target,
            prompts,
            args.out,
            max_tokens=DEFAULT_MAX_TOKENS,
            concurrency=args.concurrency,
            length_window=args.length_window,
        )  # fmt: skip
    )
    print(f"wrote {written} records to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
