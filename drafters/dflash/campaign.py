"""A DFlash training campaign whose state lives in the repository, so every sitting continues
the last one on any machine.

    python -m drafters.dflash.campaign run [--minutes N]      # one sitting (SIGTERM: save, stop)
    python -m drafters.dflash.campaign run --fresh-only       # only never-trained records
    python -m drafters.dflash.campaign eval                   # held-out tau; keep or restore
    python -m drafters.dflash.campaign measure --steps 40 ... # a lever, from scratch, no repo write
    python -m drafters.dflash.campaign features [--shard N]   # a shard's features, ahead of time
    python -m drafters.dflash.campaign heldout                # held-out loss, acc, offline tau
    python -m drafters.dflash.campaign grow --layers 3        # more layers, same predictions
    python -m drafters.dflash.campaign grow --taps 1,14,27    # read one more target layer
    python -m drafters.dflash.card                            # MODEL_CARD.md
    python -m drafters.dflash.evalset measure --log           # the eval set, loop replayed

What the repository holds (`engine/models/smollm2_drafter/`, the registry's drafter directory):

- `config.json` + `model.safetensors`: the drafter's own weights in bfloat16, z-lab layout (the
  embeddings and LM head are the target's), and `draft_vocab.safetensors` (`vocab.py`);
- `training/state.json`: optimizer steps, labels seen, the schedule position, the data cursor
  (shard, pass over it, records done in the pass, times the corpus wrapped) and the recipe;
- `training/sittings.json`: every sitting (command, steps, hours, labels a second, held-out loss)
  and every `eval` (tau per kind).

The state, the cursor and the checkpoint files are `drafters.dflash.campaign_state`'s; whether
a sitting's checkpoint replaces the committed one is `drafters.dflash.keep_gate`'s (`eval`).

No optimizer moments are kept (they would triple the checkpoint and every commit): a resume
starts AdamW afresh and re-warms the learning rate over `rewarm_steps`. Files are written under
temporary names and renamed, `state.json` last, so a crash mid-save leaves the previous state
(at worst a few records are trained again).

Data: the corpus parts in the repository (`drafters.dflash.corpus`) in the order they were
written, minus a fixed held-out slice (keys whose hash is 0 mod `VAL_MODULUS`), cut into shards of
`shard_records` records. A sitting computes target features only for the shard the cursor is on
(plus its top-k next-token log-probabilities, for the levers), in a per-machine cache under
`~/.cache/flashbatch/campaign/`, trains `passes_per_shard` passes over it (fresh anchors each
pass), moves on, and wraps to shard 0 once the corpus is used up. A corpus grown by new parts
has more shards, and they come first: the next sitting's cursor goes at once to the shard
holding the first record no sitting has trained (`State.records_reached`), trains on to the
corpus's end, then goes back to the start of the shard it left (unless that order reaches
them next anyway). Fresh records teach the drafter far more than another visit to old ones:
in paired arms on 2026-12-07 one fresh shard lowered the held-out loss by 0.056 where a
thirteenth visit to an old one raised it by 0.004 (`run --fresh-only` trains nothing else).
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import argparse
import hashlib
import json
import logging
import math
import platform
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from drafters.dflash.campaign_state import (
    CACHE_ROOT,
    DEFAULT_DRAFTER_DIR,
    DEFAULT_TARGET,
    RETUNABLE,
    SIDECAR_DIR,
    STATE_FILE,
    Recipe,
    State,
    has_state,
    learning_rate,
    load_checkpoint,
    log_entry,
    read_sittings,
    save_checkpoint,
    sidecar_dir,
)
from drafters.dflash.checkpoint import read_config
from drafters.dflash.corpus import corpus_dir, read_parts
from drafters.dflash.features import FeatureSidecar, FeatureStore
from drafters.dflash.keep_gate import run_eval
from drafters.dflash.levers import (
    greedy_chain_labels,
    lever_batch,
    lever_loss,
    sample_negatives,
)
from drafters.dflash.model import DFlashDraftModel
from drafters.dflash.train import (
    BlockBatch,
    TrainSequence,
    block_hidden_states,
    block_row_mask,
    default_gamma,
    drafter_config_for_target,
    init_drafter,
    make_blocks,
    sample_anchors,
    shared_prefix_lengths,
    use_cpu_kernels,
)
from drafters.dflash.vocab import DraftHead, choose_draft_vocab
from engine.step.target import TargetAdapter

log = logging.getLogger("campaign")

VAL_MODULUS = 128  # 1 record in 128 (by key hash) is held out: ~31 of 3,967
EVAL_KINDS = ("completion", "editing", "chat", "prose")


# =================================================================== corpus and shards
def is_held_out(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % VAL_MODULUS == 0


def corpus_split(target: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) records of the repository corpus, in the order the parts hold them."""
    records = read_parts(corpus_dir(target))
    train = [r for r in records if not is_held_out(r["key"])]
    return train, [r for r in records if is_held_out(r["key"])]


def shard_slices(count: int, shard_records: int) -> list[range]:
    """Consecutive shards of `shard_records` (the last may be shorter; a tail of under half a
    shard joins the one before, so no shard is tiny)."""
    bounds = list(range(0, count, shard_records)) + [count]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < shard_records // 2:
        bounds.pop(-2)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def shard_holding(shards: list[range], record: int) -> int:
    """The index of the shard that holds train record `record`."""
    return next(i for i, shard in enumerate(shards) if record < shard.stop)


