"""Paired ratios (`bench.paired`) for the engine pairs the bench's own table leaves out (the
hybrid against lookup alone), from a run's results.json:

    PYTHONPATH=. python bench/results/2026-12-07c/c1-mlxlm-step22303/paired.py DIR
"""

import json
import sys
from pathlib import Path

from bench.paired import paired_cells

results = json.loads((Path(sys.argv[1]) / "results.json").read_text())
pairs = (
    ("flashbatch adaptive", "flashbatch adaptive lookup"),
    ("flashbatch adaptive", "flashbatch off"),
    ("flashbatch adaptive lookup", "flashbatch off"),
)
for numerator, denominator in pairs:
    for (workload, temperature, c), pair, _ in sorted(
        paired_cells(results, numerator, denominator)
    ):
        text = pair.text() if pair else "-"
        verdict = pair.verdict(0.97) if pair else "-"
        name = f"{numerator} / {denominator}"
        print(f"| {name} | {workload} | {temperature:g} | {c} | {text} | {verdict} |")
