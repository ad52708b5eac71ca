"""Adopt a paired arm (`bench/campaign_arms.py`; older ones: `bench/campaign_arm.sh`) as the
campaign's checkpoint.

The arm must have started from the live checkpoint as it stands: its sittings log begins with
the live one. Weights, config and training state come from the arm; the live sittings log gains
the arm's sittings (and the `campaign grow` it began with, if any: more layers or taps, which
keep the predictions), annotated with NOTE, the first sitting also with what the arm retuned
(the recipe's retunable fields that differ from the live state's). An arm that changed any
other recipe field (the data cut, say; the layer count unless a grow says so) is refused by
name: the campaign could not have retuned it.

    python bench/campaign_adopt.py ARM_DIR LIVE_DIR NOTE
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from drafters.dflash.campaign_state import RETUNABLE


def _read(path: Path) -> object:
    return json.loads(path.read_text())


def adopt(arm: Path, live: Path, note: str) -> dict:
    live_log = _read(live / "training/sittings.json")
    arm_log = _read(arm / "training/sittings.json")
    if arm_log[: len(live_log)] != live_log:
        raise SystemExit(f"{arm} did not start from the live checkpoint {live}")
    legs = arm_log[len(live_log) :]
    # an arm's own entries: its sittings, and any `grow` (layers or taps) it started with
    own = all(s.get("stage") in ("sitting", "grow") and str(arm) in s["command"] for s in legs)
    if not own or not any(s.get("stage") == "sitting" for s in legs):
        raise SystemExit(f"{arm} holds no sitting of its own to adopt")
    before = _read(live / "training/state.json")["recipe"]
    state = _read(arm / "training/state.json")
    after = state["recipe"]
    changed = {k: [before.get(k), after.get(k)] for k in after if before.get(k) != after.get(k)}
    # `campaign grow --layers` changes the recipe's layer count, and its log entry says so
    grown = any(s.get("stage") == "grow" and "layers" in s for s in legs)
    fixed = sorted(k for k in changed if k not in RETUNABLE and not (k == "layers" and grown))
    if fixed:
        raise SystemExit(f"the arm changed {', '.join(fixed)}, which a campaign cannot retune")
    for leg in legs:
        leg["note"] = note
    retuned = {k: v for k, v in changed.items() if k in RETUNABLE}
    if retuned:
        next(s for s in legs if s.get("stage") == "sitting")["retuned"] = retuned
    for name in ("model.safetensors", "config.json", "draft_vocab.safetensors"):
        shutil.copy2(arm / name, live / name)
    (live / "training/sittings.json").write_text(json.dumps(live_log + legs, indent=1) + "\n")
    (live / "training/state.json").write_text(json.dumps(state, indent=1) + "\n")
    return {"adopted": str(arm), "step": state["step"], "retuned": changed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", type=Path, help="the arm's drafter directory")
    parser.add_argument("live", type=Path, help="the campaign's drafter directory")
    parser.add_argument("note", help="why this arm: kept in each of its sittings")
    args = parser.parse_args()
    print(json.dumps(adopt(args.arm, args.live, args.note)))


if __name__ == "__main__":
    main()
