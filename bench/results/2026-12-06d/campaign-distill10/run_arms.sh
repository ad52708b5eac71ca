#!/bin/bash
# Paired arms from the stopped campaign's checkpoint at step 11188 (FROM: a copy of its
# directory under /tmp/arms6/start/), equal steps, over the data its cursor points at next
# (shard 10 from record 160, then shard 11, whose features `campaign features --shard 11`
# computed first). base: the campaign's recipe (distillation alpha 0.8: 0.2 x CE(label) +
# 0.8 x KL(target top-8 || drafter)); distill10: alpha 1.0, the KL alone (the label is the
# target's argmax, so it is in the top-8 already). The drafter memorises (training shards
# score well above held-out records; ../campaign-diagnostics/README.md), and a softer target
# may memorise less. Each arm is measured on every held-out anchor and on the eval set.
# Stop the live campaign first (kill -TERM <its pid>).
set -u
OUT=${OUT:-/work/notes/arms6} FROM=${FROM:-/tmp/arms6/start/engine/models/smollm2_drafter}
ARMS=arms6
. /work/main/bench/campaign_arm.sh
STEPS=${STEPS:-400}
for a in "$@"; do
  case $a in
    base) arm base $STEPS "pass" ;;
    distill10) arm distill10 $STEPS "recipe['distill']=1.0" ;;
  esac
done
echo all done >> $OUT/arms.log
