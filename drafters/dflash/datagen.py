"""Drafter training data from the target itself, generated in batches through `AsyncEngine`.

The single-request `train.generate_data` decodes one prompt at a time; a real target on a CPU
makes that hours per 100k tokens. Here `concurrency` requests decode together (drafting off) and
each finished one is appended to a JSONL file at once, so an interrupted run loses at most the
requests in flight and the next run skips every prompt already done (by key).

Records: ``{"key", "kind", "prompt", "chat", "prompt_tokens", "tokens"}`` with tokens = prompt +
continuation, the layout `train.load_sequences` reads.

With `features_dir`, each record's target features and top-k next-token log-probabilities are
kept as it is generated (`features.FeatureSidecar`), from the very forwards that generated it:
the engine serves DFlash (whose drafter sets the taps) with `keep_features`, and every request
asks its prompt's and its tokens' top-k. The campaign's feature pass then copies them instead
of running the target over the record a second time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from drafters.dflash.features import FeatureSidecar
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
    features_dir: str | Path | None = None,
    drafter: str | Path | None = None,
    top_k: int = 8,
    max_len: int | None = None,
) -> int:
    """Append the target's continuation of every prompt not yet in `out_path`; return how many.
    Prompts go in `length_window`s, each shortest first (`shortest_first_by_window`; 0 or
    1: in order). With `features_dir` (and the `drafter` whose taps to keep), each record's
    features and top-`top_k` go there too (see the module's docstring), for its first
    `max_len` tokens where given (the campaign trains on records cut so: their features are
    those of the whole record's first positions, the target being causal)."""
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
    keeping = features_dir is not None
    if keeping and drafter is None:
        raise ValueError("features_dir needs the drafter whose taps to keep")
    config = EngineConfig(
        target=target, max_num_seqs=concurrency, num_speculative_tokens=None,
        draft_sources=["dflash", "lookup"] if keeping else ["lookup"],
        drafter=str(drafter) if keeping else None, keep_features=keeping,
        max_waiting_requests=max(256, 2 * concurrency),
    )  # fmt: skip
    written = 0
    tokens_out = 0
    start = time.perf_counter()
    async with AsyncEngine(config) as engine:
        keeper = None
        if keeping:
            sidecar = FeatureSidecar(Path(features_dir), target, engine.feature_taps, top_k)
            keeper = FeatureKeeper(sidecar, max_len)
            engine.step_hooks.append(keeper.on_step)

        def ids_of(prompt: Prompt) -> list[int]:
            return encode(engine.tokenizer, prompt)[-max_prompt_tokens:]

        # One source for every worker (no await inside it, so no two workers step it at once).
        source = shortest_first_by_window(todo, ids_of, length_window)
        with out_path.open("a") as out:

            async def worker() -> None:
                nonlocal written, tokens_out
                for prompt, ids in source:
                    limit = max_tokens if isinstance(max_tokens, int) else max_tokens[prompt.kind]
                    wanted = top_k if keeper is not None else None
                    # Lookup drafts only, as without kept features: DFlash is served for its
                    # taps, and a request that may not draft from it opens no session.
                    params = SamplingParams(max_tokens=limit, temperature=temperature,
                                            logprobs=wanted, prompt_logprobs=wanted,
                                            draft_sources=["lookup"])  # fmt: skip
                    request_id = f"datagen-{prompt.key}"
                    generated: list[int] = []
                    prompt_tops: list = []
                    tops: list = []
                    async for delta in engine.generate(ids, params, request_id):
                        generated += delta.token_ids
                        prompt_tops += delta.prompt_logprobs or []
                        tops += delta.logprobs or []
                    if keeper is not None:
                        await keeper.keep(request_id, ids + generated, prompt_tops + tops)
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


class FeatureKeeper:
    """Each finished request's released features (a step hook) and its log-probabilities,
    joined into one sidecar file."""

    def __init__(self, sidecar: FeatureSidecar, max_len: int | None = None) -> None:
        self.sidecar = sidecar
        self.max_len = max_len  # rows kept for a record's first max_len tokens (None: all)
        self._released: dict[str, np.ndarray] = {}
        self._arrived: dict[str, asyncio.Event] = {}
        self.kept = self.missed = 0

    def _event(self, request_id: str) -> asyncio.Event:
        return self._arrived.setdefault(request_id, asyncio.Event())

    def on_step(self, result) -> None:  # noqa: ANN001 (scheduler.plan.StepResult)
        for request_id, features in result.released_features.items():
            self._released[request_id] = features
            self._event(request_id).set()

    async def keep(self, request_id: str, tokens: list[int], logprobs: list) -> None:
        """Write the sequence's sidecar once its row has left the batch (the step after its
        last token). `logprobs`: its prompt's entries (the first None), then its tokens'."""
        await self._event(request_id).wait()
        del self._arrived[request_id]
        features = self._released.pop(request_id)
        rows = sidecar_rows(tokens, features, logprobs, self.sidecar.top_k)
        if rows is None:
            log.warning("%s: %d feature rows and %d log-prob entries for %d tokens; not kept",
                        request_id, len(features), len(logprobs), len(tokens))  # fmt: skip
            self.missed += 1
            return
        cut = slice(None, self.max_len)
        self.sidecar.write(np.asarray(tokens[cut]), *(r[cut] for r in rows))
        self.kept += 1


def sidecar_rows(
    tokens: list[int], features: np.ndarray, logprobs: list, top_k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A record's store rows from what the engine handed out: the features of the positions
    its row had in the target's cache (every position but the last, which never went through
    the target; more where a draft accepted past the request's end) and, per token, the
    log-probabilities of what could come at it (the prompt's first: None). Row p of a store
    predicts token p + 1, so the top-k rows are the entries of tokens 1..S-1; the last row
    (predicting past the end, read by no anchor) is zeros, and so are the last position's
    features where the cache never held it. None where the counts do not fit."""
    n = len(tokens)
    if features.shape[0] < n - 1 or len(logprobs) != n or logprobs[0] is not None:
        return None
    top_ids = np.zeros((n, top_k), dtype=np.int32)
    top_logp = np.zeros((n, top_k), dtype=np.float32)
    for p, entry in enumerate(logprobs[1:]):
        if entry is None or len(entry.top) != top_k:
            return None
        top_ids[p] = [token for token, _ in entry.top]
        top_logp[p] = [value for _, value in entry.top]
    padded = np.zeros((n, features.shape[1]), dtype=np.float32)
    held = min(n, features.shape[0])
    padded[:held] = features[:held]
    return padded, top_ids, top_logp


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
