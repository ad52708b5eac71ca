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
more() {  # train the existing arm $1 STEPS more steps, then measure it again (as "$1-2")
  echo "=== $1: $STEPS more steps $(date +%T)" >> $OUT/arms.log
  train_measure $1-2 /tmp/$ARMS/$1/engine/models/smollm2_drafter $STEPS
}
for a in "$@"; do
  [ -n "${CONTINUE:-}" ] && { more $a; continue; }
  case $a in
    base) arm base $STEPS "pass" ;;
    prompt) arm prompt $STEPS "recipe['prompt_anchors']=True" ;;
  esac
done
echo all done >> $OUT/arms.log
