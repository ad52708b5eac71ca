"""The drafter build's data kept in the repository, so hours of generation outlive a machine.

A build's work directory (`~/.cache/flashbatch/drafter-build/<target>/`) lives on one machine;
a fresh machine starts it empty, and every hour of target generation it held is lost. The
records themselves are small (token ids), so each sitting's new records are also written to the
repository as one compressed part that is never rewritten:

    drafters/dflash/corpus/<target>/part-<UTC stamp>.jsonl.gz

`import_parts` seeds a work directory's `data.jsonl` from the parts (the data stage then skips
every prompt already generated), and `export_new_part` writes the records that no part holds yet.
A part keeps what training and the resume need: key, kind, chat, prompt_tokens and tokens (the
prompt text is rebuilt from the key's prompt mix, so it is dropped).
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any

from drafters.dflash.train import read_jsonl_records

CORPUS_ROOT = Path(__file__).resolve().parent / "corpus"
KEPT_FIELDS = ("key", "kind", "chat", "prompt_tokens", "tokens")


def corpus_dir(target: str, root: Path = CORPUS_ROOT) -> Path:
    """Where the parts of `target` (a registry name, or a path whose last part names it) live."""
    return root / Path(target).name


def part_paths(directory: Path) -> list[Path]:
    """The parts in the order they were written (their names sort by UTC stamp)."""
    return sorted(directory.glob("part-*.jsonl.gz"))


def read_part(path: Path) -> list[dict[str, Any]]:
    """The records of one gzipped JSONL file (a part, or an eval set)."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_parts(directory: Path) -> list[dict[str, Any]]:
    return [r for path in part_paths(directory) for r in read_part(path)]


def import_parts(directory: Path, data_path: Path) -> int:
    """Append to `data_path` every part record whose key it lacks; return how many."""
    have = {r.get("key") for r in read_jsonl_records(data_path)}
    missing = [r for r in read_parts(directory) if r["key"] not in have]
    if missing:
        data_path.parent.mkdir(parents=True, exist_ok=True)
        with data_path.open("a") as out:
            out.writelines(json.dumps(r) + "\n" for r in missing)
    return len(missing)


def export_new_part(data_path: Path, directory: Path, stamp: str | None = None) -> Path | None:
    """Write the records of `data_path` that no part holds into a new part; None if none."""
    kept = {r["key"] for r in read_parts(directory)}
    new = [
        {name: r[name] for name in KEPT_FIELDS}
        for r in read_jsonl_records(data_path)
        if "key" in r and r["key"] not in kept
    ]
    if not new:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"part-{stamp or time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.jsonl.gz"
    if path.exists():
        raise FileExistsError(f"{path} exists; parts are never rewritten")
    staging = path.with_suffix(".tmp")
    # mtime=0: the same records give the same bytes, so a re-export changes nothing in git.
    with gzip.GzipFile(staging, "wb", compresslevel=9, mtime=0) as f:
        f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in new).encode())
    staging.replace(path)
    return path


def merge_sittings(source: Path, dest: Path) -> int:
    """Append to the sittings log `dest` the sittings of `source` it lacks; return how many.

    Sittings are the build's `sittings.json` entries (command, time, stage stats); the card
    lists them all, so the log travels with the parts.
    """
    theirs = json.loads(source.read_text()) if source.exists() else []
    ours = json.loads(dest.read_text()) if dest.exists() else []
    seen = {(s["command"], s["at"], s.get("stage")) for s in ours}
    new = [s for s in theirs if (s["command"], s["at"], s.get("stage")) not in seen]
    if new:
        dest.parent.mkdir(parents=True, exist_ok=True)
        merged = sorted(ours + new, key=lambda s: s["at"])  # "YYYY-MM-DD HH:MM" sorts as time
        dest.write_text(json.dumps(merged, indent=1) + "\n")
    return len(new)
