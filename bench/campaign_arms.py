"""Paired arms: recipes trained from one checkpoint over the same shard, then measured alike.

    python bench/campaign_arms.py --arm P1="--passes-per-shard 1" --arm P3="" \\
        --work /tmp/arms --out bench/results/<date>/<name>

A campaign lever (fewer passes over a shard, another learning rate, one more layer) is judged
by training copies of one checkpoint on the same records and measuring each the same way. Each
arm is a copy of the checkpoint (`--from`, the live drafter directory by default) in
`WORK/NAME`, its data cursor sent to the start of `--shard` (by default the shard holding the
first record no sitting has trained: the one `campaign run --fresh-only` trains next, so an
adopted arm is the campaign's own next step), trained by `campaign.run_sitting` with the arm's
arguments, then measured on the eval set (`drafters/dflash/evalset.py`, the aims' prompts) and
by the loop replayed over held-out corpus records (`campaign heldout --heldout-anchors 0`).

An arm's arguments are those of `campaign run`: retunable recipe fields (`--lr 9e-4`,
`--passes-per-shard 1`) and `--steps`, which by default is one trip over the shard at the arm's
own passes and batch size. `--layers N` or `--taps A,B,C` grows the copy first, as `campaign
grow` does (the predictions stay the same). The shard's target features are computed by the
first arm and read from the cache by the rest, so each arm's `train_seconds` is its own.

Results go to `OUT/arms.json` (each arm's arguments, sitting record and measures) and
`OUT/arms.md` (the table), and are printed. The checkpoint itself is never written: adopt an
arm with `python bench/campaign_adopt.py WORK/NAME LIVE_DIR NOTE`. Pause a live campaign first
(kill -STOP its pid): the arms time their own training.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import json
import logging
import math
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafters.dflash import campaign, campaign_state, evalset

Corpus = tuple[list[dict[str, Any]], list[dict[str, Any]]]

log = logging.getLogger("campaign_arms")


@dataclass
class Arm:
    """One arm: its name and its `campaign run` arguments, read into what the arm does."""

    name: str
    args: str = ""
    retune: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None  # None: one trip over the shard
    grow_layers: int | None = None
    grow_taps: list[int] | None = None

    @classmethod
    def parse(cls, spec: str) -> Arm:
        """`NAME=ARGS`, ARGS as `campaign run` takes them (an empty ARGS: the recipe as is)."""
        name, sep, args = spec.partition("=")
        if not sep or not name or "/" in name:
            raise ValueError(f"an arm is NAME=ARGS (NAME without a slash), not {spec!r}")
        parsed = campaign.build_parser().parse_args(["run", *shlex.split(args)])
        retune = campaign.recipe_args(parsed)
        layers = retune.pop("layers", None)  # a grow, not a retune: no campaign retunes it
        fixed = sorted(k for k in retune if k not in campaign_state.RETUNABLE)
        if fixed:
            raise ValueError(
                f"arm {name}: {', '.join(fixed)} cannot change in a running campaign; an arm may "
                f"retune {', '.join(campaign_state.RETUNABLE)}, or grow by --layers / --taps"
            )
        taps = [int(t) for t in parsed.taps.split(",")] if parsed.taps else None
        return cls(name, args, retune, parsed.steps, layers, taps)


def first_fresh_shard(state: campaign_state.State, shards: list[range]) -> int:
    """The shard the campaign itself trains next (`run --fresh-only`, `campaign.fresh_shard`):
    the one holding the first record no sitting has started training on, or the next one when
    that is mostly trained records; so an adopted arm is the campaign's own next step."""
    reached = state.records_reached or 0
    if reached >= shards[-1].stop:
        raise SystemExit(
            f"no fresh records (all {reached} train records reached): generate data first "
            "(python -m drafters.dflash.build --stages data, then --stages keep)"
        )
    return campaign.fresh_shard(shards, reached)


def send_to_shard(state: campaign_state.State, shard: int, shards: list[range]) -> None:
    """Point the cursor at the start of `shard`: a detour if it holds fresh records (the arm
    trains it as `campaign run` trains new data; fresh records before it count as reached),
    else a plain visit with no fresh records left to draw the cursor elsewhere (a repeated
    shard)."""
    cursor = state.cursor
    if shards[shard].stop > (state.records_reached or 0):
        if cursor.return_to < 0:
            cursor.return_to = cursor.shard
        state.records_reached = shards[shard].start
    else:
        cursor.return_to = -1
        state.records_reached = shards[-1].stop
    cursor.shard, cursor.pass_, cursor.position = shard, 0, 0


