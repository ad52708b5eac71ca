"""The drafter build's data kept in the repository: parts written once, read back on a fresh
machine, and a build that resumes from them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from drafters.dflash import build, corpus


def _record(key: str, n: int = 5) -> dict:
    return {"key": key, "kind": "completion", "prompt": f"text of {key}", "chat": False,
            "prompt_tokens": 2, "tokens": list(range(n))}  # fmt: skip


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_new_records_become_one_part_and_a_fresh_machine_gets_them_back(tmp_path):
    parts, first = tmp_path / "corpus", tmp_path / "machine1" / "data.jsonl"
    _write(first, [_record("a"), _record("b")])
    part = corpus.export_new_part(first, parts, stamp="20261202-000000")
    assert part is not None and part.name == "part-20261202-000000.jsonl.gz"
    # Only what training and the resume need: the prompt text is dropped.
    kept = [json.loads(line) for line in gzip.open(part, "rt")]
    assert [r["key"] for r in kept] == ["a", "b"] and "prompt" not in kept[0]
    assert kept[0]["tokens"] == list(range(5)) and kept[0]["prompt_tokens"] == 2

    # Nothing new: no part. A later sitting's new records: a second part, the first untouched.
    before = part.read_bytes()
    assert corpus.export_new_part(first, parts, stamp="20261202-000001") is None
    _write(first, [_record("c", 9)])
    second = corpus.export_new_part(first, parts, stamp="20261202-010000")
    assert [json.loads(x)["key"] for x in gzip.open(second, "rt")] == ["c"]
    assert part.read_bytes() == before

    fresh = tmp_path / "machine2" / "data.jsonl"
    assert corpus.import_parts(parts, fresh) == 3
    assert corpus.import_parts(parts, fresh) == 0  # idempotent
    assert [r["key"] for r in _lines(fresh)] == ["a", "b", "c"]
    assert build.data_facts(fresh.parent)["generated_tokens"] == 3 + 3 + 7
    # A machine that already generated some keeps its own and takes only the rest.
    partial = tmp_path / "machine3" / "data.jsonl"
    _write(partial, [_record("b")])
    assert corpus.import_parts(parts, partial) == 2
    assert sorted(r["key"] for r in _lines(partial)) == ["a", "b", "c"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_part_is_never_rewritten_and_its_bytes_depend_on_its_records_only(tmp_path):
    data = tmp_path / "data.jsonl"
    _write(data, [_record("a")])
    one = corpus.export_new_part(data, tmp_path / "p1", stamp="x")
    two = corpus.export_new_part(data, tmp_path / "p2", stamp="x")
    assert one.read_bytes() == two.read_bytes()  # no timestamp inside the gzip
    _write(data, [_record("b")])
    with pytest.raises(FileExistsError):
        corpus.export_new_part(data, tmp_path / "p1", stamp="x")


def test_sittings_travel_with_the_parts(tmp_path):
    here, there = tmp_path / "work" / "sittings.json", tmp_path / "corpus" / "sittings.json"
    here.parent.mkdir()
    log = [{"command": "build --stages data", "at": "2026-12-01 10:00", "stage": "data"},
           {"command": "build --stages fit", "at": "2026-12-01 12:00", "stage": "fit"}]  # fmt: skip
    here.write_text(json.dumps(log))
    assert corpus.merge_sittings(here, there) == 2
    assert corpus.merge_sittings(here, there) == 0
    # A fresh machine's sitting is merged in time order with the ones the repository kept.
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps([{"command": "build --stages eval", "at": "2026-12-01 11:00",
                                  "stage": "eval"}]))  # fmt: skip
    assert corpus.merge_sittings(fresh, there) == 1
    assert [s["stage"] for s in json.loads(there.read_text())] == ["data", "eval", "fit"]


def test_the_keep_stage_writes_a_part_and_the_sittings_log(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "corpus_dir", lambda target: tmp_path / "corpus" / target)
    work = tmp_path / "work"
    _write(work / "data.jsonl", [_record("a"), _record("b")])
    assert build.main(["--target", "tiny", "--work-dir", str(work), "--stages", "keep"]) == 0
    kept = tmp_path / "corpus" / "tiny"
    assert [r["key"] for r in corpus.read_parts(kept)] == ["a", "b"]
    assert json.loads((kept / "sittings.json").read_text())[0]["stage"] == "keep"


def test_a_fresh_machine_fits_on_the_kept_records(tmp_path, monkeypatch):
    """`fit` on an empty work directory takes the repository's parts in first: the records a
    machine that is gone generated are what the drafter trains on."""
    monkeypatch.setattr(build, "corpus_dir", lambda target: tmp_path / "corpus")
    old = tmp_path / "gone" / "data.jsonl"
    _write(old, [{**_record("k"), "kind": "prose", "prompt_tokens": 4,
                  "tokens": list(range(10, 60))}])  # fmt: skip
    corpus.export_new_part(old, tmp_path / "corpus", stamp="1")
    work = tmp_path / "fresh"
    build.main(["--target", "bundled", "--work-dir", str(work), "--stages", "fit", "--steps", "2",
                "--layers", "1", "--block-size", "4", "--batch-size", "1", "--num-anchors", "4",
                "--max-len", "64"])  # fmt: skip
    (fit,) = [s for s in json.loads((work / "sittings.json").read_text()) if s["stage"] == "fit"]
    assert fit["sequences"] == 1 and fit["steps"] == 2
    assert [r["key"] for r in _lines(work / "data.jsonl")] == ["k"]
