"""Adopt a paired arm's checkpoint as the campaign's. Weights, config and state come from the
arm; the live sittings log keeps every sitting (the campaign's own run over the same shard is
marked superseded) and gains the arm's sitting, annotated with what it changed."""
import json, shutil, sys
from pathlib import Path
arm, live, note, retuned = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
live_log = json.loads((live / "training/sittings.json").read_text())
arm_log = json.loads((arm / "training/sittings.json").read_text())
arm_sitting = arm_log[-1]
assert arm_sitting.get("stage") == "sitting" and str(arm) in arm_sitting["command"]
own = live_log[-1]
assert own.get("stage") == "sitting" and "--drafter-dir" not in own["command"], own.get("command")
own["superseded"] = f"by the paired arm below ({note})"
arm_sitting["note"] = note
arm_sitting["retuned"] = retuned
for name in ("model.safetensors", "config.json"):
    shutil.copy2(arm / name, live / name)
(live / "training/sittings.json").write_text(json.dumps(live_log + [arm_sitting], indent=1) + "\n")
shutil.copy2(arm / "training/state.json", live / "training/state.json")
print("adopted", arm, "step", json.loads((live / "training/state.json").read_text())["step"])
