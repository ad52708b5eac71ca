"""B=32 plain decode steps: context length's effect (attention) on the step time."""
import engine  # noqa
import sys, time, statistics
import mlx.core as mx
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.models.resolve import resolve_target
from engine.step.runner import ModelRunner
from engine.step.sampling import SamplingParams
from scheduler.plan import Admission, PrefillChunk, StepPlan
tune_process_if_wanted()
pair = load_pair(resolve_target("smollm2-135m-instruct"), None)
tune_for_backend(pair)
B = int(sys.argv[1])
for ctx in [int(x) for x in sys.argv[2].split(",")]:
    runner = ModelRunner(pair.target, None)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    for i in range(B):
        p = [(7 * i + j) % 5000 + 100 for j in range(ctx + i % 3)]  # slightly ragged
        runner.execute(StepPlan(admissions=[Admission(f"r{i}", p, params)],
                                prefills=[PrefillChunk(f"r{i}", 0, len(p), True)]))
    depths = {f"r{i}": 0 for i in range(B)}
    ts = []
    for s in range(12):
        t = time.perf_counter(); runner.execute(StepPlan(depths=depths)); ts.append(time.perf_counter() - t)
    print(f"B={B} ctx={ctx}: median {1e3*statistics.median(ts[3:]):.1f} ms a step", flush=True)
