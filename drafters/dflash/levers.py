"""Cheaper training losses for a DFlash drafter: a candidate set instead of the whole head, and
distillation from the target's top-k.

On SmolLM2 the LM head (16,384 draft rows x 576) is about half of a fit step's FLOPs: every one
of the N x (B-1) block rows is scored against every row, and its gradient is as large again.
Both levers below reuse the target's top-k next-token log-probabilities that the feature pass
keeps (`FeatureStore(top_k=...)`), so they cost no extra target forward:

- **candidate set** (`candidates=True`): each row is scored only against the target's top-k at
  its position, its label, and `negatives` draft rows shared by the whole micro-step (uniformly
  sampled, with the usual log(V/S) correction so they stand for the rest of the vocabulary).
  Inference is unchanged: the drafter still proposes over its full draft vocabulary.
- **distillation** (`distill=alpha`): the loss is ``(1 - alpha) * CE(label) + alpha *
  KL(p_topk || q)``, where ``p_topk`` is the target's top-k renormalised over the candidates the
  draft vocabulary holds. A label then carries the target's ranking, not just its argmax.

The label of block row j of anchor a is token a + j, so its teacher is the target's
distribution at position a + j - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from drafters.dflash.train import BlockBatch

_MASKED = -1e9  # logit of a missing candidate: finite, so 0 * (its log-prob) stays 0


@dataclass
class LeverBatch:
    """Per block row: candidate draft indices, teacher probabilities and where the label is."""

    cand: np.ndarray  # [N, B-1, C] int32 draft-vocabulary indices, -1 = no candidate
    teacher: np.ndarray  # [N, B-1, C] float32, sums to 1 over a row's valid candidates
    label_col: np.ndarray  # [N, B-1] int32: the column of cand holding the label
    labels: np.ndarray  # [N, B-1] int32: the label as a draft index (0 where outside)
    weights: np.ndarray  # [N, B-1] float32: block weights, 0 where the label is outside
    negatives: np.ndarray  # [S] int32 shared sampled draft indices (S may be 0)
    clash: np.ndarray  # [N, B-1, S] bool: negative equals one of that row's candidates


def lever_batch(
    blocks: BlockBatch,
    top_ids: np.ndarray,
    top_logp: np.ndarray,
    index_of: np.ndarray | None,
    negatives: np.ndarray | None = None,
) -> LeverBatch:
    """Candidates and teacher of every block row of `blocks` (whose labels are target ids).

    top_ids / top_logp: [S_seq, k] from the feature store (row p: the target's top-k for token
    p + 1); index_of: target id -> draft index (-1 outside), None for the full head.
    """
    n, rows = blocks.labels.shape
    seq_len = len(top_ids)
    positions = blocks.anchors[:, None] + np.arange(1, rows + 1)[None, :]
    source = np.clip(positions - 1, 0, seq_len - 1)
    top_t, top_l = top_ids[source], top_logp[source]  # [N, B-1, k]
    if index_of is None:
        top_d, label_d = top_t.astype(np.int32), blocks.labels.astype(np.int32)
    else:
        top_d, label_d = index_of[top_t], index_of[blocks.labels]
    valid_top = top_d >= 0
    label_in_top = ((top_d == label_d[..., None]) & valid_top).any(-1)
    extra = np.where(label_in_top | (label_d < 0), -1, label_d)[..., None]
    cand = np.concatenate([np.where(valid_top, top_d, -1), extra], axis=-1).astype(np.int32)
    probs = np.where(valid_top, np.exp(top_l), 0.0)
    teacher = np.concatenate([probs, np.zeros_like(probs[..., :1])], axis=-1)
    total = teacher.sum(-1, keepdims=True)
    label_col = np.argmax((cand == label_d[..., None]) & (cand >= 0), axis=-1).astype(np.int32)
    # No teacher token in the draft vocabulary: the label alone is the target.
    onehot = np.zeros_like(teacher)
    np.put_along_axis(onehot, label_col[..., None], 1.0, axis=-1)
    teacher = np.where(total > 0, teacher / np.maximum(total, 1e-30), onehot).astype(np.float32)
    weights = np.where(label_d >= 0, blocks.weights, 0.0).astype(np.float32)
    negatives = np.zeros(0, np.int32) if negatives is None else np.asarray(negatives, np.int32)
    clash = (negatives[None, None, :, None] == cand[..., None, :]).any(-1)
    return LeverBatch(
        cand, teacher, label_col, np.maximum(label_d, 0).astype(np.int32), weights, negatives, clash
    )


def greedy_chain_labels(blocks: BlockBatch, tokens: np.ndarray, top1: np.ndarray) -> BlockBatch:
    """`blocks` relabelled by the target's own greedy chain, so an anchor may sit anywhere,
    the prompt included, not only in the target's greedy continuation.

    top1: [S] the target's argmax after each position (the feature store's top-k, column 0).
    Block row j of anchor a is labelled top1[a + j - 1], the token greedy decoding would emit
    there, and counts only while the text before it is that chain (tokens a+1 .. a+j-1 each
    the target's argmax): past a divergence the target's prediction is for a context the
    drafter, which sees only mask tokens there, cannot know. Row 1 always counts. On the
    target's greedy continuation this changes nothing (its tokens are the chain).
    """
    seq_len = len(tokens)
    rows = blocks.labels.shape[1]
    positions = blocks.anchors[:, None] + np.arange(1, rows + 1)[None, :]  # label positions
    clipped = np.minimum(positions, seq_len - 1)
    inside = positions < seq_len
    follows = (tokens[clipped] == top1[clipped - 1]) & inside  # text token == greedy token
    # row j counts when rows 1..j-1 followed the chain
    chain = np.cumprod(np.concatenate([np.ones_like(follows[:, :1]), follows[:, :-1]], 1), 1)
    keep = inside & chain.astype(bool)
    labels = np.where(keep, top1[clipped - 1], 0).astype(np.int32)
    weights = np.where(keep, blocks.weights, 0.0).astype(np.float32)
    return BlockBatch(blocks.block_ids, blocks.anchors, labels, weights)


def sample_negatives(vocab: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` distinct draft indices, uniformly (shared by a micro-step's rows)."""
    return np.sort(rng.choice(vocab, size=min(count, vocab), replace=False)).astype(np.int32)


def lever_loss(
    hidden: mx.array,
    head_weight: mx.array,
    batch: LeverBatch,
    *,
    candidates: bool,
    distill: float,
) -> tuple[mx.array, mx.array]:
    """Weighted loss and accuracy of final-normed block states hidden [N, B-1, d] against
    the draft head rows head_weight [V, d].

    Accuracy is over what the loss scores: the whole head without `candidates`, the
    candidate set with it (optimistic; held-out numbers always use the whole head).
    """
    weights = mx.array(batch.weights)
    total = mx.maximum(weights.sum(), 1e-9)
    cand = mx.array(batch.cand)
    valid = cand >= 0
    if candidates:
        rows = head_weight[mx.maximum(cand, 0)]  # [N, B-1, C, d]
        cand_logits = (rows @ hidden[..., None]).squeeze(-1).astype(mx.float32)
        cand_logits = mx.where(valid, cand_logits, _MASKED)
        parts = [cand_logits]
        if len(batch.negatives):
            neg = (hidden @ head_weight[mx.array(batch.negatives)].T).astype(mx.float32)
            neg = neg + math.log(head_weight.shape[0] / len(batch.negatives))
            parts.append(mx.where(mx.array(batch.clash), _MASKED, neg))
        logits = mx.concatenate(parts, axis=-1)
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        cand_logq = logq[..., : batch.cand.shape[-1]]
        label_logq = mx.take_along_axis(cand_logq, mx.array(batch.label_col)[..., None], -1)
        hits = mx.argmax(logits, axis=-1) == mx.array(batch.label_col)
    else:
        logits = (hidden @ head_weight.T).astype(mx.float32)
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        labels = mx.array(batch.labels)
        label_logq = mx.take_along_axis(logq, labels[..., None], -1)
        cand_logq = mx.where(valid, mx.take_along_axis(logq, mx.maximum(cand, 0), -1), _MASKED)
        hits = mx.argmax(logits, axis=-1) == labels
    ce = -label_logq.squeeze(-1)
    per_row = ce
    if distill > 0:
        teacher = mx.array(batch.teacher)
        log_teacher = mx.log(mx.maximum(teacher, 1e-30))
        kl = mx.where(teacher > 0, teacher * (log_teacher - cand_logq), 0.0).sum(-1)
        per_row = (1.0 - distill) * ce + distill * kl
    loss = (per_row * weights).sum() / total
    acc = (hits.astype(mx.float32) * weights).sum() / total
    return loss, mx.stop_gradient(acc)
