"""Loading a target (mlx-lm format) and, optionally, a DFlash drafter paired with it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn

from drafters.dflash.checkpoint import load_drafter, read_config
from drafters.dflash.config import validate_pairing
from drafters.dflash.drafter import DFlashDrafter
from engine.backend.platform import compute_dtype
from engine.models.gguf_dtype import converted_gguf_dtype
from engine.step.stopping import eos_ids_of
from engine.step.target import TargetAdapter, target_shape


@dataclass
class ModelPair:
    """A loaded target (tapped for its drafter), the drafter if any, and the tokenizer."""

    target: TargetAdapter
    drafter: DFlashDrafter | None
    tokenizer: Any

    @property
    def eos_token_ids(self) -> set[int]:
        return eos_ids_of(self.tokenizer)


def load_target_model(
    path: str | Path, shard: Callable[[nn.Module], None] | None = None
) -> tuple[nn.Module, Any]:
    """An mlx-lm model and tokenizer, cast to the compute dtype. `path` is an mlx-lm directory,
    a `.gguf` file (converted once, cached) or a registry name such as `smollm2-135m-instruct`
    (pulled once, cached) or `bundled`. With `shard` (distributed mode) the weights load lazily
    and `shard(model)` runs before any is read, so a rank materialises only its own part."""
    import mlx.core as mx
    from mlx_lm import load

    from engine.models.resolve import resolve_target

    path = resolve_target(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no mlx-lm model at {path} (config.json missing)")
    model, tokenizer = load(str(path), lazy=shard is not None)
    if shard is not None:
        shard(model)
        mx.eval(model.parameters())
    dtype = compute_dtype()
    if dtype is None:
        dtype = converted_gguf_dtype(path)  # a GPU computes a GGUF in the file's own precision
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer


def load_pair(
    target_path: str | Path,
    drafter_path: str | Path | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> ModelPair:
    """Load a target (a directory, a `.gguf` file or a registry name) and, optionally, its
    DFlash drafter; a bad pairing fails here, clearly. No drafter is attached unless given:
    callers that want a named model's own drafter ask `engine.models.resolve.default_drafter`.
    `shard`: this rank's part of a distributed target (`engine.distributed.sharding`)."""
    model, tokenizer = load_target_model(target_path, shard)
    if drafter_path is None:
        return ModelPair(TargetAdapter(model, []), None, tokenizer)
    config = read_config(drafter_path)
    fc_width = len(config.target_layer_ids) * config.hidden_size
    validate_pairing(config, target_shape(model), fc_width)  # before tapping: the clear error
    target = TargetAdapter(model, config.target_layer_ids)
    return ModelPair(target, load_drafter(drafter_path, target), tokenizer)
