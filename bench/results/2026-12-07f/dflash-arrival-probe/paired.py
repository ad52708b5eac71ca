"""Paired ratios of the arms (`bench.paired`), from this folder's results.json:

PYTHONPATH=. python bench/results/2026-12-07f/dflash-arrival-probe/paired.py DIR
"""

import json
import sys
from pathlib import Path

from bench.paired import pair_rows

results = json.loads((Path(sys.argv[1]) / "results.json").read_text())
pairs = (
    ("flashbatch adaptive arrival", "flashbatch adaptive"),
    ("flashbatch adaptive arrival", "flashbatch adaptive lookup"),
    ("flashbatch adaptive", "flashbatch adaptive lookup"),
)
print("\n".join(pair_rows(results, pairs)))
