"""Adopt the block4 arm as the campaign's checkpoint. The arm started from the campaign's own
latest checkpoint (its last sitting stays as it is, nothing is superseded); weights, config and
state come from the arm, whose recipe edit (block_size 4) becomes the retunable `train_block`
4, the model keeping its block of 8; the live sittings log gains the arm's sitting, annotated.
Usage: adopt.py ARM_DIR LIVE_DIR NOTE"""

import json
import shutil
import sys
from pathlib import Path

arm, live, note = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
live_log = json.loads((live / "training/sittings.json").read_text())
arm_log = json.loads((arm / "training/sittings.json").read_text())
assert arm_log[: len(live_log)] == live_log, "the arm did not start from this campaign's checkpoint"
legs = arm_log[len(live_log) :]
assert legs and all(s.get("stage") == "sitting" and str(arm) in s["command"] for s in legs)
state = json.loads((arm / "training/state.json").read_text())
model_block = json.loads((arm / "config.json").read_text())["block_size"]
state["recipe"]["train_block"] = state["recipe"]["block_size"]
state["recipe"]["block_size"] = model_block
for leg in legs:
    leg["note"] = note
legs[0]["retuned"] = {"train_block": [0, state["recipe"]["train_block"]], "num_anchors": [64, 128]}
for name in ("model.safetensors", "config.json"):
    shutil.copy2(arm / name, live / name)
(live / "training/sittings.json").write_text(json.dumps(live_log + legs, indent=1) + "\n")
(live / "training/state.json").write_text(json.dumps(state, indent=1) + "\n")
print(
    "adopted",
    arm,
    "step",
    state["step"],
    "recipe",
    {k: state["recipe"][k] for k in ("block_size", "train_block", "num_anchors")},
)