def trip_steps(arm: Arm, recipe: campaign_state.Recipe, shard_size: int) -> int:
    """Steps of one trip over a shard: every pass, each a batch at a time."""
    passes = arm.retune.get("passes_per_shard", recipe.passes_per_shard)
    batch = arm.retune.get("batch_size", recipe.batch_size)
    return passes * math.ceil(shard_size / batch)


def measure(
    target: str,
    drafter_dir: Path,
    eval_records: list[dict[str, Any]],
    val_records: int | None,
    cache_root: Path,
    corpus: Corpus,
) -> dict[str, Any]:
    """The eval set (loop replayed per kind) and the loop replay on held-out corpus records."""
    eval_set = evalset.measure(target, drafter_dir, eval_records, cache_root)
    heldout = campaign.heldout_of(target, drafter_dir, val_records, 0, cache_root, corpus=corpus)
    keep = ("tau_loop_mean", "tau_loop_mean_90", "tau_loop", "step")
    return {
        "evalset": {
            **{k: eval_set[k] for k in keep},
            "by_kind": {
                k: {"loop_records": v["loop_records"]} for k, v in eval_set["by_kind"].items()
            },
        },
        "heldout": {
            k: heldout[k]
            for k in ("loss", "acc", "tau", "tau_loop", "acc_by_position", "loop_records")
        },
    }


def against(after: dict[str, Any], before: dict[str, Any]) -> dict[str, list[float]]:
    """After's gain over before on the same records, with its paired 90% bootstrap interval
    (`evalset.loop_interval`): the eval set's `tau_loop_mean` and the held-out records' loop
    tau, each as [difference, low, high]."""
    gains = {}
    for name, a, b, point in (
        ("evalset", after["evalset"]["by_kind"], before["evalset"]["by_kind"],
         after["evalset"]["tau_loop_mean"] - before["evalset"]["tau_loop_mean"]),
        ("loop_tau", {"all": after["heldout"]}, {"all": before["heldout"]},
         after["heldout"]["tau_loop"] - before["heldout"]["tau_loop"]),
    ):  # fmt: skip
        gains[name] = [round(point, 4), *evalset.loop_interval(a, b)]
    return gains


def run_arms(
    arms: list[Arm],
    *,
    target: str,
    start: Path,
    work: Path,
    shard: int | None = None,
    eval_records: list[dict[str, Any]],
    val_records: int | None = None,
    baseline: bool = True,
    cache_root: Path = campaign_state.CACHE_ROOT,
    corpus: Corpus | None = None,
) -> dict[str, Any]:
    """Train and measure each arm from the checkpoint in `start` (never written); the result
    holds the shard, the starting step, a baseline measure of the start (unless not
    `baseline`) and, per arm, its arguments, sitting record and measures."""
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names repeat: {names}")
    corpus = corpus or campaign.corpus_split(target)
    state = campaign_state.read_state(start)
    recipe = state.recipe
    shards = campaign.shard_slices(len(corpus[0]), recipe.shard_records)
    reached = state.records_reached or 0
    shard = first_fresh_shard(state, shards) if shard is None else shard
    if not 0 <= shard < len(shards):
        raise SystemExit(f"shard {shard} does not exist: the corpus has {len(shards)}")
    result: dict[str, Any] = {
        "from": str(start),
        "step": state.step,
        "labels_seen": state.labels_seen,
        "shard": shard,
        "shard_records": len(shards[shard]),
        "fresh_records": max(0, shards[shard].stop - max(shards[shard].start, reached)),
        "arms": {},
    }
    log.info("arms %s from step %d on shard %d", names, state.step, shard)
    if baseline:
        result["baseline"] = measure(target, start, eval_records, val_records, cache_root, corpus)
    for arm in arms:
        directory = work / arm.name
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(start, directory)
        # the arm's own directory in every command it logs: `campaign_adopt` checks for it
        command = f"bench/campaign_arms.py arm {arm.name}: campaign run --drafter-dir {directory}"
        command += f" {arm.args}" if arm.args else ""
        if arm.grow_layers is not None or arm.grow_taps is not None:
            campaign.grow_checkpoint(directory, arm.grow_layers, command, arm.grow_taps)
        arm_state = campaign_state.read_state(directory)
        send_to_shard(arm_state, shard, shards)
        campaign_state.write_json(directory / campaign_state.STATE_FILE, arm_state.to_dict())
        steps = arm.steps or trip_steps(arm, recipe, len(shards[shard]))
        log.info("arm %s: %d steps (%s)", arm.name, steps, arm.args or "the recipe as it is")
        sitting = campaign.run_sitting(
            target_name=target,
            drafter_dir=directory,
            recipe=None,
            minutes=None,
            max_steps=steps,
            checkpoint_minutes=1e9,
            heldout_every=0,
            command=command,
            cache_root=cache_root,
            val_records=val_records,
            corpus=corpus,
            retune=arm.retune,
        )
        keep = ("steps", "labels", "train_seconds", "feature_seconds", "labels_per_s", "cursor")
        result["arms"][arm.name] = {
            "args": arm.args,
            "directory": str(directory),
            "sitting": {k: sitting.get(k) for k in keep},
            **({"retuned": sitting["retuned"]} if "retuned" in sitting else {}),
            **measure(target, directory, eval_records, val_records, cache_root, corpus),
        }
        if baseline:
            result["arms"][arm.name]["vs_start"] = against(
                result["arms"][arm.name], result["baseline"]
            )
    return result