def fresh_shard(shards: list[range], reached: int) -> int:
    """The shard a detour over new records starts at: the one holding the first new record
    (`reached`), unless most of that shard was trained already and a later shard exists (the
    corpus's old end fell early in a shard, and a new part filled it up): then the next one,
    and the few new records left behind wait for the normal order. Three more passes over
    records just trained three times teach nothing (sitting 17 spent 9 minutes learning so)."""
    index = shard_holding(shards, reached)
    shard = shards[index]
    if 2 * (reached - shard.start) > len(shard) and index + 1 < len(shards):
        return index + 1
    return index


def records_reached_before(
    state: State, sittings: list[dict[str, Any]], shards: list[range]
) -> int:
    """What a campaign from before `State.records_reached` had reached: the whole corpus of its
    last sitting once it has wrapped, else the records before the cursor's shard."""
    if state.cursor.wraps > 0 and sittings and "corpus_records" in sittings[-1]:
        return int(sittings[-1]["corpus_records"])
    return shards[min(state.cursor.shard, len(shards) - 1)].start


def to_sequences(records: list[dict[str, Any]], max_len: int) -> list[TrainSequence]:
    """Records as training sequences, each knowing the prefix it shares with the rest (where
    prompt anchors start)."""
    sequences = [
        TrainSequence(np.asarray(r["tokens"][:max_len], np.int32), int(r["prompt_tokens"]))
        for r in records
    ]
    for sequence, shared in zip(sequences, shared_prefix_lengths(sequences)):
        sequence.shared_prefix = int(shared)
    return sequences


# =================================================================== training pieces
def block_states(
    model: DFlashDraftModel, target: TargetAdapter, features: mx.array, blocks: BlockBatch
) -> mx.array:
    """Final-normed drafter states [N, B-1, d] of the block rows that carry labels."""
    dtype = model.norm.weight.dtype
    embeddings = mx.stop_gradient(target.embed(mx.array(blocks.block_ids))).astype(dtype)
    mask = mx.array(block_row_mask(features.shape[1], blocks.anchors, blocks.block_ids.shape[1]))
    anchors = mx.array(blocks.anchors, dtype=mx.int32)
    return block_hidden_states(model, features, embeddings, anchors, mask)[:, 1:]


