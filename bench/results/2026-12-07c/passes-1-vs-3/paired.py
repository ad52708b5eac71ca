"""P3 against P1 paired on the same records, re-measured after the run (the arms tool gained
paired intervals after it; the start checkpoint, step 21202, was not kept, so the pair is the
two arms):

    PYTHONPATH=$PWD python bench/results/2026-12-07c/passes-1-vs-3/paired.py /tmp/arms17/P3 \\
        /tmp/arms17/P1 > bench/results/2026-12-07c/passes-1-vs-3/paired.json
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import sys
from pathlib import Path

from bench.campaign_arms import against, measure
from drafters.dflash import campaign, evalset

target = campaign.DEFAULT_TARGET
records = evalset.read_evalset(evalset.evalset_path(target))
corpus = campaign.corpus_split(target)
after, before = (
    measure(target, Path(d), records, 68, campaign.CACHE_ROOT, corpus) for d in sys.argv[1:3]
)
gains = against(after, before)
print(json.dumps({"after": sys.argv[1], "before": sys.argv[2], **gains}))