def table(result: dict[str, Any]) -> str:
    """The arms side by side, the baseline first: a Markdown table."""
    kinds = sorted({k for row in _rows(result) for k in row[3]["evalset"]["tau_loop"]})
    head = ["arm", "args", "steps", "train s", "eval set", "vs start [90%]", *kinds,
            "held-out loss", "loop tau", "vs start [90%]"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for name, args, sitting, measures in _rows(result):
        ev, ho = measures["evalset"], measures["heldout"]
        cells = [
            name,
            f"`{args}`" if args else "",
            str(sitting.get("steps", 0)),
            str(sitting.get("train_seconds", 0)),
            f"{ev['tau_loop_mean']:.3f}",
            _gain(measures, "evalset"),
            *(f"{ev['tau_loop'][k]:.3f}" for k in kinds),
            f"{ho['loss']:.3f}",
            f"{ho['tau_loop']:.3f}" if ho["tau_loop"] is not None else "",
            _gain(measures, "loop_tau"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _gain(measures: dict[str, Any], name: str) -> str:
    if "vs_start" not in measures:
        return ""
    point, low, high = measures["vs_start"][name]
    return f"{point:+.3f} [{low:+.3f}, {high:+.3f}]"


def _rows(result: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    rows = []
    if "baseline" in result:
        rows.append((f"start (step {result['step']})", "", {}, result["baseline"]))
    for name, arm in result["arms"].items():
        rows.append((name, arm["args"], arm["sitting"], arm))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arm", action="append", required=True, metavar="NAME=ARGS")
    parser.add_argument("--target", default=campaign_state.DEFAULT_TARGET)
    parser.add_argument(
        "--from", dest="start", type=Path, default=campaign_state.DEFAULT_DRAFTER_DIR
    )
    parser.add_argument("--work", type=Path, required=True, help="where the arms' copies go")
    parser.add_argument("--out", type=Path, required=True, help="arms.json and arms.md go here")
    parser.add_argument("--shard", type=int, help="default: the one the campaign trains next")
    parser.add_argument("--val-records", type=int, default=68, help="held-out records measured")
    parser.add_argument("--evalset", type=Path, help="default: evalsets/<target>.jsonl.gz")
    parser.add_argument(
        "--no-baseline", dest="baseline", action="store_false", help="skip measuring the start"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        arms = [Arm.parse(spec) for spec in args.arm]
    except ValueError as error:
        parser.error(str(error))
    path = args.evalset or evalset.evalset_path(args.target)
    result = run_arms(
        arms,
        target=args.target,
        start=args.start,
        work=args.work,
        shard=args.shard,
        eval_records=evalset.read_evalset(path),
        val_records=args.val_records,
        baseline=args.baseline,
    )
    result["command"] = "python bench/campaign_arms.py " + shlex.join(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "arms.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "arms.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
