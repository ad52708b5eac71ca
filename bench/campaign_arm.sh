# Superseded by bench/campaign_arms.py (paired arms in one command, the measures in one table);
# kept because the results scripts of earlier sittings source it.
# Sourced by the campaign's paired-arm scripts (bench/results/*/campaign-arms*/run_arms.sh).
# `arm NAME STEPS EDIT [GROW]`: a copy of the drafter checkpoint at commit (or directory) $FROM under
# /tmp/$ARMS/NAME, its state/config edited by the python snippet EDIT (it sees `st`, `recipe`,
# `config`), grown by `campaign grow GROW` if given ("--taps 1,14,27", "--layers 3"; a bare
# number N means "--layers N"), trained by the campaign's own
# `run --steps STEPS`, then measured on every held-out anchor; results go to $OUT. Pause the
# live campaign first (kill -STOP <its pid>): arms time their own labels a second.
cd /work/main
export PYTHONPATH=/work/main
PY=/work/main/.venv/bin/python
mkdir -p "$OUT"
arm() {
  local name=$1 steps=$2 edit=$3 grow=${4:-} dir=/tmp/$ARMS/$1
  rm -rf $dir && mkdir -p $dir
  if [ -d "$FROM" ]; then  # a checkpoint directory (a paused campaign's, say) instead of a commit
    mkdir -p $dir/engine/models && cp -r "$FROM" $dir/engine/models/smollm2_drafter
  else
    git archive $FROM engine/models/smollm2_drafter | tar -x -C $dir
  fi
  dir=$dir/engine/models/smollm2_drafter
  $PY - "$dir" "$edit" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1]); st = json.loads((d/"training/state.json").read_text()); cf = json.loads((d/"config.json").read_text())
recipe, config = st["recipe"], cf
exec(sys.argv[2])
(d/"training/state.json").write_text(json.dumps(st, indent=1)); (d/"config.json").write_text(json.dumps(cf, indent=1))
PYEOF
  case $grow in [0-9]*) grow="--layers $grow" ;; esac
  [ -n "$grow" ] && $PY -m drafters.dflash.campaign grow $grow --drafter-dir $dir >> $OUT/arm-$name.log 2>&1
  echo "=== $name: steps $steps; $edit; grow ${grow:-no} $(date +%T)" >> $OUT/arms.log
  train_measure $name $dir $steps
}
# `train_measure LABEL DIR STEPS`: the campaign's own `run --steps STEPS` on checkpoint DIR
# (log arm-LABEL.log, its sitting arm-LABEL.sitting.json), then the held-out measure on every
# anchor, appended to heldout.jsonl as arm LABEL, and the eval set's, to evalset.jsonl.
train_measure() {
  local name=$1 dir=$2 steps=$3
  $PY -m drafters.dflash.campaign run --drafter-dir $dir --steps $steps --heldout-every ${EVERY:-0} --heldout-anchors ${ANCH:-16} --checkpoint-minutes 1000 >> $OUT/arm-$name.log 2>&1
  grep "sitting done" $OUT/arm-$name.log | tail -1 | sed 's/.*sitting done: //' > $OUT/arm-$name.sitting.json
  $PY -m drafters.dflash.campaign heldout --heldout-anchors 0 --drafter-dir $dir 2>/dev/null | tail -1 | sed "s/^{/{\"arm\": \"$name\", /" | tee -a $OUT/heldout.jsonl
  # the eval set: the mix's held-out prompts, the loop replayed (drafters/dflash/evalset.py)
  $PY -m drafters.dflash.evalset measure --drafter-dir $dir 2>/dev/null | tail -1 | sed "s/^{/{\"arm\": \"$name\", /" | tee -a $OUT/evalset.jsonl
  echo "$name done $(date +%T)" >> $OUT/arms.log
}
