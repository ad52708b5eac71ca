"""How far prompt lookup could go on the target's own outputs: an oracle replay, no model run.

    python bench/lookup_oracle.py [--data ~/.cache/flashbatch/drafter-build/<target>/data.jsonl]
        [--per-kind 60] [--tokens 96] [--depths 7,15] [--max-n 8] [--per-token 2]

Replays each record of a drafter-build data file (prompt + the target's greedy continuation):
at every step the lookup index (`drafters.lookup.index.NGramIndex`, suffixes of 2 to
`--max-n` tokens) over the prompt and the committed tokens proposes up to `depth` tokens (and
at most `--per-token` per matched token; 0: no cap), the longest prefix equal to the real
continuation is accepted, and one more token commits. Prints, per kind, tokens per step (the
tau a perfect controller drafting on every match would reach), the share of steps with a
match, tokens accepted per matched step, and positions verified per step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafters.lookup.drafter import DEFAULT_DEPTH_PER_MATCH, DEFAULT_MAX_N, DEFAULT_MIN_N
from drafters.lookup.index import NGramIndex

DEFAULT_DATA = (Path.home() / ".cache/flashbatch/drafter-build/smollm2-135m-instruct"
                / "data.jsonl")  # fmt: skip


def replay(
    prompt: list[int],
    generated: list[int],
    depth: int,
    max_n: int = DEFAULT_MAX_N,
    per_token: int | None = DEFAULT_DEPTH_PER_MATCH,
) -> tuple[int, int, int, int, int]:
    """(steps, committed tokens, steps with a match, drafts accepted on them, drafts)."""
    index = NGramIndex(DEFAULT_MIN_N, max_n)
    index.extend(prompt)
    steps = committed = matched = accepted_total = drafted = 0
    i = 0
    while i < len(generated):
        index.append(generated[i])  # the anchor: the newest committed token
        drafts, _ = index.propose(depth, per_token)
        drafted += len(drafts)
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
    return steps, committed, matched, accepted_total, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--per-kind", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=96, help="continuation tokens replayed")
    parser.add_argument("--depths", default="7,15")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="longest suffix")
    parser.add_argument("--per-token", type=int, default=DEFAULT_DEPTH_PER_MATCH,
                        help="most draft tokens per matched token (0: no cap)")  # fmt: skip
    args = parser.parse_args()
    per_token = args.per_token or None
    records = [json.loads(line) for line in args.data.open() if line.strip()]
    kinds = sorted({r["kind"] for r in records})
    print("| kind | depth | records | tokens per step | steps with a match | accepted per match "
          "| positions verified per step |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        chosen = [r for r in records if r["kind"] == kind][: args.per_kind]
        for depth in (int(d) for d in args.depths.split(",")):
            totals = [0, 0, 0, 0, 0]
            for r in chosen:
                prompt = r["tokens"][: r["prompt_tokens"]]
                generated = r["tokens"][r["prompt_tokens"] :][: args.tokens]
                run = replay(prompt, generated, depth, args.max_n, per_token)
                totals = [a + b for a, b in zip(totals, run)]
            steps, committed, matched, accepted, drafted = totals
            per_match = accepted / max(1, matched)
            print(f"| {kind} | {depth} | {len(chosen)} | {committed / steps:.2f} "
                  f"| {100 * matched / steps:.0f}% | {per_match:.2f} "
                  f"| {1 + drafted / steps:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
