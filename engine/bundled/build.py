"""Build the bundled model pair, stage by stage; every stage resumes from its work directory.

    python -m engine.bundled.build [--work-dir DIR] [--steps N] [--stages corpus,tokenizer,pretrain]

Stages, in order (each resumes from what its work directory holds):
  corpus          stdlib files split into train / held-out (hash of the relative path)
  tokenizer       byte-level BPE on the train files
  pretrain        the Qwen3 target, from scratch
  export-target   target + tokenizer into engine/bundled/target (bf16 storage)
  workloads       completion / editing / prose prompts from the held-out files
  data            the target's own greedy continuations of training-file prompts
  drafter         DFlash drafter training (block 16)
  export-drafter  drafter into engine/bundled/drafter
  eval            tau per workload and tokens/s against mlx-lm, written to eval.json
  card            MODEL_CARD.md beside the weights, from what the stages recorded
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import json
import time
from pathlib import Path

from engine.bundled import pair
from engine.bundled.pretrain import (
    PretrainConfig,
    TargetSize,
    pretrain_target,
    read_files,
    split_corpus,
    train_tokenizer,
)
from engine.bundled.workloads import build_workloads, load_workloads, save_workloads

WORKLOADS_FILE = Path(__file__).with_name("workloads.json")

DEFAULT_WORK_DIR = Path.home() / ".cache" / "flashbatch" / "bundle-build"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    parser.add_argument(
        "--stages",
        default="corpus,tokenizer,pretrain,export-target,workloads,data,drafter,export-drafter,eval,card",
    )
    parser.add_argument("--data-prompts", type=int, default=2000)
    parser.add_argument("--workload-data-prompts", type=int, default=0)
    parser.add_argument("--drafter-steps", type=int, default=400)
    parser.add_argument("--eval-prompts", type=int, default=12)
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
    target_dir, drafter_dir = pair.bundled_paths()
    if "export-target" in stages:
        print(f"target exported to {pair.export_target(args.work_dir)}")
    if "workloads" in stages:
        sources = read_files(split_corpus(args.work_dir), "held_out")
        save_workloads(build_workloads(sources), WORKLOADS_FILE)
        print(f"workloads written to {WORKLOADS_FILE}")
    if "data" in stages:
        pair.generate_drafter_data(
            args.work_dir, target_dir, args.data_prompts, args.workload_data_prompts
        )
    if "drafter" in stages:
        started = time.perf_counter()
        result = pair.train_bundled_drafter(args.work_dir, target_dir, args.drafter_steps)
        summary_file = args.work_dir / "drafter_summary.json"
        previous = json.loads(summary_file.read_text())["seconds"] if summary_file.exists() else 0
        tail = result.history[-20:]
        summary = {
            "steps": result.step,
            "loss": sum(h[1] for h in tail) / max(1, len(tail)),
            "acc": sum(h[2] for h in tail) / max(1, len(tail)),
            "seconds": previous + time.perf_counter() - started,
        }
        summary_file.write_text(json.dumps(summary))
        # Each sitting's schedule length matters (a resumed run restarts the cosine for its
        # new total), so the model card lists every sitting's command.
        runs_file = args.work_dir / "drafter_runs.json"
        runs = json.loads(runs_file.read_text()) if runs_file.exists() else []
        if not runs or runs[-1]["steps"] != result.step:
            runs.append(
                {
                    "steps": result.step,
                    "data_prompts": args.data_prompts,
                    "workload_data_prompts": args.workload_data_prompts,
                    "records": pair.count_records(args.work_dir),
                }
            )
        runs_file.write_text(json.dumps(runs))
    if "export-drafter" in stages:
        print(f"drafter exported to {pair.export_drafter(args.work_dir)}")
    if "eval" in stages:
        workloads = load_workloads(WORKLOADS_FILE)
        results = pair.evaluate_pair(
            target_dir, drafter_dir, workloads, prompts=args.eval_prompts, max_tokens=128
        )
        record = {"results": results, "prompts": args.eval_prompts, "max_tokens": 128}
        (args.work_dir / "eval.json").write_text(json.dumps(record, indent=1))
    if "card" in stages:
        pair.write_model_card(args.work_dir, pair.collect_facts(args.work_dir))
        print("model card written")


if __name__ == "__main__":
    main()
