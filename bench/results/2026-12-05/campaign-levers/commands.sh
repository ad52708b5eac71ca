#!/bin/bash
# Lever measurements on a loaded 2-core host: equal steps, same data (shard of 32 records), same held-out anchors.
cd /work/wt-campaign
export PYTHONPATH=/work/wt-campaign
PY=/work/main/.venv/bin/python
COMMON="--shard-records 32 --val-records 4 --heldout-anchors 48 --warmup-steps 5 --out /tmp/levers/measure.jsonl"
nice -n 10 $PY -m drafters.dflash.campaign speed --shard-records 32 --steps 4 > /tmp/levers/speed.json 2>/tmp/levers/speed.err
for arm in "" "--candidates" "--candidates --distill 0.5" "--candidates --distill 0.5 --warm-start"; do
  nice -n 10 $PY -m drafters.dflash.campaign measure --steps 12 $COMMON $arm 2>>/tmp/levers/measure.err
done
echo done
#!/bin/bash
cd /work/wt-campaign
export PYTHONPATH=/work/wt-campaign
PY=/work/main/.venv/bin/python
COMMON="--shard-records 32 --val-records 4 --heldout-anchors 48 --warmup-steps 5 --out /tmp/levers/measure.jsonl"
while pgrep -f /tmp/levers/run.sh >/dev/null; do sleep 5; done
for arm in "--steps 12 --warm-start" "--steps 12 --warm-start --distill 0.5" "--steps 27 --candidates --distill 0.5 --warm-start"; do
  nice -n 10 $PY -m drafters.dflash.campaign measure $COMMON $arm 2>>/tmp/levers/measure.err
done
nice -n 10 $PY -m drafters.dflash.campaign speed --shard-records 32 --steps 8 > /tmp/levers/speed2.json 2>/tmp/levers/speed2.err
echo done
#!/bin/bash
cd /work/wt-campaign
export PYTHONPATH=/work/wt-campaign
PY=/work/main/.venv/bin/python
COMMON="--shard-records 32 --val-records 4 --heldout-anchors 48 --warmup-steps 5 --out /tmp/levers/measure.jsonl"
while pgrep -f /tmp/levers/run2.sh >/dev/null; do sleep 5; done
for arm in "--steps 40 --candidates --distill 0.5 --warm-start" "--steps 40 --candidates --distill 0.5"; do
  nice -n 10 $PY -m drafters.dflash.campaign measure $COMMON $arm 2>>/tmp/levers/measure.err
done
echo done
