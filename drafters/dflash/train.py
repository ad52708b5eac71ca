"""Training a DFlash drafter on MLX (the recipe of `shared/reference/dflash.md` §7).

Pipeline:

1. **data** — the target writes its own greedy continuations of prompts (`generate_data`), so
   the drafter learns the target's distribution; sequences go to a JSONL file.
2. **fit** — per sequence, the frozen target computes its tapped features for every position;
   random anchors ``a_1 < ... < a_N`` are drawn and each anchor starts a block
   ``[x_a, MASK, ..., MASK]`` whose row ``j`` must predict ``x_{a+j}`` (same-position labels).
   All blocks of a sequence run in one drafter forward: block ``n`` sees the context rows of
   positions ``< a_n`` (strictly: the anchor's own features are not known at inference) and
   its own block, never other blocks (`training_attention_mask`). Loss is cross-entropy
   weighted by ``exp(-(j-1)/gamma)``: early rows matter most because only prefixes get accepted.
3. **eval** — tau (mean tokens committed per verify step) with the real speculative loop.

Layout of the training forward: blocks are laid out as *batch rows* (`block_row_mask`), so the
drafter layers run as at inference — per-row RoPE offset = the anchor, keys = ``[context |
block]`` — with the context shared by every block row (`block_attention` avoids copying it).

Batching: one sequence per micro-step; `TrainConfig.batch_size` micro-steps are accumulated
(gradients averaged) into each optimizer step. Anchors and sequence order derive from
``(seed, micro-step index)``, so resuming from a checkpoint replays the same data stream.
"""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import json
import logging
import math
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from drafters.dflash.checkpoint import load_dflash_model, save_dflash_model
from drafters.dflash.config import DFlashConfig, default_target_layer_ids
from drafters.dflash.features import FeatureStore
from drafters.dflash.model import DFlashAttention, DFlashDraftModel
from drafters.dflash.vocab import DraftHead, choose_draft_vocab, read_draft_vocab
from engine.backend import cpu_kernels
from engine.step.target import TargetAdapter

log = logging.getLogger(__name__)

# Trainer files live in a subdirectory: the drafter loader reads every top-level *.safetensors.
OPTIMIZER_FILE = "training/optimizer.safetensors"
STATE_FILE = "training/state.json"
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # paper Eq. 4


# =================================================================== configuration
@dataclass
class TrainConfig:
    """Hyperparameters of one training run (defaults follow the reference's small recipe)."""

    steps: int = 1000  # optimizer steps
    batch_size: int = 1  # sequences per optimizer step (gradient accumulation)
    lr: float = 6e-4
    warmup_fraction: float = 0.04  # linear warmup, then cosine decay to 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global gradient norm
    num_anchors: int = 64  # blocks per sequence
    gamma: float | None = None  # loss decay; None: `default_gamma(block_size)`
    max_len: int = 2048  # sequences are truncated to this many tokens
    train_on_prompt: bool = False  # False: only continuation tokens are labels
    draft_vocab_size: int = 0  # > 0: train (and draft) over that many head rows (`vocab.py`)
    seed: int = 0
    checkpoint_every: int = 100  # optimizer steps; 0: only at the end
    feature_cache_mb: int = 4096  # target features kept between epochs (0: recompute each time)
    # set: features computed once into a disk store there (one per target)
    feature_store_dir: str = ""
    log_every: int = 10
    out_dir: str = "drafter"
    resume: bool = False
    progress: bool = True  # tqdm bar when tqdm is installed


def default_gamma(block_size: int) -> float:
    """The paper's loss decay for the published block sizes, else B / 2.3."""
    return _GAMMA_BY_BLOCK.get(block_size, block_size / 2.3)


