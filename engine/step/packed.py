"""Packed verify forward: every decoding row contributes exactly its own ``1 + depth`` positions.

The padded verify (stock mlx-lm forward on ``[B, widest]``) makes every row pay for the widest
row. Here all rows' positions form one packed sequence ``[1, N, H]`` (N = sum of widths) for
everything that is per token (embedding, norms, q/k/v/o projections, MLP, LM head); only
attention sees the rows. It runs the model's own submodules and weights (mlx-lm ``llama``,
``qwen2``, ``qwen3``), so no weights are copied or converted.

Attention: each row's new K/V are written into its own `RaggedKVCache` slot at its own
offset; RoPE runs on the packed ``[N, heads, 1, D]`` view with one position per token
(`mx.fast.rope` takes a per-batch offset vector). The attention itself runs in one of two
layouts, chosen per forward by `padded_attention_pays` (measured on the 2-core CPU,
`bench/packed_attention.py`): *split* (every row's anchor in one ``[B, heads, 1, T]`` SDPA,
the drafting rows' drafted positions in one more over just those rows' cache) when few rows
draft, *padded* (one ``[B, heads, widest, T]`` SDPA, per-row causal mask) when many do. Both
are exact; attention at decode sizes is bound by reading the cache, so a padded query row
costs little next to a second pass over a drafting row's cache.

`PackedLayout` is the one mapping between (row, verify position) and packed index; logits,
features and samples come back packed ``[N, ...]`` and are read through it.

Prefill chunks of requests that have not joined the batch yet may ride in the same forward
(`PrefillSegment`): their tokens follow the rows' positions in the packed sequence, so they
share every per-token matmul, and each attends causally over its request's own one-row cache.
A join then costs its tokens' compute, not a forward of its own (on the CPU a forward has a
large fixed cost: a 20-token prompt alone cost the bundled target more than 7 decoding rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.backend import cpu_kernels
from engine.step.kv_cache import RaggedKVCache

log = logging.getLogger(__name__)

# mlx-lm model modules whose decoder layers have the structure `packed_forward` runs.
SUPPORTED_MODULES = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")


@dataclass(frozen=True)
class PackedLayout:
    """Where each row's verify positions lie in the packed sequence.

    Row b owns packed indices ``starts[b] .. starts[b] + widths[b] - 1``; its position i is
    the token at cache position ``lengths[b] + i``. Position 0 is the row's anchor (the last
    committed token), positions 1.. its drafts.
    """

    widths: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]  # each row's cache length before this forward

    @classmethod
    def build(cls, widths: list[int], lengths: list[int]) -> PackedLayout:
        if len(widths) != len(lengths) or any(w < 1 for w in widths):
            raise ValueError(f"need one width >= 1 per row, got {widths} for {len(lengths)} rows")
        starts, total = [], 0
        for w in widths:
            starts.append(total)
            total += w
        return cls(tuple(widths), tuple(starts), tuple(lengths))

    @property
    def rows(self) -> int:
        return len(self.widths)

    @property
    def total(self) -> int:
        return sum(self.widths)

    @property
    def max_width(self) -> int:
        return max(self.widths)

    @property
    def drafting_rows(self) -> list[int]:
        return [b for b, w in enumerate(self.widths) if w > 1]

    def index(self, row: int, position: int) -> int:
        """Packed index of verify position `position` of `row`."""
        if not 0 <= position < self.widths[row]:
            raise IndexError(f"row {row} has {self.widths[row]} verify positions")
        return self.starts[row] + position

    def padded_index(self, rows: list[int], first: int, width: int) -> list[int]:
        """Packed index of positions ``first .. first + width - 1`` of each of `rows`, flat
        [len(rows) * width]; past a row's own width its last position is repeated."""
        return [
            self.starts[b] + min(first + i, self.widths[b] - 1) for b in rows for i in range(width)
        ]

    def positions(self) -> list[int]:
        """Absolute (cache) position of every packed token, for RoPE."""
        return [n + i for n, w in zip(self.lengths, self.widths) for i in range(w)]


