"""A 30-layer chain of the MLP's matrices (576 x 1536, float32) on 1-8 rows, three ways:
x @ W.T (a), (W @ x.T).T (b), one row at a time (c), and (a) for the gate with (c) for the
down projection (d). Milliseconds per chain, MLX on the CPU backend.

    PYTHONPATH=<repo> python gemm_rows.py
"""

import engine  # noqa
import time

import mlx.core as mx

L = 30
Ws = [
    (mx.random.normal((1536, 576)) * 0.02, mx.random.normal((576, 1536)) * 0.02) for _ in range(L)
]
mx.eval(Ws)


def chain(x, form):
    for g, d in Ws:
        if form == "a":
            h = x @ g.T
            x = h @ d.T
        elif form == "b":
            h = (g @ x.T).T
            x = (d @ h.T).T
        elif form == "c":
            rows = []
            for i in range(x.shape[0]):
                hi = x[i : i + 1] @ g.T
                rows.append(hi @ d.T)
            x = mx.concatenate(rows, 0)
        elif form == "d":  # gate as a, down as loop
            h = x @ g.T
            x = mx.concatenate([h[i : i + 1] @ d.T for i in range(h.shape[0])], 0)
    return x


def t(f, n=30):
    for _ in range(3):
        mx.eval(f())
    s = time.perf_counter()
    for _ in range(n):
        mx.eval(f())
    return (time.perf_counter() - s) / n * 1e3


for M in (1, 2, 3, 4, 8):
    x = mx.random.normal((M, 576))
    mx.eval(x)
    print(M, {f: round(t(lambda x=x, f=f: chain(x, f)), 2) for f in "abcd"})
