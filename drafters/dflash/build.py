"""Build a DFlash drafter for a real chat target, stage by stage; every stage resumes.

    python -m drafters.dflash.build --target smollm2-135m-instruct [--stages data,fit,eval]

Stages (each resumes from what `--work-dir` holds, so the hours it takes can span sittings):
  data    the target's own continuations of the train split of the prompt mix
          (`drafters.dflash.prompt_mix`), batched through the engine (`datagen`); it first
          takes in the records the repository keeps (`drafters.dflash.corpus`)
  keep    writes the records no repository part holds yet into a new part, and the sittings
          log beside them, so a fresh machine resumes where this one stopped (commit them)
  fit     DFlash training on them (`drafters.dflash.train`), checkpointed, resumable
  eval    tau per kind on held-out prompts, greedy and T=1, and tokens/s against mlx-lm's
          plain `stream_generate` on the same target, one request at a time
  export  the drafter into `--export-dir` (bf16, z-lab layout), e.g. the registry's directory
  card    MODEL_CARD.md beside the exported drafter, from what the stages recorded

Every sitting's command line is recorded in `sittings.json` and printed in the card.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import json
import logging
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from drafters.dflash.campaign_state import (
    DEFAULT_DRAFTER_DIR,
    Recipe,
    has_state,
    read_state,
    sidecar_dir,
)
from drafters.dflash.corpus import (
    corpus_dir,
    export_new_part,
    import_parts,
    merge_sittings,
    read_parts,
)

DEFAULT_WORK_ROOT = Path.home() / ".cache" / "flashbatch" / "drafter-build"  # / <target name>
EVAL_KINDS = ("completion", "editing", "chat", "prose")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _record_sitting(work: Path, argv: list[str], stats: dict[str, Any]) -> None:
    path = work / "sittings.json"
    sittings = json.loads(path.read_text()) if path.exists() else []
    command = "python -m drafters.dflash.build " + " ".join(shlex.quote(a) for a in argv)
    sittings.append({"command": command, "at": time.strftime("%Y-%m-%d %H:%M"), **stats})
    path.write_text(json.dumps(sittings, indent=1))


def take_in_corpus(work: Path, target: str) -> int:
    """Seed the work directory with the records and sittings the repository keeps."""
    imported = import_parts(corpus_dir(target), work / "data.jsonl")
    merge_sittings(corpus_dir(target) / "sittings.json", work / "sittings.json")
    if imported:
        print(f"took {imported} records from {corpus_dir(target)}")
    return imported


def stage_data(
    work: Path,
    target: str,
    per_kind: int,
    concurrency: int,
    length_window: int = 256,
    features_drafter: Path | None = None,
) -> dict[str, Any]:
    """Generate records into the work file; with `features_drafter`, keep each record's
    features (that drafter's taps) for the campaign's feature pass (`datagen`, `features_dir`)."""
    from drafters.dflash.datagen import DEFAULT_MAX_TOKENS, generate_mix
    from drafters.dflash.prompt_mix import build_prompts
    from drafters.dflash.train import read_jsonl_records

    # The campaign's recipe (its data cut and top-k), where the drafter has a state.
    recipe = Recipe()
    if features_drafter is not None and has_state(features_drafter):
        recipe = read_state(features_drafter).recipe
    started = time.perf_counter()
    imported = take_in_corpus(work, target)
    before = len(read_jsonl_records(work / "data.jsonl"))
    prompts = build_prompts("train", per_kind)
    note = {}
    try:
        asyncio.run(
            generate_mix(
                target,
                prompts,
                work / "data.jsonl",
                max_tokens=DEFAULT_MAX_TOKENS,
                concurrency=concurrency,
                length_window=length_window,
                features_dir=sidecar_dir(target) if features_drafter else None,
                drafter=features_drafter,
                top_k=recipe.top_k,
                max_len=recipe.max_len,  # the campaign's cut of every record
            )  # fmt: skip
        )
    except KeyboardInterrupt:  # stopped by hand: every finished request is on file
        note = {"note": "stopped by hand; --stages data resumes it"}
    written = len(read_jsonl_records(work / "data.jsonl")) - before
    return {"stage": "data", "records_written": written, "records_imported": imported,
            "seconds": round(time.perf_counter() - started), **note}  # fmt: skip


def stage_keep(work: Path, target: str) -> dict[str, Any]:
    """The new records as a repository part (`main` then merges the sittings log beside
    the parts, once this sitting is recorded)."""
    directory = corpus_dir(target)
    part = export_new_part(work / "data.jsonl", directory)
    return {"stage": "keep", "part": None if part is None else part.name,
            "records_kept": len(read_parts(directory))}  # fmt: skip


def data_facts(work: Path) -> dict[str, Any]:
    from drafters.dflash.train import read_jsonl_records

    records = read_jsonl_records(work / "data.jsonl")
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    generated = sum(len(r["tokens"]) - r["prompt_tokens"] for r in records)
    return {"records": len(records), "generated_tokens": generated, "by_kind": kinds,
            "total_tokens": sum(len(r["tokens"]) for r in records)}  # fmt: skip


def stage_fit(work: Path, target: str, args: argparse.Namespace) -> dict[str, Any]:
    from drafters.dflash.train import (
        TrainConfig,
        drafter_config_for_target,
        has_checkpoint,
        load_sequences,
        train,
    )
    from engine.models.loading import load_target_model
    from engine.models.resolve import resolve_target
    from engine.step.target import TargetAdapter

    take_in_corpus(work, target)  # a fresh machine fits on what earlier machines generated
    out = work / "drafter"
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, num_anchors=args.num_anchors,
        max_len=args.max_len, out_dir=str(out), resume=True, checkpoint_every=50,
        progress=False, log_every=10, feature_cache_mb=args.feature_cache_mb,
        feature_store_dir=str(work),  # computed once per machine and corpus, then read back
        draft_vocab_size=args.draft_vocab,
    )  # fmt: skip
    if has_checkpoint(out):
        from drafters.dflash.checkpoint import read_config

        drafter_config = read_config(out)
    else:
        raw = json.loads((resolve_target(target) / "config.json").read_text())
        drafter_config = drafter_config_for_target(
            raw, num_layers=args.layers, block_size=args.block_size,
            mask_token_id=args.mask_token_id,
        )  # fmt: skip
    model, _ = load_target_model(target)
    tapped = TargetAdapter(model, drafter_config.target_layer_ids)
    sequences = load_sequences(work / "data.jsonl", config.max_len)
    started = time.perf_counter()
    try:
        result = train(tapped, sequences, config, drafter_config)
    except KeyboardInterrupt:  # stopped by hand: the last checkpoint (<= 50 steps back) stands
        from drafters.dflash.train import STATE_FILE

        step = json.loads((out / STATE_FILE).read_text())["step"] if has_checkpoint(out) else 0
        return {"stage": "fit", "steps": step, "sequences": len(sequences),
                "seconds": round(time.perf_counter() - started),
                "note": "interrupted by hand; resumes from its last checkpoint"}  # fmt: skip
    tail = result.history[-20:]
    return {
        "stage": "fit", "steps": result.step, "sequences": len(sequences),
        "loss": sum(h[1] for h in tail) / max(1, len(tail)),
        "acc": sum(h[2] for h in tail) / max(1, len(tail)),
        "seconds": round(time.perf_counter() - started),
    }  # fmt: skip


def stage_eval(
    work: Path, target: str, drafter: Path, prompts_per_kind: int, max_tokens: int, depth: int
) -> dict[str, Any]:
    """Per kind: tau greedy and at T=1 (seeded), and greedy tokens/s against mlx-lm plain."""
    from mlx_lm import stream_generate

    from drafters.dflash.datagen import encode
    from drafters.dflash.prompt_mix import build_prompts
    from engine.models.loading import load_pair
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

    pair = load_pair(target, drafter)
    head = pair.drafter.head
    in_vocab = None if head is None else set(np.array(head.token_ids).tolist())
    held = build_prompts("held_out", prompts_per_kind)
    results: dict[str, Any] = {}
    for kind in EVAL_KINDS:
        tally = {"greedy": [0, 0, 0, 0.0], "t1": [0, 0, 0, 0.0]}  # tokens, steps, committed, s
        plain_tokens, plain_seconds, covered = 0, 0.0, 0
        for i, prompt in enumerate(p for p in held if p.kind == kind):
            ids = encode(pair.tokenizer, prompt)
            for name, temperature in (("greedy", 0.0), ("t1", 1.0)):
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, seed=i,
                    num_speculative_tokens=depth,
                )  # fmt: skip
                started = time.perf_counter()
                out = generate(pair.target, ids, params, drafter=pair.drafter)
                t = tally[name]
                t[0] += len(out.token_ids)
                t[1] += len(out.steps)
                t[2] += sum(s.committed for s in out.steps)
                t[3] += time.perf_counter() - started
                if name == "greedy":
                    covered += sum(1 for x in out.token_ids if in_vocab is None or x in in_vocab)
            started = time.perf_counter()
            for _ in stream_generate(pair.target.model, pair.tokenizer, ids, max_tokens=max_tokens):
                plain_tokens += 1
            plain_seconds += time.perf_counter() - started
        greedy, t1 = tally["greedy"], tally["t1"]
        plain_rate = plain_tokens / plain_seconds
        results[kind] = {
            "tau": greedy[2] / greedy[1], "tau_t1": t1[2] / t1[1],
            "spec_tok_s": greedy[0] / greedy[3], "mlx_lm_tok_s": plain_rate,
            "speedup": greedy[0] / greedy[3] / plain_rate,
            "vocab_coverage": covered / max(1, greedy[0]),
        }  # fmt: skip
        print(f"{kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[kind].items()))
    record = {"depth": depth, "prompts_per_kind": prompts_per_kind, "max_tokens": max_tokens,
              "draft_vocab": None if head is None else head.size, "results": results}  # fmt: skip
    (work / "eval.json").write_text(json.dumps(record, indent=1))
    return {"stage": "eval", **{k: round(v["tau"], 3) for k, v in results.items()}}


def stage_export(work: Path, dest: Path) -> dict[str, Any]:
    from engine.bundled.pair import export_drafter  # bf16, z-lab layout, from work/drafter

    return {"stage": "export", "dest": str(export_drafter(work, dest))}


def write_card(work: Path, dest: Path, target: str) -> Path:
    from drafters.dflash.checkpoint import read_config
    from drafters.dflash.vocab import read_draft_vocab

    config = read_config(dest)
    data = data_facts(work)
    sittings = json.loads((work / "sittings.json").read_text())
    fits = [s for s in sittings if s.get("stage") == "fit"]
    ev = json.loads((work / "eval.json").read_text())
    rows = "\n".join(
        f"| {k} | {r['tau']:.2f} | {r['tau_t1']:.2f} | {r['spec_tok_s']:.1f} | "
        f"{r['mlx_lm_tok_s']:.1f} | {r['speedup']:.2f}x | {r.get('vocab_coverage', 1.0):.3f} |"
        for k, r in ev["results"].items()
    )
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(data["by_kind"].items()))
    commands = "\n".join(s["command"] for s in sittings)
    vocab = read_draft_vocab(dest)
    vocab_line = (
        "none (the target's full LM head)" if vocab is None else
        f"{len(vocab)} of the target's {config.vocab_size} LM-head rows (EAGLE-3 `d2t`, "
        "`draft_vocab.safetensors`); the last column is the share of held-out greedy output "
        "tokens it holds"
    )  # fmt: skip
    last = next((s for s in reversed(fits) if "loss" in s), {})  # an interrupted fit has none
    steps = max((s.get("steps", 0) for s in fits), default=0)
    card = f"""# DFlash drafter for `{target}`

Trained here by `python -m drafters.dflash.build` (2-core x86_64 CPU, MLX CPU backend,
float32 compute). z-lab layout: `config.json` + safetensors, bf16 storage.

## Drafter

- {config.num_hidden_layers} target-shaped layers, hidden {config.hidden_size}, block size \
{config.block_size}, tapped target layers {config.target_layer_ids}, mask token id \
{config.mask_token_id}.
- Data: the target's own greedy continuations of {data["records"]} prompts of the train split
  of the prompt mix ({kinds}); {data["generated_tokens"]} generated tokens,
  {data["total_tokens"]} tokens with prompts. Held-out prompts (by file / text hash) are never
  trained on.
- Draft vocabulary: {vocab_line}.
- Training: {steps} steps; last recorded loss {last.get("loss", float("nan")):.3f},
  weighted accuracy {last.get("acc", float("nan")):.3f}; \
{sum(s.get("seconds", 0) for s in fits) / 60:.0f} minutes over {len(fits)} sitting(s).

## Measured (held-out prompts, one request at a time, depth {ev["depth"]}, \
{ev["max_tokens"]} tokens, {ev["prompts_per_kind"]} prompts per kind)

