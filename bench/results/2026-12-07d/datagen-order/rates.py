"""Each arm's data generation rate, from its log and the records it wrote.

    python rates.py [DATA_JSONL] [ALPHA]

An arm's log says how many records the work file held when it started (its records follow
them, in the order they finished) and, every 50 records, how many it had written and when.
Over the span from its start to its last such line: generated tokens a second, records by
kind, and an effort rate, (generated + ALPHA x prompt tokens) a second, since a 256-window
arm stopped mid-window has done its window's short prompts first (chat and prose) and the
kinds differ in prompt length; ALPHA (default 0.2) is a prompt token's prefill cost against a
generated token's share of a 32-row decode step (about 1.6 against 7.8 ms here).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path

START = re.compile(r"^(\S+ \S+),\d+ INFO drafters\.dflash\.datagen: \d+ prompts, (\d+) done")
LINE = re.compile(r"^(\S+ \S+),\d+ INFO drafters\.dflash\.datagen: (\d+)/\d+ written, (\d+) tokens")
DEFAULT_DATA = Path.home() / ".cache/flashbatch/drafter-build/smollm2-135m-instruct/data.jsonl"


def arm(log: Path, records: list[dict], alpha: float) -> dict:
    start = offset = None
    last = None
    for line in log.read_text().splitlines():
        if start is None and (m := START.match(line)):
            start, offset = datetime.fromisoformat(m.group(1)), int(m.group(2))
        elif m := LINE.match(line):
            last = (datetime.fromisoformat(m.group(1)), int(m.group(2)), int(m.group(3)))
    seconds = (last[0] - start).total_seconds()
    mine = records[offset : offset + last[1]]
    generated = sum(len(r["tokens"]) - r["prompt_tokens"] for r in mine)
    prompt = sum(r["prompt_tokens"] for r in mine)
    if generated != last[2]:
        raise ValueError(f"{log.name}: the log says {last[2]} tokens, the records {generated}")
    return {
        "arm": log.stem, "seconds": round(seconds), "records": len(mine),
        "kinds": dict(Counter(r["kind"] for r in mine)),
        "generated_tok_s": round(generated / seconds, 1),
        "prompt_tok_s": round(prompt / seconds, 1),
        "effort_s": round((generated + alpha * prompt) / seconds, 1),
    }  # fmt: skip


def main() -> None:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA
    alpha = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    logs = sorted(Path(__file__).parent.glob("window*-round*.log"), key=lambda p: p.stat().st_mtime)
    rows = [arm(log, records, alpha) for log in logs]
    print(f"| arm | seconds | records | chat / completion / editing | generated tok/s | "
          f"prompt tok/s | effort (gen + {alpha:g} x prompt)/s |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        kinds = " / ".join(str(r["kinds"].get(k, 0)) for k in ("chat", "completion", "editing"))
        print(f"| {r['arm']} | {r['seconds']} | {r['records']} | {kinds} | "
              f"{r['generated_tok_s']} | {r['prompt_tok_s']} | {r['effort_s']} |")  # fmt: skip
    (Path(__file__).parent / "rates.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
