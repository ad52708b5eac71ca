#!/bin/bash
# Paired arms from the committed checkpoint at step 12090 (cursor: shard 12, pass 1, record
# 184), equal steps (200: the rest of shard 12's passes 1 and 2, whose features for both tap
# sets `campaign features --shard 12` computed before either arm began). base: the campaign's
# recipe, the target read at layers 1 and 27 (z-lab's rule for a 2-layer drafter); taps3: the
# same checkpoint grown to read layer 14 too (`campaign grow --taps 1,14,27`, z-lab's rule for
# three taps; the new tap's `fc` columns start at zero, so it starts predicting exactly as
# base). The question: does the drafter lack what the target knows between layers 1 and 27?
# Stop the live campaign first (kill -TERM <its pid>).
set -u
OUT=${OUT:-/work/notes/arms7} FROM=${FROM:-18fe92c}
ARMS=arms7
. /work/main/bench/campaign_arm.sh
STEPS=${STEPS:-200}
for a in "$@"; do
  case $a in
    base) arm base $STEPS "pass" ;;
    taps3) arm taps3 $STEPS "pass" "--taps 1,14,27" ;;
  esac
done
echo all done >> $OUT/arms.log
