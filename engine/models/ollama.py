"""Models by their Ollama name (`ollama:qwen3:0.6b`, or a bare `qwen3:0.6b`), read from the
local Ollama store: no Ollama process, no network.

The store (`$OLLAMA_MODELS`, default `~/.ollama/models`) holds a manifest per name at
`manifests/<host>/<namespace>/<model>/<tag>` and content-addressed blobs at
`blobs/sha256-<hex>`. A name is `[host/][namespace/]model[:tag]`, as Ollama spells it: the host
defaults to `registry.ollama.ai`, the namespace to `library`, the tag to `latest`. The
manifest's layer of media type `application/vnd.ollama.image.model` is the GGUF; it is then
converted like any GGUF file (content-keyed cache). Ollama's own template layer is Go template
syntax, which transformers cannot run, so the chat template is the GGUF's own
(`tokenizer.chat_template`), as llama.cpp uses it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PREFIX = "ollama:"
DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"


class OllamaModelNotFound(FileNotFoundError):
    """The Ollama store has no such model (the message lists what it holds)."""


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    @classmethod
    def parse(cls, name: str) -> OllamaName:
        name = name.removeprefix(PREFIX)
        path, tag = name, DEFAULT_TAG
        last = name.rsplit("/", 1)[-1]
        if ":" in last:  # the tag is after the last ':' of the last part (a host may hold a port)
            path, tag = name[: len(name) - len(last)] + last.split(":", 1)[0], last.split(":", 1)[1]
        parts = path.split("/")
        if not all(parts) or not tag or len(parts) > 3:
            raise OllamaModelNotFound(f"{name!r} is not an Ollama model name "
                                      "([host/][namespace/]model[:tag])")  # fmt: skip
        host = parts[-3] if len(parts) == 3 else DEFAULT_HOST
        namespace = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
        return cls(host, namespace, parts[-1], tag)

    def manifest(self, store: Path) -> Path:
        return store / "manifests" / self.host / self.namespace / self.model / self.tag

    def short(self) -> str:
        """The name as `ollama list` shows it."""
        prefix = "" if self.host == DEFAULT_HOST else f"{self.host}/"
        if prefix or self.namespace != DEFAULT_NAMESPACE:
            prefix += f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"


def store_dir() -> Path:
    """`$OLLAMA_MODELS`, else `~/.ollama/models` (Ollama's own default)."""
    explicit = os.environ.get("OLLAMA_MODELS")
    return Path(explicit).expanduser() if explicit else Path.home() / ".ollama" / "models"


def looks_like_ollama_name(spec: str) -> bool:
    """`ollama:...`, or a bare `model:tag` (a colon in the last part, no path separators that
    would make it a file): what `resolve_target` tries in the store before giving up."""
    if spec.startswith(PREFIX):
        return True
    return ":" in spec.rsplit("/", 1)[-1] and not spec.startswith((".", "/", "~"))


def held_models(store: Path) -> list[str]:
    """Every name the store has a manifest for, in `ollama list` form."""
    root = store / "manifests"
    if not root.is_dir():
        return []
    names = []
    for manifest in root.glob("*/*/*/*"):
        if manifest.is_file():
            host, namespace, model, tag = manifest.relative_to(root).parts
            names.append(OllamaName(host, namespace, model, tag).short())
    return sorted(names)


def ollama_gguf(name: str, store: Path | None = None) -> Path:
    """The GGUF blob of an Ollama model name in the local store."""
    store = store or store_dir()
    parsed = OllamaName.parse(name)
    manifest = parsed.manifest(store)
    if not manifest.is_file():
        held = held_models(store)
        listing = ", ".join(held) if held else "nothing"
        raise OllamaModelNotFound(
            f"no Ollama model {parsed.short()!r} in {store} (no {manifest}); the store holds: "
            f"{listing}. Pull it with `ollama pull {parsed.short()}`, or set $OLLAMA_MODELS"
        )
    try:
        layers = json.loads(manifest.read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OllamaModelNotFound(f"unreadable Ollama manifest {manifest}: {exc}") from None
    digests = [layer.get("digest", "") for layer in layers
               if layer.get("mediaType") == MODEL_MEDIA_TYPE]  # fmt: skip
    if not digests:
        raise OllamaModelNotFound(f"Ollama manifest {manifest} has no model layer "
                                  f"({MODEL_MEDIA_TYPE})")  # fmt: skip
    blob = store / "blobs" / digests[0].replace(":", "-", 1)
    if not blob.is_file():
        raise OllamaModelNotFound(f"Ollama model {parsed.short()!r}: its blob {blob} is missing")
    return blob