@dataclass(frozen=True)
class PrefillSegment:
    """A prompt chunk inside the packed forward: `tokens` continue the request's own cache
    (one `RaggedKVCache` row per layer, `cache[0].lengths[0]` positions so far). `full`: the
    head runs on every one of its positions (prompt logprobs), not only its last."""

    tokens: list[int]
    cache: list[RaggedKVCache]
    full: bool = False

    @property
    def offset(self) -> int:
        return self.cache[0].lengths[0]


def packed_unsupported_reason(model: nn.Module, inner: nn.Module) -> str | None:
    """Why `packed_forward` cannot run this model (None when it can)."""
    module = type(model).__module__
    if module not in SUPPORTED_MODULES:
        return f"model module {module!r} is not one of {sorted(SUPPORTED_MODULES)}"
    if getattr(model, "args", None) is None or not hasattr(inner, "norm"):
        return "no model args or final norm"
    for i, layer in enumerate(inner.layers):
        if getattr(layer, "foreign", False):  # pipeline parallel: another rank computes it
            continue
        missing = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
        missing += [p for p in ATTENTION_PARTS if not hasattr(getattr(layer, "self_attn", None), p)]
        if missing:
            return f"layer {i} lacks {missing}"
        if getattr(layer, "use_sliding", False):
            return f"layer {i} uses sliding-window attention"
    return None


def verify_mask(lengths: list[int], first: int, width: int, key_length: int) -> mx.array:
    """[R, 1, width, T] bool: verify position ``first + i`` of a row whose cache held
    ``lengths[r]`` tokens sees that row's keys up to ``lengths[r] + first + i``: its prefix and
    its own earlier verify positions. Rows are separate batch entries, so nothing of another
    row is ever in reach."""
    query = mx.array(lengths, dtype=mx.int32)[:, None, None, None] + first
    query = query + mx.arange(width)[None, None, :, None]
    return mx.arange(key_length)[None, None, None, :] <= query


def row_attention(
    queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array | str, scale: float,
    cpu: bool = False,
) -> mx.array:  # fmt: skip
    """Attention of each row's queries [R, h, W, D] over its own cache rows [R, kv, T, D]
    (`cpu`: on `engine.backend.cpu_kernels`); `mask` is a bool array or "causal"."""
    if cpu:
        return cpu_kernels.attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


# Attention layouts (`PackedVerifier.attention`): chosen per forward, or forced (tests).
AUTO, SPLIT, PADDED = "auto", "split", "padded"


def padded_attention_pays(rows: int, drafting: int, width: int) -> bool:
    """Whether one padded ``[rows, h, width, T]`` attention beats the split one for a verify
    where `drafting` of `rows` rows draft (the widest verifying `width` positions).

    The cost model, fitted to `bench/packed_attention.py` with the CPU kernels the engine runs
    (2-core CPU; 8 and 32 rows, 1-32 drafting, depths 1, 3 and 7, contexts 150 and 600: it
    picked the faster layout, or one within 10%, in 58 of 60 cases; the fit before, made on
    MLX's stock attention, missed in 13): in units of reading one row's cache once, the
    padded layout adds about 0.1 x (width - 1) per row for its query rows, and the split one
    adds 1 + 0.65 x (width - 1) per drafting row (a second pass over that row's cache, its
    gather, and its query rows). A lone probe in a large batch stays split; a batch where a
    few rows draft shallowly pads."""
    if drafting == 0:
        return False
    extra = width - 1
    return rows * 0.1 * extra <= drafting * (1.0 + 0.65 * extra)


