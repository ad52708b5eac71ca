"""The content-keyed cache of converted models.

A GGUF file is converted once into `<cache>/models/gguf-<sha256 prefix>-v<converter>/`, keyed by
the SHA-256 of its bytes, so a renamed or copied file reuses its entry and a changed file gets a
new one. An entry is built in a temporary directory beside it and renamed into place; the last
file written before the rename is a manifest (`flashbatch-entry.json`) with every file's size,
modification time and SHA-256. An entry without a manifest (an interrupted conversion) or with a
file that no longer matches it (truncated, rewritten) is removed and rebuilt, never loaded.
Files are re-hashed only when their size or modification time differ from the manifest's, so a
valid entry opens without reading its weights twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CONVERTER_VERSION = 3  # bump when the conversion's output changes: old entries are then unused
MANIFEST = "flashbatch-entry.json"
HASH_MEMO = "gguf-hashes.json"


def cache_root() -> Path:
    """`$FLASHBATCH_CACHE_DIR`, else `$XDG_CACHE_HOME/flashbatch`, else `~/.cache/flashbatch`."""
    explicit = os.environ.get("FLASHBATCH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flashbatch"


def models_dir() -> Path:
    return cache_root() / "models"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def source_sha256(path: Path) -> str:
    """The SHA-256 of a source file, memoised by (absolute path, size, mtime) so a large GGUF
    is read once, not at every start (the same rule a build tool uses for stale files)."""
    path = path.resolve()
    stat = path.stat()
    memo_file = models_dir() / HASH_MEMO
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    seen = memo.get(str(path))
    if seen and seen.get("size") == stat.st_size and seen.get("mtime_ns") == stat.st_mtime_ns:
        return seen["sha256"]
    sha = file_sha256(path)
    memo[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
    try:
        _write_atomically(memo_file, json.dumps(memo, indent=1))
    except OSError as exc:  # a read-only cache (an image's) still serves its entries
        log.info("not memoising the hash of %s: %s", path, exc)
    return sha


def entry_dir(sha256: str) -> Path:
    return models_dir() / f"gguf-{sha256[:24]}-v{CONVERTER_VERSION}"


def _manifest(directory: Path, source_sha256: str) -> dict:
    files = {}
    for item in sorted(directory.iterdir()):
        if item.is_file() and item.name != MANIFEST:
            stat = item.stat()
            files[item.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                "sha256": file_sha256(item)}  # fmt: skip
    return {"source_sha256": source_sha256, "converter": CONVERTER_VERSION, "files": files,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip


def entry_problem(directory: Path, source_sha256: str) -> str | None:
    """Why a cache entry cannot be used, or None when it is complete and intact."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (an interrupted conversion)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("source_sha256") != source_sha256:
        return "manifest of another source"
    if manifest.get("converter") != CONVERTER_VERSION:
        return "written by another converter version"
    files = manifest.get("files") or {}
    if "config.json" not in files:
        return "manifest lists no config.json"
    for name, expected in files.items():
        item = directory / name
        try:
            stat = item.stat()
        except FileNotFoundError:
            return f"{name} is missing"
        if stat.st_size != expected["size"]:
            return f"{name} has {stat.st_size} bytes, the manifest says {expected['size']}"
        if stat.st_mtime_ns != expected["mtime_ns"] and file_sha256(item) != expected["sha256"]:
            return f"{name} was modified (SHA-256 differs from the manifest)"
    return None


def cached_entry(source_sha256: str) -> Path | None:
    """The intact entry for a source hash, if the cache holds one."""
    directory = entry_dir(source_sha256)
    if directory.is_dir() and entry_problem(directory, source_sha256) is None:
        return directory
    return None


def build_entry(source_sha256: str, convert: Callable[[Path], object]) -> Path:
    """The entry for a source: the cached one if intact, else `convert(tmp_dir)` written into a
    fresh temporary directory, sealed with its manifest and renamed into place."""
    directory = entry_dir(source_sha256)
    if directory.is_dir():
        problem = entry_problem(directory, source_sha256)
        if problem is None:
            return directory
        log.warning("cache entry %s is unusable (%s): rebuilding it", directory, problem)
        _remove(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache (an image's) from its users
    try:
        convert(tmp)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp, source_sha256), indent=1) + "\n")
        try:
            os.rename(tmp, directory)
        except OSError:
            # Another process finished the same entry first: use it if it is intact.
            if cached_entry(source_sha256) is None:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for old in directory.parent.glob(f"gguf-{source_sha256[:24]}-v*"):
        if old != directory and old.is_dir():  # another converter version's copy: unused now
            _remove(old)
    return directory


def _remove(directory: Path) -> None:
    """Move aside, then delete: a reader never sees a half-deleted entry under the real name."""
    doomed = directory.with_name(f".{directory.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)