| kind | tau greedy | tau T=1 | speculative tok/s | mlx-lm `stream_generate` tok/s | speedup \
| in draft vocabulary |
|---|---:|---:|---:|---:|---:|---:|
{rows}

## Sittings (exact commands, in order)

```bash
{commands}
```
"""
    path = dest / "MODEL_CARD.md"
    path.write_text(card)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--work-dir", type=Path, help=f"default: {DEFAULT_WORK_ROOT}/<target>")
    parser.add_argument("--stages", default="data,fit,eval")
    parser.add_argument("--per-kind", type=int, default=2000, help="data prompts of each kind")
    parser.add_argument("--concurrency", type=int, default=32, help="data generation")
    parser.add_argument(
        "--length-window", type=int, default=256,
        help="data generation: prompts a window, each window shortest first (0: in order)",
    )  # fmt: skip
    parser.add_argument(
        "--keep-features", nargs="?", type=Path, const=DEFAULT_DRAFTER_DIR, default=None,
        metavar="DRAFTER",
        help="data generation: keep each record's target features and top-8 for the campaign's "
        f"feature pass, at DRAFTER's taps (default {DEFAULT_DRAFTER_DIR.name})",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=2000, help="total optimizer steps")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    # Blocks per sequence. 64 (the reference's small recipe: 32-128) against 16: 0.50 s
    # against 0.22 s per SmolLM2 sequence with its features cached, for 385 labels against
    # 112 (most generated positions of a record), so 1.7x the labels per second of training.
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-len", type=int, default=768)
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="train and draft over this many LM-head rows (0: all)",
    )
    parser.add_argument("--feature-cache-mb", type=int, default=8192)
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--eval-max-tokens", type=int, default=128)
    parser.add_argument("--eval-depth", type=int, default=7)
    parser.add_argument("--export-dir", type=Path, help="where `export` writes the drafter")
    args = parser.parse_args(argv)
    # A stage stopped by SIGTERM (how a background job is stopped: it ignores SIGINT) ends as
    # Ctrl-C does, so the sitting that ran so far is still recorded.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run_stages(args, argv, parser)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_stages(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser) -> int:
    # Progress lines (datagen's "N/M written, tok/s", training's losses) go to stderr.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stages = args.stages.split(",")
    work: Path = args.work_dir or DEFAULT_WORK_ROOT / Path(args.target).name
    work.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        if stage == "data":
            stats = stage_data(work, args.target, args.per_kind, args.concurrency,
                               args.length_window, args.keep_features)  # fmt: skip
        elif stage == "keep":
            stats = stage_keep(work, args.target)
        elif stage == "fit":
            stats = stage_fit(work, args.target, args)
        elif stage == "eval":
            stats = stage_eval(work, args.target, work / "drafter", args.eval_prompts,
                               args.eval_max_tokens, args.eval_depth)  # fmt: skip
        elif stage == "export":
            if args.export_dir is None:
                parser.error("export needs --export-dir")
            stats = stage_export(work, args.export_dir)
        elif stage == "card":
            if args.export_dir is None:
                parser.error("card needs --export-dir")
            print(f"card written to {write_card(work, args.export_dir, args.target)}")
            continue
        else:
            parser.error(f"unknown stage {stage!r}")
        print(stats)
        _record_sitting(work, argv, stats)
        if stage == "keep":  # after recording, so the log kept includes this sitting
            merge_sittings(work / "sittings.json", corpus_dir(args.target) / "sittings.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
