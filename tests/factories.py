"""Builders for small real models used by the tests: a byte-level BPE tokenizer trained on local
text, random-weight mlx-lm targets saved to disk, and random DFlash drafters in z-lab layout.
Everything goes through the real save/load paths."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import importlib
import inspect
import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from drafters.dflash.checkpoint import save_dflash_model
from drafters.dflash.config import DFlashConfig
from drafters.dflash.model import DFlashDraftModel
from engine.bundled.pretrain import build_bpe_tokenizer

TOKENIZER_VOCAB = 384


def build_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer that `mlx_lm.load` accepts (trained in about a second)."""
    corpus = [inspect.getsource(m) for m in (json, inspect, importlib)]
    build_bpe_tokenizer(corpus, TOKENIZER_VOCAB, directory)


def target_config(model_type: str, vocab_size: int, layers: int = 6) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # tied random models repeat one token forever
        "eos_token_id": 0,
    }


def build_target(directory: Path, tokenizer_dir: Path, model_type: str, seed: int) -> Path:
    """A random-weight float32 mlx-lm model of `model_type`, saved with the tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    config = target_config(model_type, vocab)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger embeddings make random models write varied (less repetitive) sequences.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 3.0
    mx.eval(model.parameters())
    save_model(directory, model)
    save_config(config, directory / "config.json")
    for file in tokenizer_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


def drafter_config(vocab_size: int, **overrides) -> DFlashConfig:
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab_size,
        block_size=8,
        mask_token_id=2,
        target_layer_ids=[1, 4],
        num_target_layers=6,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return DFlashConfig(**fields)


def build_drafter(directory: Path, config: DFlashConfig, seed: int) -> Path:
    mx.random.seed(seed)
    model = DFlashDraftModel(config)
    mx.eval(model.parameters())
    save_dflash_model(model, directory)
    return directory
