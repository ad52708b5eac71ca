"""Target adapter: one ordinary mlx-lm forward that also returns tapped layer outputs.

The decoder layers named by the drafter's ``target_layer_ids`` are given a subclass of their own
class whose ``__call__`` records the output. Parameter paths, weights and the stock model code
stay exactly as they were, so `model(tokens, cache=...)` works for any mlx-lm model whose
decoder layers are a list; the adapter returns ``(logits, features)`` with
``features = concat(tapped outputs, axis=-1)`` of shape ``[B, L, K*d]``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from drafters.base import TargetShape
from engine.step.packed import SUPPORTED_MODULES
from engine.step.recurrent import (
    UnsupportedHybridError,
    cache_layout,
    install_recorders,
    make_caches,
)

# mlx-lm model modules whose `Model.__call__` is the inner model (ending in its final norm)
# followed by the LM head or the tied embedding, and nothing else, so that a prefill can run
# the head on the one position per prompt it reads. A prompt chunk's head over every position
# is what it costs most where the vocabulary is large: on Gemma 3 270M (262,144 rows, a head
# larger than the rest of the model) a 4 x 250-token prefill took 6.3-7.6 s with the head on
# every position against 3.4 s with it on the last one. Each entry is checked against the
# stock forward by `tests/test_target.py`. Not here: `gemma2` (its logits are soft-capped
# after the head).
HEAD_SEPARABLE_MODULES = SUPPORTED_MODULES | {
    "mlx_lm.models.gemma3_text",  # tied embedding (Gemma 3) or `lm_head`
    "mlx_lm.models.qwen3_moe",
    "mlx_lm.models.gpt_oss",
    "mlx_lm.models.qwen3_next",
    "mlx_lm.models.lfm2",  # always tied
    "mlx_lm.models.qwen3_5",  # the head is the wrapped `language_model`'s
    "mlx_lm.models.qwen3_5_moe",
}


class UnsupportedTargetError(ValueError):
    """The target model's structure cannot be tapped."""


class _FeatureStore:
    """Holds tapped outputs during one adapter forward (outside the module tree)."""

    def __init__(self, n_taps: int) -> None:
        self.armed = False
        self.outputs: list[mx.array | None] = [None] * n_taps

    def record(self, slot: int, value: mx.array) -> None:
        if self.armed:
            self.outputs[slot] = value


_tapped_classes: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    """A subclass of a decoder-layer class whose call also records its output."""
    if cls not in _tapped_classes:

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = cls.__call__(self, *args, **kwargs)
            self._flashbatch_store.record(self._flashbatch_slot, out)
            return out

        _tapped_classes[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _tapped_classes[cls]


def _inner_model(model: nn.Module) -> nn.Module | None:
    """The module holding `embed_tokens` and `layers` (text models and VLM wrappers)."""
    for path in ("model", "language_model.model", "model.language_model"):
        node: Any = model
        for part in path.split("."):
            node = getattr(node, part, None) if node is not None else None
        if node is not None and isinstance(getattr(node, "layers", None), list):
            return node
    return None


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "args", None), "model_type", type(model).__name__))


def _checked_inner(model: nn.Module) -> nn.Module:
    inner = _inner_model(model)
    if inner is None or not hasattr(inner, "embed_tokens"):
        raise UnsupportedTargetError(
            f"cannot tap model type {_model_type(model)!r}: no list of decoder layers with an "
            "embed_tokens table found under .model (supported: llama, qwen3, qwen2, mistral "
            "and other mlx-lm models with model.layers)"
        )
    return inner


def _embedding_size(embed: nn.Module) -> tuple[int, int]:
    """(vocabulary, hidden size) of an embedding, quantized or not (a quantized one packs
    several values into each stored word, so its weight's shape is not the matrix's)."""
    if hasattr(embed, "scales"):
        return int(embed.num_embeddings), int(embed.dims)
    rows, width = embed.weight.shape
    return int(rows), int(width)


def target_shape(model: nn.Module) -> TargetShape:
    """Hidden size, layer count and vocabulary of an (untapped) mlx-lm model."""
    inner = _checked_inner(model)
    rows, width = _embedding_size(inner.embed_tokens)
    return TargetShape(_model_type(model), width, len(inner.layers), rows)