class Trainer:
    """The drafter, its frozen target and head, and one sitting's optimizer."""

    def __init__(
        self,
        target: TargetAdapter,
        target_name: str,
        model: DFlashDraftModel,
        state: State,
        draft_vocab: np.ndarray | None,
        cache_root: Path,
    ) -> None:
        self.target, self.target_name, self.model, self.state = target, target_name, model, state
        self.recipe = state.recipe
        self.draft_vocab = draft_vocab
        self.head = DraftHead(target, draft_vocab) if draft_vocab is not None else None
        if self.head is not None:
            self.head_weight, self.index_of = self.head.weight, self.head.index_of
        else:
            self.head_weight = target.head_rows(mx.arange(target.vocab_size))
            self.index_of = None
        self.head_weight = mx.stop_gradient(self.head_weight.astype(mx.float32))
        mx.eval(self.head_weight)
        self.cache_root = cache_root
        self.gamma = self.recipe.gamma or default_gamma(self.recipe.block_size)
        if self.recipe.train_block and not 2 <= self.recipe.train_block <= self.recipe.block_size:
            raise ValueError(
                f"train_block {self.recipe.train_block} must lie in [2, {self.recipe.block_size}]"
            )
        use_cpu_kernels(target, model)
        self.optimizer = optim.AdamW(
            learning_rate=self.recipe.lr, weight_decay=self.recipe.weight_decay
        )
        self._grad = nn.value_and_grad(model, self._loss)
        # The average starts at the loaded weights: a sitting resumes from the last one's average
        # (raw weights are not kept; they would double every checkpoint commit).
        self.average = tree_map(mx.array, model.parameters()) if self.recipe.ema > 0 else None

    def first_anchor(self, sequence: TrainSequence) -> int:
        """Where a training sequence's anchors may start: its continuation, or with
        `prompt_anchors` right after the prefix it shares with its group (a chat template's
        system prompt)."""
        if self.recipe.prompt_anchors:
            return sequence.shared_prefix
        return max(sequence.prompt_tokens - 1, 0)

    def shipped(self) -> dict[str, mx.array]:
        """The weights a checkpoint holds and the held-out measure scores: the average, if any."""
        return dict(
            tree_flatten(self.average if self.average is not None else self.model.parameters())
        )

    def _loss(
        self, features: mx.array, blocks: BlockBatch, batch: Any, candidates: bool, distill: float
    ) -> tuple[mx.array, mx.array]:
        hidden = block_states(self.model, self.target, features, blocks)
        return lever_loss(hidden, self.head_weight, batch, candidates=candidates, distill=distill)

    def store(self, sequences: list[TrainSequence]) -> FeatureStore:
        return FeatureStore.build(
            self.target,
            [s.tokens for s in sequences],
            self.cache_root / "features",
            self.target_name,
            top_k=self.recipe.top_k,
            # records whose features data generation kept (`build --stages data --keep-features`)
            sidecar=FeatureSidecar(
                self.cache_root / SIDECAR_DIR,
                self.target_name,
                self.target.layer_ids,
                self.recipe.top_k,
            ),
        )

    def blocks_of(
        self,
        store: FeatureStore,
        index: int,
        sequence: TrainSequence,
        anchors: np.ndarray,
        rng: np.random.Generator | None,
        chain_labels: bool = False,
        block_size: int | None = None,
    ) -> tuple[BlockBatch, Any]:
        """Blocks of `block_size` rows (default: the model's) at `anchors` and their lever
        batch; `chain_labels`: labelled by the target's greedy chain (`greedy_chain_labels`),
        which prompt anchors need."""
        r = self.recipe
        rows = block_size or r.block_size
        blocks = make_blocks(sequence.tokens, anchors, rows, r.mask_token_id, self.gamma)
        top_ids, top_logp = store.top(index)
        if chain_labels:
            blocks = greedy_chain_labels(blocks, sequence.tokens, top_ids[:, 0])
        negatives = None
        if r.candidates and r.negatives and rng is not None:
            negatives = sample_negatives(self.head_weight.shape[0], r.negatives, rng)
        return blocks, lever_batch(blocks, top_ids, top_logp, self.index_of, negatives)

    def training_blocks(
        self, store: FeatureStore, index: int, sequence: TrainSequence, rng: np.random.Generator
    ) -> tuple[BlockBatch, Any] | None:
        """A training micro-step's blocks as the recipe draws them (fresh anchors, where they
        may start, their labels, the training block's rows); None when there is no anchor."""
        r = self.recipe
        anchors = sample_anchors(
            len(sequence.tokens), r.num_anchors, rng, self.first_anchor(sequence)
        )
        if len(anchors) == 0:
            return None
        return self.blocks_of(
            store, index, sequence, anchors, rng, r.prompt_anchors, r.train_block or None
        )

    def step(
        self, store: FeatureStore, members: list[int], sequences: list[TrainSequence], lr: float
    ) -> tuple[float, float, float]:
        """One optimizer step over `members` of the store; (loss, acc, labels)."""
        r = self.recipe
        grads_sum, losses, accs, labels = None, [], [], 0.0
        for k, index in enumerate(members):
            rng = np.random.default_rng([r.seed, self.state.step, k])
            made = self.training_blocks(store, index, sequences[index], rng)
            if made is None:
                continue
            blocks, batch = made
            (loss, acc), grads = self._grad(
                store.get(index), blocks, batch, r.candidates, r.distill
            )
            grads_sum = grads if grads_sum is None else tree_map(mx.add, grads_sum, grads)
            mx.eval(grads_sum, loss, acc)
            losses.append(loss.item())
            accs.append(acc.item())
            labels += float((batch.weights > 0).sum())
        if grads_sum is None:
            return math.nan, math.nan, 0.0
        grads = tree_map(lambda g: g / len(losses), grads_sum)
        grads, _ = optim.clip_grad_norm(grads, r.grad_clip)
        self.optimizer.learning_rate = lr
        self.optimizer.update(self.model, grads)
        if self.average is not None:
            decay = self.recipe.ema
            self.average = tree_map(
                lambda a, w: decay * a + (1.0 - decay) * w, self.average, self.model.parameters()
            )
        mx.eval(self.model.parameters(), self.optimizer.state)
        if self.average is not None:
            mx.eval(self.average)
        return float(np.mean(losses)), float(np.mean(accs)), labels

    def _measure(
        self, store: FeatureStore, index: int, sequence: TrainSequence, anchors: np.ndarray
    ) -> tuple[tuple[float, float], np.ndarray, np.ndarray, float]:
        """Full-head (loss, acc) of the blocks at `anchors`, each block row's argmax hit [N, B-1],
        which rows count (label inside the sequence and the draft vocabulary) and their weight."""
        blocks, batch = self.blocks_of(store, index, sequence, anchors, None)
        hidden = block_states(self.model, self.target, store.get(index), blocks)
        loss, acc = lever_loss(hidden, self.head_weight, batch, candidates=False, distill=0.0)
        inside = batch.weights > 0
        top = np.array(mx.argmax(hidden @ self.head_weight.T, axis=-1))
        hits = (top == batch.labels) & inside
        return (loss.item(), acc.item()), hits, inside, float(batch.weights.sum())

    def accepted_runs(
        self, store: FeatureStore, index: int, sequence: TrainSequence, anchors: np.ndarray
    ) -> np.ndarray:
        """Per anchor, how many of its block's drafts greedy verification would accept when the
        sequence is the target's greedy continuation: the run of leading argmax hits."""
        _, hits, _, _ = self._measure(store, index, sequence, np.asarray(anchors))
        return np.cumprod(hits, axis=1).sum(1)

    def heldout(
        self, store: FeatureStore, sequences: list[TrainSequence], anchors_per_record: int = 32
    ) -> dict[str, Any]:
        """Loss and accuracy over the whole draft head, cross-entropy only (comparable whatever
        the training loss), on the same `anchors_per_record` anchors of every held-out record
        each time (0: all, about 9,800 blocks of the 32 held-out records: ~25 s on a quiet
        2-core host). Rows are weighted by the recipe's gamma, so a gamma change moves the loss
        and accuracy; the offline tau below does not depend on it.

        Also the offline greedy tau: the corpus is the target's own greedy continuation, so a
        block's accepted length in greedy speculative decoding is its run of leading argmax
        hits, and ``tau = 1 + mean(run)`` over the anchors, at the drafter's block size, with
        no speculative loop (`acc_by_position` is the top-1 accuracy of each block row). With
        every anchor measured, `tau_loop` replays the loop itself (`loop_steps_over`)."""
        if self.average is not None:  # score the average, then train on from the raw weights
            raw = self.model.parameters()
            self.model.update(self.average)
            try:
                return self._heldout(store, sequences, anchors_per_record)
            finally:
                self.model.update(raw)
        return self._heldout(store, sequences, anchors_per_record)

    def _heldout(
        self, store: FeatureStore, sequences: list[TrainSequence], anchors_per_record: int
    ) -> dict[str, Any]:
        loss_sum = acc_sum = weight_sum = 0.0
        runs: list[np.ndarray] = []
        loop_tokens = loop_steps = 0  # the greedy loop replayed, where every anchor was measured
        loop_records: list[list[int]] = []  # [record, tokens, steps]: intervals are drawn on them
        hits_sum = np.zeros(self.recipe.block_size - 1)
        rows_sum = np.zeros(self.recipe.block_size - 1)
        for index, sequence in enumerate(sequences):
            first = max(sequence.prompt_tokens - 1, 0)
            anchors = np.arange(first, len(sequence.tokens) - 1)
            if anchors_per_record and len(anchors) > anchors_per_record:
                rng = np.random.default_rng([self.recipe.seed, 7919, index])
                anchors = np.sort(rng.choice(anchors, anchors_per_record, replace=False))
            if len(anchors) == 0:
                continue
            (loss, acc), hits, inside, weight = self._measure(store, index, sequence, anchors)
            loss_sum += loss * weight
            acc_sum += acc * weight
            weight_sum += weight
            hits_sum += hits.sum(0)
            rows_sum += inside.sum(0)
            record_runs = np.cumprod(hits, axis=1).sum(1)
            runs.append(record_runs)
            if not anchors_per_record:  # every anchor (a sample would replay short records only)
                loop_records.append([index, len(record_runs), loop_steps_over(record_runs)])
                loop_tokens += loop_records[-1][1]
                loop_steps += loop_records[-1][2]
        run = np.concatenate(runs) if runs else np.zeros(1)
        result = {
            "loss": loss_sum / max(weight_sum, 1e-9),
            "acc": acc_sum / max(weight_sum, 1e-9),
            "tau": round(1.0 + float(run.mean()), 4),
            "acc_by_position": [round(float(h), 4) for h in hits_sum / np.maximum(rows_sum, 1)],
            # tau were the drafting depth capped at d = 1 .. B-1 (what the adaptive depth buys)
            "tau_by_depth": [
                round(1.0 + float(np.minimum(run, d).mean()), 4)
                for d in range(1, len(rows_sum) + 1)
            ],
            # tokens / steps of the real loop replayed over the records (None unless every
            # anchor was measured): what `campaign eval` measures, without its prompt noise
            "tau_loop": round(loop_tokens / loop_steps, 4) if loop_steps else None,
            "step": self.state.step,
        }
        if loop_records:  # each record's replayed loop, for intervals over records
            result["loop_records"] = loop_records
        return result


