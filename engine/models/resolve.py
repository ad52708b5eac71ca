"""What a `--target` value names: an mlx-lm directory, a `.gguf` file, a registry name, or an
Ollama model name (`ollama:qwen3:0.6b`, or a bare `name:tag` the registry does not know)."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.models.ollama import PREFIX, looks_like_ollama_name, ollama_gguf
from engine.models.registry import REGISTRY, lookup

log = logging.getLogger(__name__)


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


def convert_cached(path: Path) -> Path:
    """The cached mlx-lm directory of a GGUF file, converting it on first use."""
    from engine.models.cache import build_entry, source_sha256
    from engine.models.gguf import convert_gguf

    sha = source_sha256(path)

    def convert(out: Path) -> None:
        log.info("converting %s to an mlx-lm directory (once; cached by content)", path)
        convert_gguf(path, out)

    return build_entry(sha, convert)


def resolve_target(spec: str | Path) -> Path:
    """The mlx-lm directory a target value stands for. An existing path wins over a name, so a
    local folder is never shadowed by the registry."""
    path = Path(spec).expanduser()
    if path.exists():
        return convert_cached(path) if is_gguf(path) else path
    if lookup(str(spec)) is not None:
        from engine.models.pull import pull

        return pull(str(spec))
    if looks_like_ollama_name(str(spec)):
        return convert_cached(ollama_gguf(str(spec)))
    raise FileNotFoundError(
        f"no model at {spec}: give an mlx-lm directory, a .gguf file, a model name "
        f"({', '.join(REGISTRY)}) or an Ollama name (ollama:NAME[:TAG])"
    )


def default_drafter(spec: str | Path) -> Path | None:
    """The drafter the registry pairs with a named target (when it exists in this checkout)."""
    if Path(spec).expanduser().exists():
        return None
    entry = lookup(str(spec))
    return entry.drafter_dir() if entry is not None else None


def display_name(spec: str | Path) -> str:
    """The model name clients see by default: the registry name, a GGUF's stem, a folder."""
    path = Path(spec).expanduser()
    if not path.exists() and lookup(str(spec)) is not None:
        return str(spec)
    if not path.exists() and looks_like_ollama_name(str(spec)):
        return str(spec).removeprefix(PREFIX)
    return path.stem if path.suffix == ".gguf" else path.name
