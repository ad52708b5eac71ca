#!/bin/bash
# Paired arms from the paused campaign's checkpoint (FROM: a copy of its directory under
# /tmp/arms4/start/), equal steps and equal block rows a step, over the data its cursor points
# at next. base: the campaign's recipe (block 8, 64 anchors a record); block4: blocks of 4 rows
# (anchor + 3 masks), 128 anchors a record. Each arm is measured on every held-out anchor twice:
# with 8-row blocks and with 4-row blocks (what inference runs at depth 3: `DFlashDrafter`
# truncates the block to the depth). Pause the live campaign first (kill -STOP <its pid>).
set -u
OUT=${OUT:-/work/notes/arms4} FROM=${FROM:-/tmp/arms4/start/engine/models/smollm2_drafter}
ARMS=arms4
. /work/main/bench/campaign_arm.sh
STEPS=${STEPS:-400}
measure_at() {  # measure arm $1 with blocks of $2 rows (its state's recipe, put back after)
  local name=$1 block=$2 dir=/tmp/$ARMS/$1/engine/models/smollm2_drafter
  cp $dir/training/state.json $dir/training/state.keep
  $PY -c "import json,sys; p=sys.argv[1]; s=json.load(open(p)); s['recipe']['block_size']=int(sys.argv[2]); json.dump(s, open(p,'w'), indent=1)" $dir/training/state.json $block
  $PY -m drafters.dflash.campaign heldout --heldout-anchors 0 --drafter-dir $dir 2>/dev/null | tail -1 | sed "s/^{/{\"arm\": \"$name\", \"measured_block\": $block, /" | tee -a $OUT/heldout-by-block.jsonl
  mv $dir/training/state.keep $dir/training/state.json
}
for a in "$@"; do
  case $a in
    start) ;;  # the paused campaign's checkpoint itself (FROM), measured only
    base) arm base $STEPS "pass" ;;
    block4) arm block4 $STEPS "recipe['block_size']=4; recipe['num_anchors']=128" ;;
  esac
  measure_at $a 8
  measure_at $a 4
done
echo all done >> $OUT/arms.log
