"""The drafter's MODEL_CARD.md, written from its training state and sittings log.

    python -m drafters.dflash.card [--drafter-dir D]   # regenerate it before a checkpoint commit

The card shows the recipe and the levers in force, every sitting (command, steps, hours,
labels a second, held-out loss and offline tau), every `campaign eval` and eval-set measure,
and the projection: a straight line through tau against log(labels) per kind, and the labels
and sittings each aim of the issue needs at that rate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from drafters.dflash.campaign import VAL_MODULUS
from drafters.dflash.campaign_state import (
    DEFAULT_DRAFTER_DIR,
    DEFAULT_TARGET,
    State,
    read_sittings,
    read_state,
)
from drafters.dflash.checkpoint import read_config
from drafters.dflash.train import default_gamma

# The aims: held-out greedy tau per kind at the shipped block size.
TAU_AIMS = {"editing": 3.5, "completion": 3.0, "chat": 2.5}


def _labels_at(step: int, sittings: list[dict], state: State) -> float:
    """Labels seen at `step`: from the sitting that ended there, else pro rata."""
    for s in sittings:
        if s.get("stage") == "sitting" and s.get("step_end") == step and "labels_start" in s:
            return float(s["labels_start"] + s.get("labels", 0))
    return state.labels_seen * step / max(state.step, 1)


def tau_projection(
    sittings: list[dict], state: State, stage: str = "eval", field: str = "tau"
) -> list[str]:
    """Markdown lines: tau against labels seen (every kept eval, or with `stage="evalset"`
    and `field="tau_loop"` every eval-set measure), a straight line through tau against
    log(labels) per kind, and the labels and sittings each aim needs at it. Crude by design:
    a handful of noisy points, and learning curves bend."""
    evals = [
        s for s in sittings
        if s.get("stage") == stage and s.get(field) and s.get("kept", True)  # not a rejected one
    ]  # fmt: skip
    points = [
        (s.get("labels_seen") or _labels_at(s["step"], sittings, state), s[field]) for s in evals
    ]
    points = [(labels, tau) for labels, tau in points if labels > 0]
    lines = ["| labels seen | " + " | ".join(TAU_AIMS) + " |",
             "|---:|" + "---:|" * len(TAU_AIMS)]  # fmt: skip
    for labels, tau in points:
        cells = " | ".join(f"{tau.get(kind, float('nan')):.3f}" for kind in TAU_AIMS)
        lines.append(f"| {labels:,.0f} | {cells} |")
    counted = [s for s in sittings if s.get("stage") == "sitting" and not s.get("superseded")]
    per_sitting = [s["labels"] for s in counted if s.get("labels")]
    if len({labels for labels, _ in points}) < 2 or not per_sitting:
        return lines + ["", "Two evals at different label counts are needed for a projection."]
    sitting = float(np.median(per_sitting))
    lines += ["", f"Straight line through tau against ln(labels), per kind; a sitting is "
              f"{sitting:,.0f} labels (the median so far):", "",
              "| kind | aim | tau per doubling of labels | labels for the aim | sittings more |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    x = np.log([labels for labels, _ in points])
    for kind, aim in TAU_AIMS.items():
        y = np.array([tau.get(kind, np.nan) for _, tau in points])
        slope, intercept = np.polyfit(x, y, 1)
        if slope <= 0:
            lines.append(f"| {kind} | {aim} | {slope * np.log(2):+.3f} | not rising | - |")
            continue
        needed = float(np.exp((aim - intercept) / slope))
        more = max(0.0, needed - state.labels_seen) / sitting
        lines.append(f"| {kind} | {aim} | {slope * np.log(2):+.3f} | {needed:,.3g} | "
                     f"{more:,.3g} |")  # fmt: skip
    return lines


SITTINGS_HEADER = (
    "| at (UTC) | command | steps | hours | labels/s | held-out start | after 100 | end / acc "
    "| offline tau start / end |\n|---|---|---|---:|---:|---:|---:|---:|---:|"
)


def write_card(drafter_dir: Path, target_name: str) -> Path:
    """MODEL_CARD.md beside the drafter: recipe, every sitting and every eval, from the
    state and the sittings log (regenerate it before each checkpoint commit)."""
    state = read_state(drafter_dir)
    config = read_config(drafter_dir)
    r = state.recipe
    sittings = read_sittings(drafter_dir)
    rows, evals, evalsets = [], [], []
    for s in sittings:
        if s.get("stage") == "evalset":  # `python -m drafters.dflash.evalset measure --log`
            taus = " / ".join(f"{k} {v:.3f}" for k, v in s.get("tau_loop", {}).items())
            records = sum(k.get("records", 0) for k in s.get("by_kind", {}).values())
            low, high = s.get("tau_loop_mean_90") or (None, None)
            interval = f"{low:.3f}-{high:.3f}" if low is not None else "-"
            evalsets.append(
                f"| {s['at']} | {s['step']} | {s.get('tau_loop_mean', 0):.3f} | {taus} "
                f"| {records} | {interval} |"
            )
            continue
        if s.get("stage") == "eval":
            taus = " / ".join(f"{k} {v:.2f}" for k, v in s.get("tau", {}).items())
            kept = "kept" if s.get("kept") else "rejected (committed one restored)"
            evals.append(
                f"| {s['at']} | {s['step']} | {s.get('tau_mean', 0):.3f} | {taus} | {kept} |"
            )
            continue
        if s.get("stage") == "grow":
            grew = []
            if "layers" in s:
                grew.append(f"{s['layers'][0]} -> {s['layers'][1]} layers (new layers' output "
                            "projections start at zero)")  # fmt: skip
            if "taps" in s:
                grew.append(f"taps {s['taps'][0]} -> {s['taps'][1]} (new taps' `fc` columns "
                            "start at zero)")  # fmt: skip
            rows.append(
                f"| {s['at']} | `{s['command']}`: {'; '.join(grew)}, predictions unchanged "
                f"| {s['step']} | - | - | - | - | - | - |"
            )
            continue
        start, end = s.get("heldout_start") or {}, s.get("heldout_end") or {}
        hundred = s.get("heldout_after_100") or {}
        retuned = "".join(f"; {k} {a} -> {b}" for k, (a, b) in s.get("retuned", {}).items())
        if s.get("superseded"):  # a paired arm over the same data was adopted in its place
            retuned += "; superseded by the next row"
        offline = " / ".join(f"{h['tau']:.3f}" if "tau" in h else "-" for h in (start, end))
        if "heldout_records" in s:  # the held-out slice grows when the corpus does
            offline += f" ({s['heldout_records']} records)"
        rows.append(
            f"| {s['at']} | `{s['command']}`{retuned} "
            f"| {s.get('step_start', 0)}-{s.get('step_end', '?')} "
            f"| {s.get('seconds', 0) / 3600:.2f} | {s.get('labels_per_s') or 0:.0f} "
            f"| {start.get('loss', float('nan')):.3f} | {hundred.get('loss', float('nan')):.3f} "
            f"| {end.get('loss', float('nan')):.3f} / {end.get('acc', float('nan')):.3f} "
            f"| {offline} |"
        )
    chosen = []
    if r.candidates:
        chosen.append(f"candidate-set loss (top-{r.top_k} + label + {r.negatives} negatives)")
    if r.distill > 0:
        chosen.append(f"distillation (alpha {r.distill:.2f} on KL to the target's top-{r.top_k})")
    grown = [s["layers"] for s in sittings if s.get("stage") == "grow" and "layers" in s]
    if r.warm_start:
        first = grown[0][0] if grown else r.layers
        chosen.append(f"warm start from the target's top {first} layers")
    if grown:
        chosen.append(f"grown to {r.layers} layers (`campaign grow`)")
    if r.ema > 0:
        chosen.append(f"weight averaging (ema {r.ema}; the shipped weights are the average)")
    if r.prompt_anchors:
        chosen.append("prompt anchors (labelled by the target's argmax chain)")
    if r.train_block and r.train_block != r.block_size:
        chosen.append(f"training blocks of {r.train_block} rows")
    levers = ", ".join(chosen) or "none (full draft-vocabulary cross-entropy, random init)"
    gamma = r.gamma or default_gamma(r.block_size)
    last = state.heldout or {}
    detour = (
        f", on a detour over the fresh shards before going back to shard {state.cursor.return_to}"
        if state.cursor.return_to >= 0
        else ""
    )
    now_heldout = (
        f"- Held-out now (the last measure, step {last.get('step')}): offline greedy tau "
        f"{last['tau']:.3f}; accuracy by block row {last.get('acc_by_position')}; tau were the "
        f"depth capped at 1..{config.block_size - 1}: {last.get('tau_by_depth')}"
        + (
            f"; the greedy loop replayed over the same records: {last['tau_loop']:.3f} tokens "
            "a step (the mean over anchors overstates it: accepted runs cluster).\n"
            if last.get("tau_loop")
            else ".\n"
        )
        if "tau" in last
        else ""
    )
    card = f"""# DFlash drafter for `{target_name}`

