"""The frozen target's tapped features of a training corpus, computed once and kept on disk.

Training reads every sequence's features once an epoch, and the target never changes, so
they are computed once. On a CPU that is the longest part of a fit (SmolLM2: ~3.4 ms a token
one sequence at a time, an hour for a million tokens, before the target ran on the CPU
kernels and the top-k below took its block-wise path: 1.74x faster since), so this module

- batches sequences of similar length into one forward (right padding does not change the
  features of real positions under a causal mask; ~20% faster on SmolLM2 at 8 rows);
- writes them to one float32 file that is memory-mapped back, so a fit stopped by hand, or
  the next fit on the same corpus, reads them instead of computing them again;
- resumes: batches are written in a fixed order and a progress file counts those done.

A store is keyed by the target's tapped layers and the exact token sequences, so a grown
corpus or another drafter layout gets a store of its own.

A `FeatureSidecar` holds sequences whose features were made elsewhere: data generation with
the engine's `keep_features` keeps each record's features and top-k as it is generated (the
same forwards that generated it), and `FeatureStore.build` copies those in instead of
running the target over them again.

With `top_k`, the same forward also keeps the target's `top_k` next-token log-probabilities per
position (int32 ids + float16 log-probs, 6 bytes a candidate): distillation and candidate-set
losses train on them, and the LM head they cost is ~20% of the forward, not a second pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.step.logprobs import log_normaliser, top_k_ids
from engine.step.target import TargetAdapter

log = logging.getLogger(__name__)

DATA_FILE = "features.f32"
INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.json"
TOPK_IDS_FILE = "topk_ids.i32"
TOPK_LOGP_FILE = "topk_logp.f16"


def store_key(tokens: Sequence[np.ndarray], layer_ids: Sequence[int], target_name: str) -> str:
    """A short digest of what the features depend on: target, taps and every token."""
    digest = hashlib.sha1(f"{target_name}|{list(layer_ids)}".encode())
    for seq in tokens:
        digest.update(np.asarray(seq, dtype=np.int32).tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def length_batches(lengths: Sequence[int], batch_tokens: int, max_rows: int) -> list[list[int]]:
    """Sequence indices grouped by similar length: each group's padded size (rows x longest)
    stays within `batch_tokens` (a longer sequence goes alone) and `max_rows`."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:  # ascending, so the newest member is the group's longest
        if current and ((len(current) + 1) * lengths[i] > batch_tokens or len(current) >= max_rows):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


class FeatureSidecar:
    """Features [S, F] and top-k next-token log-probabilities [S, k] of single sequences, made
    outside a store's own pass, one `.npz` per sequence under `directory`, named by a digest of
    the target, its taps, k and the sequence's tokens (so another layout never reads them)."""

    def __init__(self, directory: Path, target: str | Path, layer_ids: Sequence[int],
                 top_k: int) -> None:  # fmt: skip
        self.directory = Path(directory)
        self.target_name = Path(str(target)).name  # a registry name, or a model's folder
        self.layer_ids = list(layer_ids)
        self.top_k = top_k

    def path_of(self, tokens: np.ndarray) -> Path:
        name = store_key([tokens], self.layer_ids, f"{self.target_name}|top{self.top_k}")
        return self.directory / f"{name}.npz"

    def write(self, tokens: np.ndarray, features: np.ndarray, top_ids: np.ndarray,
              top_logp: np.ndarray) -> Path:  # fmt: skip
        """Keep one sequence's rows (written whole, then renamed: a reader never sees half)."""
        n = len(tokens)
        shape = (n, self.top_k)
        if features.shape[0] != n or top_ids.shape != shape or top_logp.shape != shape:
            raise ValueError(f"sidecar rows {features.shape}, {top_ids.shape}, "
                             f"{top_logp.shape} for {n} tokens at top {self.top_k}")  # fmt: skip
        path = self.path_of(tokens)
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial.npz")
        np.savez(partial, features=features.astype(np.float32), top_ids=top_ids.astype(np.int32),
                 top_logp=top_logp.astype(np.float16))  # fmt: skip
        partial.replace(path)
        return path

    def read(self, tokens: np.ndarray, width: int) -> tuple[np.ndarray, ...] | None:
        """(features, top ids, top log-probs) of `tokens`, or None where none is kept (or what
        is kept does not have the store's shapes)."""
        path = self.path_of(tokens)
        try:
            with np.load(path) as kept:
                rows = (kept["features"], kept["top_ids"], kept["top_logp"])
        except (OSError, ValueError, KeyError):
            return None
        n = len(tokens)
        if rows[0].shape != (n, width) or rows[1].shape != (n, self.top_k):
            log.warning("sidecar %s has rows %s for %d tokens of width %d: not used",
                        path, rows[0].shape, n, width)  # fmt: skip
            return None
        return rows


