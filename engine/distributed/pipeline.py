"""Pipeline parallel: the target's layers split into contiguous blocks, one block per rank.

Rank r computes only its block; every other layer is a `ForeignLayer` on it, which holds no
weights and writes an empty (zero-head) entry to its cache, so every rank's caches keep the
same lengths and every cache operation of the runner stays valid everywhere. After each
block's last layer, and after every layer the drafter taps, the owner's hidden state reaches
every rank in one `all_sum` (the others add zeros): the next block's owner reads its input from
it, and rank 0 has the tapped features and the final hidden state for its head. Any head count
works. Used for the families the engine's packed forward covers (llama, qwen2, qwen3).

Layers are cut in rank order (rank 0 the first block) as evenly as the count allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.distributed.group import Group, ShardingError
from engine.step.packed import SUPPORTED_MODULES


def blocks(num_layers: int, ranks: int) -> list[range]:
    """Each rank's layers: contiguous, in rank order, the first ranks one more where uneven."""
    if num_layers < ranks:
        raise ShardingError(f"{num_layers} layers cannot be split over {ranks} ranks")
    base, extra = divmod(num_layers, ranks)
    out, start = [], 0
    for rank in range(ranks):
        end = start + base + (1 if rank < extra else 0)
        out.append(range(start, end))
        start = end
    return out


class _Stage:
    """This rank's part in the pipeline: who owns each layer, where hidden states are shared."""

    def __init__(self, group: Group, owners: list[int], shared_after: set[int]) -> None:
        self.group = group
        self.owners = owners
        self.shared_after = shared_after

    def share(self, index: int, h: mx.array) -> mx.array:
        """After layer `index`: its owner's output on every rank (in-graph, lazily)."""
        mine = h if self.owners[index] == self.group.rank else h * 0
        return self.group.chained_sum(mine)


class ForeignLayer(nn.Module):
    """A layer another rank computes: no weights; keeps its cache's lengths in step."""

    foreign = True
    use_sliding = False  # mlx-lm's llama reads it to pick the mask

    def __init__(self, index: int, kv_heads_dim: int, stage: _Stage) -> None:
        super().__init__()
        self._index = index
        self._head_dim = kv_heads_dim
        self._stage = stage

    def empty_heads(self, batch: int, length: int) -> mx.array:
        """Zero-head keys/values [B, 0, L, D]: a cache write that stores nothing."""
        return mx.zeros((batch, 0, length, self._head_dim), dtype=mx.float32)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if cache is not None:
            empty = self.empty_heads(x.shape[0], x.shape[1])
            cache.update_and_fetch(empty, empty)
        return self.pipeline_share(x)

    def pipeline_share(self, h: mx.array) -> mx.array:
        stage = self._stage
        return stage.share(self._index, h) if self._index in stage.shared_after else h


_shared_classes: dict[type, type] = {}


def _sharing_class(cls: type) -> type:
    """A subclass of an owned layer's class whose call also shares its output (see module)."""
    if cls not in _shared_classes:

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.pipeline_share(cls.__call__(self, *args, **kwargs))

        def pipeline_share(self, h: mx.array) -> mx.array:
            return self._pipeline_stage.share(self._pipeline_index, h)

        methods = {"__call__": __call__, "pipeline_share": pipeline_share}
        _shared_classes[cls] = type(f"Shared{cls.__name__}", (cls,), methods)
    return _shared_classes[cls]


def shard_pipeline(model: nn.Module, group: Group, tapped: Sequence[int] = ()) -> None:
    """Keep this rank's block of `model`'s layers; the rest become `ForeignLayer`s. `tapped`:
    the layers the drafter reads (their outputs are shared too)."""
    if type(model).__module__ not in SUPPORTED_MODULES:
        raise ShardingError(
            f"pipeline parallel covers llama, qwen2 and qwen3 (the packed forward's families), "
            f"not {type(model).__module__!r}"
        )
    inner = model.model
    layers = inner.layers
    cut = blocks(len(layers), group.size)
    owners = [rank for rank, block in enumerate(cut) for _ in block]
    shared_after = {block[-1] for block in cut}  # every block end, the last one included
    shared_after |= set(tapped)
    stage = _Stage(group, owners, shared_after)
    args = model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    for index, layer in enumerate(layers):
        if owners[index] != group.rank:
            layers[index] = ForeignLayer(index, head_dim, stage)
        elif index in shared_after:
            layer._pipeline_stage = stage
            layer._pipeline_index = index
            layer.__class__ = _sharing_class(type(layer))
