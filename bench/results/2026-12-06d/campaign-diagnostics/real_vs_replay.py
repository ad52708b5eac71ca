"""The real speculative loop against its offline replay, on the same prompts.

    PYTHONPATH=<repo> python real_vs_replay.py [DRAFTER_DIR]

Four held-out corpus records of each kind (continuations of 66+ tokens). For each: the real
greedy loop (`engine.step.speculative.generate`, the loop `campaign eval` runs) on the
record's prompt for 64 tokens, and `campaign.loop_steps_over` on the offline accepted runs
of the record's own first 64 continuation tokens. Equal tokens a step mean the offline
measure sees what the loop sees, and a gap between `campaign eval` and the held-out measure
comes from the prompts, not the machinery.
"""

import collections
import sys
from pathlib import Path

import numpy as np

from drafters.dflash import campaign
from engine.models.loading import load_pair
from engine.step.sampling import SamplingParams
from engine.step.speculative import generate

NAME = "smollm2-135m-instruct"


def main(drafter_dir: Path) -> None:
    pair = load_pair(NAME, drafter_dir)
    config = campaign.read_config(drafter_dir)
    model, state, vocab = campaign.load_checkpoint(drafter_dir)
    target, _ = campaign.load_target(NAME, config.target_layer_ids, config.num_hidden_layers)
    trainer = campaign.Trainer(target, NAME, model, state, vocab, campaign.CACHE_ROOT / NAME)
    trainer.model.update(trainer.average)  # the shipped weights
    _, held_out = campaign.corpus_split(NAME)
    taken: collections.Counter = collections.Counter()
    totals = collections.defaultdict(lambda: np.zeros(4))
    for record in held_out:
        start = record["prompt_tokens"]
        if taken[record["kind"]] >= 4 or len(record["tokens"]) - start < 66:
            continue
        taken[record["kind"]] += 1
        params = SamplingParams(
            max_tokens=64, temperature=0.0, num_speculative_tokens=config.block_size - 1
        )
        out = generate(pair.target, record["tokens"][:start], params, drafter=pair.drafter)
        assert out.token_ids == record["tokens"][start : start + len(out.token_ids)]
        sequence = campaign.TrainSequence(
            np.asarray(record["tokens"][: start + 64], np.int32), start
        )
        runs = trainer.accepted_runs(
            trainer.store([sequence]), 0, sequence, np.arange(start, len(sequence.tokens) - 1)
        )
        totals[record["kind"]] += [
            sum(s.committed for s in out.steps), len(out.steps),
            len(runs), campaign.loop_steps_over(runs),
        ]  # fmt: skip
    for kind, (committed, steps, tokens, replayed) in totals.items():
        print(f"{kind}: real loop {committed / steps:.3f}, replay {tokens / replayed:.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else campaign.DEFAULT_DRAFTER_DIR)
