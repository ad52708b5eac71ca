"""Grow a trained drafter by layers or by target taps without changing what it predicts.

A new layer starts as a copy of the drafter's last layer with its two output projections
(`o_proj`, `down_proj`) at zero. Both sublayers then add nothing to the residual stream, so
the grown drafter's outputs equal the old one's exactly (block expansion, as in LLaMA Pro),
and training can use the new capacity from there without losing what the campaign has
learned. The copied q/k/v, MLP input and norms give it a trained starting point once the
zeroed projections move off zero (their gradients are non-zero from the first step).

A new tap (a target layer whose hidden states the drafter reads) works the same way: `fc`
gets zero columns for it, so the drafter predicts as before and training decides how much of
the new layer's view to use. The feature store is keyed by the taps, so the next sitting
recomputes the features it needs with the new tap.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_flatten

from drafters.dflash.config import DFlashConfig
from drafters.dflash.model import DFlashDraftModel

# what a new layer adds to the residual stream: zero, so the grown drafter predicts as before
ZEROED = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight")


def grown_config(config: DFlashConfig, layers: int) -> DFlashConfig:
    """`config` with `layers` layers; new layers take the last layer's attention type."""
    if layers <= config.num_hidden_layers:
        raise ValueError(
            f"growing needs more layers than the drafter's {config.num_hidden_layers}, got {layers}"
        )
    extra = layers - config.num_hidden_layers
    types = config.layer_types
    grown = replace(
        config,
        num_hidden_layers=layers,
        layer_types=None if types is None else list(types) + [types[-1]] * extra,
    )
    grown.check()
    return grown


def grow_layers(model: DFlashDraftModel, layers: int) -> DFlashDraftModel:
    """A new drafter with `layers` layers whose outputs equal `model`'s (see the module doc)."""
    config = grown_config(model.config, layers)
    weights = dict(tree_flatten(model.parameters()))
    prefix = f"layers.{model.config.num_hidden_layers - 1}."
    last = {name[len(prefix) :]: v for name, v in weights.items() if name.startswith(prefix)}
    for index in range(model.config.num_hidden_layers, layers):
        for part, value in last.items():
            zeroed = part.endswith(ZEROED)
            weights[f"layers.{index}.{part}"] = mx.zeros_like(value) if zeroed else value
    return _drafter_with(config, weights)


def _drafter_with(config: DFlashConfig, weights: dict[str, mx.array]) -> DFlashDraftModel:
    """A drafter of `config` holding exactly `weights` (every parameter, evaluated)."""
    grown = DFlashDraftModel(config)
    grown.load_weights(list(weights.items()), strict=True)
    mx.eval(grown.parameters())
    return grown


def grown_taps_config(config: DFlashConfig, taps: list[int]) -> DFlashConfig:
    """`config` reading the target at `taps`, which must hold every tap it reads now."""
    old = list(config.target_layer_ids)
    new = sorted(set(int(t) for t in taps))
    if not set(old) < set(new):
        raise ValueError(f"growing taps needs more taps than {old} and all of them, got {new}")
    grown = replace(config, target_layer_ids=new)
    grown.check()
    return grown


def grow_taps(model: DFlashDraftModel, taps: list[int]) -> DFlashDraftModel:
    """A new drafter reading the target at `taps` whose outputs equal `model`'s.

    `fc` maps the tapped hidden states, concatenated in layer order, to the drafter's width; the
    columns a new tap feeds start at zero, so it adds nothing until training moves them (their
    gradients are non-zero from the first step: the new tap's features are not zero)."""
    config = grown_taps_config(model.config, taps)
    hidden = model.config.hidden_size
    old_fc = model.fc.weight  # [hidden, len(old taps) * hidden]
    blocks = []
    for tap in config.target_layer_ids:
        if tap in model.config.target_layer_ids:
            i = model.config.target_layer_ids.index(tap)
            blocks.append(old_fc[:, i * hidden : (i + 1) * hidden])
        else:
            blocks.append(mx.zeros((old_fc.shape[0], hidden), dtype=old_fc.dtype))
    weights = dict(tree_flatten(model.parameters()))
    weights["fc.weight"] = mx.concatenate(blocks, axis=1)
    return _drafter_with(config, weights)
