"""A draft vocabulary: the drafter's LM head restricted to the tokens it is likely to propose.

The drafter borrows the target's LM head. On SmolLM2 that head has 49,152 rows, and on a CPU it
costs more than the drafter's own layers: a depth-7 proposal for one row took 49 ms with the
full head and 26 ms over 16,384 rows, next to a 120 ms plain target step (README). Proposals
only need to be right where the target agrees, and the target's outputs concentrate on a few
thousand tokens. So, as EAGLE-3 does, the drafter
scores a frequency-chosen subset of the head's rows and maps the winner back to a target id.
Drafting stays lossless whatever the subset: the target verifies every proposal; a token the
subset lacks can only end a draft early.

Stored EAGLE-3-style beside the drafter's weights as ``d2t`` (int64 offsets: draft index i
is target id ``i + d2t[i]``), which z-lab's loader and ours skip as weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from engine.step.target import TargetAdapter

D2T_KEY = "d2t"


def choose_draft_vocab(
    sequences: Iterable[Iterable[int]], size: int, vocab_size: int
) -> np.ndarray:
    """The `size` token ids to keep, ascending: the most frequent ids in `sequences` (the
    target's own training data, prompts included), then the lowest remaining ids, since BPE
    ids follow merge order, which roughly follows frequency in the tokenizer's corpus."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must lie in [1, {vocab_size}]")
    counts: Counter[int] = Counter()
    for tokens in sequences:
        counts.update(int(t) for t in tokens)
    chosen = {t for t, _ in counts.most_common(size) if 0 <= t < vocab_size}
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return np.array(sorted(chosen), dtype=np.int32)


def to_d2t(token_ids: np.ndarray) -> mx.array:
    """EAGLE-3's offset form of a draft vocabulary (target id = index + offset)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    return mx.array(ids - np.arange(len(ids), dtype=np.int64))


def read_draft_vocab(path: str | Path) -> np.ndarray | None:
    """The draft vocabulary stored in a drafter directory's safetensors, or None (full head)."""
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = mx.load(str(file))
        if D2T_KEY in tensors:
            d2t = np.array(tensors[D2T_KEY], dtype=np.int64)
            return (d2t + np.arange(len(d2t))).astype(np.int32)
    return None


class DraftHead:
    """The target's LM head restricted to a draft vocabulary (a copy of those rows only)."""

    def __init__(self, target: TargetAdapter, token_ids: np.ndarray) -> None:
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.ndim != 1 or len(ids) == 0 or np.any(np.diff(ids) <= 0):
            raise ValueError("a draft vocabulary is a non-empty ascending list of token ids")
        self.size = len(ids)
        self.token_ids = mx.array(ids)
        self.weight = target.head_rows(self.token_ids)  # [K, d]
        mx.eval(self.weight)
        # Target id -> draft index (-1 outside the vocabulary), for training labels.
        lookup = np.full(target.vocab_size, -1, dtype=np.int32)
        lookup[ids] = np.arange(len(ids), dtype=np.int32)
        self.index_of = lookup

    def __call__(self, hidden: mx.array) -> mx.array:
        """Logits [..., K] over the draft vocabulary of normed hidden states [..., d]."""
        return hidden @ self.weight.T

    def to_target(self, draft_ids: mx.array) -> mx.array:
        """Target token ids of draft-vocabulary indices."""
        return self.token_ids[draft_ids]
