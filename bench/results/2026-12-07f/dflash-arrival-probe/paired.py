"""Paired ratios of the arms (`bench.paired`), from this folder's results.json:

PYTHONPATH=. python bench/results/2026-12-07f/dflash-arrival-probe/paired.py DIR
"""

import json
import sys
from pathlib import Path

from bench.paired import paired_cells

results = json.loads((Path(sys.argv[1]) / "results.json").read_text())
pairs = (
    ("flashbatch adaptive arrival", "flashbatch adaptive"),
    ("flashbatch adaptive arrival", "flashbatch adaptive lookup"),
    ("flashbatch adaptive", "flashbatch adaptive lookup"),
)
for numerator, denominator in pairs:
    for (workload, temperature, c), pair, _ in sorted(
        paired_cells(results, numerator, denominator)
    ):
        text = pair.text() if pair else "-"
        verdict = pair.verdict(0.97) if pair else "-"
        name = f"{numerator} / {denominator}"
        print(f"| {name} | {workload} | {temperature:g} | {c} | {text} | {verdict} |")