class _Indices:
    """The layout's index arrays and masks, built once per forward and shared by every layer.

    Split attention runs in two groups: every row's anchor in one [B, h, 1, T] SDPA over the
    cache as it lies (exactly the plain step's attention), and the drafted positions of the
    drafting rows in one [S, h, widest - 1, T] SDPA over just those rows' cache (a slice or a
    small gather). Padded attention runs every row's positions, padded to the widest, in one
    [B, h, widest, T] SDPA (see `padded_attention_pays`)."""

    def __init__(
        self, layout: PackedLayout, segments: tuple[PrefillSegment, ...] = (),
        attention: str = AUTO,
    ) -> None:  # fmt: skip
        self.layout = layout
        B = layout.rows
        positions = layout.positions()
        # Prefill segments follow the rows' positions: [start, end) in the packed sequence.
        self.segments: list[tuple[int, int]] = []
        for segment in segments:
            start = len(positions)
            positions += range(segment.offset, segment.offset + len(segment.tokens))
            self.segments.append((start, len(positions)))
        self.positions = mx.array(positions, dtype=mx.int32)
        self.key_length = max(n + w for n, w in zip(layout.lengths, layout.widths))
        all_rows = list(range(B))
        self.write = mx.array(layout.padded_index(all_rows, 0, layout.max_width), dtype=mx.int32)
        drafting = layout.drafting_rows
        self.draft_width = layout.max_width - 1
        self.drafting: slice | mx.array | None = None
        # Padded attention: its [B * widest] outputs -> packed order, and its mask.
        self.unpad: mx.array | None = None
        padded = attention == PADDED or (
            attention == AUTO and padded_attention_pays(B, len(drafting), layout.max_width)
        )
        if drafting and padded:
            W = layout.max_width
            self.padded_mask = verify_mask(list(layout.lengths), 0, W, self.key_length)
            self.unpad = mx.array(
                [b * W + i for b, w in enumerate(layout.widths) for i in range(w)], dtype=mx.int32
            )
            return
        self.anchors = mx.array(layout.padded_index(all_rows, 0, 1), dtype=mx.int32)
        self.anchor_mask = verify_mask(list(layout.lengths), 0, 1, self.key_length)
        pack = {layout.starts[b]: b for b in all_rows}  # anchor outputs come first
        if drafting:
            Wd = self.draft_width
            self.drafts = mx.array(layout.padded_index(drafting, 1, Wd), dtype=mx.int32)
            lengths = [layout.lengths[b] for b in drafting]
            self.draft_mask = verify_mask(lengths, 1, Wd, self.key_length)
            contiguous = drafting == list(range(drafting[0], drafting[-1] + 1))
            self.drafting = (
                slice(drafting[0], drafting[-1] + 1)
                if contiguous
                else mx.array(drafting, dtype=mx.int32)
            )
            for s, b in enumerate(drafting):
                for i in range(1, layout.widths[b]):
                    pack[layout.starts[b] + i] = B + s * Wd + (i - 1)
        # Packed position -> row of [anchor outputs; drafted outputs].
        self.pack = mx.array([pack[j] for j in range(layout.total)], dtype=mx.int32)


def qkv_heads(attn: nn.Module, x: mx.array, B: int, L: int) -> tuple[mx.array, mx.array, mx.array]:
    """A llama/qwen attention's queries, keys and values of x (B x L positions) as
    [B, heads, L, D], per-head normed where the model has q/k norms (qwen3), before RoPE.
    Shared by the packed forward (x [1, N, H] read as N rows of one position each) and the
    CPU-kernel layers (`engine.backend.cpu_layers`, x [B, L, H])."""
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1)
    keys = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1)
    values = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3: per-head norms before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    return queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)


def _heads(x: mx.array, index: mx.array, rows: int) -> mx.array:
    """Packed heads [N, h, 1, D] -> [rows, h, W, D] gathered by a flat packed index."""
    gathered = x[index]  # [rows * W, h, 1, D]
    return gathered.reshape(rows, -1, x.shape[1], x.shape[3]).transpose(0, 2, 1, 3)