Trained by `python -m drafters.dflash.campaign` on a 2-core x86_64 CPU (MLX CPU backend,
float32 compute), a sitting at a time; the training state lives beside the weights
(`training/state.json`, `training/sittings.json`), so each sitting continues the last.
z-lab layout: `config.json` + `model.safetensors` (bf16), draft vocabulary in
`draft_vocab.safetensors` (EAGLE-3 `d2t`). The embeddings and LM head are the target's.

- {config.num_hidden_layers} target-shaped layers, hidden {config.hidden_size}, block size
  {config.block_size}, taps {config.target_layer_ids}, mask token {config.mask_token_id},
  draft vocabulary {r.draft_vocab} rows.
- Recipe: {r.batch_size} sequences x {r.num_anchors} anchors a step, AdamW lr {r.lr}
  (warmup {r.warmup_steps}, re-warm {r.rewarm_steps} after each resume, cosine over
  {r.horizon_steps} steps to {r.min_lr_fraction:.0%}), loss decay gamma {gamma:g} over block
  rows; levers: {levers}.
- Data: the corpus parts in `drafters/dflash/corpus/{Path(target_name).name}/`, in shards of
  {r.shard_records} records, {r.passes_per_shard} passes each; 1 key in {VAL_MODULUS} held out.
- Now: step {state.step}, {state.labels_seen:,} labels seen, cursor shard
  {state.cursor.shard} pass {state.cursor.pass_} record {state.cursor.position}, corpus
  wrapped {state.cursor.wraps} time(s){detour}.
{now_heldout}
## Sittings