def loop_steps_over(runs: np.ndarray) -> int:
    """Steps greedy speculative decoding takes over a continuation whose anchor `i` accepts
    `runs[i]` drafts: each step commits its run plus the target's own token. The mean of
    `1 + runs` over every anchor overstates the loop's tokens per step, because runs cluster:
    the loop crosses an easy stretch in few steps, so it visits fewer of its anchors."""
    position = steps = 0
    while position < len(runs):
        position += int(runs[position]) + 1
        steps += 1
    return steps


def new_drafter(
    target: TargetAdapter, target_dir: Path, recipe: Recipe, train_sequences: list[TrainSequence]
) -> tuple[DFlashDraftModel, np.ndarray | None]:
    """A fresh drafter (random, or warm-started) and its draft vocabulary (from the corpus)."""
    raw = json.loads((target_dir / "config.json").read_text())
    config = drafter_config_for_target(
        raw,
        num_layers=recipe.layers,
        block_size=recipe.block_size,
        mask_token_id=recipe.mask_token_id,
    )
    model = init_drafter(config, recipe.seed)
    if recipe.warm_start:
        from drafters.dflash.warm_start import warm_start

        sample = np.concatenate([s.tokens for s in train_sequences[:8]])[:2048]
        scales = warm_start(model, TargetAdapter_for(target, config), sample)
        log.info(
            "warm start from the target's top %d layers; q/k norm scales %s",
            recipe.layers,
            {k: round(v, 3) for k, v in scales.items()},
        )
    vocab = None
    if 0 < recipe.draft_vocab < target.vocab_size:
        vocab = choose_draft_vocab(
            (s.tokens for s in train_sequences), recipe.draft_vocab, target.vocab_size
        )
    return model, vocab


def TargetAdapter_for(target: TargetAdapter, config: Any) -> TargetAdapter:  # noqa: N802
    if target.layer_ids != list(config.target_layer_ids):
        raise ValueError(
            f"target tapped at {target.layer_ids}, drafter needs {config.target_layer_ids}"
        )
    return target


