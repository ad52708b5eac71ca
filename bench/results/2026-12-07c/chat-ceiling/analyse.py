"""Why does chat not move? Per kind, over every continuation anchor of the 132 held-out corpus
records: the target's own confidence in its next token (top-1 probability, from the feature
store's top-k) and the drafter's first-row accuracy, overall and within bins of that confidence.

    PYTHONPATH=$PWD python bench/results/2026-12-07c/chat-ceiling/analyse.py DRAFTER_DIR [N]

(N: only the first N held-out records, so that measures taken after the corpus grew stay on
the same records; the held-out slice only grows at its end.)

If chat's first-row accuracy matches the other kinds' within each confidence bin, chat is low
because more of its positions are ones where the target itself is unsure (a ceiling the data
cannot lift much); if it is lower within the bins, chat is under-learned.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from drafters.dflash import campaign

BINS = ((0.0, 0.5), (0.5, 0.9), (0.9, 1.01))


def main() -> None:
    drafter_dir = Path(sys.argv[1])
    target = campaign.DEFAULT_TARGET
    trainer = campaign.trainer_for(target, drafter_dir)
    _, val = campaign.corpus_split(target)
    val = val[: int(sys.argv[2])] if len(sys.argv) > 2 else val
    seqs = campaign.to_sequences(val, trainer.state.recipe.max_len)
    store = trainer.store(seqs)
    conf: dict[str, list[np.ndarray]] = defaultdict(list)
    hit1: dict[str, list[np.ndarray]] = defaultdict(list)
    runs: dict[str, list[np.ndarray]] = defaultdict(list)
    for index, (record, seq) in enumerate(zip(val, seqs)):
        anchors = np.arange(max(seq.prompt_tokens - 1, 0), len(seq.tokens) - 1)
        if len(anchors) == 0:
            continue
        _, hits, _, _ = trainer._measure(store, index, seq, anchors)
        _, top_logp = store.top(index)
        conf[record["kind"]].append(np.exp(top_logp[anchors, 0]))
        hit1[record["kind"]].append(hits[:, 0])
        runs[record["kind"]].append(np.cumprod(hits, axis=1).sum(1))
    table = {}
    for kind in sorted(conf):
        p1, h1 = np.concatenate(conf[kind]), np.concatenate(hit1[kind])
        steps = sum(campaign.loop_steps_over(r) for r in runs[kind])
        row = {
            "positions": int(len(p1)),
            "target_p1_mean": round(float(p1.mean()), 3),
            "share_p1_ge_0.9": round(float((p1 >= 0.9).mean()), 3),
            "row1_acc": round(float(h1.mean()), 3),
            "tau_loop": round(sum(len(r) for r in runs[kind]) / steps, 3),
        }
        for lo, hi in BINS:
            inside = (p1 >= lo) & (p1 < hi)
            row[f"share_{lo}-{min(hi, 1.0)}"] = round(float(inside.mean()), 3)
            row[f"row1_acc_{lo}-{min(hi, 1.0)}"] = round(float(h1[inside].mean()), 3)
        table[kind] = row
    print(json.dumps({"drafter_step": trainer.state.step, "by_kind": table}, indent=1))


if __name__ == "__main__":
    main()
