#!/bin/bash
# Paired arms from the stopped campaign's checkpoint (FROM: a copy of its directory under
# /tmp/arms5/start/), equal steps, over the data its cursor points at next. base: the
# campaign's recipe (distillation alpha 0.5: 0.5 x CE(label) + 0.5 x KL(target top-8 ||
# drafter)); distill08: alpha 0.8, more of each label's weight on the target's ranking, which
# may memorise less (training shards already score tau 0.12 above held-out records). Each arm
# is measured on every held-out anchor. Stop the live campaign first (kill -TERM <its pid>).
set -u
OUT=${OUT:-/work/notes/arms5} FROM=${FROM:-/tmp/arms5/start/engine/models/smollm2_drafter}
ARMS=arms5
. /work/main/bench/campaign_arm.sh
STEPS=${STEPS:-400}
for a in "$@"; do
  case $a in
    base) arm base $STEPS "pass" ;;
    distill08) arm distill08 $STEPS "recipe['distill']=0.8" ;;
    # a second leg: each arm goes on from its own checkpoint over the next data
    base2) train_measure base2 /tmp/$ARMS/base/engine/models/smollm2_drafter $STEPS ;;
    distill082) train_measure distill082 /tmp/$ARMS/distill08/engine/models/smollm2_drafter $STEPS ;;
  esac
done
echo all done >> $OUT/arms.log
