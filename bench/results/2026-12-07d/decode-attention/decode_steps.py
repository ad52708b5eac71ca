"""Plain decode steps of one `ModelRunner` on SmolLM2 (no drafter): ms a step by context.

    PYTHONPATH=<repo> python decode_steps.py ROWS CONTEXTS    # e.g. 32 16,128,512,1024

Every row gets a synthetic prompt of about CONTEXT tokens (lengths differ by up to 2, so the
cache is ragged), then 12 plain steps run; the median of the last 9 is printed.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import statistics
import sys
import time

from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.models.resolve import resolve_target
from engine.step.runner import ModelRunner
from engine.step.sampling import SamplingParams
from scheduler.plan import Admission, PrefillChunk, StepPlan


def main() -> None:
    tune_process_if_wanted()
    pair = load_pair(resolve_target("smollm2-135m-instruct"), None)
    tune_for_backend(pair)
    rows = int(sys.argv[1])
    for context in (int(x) for x in sys.argv[2].split(",")):
        runner = ModelRunner(pair.target, None)
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
        for i in range(rows):
            prompt = [(7 * i + j) % 5000 + 100 for j in range(context + i % 3)]
            admission = Admission(f"r{i}", prompt, params)
            chunk = PrefillChunk(f"r{i}", 0, len(prompt), True)
            runner.execute(StepPlan(admissions=[admission], prefills=[chunk]))
        depths = {f"r{i}": 0 for i in range(rows)}
        seconds = []
        for _ in range(12):
            start = time.perf_counter()
            runner.execute(StepPlan(depths=depths))
            seconds.append(time.perf_counter() - start)
        median = 1e3 * statistics.median(seconds[3:])
        print(f"B={rows} ctx={context}: median {median:.1f} ms a step", flush=True)


if __name__ == "__main__":
    main()
