"""What a hybrid target's exact rollback costs, against a plain step and the verify itself.

    python bench/hybrid_rollback.py [--rows 1 8] [--depths 3 7] [--repeats 15] [--size small]

A random Qwen3.5-shaped model (GatedDeltaNet layers, full attention every 4th, built from
mlx-lm's own `ModelArgs`), `rows` rows prefilled to a 64-token context. Per batch size and
depth, median seconds of (interleaved, so host drift falls on all alike):

- plain: one decode step (1 position per row; a hybrid's plain step needs no rollback);
- verify: the verify forward over ``1 + depth`` positions per row, recording off;
- verify+replay: the same forward with recording on, synced, then `engine.step.recurrent.replay`
  built and computed (the engine builds it at the commit and computes it with the next
  step); odd rows keep ``1 + 3b mod (1 + depth)`` positions, even rows only their anchor;
- per-position: the alternative rollback, as a separate pass over the recorded inputs: every
  state layer's mixer one position at a time, each position's state kept, then each row's
  state gathered (what keeping per-position states during the verify would cost on top of a
  verify that ran its mixers one position at a time).

Also the bytes: a row's recurrent state (whatever its length), a position's KV, and what a
verify holds on top while it waits for the rollback (the pre-verify state and each state
layer's recorded input).
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import random
import statistics
import time

import mlx.core as mx
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import ArraysCache

from engine.step.kv_cache import RaggedKVCache
from engine.step.recurrent import replay
from engine.step.state_cache import RaggedStateCache
from engine.step.target import TargetAdapter

SIZES = {
    # About a tenth of Qwen3.5-4B's width, its head layout and ratios kept.
    "small": dict(
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),  # fmt: skip
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),  # fmt: skip
}


def build(size: str) -> TargetAdapter:
    config = dict(SIZES[size], model_type="qwen3_5", vocab_size=4096, rms_norm_eps=1e-6,
                  linear_conv_kernel_dim=4, full_attention_interval=4,
                  max_position_embeddings=4096, tie_word_embeddings=False,
                  rope_parameters={"type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.25})  # fmt: skip
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return TargetAdapter(model, [])


def per_position_states(cache: RaggedStateCache, keep: list[int]) -> None:
    """The alternative: each state layer's mixer one position at a time from the recorded
    state, row b keeping its state after ``keep[b]`` positions."""
    mixer, x, _mask, before = cache.recorded
    cache.recorded = None
    scratch = ArraysCache(len(before))
    scratch.cache = list(before)
    states = []
    for t in range(x.shape[1]):
        mixer(x[:, t : t + 1], mask=None, cache=scratch)
        states.append(list(scratch.cache))
    rows = mx.arange(x.shape[0])
    picked = mx.array([k - 1 for k in keep], dtype=mx.int32)
    cache.cache = [
        mx.stack([s[slot] for s in states], axis=1)[rows, picked] for slot in range(len(before))
    ]


def measure(target: TargetAdapter, rows: int, depth: int, repeats: int) -> dict[str, float]:
    cache = target.new_cache(rows)
    prompt = mx.array([[random.randrange(4096) for _ in range(64)] for _ in range(rows)])
    mx.eval(target(prompt, cache)[0], [c.arrays() for c in cache])
    states = [c for c in cache if isinstance(c, RaggedStateCache)]
    kv = [c for c in cache if isinstance(c, RaggedKVCache)]
    width = depth + 1
    # What rows keep: a mix (some reject their first draft, some keep a few); the replay
    # runs over the longest kept span.
    keeps = {depth: [1 + (3 * b) % width if b % 2 else 1 for b in range(rows)]}
    tokens = {n: mx.array([[random.randrange(4096) for _ in range(n)] for _ in range(rows)])
              for n in (1, width)}  # fmt: skip

    def reset(before: list, n: int) -> None:
        for c, b in zip(states, before):
            c.restore(b)
            c.recorded = None
        for c in kv:
            c.trim_rows([n] * rows)

    def plain() -> None:
        logits, _ = target(tokens[1], cache)
        mx.eval(logits, [c.arrays() for c in states])

    def verify() -> None:
        logits, _ = target(tokens[width], cache)
        mx.eval(logits, [c.arrays() for c in states])

    def verify_replay() -> None:
        keep = keeps[depth]
        for c in states:
            c.recording = True
        logits, _ = target(tokens[width], cache)
        for c in states:
            c.recording = False
        mx.eval(logits)  # the step's sync; the replay is built at the commit, after it
        for c in states:
            replay(c, keep)
        mx.eval([c.arrays() for c in states])

    def per_position() -> float:  # the pass alone, after a recorded verify
        for c in states:
            c.recording = True
        mx.eval(target(tokens[width], cache)[0])
        for c in states:
            c.recording = False
        keep = keeps[depth]
        started = time.perf_counter()
        for c in states:
            per_position_states(c, keep)
        mx.eval([c.arrays() for c in states])
        return time.perf_counter() - started

    cases = {"plain": (plain, 1), "verify": (verify, width),
             "verify+replay": (verify_replay, width)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in [*cases, "per-position"]}
    for _ in range(repeats):
        for name, (run, n) in cases.items():
            before = [c.snapshot() for c in states]
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
            reset(before, n)
        before = [c.snapshot() for c in states]
        times["per-position"].append(per_position())
        reset(before, width)
    return {name: statistics.median(t) for name, t in times.items()}


def memory(target: TargetAdapter, rows: int, width: int) -> dict[str, int]:
    cache = target.new_cache(1)
    mx.eval(target(mx.zeros((1, 1), dtype=mx.int32), cache)[0])
    state = sum(c.nbytes for c in cache if isinstance(c, RaggedStateCache))
    per_token = sum(c.nbytes // c.keys.shape[2] for c in cache if isinstance(c, RaggedKVCache))
    layers = sum(isinstance(c, RaggedStateCache) for c in cache)
    recorded = layers * width * target.hidden_size * target.dtype.size  # inputs, per row
    return {"state per row": state, "KV per position": per_token,
            "verify extra per row": state + recorded}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--depths", type=int, nargs="+", default=[3, 7])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    args = parser.parse_args()
    random.seed(0)
    target = build(args.size)
    print(f"qwen3_5 {args.size}: {SIZES[args.size]}")
    print("| rows | depth | plain ms | verify ms | verify+replay ms | replay extra | "
          "per-position pass ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for depth in args.depths:
            t = measure(target, rows, depth, args.repeats)
            extra = t["verify+replay"] - t["verify"]
            print(f"| {rows} | {depth} | {t['plain'] * 1e3:.2f} | {t['verify'] * 1e3:.2f} | "
                  f"{t['verify+replay'] * 1e3:.2f} | {extra * 1e3:+.2f} ms "
                  f"({extra / t['plain']:+.0%} of plain) | "
                  f"{t['per-position'] * 1e3:.2f} |")  # fmt: skip
    for name, value in memory(target, 1, 1 + max(args.depths)).items():
        print(f"{name}: {value} bytes")


if __name__ == "__main__":
    main()
