#!/usr/bin/env bash
# Data generation with prompts in corpus-mix order (--length-window 0) against windows of 256
# shortest first (the default), alternating arms of ARM_SECONDS each, alone on the machine
# at nice 19. Every arm appends real records to the build's work file; `--stages keep` after
# the last arm makes them a corpus part.
#   bash run.sh [ARM_SECONDS] [ROUNDS]     (from the repository root's .venv)
set -u
cd "$(dirname "$0")/../../../.."
seconds=${1:-540}
rounds=${2:-2}
out=bench/results/2026-12-07d/datagen-order
for round in $(seq 1 "$rounds"); do
  for window in 0 256; do
    log="$out/window${window}-round${round}.log"
    PYTHONPATH=$PWD timeout -s TERM "$seconds" nice -n 19 .venv/bin/python -m drafters.dflash.build \
      --target smollm2-135m-instruct --stages data --per-kind 8000 --length-window "$window" \
      > "$log" 2>&1
  done
done
