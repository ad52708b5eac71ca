"""Decode-time attention on the CPU kernels: scores as queries @ keys^T against keys @ queries.

    PYTHONPATH=<repo> python bench/decode_attention.py [--rows 8,32] [--keys 128,512,1024]

For each shape (rows, queries a row, keys), times `cpu_kernels.attention` over 30 layers'
worth of separate ragged caches (SmolLM2's 9 query heads over 3 key heads, head size 64), the
cache sliced to its longest row as `RaggedKVCache.fetch` does, once with the keys @ queries
orientation on and once with it off (`FLASHBATCH_DECODE_KEYS_FIRST`, read at import, so each
arm runs in a subprocess). Prints medians and their ratio, and whether the outputs are the
same bit for bit (a digest of their bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ARM = r"""
import engine  # noqa: F401
import hashlib, json, statistics, sys, time
import numpy as np
import mlx.core as mx
from engine.backend.cpu_kernels import attention
rows, L, T, layers = (int(x) for x in sys.argv[1:5])
heads, kv, d, cap = 9, 3, 64, ((T + L + 255) // 256) * 256
rng = np.random.default_rng(0)
lengths = [T] + [int(x) for x in rng.integers(max(1, T // 8), T + 1, rows - 1)]
keys = [mx.random.normal((rows, kv, cap, d), key=mx.random.key(i)) for i in range(layers)]
values = [mx.random.normal((rows, kv, cap, d), key=mx.random.key(100 + i)) for i in range(layers)]
q = mx.random.normal((rows, heads, L, d), key=mx.random.key(7))
end = T + L
mask = mx.arange(end)[None, None, None, :] <= (
    mx.array(lengths)[:, None, None, None] + mx.arange(L)[None, None, :, None])
mx.eval(keys, values, q, mask)
def run():
    return [attention(q, k[:, :, :end], v[:, :, :end], 0.125, mask) for k, v in zip(keys, values)]
times = []
for _ in range(9):
    t = time.perf_counter(); out = run(); mx.eval(out); times.append(time.perf_counter() - t)
digest = hashlib.sha1(b"".join(np.asarray(o).tobytes() for o in out)).hexdigest()
print(json.dumps({"ms": 1e3 * statistics.median(times[2:]), "digest": digest}))
"""


def arm(keys_first: bool, rows: int, queries: int, keys: int) -> dict:
    env = dict(os.environ, FLASHBATCH_DECODE_KEYS_FIRST="1" if keys_first else "0")
    out = subprocess.run(
        [sys.executable, "-c", ARM, str(rows), str(queries), str(keys), "30"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--queries", default="1")
    parser.add_argument("--keys", default="128,512,1024")
    args = parser.parse_args()
    print("| rows | queries a row | keys (longest) | q @ k^T ms | k @ q ms | ratio | same |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for rows in map(int, args.rows.split(",")):
        for queries in map(int, args.queries.split(",")):
            for keys in map(int, args.keys.split(",")):
                old, new = arm(False, rows, queries, keys), arm(True, rows, queries, keys)
                same = old["digest"] == new["digest"]
                print(f"| {rows} | {queries} | {keys} | {old['ms']:.1f} | {new['ms']:.1f} | "
                      f"{old['ms'] / new['ms']:.2f} | {same} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
