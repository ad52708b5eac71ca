#!/bin/bash
# Sitting 16's paired arms from the step-19666 checkpoint, on the first wholly fresh shard:
# P3 (3 passes over it, today's recipe: 384 steps) against P6 (6 passes: 768 steps).
# The question: with fresh records costing ~20 minutes a shard to generate and featurise,
# do more passes over each one buy more than they cost?
set -e
cd /work/main
export PYTHONPATH=$PWD
PY=".venv/bin/python"
A=/tmp/arms16
D=engine/models/smollm2_drafter
S=$($PY -c "
import json, math
s = json.load(open('$D/training/state.json'))
print(math.ceil(s['records_reached'] / s['recipe']['shard_records']))")
echo "fresh shard: $S"
for arm in P3 P6; do
  rm -rf $A/$arm; mkdir -p $A/$arm/engine/models
  cp -r $D $A/$arm/engine/models/
  $PY - "$A/$arm/$D/training/state.json" "$S" <<'PY'
import json, sys
path, shard = sys.argv[1], int(sys.argv[2])
state = json.load(open(path))
left = state["cursor"]["shard"]
state["cursor"] = {"shard": shard, "pass_": 0, "position": 0,
                   "wraps": state["cursor"]["wraps"], "return_to": left}
state["records_reached"] = shard * state["recipe"]["shard_records"]
json.dump(state, open(path, "w"), indent=1)
print(path, state["cursor"], state["records_reached"])
PY
done
$PY -m drafters.dflash.campaign features --shard $S --drafter-dir $A/P3/$D
$PY -m drafters.dflash.campaign run --drafter-dir $A/P3/$D --steps 384 --heldout-every 0 \
  --heldout-anchors 16 --checkpoint-minutes 1000
$PY -m drafters.dflash.campaign run --drafter-dir $A/P6/$D --steps 768 --passes-per-shard 6 \
  --heldout-every 0 --heldout-anchors 16 --checkpoint-minutes 1000
for arm in P3 P6; do
  echo "== $arm"
  $PY -m drafters.dflash.evalset measure --drafter-dir $A/$arm/$D --log
  $PY -m drafters.dflash.campaign heldout --drafter-dir $A/$arm/$D --heldout-anchors 0 --val-records 68
done
echo ARMS DONE