Held-out loss: cross-entropy over the whole draft vocabulary on fixed anchors of the held-out
records (start of the sitting, after 100 of its steps, end / accuracy at the end; rows
weighted by the recipe's gamma, so a retuned gamma moves it). Offline tau: 1 + the mean run
of leading argmax hits on those anchors (`campaign heldout`), at the start and end of the
sitting, where measured.

{SITTINGS_HEADER}
{chr(10).join(rows)}

## Held-out tau (greedy, the bench's `mix` split, depth {config.block_size - 1})

| at (UTC) | step | mean tau | per kind | outcome |
|---|---:|---:|---|---|
{chr(10).join(evals)}

## Held-out tau on the eval set (the loop replayed, depth {config.block_size - 1})

`python -m drafters.dflash.evalset measure --log`: the first held-out prompts of each kind of
the mix, each whole greedy continuation (`drafters/dflash/evalsets/`), tokens a step of the
greedy loop replayed offline (equal to the real loop's): more prompts and tokens than above.
The interval draws the records with replacement (bootstrap, within each kind): how far the
mean could move on another draw of prompts like these.

| at (UTC) | step | mean tau | per kind | records | 90% interval (records drawn) |
|---|---:|---:|---|---:|---|
{chr(10).join(evalsets) or "| - | - | - | not measured yet | - | - |"}

## Projection: tau against labels seen

{chr(10).join(tau_projection(sittings, state))}

On the eval set (tokens a step of the loop replayed):

{chr(10).join(tau_projection(sittings, state, "evalset", "tau_loop"))}
"""
    path = drafter_dir / "MODEL_CARD.md"
    path.write_text(card)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter-dir", type=Path, default=DEFAULT_DRAFTER_DIR)
    args = parser.parse_args(argv)
    print(f"card written to {write_card(args.drafter_dir, args.target)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
