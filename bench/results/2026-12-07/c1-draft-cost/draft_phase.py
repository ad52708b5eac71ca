"""The drafter's share of a depth-1 DFlash step at c=1 on SmolLM2, phase by phase.

    PYTHONPATH=<repo> python draft_phase.py [--rounds 40] [--workload chat]
    PYTHONPATH=<repo> python draft_phase.py --widths

One `ModelRunner` (phase profiling on) decodes one held-out mix prompt; round after round it
runs a plain step and a depth-1 step, and reports the median milliseconds of the plain
forward, and of the depth-1 step's draft (the drafter forward, synced alone), verify and
forward. Then the drafter's forward alone, split: the block through the layers, and the head.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import statistics
import sys
import time

import mlx.core as mx

from bench.suite import cell_prompts
from engine.backend.process_tuning import tune_process_if_wanted
from engine.backend.tuning import tune_for_backend
from engine.models.loading import load_pair
from engine.models.resolve import default_drafter, resolve_target
from engine.step.runner import ModelRunner
from engine.step.sampling import SamplingParams
from scheduler.plan import Admission, PrefillChunk, StepPlan

TARGET = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--workload", default="chat")
    args, _ = parser.parse_known_args()
    tune_process_if_wanted()
    pair = load_pair(resolve_target(TARGET), default_drafter(TARGET))
    tune_for_backend(pair)
    runner = ModelRunner(pair.target, pair.drafter, profile_phases=True)
    prompt = cell_prompts(pair.tokenizer, args.workload, 1, 384, "mix")[0]
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    runner.execute(StepPlan(admissions=[Admission("r0", prompt, params)],
                            prefills=[PrefillChunk("r0", 0, len(prompt), True)]))  # fmt: skip
    ms = {k: [] for k in ("plain", "depth-1 draft", "depth-1 verify", "depth-1 forward")}
    for _ in range(args.rounds):
        plain = runner.execute(StepPlan(depths={"r0": 0}))
        ms["plain"].append(plain.forward_seconds)
        step = runner.execute(StepPlan(depths={"r0": 1}))
        ms["depth-1 draft"].append(step.phase_seconds["draft"])
        ms["depth-1 verify"].append(step.phase_seconds["verify"])
        ms["depth-1 forward"].append(step.forward_seconds)
    print(f"prompt {len(prompt)} tokens, context now {runner.cache[0].lengths}")
    for k, v in ms.items():
        print(f"{k:>16}: {1e3 * statistics.median(v):6.2f} ms (best {1e3 * min(v):6.2f})")

    # The drafter forward alone, on its session as it stands (no new context rows).
    drafter = pair.drafter
    session = runner.states["r0"].session
    anchor = runner.states["r0"].anchor
    parts = {k: [] for k in ("propose", "layers", "head")}
    for _ in range(args.rounds):
        t = time.perf_counter()
        c = drafter.propose([session], [anchor], [1])
        mx.eval(c.tokens, c.probs)
        parts["propose"].append(time.perf_counter() - t)
        cache = drafter.cache
        block = mx.array([[anchor, drafter.mask_token_id]])
        t = time.perf_counter()
        hidden = drafter.model(drafter.target.embed(block), cache)
        mx.eval(hidden)
        parts["layers"].append(time.perf_counter() - t)
        t = time.perf_counter()
        logits = drafter.head(hidden[:, 1:2]) if drafter.head is not None else None
        mx.eval(mx.argmax(logits, axis=-1))
        parts["head"].append(time.perf_counter() - t)
    for k, v in parts.items():
        print(f"{k:>16}: {1e3 * statistics.median(v):6.2f} ms (best {1e3 * min(v):6.2f})")


def widths() -> None:
    """The target's B=1 forward over 1, 2, 3, 4 and 8 new tokens at the chat prompt's context."""
    tune_process_if_wanted()
    pair = load_pair(resolve_target(TARGET), default_drafter(TARGET))
    tune_for_backend(pair)
    runner = ModelRunner(pair.target, pair.drafter)
    for _ in range(3):
        print([(w, round(1e3 * s, 2)) for _, w, s in runner.profile((1, 2, 3, 4, 8), 134, 10)])


if __name__ == "__main__":
    widths() if "--widths" in sys.argv else main()