def drafter_config_for_target(
    target_config: dict[str, Any],
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    num_features: int | None = None,
    mask_token_id: int | None = None,
) -> DFlashConfig:
    """A drafter with target-shaped layers for a target's `config.json` (as a dict).

    `target_layer_ids` defaults to `default_target_layer_ids(L_t, num_features)`, with
    `num_features` defaulting to `num_layers` (the reference rule ties K to L_d). The mask
    token defaults to the last embedding row, which ordinary text never produces.
    """
    raw = dict(target_config)
    raw.update(raw.get("text_config") or {})  # VLM wrappers keep the LM's fields nested
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    target_layers, vocab = int(raw["num_hidden_layers"]), int(raw["vocab_size"])
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(target_layers, num_features or num_layers)
    config = DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=vocab,
        block_size=block_size,
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=list(target_layer_ids),
        num_target_layers=target_layers,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
        rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    config.check()
    return config


def init_drafter(config: DFlashConfig, seed: int = 0, std: float = 0.02) -> DFlashDraftModel:
    """A fresh float32 drafter: linear weights ~ N(0, std) (initializer_range), norms at 1."""
    mx.random.seed(seed)
    model = DFlashDraftModel(config)

    def reinit(_: str, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight = std * mx.random.normal(module.weight.shape)
            if "bias" in module:
                module.bias = mx.zeros_like(module.bias)

    model.apply_to_modules(reinit)
    mx.eval(model.parameters())
    return model


# =================================================================== masks, anchors, labels
def training_attention_mask(
    seq_len: int, anchors: Iterable[int], block_size: int, valid: Iterable[bool] | None = None
) -> np.ndarray:
    """The reference training mask for one sequence, [N*B, S + N*B] booleans.

    Query rows are the N blocks' B rows in order; key columns are the S context rows, then the
    N*B block rows. Block n sees context key k iff ``k < anchors[n]`` and all of its own block
    (bidirectional), never another block. An invalid (padding) block sees only its own block,
    so softmax stays finite; it must get zero loss weight.
    """
    anchors = np.asarray(list(anchors), dtype=np.int64)
    n, b = len(anchors), block_size
    keep = np.ones(n, bool) if valid is None else np.asarray(list(valid), bool)
    block_of_row = np.repeat(np.arange(n), b)  # [N*B]
    context = np.arange(seq_len)[None, :] < anchors[block_of_row][:, None]
    context &= keep[block_of_row][:, None]
    same_block = block_of_row[:, None] == block_of_row[None, :]
    return np.concatenate([context, same_block], axis=1)


def block_row_mask(
    seq_len: int, anchors: Iterable[int], block_size: int, valid: Iterable[bool] | None = None
) -> np.ndarray:
    """The same mask for blocks laid out as batch rows: [N, 1, B, S + B].

    Row n holds block n's queries against ``[S context rows | its own B block rows]``; this is
    `training_attention_mask` with the (always hidden) other blocks' columns dropped.
    """
    anchors = np.asarray(list(anchors), dtype=np.int64)
    n = len(anchors)
    keep = np.ones(n, bool) if valid is None else np.asarray(list(valid), bool)
    context = (np.arange(seq_len)[None, :] < anchors[:, None]) & keep[:, None]  # [N, S]
    row = np.concatenate([context, np.ones((n, block_size), bool)], axis=1)  # [N, S + B]
    return np.broadcast_to(row[:, None, None, :], (n, 1, block_size, seq_len + block_size))


def sample_anchors(
    seq_len: int, num_anchors: int, rng: np.random.Generator, first: int = 0
) -> np.ndarray:
    """Sorted anchors drawn without replacement from ``[first, S-2]`` (each has a label)."""
    candidates = np.arange(max(first, 0), seq_len - 1)
    count = min(num_anchors, len(candidates))
    return np.sort(rng.choice(candidates, size=count, replace=False)).astype(np.int64)


def shared_prefix_lengths(sequences: Sequence[TrainSequence]) -> np.ndarray:
    """Per sequence, the tokens it shares with every other sequence that starts with the same
    token (a chat template's fixed system prompt; 0 for a sequence alone in its group):
    anchors there teach nothing new, the drafter would see the same few contexts again and
    again."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(sequences):
        if len(s.tokens):
            groups.setdefault(int(s.tokens[0]), []).append(i)
    out = np.zeros(len(sequences), np.int64)
    for members in groups.values():
        if len(members) < 2:
            continue
        first = sequences[members[0]].tokens
        length = min(len(sequences[i].tokens) for i in members)
        for i in members[1:]:
            differs = np.nonzero(sequences[i].tokens[:length] != first[:length])[0]
            if len(differs):
                length = int(differs[0])
        out[members] = length
    return out


@dataclass
class BlockBatch:
    """One sequence's blocks: inputs, labels and loss weights (all numpy)."""

    block_ids: np.ndarray  # [N, B] int32: anchor token then MASK tokens
    anchors: np.ndarray  # [N] int64
    labels: np.ndarray  # [N, B-1] int32: x_{a+j} for rows j = 1..B-1 (0 where invalid)
    weights: np.ndarray  # [N, B-1] float32: exp(-(j-1)/gamma), 0 past the sequence end


def make_blocks(
    tokens: np.ndarray, anchors: np.ndarray, block_size: int, mask_token_id: int, gamma: float
) -> BlockBatch:
    """Blocks ``[x_a, MASK, ...]`` with same-position labels (row j predicts x_{a+j})."""
    seq_len, n = len(tokens), len(anchors)
    block_ids = np.full((n, block_size), mask_token_id, dtype=np.int32)
    block_ids[:, 0] = tokens[anchors]
    positions = anchors[:, None] + np.arange(1, block_size)[None, :]  # [N, B-1]
    inside = positions < seq_len
    labels = np.where(inside, tokens[np.minimum(positions, seq_len - 1)], 0).astype(np.int32)
    decay = np.exp(-np.arange(block_size - 1) / gamma)[None, :]
    weights = (decay * inside).astype(np.float32)
    return BlockBatch(block_ids, anchors, labels, weights)


# =================================================================== training forward
def target_features(target: TargetAdapter, tokens: np.ndarray) -> mx.array:
    """Tapped features [1, S, K*d] of the frozen target for every position (no gradient)."""
    _, features = target(mx.array(tokens, dtype=mx.int32)[None])
    features = mx.stop_gradient(features)
    mx.eval(features)
    return features


def context_kv_per_layer(
    model: DFlashDraftModel, context: mx.array
) -> list[tuple[mx.array, mx.array]]:
    """Every layer's rotated context keys/values for rows C [1, S, d] at positions 0..S-1.

    The per-layer projections, never the fused inference matrix: that one is a copy of the
    weights and would neither see updates nor pass gradients back.
    """
    out = []
    for layer in model.layers:
        attn = layer.self_attn
        out.append(attn.context_keys(attn.k_proj(context), attn.v_proj(context), offset=0))
    return out


def block_hidden_states(
    model: DFlashDraftModel,
    features: mx.array,
    block_embeddings: mx.array,
    anchors: mx.array,
    mask: mx.array,
) -> mx.array:
    """Final-normed drafter states [N, B, d] of N blocks over one sequence's features.

    features: [1, S, K*d]; block_embeddings: [N, B, d]; anchors: [N] (RoPE offset of each
    block's row 0); mask: `block_row_mask` as an array [N, 1, B, S + B].
    """
    context = model.project_context(features.astype(block_embeddings.dtype))
    h = block_embeddings
    for layer, (keys, values) in zip(model.layers, context_kv_per_layer(model, context)):
        # DFlashLayer's residual structure, with the training attention below.
        attn_in = layer.input_layernorm(h)
        h = h + block_attention(layer.self_attn, attn_in, keys[0], values[0], anchors, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h)


def block_attention(
    attn: DFlashAttention,
    x: mx.array,
    context_keys: mx.array,
    context_values: mx.array,
    anchors: mx.array,
    mask: mx.array,
) -> mx.array:
    """DFlashAttention over ``[context | own block]`` for N blocks at once.

    x: [N, B, d] block rows; context_keys/values: [kv, S, hd], shared by all blocks. Same
    math as `DFlashAttention.__call__` with the context broadcast to every block, but the
    context part is one matmul with all N*B queries folded into its rows: broadcasting (or
    concatenating) the context per block would copy it N times, and its gradient too.
    """
    n, b, _ = x.shape
    kv, rep, hd = attn.n_kv_heads, attn.n_heads // attn.n_kv_heads, attn.head_dim
    seq_len = context_keys.shape[1]
    q = attn.rope(attn.q_norm(attn.split_heads(attn.q_proj(x), attn.n_heads)), offset=anchors)
    k = attn.rope(attn.k_norm(attn.split_heads(attn.k_proj(x), kv)), offset=anchors)
    v = attn.split_heads(attn.v_proj(x), kv)  # k, v: [N, kv, B, hd]
    q = (q * attn.scale).reshape(n, kv, rep * b, hd)  # query head h uses kv head h // rep

    folded = q.reshape(n, kv, rep, b, hd).transpose(1, 2, 0, 3, 4).reshape(kv, rep * n * b, hd)
    context_scores = (folded @ context_keys.swapaxes(-1, -2)).reshape(kv, rep, n, b, seq_len)
    block_scores = (q @ k.swapaxes(-1, -2)).reshape(n, kv, rep, b, b)
    scores = mx.concatenate([context_scores.transpose(2, 0, 1, 3, 4), block_scores], axis=-1)
    scores = mx.where(mask[:, :, None], scores, mx.finfo(scores.dtype).min)
    # [N, kv, rep, B, S + B]; on the CPU backend on a vectorised exp (MLX's goes one at a time)
    if attn.cpu_kernels:
        probs = cpu_kernels.softmax(scores)
    else:
        probs = mx.softmax(scores, axis=-1, precise=True)

    context_probs = probs[..., :seq_len].transpose(1, 2, 0, 3, 4).reshape(kv, rep * n * b, seq_len)
    out = (context_probs @ context_values).reshape(kv, rep, n, b, hd).transpose(2, 0, 1, 3, 4)
    block_probs = probs[..., seq_len:].reshape(n, kv, rep * b, b)
    out = out + (block_probs @ v).reshape(n, kv, rep, b, hd)
    out = out.reshape(n, attn.n_heads, b, hd).transpose(0, 2, 1, 3).reshape(n, b, -1)
    return attn.o_proj(out)


def block_logits(
    model: DFlashDraftModel,
    target: TargetAdapter,
    features: mx.array,
    blocks: BlockBatch,
    head: DraftHead | None = None,
) -> mx.array:
    """Float32 logits [N, B-1, V] of rows 1..B-1 of every block (row 0 is the anchor);
    with a draft `head`, over its K rows instead of V."""
    dtype = model.norm.weight.dtype
    embeddings = mx.stop_gradient(target.embed(mx.array(blocks.block_ids))).astype(dtype)
    seq_len = features.shape[1]
    mask = mx.array(block_row_mask(seq_len, blocks.anchors, blocks.block_ids.shape[1]))
    anchors = mx.array(blocks.anchors, dtype=mx.int32)
    hidden = block_hidden_states(model, features, embeddings, anchors, mask)
    if head is not None:
        return head(hidden[:, 1:]).astype(mx.float32)
    return target.unembed(hidden[:, 1:]).astype(mx.float32)


def restrict_labels(blocks: BlockBatch, head: DraftHead) -> BlockBatch:
    """Labels as draft-vocabulary indices; a label outside the vocabulary weighs nothing
    (the drafter cannot propose it, so there is nothing to learn there)."""
    index = head.index_of[blocks.labels]
    weights = np.where(index >= 0, blocks.weights, 0.0).astype(np.float32)
    return BlockBatch(blocks.block_ids, blocks.anchors, np.maximum(index, 0), weights)


def block_loss(
    model: DFlashDraftModel,
    target: TargetAdapter,
    features: mx.array,
    blocks: BlockBatch,
    head: DraftHead | None = None,
) -> tuple[mx.array, mx.array]:
    """Weighted cross-entropy ``sum(w*CE)/sum(w)`` and weighted argmax accuracy (with a
    draft `head`, `blocks` carries `restrict_labels` labels)."""
    logits = block_logits(model, target, features, blocks, head)
    labels = mx.array(blocks.labels)
    weights = mx.array(blocks.weights)
    total = mx.maximum(weights.sum(), 1e-9)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    loss = (ce * weights).sum() / total
    hits = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
    return loss, mx.stop_gradient((hits * weights).sum() / total)


# =================================================================== data
@dataclass
class TrainSequence:
    tokens: np.ndarray  # [S] int32, prompt + continuation
    prompt_tokens: int  # how many leading tokens are the prompt
    shared_prefix: int = 0  # leading tokens shared with its group (`shared_prefix_lengths`)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a text file (one per line) or JSONL (``{"prompt": ...}`` or strings)."""
    path = Path(path)
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            item = json.loads(line)
            line = item if isinstance(item, str) else item.get("prompt", item.get("text"))
        prompts.append(line)
    return prompts


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool = True) -> list[int]:
    """Token ids of a prompt, wrapped in the chat template when the tokenizer has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def read_jsonl_records(path: Path) -> list[dict[str, Any]]:
    """Complete records of a JSONL file; a torn last line (interrupted write) is cut off."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def generate_data(
    target: TargetAdapter,
    tokenizer: Any,
    prompts: list[str],
    out_path: str | Path,
    max_tokens: int = 256,
    chat_template: bool = True,
) -> int:
    """Append the target's greedy continuation of each prompt to `out_path` (JSONL).

    Records are ``{"prompt", "prompt_tokens", "tokens"}`` with tokens = prompt + continuation.
    Prompts already in the file are skipped, so an interrupted run just continues. Returns the
    number of records written by this call.
    """
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {record["prompt"] for record in read_jsonl_records(out_path)}
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with out_path.open("a") as out:
        for prompt in _progress(todo, desc="generating", enabled=True):
            ids = encode_prompt(tokenizer, prompt, chat_template)
            result = generate(target, ids, params, tokenizer=tokenizer)
            record = {"prompt": prompt, "prompt_tokens": len(ids), "tokens": ids + result.token_ids}
            out.write(json.dumps(record) + "\n")
            out.flush()
    return len(todo)


