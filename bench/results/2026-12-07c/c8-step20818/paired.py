"""Paired ratios (`bench.paired`) for the engine pairs the bench's own table leaves out (the
hybrid against lookup alone), from a run's results.json:

    PYTHONPATH=. python bench/results/2026-12-07c/c8-step20818/paired.py DIR
"""

import json
import sys
from pathlib import Path

from bench.paired import pair_rows

results = json.loads((Path(sys.argv[1]) / "results.json").read_text())
pairs = (
    ("flashbatch adaptive", "flashbatch adaptive lookup"),
    ("flashbatch adaptive", "flashbatch off"),
    ("flashbatch adaptive lookup", "flashbatch off"),
)
print("\n".join(pair_rows(results, pairs)))
