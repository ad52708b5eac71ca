"""The issue's held-out prompts as a fixed eval set, measured offline by replaying the loop.

    python -m drafters.dflash.evalset build [--per-kind 24]   # once: the target's continuations
    python -m drafters.dflash.evalset measure [--drafter-dir D] [--log]
    python -m drafters.dflash.evalset compare --drafter-dir D --before E   # D's gain over E

`campaign eval` runs the real speculative loop on 3 held-out prompts a kind for 64 tokens: a
minute, but a coarse measure (a sitting's gain is often inside its noise). Here the first
`per_kind` prompts of each kind from the mix's held-out files (`prompt_mix.build_prompts
("held_out", ...)`, the split the bench's aims are stated on) are generated once, greedy, by the
target, and kept in the repository (`evalsets/<target>.jsonl.gz`). A measure is then the
greedy loop replayed over every record's whole continuation (`campaign.loop_steps_over` on the
offline accepted runs, which equal the real loop's: `tests/test_campaign.py`), at the drafter's
own depth: 4x the prompts and 2-4x the tokens of `campaign eval`, in about as long once the
target's features are cached.

The records are never trained on: the campaign's corpus holds only `train`-split prompts, and
these files are outside `corpus/`.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import asyncio
import gzip
import json
import logging
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from drafters.dflash import campaign, campaign_state
from drafters.dflash.corpus import read_part
from drafters.dflash.train import read_jsonl_records

EVALSET_ROOT = Path(__file__).resolve().parent / "evalsets"
DEFAULT_PER_KIND = 24

log = logging.getLogger(__name__)


def evalset_path(target: str, root: Path = EVALSET_ROOT) -> Path:
    return root / f"{Path(target).name}.jsonl.gz"


def read_evalset(path: Path) -> list[dict[str, Any]]:
    return read_part(path)


def write_evalset(records: list[dict[str, Any]], path: Path) -> Path:
    """Sorted by kind then key, gzip without a timestamp: the same records, the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = sorted(records, key=lambda r: (r["kind"], r["key"]))
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in ordered).encode())
    return path


def build_evalset(target: str, per_kind: int, path: Path) -> Path:
    """Generate (greedy, the corpus's limits) the target's continuations of the held-out split's
    first `per_kind` prompts of each kind and write them to `path`."""
    from drafters.dflash.datagen import DEFAULT_MAX_TOKENS, generate_mix
    from drafters.dflash.prompt_mix import build_prompts

    prompts = build_prompts("held_out", per_kind)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "held_out.jsonl"
        asyncio.run(generate_mix(target, prompts, out, max_tokens=DEFAULT_MAX_TOKENS))
        return write_evalset(read_jsonl_records(out), path)


def measure(
    target: str, drafter_dir: Path, records: list[dict[str, Any]], cache_root: Path
) -> dict[str, Any]:
    """Per kind: tokens a step of the greedy loop replayed (`tau_loop`), the mean over anchors
    (`tau`), and the held-out loss; `tau_loop_mean` averages the kinds, as `campaign eval`."""
    trainer = campaign.trainer_for(target, drafter_dir, cache_root)
    state, depth = trainer.state, trainer.model.config.block_size - 1
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in records}):
        sequences = campaign.to_sequences(
            [r for r in records if r["kind"] == kind], state.recipe.max_len
        )
        result = trainer.heldout(trainer.store(sequences), sequences, anchors_per_record=0)
        by_kind[kind] = {
            "tau_loop": result["tau_loop"],
            "tau": result["tau"],
            "loss": round(result["loss"], 4),
            "records": len(sequences),
            "loop_records": result.get("loop_records", []),
        }
        log.info(
            "%s: tau_loop %.3f (mean over anchors %.3f)", kind, result["tau_loop"], result["tau"]
        )
    return {
        "tau_loop": {k: v["tau_loop"] for k, v in by_kind.items()},
        "tau_loop_mean": round(float(np.mean([v["tau_loop"] for v in by_kind.values()])), 4),
        "tau_loop_mean_90": loop_interval(by_kind),
        "by_kind": by_kind,
        "depth": depth,
        "step": state.step,
        "labels_seen": state.labels_seen,
    }