# =================================================================== a sitting
class Stop:
    """SIGTERM/SIGINT: finish the optimizer step, save, leave. During the feature pass (minutes
    of target forwards, resumable from its progress file) it interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self.in_features = False
        self.reason = ""

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.reason = signal.Signals(signum).name
        log.info("%s received: stopping after the current step", self.reason)
        if self.in_features:
            raise KeyboardInterrupt


def load_target(name: str, layer_ids: list[int] | None, layers: int) -> tuple[TargetAdapter, Path]:
    from drafters.dflash.config import default_target_layer_ids
    from engine.models.loading import load_target_model
    from engine.models.resolve import resolve_target

    target_dir = resolve_target(name)
    model, _ = load_target_model(target_dir)
    if layer_ids is None:
        raw = json.loads((target_dir / "config.json").read_text())
        layer_ids = default_target_layer_ids(int(raw["num_hidden_layers"]), layers)
    target = TargetAdapter(model, list(layer_ids))
    use_cpu_kernels(target, None)
    return target, target_dir


def trainer_for(target_name: str, drafter_dir: Path, cache_root: Path = CACHE_ROOT) -> Trainer:
    """A `Trainer` on the checkpoint in `drafter_dir` and its target, for measures (no sitting)."""
    config = read_config(drafter_dir)
    target, _ = load_target(target_name, config.target_layer_ids, config.num_hidden_layers)
    model, state, vocab = load_checkpoint(drafter_dir)
    return Trainer(target, target_name, model, state, vocab, cache_root / Path(target_name).name)


def heldout_of(
    target_name: str,
    drafter_dir: Path,
    val_records: int | None = None,
    heldout_anchors: int = 16,
    cache_root: Path = CACHE_ROOT,
    train_shard: int | None = None,
    corpus: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """The held-out measure (`Trainer.heldout`) of the checkpoint in `drafter_dir`, no training;
    with `train_shard`, the same measure on that training shard's first records instead (the
    gap between the two says whether the drafter is short of data or of capacity). `corpus`
    (train, held-out records) replaces the repository's (tests)."""
    trainer = trainer_for(target_name, drafter_dir, cache_root)
    state = trainer.state
    train, val = corpus or corpus_split(target_name)
    if train_shard is not None:
        # records and sequences are one to one: the shard is cut from the record count
        val = [train[i] for i in shard_slices(len(train), state.recipe.shard_records)[train_shard]]
    val_seqs = to_sequences(val[:val_records] if val_records else val, state.recipe.max_len)
    return trainer.heldout(trainer.store(val_seqs), val_seqs, heldout_anchors)


def grow_checkpoint(
    drafter_dir: Path, layers: int | None, command: str, taps: list[int] | None = None
) -> dict[str, Any]:
    """Grow the checkpoint in `drafter_dir` in place to `layers` layers (`grow.grow_layers`)
    and/or to read the target at `taps` (`grow.grow_taps`); the predictions stay the same.
    Logged in the sittings log as a `grow` stage."""
    from drafters.dflash.grow import grow_layers, grow_taps

    if layers is None and taps is None:
        raise ValueError("grow needs more layers or more taps")
    model, state, vocab = load_checkpoint(drafter_dir)
    record = log_entry("grow", command, state)
    if layers is not None:
        record["layers"] = [state.recipe.layers, layers]
        model = grow_layers(model, layers)
        state.recipe.layers = layers
    if taps is not None:
        before = list(model.config.target_layer_ids)
        model = grow_taps(model, taps)
        record["taps"] = [before, list(model.config.target_layer_ids)]
    save_checkpoint(drafter_dir, model, state, vocab, read_sittings(drafter_dir) + [record])
    return record


def apply_retune(recipe: Recipe, changes: dict[str, Any]) -> dict[str, list[Any]]:
    """Set the `RETUNABLE` fields in `changes` on a resumed campaign's recipe; {field: [old,
    new]} for those that changed. Any other field that differs is an error that names it."""
    fixed = sorted(k for k, v in changes.items() if k not in RETUNABLE and getattr(recipe, k) != v)
    if fixed:
        raise ValueError(
            f"a resumed campaign keeps {', '.join(fixed)} (stored: "
            + ", ".join(f"{k}={getattr(recipe, k)}" for k in fixed)
            + f"); a sitting may change only {', '.join(RETUNABLE)}"
        )
    changed = {k: [getattr(recipe, k), v] for k, v in changes.items() if getattr(recipe, k) != v}
    for name, (_, value) in changed.items():
        setattr(recipe, name, value)
    return changed


