"""The DFlash draft model: a small non-causal transformer conditioned on target features.

It reads a block ``[anchor, MASK, ..., MASK]`` and predicts every masked position in one
forward. The target's tapped-layer features are projected once (`fc` + `hidden_norm`) into
context rows, and every layer turns them into extra keys/values with its own `k_proj`/`v_proj`
(+ `k_norm`, RoPE at the rows' absolute positions). Only those context keys/values are cached;
block rows are recomputed each call and never kept. Embedding and LM head are the target's.

Batched from the start: row b of a batch has its own context length (the cache is ragged), and
a mask hides the padding. Names mirror the z-lab checkpoint layout, so weights load as is.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from drafters.dflash.config import DFlashConfig
from engine.backend import cpu_kernels
from engine.step.kv_cache import RaggedKVCache


class DFlashAttention(nn.Module):
    cpu_kernels = False  # inference on the CPU backend: `DFlashDraftModel.use_cpu_kernels`

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        bias = config.attention_bias
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def split_heads(self, x: mx.array, n_heads: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, self.head_dim).transpose(0, 2, 1, 3)

    def context_keys(self, k: mx.array, v: mx.array, offset: mx.array) -> tuple[mx.array, mx.array]:
        """Projected context rows [B, S, kv*hd] -> normed, rotated keys/values [B, kv, S, hd]."""
        keys = self.rope(self.k_norm(self.split_heads(k, self.n_kv_heads)), offset=offset)
        return keys, self.split_heads(v, self.n_kv_heads)

    def __call__(
        self,
        x: mx.array,
        context_keys: mx.array,
        context_values: mx.array,
        offset: mx.array,
        mask: mx.array | None,
    ) -> mx.array:
        """Block queries attend over [context | block] without a causal mask."""
        B, L, _ = x.shape
        q = self.rope(self.q_norm(self.split_heads(self.q_proj(x), self.n_heads)), offset=offset)
        k = self.rope(self.k_norm(self.split_heads(self.k_proj(x), self.n_kv_heads)), offset=offset)
        v = self.split_heads(self.v_proj(x), self.n_kv_heads)
        keys = mx.concatenate([context_keys, k], axis=2)
        values = mx.concatenate([context_values, v], axis=2)
        if self.cpu_kernels:
            out = cpu_kernels.attention(q, keys, values, self.scale, mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DFlashMLP(nn.Module):
    cpu_kernels = False

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        if self.cpu_kernels:
            return self.down_proj(cpu_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, window: int | None = None) -> None:
        super().__init__()
        self.window = window  # sliding attention over this many positions (None: full)
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, h, context_keys, context_values, offset, mask) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), context_keys, context_values, offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The drafter's own weights: `fc`, `hidden_norm`, the layers and the final `norm`."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        width = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [
            DFlashLayer(config, config.window_of(i)) for i in range(config.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Inference-only: all layers' context K/V weights stacked into one matrix, so the new
        # context rows of a step are projected for every layer by one matmul (fewer, larger
        # ops win on CPU). A leading underscore keeps it out of parameters() and checkpoints.
        self._fused_context_kv: mx.array | None = None

    def make_cache(self, batch_size: int = 1) -> list[RaggedKVCache]:
        return [RaggedKVCache(batch_size) for _ in self.layers]

    def use_cpu_kernels(self) -> None:
        """Attention and SwiGLU on `engine.backend.cpu_kernels` (the CPU backend; their softmax
        and SwiGLU carry their own gradients, so training uses them too)."""
        for layer in self.layers:
            layer.self_attn.cpu_kernels = layer.mlp.cpu_kernels = True

    def fuse_context_projections(self) -> None:
        """Stack every layer's k/v projection for inference. Call again after weights change."""
        if self.config.attention_bias:
            self._fused_context_kv = None  # biases would need fusing too; keep per-layer path
            return
        weights = []
        for layer in self.layers:
            weights += [layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]
        self._fused_context_kv = mx.concatenate(weights, axis=0)
        mx.eval(self._fused_context_kv)

    def project_context(self, features: mx.array) -> mx.array:
        """Target features [B, S, K*d] -> context rows C [B, S, d]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, context: mx.array, offset: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Every layer's rotated context keys and values for context rows C at `offset`."""
        if self._fused_context_kv is None:
            projected = [
                (layer.self_attn.k_proj(context), layer.self_attn.v_proj(context))
                for layer in self.layers
            ]
        else:
            stacked = context @ self._fused_context_kv.T
            parts = mx.split(stacked, 2 * len(self.layers), axis=-1)
            projected = [(parts[2 * i], parts[2 * i + 1]) for i in range(len(self.layers))]
        return [
            layer.self_attn.context_keys(k, v, offset)
            for layer, (k, v) in zip(self.layers, projected)
        ]

    def append_context(
        self, features: mx.array, counts: list[int], cache: list[RaggedKVCache]
    ) -> None:
        """Write new context rows (row b keeps its first counts[b]) into the drafter cache."""
        offset = cache[0].offset
        for layer_cache, (k, v) in zip(
            cache, self.context_kv(self.project_context(features), offset)
        ):
            layer_cache.write(k, v, counts)

    def __call__(
        self,
        block_embeddings: mx.array,
        cache: list[RaggedKVCache],
        features: mx.array | None = None,
        counts: list[int] | None = None,
    ) -> mx.array:
        """One draft forward: append pending context rows, then run the block.

        block_embeddings: [B, Q, d], the target's embeddings of ``[anchor, MASK, ...]``.
        features: [B, S, K*d] pending target features (row b keeps its first counts[b]).
        Returns the final-normed hidden states of the block, [B, Q, d].
        """
        if features is not None and features.shape[1] > 0:
            self.append_context(features, counts or [features.shape[1]] * features.shape[0], cache)
        lengths = cache[0].lengths
        block_offset = cache[0].offset  # the anchor sits right after each row's context
        block_len = block_embeddings.shape[1]
        masks = {None: _context_mask(lengths, block_len)}
        for window in {layer.window for layer in self.layers} - {None}:
            masks[window] = _window_mask(lengths, block_len, window)
        h = block_embeddings
        for layer, layer_cache in zip(self.layers, cache):
            mask = masks[layer.window]
            if layer_cache.keys is None:  # no context yet: the block attends to itself only
                empty = mx.zeros(
                    (len(lengths), self.config.num_key_value_heads, 0, self.config.head_dim),
                    block_embeddings.dtype,
                )
                context_keys = context_values = empty
            else:
                context_keys, context_values = layer_cache.fetch()
            h = layer(h, context_keys, context_values, block_offset, mask)
        return self.norm(h)


