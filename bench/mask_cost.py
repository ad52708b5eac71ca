"""Structured output's mask cost per row per step on a real tokenizer: llguidance on the host
(plain step; cut + masks for a depth-4 verify) and the masks' application on the device.

    python bench/mask_cost.py MODEL_DIR   # a directory with tokenizer.json and config.json
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import sys
import time

import mlx.core as mx
import numpy as np
from transformers import PreTrainedTokenizerFast

from engine.step.structured import GrammarCompiler, StructuredOutput, allowed

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]}'


def main(path: str) -> None:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=f"{path}/tokenizer.json", eos_token="<|endoftext|>"
    )
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    build = time.perf_counter() - started
    spec = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
    started = time.perf_counter()
    grammar = compiler.matcher(spec)
    compile_seconds = time.perf_counter() - started
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    plain = []
    for token in answer:
        started = time.perf_counter()
        grammar.masks([])
        plain.append(time.perf_counter() - started)
        grammar.commit([token])
    grammar, verify = compiler.matcher(spec), []
    for i in range(0, len(answer) - 5, 5):
        started = time.perf_counter()
        grammar.masks(grammar.cut(answer[i : i + 4]))
        verify.append(time.perf_counter() - started)
        grammar.commit(answer[i : i + 5])
    logits = mx.random.normal((5 * 8, vocab))
    masks = [compiler.matcher(spec).masks([]).repeat(5, 0)] * 8
    mx.eval(logits)

    def apply() -> mx.array:  # what the sampler does with the masks
        return mx.where(allowed(masks, [5] * 8, vocab), logits, -mx.inf)

    for _ in range(3):
        mx.eval(apply())
    started = time.perf_counter()
    for _ in range(20):
        mx.eval(apply())
    per_apply = (time.perf_counter() - started) / 20
    print(f"vocab {vocab}: llguidance tokenizer {build * 1e3:.0f} ms once; "
          f"schema compile {compile_seconds * 1e3:.1f} ms")  # fmt: skip
    print(f"host mask, plain step: median {np.median(plain) * 1e6:.0f} us, "
          f"p90 {np.percentile(plain, 90) * 1e6:.0f} us per row")  # fmt: skip
    print(f"host cut + 5 masks (4 drafts + bonus): median {np.median(verify) * 1e6:.0f} us/row")
    print(f"device apply, 8 rows x 5 positions: {per_apply * 1e3:.2f} ms "
          f"({per_apply / 40 * 1e6:.0f} us per position)")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
