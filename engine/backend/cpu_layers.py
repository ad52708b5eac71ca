"""The CPU kernels (`engine.backend.cpu_kernels`) inside the mlx-lm llama, qwen2 and qwen3 decoders.

Each layer's attention and MLP get a subclass of their own class whose ``__call__`` is the
stock one with `cpu_kernels.attention` for `mx.fast.scaled_dot_product_attention` and
`cpu_kernels.swiglu` for mlx-lm's `swiglu`. Weights, parameter paths and the cache protocol stay
as they were (as with the adapter's tapped layers), so the stock model forward, the packed verify
and every cache run on them unchanged. The engine installs them on its own model only: a model
loaded for an mlx-lm baseline keeps the stock code.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.backend import cpu_kernels
from engine.step.packed import ATTENTION_PARTS, qkv_heads  # the structure the packed verify needs

_classes: dict[tuple[type, str], type] = {}


def _attention_call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    B, L, _ = x.shape
    queries, keys, values = qkv_heads(self, x, B, L)
    if cache is not None:
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries, keys = self.rope(queries), self.rope(keys)
    output = cpu_kernels.attention(queries, keys, values, self.scale, mask)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _mlp_call(self: Any, x: mx.array) -> mx.array:
    return self.down_proj(cpu_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


def _subclass(cls: type, kind: str) -> type:
    if (cls, kind) not in _classes:
        call = _attention_call if kind == "attention" else _mlp_call
        _classes[(cls, kind)] = type(f"Cpu{cls.__name__}", (cls,), {"__call__": call})
    return _classes[(cls, kind)]


def unsupported_reason(layers: list[nn.Module]) -> str | None:
    """Why these decoder layers cannot take the CPU kernels (None when they can)."""
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or any(not hasattr(attn, p) for p in ATTENTION_PARTS):
            return f"layer {i}: attention lacks the llama/qwen structure"
        if mlp is None or any(not hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}: the MLP is not a SwiGLU"
        if getattr(layer, "use_sliding", False) or getattr(attn, "sinks", None) is not None:
            return f"layer {i}: sliding-window or sink attention"
    return None


def install(layers: list[nn.Module]) -> None:
    """Give every layer's attention and MLP the CPU-kernel call (idempotent)."""
    for layer in layers:
        for name, kind in (("self_attn", "attention"), ("mlp", "mlp")):
            module = getattr(layer, name)
            if type(module) not in _classes.values():
                module.__class__ = _subclass(type(module), kind)
