#!/bin/bash
# Paired arms from the committed step-5640 checkpoint (b8837f6), equal steps, over the data the
# campaign's cursor points at next (shard 7). Each arm: a copy of the checkpoint, an edit of its
# recipe, `run --steps N`, then the held-out measure over every anchor of the 49 held-out
# records. Pause the live campaign first (kill -STOP <its pid>). `CONTINUE=1 ./run_arms.sh base
# prompt` then trains each existing arm STEPS more steps from where it stopped and measures again.
set -u
OUT=${OUT:-/work/notes/arms3} FROM=${FROM:-b8837f6} ARMS=arms3
. /work/main/bench/campaign_arm.sh
STEPS=${STEPS:-400}
more() {  # train the existing arm $1 STEPS more steps, then measure it again
  local name=$1 dir=/tmp/$ARMS/$1/engine/models/smollm2_drafter
  echo "=== $name: $STEPS more steps $(date +%T)" >> $OUT/arms.log
  $PY -m drafters.dflash.campaign run --drafter-dir $dir --steps $STEPS --heldout-every 0 --heldout-anchors 16 --checkpoint-minutes 1000 >> $OUT/arm-$name-2.log 2>&1
  grep "sitting done" $OUT/arm-$name-2.log | tail -1 | sed 's/.*sitting done: //' > $OUT/arm-$name-2.sitting.json
  $PY -m drafters.dflash.campaign heldout --heldout-anchors 0 --drafter-dir $dir 2>/dev/null | tail -1 | sed "s/^{/{\"arm\": \"$name-2\", /" | tee -a $OUT/heldout.jsonl
  echo "$name-2 done $(date +%T)" >> $OUT/arms.log
}
for a in "$@"; do
  [ -n "${CONTINUE:-}" ] && { more $a; continue; }
  case $a in
    base) arm base $STEPS "pass" ;;
    prompt) arm prompt $STEPS "recipe['prompt_anchors']=True" ;;
  esac
done
echo all done >> $OUT/arms.log
