#!/bin/bash
# Paired arms from the committed step-4143 checkpoint (616e86f), equal labels, over the data the
# campaign's cursor points at next (the rest of shard 3, then shard 4). Each arm: a copy of the
# checkpoint, an edit (its recipe, or `campaign grow`), `run --steps N`, then the held-out measure
# over every anchor of the 32 held-out records. Pause the campaign first (kill -STOP <its pid>).
set -u
OUT=${OUT:-/work/notes/arms2} FROM=${FROM:-616e86f} ARMS=arms2
. /work/main/bench/campaign_arm.sh
for a in "$@"; do
  case $a in
    base) arm base 264 "pass" ;;
    grow3) arm grow3 264 "pass" 3 ;;
    grow4) arm grow4 264 "pass" 4 ;;
    batch8) arm batch8 132 "recipe['batch_size']=8" ;;
    anchors128) arm anchors128 132 "recipe['num_anchors']=128" ;;
    lr01) arm lr01 264 "recipe['lr']=0.0001" ;;
    # the first shard made only of records generated this sitting (SHARD: its index)
    fresh) arm fresh 264 "st['cursor'].update(shard=${SHARD:?}, pass_=0, position=0)" ;;
  esac
done
echo all done >> $OUT/arms.log