def _attention(
    attn: nn.Module, x: mx.array, cache: RaggedKVCache, idx: _Indices, cpu: bool,
    segment_caches: list[RaggedKVCache] = (),
) -> mx.array:  # fmt: skip
    """The layer's attention on packed x [1, N, H], reading and writing the ragged cache (and
    each prefill segment's own cache)."""
    layout = idx.layout
    # Every packed token is its own "batch" of length 1 at its own position.
    queries, keys, values = qkv_heads(attn, x, x.shape[1], 1)
    queries = attn.rope(queries, offset=idx.positions)
    keys = attn.rope(keys, offset=idx.positions)
    # Each row's positions go to its own cache slot at its own offset (padding lands past
    # the row's new length, in free space, and is never attended).
    B = layout.rows
    cache.write(_heads(keys, idx.write, B), _heads(values, idx.write, B), list(layout.widths))
    cached_keys, cached_values = cache.fetch()
    if idx.unpad is not None:  # padded: every row's positions in one attention
        W = layout.max_width
        out = row_attention(
            _heads(queries, idx.write, B), cached_keys, cached_values, idx.padded_mask,
            attn.scale, cpu,
        )  # fmt: skip
        out = out.transpose(0, 2, 1, 3).reshape(B * W, -1)[idx.unpad]
        return _with_segments(attn, out, queries, keys, values, idx, segment_caches, cpu)
    outputs = [
        row_attention(
            _heads(queries, idx.anchors, B), cached_keys, cached_values, idx.anchor_mask,
            attn.scale, cpu,
        ).reshape(B, -1)
    ]  # fmt: skip
    if idx.drafting is not None:
        rows = idx.drafts.shape[0] // idx.draft_width
        drafted = row_attention(
            _heads(queries, idx.drafts, rows), cached_keys[idx.drafting],
            cached_values[idx.drafting], idx.draft_mask, attn.scale, cpu,
        )  # fmt: skip
        outputs.append(drafted.transpose(0, 2, 1, 3).reshape(rows * idx.draft_width, -1))
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
    return _with_segments(attn, out[idx.pack], queries, keys, values, idx, segment_caches, cpu)


def _skip_attention(
    layer: nn.Module, cache: RaggedKVCache, idx: _Indices, segment_caches: list[RaggedKVCache]
) -> None:
    """A layer another rank computes (pipeline parallel): empty writes that keep this rank's
    caches as long as the owner's (`engine.distributed.pipeline.ForeignLayer`)."""
    layout = idx.layout
    cache.write(*[layer.empty_heads(layout.rows, layout.max_width)] * 2, list(layout.widths))
    for (start, end), segment_cache in zip(idx.segments, segment_caches):
        empty = layer.empty_heads(1, end - start)
        segment_cache.update_and_fetch(empty, empty)


def _with_segments(
    attn: nn.Module, out: mx.array, queries: mx.array, keys: mx.array, values: mx.array,
    idx: _Indices, segment_caches: list[RaggedKVCache], cpu: bool,
) -> mx.array:  # fmt: skip
    """The rows' attention outputs (packed order), then each prefill segment's, projected."""
    if idx.segments:
        out = mx.concatenate([out] + [
            _segment_attention(attn, queries, keys, values, span, segment_cache, cpu)
            for span, segment_cache in zip(idx.segments, segment_caches)
        ])  # fmt: skip
    return attn.o_proj(out[None])


def _segment_attention(
    attn: nn.Module, queries: mx.array, keys: mx.array, values: mx.array,
    span: tuple[int, int], cache: RaggedKVCache, cpu: bool,
) -> mx.array:  # fmt: skip
    """A prefill segment's attention: its packed positions [start, end) of the roped heads
    [N, h, 1, D] appended to its own one-row cache, causal over it. Returns [L, h * D]."""
    start, end = span

    def one_row(x: mx.array) -> mx.array:  # [L, h, 1, D] -> [1, h, L, D]
        return x[start:end].transpose(2, 1, 0, 3)

    cached_keys, cached_values = cache.update_and_fetch(one_row(keys), one_row(values))
    out = row_attention(one_row(queries), cached_keys, cached_values, "causal", attn.scale, cpu)
    return out.transpose(0, 2, 1, 3).reshape(end - start, -1)


