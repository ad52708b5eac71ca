"""z-lab checkpoint layout: round trip, config variants, and pairing errors with clear messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import factories
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from drafters.dflash import (
    DFlashConfig,
    DrafterConfigError,
    DrafterPairingError,
    default_target_layer_ids,
    load_dflash_model,
    read_config,
)
from engine import TargetAdapter, load_pair
from engine.step.target import UnsupportedTargetError


def test_round_trip_keeps_layout_weights_and_outputs(drafter_dir: Path, tmp_path: Path):
    raw = json.loads((drafter_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["block_size"] == 8
    assert raw["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [1, 4]}
    names = set(mx.load(str(drafter_dir / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert "layers.1.self_attn.k_norm.weight" in names
    assert "layers.0.mlp.down_proj.weight" in names
    assert not any(n.startswith(("model.", "embed_tokens", "lm_head")) for n in names)

    model = load_dflash_model(drafter_dir)
    from drafters.dflash import save_dflash_model

    save_dflash_model(model, tmp_path / "copy")
    again = load_dflash_model(tmp_path / "copy")
    for (name, a), (_, b) in zip(
        tree_flatten(model.parameters()), tree_flatten(again.parameters())
    ):
        assert mx.array_equal(a, b), name
    assert read_config(tmp_path / "copy").to_dict() == read_config(drafter_dir).to_dict()

    cache_a, cache_b = model.make_cache(), again.make_cache()
    feats = mx.random.normal((1, 5, 128))
    block = mx.random.normal((1, 8, 64))
    assert mx.allclose(model(block, cache_a, feats), again(block, cache_b, feats))


@pytest.mark.parametrize(
    ("layers", "n", "expected"),
    [(36, 5, [1, 9, 17, 25, 33]), (32, 5, [1, 8, 15, 22, 29]), (28, 5, [1, 7, 13, 19, 25]),
     (24, 5, [1, 6, 11, 16, 21]), (28, 3, [1, 13, 25]), (28, 1, [14])],
)  # fmt: skip
def test_default_layer_id_rule(layers, n, expected):
    assert default_target_layer_ids(layers, n) == expected


def _base_raw() -> dict:
    return factories.drafter_config(384).to_dict()


def test_config_variants_parse_alike():
    reference = DFlashConfig.from_dict(_base_raw())

    nested_rope = _base_raw()
    nested_rope.pop("rope_theta")
    nested_rope["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    assert DFlashConfig.from_dict(nested_rope).rope_theta == reference.rope_theta

    top_level = _base_raw()
    top_level.update(top_level.pop("dflash_config"))
    parsed = DFlashConfig.from_dict(top_level)
    assert (parsed.mask_token_id, parsed.target_layer_ids) == (2, [1, 4])

    block_inside = _base_raw()
    block_inside["dflash_config"]["block_size"] = block_inside.pop("block_size")
    assert DFlashConfig.from_dict(block_inside).block_size == 8

    default_ids = _base_raw()
    del default_ids["dflash_config"]["target_layer_ids"]
    default_ids["num_target_layers"] = 28
    assert DFlashConfig.from_dict(default_ids).target_layer_ids == [1, 25]


def test_config_errors_name_the_problem():
    missing = _base_raw()
    del missing["intermediate_size"]
    with pytest.raises(DrafterConfigError, match="intermediate_size"):
        DFlashConfig.from_dict(missing)
    no_ids = _base_raw()
    del no_ids["dflash_config"]["target_layer_ids"]
    no_ids["num_target_layers"] = None
    with pytest.raises(DrafterConfigError, match="target_layer_ids"):
        DFlashConfig.from_dict(no_ids)


def _edited_drafter(drafter_dir: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(drafter_dir, copy)
    raw = json.loads((copy / "config.json").read_text())
    edit(raw)
    (copy / "config.json").write_text(json.dumps(raw))
    return copy


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(hidden_size=96), "hidden_size 96 != target hidden_size 64"),
        (lambda c: c.update(vocab_size=999), "vocab_size 999 != target vocab size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]),
         r"target_layer_ids \[9\] out of range"),
        (lambda c: c["dflash_config"].update(mask_token_id=5000),
         "mask_token_id 5000 lies outside"),
        (lambda c: c.update(num_target_layers=36), "trained for a 36-layer target"),
        (lambda c: c.update(block_size=1), "block_size must be at least 2"),
    ],
)  # fmt: skip
def test_pairing_errors(qwen3_target_dir, drafter_dir, tmp_path, edit, message):
    bad = _edited_drafter(drafter_dir, tmp_path, edit)
    with pytest.raises((DrafterPairingError, DrafterConfigError), match=message):
        load_pair(qwen3_target_dir, bad)


def test_weights_that_do_not_match_the_config_fail_clearly(drafter_dir, tmp_path):
    bad = _edited_drafter(drafter_dir, tmp_path, lambda c: c.update(num_hidden_layers=3))
    with pytest.raises(DrafterConfigError, match="missing"):
        load_dflash_model(bad)


def test_not_a_dflash_checkpoint(drafter_dir, tmp_path):
    bad = _edited_drafter(
        drafter_dir, tmp_path, lambda c: c.update(architectures=["LlamaForCausalLM"])
    )
    with pytest.raises(DrafterConfigError, match="not a DFlash drafter"):
        read_config(bad)


def test_untappable_model_names_its_type():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(UnsupportedTargetError, match="Flat"):
        TargetAdapter(Flat(), [0])