class TargetAdapter:
    """An mlx-lm target model with tapped layers, embedding and LM head access.

    With no layer ids it is a plain model (features come back as None).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        self.model = model
        self.model_type = _model_type(model)
        inner = _checked_inner(model)
        self._inner = inner
        self.layers: list[nn.Module] = inner.layers
        bad = [i for i in layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise UnsupportedTargetError(
                f"cannot tap layers {bad}: model type {self.model_type!r} has "
                f"{len(self.layers)} decoder layers"
            )
        # Per layer: None (attention: a ragged KV cache) or how many state arrays a recurrent
        # layer keeps (`engine.step.recurrent`); an unsupported layout fails here, named.
        try:
            self.cache_layout = cache_layout(model, self.layers, self.model_type)
        except UnsupportedHybridError as e:
            raise UnsupportedTargetError(str(e)) from None
        if self.hybrid:
            try:
                install_recorders(self.layers, self.cache_layout, self.model_type)
            except UnsupportedHybridError as e:
                raise UnsupportedTargetError(str(e)) from None
        self.layer_ids = list(layer_ids)
        self._store = _FeatureStore(len(layer_ids))
        for slot, index in enumerate(layer_ids):
            layer = self.layers[index]
            if getattr(layer, "_flashbatch_store", None) is not None:
                raise UnsupportedTargetError(f"layer {index} is already tapped by another adapter")
            layer.__class__ = _tapped_class(type(layer))
            layer._flashbatch_store = self._store
            layer._flashbatch_slot = slot

    # ----------------------------------------------------------------- facts
    @property
    def hybrid(self) -> bool:
        """Does any layer keep a recurrent state (rolled back by replay, verified padded)?"""
        return any(n is not None for n in self.cache_layout)

    def new_cache(self, batch: int = 0) -> list[Any]:
        """Empty per-layer batch caches of `batch` rows (ragged KV or recurrent state)."""
        return make_caches(self.cache_layout, batch)

    def _head(self) -> nn.Module | None:
        """The untied LM head, wherever the family keeps it (VLM-style wrappers nest it)."""
        for node in (self.model, getattr(self.model, "language_model", None)):
            head = getattr(node, "lm_head", None) if node is not None else None
            if head is not None:
                return head
        return None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return _embedding_size(self._inner.embed_tokens)[1]

    @property
    def vocab_size(self) -> int:
        return _embedding_size(self._inner.embed_tokens)[0]

    @property
    def shape(self) -> TargetShape:
        return target_shape(self.model)

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype (a quantized embedding's scales carry it)."""
        embed = self._inner.embed_tokens
        return (embed.scales if hasattr(embed, "scales") else embed.weight).dtype

    # ----------------------------------------------------------------- compute
    @property
    def head_separable(self) -> bool:
        """Are this model's logits just `unembed` of its inner model's output (the final
        norm's output, then the LM head or the tied embedding: `HEAD_SEPARABLE_MODULES`)?
        Then a prefill can run the head on the few positions it reads."""
        return type(self.model).__module__ in HEAD_SEPARABLE_MODULES

    def __call__(
        self, tokens: mx.array, cache: list[Any] | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Forward `tokens` [B, L]; return logits [B, L, V] and features [B, L, K*d]."""
        return self._tapped(self.model, tokens, cache)

    def hidden_states(
        self, tokens: mx.array, cache: list[Any] | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """Forward `tokens` [B, L] without the LM head (only where `head_separable`): the
        final normed hidden states [B, L, d], whose logits are `unembed(...)`, and features.
        A prompt chunk reads one position's logits; the head over all of them would be
        10-20% of the chunk's compute (a 49k-row head on SmolLM2)."""
        if not self.head_separable:
            raise UnsupportedTargetError(f"model type {self.model_type!r}: head not separable")
        return self._tapped(self._inner, tokens, cache)

    def _tapped(
        self, module: nn.Module, tokens: mx.array, cache: list[Any] | None
    ) -> tuple[mx.array, mx.array | None]:
        """`module(tokens, cache=cache)` with the tapped layers' outputs recorded."""
        if not self.layer_ids:
            return module(tokens, cache=cache), None
        store = self._store
        store.armed = True
        try:
            out = module(tokens, cache=cache)
        finally:
            store.armed = False
        outputs = store.outputs
        store.outputs = [None] * len(outputs)
        if any(o is None for o in outputs):
            raise UnsupportedTargetError(
                f"model type {self.model_type!r} did not call its tapped layers in the forward"
            )
        if not all(isinstance(o, mx.array) for o in outputs):
            raise UnsupportedTargetError(
                f"model type {self.model_type!r}: decoder layers return "
                f"{type(outputs[0]).__name__}, not an array of hidden states"
            )
        features = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=-1)
        return out, features

    def embed(self, ids: mx.array) -> mx.array:
        """Raw token embeddings (no model-specific scaling)."""
        return self._inner.embed_tokens(ids)

    def unembed(self, hidden: mx.array) -> mx.array:
        """The target's LM head applied to already-normed hidden states (tied or not)."""
        head = self._head()
        if head is not None:
            return head(hidden)
        return self._inner.embed_tokens.as_linear(hidden)

    def head_rows(self, token_ids: mx.array) -> mx.array:
        """The LM head's rows [K, d] for `token_ids` (tied or not, dequantized if quantized):
        `hidden @ head_rows(ids).T` is `unembed(hidden)[..., ids]`."""
        head = self._head()
        if head is None:
            head = self._inner.embed_tokens
        if getattr(head, "bias", None) is not None:
            raise UnsupportedTargetError("an LM head with a bias cannot be restricted to rows")
        if hasattr(head, "scales"):  # QuantizedLinear / QuantizedEmbedding
            biases = getattr(head, "biases", None)
            return mx.dequantize(
                head.weight[token_ids], head.scales[token_ids],
                None if biases is None else biases[token_ids],
                group_size=head.group_size, bits=head.bits, mode=getattr(head, "mode", "affine"),
            )  # fmt: skip
        return head.weight[token_ids]

    def use_cpu_kernels(self) -> str | None:
        """Run this model's attention and SwiGLU on the CPU kernels (`engine.backend.cpu_layers`).
        Returns why not (None when they are on): only the llama, qwen2 and qwen3 families."""
        from engine.backend import cpu_layers

        if type(self.model).__module__ not in SUPPORTED_MODULES:
            return f"model module {type(self.model).__module__!r} is not llama, qwen2 or qwen3"
        reason = cpu_layers.unsupported_reason(self.layers)
        if reason is None:
            cpu_layers.install(self.layers)
            self.cpu_kernels = True
        return reason

    cpu_kernels = False  # set by `use_cpu_kernels`

    def packed_verifier(self) -> Any:
        """The packed verify forward of this target (`engine.step.packed`), built once; None
        (with the reason logged) for models it does not cover: they verify padded."""
        if not hasattr(self, "_packed"):
            from engine.step.packed import make_packed_verifier

            # A recurrence runs per row: hybrid rows verify padded (`engine.step.recurrent`).
            self._packed = None if self.hybrid else make_packed_verifier(self)
        return self._packed

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)