def load_sequences(path: str | Path, max_len: int | None = None) -> list[TrainSequence]:
    """Training sequences from a `generate_data` JSONL file, truncated to `max_len`."""
    sequences = []
    for record in read_jsonl_records(Path(path)):
        tokens = np.asarray(record["tokens"][:max_len], dtype=np.int32)
        sequences.append(TrainSequence(tokens, int(record.get("prompt_tokens", 0))))
    return sequences


# =================================================================== checkpoints
def save_checkpoint(
    model: DFlashDraftModel,
    optimizer: optim.Optimizer,
    step: int,
    config: TrainConfig,
    draft_vocab: np.ndarray | None = None,
) -> None:
    """Drafter (z-lab layout, with its draft vocabulary), optimizer state and step counter
    into `config.out_dir`.

    Files are written under temporary names and renamed; the step file goes last, so a crash
    mid-save leaves the previous checkpoint's step (resume then redoes a few steps at most).
    """
    out = Path(config.out_dir)
    staging = out / ".staging"
    save_dflash_model(model, staging, draft_vocab=draft_vocab)
    for directory in (staging, out):
        (directory / STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(staging / OPTIMIZER_FILE), dict(tree_flatten(optimizer.state)))
    state = {"step": step, "seed": config.seed, "config": asdict(config)}
    (staging / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
    for name in ("config.json", "model.safetensors", OPTIMIZER_FILE, STATE_FILE):
        os.replace(staging / name, out / name)
    shutil.rmtree(staging)


def has_checkpoint(out_dir: str | Path) -> bool:
    return (Path(out_dir) / STATE_FILE).is_file()


def load_checkpoint(
    out_dir: str | Path, optimizer: optim.Optimizer
) -> tuple[DFlashDraftModel, int]:
    """The drafter and step of a checkpoint; the optimizer gets its saved state."""
    out = Path(out_dir)
    model = load_dflash_model(out)
    optimizer.state = tree_unflatten(list(mx.load(str(out / OPTIMIZER_FILE)).items()))
    step = int(json.loads((out / STATE_FILE).read_text())["step"])
    return model, step


# =================================================================== training loop
def make_optimizer(config: TrainConfig) -> optim.AdamW:
    """AdamW on linear warmup to `lr`, then cosine decay to 0 over the remaining steps."""
    warmup = max(1, round(config.warmup_fraction * config.steps))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(0.0, config.lr, warmup),
            optim.cosine_decay(config.lr, max(1, config.steps - warmup)),
        ],
        [warmup],
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=config.weight_decay)


