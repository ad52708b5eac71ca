"""Warm start: a drafter whose step 0 already behaves like the top of its target.

A DFlash layer has the target layer's shapes, so the drafter's L_d layers can start as copies
of the target's last L_d layers, its final norm as the target's final norm, and `fc` as a pass-
through of the deepest tapped layer (identity on that tap's block, zeros elsewhere), with
`hidden_norm` set to the first copied layer's input norm. When the deepest tap is the layer
just below the copied ones (the default taps end at L_t - 3; 2 drafter layers copy L_t - 2 and
L_t - 1), the first drafter layer's context keys/values are then exactly what the target
layer computes from its own input; the second sees the same rows, an approximation.

Targets with per-head q/k norms (Qwen3) give them to the drafter as they are. Targets without
them (llama: SmolLM2) get norms whose weight is the mean per-head RMS of that layer's q (k) on
sample tokens, so `q_norm(q)` keeps the scale the copied `q_proj` produced and attention
logits start at the target's temperature instead of ~sqrt(head_dim) times smaller or larger.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from drafters.dflash.model import DFlashDraftModel
from engine.step.target import TargetAdapter

log = logging.getLogger(__name__)


def _dense(linear: nn.Module) -> mx.array:
    """A linear layer's weight as a float matrix (dequantized where it is quantized)."""
    if hasattr(linear, "scales"):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            getattr(linear, "biases", None),
            group_size=linear.group_size,
            bits=linear.bits,
        )
    return linear.weight


def _head_rms(proj: mx.array, heads: int, head_dim: int) -> float:
    """Mean RMS of each head's slice of projected rows [T, heads * head_dim]."""
    split = proj.reshape(-1, heads, head_dim).astype(mx.float32)
    return float(mx.sqrt((split * split).mean(-1)).mean().item())


def warm_start(
    model: DFlashDraftModel, target: TargetAdapter, sample_tokens: np.ndarray | None = None
) -> dict[str, float]:
    """Overwrite `model`'s weights from the target (in place); returns the q/k norm scales
    set, by name (empty when the target has its own q/k norms)."""
    config = model.config
    depth = len(model.layers)
    sources = target.layers[target.num_layers - depth :]
    d = config.hidden_size
    scales: dict[str, float] = {}
    features = None
    needs_scale = not hasattr(sources[0].self_attn, "q_norm")
    if needs_scale:
        if sample_tokens is None:
            raise ValueError("a target without q/k norms needs sample tokens to set their scale")
        _, features = target(mx.array(np.asarray(sample_tokens, np.int32))[None])
        deepest = int(np.argmax(config.target_layer_ids))
        features = features[0, :, deepest * d : (deepest + 1) * d]
    for i, (layer, source) in enumerate(zip(model.layers, sources)):
        attn, src = layer.self_attn, source.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).weight = _dense(getattr(src, name)).astype(mx.float32)
            if "bias" in getattr(attn, name) and "bias" in getattr(src, name):
                getattr(attn, name).bias = getattr(src, name).bias.astype(mx.float32)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight = _dense(getattr(source.mlp, name)).astype(mx.float32)
        layer.input_layernorm.weight = source.input_layernorm.weight.astype(mx.float32)
        layer.post_attention_layernorm.weight = source.post_attention_layernorm.weight.astype(
            mx.float32
        )
        if not needs_scale:
            attn.q_norm.weight = src.q_norm.weight.astype(mx.float32)
            attn.k_norm.weight = src.k_norm.weight.astype(mx.float32)
            continue
        x = source.input_layernorm(features).astype(mx.float32)  # exact for i == 0
        q_scale = _head_rms(x @ attn.q_proj.weight.T, attn.n_heads, attn.head_dim)
        k_scale = _head_rms(x @ attn.k_proj.weight.T, attn.n_kv_heads, attn.head_dim)
        attn.q_norm.weight = mx.full((attn.head_dim,), q_scale)
        attn.k_norm.weight = mx.full((attn.head_dim,), k_scale)
        scales[f"layers.{i}.q_norm"], scales[f"layers.{i}.k_norm"] = q_scale, k_scale
    taps = len(config.target_layer_ids)
    deepest = int(np.argmax(config.target_layer_ids))
    fc = np.zeros((d, taps * d), np.float32)
    fc[:, deepest * d : (deepest + 1) * d] = np.eye(d, dtype=np.float32)
    model.fc.weight = mx.array(fc)
    model.hidden_norm.weight = sources[0].input_layernorm.weight.astype(mx.float32)
    model.norm.weight = target._inner.norm.weight.astype(mx.float32)
    mx.eval(model.parameters())
    if max(config.target_layer_ids) != target.num_layers - depth - 1:
        log.warning(
            "warm start: deepest tap %d is not the layer below the copied ones (%d)",
            max(config.target_layer_ids),
            target.num_layers - depth - 1,
        )
    return scales
