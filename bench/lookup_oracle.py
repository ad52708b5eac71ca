"""How far prompt lookup could go on the target's own outputs: an oracle replay, no model run.

    python bench/lookup_oracle.py [--data ~/.cache/flashbatch/drafter-build/<target>/data.jsonl]
        [--per-kind 60] [--tokens 96] [--depths 7,15]

Replays each record of a drafter-build data file (prompt + the target's greedy continuation):
at every step the lookup index (`drafters.lookup.index.NGramIndex`, 2..4-gram suffixes) over
the prompt and the committed tokens proposes up to `depth` tokens, the longest prefix equal to
the real continuation is accepted, and one more token commits. Prints, per kind, tokens per
step (the tau a perfect controller drafting on every match would reach at no verify cost),
the share of steps with a match, and tokens accepted per matched step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafters.lookup.index import NGramIndex

DEFAULT_DATA = (Path.home() / ".cache/flashbatch/drafter-build/smollm2-135m-instruct"
                / "data.jsonl")  # fmt: skip


def replay(prompt: list[int], generated: list[int], depth: int) -> tuple[int, int, int, int]:
    """(steps, committed tokens, steps with a match, drafts accepted on them)."""
    index = NGramIndex(2, 4)
    index.extend(prompt)
    steps = committed = matched = accepted_total = 0
    i = 0
    while i < len(generated):
        index.append(generated[i])  # the anchor: the newest committed token
        drafts, _ = index.propose(depth)
        accepted = 0
        for j, token in enumerate(drafts):
            if i + 1 + j >= len(generated) or generated[i + 1 + j] != token:
                break
            accepted += 1
        if drafts:
            matched += 1
            accepted_total += accepted
        index.extend(generated[i + 1 : i + 1 + accepted])
        i += 1 + accepted
        steps += 1
        committed += 1 + accepted
    return steps, committed, matched, accepted_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--per-kind", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=96, help="continuation tokens replayed")
    parser.add_argument("--depths", default="7,15")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.data.open() if line.strip()]
    kinds = sorted({r["kind"] for r in records})
    print("| kind | depth | records | tokens per step | steps with a match | accepted per match |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in kinds:
        chosen = [r for r in records if r["kind"] == kind][: args.per_kind]
        for depth in (int(d) for d in args.depths.split(",")):
            totals = [0, 0, 0, 0]
            for r in chosen:
                prompt = r["tokens"][: r["prompt_tokens"]]
                generated = r["tokens"][r["prompt_tokens"] :][: args.tokens]
                totals = [a + b for a, b in zip(totals, replay(prompt, generated, depth))]
            steps, committed, matched, accepted = totals
            per_match = accepted / max(1, matched)
            print(f"| {kind} | {depth} | {len(chosen)} | {committed / steps:.2f} "
                  f"| {100 * matched / steps:.0f}% | {per_match:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
