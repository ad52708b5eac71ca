"""Train the autoregressive draft model that mlx-lm's speculative decoding uses in
`flashbatch bench run` (the "classic" speculative-decoding peer of the DFlash drafter).

    python bench/train_ar_draft.py [--out bench/ar_draft] [--steps 500]
        [--hidden 128 --layers 2] [--tokenizer DIR] [--work-dir ~/.cache/flashbatch/ar-draft/work]

A small Qwen3 with the target's (by default the bundled pair's) tokenizer, pretrained on the
same Python-standard-library corpus as the bundled target with `engine.bundled.pretrain`. Work
goes to `--work-dir` and resumes where it stopped (run the same command again); when training
is done, `<out>` is an mlx-lm model directory (config.json, bf16 weights, tokenizer). The
repository ships the result in `bench/ar_draft` (0.9M parameters, 1.8 MB), which `flashbatch
bench run` uses by default, so the benchmark reproduces on a fresh clone without training.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import json
import shutil
from pathlib import Path

from engine.bundled.pretrain import PretrainConfig, TargetSize, pretrain_target, split_corpus

DEFAULT_OUT = Path(__file__).with_name("ar_draft")
DEFAULT_WORK = Path("~/.cache/flashbatch/ar-draft/work")
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens", "added_tokens", "chat_template", "vocab",
                      "merges")  # fmt: skip


def draft_size(hidden: int = 128, layers: int = 2, head_dim: int = 32) -> TargetSize:
    heads = max(1, hidden // head_dim)
    return TargetSize(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
    )


def _copy_tokenizer(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name.startswith(TOKENIZER_PREFIXES):
            shutil.copy(item, dest / item.name)
    if not (dest / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {source}")


def train_ar_draft(
    out: Path,
    tokenizer_dir: Path,
    size: TargetSize,
    config: PretrainConfig,
    corpus_root: Path | None = None,
    log=print,
    work: Path | None = None,
) -> Path:
    """Pretrain (resumably, in `work`, default `<out>/work`) and export the draft to `out`
    (bf16 storage); return `out`."""
    from engine.bundled.pair import export_target

    out = Path(out).expanduser()
    work = Path(work).expanduser() if work is not None else out / "work"
    if not (work / "tokenizer" / "tokenizer.json").is_file():
        _copy_tokenizer(Path(tokenizer_dir), work / "tokenizer")
    split_corpus(work, corpus_root)
    checkpoint = pretrain_target(work, size, config, log=log)
    state = json.loads((checkpoint / "state.json").read_text())
    if state["step"] < config.steps:
        raise RuntimeError(f"training stopped at step {state['step']}/{config.steps}")
    export_target(work, out)  # the bundled target's export: bf16 shards, config, tokenizer
    (out / "ar_draft.json").write_text(
        json.dumps({"steps": state["step"], "history": state["history"][-5:]}, indent=1) + "\n"
    )
    log(f"AR draft model ready: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.bundled.pair import bundled_paths

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model folder (resumes)")
    parser.add_argument(
        "--tokenizer", type=Path, default=bundled_paths()[0],
        help="directory with the target's tokenizer.json (default: the bundled target)",
    )  # fmt: skip
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument(
        "--work-dir", type=Path, default=DEFAULT_WORK, help="training checkpoints (resumes)"
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--corpus-root", type=Path, help="Python sources to train on (default: the stdlib)"
    )
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(
            f"no tokenizer.json in {args.tokenizer}: build the bundled pair "
            "(python -m engine.bundled.build) or pass --tokenizer"
        )
    config = PretrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        learning_rate=args.lr, seed=args.seed, checkpoint_every=args.checkpoint_every,
    )  # fmt: skip
    size = draft_size(args.hidden, args.layers, args.head_dim)
    train_ar_draft(args.out, args.tokenizer, size, config, args.corpus_root, work=args.work_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