def run_sitting(
    *,
    target_name: str,
    drafter_dir: Path,
    recipe: Recipe | None,
    minutes: float | None,
    max_steps: int | None,
    checkpoint_minutes: float,
    heldout_every: int,
    command: str,
    cache_root: Path = CACHE_ROOT,
    val_records: int | None = None,
    heldout_anchors: int = 16,
    log_every: int = 10,
    corpus: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None,
    retune: dict[str, Any] | None = None,
    fresh_only: bool = False,
) -> dict[str, Any]:
    """Resume (or start) the campaign in `drafter_dir` and train until `minutes` pass,
    `max_steps` steps are done, or SIGTERM; checkpoint every `checkpoint_minutes` and at the
    end. Returns the sitting's record (also in the sittings log). `corpus` (train, held-out
    records) replaces the repository's (tests). `retune`: recipe fields a resumed campaign
    changes from this sitting on (only `RETUNABLE` ones; recorded in the sitting).
    `fresh_only`: train only the shards holding records no sitting has trained, then stop (a
    drafter that has seen a record a dozen times learns next to nothing from it again)."""
    started = time.time()
    stop = Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        resumed = has_state(drafter_dir)
        retuned: dict[str, list[Any]] = {}
        train_records, val = corpus or corpus_split(target_name)
        if resumed:
            config = read_config(drafter_dir)
            target, target_dir = load_target(
                target_name, config.target_layer_ids, config.num_hidden_layers
            )
            model, state, vocab = load_checkpoint(drafter_dir)
            log.info("resumed %s at step %d, cursor %s", drafter_dir, state.step, state.cursor)
            retuned = apply_retune(state.recipe, retune or {})
            if retuned:
                log.info("retuned from this sitting on: %s", retuned)
        else:
            recipe = recipe or Recipe()
            target, target_dir = load_target(target_name, None, recipe.layers)
            sequences = to_sequences(train_records, recipe.max_len)
            model, vocab = new_drafter(target, target_dir, recipe, sequences)
            state = State(recipe=recipe, records_reached=0)
            log.info("initialised a drafter in %s (recipe %s)", drafter_dir, asdict(recipe))
        recipe = state.recipe
        trainer = Trainer(
            target, target_name, model, state, vocab, cache_root / Path(target_name).name
        )
        train_seqs = to_sequences(train_records, recipe.max_len)
        val_seqs = to_sequences(val[:val_records] if val_records else val, recipe.max_len)
        shards = shard_slices(len(train_seqs), recipe.shard_records)
        sittings = read_sittings(drafter_dir)
        if state.records_reached is None:
            state.records_reached = records_reached_before(state, sittings, shards)
        record: dict[str, Any] = {
            "stage": "sitting",
            "command": command,
            "host": platform.node(),
            "at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "resumed": resumed,
            "step_start": state.step,
            "labels_start": state.labels_seen,
            "recipe": asdict(recipe),
            **({"retuned": retuned} if retuned else {}),
            "corpus_records": len(train_records),
            "heldout_records": len(val_seqs),  # grows with the corpus: say what tau is over
            "shards": len(shards),
        }
        sittings.append(record)
        stop.in_features = True
        val_store = trainer.store(val_seqs)
        stop.in_features = False
        first_heldout = trainer.heldout(val_store, val_seqs, heldout_anchors)
        record["heldout_start"] = first_heldout
        log.info(
            "held-out at step %d: loss %.4f acc %.4f tau %.3f",
            state.step,
            first_heldout["loss"],
            first_heldout["acc"],
            first_heldout["tau"],
        )
        sitting_step, train_seconds, feature_seconds, labels = 0, 0.0, 0.0, 0.0
        last_save = time.time()
        losses: list[float] = []
        accs: list[float] = []

        def save(reason: str) -> None:
            record.update(
                {
                    "step_end": state.step,
                    "steps": state.step - record["step_start"],
                    "labels": int(labels),
                    "seconds": round(time.time() - started),
                    "train_seconds": round(train_seconds),
                    "feature_seconds": round(feature_seconds),
                    "labels_per_s": round(labels / train_seconds, 1) if train_seconds else None,
                    "steps_per_s": round(sitting_step / train_seconds, 4)
                    if train_seconds
                    else None,
                    "cursor": asdict(state.cursor),
                    "heldout_end": state.heldout,
                    "saved": reason,
                }
            )
            save_checkpoint(drafter_dir, model, state, vocab, sittings, trainer.shipped())
            log.info(
                "checkpoint (%s): step %d, cursor %s -> %s",
                reason,
                state.step,
                asdict(state.cursor),
                drafter_dir / STATE_FILE,
            )

        while not stop.requested:
            if minutes is not None and time.time() - started >= minutes * 60:
                stop.reason = f"{minutes} minutes"
                break
            if max_steps is not None and sitting_step >= max_steps:
                stop.reason = f"{max_steps} steps"
                break
            cursor = state.cursor
            if cursor.shard >= len(shards):  # the corpus shrank (never, in practice)
                cursor.shard, cursor.pass_, cursor.position, cursor.return_to = 0, 0, 0, -1
            if cursor.return_to < 0:  # not on a detour already: are there fresh records?
                if state.records_reached < len(train_seqs):
                    fresh = fresh_shard(shards, state.records_reached)
                    cursor.visit_fresh(fresh, now=fresh_only)
                elif fresh_only:
                    stop.reason = "no fresh records left"
                    break
            shard = shards[cursor.shard]
            shard_seqs = [train_seqs[i] for i in shard]
            t0 = time.time()
            stop.in_features = True
            try:
                store = trainer.store(shard_seqs)
            except KeyboardInterrupt:
                feature_seconds += time.time() - t0
                break
            finally:
                stop.in_features = False
            feature_seconds += time.time() - t0
            state.records_reached = max(state.records_reached, shard.stop)
            order = np.random.default_rng(
                [recipe.seed, cursor.shard, cursor.wraps, cursor.pass_]
            ).permutation(len(shard_seqs))
            while not stop.requested and not (max_steps is not None and sitting_step >= max_steps):
                if minutes is not None and time.time() - started >= minutes * 60:
                    break
                members = [
                    int(i) for i in order[cursor.position : cursor.position + recipe.batch_size]
                ]
                lr = learning_rate(recipe, state.step, sitting_step, resumed)
                t1 = time.time()
                loss, acc, n = trainer.step(store, members, shard_seqs, lr)
                train_seconds += time.time() - t1
                state.step += 1
                sitting_step += 1
                labels += n
                state.labels_seen += int(n)
                state.sequences_seen += len(members)
                losses.append(loss)
                accs.append(acc)
                shard_done = cursor.advance(
                    len(members), len(shard_seqs), len(shards), recipe.passes_per_shard
                )
                if sitting_step % log_every == 0:
                    log.info(
                        "step %d loss %.4f acc %.3f lr %.2e | %.1f labels/s %.3f steps/s | "
                        "shard %d pass %d pos %d wraps %d",
                        state.step,
                        np.mean(losses[-log_every:]),
                        np.mean(accs[-log_every:]),
                        lr,
                        labels / train_seconds,
                        sitting_step / train_seconds,
                        cursor.shard,
                        cursor.pass_,
                        cursor.position,
                        cursor.wraps,
                    )
                if heldout_every and (sitting_step == 100 or sitting_step % heldout_every == 0):
                    state.heldout = trainer.heldout(val_store, val_seqs, heldout_anchors)
                    log.info(
                        "held-out at step %d: loss %.4f acc %.4f tau %.3f",
                        state.step,
                        state.heldout["loss"],
                        state.heldout["acc"],
                        state.heldout["tau"],
                    )
                    if sitting_step == 100:
                        record["heldout_after_100"] = state.heldout
                if shard_done or time.time() - last_save >= checkpoint_minutes * 60:
                    # before the next shard's feature pass too: it may take many minutes
                    save("shard done" if shard_done else "periodic")
                    last_save = time.time()
                if shard_done:
                    break
        reason = stop.reason or "end"
        if sitting_step:
            save(reason)  # at once: the held-out pass below takes minutes on a loaded host
        state.heldout = trainer.heldout(val_store, val_seqs, heldout_anchors)
        log.info(
            "held-out at step %d: loss %.4f acc %.4f tau %.3f",
            state.step,
            state.heldout["loss"],
            state.heldout["acc"],
            state.heldout["tau"],
        )
        save(reason + ", held-out loss recorded")
        log.info("sitting done: %s", json.dumps(record))
        return record
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# =================================================================== loss speed
def loss_speed(target_name: str, recipe: Recipe, rounds: int) -> dict[str, Any]:
    """Seconds per micro-step (forward + backward, no update) of each loss, interleaved round
    by round on the same sequences and anchors (the order rotating), so a loaded host slows
    every arm alike; medians over the rounds."""
    target, target_dir = load_target(target_name, None, recipe.layers)
    train_records, _ = corpus_split(target_name)
    seqs = to_sequences(train_records, recipe.max_len)
    shard = [seqs[i] for i in shard_slices(len(seqs), recipe.shard_records)[0]]
    model, vocab = new_drafter(target, target_dir, recipe, seqs)
    trainer = Trainer(
        target, target_name, model, State(recipe=recipe), vocab, CACHE_ROOT / Path(target_name).name
    )
    store = trainer.store(shard)
    arms = {
        "full": (False, 0.0),
        "full+distill": (False, 0.5),
        "candidates": (True, 0.0),
        "candidates+distill": (True, 0.5),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    labels: list[float] = []
    names = list(arms)
    for r in range(rounds + 1):  # round 0 warms every arm up and is not counted
        index = r % len(shard)
        rng = np.random.default_rng([recipe.seed, r])
        recipe.candidates = True  # negatives are sampled; the full arms ignore them
        made = trainer.training_blocks(store, index, shard[index], rng)
        if made is None:
            continue
        blocks, batch = made
        features = store.get(index)
        mx.eval(features)
        if r:
            labels.append(float((batch.weights > 0).sum()))
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            candidates, distill = arms[name]
            t = time.perf_counter()
            (loss, _), grads = trainer._grad(features, blocks, batch, candidates, distill)
            mx.eval(loss, grads)
            if r:
                times[name].append(time.perf_counter() - t)
    per_label = {n: float(np.median(np.array(t) / np.array(labels))) for n, t in times.items()}
    return {
        name: {
            "median_s_per_sequence": round(float(np.median(times[name])), 3),
            "labels_per_s": round(1.0 / per_label[name], 1),
            "vs_full": round(per_label["full"] / per_label[name], 2),
        }
        for name in arms
    } | {"rounds": rounds, "labels_per_sequence": round(float(np.mean(labels)), 1)}


# =================================================================== CLI
def _recipe_from_args(args: argparse.Namespace) -> Recipe:
    return Recipe(**recipe_args(args))


def recipe_args(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe fields given on the command line."""
    given: dict[str, Any] = {}
    for name in (
        "candidates",
        "distill",
        "warm_start",
        "negatives",
        "lr",
        "shard_records",
        "passes_per_shard",
        "batch_size",
        "num_anchors",
        "block_size",
        "layers",
        "draft_vocab",
        "top_k",
        "gamma",
        "ema",
        "warmup_steps",
        "prompt_anchors",
        "train_block",
    ):
        value = getattr(args, name, None)
        if value is not None:
            given[name] = value
    return given


def build_parser() -> argparse.ArgumentParser:
    """The command line (also read by `bench/campaign_arms.py` for each arm's arguments)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "action",
        choices=("run", "eval", "measure", "features", "speed", "heldout", "grow"),
    )
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter-dir", type=Path, default=DEFAULT_DRAFTER_DIR)
    parser.add_argument("--minutes", type=float, help="run: stop (and save) after this long")
    parser.add_argument("--steps", type=int, help="run/measure: stop after this many steps")
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0)
    parser.add_argument("--heldout-every", type=int, default=250)
    parser.add_argument("--val-records", type=int, help="held-out records used (default: all)")
    parser.add_argument("--heldout-anchors", type=int, default=16, help="per record (0: all)")
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--log-file", type=Path)
    parser.add_argument("--shard", type=int, default=0, help="features: which shard")
    parser.add_argument(
        "--on-shard", action="store_true", help="heldout: measure on training shard --shard"
    )
    # recipe (a new campaign, or `measure`; a resumed campaign keeps its stored recipe, but for
    # the RETUNABLE fields given here, which it changes from this sitting on)
    parser.add_argument("--candidates", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--negatives", type=int)
    parser.add_argument("--distill", type=float)
    parser.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--train-block",
        type=int,
        help="rows of a training block, anchor included (default: the model's block size)",
    )
    parser.add_argument(
        "--prompt-anchors",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="anchors in the prompts too, labelled by the target's argmax chain",
    )
    parser.add_argument("--lr", type=float)
    parser.add_argument("--shard-records", type=int)
    parser.add_argument("--passes-per-shard", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--num-anchors", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument(
        "--taps", help="grow: the target layers to read, comma-separated (every current one too)"
    )
    parser.add_argument("--draft-vocab", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--gamma", type=float, help="loss decay over block rows (0: paper's)")
    parser.add_argument("--ema", type=float, help="weight averaging decay (0: off)")
    # eval
    parser.add_argument("--prompts", type=int, default=3, help="eval: held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--force", action="store_true", help="eval: keep even if tau is lower")
    parser.add_argument(
        "--fresh-only",
        action="store_true",
        help="run: train only records no sitting has trained (the newest corpus parts), then stop",
    )
    parser.add_argument("--out", type=Path, help="measure: append the result (JSON line) here")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m drafters.dflash.campaign " + " ".join(shlex.quote(a) for a in argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log_file:
        handlers.append(logging.FileHandler(args.log_file))
    logging.basicConfig(
        level=logging.INFO,
        handlers=handlers,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.action == "run":
        run_sitting(
            target_name=args.target,
            drafter_dir=args.drafter_dir,
            recipe=_recipe_from_args(args),
            retune=recipe_args(args),
            minutes=args.minutes,
            max_steps=args.steps,
            checkpoint_minutes=args.checkpoint_minutes,
            heldout_every=args.heldout_every,
            command=command,
            val_records=args.val_records,
            heldout_anchors=args.heldout_anchors,
            fresh_only=args.fresh_only,
        )
    elif args.action == "eval":
        run_eval(args.target, args.drafter_dir, args.prompts, args.max_tokens, command, args.force)
    elif args.action == "measure":
        with tempfile.TemporaryDirectory(prefix="campaign-measure-") as tmp:
            record = run_sitting(
                target_name=args.target,
                drafter_dir=Path(tmp),
                recipe=_recipe_from_args(args),
                minutes=args.minutes,
                max_steps=args.steps or 40,
                checkpoint_minutes=1e9,
                heldout_every=0,
                command=command,
                val_records=args.val_records,
                heldout_anchors=args.heldout_anchors,
            )
        line = json.dumps(
            {
                "command": command,
                **{
                    k: record.get(k)
                    for k in (
                        "steps",
                        "labels",
                        "train_seconds",
                        "labels_per_s",
                        "steps_per_s",
                        "heldout_start",
                        "heldout_end",
                    )
                },
            }
        )
        print(line)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")
    elif args.action == "heldout":
        on_shard = args.shard if args.on_shard else None
        result = heldout_of(
            args.target,
            args.drafter_dir,
            args.val_records,
            args.heldout_anchors,
            CACHE_ROOT,
            on_shard,
        )
        print(json.dumps({"drafter_dir": str(args.drafter_dir), "shard": on_shard, **result}))
    elif args.action == "grow":
        if args.layers is None and args.taps is None:
            parser.error("grow needs --layers N (more than the drafter has) and/or --taps A,B,...")
        taps = None if args.taps is None else [int(t) for t in args.taps.split(",")]
        print(json.dumps(grow_checkpoint(args.drafter_dir, args.layers, command, taps)))
    elif args.action == "speed":
        print(
            json.dumps(loss_speed(args.target, _recipe_from_args(args), args.steps or 4), indent=1)
        )
    elif args.action == "features":
        recipe = _recipe_from_args(args)
        # the checkpoint's own taps where there is one (a grown drafter reads more layers)
        has_checkpoint = (args.drafter_dir / "config.json").exists()
        taps = read_config(args.drafter_dir).target_layer_ids if has_checkpoint else None
        target, _ = load_target(args.target, taps, recipe.layers)
        train_records, val = corpus_split(args.target)
        seqs = to_sequences(train_records, recipe.max_len)
        shard = shard_slices(len(seqs), recipe.shard_records)[args.shard]
        started = time.time()
        for part in (to_sequences(val, recipe.max_len), [seqs[i] for i in shard]):
            FeatureStore.build(
                target,
                [s.tokens for s in part],
                CACHE_ROOT / Path(args.target).name / "features",
                args.target,
                top_k=recipe.top_k,
                sidecar=FeatureSidecar(
                    sidecar_dir(args.target), args.target, target.layer_ids, recipe.top_k
                ),
            )
        tokens = sum(len(seqs[i].tokens) for i in shard)
        print(
            f"shard {args.shard}: {len(shard)} records, {tokens} tokens, "
            f"{time.time() - started:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
