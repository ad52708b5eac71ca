"""`bench/campaign_arms.py`: paired arms trained from one checkpoint over the same shard (by
default the one the campaign trains next: it holds the first fresh record), measured alike, the
checkpoint itself never written."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from bench.campaign_adopt import adopt
from bench.campaign_arms import Arm, main, run_arms, send_to_shard, table
from drafters.dflash import campaign, campaign_state
from drafters.dflash.campaign_state import Cursor, Recipe

VOCAB = 256  # the bundled tiny tokenizer's ids are all below this


def _records(n: int, seed: int, kind: str | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "key": f"r{seed}-{i}",
            "prompt_tokens": 6,
            "tokens": rng.integers(3, VOCAB, size=int(rng.integers(20, 40))).tolist(),
            **({"kind": kind} if kind else {}),
        }
        for i in range(n)
    ]


def _tiny_recipe() -> Recipe:
    return Recipe(
        layers=2, block_size=4, mask_token_id=2, draft_vocab=128, num_anchors=6, batch_size=2,
        shard_records=4, passes_per_shard=1, top_k=4, warmup_steps=2, rewarm_steps=1,
    )  # fmt: skip


def _digest(directory: Path) -> str:
    digest = hashlib.sha1()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + path.read_bytes())
    return digest.hexdigest()


def test_an_arm_reads_campaign_run_arguments_and_refuses_what_no_campaign_retunes():
    arm = Arm.parse("B=--passes-per-shard 2 --lr 5e-4 --steps 9")
    assert (arm.name, arm.retune, arm.steps) == ("B", {"passes_per_shard": 2, "lr": 5e-4}, 9)
    grown = Arm.parse("G=--layers 3 --taps 1,4")
    assert (grown.retune, grown.grow_layers, grown.grow_taps) == ({}, 3, [1, 4])
    assert Arm.parse("P3=") == Arm("P3")
    with pytest.raises(ValueError, match="shard_records cannot change"):
        Arm.parse("X=--shard-records 256")
    with pytest.raises(ValueError, match="NAME=ARGS"):
        Arm.parse("--lr 1e-4")


def test_the_command_line_refuses_an_arm_by_name_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--arm", "X=--shard-records 256", "--work", str(tmp_path), "--out", str(tmp_path)])
    assert "arm X: shard_records cannot change" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_cursor_goes_to_a_fresh_shard_on_a_detour_and_to_an_old_one_plainly():
    shards = campaign.shard_slices(18, 4)  # 0-4, 4-8, 8-12, 12-16, 16-18
    fresh = campaign_state.State(cursor=Cursor(shard=1, position=2, wraps=1), records_reached=10)
    send_to_shard(fresh, 2, shards)  # holds records 10 and 11, the first fresh ones
    assert (fresh.cursor.shard, fresh.cursor.position, fresh.cursor.return_to) == (2, 0, 1)
    assert fresh.records_reached == 8  # the detour runs on from shard 2 to the corpus's end
    old = campaign_state.State(cursor=Cursor(shard=1, return_to=4), records_reached=10)
    send_to_shard(old, 0, shards)
    assert (old.cursor.shard, old.cursor.return_to, old.records_reached) == (0, -1, 18)


def test_arms_train_the_first_fresh_shard_from_one_checkpoint_and_can_be_adopted(
    qwen3_target_dir: Path, tmp_path: Path
):
    old, held_out = _records(10, seed=0), _records(2, seed=1)
    start = tmp_path / "live"
    cache = tmp_path / "cache"
    common = dict(target_name=str(qwen3_target_dir), minutes=None, checkpoint_minutes=1e9,
                  heldout_every=0, command="test", cache_root=cache)  # fmt: skip
    # 6 steps of 2 records over shards 0-4, 4-8, 8-10: wrapped once, every record reached
    campaign.run_sitting(drafter_dir=start, recipe=_tiny_recipe(), max_steps=6,
                         corpus=(old, held_out), **common)  # fmt: skip
    before = _digest(start)
    # 8 new records: shards 0-4, 4-8, 8-12, 12-16, 16-18; record 10, the first new one, is in
    # shard 2 (with old records 8 and 9): the shard `run --fresh-only` would train next
    corpus = (old + _records(8, seed=2), held_out)
    eval_records = _records(2, seed=3, kind="chat") + _records(2, seed=4, kind="editing")
    arms = [Arm.parse("A="), Arm.parse("B=--passes-per-shard 2 --lr 5e-4"),
            Arm.parse("G=--layers 3 --steps 1")]  # fmt: skip
    result = run_arms(arms, target=str(qwen3_target_dir), start=start, work=tmp_path / "arms",
                      eval_records=eval_records, cache_root=cache, corpus=corpus)  # fmt: skip

    assert _digest(start) == before, "the starting checkpoint is never written"
    assert (result["shard"], result["shard_records"], result["fresh_records"]) == (2, 4, 2)
    first = result["step"]
    for name, steps in (("A", 2), ("B", 4), ("G", 1)):
        arm = result["arms"][name]
        state = campaign_state.read_state(Path(arm["directory"]))
        assert arm["sitting"]["steps"] == steps and state.step == first + steps
        assert set(arm["evalset"]["tau_loop"]) == {"chat", "editing"}
        assert arm["heldout"]["tau_loop"] is not None  # every anchor: the loop replayed
        for measure in ("evalset", "loop_tau"):  # paired with the start, on the same records
            gain, low, high = arm["vs_start"][measure]
            assert low <= high and -3.0 < gain < 3.0
    # one trip over shard 2 (one pass or two) leaves the cursor at the start of shard 3, still
    # on the detour over the new records
    for name in ("A", "B"):
        cursor = result["arms"][name]["sitting"]["cursor"]
        assert (cursor["shard"], cursor["position"], cursor["return_to"]) == (3, 0, 0)
    assert result["arms"]["B"]["retuned"] == {"passes_per_shard": [1, 2], "lr": [1e-3, 5e-4]}
    grown = campaign_state.read_sittings(Path(result["arms"]["G"]["directory"]))
    assert [s["stage"] for s in grown[-2:]] == ["grow", "sitting"]
    assert campaign_state.read_state(Path(result["arms"]["G"]["directory"])).recipe.layers == 3
    assert result["baseline"]["evalset"]["step"] == first

    json.dumps(result)  # arms.json: plain numbers throughout
    rows = table(result).splitlines()
    assert rows[2].startswith(f"| start (step {first}) |") and len(rows) == 6
    assert rows[4].startswith("| B | `--passes-per-shard 2 --lr 5e-4` | 4 |")
    gain, low, high = result["arms"]["B"]["vs_start"]["evalset"]
    assert f"| {gain:+.3f} [{low:+.3f}, {high:+.3f}] |" in rows[4]
    assert rows[2].count("|  |") >= 2  # the start has no gain over itself

    adopted = adopt(Path(result["arms"]["B"]["directory"]), start, "two passes")
    assert adopted["step"] == first + 4
    log = json.loads((start / campaign_state.SITTINGS_FILE).read_text())
    assert log[-1]["note"] == "two passes" and log[-1]["retuned"]["lr"] == [1e-3, 5e-4]