def micro_step_data(
    sequences: list[TrainSequence], micro_step: int, config: TrainConfig
) -> tuple[int, np.random.Generator]:
    """The sequence index and anchor RNG of a global micro-step: a fresh shuffle every epoch,
    derived from the seed alone so a resumed run sees the same stream."""
    epoch, index = divmod(micro_step, len(sequences))
    order = np.random.default_rng([config.seed, epoch]).permutation(len(sequences))
    return int(order[index]), np.random.default_rng([config.seed, epoch, micro_step])


class FeatureCache:
    """The frozen target's features per sequence, kept up to a byte budget.

    The target never changes during training, so an epoch after the first would recompute
    exactly the same features; on the bundled pair that forward is ~20% of a micro-step.
    Sequences past the budget are recomputed every time (big targets, long sequences).
    """

    def __init__(self, target: TargetAdapter, budget_bytes: int) -> None:
        self.target, self.budget, self.used = target, budget_bytes, 0
        self._features: dict[int, mx.array] = {}

    def get(self, index: int, tokens: np.ndarray) -> mx.array:
        cached = self._features.get(index)
        if cached is not None:
            return cached
        features = target_features(self.target, tokens)
        if self.used + features.nbytes <= self.budget:
            self._features[index] = features
            self.used += features.nbytes
        return features


