#!/bin/bash
# Paired recipe arms from the committed step-2688 checkpoint (fe674be), equal labels, on shard 7
# (unseen). Each arm: a copy of the checkpoint with its recipe edited, `run --steps ${STEPS:-264}`,
# then the held-out measure over every anchor of the 32 held-out records.
set -u
OUT=/work/notes/arms FROM=fe674be ARMS=arms
. /work/main/bench/campaign_arm.sh
for a in "$@"; do
  case $a in
    base) arm base ${STEPS:-264} "pass" ;;
    basetraj) arm basetraj ${STEPS:-264} "pass" ;;
    block4) arm block4 ${STEPS:-264} "recipe['block_size']=4; config['block_size']=4; recipe['num_anchors']=128" ;;
    gamma15) arm gamma15 ${STEPS:-264} "recipe['gamma']=1.5" ;;
    lr2) arm lr2 ${STEPS:-264} "recipe['lr']=0.002" ;;
    ema99) arm ema99 ${STEPS:-264} "recipe['ema']=0.99" ;;
    lr03) arm lr03 ${STEPS:-264} "recipe['lr']=0.0003" ;;
    lr01) arm lr01 ${STEPS:-264} "recipe['lr']=0.0001" ;;
    lr003) arm lr003 ${STEPS:-264} "recipe['lr']=0.00003" ;;
    ema) arm ema ${STEPS:-264} "recipe['ema']=0.99" ;;
    lr03emag15) arm lr03emag15 ${STEPS:-264} "recipe['lr']=0.0003; recipe['ema']=0.99; recipe['gamma']=1.5" ;;
    lr01ema) arm lr01ema ${STEPS:-264} "recipe['lr']=0.0001; recipe['ema']=0.99" ;;
    lr03ema) arm lr03ema ${STEPS:-264} "recipe['lr']=0.0003; recipe['ema']=0.99" ;;
    lr03g15) arm lr03g15 ${STEPS:-264} "recipe['lr']=0.0003; recipe['gamma']=1.5" ;;
    anchors128) arm anchors128 ${STEPS:-264} "recipe['num_anchors']=128" ;;
  esac
done
echo all done >> $OUT/arms.log