def _window_mask(lengths: list[int], block_len: int, window: int) -> mx.array:
    """[B, 1, Q, S_max + Q] validity for a sliding layer: block query i of row b sits at
    position ``lengths[b] + i`` and sees a key at position p iff ``p > that - window`` (and
    the key is real: context keys past the row's own length are padding)."""
    longest = max(lengths) if lengths else 0
    context_len = mx.array(lengths, dtype=mx.int32)[:, None, None]  # [B, 1, 1]
    query_pos = context_len + mx.arange(block_len)[None, :, None]  # [B, Q, 1]
    slot = mx.arange(longest + block_len)[None, None, :]
    # Context slot j holds position j; block slot longest + i' holds position lengths[b] + i'.
    key_pos = mx.where(slot < longest, slot, context_len + slot - longest)
    real = (slot < context_len) | (slot >= longest)
    valid = real & (key_pos > query_pos - window)  # [B, Q, S_max + Q]
    return valid[:, None, :, :]


def _context_mask(lengths: list[int], block_len: int) -> mx.array | None:
    """[B, 1, Q, S_max + Q] validity: each row sees its own context and the whole block."""
    if len(set(lengths)) <= 1:
        return None
    longest = max(lengths)
    key_pos = mx.arange(longest + block_len)[None, :]
    context_len = mx.array(lengths, dtype=mx.int32)[:, None]
    valid = (key_pos < context_len) | (key_pos >= longest)  # [B, S_max + Q]
    return mx.broadcast_to(
        valid[:, None, None, :], (len(lengths), 1, block_len, longest + block_len)
    )
