"""Hybrid targets: which layers keep a recurrent state, and the exact per-row rollback.

A verify forward runs ``1 + width`` positions through every row; row b keeps only its first
``accepted_b + 1``. Attention layers drop the rest in O(1) (lengths only). A recurrent state
after all ``1 + width`` positions cannot be undone, so each state layer's mixer (GatedDeltaNet,
LFM2's short convolution, ...) records its input and the state before the verify, and the
rollback *replays* the mixer on that input from the old state with mlx-lm's own right-padding
mask (``lengths = accepted + 1``): the recurrence and the conv window stop at each row's last
kept position. Only the mixer runs again (not the model), over the longest kept span only
(one position when every row rejected its first draft), not at all when every row kept the
whole verify, and lazily: built at the commit (the accepted counts are on the host by then),
computed with the next step's forward; the mixer's unused output is never computed.

Replay against keeping per-position states (the state after every verify position):
``bench/hybrid_rollback.py``; the numbers are in the README's target-family section.

The replay is generic over mlx-lm mixers with the ``(x, mask, cache)`` call and `ArraysCache`
protocol (`cache.lengths` picks the conv window's end, the mask stops the state update);
a family whose state layers have no such mixer fails at load, with its name.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from engine.step.kv_cache import RaggedKVCache
from engine.step.state_cache import RaggedStateCache

# Attribute names of the module a hybrid decoder layer hands its state cache to.
MIXER_NAMES = ("linear_attn", "conv", "mixer", "mamba", "ssm")


class UnsupportedHybridError(ValueError):
    """A target whose cache layout the batched engine cannot hold."""


def cache_layout(model: nn.Module, layers: list[nn.Module], family: str) -> list[int | None]:
    """Per decoder layer: None for an attention layer (ragged KV cache), else the number of
    state arrays its `ArraysCache` holds. Raises for layouts the engine cannot batch."""
    make = getattr(model, "make_cache", None)
    if make is None:
        return [None] * len(layers)
    caches = make()
    if len(caches) != len(layers):
        raise UnsupportedHybridError(
            f"model type {family!r}: its {len(caches)} layer caches do not pair with its "
            f"{len(layers)} decoder layers"
        )
    layout: list[int | None] = []
    for index, cache in enumerate(caches):
        if isinstance(cache, ArraysCache):
            layout.append(len(cache.cache))
        elif hasattr(cache, "update_and_fetch") and hasattr(cache, "offset"):
            layout.append(None)  # KVCache, RotatingKVCache: held ragged, masked by the model
        else:
            raise UnsupportedHybridError(
                f"model type {family!r}: layer {index} uses a {type(cache).__name__}, which "
                "the batched engine does not support"
            )
    if any(n is not None for n in layout) and all(n is not None for n in layout):
        raise UnsupportedHybridError(
            f"model type {family!r}: no attention layer (purely recurrent models are not "
            "supported by the batched engine)"
        )
    return layout


def make_caches(layout: list[int | None], batch: int) -> list[Any]:
    """Fresh per-layer caches of `batch` rows for a model of this layout."""
    return [RaggedKVCache(batch) if n is None else RaggedStateCache(n, batch) for n in layout]


_recording_classes: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """A subclass of a mixer class whose call records its input and the state before it
    when its cache asks (`RaggedStateCache.recording`)."""
    if cls not in _recording_classes:

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> Any:
            if isinstance(cache, RaggedStateCache) and cache.recording:
                cache.recorded = (self, x, mask, cache.snapshot())
            return cls.__call__(self, x, mask=mask, cache=cache)

        _recording_classes[cls] = type(f"Recording{cls.__name__}", (cls,), {"__call__": __call__})
    return _recording_classes[cls]


def install_recorders(layers: list[nn.Module], layout: list[int | None], family: str) -> None:
    """Give every state layer's mixer the recording subclass (weights and paths unchanged)."""
    for index, (layer, n) in enumerate(zip(layers, layout)):
        if n is None:
            continue
        mixer = next((getattr(layer, name) for name in MIXER_NAMES if hasattr(layer, name)), None)
        if not isinstance(mixer, nn.Module):
            raise UnsupportedHybridError(
                f"model type {family!r}: state layer {index} has no mixer module named one of "
                f"{', '.join(MIXER_NAMES)}"
            )
        if type(mixer) not in _recording_classes.values():
            mixer.__class__ = _recording_class(type(mixer))


def replay(cache: RaggedStateCache, keep: list[int]) -> None:
    """Roll `cache` back to the state after each row's first ``keep[b]`` positions of the
    recorded verify (lazy): the mixer again on its recorded input, from the state before,
    over the longest kept span only. When every row keeps the whole verify, the state it
    left is already right and nothing runs."""
    if cache.recorded is None:
        raise RuntimeError("no recorded verify to roll back")
    mixer, x, _mask, before = cache.recorded
    cache.recorded = None
    span = max(keep)
    if span == x.shape[1] and min(keep) == span:
        return
    scratch = ArraysCache(len(before))
    scratch.cache = list(before)
    # mlx-lm's right padding: `lengths` ends each row's conv window and (as the mask) its
    # state update. A fresh array: mlx-lm's `advance` subtracts from it in place.
    scratch.lengths = mx.array(keep, dtype=mx.int32)
    mixer(x[:, :span], mask=scratch.make_mask(span), cache=scratch)
    cache.cache = list(scratch.cache)
