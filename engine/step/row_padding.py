"""Matmul row padding for the CPU backend: M rows computed as M' >= M where that is faster.

A decode or verify step multiplies a few rows (one per position: the batch, plus drafts) by
each weight matrix. OpenBLAS's float32 GEMM, as MLX's CPU backend calls it, is not monotone
in that row count: on the 2-core test machine its time rises from 16k + 1 rows to about
16k + 12 and falls back at 16(k + 1), so 12 rows through SmolLM2's 49k-row LM head took
22 ms and 16 rows 12 ms; 8 rows 14 ms (`python bench/row_padding.py` prints the curve). Zero
rows appended to the input, cut from the output, then cost less than nothing.

Which counts are slow depends on the BLAS, its kernels for the CPU and the thread count, so
nothing here is assumed: `measure` times one matmul of the model's width at every row count
up to `MOST_ROWS` and keeps a padding only where it measured clearly faster. `install` gives
the target's own `nn.Linear` layers (and a tied embedding's `as_linear`) a subclass that
pads to the table (weights and parameter paths unchanged); quantized layers do not call the
BLAS and keep theirs. Rows of a matmul are independent, so outputs are exactly the unpadded
ones. Metal and CUDA have no such curve: the engine installs this on the CPU backend only.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn

MOST_ROWS = 96  # decode steps up to 32 rows with drafts; larger forwards are prefill chunks
MIN_GAIN = 0.15  # pad only where the padded count measured at least this much faster
_ROUNDS = 3  # timings per row count
_TIMING_SECONDS = 1e-3  # the least one timing lasts


def wanted() -> bool:
    """On the CPU backend, unless turned off with ``FLASHBATCH_ROW_PADDING=0`` (for side by
    side measurements)."""
    if os.environ.get("FLASHBATCH_ROW_PADDING", "1") == "0":
        return False
    return mx.default_device().type == mx.DeviceType.cpu


class RowPadding:
    """Row count -> the count to compute it as (only the counts that gain are stored)."""

    def __init__(self, padded: dict[int, int]) -> None:
        if any(to <= rows for rows, to in padded.items()):
            raise ValueError("a padding must add rows")
        self.padded = dict(padded)

    def rows(self, rows: int) -> int:
        return self.padded.get(rows, rows)

    @classmethod
    def from_timings(cls, seconds: dict[int, float], min_gain: float = MIN_GAIN) -> RowPadding:
        """For each row count, the count (itself or more, at most twice) that took least,
        kept where it beat the count's own time by `min_gain`."""
        padded = {}
        for rows, own in seconds.items():
            candidates = [r for r in seconds if rows < r <= 2 * rows]
            if not candidates:
                continue
            best = min(candidates, key=lambda r: (seconds[r], r))
            if seconds[best] <= (1.0 - min_gain) * own:
                padded[rows] = best
        return cls(padded)


@functools.cache
def measure(hidden: int, dtype: mx.Dtype = mx.float32, most: int = MOST_ROWS) -> RowPadding:
    """Time ``[rows, hidden] @ [hidden, 4 * hidden]`` for rows 1..`most`, once per process per
    width and dtype (about half a second at SmolLM2's 576). Each timing repeats the product
    for at least a millisecond (one call is too short to time against `mx.eval`'s own cost);
    the least of `_ROUNDS` rounds is kept (on a shared machine, the undisturbed one)."""
    weight = mx.random.normal((4 * hidden, hidden)).astype(dtype)
    inputs = {rows: mx.random.normal((rows, hidden)).astype(dtype) for rows in range(1, most + 1)}
    mx.eval(weight, list(inputs.values()))
    repeats = {}
    for rows, x in inputs.items():  # calibrate (and warm up) each count
        started = time.perf_counter()
        mx.eval(x @ weight.T)
        repeats[rows] = max(1, min(64, int(_TIMING_SECONDS / (time.perf_counter() - started))))
    seconds = {rows: float("inf") for rows in inputs}
    for _ in range(_ROUNDS):  # rounds over every count, so a disturbance hits one round
        for rows, x in inputs.items():
            started = time.perf_counter()
            for _ in range(repeats[rows]):
                mx.eval(x @ weight.T)
            seconds[rows] = min(seconds[rows], (time.perf_counter() - started) / repeats[rows])
    return RowPadding.from_timings(seconds)


def _pad_rows(padding: RowPadding, x: mx.array, call: Any) -> mx.array:
    """`call` on `x` [..., d] with its rows padded per `padding`, the padding cut off again."""
    width = x.shape[-1]
    rows = x.size // width if width else 0
    target = padding.rows(rows)
    if target == rows:
        return call(x)
    flat = mx.concatenate([x.reshape(rows, width), mx.zeros((target - rows, width), x.dtype)])
    out = call(flat)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


_classes: dict[type, type] = {}


def _padded_class(cls: type) -> type:
    if cls not in _classes:
        if issubclass(cls, nn.Embedding):

            def as_linear(self: Any, x: mx.array) -> mx.array:
                return _pad_rows(self._flashbatch_rows, x, lambda v: cls.as_linear(self, v))

            members = {"as_linear": as_linear}
        else:

            def __call__(self: Any, x: mx.array) -> mx.array:  # noqa: N807
                return _pad_rows(self._flashbatch_rows, x, lambda v: cls.__call__(self, v))

            members = {"__call__": __call__}
        _classes[cls] = type(f"RowPadded{cls.__name__}", (cls,), members)
    return _classes[cls]


def install(model: nn.Module, padding: RowPadding) -> int:
    """Pad the rows of every float `nn.Linear` and `nn.Embedding` (its `as_linear`, a tied
    LM head) in `model` per `padding`; returns how many layers it covers (idempotent)."""
    covered = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in _classes.values():
            module._flashbatch_rows = padding
            covered += 1
        elif cls in (nn.Linear, nn.Embedding):  # not their quantized kin (no BLAS call)
            module.__class__ = _padded_class(cls)
            module._flashbatch_rows = padding
            covered += 1
    return covered


def pad_pair(target: Any, drafter: Any = None) -> RowPadding:
    """Measure the table for `target` (a `TargetAdapter`) and install it on the target's model
    and, when given, the drafter's (the engine on the CPU backend, and the step benchmarks)."""
    padding = measure(target.hidden_size, target.dtype)
    install(target.model, padding)
    if drafter is not None and hasattr(drafter, "model"):
        install(drafter.model, padding)
    return padding
