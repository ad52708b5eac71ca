#!/bin/bash
# Paired recipe arms from the committed step-2688 checkpoint, equal wall time, on shard 7 (unseen).
# Each arm: a copy of the checkpoint with its recipe edited, `run --minutes M`, then the held-out
# measure over every anchor of the 32 held-out records.
set -u
cd /work/main
export PYTHONPATH=/work/main
PY=/work/main/.venv/bin/python
M=${M:-7}
OUT=/work/notes/arms
arm() {  # name, python snippet editing `recipe` and `config`
  local name=$1 edit=$2 dir=/tmp/arms/$1
  rm -rf $dir && mkdir -p $dir && git archive fe674be engine/models/smollm2_drafter | tar -x -C $dir
  dir=$dir/engine/models/smollm2_drafter
  $PY - "$dir" "$edit" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1]); st = json.loads((d/"training/state.json").read_text()); cf = json.loads((d/"config.json").read_text())
recipe, config = st["recipe"], cf
exec(sys.argv[2])
(d/"training/state.json").write_text(json.dumps(st, indent=1)); (d/"config.json").write_text(json.dumps(cf, indent=1))
PYEOF
  echo "=== $name: $edit $(date +%T)" >> $OUT/arms.log
  $PY -m drafters.dflash.campaign run --drafter-dir $dir --steps ${STEPS:-264} --heldout-every ${EVERY:-0} --heldout-anchors ${ANCH:-16} --checkpoint-minutes 1000 >> $OUT/arm-$name.log 2>&1
  grep "sitting done" $OUT/arm-$name.log | tail -1 | sed 's/.*sitting done: //' > $OUT/arm-$name.sitting.json
  $PY -m drafters.dflash.campaign heldout --heldout-anchors 0 --drafter-dir $dir 2>/dev/null | tail -1 | tee -a $OUT/heldout.jsonl
  echo "$name $(date +%T)" >> $OUT/arms.log
}
for a in "$@"; do
  case $a in
    base) arm base "pass" ;;
    basetraj) arm basetraj "pass" ;;
    block4) arm block4 "recipe['block_size']=4; config['block_size']=4; recipe['num_anchors']=128" ;;
    gamma15) arm gamma15 "recipe['gamma']=1.5" ;;
    lr2) arm lr2 "recipe['lr']=0.002" ;;
    ema99) arm ema99 "recipe['ema']=0.99" ;;
    lr03) arm lr03 "recipe['lr']=0.0003" ;;
    lr01) arm lr01 "recipe['lr']=0.0001" ;;
    lr003) arm lr003 "recipe['lr']=0.00003" ;;
    ema) arm ema "recipe['ema']=0.99" ;;
    lr03emag15) arm lr03emag15 "recipe['lr']=0.0003; recipe['ema']=0.99; recipe['gamma']=1.5" ;;
    lr01ema) arm lr01ema "recipe['lr']=0.0001; recipe['ema']=0.99" ;;
    lr03ema) arm lr03ema "recipe['lr']=0.0003; recipe['ema']=0.99" ;;
    lr03g15) arm lr03g15 "recipe['lr']=0.0003; recipe['gamma']=1.5" ;;
    anchors128) arm anchors128 "recipe['num_anchors']=128" ;;
  esac
done
echo all done >> $OUT/arms.log