@dataclass
class TrainResult:
    model: DFlashDraftModel
    step: int  # optimizer steps done (including any before a resume)
    history: list[tuple[int, float, float]] = field(default_factory=list)  # step, loss, acc


def use_cpu_kernels(target: TargetAdapter | None, model: DFlashDraftModel | None) -> None:
    """On the CPU backend, the target's feature forwards and the drafter's training step run
    attention and SwiGLU on `engine.backend.cpu_kernels` (a vectorised exp; same values to
    float32 rounding): MLX's exp there goes one element at a time. Elsewhere, nothing."""
    if not cpu_kernels.wanted():
        return
    if target is not None and not target.cpu_kernels:
        reason = target.use_cpu_kernels()
        if reason:
            log.info("target keeps MLX's attention: %s", reason)
    if model is not None:
        model.use_cpu_kernels()


def train(
    target: TargetAdapter,
    sequences: list[TrainSequence],
    config: TrainConfig,
    drafter_config: DFlashConfig | None = None,
) -> TrainResult:
    """Train (or, with `config.resume` and a checkpoint in `out_dir`, continue) a drafter.

    The target must be tapped at the drafter's `target_layer_ids`; it stays frozen (its
    weights are not part of the differentiated model).
    """
    optimizer = make_optimizer(config)
    if config.resume and has_checkpoint(config.out_dir):
        model, start = load_checkpoint(config.out_dir, optimizer)
        log.info("resuming from %s at step %d", config.out_dir, start)
    elif drafter_config is None:
        raise ValueError(f"no checkpoint to resume in {config.out_dir} and no drafter config")
    else:
        model, start = init_drafter(drafter_config, config.seed), 0
    if target.layer_ids != model.config.target_layer_ids:
        raise ValueError(
            f"target is tapped at {target.layer_ids}, drafter needs {model.config.target_layer_ids}"
        )
    sequences = _usable(sequences, config)
    if not sequences:
        raise ValueError("no training sequence has a label to predict")
    use_cpu_kernels(target, model)
    block_size = model.config.block_size
    gamma = config.gamma or default_gamma(block_size)
    draft_vocab = training_draft_vocab(config, sequences, target.vocab_size)
    head = DraftHead(target, draft_vocab) if draft_vocab is not None else None
    value_and_grad = nn.value_and_grad(model, lambda f, b: block_loss(model, target, f, b, head))

    features_of: FeatureCache | FeatureStore
    if config.feature_store_dir:
        tokens = [s.tokens for s in sequences]
        features_of = FeatureStore.build(target, tokens, Path(config.feature_store_dir),
                                         target_name=target.model_type)  # fmt: skip
    else:
        features_of = FeatureCache(target, config.feature_cache_mb << 20)
    result = TrainResult(model, start)
    bar = _progress(range(start, config.steps), desc="training", enabled=config.progress)
    for step in bar:
        grads_sum, losses, accs = None, [], []
        for k in range(config.batch_size):
            index, rng = micro_step_data(sequences, step * config.batch_size + k, config)
            sequence = sequences[index]
            first = 0 if config.train_on_prompt else sequence.prompt_tokens - 1
            anchors = sample_anchors(len(sequence.tokens), config.num_anchors, rng, first)
            blocks = make_blocks(
                sequence.tokens, anchors, block_size, model.config.mask_token_id, gamma
            )
            if head is not None:
                blocks = restrict_labels(blocks, head)
            features = features_of.get(index, sequence.tokens)
            (loss, acc), grads = value_and_grad(features, blocks)
            grads_sum = grads if grads_sum is None else tree_map(mx.add, grads_sum, grads)
            mx.eval(grads_sum, loss, acc)
            losses.append(loss.item())
            accs.append(acc.item())
        grads = tree_map(lambda g: g / config.batch_size, grads_sum)
        grads, _ = optim.clip_grad_norm(grads, config.grad_clip)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
        result.step = step + 1
        result.history.append((step + 1, float(np.mean(losses)), float(np.mean(accs))))
        _report(bar, result, optimizer, config)
        if _checkpoint_due(result.step, config):
            save_checkpoint(model, optimizer, result.step, config, draft_vocab)
    if not (result.step > start and _checkpoint_due(result.step, config)):
        # the final state, always kept
        save_checkpoint(model, optimizer, result.step, config, draft_vocab)
    return result