def loop_interval(
    after: dict[str, dict[str, Any]],
    before: dict[str, dict[str, Any]] | None = None,
    *,
    rounds: int = 4000,
    level: float = 0.9,
    seed: int = 0,
) -> list[float]:
    """A bootstrap interval of `tau_loop_mean` over the eval set's records (each kind's records
    drawn with replacement, each kind's tau the drawn records' tokens over their steps, the
    mean over kinds), from a measure's `by_kind`. With `before` (a measure of another
    checkpoint on the same records), the interval of after minus before, the same records
    drawn for both: paired, so the records' own difficulty cancels and a sitting's gain can
    be told from the eval set's noise."""
    rng = np.random.default_rng(seed)
    total = np.zeros(rounds)
    for kind, measured in after.items():
        a = np.asarray(measured["loop_records"], dtype=np.float64).reshape(-1, 3)
        draws = rng.integers(0, len(a), size=(rounds, len(a)))
        tau = a[draws, 1].sum(1) / a[draws, 2].sum(1)
        if before is not None:
            b = np.asarray(before[kind]["loop_records"], dtype=np.float64).reshape(-1, 3)
            if not np.array_equal(a[:, 0], b[:, 0]):
                raise ValueError(f"{kind}: the two measures are not over the same records")
            tau = tau - b[draws, 1].sum(1) / b[draws, 2].sum(1)
        total += tau
    mean = total / max(len(after), 1)
    tail = (1.0 - level) / 2 * 100
    return [round(float(np.percentile(mean, tail)), 4),
            round(float(np.percentile(mean, 100 - tail)), 4)]  # fmt: skip


def compare(
    target: str, drafter_dir: Path, before_dir: Path, records: list[dict[str, Any]]
) -> dict[str, Any]:
    """Both checkpoints measured on the eval set, and the first's gain in `tau_loop_mean` over
    the second with its paired 90% interval (`loop_interval`): per kind and overall."""
    after = measure(target, drafter_dir, records, campaign_state.CACHE_ROOT)
    before = measure(target, before_dir, records, campaign_state.CACHE_ROOT)
    a, b = after["by_kind"], before["by_kind"]

    def summary(directory: Path, measured: dict[str, Any]) -> dict[str, Any]:
        keys = ("step", "tau_loop", "tau_loop_mean")
        return {"dir": str(directory), **{k: measured[k] for k in keys}}

    return {
        "after": summary(drafter_dir, after),
        "before": summary(before_dir, before),
        "gain": round(after["tau_loop_mean"] - before["tau_loop_mean"], 4),
        "gain_90": loop_interval(a, b),
        "gain_by_kind": {
            kind: [round(a[kind]["tau_loop"] - b[kind]["tau_loop"], 4),
                   *loop_interval({kind: a[kind]}, {kind: b[kind]})]
            for kind in sorted(a)
        },
    }  # fmt: skip


def log_measure(drafter_dir: Path, result: dict[str, Any], command: str) -> None:
    """Append the measure to the drafter's sittings log (the card shows the newest), without
    the per-record loops (they serve intervals, and would bloat the log)."""
    state = campaign_state.read_state(drafter_dir)
    by_kind = {
        kind: {k: v for k, v in measured.items() if k != "loop_records"}
        for kind, measured in result["by_kind"].items()
    }
    entry = {**campaign_state.log_entry("evalset", command, state), **result, "by_kind": by_kind}
    campaign_state.write_json(
        drafter_dir / campaign_state.SITTINGS_FILE,
        campaign_state.read_sittings(drafter_dir) + [entry],
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m drafters.dflash.evalset " + " ".join(shlex.quote(a) for a in argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("action", choices=("build", "measure", "compare"))
    parser.add_argument("--target", default=campaign_state.DEFAULT_TARGET)
    parser.add_argument("--drafter-dir", type=Path, default=campaign_state.DEFAULT_DRAFTER_DIR)
    parser.add_argument("--per-kind", type=int, default=DEFAULT_PER_KIND)
    parser.add_argument("--evalset", type=Path, help="default: evalsets/<target>.jsonl.gz")
    parser.add_argument("--log", action="store_true", help="measure: add it to the sittings log")
    parser.add_argument("--before", type=Path, help="compare: the checkpoint measured against")
    args = parser.parse_args(argv)
    if args.action == "compare" and args.before is None:
        parser.error("compare needs --before DIR (the checkpoint --drafter-dir is set against)")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    path = args.evalset or evalset_path(args.target)
    if args.action == "build":
        print(f"wrote {build_evalset(args.target, args.per_kind, path)}")
        return 0
    records = read_evalset(path)
    if args.action == "compare":
        print(json.dumps(compare(args.target, args.drafter_dir, args.before, records)))
        return 0
    result = measure(args.target, args.drafter_dir, records, campaign_state.CACHE_ROOT)
    if args.log:
        log_measure(args.drafter_dir, result, command)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
