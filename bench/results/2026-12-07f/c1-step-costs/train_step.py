"""Where a campaign training micro-step's time goes (SmolLM2's drafter, the shipped recipe):
eight sequences of shard 38, their forward and forward + backward, then one sequence's first
drafter layer op by op (each op evaluated on its own, so the sum overstates a fused forward).

    PYTHONPATH=. python bench/results/2026-12-07f/c1-step-costs/train_step.py
"""

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from drafters.dflash import campaign
from drafters.dflash.train import block_attention, block_row_mask, context_kv_per_layer
from engine.backend.cpu_kernels import softmax as attn_softmax

TARGET = "smollm2-135m-instruct"


def median_ms(fn, repeats: int = 8) -> tuple[float, object]:
    """Median milliseconds of `fn()` evaluated, the first two runs dropped; its last output."""
    seconds, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        mx.eval(out)
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds[2:]), out


trainer = campaign.trainer_for(TARGET, Path("engine/models/smollm2_drafter"))
recipe = trainer.recipe
train_records, _ = campaign.corpus_split(TARGET)
sequences = campaign.to_sequences(train_records, recipe.max_len)
shard = [sequences[i] for i in campaign.shard_slices(len(sequences), recipe.shard_records)[38]]
store = trainer.store(shard)
items = []
for i in range(8):
    blocks, batch = trainer.training_blocks(store, i, shard[i], np.random.default_rng([0, i]))
    items.append((store.get(i), blocks, batch))
print("sequence lengths", [features.shape[1] for features, _, _ in items])


def losses():
    return [trainer._loss(f, b, batch, recipe.candidates, recipe.distill)[0]
            for f, b, batch in items]  # fmt: skip


def gradients():
    return [trainer._grad(f, b, batch, recipe.candidates, recipe.distill)
            for f, b, batch in items]  # fmt: skip


print(f"loss forward: {median_ms(losses)[0]:.0f} ms / 8 sequences")
print(f"forward + backward: {median_ms(gradients)[0]:.0f} ms / 8 sequences")

features, blocks, _ = items[0]
model, layer = trainer.model, trainer.model.layers[0]
attn = layer.self_attn
embeddings = trainer.target.embed(mx.array(blocks.block_ids)).astype(model.norm.weight.dtype)
mask = mx.array(block_row_mask(features.shape[1], blocks.anchors, blocks.block_ids.shape[1]))
anchors = mx.array(blocks.anchors, dtype=mx.int32)
times = {}
times["project_context"], context = median_ms(lambda: model.project_context(features))
times["context_kv"], kvs = median_ms(lambda: context_kv_per_layer(model, context))
keys, values = kvs[0]
x = layer.input_layernorm(embeddings)
times["attention"], out = median_ms(
    lambda: block_attention(attn, x, keys[0], values[0], anchors, mask)
)
h = embeddings + out
times["mlp"], _ = median_ms(lambda: layer.mlp(layer.post_attention_layernorm(h)))
# Inside the attention: the projections, and the softmax over [N, kv, rep, B, S + B].
times["q/k/v/o projections"], _ = median_ms(
    lambda: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(x)]
)
n, b = x.shape[:2]
scores = mx.random.normal((n, attn.n_kv_heads, attn.n_heads // attn.n_kv_heads, b,
                           keys.shape[2] + b))  # fmt: skip
times["softmax"], _ = median_ms(lambda: attn_softmax(scores))
print({name: round(ms, 1) for name, ms in times.items()}, "(ms, one sequence, layer 0)")
