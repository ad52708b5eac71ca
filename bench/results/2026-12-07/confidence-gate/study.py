"""Would the drafter's own confidence choose a better verify width than a fixed depth?

    PYTHONPATH=<repo> python study.py [--out rows.npz]

Offline, on the eval set (`drafters/dflash/evalsets/`, the bench's held-out mix prompts with
the target's greedy continuations): every anchor's block through the shipped drafter (its EMA
weights, as served), each row's top-1 probability over the draft vocabulary and whether its
argmax is the target's token. Saved to `--out` for `simulate.py`.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np

from drafters.dflash import campaign, evalset
from engine.models.resolve import default_drafter

TARGET = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="rows.npz")
    args = parser.parse_args()
    trainer = campaign.trainer_for(TARGET, Path(default_drafter(TARGET)))
    if trainer.average is not None:
        trainer.model.update(trainer.average)
    records = evalset.read_evalset(evalset.evalset_path(TARGET))
    sequences = campaign.to_sequences(records, trainer.state.recipe.max_len)
    store = trainer.store(sequences)
    probs, hits, kinds, record_ids = [], [], [], []
    for index, (record, sequence) in enumerate(zip(records, sequences)):
        anchors = np.arange(max(sequence.prompt_tokens - 1, 0), len(sequence.tokens) - 1)
        if len(anchors) == 0:
            continue
        blocks, batch = trainer.blocks_of(store, index, sequence, anchors, None)
        hidden = campaign.block_states(trainer.model, trainer.target, store.get(index), blocks)
        logits = hidden @ trainer.head_weight.T
        top = mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))
        top_ids = np.array(mx.argmax(logits, axis=-1))
        probs.append(np.array(top))
        hits.append((top_ids == np.asarray(batch.labels)) & (np.asarray(batch.weights) > 0))
        kinds += [record["kind"]] * len(anchors)
        record_ids += [index] * len(anchors)
    np.savez(
        args.out, probs=np.concatenate(probs), hits=np.concatenate(hits),
        kinds=np.array(kinds), records=np.array(record_ids),
    )  # fmt: skip
    print("anchors", len(kinds))


if __name__ == "__main__":
    main()
