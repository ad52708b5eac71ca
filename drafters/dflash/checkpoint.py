"""Load and save DFlash drafters in the published z-lab layout.

A checkpoint directory holds `config.json` (see `config.py`) and one or more `*.safetensors`
files with unprefixed names (`fc.weight`, `hidden_norm.weight`, `norm.weight`, `layers.{i}...`).
There is no embedding and no LM head: the drafter borrows the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from drafters.dflash.config import DFlashConfig, DrafterConfigError, validate_pairing
from drafters.dflash.model import DFlashDraftModel
from drafters.dflash.vocab import D2T_KEY, read_draft_vocab, to_d2t

if TYPE_CHECKING:
    from drafters.dflash.drafter import DFlashDrafter
    from engine.step.target import TargetAdapter

# Tensors some third-party variants ship that this drafter does not use.
_IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "mask_embedding", "d2t", "t2d")


def read_config(path: str | Path) -> DFlashConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise DrafterConfigError(f"no config.json in drafter directory {path}")
    raw = json.loads(config_file.read_text())
    architectures = raw.get("architectures") or ["DFlashDraftModel"]
    if not any("DFlash" in a for a in architectures):
        raise DrafterConfigError(
            f"{config_file} describes {architectures}, not a DFlash drafter (DFlashDraftModel)"
        )
    return DFlashConfig.from_dict(raw)


def load_dflash_model(path: str | Path, dtype: mx.Dtype | None = None) -> DFlashDraftModel:
    """Build the drafter from `config.json` and load its safetensors strictly."""
    path = Path(path)
    config = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterConfigError(f"no *.safetensors weights in drafter directory {path}")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    weights = {k: v for k, v in weights.items() if not k.startswith(_IGNORED_PREFIXES)}
    model = DFlashDraftModel(config)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise DrafterConfigError(
            f"drafter weights in {path} do not match its config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    wrong = [
        f"{k} {tuple(weights[k].shape)} (config implies {tuple(v.shape)})"
        for k, v in expected.items()
        if weights[k].shape != v.shape
    ]
    if wrong:
        raise DrafterConfigError(f"drafter weight shapes do not match its config: {wrong[:3]}")
    model.load_weights(list(weights.items()), strict=True)
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def save_dflash_model(
    model: DFlashDraftModel,
    path: str | Path,
    dtype: mx.Dtype | None = None,
    draft_vocab: np.ndarray | None = None,
) -> None:
    """Write `config.json` and `model.safetensors` in the z-lab layout (with a draft
    vocabulary as EAGLE-3's `d2t` offsets, which z-lab's loader skips)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    weights = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    config["torch_dtype"] = str(next(iter(weights.values())).dtype).replace("mlx.core.", "")
    if draft_vocab is not None:
        weights[D2T_KEY] = to_d2t(draft_vocab)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


def load_drafter(path: str | Path, target: TargetAdapter) -> DFlashDrafter:
    """Load a drafter for an already tapped target, in the target's compute dtype."""
    from drafters.dflash.drafter import DFlashDrafter

    config = read_config(path)
    validate_pairing(config, target.shape, len(config.target_layer_ids) * config.hidden_size)
    model = load_dflash_model(path, dtype=target.dtype)
    return DFlashDrafter(model, target, draft_vocab=read_draft_vocab(path))
