"""Data generation that keeps its features (`build --stages data --keep-features`) against
plain data generation followed by the campaign's feature pass, in alternating arms.

    PYTHONPATH=. python bench/datagen_arms.py --seconds 540 --rounds 2 --out DIR

Each arm runs `python -m drafters.dflash.build --stages data` alone for `--seconds` (stopped by
SIGTERM, as a sitting stops it), so every arm appends real records to the build's work file.
A plain arm's records still need the feature pass; a keeping arm's do not (the pass copies
what it kept). So after the arms the pass is timed on a sample of the plain arms' records,
and each arm is scored by its work rate over all the seconds its records cost:

    (generated + ALPHA x prompt tokens) / (arm seconds + feature-pass seconds of its records)

ALPHA (0.2) weighs a prompt token at its prefill cost against a generated token's share of a
32-row decode step, since an arm stopped mid-window has done its window's short prompts first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK_DATA = Path.home() / ".cache/flashbatch/drafter-build/smollm2-135m-instruct/data.jsonl"
START = re.compile(r"^(\S+ \S+),\d+ INFO drafters\.dflash\.datagen: \d+ prompts, (\d+) done")
LINE = re.compile(r"^(\S+ \S+),\d+ INFO drafters\.dflash\.datagen: (\d+)/\d+ written, (\d+) tokens")
ARMS = {"keeping": ["--keep-features"], "plain": []}


def run_arm(name: str, seconds: int, log: Path, target: str) -> None:
    command = [sys.executable, "-m", "drafters.dflash.build", "--target", target,
               "--stages", "data", "--per-kind", "8000", *ARMS[name]]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log.open("w") as out:
        process = subprocess.Popen(["nice", "-n", "19", *command], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO, env=env)  # fmt: skip
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.terminate()  # SIGTERM: the build records the sitting and exits
            process.wait()


def arm_records(log: Path, records: list[dict]) -> dict:
    """The span and records of one arm, from its log's first and last progress lines."""
    start = offset = last = None
    for line in log.read_text().splitlines():
        if start is None and (m := START.match(line)):
            start, offset = datetime.fromisoformat(m.group(1)), int(m.group(2))
        elif m := LINE.match(line):
            last = (datetime.fromisoformat(m.group(1)), int(m.group(2)), int(m.group(3)))
    if start is None or last is None:
        raise ValueError(f"{log}: no progress lines")
    mine = records[offset : offset + last[1]]
    generated = sum(len(r["tokens"]) - r["prompt_tokens"] for r in mine)
    if generated != last[2]:
        raise ValueError(f"{log.name}: the log says {last[2]} tokens, the records {generated}")
    return {"seconds": (last[0] - start).total_seconds(), "records": mine}


def pass_seconds_per_token(records: list[dict], target: str, sample: int) -> float:
    """The campaign's feature pass (its taps and top-k) over `sample` records, timed."""
    import numpy as np

    from drafters.dflash.campaign import load_target
    from drafters.dflash.campaign_state import DEFAULT_DRAFTER_DIR, Recipe
    from drafters.dflash.checkpoint import read_config
    from drafters.dflash.features import FeatureStore

    taps = read_config(DEFAULT_DRAFTER_DIR).target_layer_ids
    model, _ = load_target(target, taps, 0)
    tokens = [np.array(r["tokens"], dtype=np.int32) for r in records[:sample]]
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        FeatureStore.build(model, tokens, Path(root), target, top_k=Recipe().top_k)
        seconds = time.perf_counter() - started
    return seconds / sum(len(t) for t in tokens)


def score(name: str, span: dict, per_token: float, alpha: float) -> dict:
    mine = span["records"]
    generated = sum(len(r["tokens"]) - r["prompt_tokens"] for r in mine)
    prompt = sum(r["prompt_tokens"] for r in mine)
    pass_seconds = per_token * (generated + prompt) if name == "plain" else 0.0
    effort = generated + alpha * prompt
    return {
        "arm": name, "seconds": round(span["seconds"]), "records": len(mine),
        "kinds": dict(Counter(r["kind"] for r in mine)),
        "generated_tok_s": round(generated / span["seconds"], 1),
        "effort_s": round(effort / span["seconds"], 1),
        "pass_seconds": round(pass_seconds),
        "effort_s_with_pass": round(effort / (span["seconds"] + pass_seconds), 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=int, default=540)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--pass-sample", type=int, default=96, help="records the pass is timed on")
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--score-only", action="store_true", help="score the logs in --out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.score_only:
        for round_ in range(1, args.rounds + 1):
            for name in ARMS:
                run_arm(name, args.seconds, args.out / f"{name}-round{round_}.log", args.target)
    records = [json.loads(line) for line in WORK_DATA.read_text().splitlines() if line.strip()]
    logs = sorted(args.out.glob("*-round*.log"), key=lambda p: p.stat().st_mtime)
    spans = {log: arm_records(log, records) for log in logs}
    plain = [
        r for log, span in spans.items() if log.name.startswith("plain") for r in span["records"]
    ]
    per_token = pass_seconds_per_token(plain, args.target, args.pass_sample)
    rows = [{"log": log.name, **score(log.name.split("-")[0], span, per_token, args.alpha)}
            for log, span in spans.items()]  # fmt: skip
    result = {"pass_ms_per_token": round(per_token * 1000, 3), "alpha": args.alpha, "arms": rows}
    (args.out / "arms.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"feature pass: {per_token * 1000:.3f} ms a token (on {args.pass_sample} plain records)")
    print("| arm | seconds | records | generated tok/s | effort/s | pass s | effort/s with pass |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['log']} | {r['seconds']} | {r['records']} | {r['generated_tok_s']} | "
              f"{r['effort_s']} | {r['pass_seconds']} | {r['effort_s_with_pass']} |")  # fmt: skip


if __name__ == "__main__":
    main()
