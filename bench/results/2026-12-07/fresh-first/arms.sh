#!/bin/bash
# Sitting 15's paired arms from the step-18549 checkpoint: F (a fresh shard, the floor lr),
# FH (the same fresh shard, 3x the lr), R (a repeated shard, the floor lr); 384 steps each.
set -e
cd /work/main
export PYTHONPATH=$PWD
PY=".venv/bin/python"
A=/tmp/arms15
N=$($PY -c "from drafters.dflash.campaign import corpus_split; print(len(corpus_split('smollm2-135m-instruct')[0]))")
echo "train records: $N"
for arm in F FH R; do
  rm -rf $A/$arm; mkdir -p $A/$arm/engine/models
  cp -r engine/models/smollm2_drafter $A/$arm/engine/models/
done
$PY - "$A" "$N" <<'PY'
import json, sys
from pathlib import Path
root, n = Path(sys.argv[1]), int(sys.argv[2])
for arm, cursor, reached in (
    ("F", {"shard": 24, "pass_": 0, "position": 0, "wraps": 3, "return_to": 7}, 24 * 512),
    ("FH", {"shard": 24, "pass_": 0, "position": 0, "wraps": 3, "return_to": 7}, 24 * 512),
    ("R", {"shard": 7, "pass_": 0, "position": 0, "wraps": 3, "return_to": -1}, n),
):
    path = root / arm / "engine/models/smollm2_drafter/training/state.json"
    state = json.loads(path.read_text())
    state["cursor"], state["records_reached"] = cursor, reached
    path.write_text(json.dumps(state, indent=1))
    print(arm, cursor, reached)
PY
D=engine/models/smollm2_drafter
$PY -m drafters.dflash.campaign features --shard 24 --drafter-dir $A/F/$D
for arm in F FH R; do
  extra=""; [ $arm = FH ] && extra="--lr 9e-4"
  $PY -m drafters.dflash.campaign run --drafter-dir $A/$arm/$D --steps 384 --heldout-every 0 \
    --heldout-anchors 16 --checkpoint-minutes 1000 $extra
done
for arm in F FH R; do
  echo "== $arm"
  $PY -m drafters.dflash.evalset measure --drafter-dir $A/$arm/$D --log
  $PY -m drafters.dflash.campaign heldout --drafter-dir $A/$arm/$D --heldout-anchors 0 --val-records 68
done
echo ARMS DONE