def training_draft_vocab(
    config: TrainConfig, sequences: list[TrainSequence], vocab_size: int
) -> np.ndarray | None:
    """The draft vocabulary a run trains over: the checkpoint's when resuming one that has
    it (once chosen, it stays), else one chosen from the data when `draft_vocab_size` asks
    for it (a run begun over the full head may switch once), else None (the full head)."""
    if config.resume and has_checkpoint(config.out_dir):
        stored = read_draft_vocab(config.out_dir)
        if stored is not None:
            return stored
    if config.draft_vocab_size <= 0 or config.draft_vocab_size >= vocab_size:
        return None
    return choose_draft_vocab((s.tokens for s in sequences), config.draft_vocab_size, vocab_size)


def _checkpoint_due(step: int, config: TrainConfig) -> bool:
    return bool(config.checkpoint_every) and step % config.checkpoint_every == 0


def evaluate_loss(
    model: DFlashDraftModel,
    target: TargetAdapter,
    sequences: list[TrainSequence],
    gamma: float | None = None,
    train_on_prompt: bool = False,
) -> tuple[float, float]:
    """Deterministic loss and accuracy with *every* anchor candidate (weighted by labels)."""
    block_size = model.config.block_size
    gamma = gamma or default_gamma(block_size)
    loss_sum = acc_sum = weight_sum = 0.0
    for sequence in sequences:
        first = 0 if train_on_prompt else sequence.prompt_tokens - 1
        anchors = np.arange(max(first, 0), len(sequence.tokens) - 1)
        if len(anchors) == 0:
            continue
        blocks = make_blocks(
            sequence.tokens, anchors, block_size, model.config.mask_token_id, gamma
        )
        loss, acc = block_loss(model, target, target_features(target, sequence.tokens), blocks)
        weight = float(blocks.weights.sum())
        loss_sum += loss.item() * weight
        acc_sum += acc.item() * weight
        weight_sum += weight
    return loss_sum / weight_sum, acc_sum / weight_sum