class FeatureStore:
    """Features [S, K*d] of each training sequence, in one memory-mapped float32 file."""

    def __init__(self, directory: Path, offsets: np.ndarray, width: int, top_k: int = 0) -> None:
        self.directory = directory
        self.offsets = offsets  # [n + 1]: sequence i spans rows offsets[i]..offsets[i+1]
        self.width = width
        self.top_k = top_k
        total = int(offsets[-1])
        self._data = np.memmap(directory / DATA_FILE, dtype=np.float32, mode="r",
                               shape=(total, width))  # fmt: skip
        if top_k:
            self._topk_ids = np.memmap(directory / TOPK_IDS_FILE, dtype=np.int32, mode="r",
                                       shape=(total, top_k))  # fmt: skip
            self._topk_logp = np.memmap(directory / TOPK_LOGP_FILE, dtype=np.float16, mode="r",
                                        shape=(total, top_k))  # fmt: skip

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, index: int, tokens: np.ndarray | None = None) -> mx.array:
        """Features [1, S, K*d] of sequence `index` (`tokens` is accepted so the store can
        stand where an in-memory cache is used; it is not needed)."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return mx.array(np.asarray(self._data[start:end]))[None]

    def top(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The target's top-k next-token ids [S, k] (descending) and their log-probabilities
        [S, k] (float32, normalised over the whole vocabulary): row p predicts token p + 1."""
        if not self.top_k:
            raise ValueError(f"feature store {self.directory} was built without top_k")
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return (np.asarray(self._topk_ids[start:end]),
                np.asarray(self._topk_logp[start:end], dtype=np.float32))  # fmt: skip

    @classmethod
    def build(
        cls,
        target: TargetAdapter,
        tokens: Sequence[np.ndarray],
        root: Path,
        target_name: str,
        *,
        batch_tokens: int = 2048,
        max_rows: int = 8,
        top_k: int = 0,
        sidecar: FeatureSidecar | None = None,
    ) -> FeatureStore:
        """The store of these sequences under `root`, computing what is not on disk yet
        (with `top_k`, also the target's top-k next-token log-probabilities). Sequences the
        `sidecar` holds are copied from it, not computed, and its files removed once the
        store is whole."""
        key = store_key(tokens, target.layer_ids, target_name + (f"|top{top_k}" if top_k else ""))
        directory = Path(root) / f"features-{key}"
        directory.mkdir(parents=True, exist_ok=True)
        lengths = [len(t) for t in tokens]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        width = target.hidden_size * len(target.layer_ids)
        index_path, progress_path = directory / INDEX_FILE, directory / PROGRESS_FILE
        index = {"sequences": len(tokens), "tokens": int(offsets[-1]), "width": width,
                 "layer_ids": list(target.layer_ids), "target": target_name}  # fmt: skip
        if top_k:
            index["top_k"] = top_k
        if index_path.exists() and _read_index(index_path) != index:
            # Not the store this key names (a store written by other code, or cut short while
            # its index was written): start it over rather than read features of other shapes.
            log.warning("feature store %s does not match its key; computing it again", directory)
            index_path.unlink()
        if not index_path.exists():
            progress_path.unlink(missing_ok=True)  # counts batches of a data file now replaced
            np.memmap(directory / DATA_FILE, dtype=np.float32, mode="w+",
                      shape=(int(offsets[-1]), width)).flush()  # fmt: skip
            if top_k:
                for name, dtype in ((TOPK_IDS_FILE, np.int32), (TOPK_LOGP_FILE, np.float16)):
                    np.memmap(directory / name, dtype=dtype, mode="w+",
                              shape=(int(offsets[-1]), top_k)).flush()  # fmt: skip
            index_path.write_text(json.dumps(index, indent=1) + "\n")
        if progress_path.exists():
            progress = json.loads(progress_path.read_text())
        else:  # a new store: first what the sidecar holds (their count, before any batch)
            seeded = _seed(directory, tokens, offsets, width, top_k, sidecar) if sidecar else []
            progress = {"batches": 0, "seeded": seeded}
            if seeded:
                progress_path.write_text(json.dumps(progress) + "\n")
        done, seeded = progress["batches"], progress.get("seeded", [])
        # The rest in batches of similar length (all of them when nothing was seeded: the
        # order older stores' progress counts).
        rest = sorted(set(range(len(tokens))) - set(seeded))
        groups = length_batches([lengths[i] for i in rest], batch_tokens, max_rows)
        batches = [[rest[j] for j in group] for group in groups]
        if done < len(batches):
            log.info("target features: %d of %d batches on disk in %s; computing the rest",
                     done, len(batches), directory)  # fmt: skip
            data, tops = _open_rows(directory, int(offsets[-1]), width, top_k)
            for b in range(done, len(batches)):
                if tops is None:
                    _write_batch(target, tokens, batches[b], offsets, data)
                else:
                    _write_batch(target, tokens, batches[b], offsets, data, tops)
                if (b + 1) % 16 == 0 or b + 1 == len(batches):
                    data.flush()  # the data before the count: a crash redoes, never skips
                    for array in tops or ():
                        array.flush()
                    progress = {"batches": b + 1, "seeded": seeded}
                    progress_path.write_text(json.dumps(progress) + "\n")
                if (b + 1) % 64 == 0:
                    log.info("target features: batch %d of %d", b + 1, len(batches))
            del data, tops
        if sidecar is not None:  # the store is whole: what it copied is kept here now
            for i in seeded:
                sidecar.path_of(tokens[i]).unlink(missing_ok=True)
        return cls(directory, offsets, width, top_k)


