"""Build the bundled model pair, stage by stage; every stage resumes from its work directory.

    python -m engine.bundled.build [--work-dir DIR] [--steps N] [--stages corpus,tokenizer,pretrain]

Stages done so far: corpus (stdlib train/held-out split), tokenizer (byte-level BPE), pretrain
(Qwen3 target). Drafter data, drafter training (`flashbatch train-drafter`), export into the
package and the model card follow in the bundled-pair issue.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
from pathlib import Path

from engine.bundled.pretrain import (
    PretrainConfig,
    TargetSize,
    pretrain_target,
    split_corpus,
    train_tokenizer,
)

DEFAULT_WORK_DIR = Path.home() / ".cache" / "flashbatch" / "bundle-build"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument("--stages", default="corpus,tokenizer,pretrain")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=PretrainConfig.steps)
    parser.add_argument("--checkpoint-every", type=int, default=PretrainConfig.checkpoint_every)
    args = parser.parse_args(argv)
    stages = set(args.stages.split(","))
    if "corpus" in stages:
        split = split_corpus(args.work_dir)
        print(f"corpus: {len(split['train'])} train files, {len(split['held_out'])} held out")
    if "tokenizer" in stages:
        print(f"tokenizer: {train_tokenizer(args.work_dir, args.vocab_size)}")
    if "pretrain" in stages:
        config = PretrainConfig(steps=args.steps, checkpoint_every=args.checkpoint_every)
        print(f"target checkpoint: {pretrain_target(args.work_dir, TargetSize(), config)}")


if __name__ == "__main__":
    main()