def _usable(sequences: list[TrainSequence], config: TrainConfig) -> list[TrainSequence]:
    """Sequences with at least one anchor candidate (a label after the prompt)."""
    first = (lambda s: 0) if config.train_on_prompt else (lambda s: max(s.prompt_tokens - 1, 0))
    return [s for s in sequences if len(s.tokens) - 1 > first(s)]


def _progress(items: Iterable, desc: str, enabled: bool) -> Iterable:
    """A tqdm bar when tqdm is installed (it is not a dependency), else the plain iterable."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(items, desc=desc, dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            pass
    return items


def _report(bar: Any, result: TrainResult, optimizer: optim.Optimizer, config: TrainConfig) -> None:
    step, loss, acc = result.history[-1]
    lr = float(optimizer.learning_rate.item())
    if hasattr(bar, "set_postfix"):
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", lr=f"{lr:.2e}")
    elif config.log_every and (step % config.log_every == 0 or step == config.steps):
        print(f"step {step}/{config.steps} loss {loss:.4f} acc {acc:.3f} lr {lr:.2e}", flush=True)


# =================================================================== evaluation
@dataclass
class EvalResult:
    tau: float  # mean tokens committed per verify step, over all prompts
    steps: int
    committed: int
    per_prompt: list[float]


def evaluate_tau(
    target_dir: str | Path,
    drafter_dir: str | Path,
    prompts: list[str],
    max_tokens: int = 128,
    chat_template: bool = True,
) -> EvalResult:
    """Greedy speculative decoding of held-out prompts with a saved drafter.

    Loads a separate copy of the drafter (`DFlashDrafter` fuses the context projections of the
    model it is given, which training weights must not carry).
    """
    from engine.models.loading import load_pair
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

    pair = load_pair(target_dir, drafter_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    steps = committed = 0
    per_prompt = []
    for prompt in _progress(prompts, desc="evaluating", enabled=True):
        ids = encode_prompt(pair.tokenizer, prompt, chat_template)
        result = generate(pair.target, ids, params, drafter=pair.drafter, tokenizer=pair.tokenizer)
        steps += len(result.steps)
        committed += sum(s.committed for s in result.steps)
        per_prompt.append(result.tau)
    return EvalResult(committed / steps if steps else math.nan, steps, committed, per_prompt)


# =================================================================== CLI entry points
def run_data(
    target_dir: str, prompts_file: str, out: str, max_tokens: int, chat_template: bool
) -> int:
    from engine.models.loading import load_target_model

    model, tokenizer = load_target_model(target_dir)
    written = generate_data(
        TargetAdapter(model, []),
        tokenizer,
        read_prompts(prompts_file),
        out,
        max_tokens,
        chat_template,
    )
    print(f"wrote {written} sequences to {out}")
    return 0


def run_fit(
    target_dir: str,
    data: str,
    config: TrainConfig,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
) -> TrainResult:
    from engine.models.loading import load_target_model
    from engine.models.resolve import resolve_target

    target_dir = resolve_target(target_dir)  # a .gguf file or a name: its converted directory
    model, _ = load_target_model(target_dir)
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    if config.resume and has_checkpoint(config.out_dir):
        from drafters.dflash.checkpoint import read_config

        drafter_config = read_config(config.out_dir)
    else:
        drafter_config = drafter_config_for_target(
            raw, num_layers=num_layers, block_size=block_size,
            target_layer_ids=target_layer_ids, mask_token_id=mask_token_id,
        )  # fmt: skip
    target = TargetAdapter(model, drafter_config.target_layer_ids)
    result = train(target, load_sequences(data, config.max_len), config, drafter_config)
    if result.history:
        _, loss, acc = result.history[-1]
        print(f"step {result.step}: loss {loss:.4f} acc {acc:.3f}; saved to {config.out_dir}")
    return result


def run_eval(
    target_dir: str, drafter_dir: str, prompts_file: str, max_tokens: int, chat_template: bool
) -> int:
    result = evaluate_tau(
        target_dir, drafter_dir, read_prompts(prompts_file), max_tokens, chat_template
    )
    print(f"tau {result.tau:.3f} over {result.steps} verify steps ({result.committed} tokens)")
    return 0
