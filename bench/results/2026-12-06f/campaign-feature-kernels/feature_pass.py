"""The campaign's feature pass as it ran before sitting 11 and as it runs now: the target on
MLX's attention and SwiGLU and the top-8 by a partition of the whole vocabulary, against the
target on the CPU kernels (`engine.backend.cpu_kernels`) and the top-8 by `top_k_ids`.

    PYTHONPATH=<repo> python feature_pass.py [shard] [batches]

Two copies of SmolLM2-135M-Instruct (float32, tapped at layers 1 and 27, as the shipped
drafter reads them), one stock ("before") and one on the kernels ("now"). `batches` batches
spread over a training shard, cut as `FeatureStore.build` cuts them, each through both arms in
turn (the order alternating), top-8 log-probabilities included. Prints the seconds a token each way
and how far the two stores would differ.
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import sys
import time

import mlx.core as mx
import numpy as np

from drafters.dflash import campaign
from drafters.dflash.features import length_batches, top_k_logprobs
from engine.models.loading import load_target_model
from engine.models.resolve import resolve_target
from engine.step.target import TargetAdapter

TARGET, TAPS = "smollm2-135m-instruct", [1, 27]


def vocabulary_top_k(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`top_k_logprobs` as it was before sitting 11: a partition of the whole vocabulary."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ids = mx.argpartition(-logp, k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids, values = mx.take_along_axis(ids, order, -1), mx.take_along_axis(values, order, -1)
    return np.asarray(ids.astype(mx.int32)), np.asarray(values)


def forward(target: TargetAdapter, ids: mx.array, top_k) -> tuple[float, np.ndarray, np.ndarray]:
    start = time.perf_counter()
    logits, features = target(ids)
    features = np.asarray(features.astype(mx.float32))
    top_ids, top_logp = top_k(logits, 8)
    return time.perf_counter() - start, features, top_ids


def main(shard: int, count: int) -> None:
    path = resolve_target(TARGET)
    stock = TargetAdapter(load_target_model(path)[0], TAPS)
    kernels = TargetAdapter(load_target_model(path)[0], TAPS)
    assert kernels.use_cpu_kernels() is None
    train, _ = campaign.corpus_split(TARGET)
    members = campaign.shard_slices(len(train), 512)[shard]
    tokens = [np.asarray(train[i]["tokens"][:768], np.int32) for i in members]
    every = length_batches([len(t) for t in tokens], 2048, 8)
    batches = every[:: max(1, len(every) // count)][:count]  # short to long
    arms = {"before": (stock, vocabulary_top_k), "now": (kernels, top_k_logprobs)}
    seconds = {"before": 0.0, "now": 0.0}
    worst, top1_same, positions = 0.0, 0, 0
    for n, batch in enumerate(batches):
        longest = max(len(tokens[i]) for i in batch)
        ids = np.zeros((len(batch), longest), np.int32)
        for row, i in enumerate(batch):
            ids[row, : len(tokens[i])] = tokens[i]
        ids = mx.array(ids)
        order = ("before", "now") if n % 2 == 0 else ("now", "before")
        out = {}
        for name in order:
            elapsed, features, top = forward(arms[name][0], ids, arms[name][1])
            seconds[name] += elapsed
            out[name] = (features, top)
        scale = np.abs(out["before"][0]).max()
        worst = max(worst, float(np.abs(out["before"][0] - out["now"][0]).max() / scale))
        top1_same += int((out["before"][1][..., 0] == out["now"][1][..., 0]).sum())
        positions += out["before"][1][..., 0].size
    real = sum(len(tokens[i]) for b in batches for i in b)
    print(f"shard {shard}: {len(batches)} batches, {real} tokens")
    for name, total in seconds.items():
        print(f"  {name}: {1000 * total / real:.2f} ms a token ({total:.1f} s)")
    print(f"  before / now: {seconds['before'] / seconds['now']:.2f}x")
    print(f"  largest feature difference / largest feature: {worst:.2e}")
    print(f"  top-1 next token equal at {top1_same} of {positions} positions (padding included)")


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 16, int(sys.argv[2]) if len(sys.argv) > 2 else 6
    )