def _open_rows(
    directory: Path, total: int, width: int, top_k: int
) -> tuple[np.memmap, tuple[np.memmap, np.memmap] | None]:
    """A store's files opened for writing: features, and (with top_k) top ids and log-probs."""
    data = np.memmap(directory / DATA_FILE, dtype=np.float32, mode="r+", shape=(total, width))
    tops = None
    if top_k:
        tops = (np.memmap(directory / TOPK_IDS_FILE, dtype=np.int32, mode="r+",
                          shape=(total, top_k)),
                np.memmap(directory / TOPK_LOGP_FILE, dtype=np.float16, mode="r+",
                          shape=(total, top_k)))  # fmt: skip
    return data, tops


def _seed(directory: Path, tokens: Sequence[np.ndarray], offsets: np.ndarray, width: int,
          top_k: int, sidecar: FeatureSidecar) -> list[int]:  # fmt: skip
    """Copy every sequence the sidecar holds into a new store's files; their indices."""
    if top_k and top_k != sidecar.top_k:
        return []
    data, tops = _open_rows(directory, int(offsets[-1]), width, top_k)
    seeded = []
    for i, seq in enumerate(tokens):
        rows = sidecar.read(np.asarray(seq), width)
        if rows is None:
            continue
        start, end = int(offsets[i]), int(offsets[i + 1])
        data[start:end] = rows[0]
        if tops is not None:
            tops[0][start:end], tops[1][start:end] = rows[1], rows[2]
        seeded.append(i)
    data.flush()
    for array in tops or ():
        array.flush()
    if seeded:
        log.info("target features: %d of %d sequences from the sidecar %s", len(seeded),
                 len(tokens), sidecar.directory)  # fmt: skip
    return seeded


def _read_index(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_batch(
    target: TargetAdapter,
    tokens: Sequence[np.ndarray],
    members: list[int],
    offsets: np.ndarray,
    data: np.memmap,
    tops: tuple[np.memmap, np.memmap] | None = None,
) -> None:
    longest = max(len(tokens[i]) for i in members)
    ids = np.zeros((len(members), longest), dtype=np.int32)
    for row, i in enumerate(members):
        ids[row, : len(tokens[i])] = tokens[i]
    # Without `tops` only the features are evaluated: MLX never computes the unused logits.
    logits, features = target(mx.array(ids))
    features = np.asarray(features.astype(mx.float32))
    for row, i in enumerate(members):
        data[int(offsets[i]) : int(offsets[i + 1])] = features[row, : len(tokens[i])]
    if tops is not None:
        top_ids, top_logp = top_k_logprobs(logits, tops[0].shape[1])
        for row, i in enumerate(members):
            n = len(tokens[i])
            tops[0][int(offsets[i]) : int(offsets[i + 1])] = top_ids[row, :n]
            tops[1][int(offsets[i]) : int(offsets[i + 1])] = top_logp[row, :n]


def top_k_logprobs(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest next-token log-probabilities of logits [..., V], descending: ids (int32)
    and log-probs (float32, normalised over all V)."""
    logits = logits.astype(mx.float32)
    ids = top_k_ids(logits, k)  # engine.step.logprobs: block-wise, not vocabulary-wide
    values = mx.take_along_axis(logits, ids, axis=-1) - log_normaliser(logits)
    order = mx.argsort(-values, axis=-1)
    ids, values = (
        mx.take_along_axis(ids, order, axis=-1),
        mx.take_along_axis(values, order, axis=-1),
    )
    return np.asarray(ids.astype(mx.int32)), np.asarray(values)