class PackedVerifier:
    """Packed verify forward of a supported target (see the module docstring)."""

    def __init__(self, target: Any, attention: str = AUTO) -> None:
        reason = packed_unsupported_reason(target.model, target._inner)
        if reason is not None:
            raise ValueError(f"packed verify unsupported: {reason}")
        if attention not in (AUTO, SPLIT, PADDED):
            raise ValueError(f"attention layout {attention!r}: one of auto, split, padded")
        self.target = target
        self._inner = target._inner
        self.attention = attention  # auto: per forward (`padded_attention_pays`)

    def __call__(
        self, tokens: mx.array, layout: PackedLayout, cache: list[RaggedKVCache],
        segments: tuple[PrefillSegment, ...] = (),
    ) -> tuple[mx.array, mx.array | None]:  # fmt: skip
        """Forward packed `tokens` [N] laid out by `layout`; every row's K/V are appended to
        its cache row. Returns logits [N, V] and tapped features [N, K*d] (or None).

        With prefill `segments`, `tokens` is the rows' N positions followed by every
        segment's tokens (M in all); each segment's K/V go to its own cache. Logits are then
        [N + S', V]: the rows' positions, then each segment's last position only (what samples
        a first token), or all its positions where it is `full`; features cover all N + M
        positions, segments after the rows."""
        if list(cache[0].lengths) != list(layout.lengths):
            raise ValueError("layout lengths do not match the cache")
        if any(len(s.cache) != len(cache) or s.cache[0].batch_size != 1 for s in segments):
            raise ValueError("a prefill segment needs one one-row cache per layer")
        if tokens.shape[0] != layout.total + sum(len(s.tokens) for s in segments):
            raise ValueError("tokens must be the layout's positions, then the segments' tokens")
        idx = _Indices(layout, tuple(segments), self.attention)
        cpu = self.target.cpu_kernels  # its MLPs already run on them
        taps = set(self.target.layer_ids)
        tapped: list[mx.array] = []
        h = self._inner.embed_tokens(tokens[None])  # [1, N, H]
        for i, (layer, layer_cache) in enumerate(zip(self._inner.layers, cache)):
            segment_caches = [s.cache[i] for s in segments]
            if getattr(layer, "foreign", False):
                _skip_attention(layer, layer_cache, idx, segment_caches)
            else:
                h = h + _attention(
                    layer.self_attn, layer.input_layernorm(h), layer_cache, idx, cpu,
                    segment_caches,
                )  # fmt: skip
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            share = getattr(layer, "pipeline_share", None)
            if share is not None:  # pipeline parallel: the owner's output, on every rank
                h = share(h)
            if i in taps:
                tapped.append(h[0])
        if idx.segments:  # the head runs on the rows' positions and each segment's last one
            read = list(range(layout.total))
            for (start, end), segment in zip(idx.segments, segments):
                read += range(start, end) if segment.full else [end - 1]
            h = h[:, mx.array(read, dtype=mx.int32)]
        logits = self.target.unembed(self._inner.norm(h))[0]
        features = None
        if tapped:  # recorded in layer order; the adapter's features follow its tap order
            by_layer = dict(zip(sorted(taps), tapped))
            ordered = [by_layer[i] for i in self.target.layer_ids]
            features = ordered[0] if len(ordered) == 1 else mx.concatenate(ordered, axis=-1)
        return logits, features


def make_packed_verifier(target: Any) -> PackedVerifier | None:
    """A packed verifier for `target`, or None (logged) when it must use the padded forward."""
    reason = packed_unsupported_reason(target.model, target._inner)
    if reason is not None:
        log.info("packed verify off, using the padded forward: %s", reason)
        return None
    return PackedVerifier(target)
