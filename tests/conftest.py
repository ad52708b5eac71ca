from __future__ import annotations

from pathlib import Path

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import factories
import pytest


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tokenizer_dir(model_root: Path) -> Path:
    directory = model_root / "tokenizer"
    directory.mkdir()
    factories.build_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def vocab_size(qwen3_target_dir: Path) -> int:
    import json

    return json.loads((qwen3_target_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="session")
def qwen3_target_dir(model_root: Path, tokenizer_dir: Path) -> Path:
    return factories.build_target(model_root / "qwen3", tokenizer_dir, "qwen3", seed=1)


@pytest.fixture(scope="session")
def llama_target_dir(model_root: Path, tokenizer_dir: Path) -> Path:
    return factories.build_target(model_root / "llama", tokenizer_dir, "llama", seed=2)


@pytest.fixture(scope="session")
def drafter_dir(model_root: Path, vocab_size: int) -> Path:
    config = factories.drafter_config(vocab_size)
    return factories.build_drafter(model_root / "drafter", config, seed=3)


@pytest.fixture(params=["qwen3", "llama"])
def target_dir(request, qwen3_target_dir: Path, llama_target_dir: Path) -> Path:
    return qwen3_target_dir if request.param == "qwen3" else llama_target_dir
