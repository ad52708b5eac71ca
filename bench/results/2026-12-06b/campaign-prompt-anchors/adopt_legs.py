"""Adopt the prompt arm (both legs) as the campaign's checkpoint: weights, config and state from
the arm; the live sittings log keeps the campaign's own short sitting (marked superseded) and
gains the arm's two sittings, annotated with what they changed.
Usage: adopt_legs.py ARM_DIR LIVE_DIR COMMITTED_SITTINGS_COUNT NOTE"""

import json
import shutil
import sys
from pathlib import Path

arm, live, base_count, note = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
live_log = json.loads((live / "training/sittings.json").read_text())
arm_log = json.loads((arm / "training/sittings.json").read_text())
legs = arm_log[base_count:]
assert legs and all(s.get("stage") == "sitting" and str(arm) in s["command"] for s in legs)
own = live_log[-1]
assert own.get("stage") == "sitting" and "--drafter-dir" not in own["command"], own.get("command")
own["superseded"] = f"by the paired arm below ({note})"
for leg in legs:
    leg["note"] = note
legs[0]["retuned"] = {"prompt_anchors": [False, True]}
for name in ("model.safetensors", "config.json"):
    shutil.copy2(arm / name, live / name)
(live / "training/sittings.json").write_text(json.dumps(live_log + legs, indent=1) + "\n")
shutil.copy2(arm / "training/state.json", live / "training/state.json")
print("adopted", arm, "step", json.loads((live / "training/state.json").read_text())["step"])
