"""`bench/campaign_adopt.py`: a paired arm becomes the campaign's checkpoint only when it began
from the live one, and only with changes a campaign can make (retunes, or a logged grow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.campaign_adopt import adopt

RECIPE = {"lr": 3e-4, "layers": 2, "shard_records": 512}


def _checkpoint(directory: Path, sittings: list[dict], recipe: dict, weights: bytes) -> Path:
    (directory / "training").mkdir(parents=True)
    (directory / "training/sittings.json").write_text(json.dumps(sittings))
    (directory / "training/state.json").write_text(
        json.dumps({"step": len(sittings), "recipe": recipe})
    )
    for name in ("model.safetensors", "config.json", "draft_vocab.safetensors"):
        (directory / name).write_bytes(weights + name.encode())
    return directory


def _leg(stage: str, arm: Path, **fields) -> dict:
    return {"stage": stage, "command": f"campaign {stage} --drafter-dir {arm}", **fields}


def test_an_arm_that_began_with_a_grow_is_adopted_with_its_grow_logged(tmp_path):
    first = {"stage": "sitting", "command": "campaign run"}
    live = _checkpoint(tmp_path / "live", [first], RECIPE, b"old")
    arm = tmp_path / "arm"
    legs = [_leg("grow", arm, taps=[[1, 27], [1, 14, 27]]), _leg("sitting", arm)]
    _checkpoint(arm, [first, *legs], {**RECIPE, "lr": 1e-4}, b"new")

    result = adopt(arm, live, "a third tap")
    log = json.loads((live / "training/sittings.json").read_text())
    assert [s["stage"] for s in log] == ["sitting", "grow", "sitting"]
    assert all(s["note"] == "a third tap" for s in log[1:])
    assert log[2]["retuned"] == {"lr": [3e-4, 1e-4]} and "retuned" not in log[1]
    assert (live / "model.safetensors").read_bytes() == b"newmodel.safetensors"
    assert result["retuned"] == {"lr": [3e-4, 1e-4]}


def test_an_arm_is_refused_for_a_change_no_campaign_makes_or_without_a_sitting(tmp_path):
    first = {"stage": "sitting", "command": "campaign run"}
    live = _checkpoint(tmp_path / "live", [first], RECIPE, b"old")

    cut = tmp_path / "cut"
    _checkpoint(cut, [first, _leg("sitting", cut)], {**RECIPE, "shard_records": 256}, b"x")
    with pytest.raises(SystemExit, match="shard_records"):
        adopt(cut, live, "note")

    deeper = tmp_path / "deeper"  # more layers with no grow in its log
    _checkpoint(deeper, [first, _leg("sitting", deeper)], {**RECIPE, "layers": 3}, b"x")
    with pytest.raises(SystemExit, match="layers"):
        adopt(deeper, live, "note")

    grown = tmp_path / "grown"  # the same, grown by `campaign grow --layers 3`: adopted
    legs = [_leg("grow", grown, layers=[2, 3]), _leg("sitting", grown)]
    _checkpoint(grown, [first, *legs], {**RECIPE, "layers": 3}, b"x")
    other = _checkpoint(tmp_path / "live2", [first], RECIPE, b"old")
    assert adopt(grown, other, "note")["step"] == 3

    only_grow = tmp_path / "only_grow"
    _checkpoint(only_grow, [first, _leg("grow", only_grow, layers=[2, 3])], RECIPE, b"x")
    with pytest.raises(SystemExit, match="no sitting"):
        adopt(only_grow, live, "note")

    elsewhere = _checkpoint(tmp_path / "elsewhere", [{"stage": "sitting"}], RECIPE, b"x")
    with pytest.raises(SystemExit, match="did not start from the live checkpoint"):
        adopt(elsewhere, live, "note")
    assert (live / "model.safetensors").read_bytes() == b"oldmodel.safetensors"  # untouched
