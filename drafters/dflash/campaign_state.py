"""What a campaign keeps in the repository: its recipe, its data cursor, its state and the
checkpoint files, written so that a crash mid-save leaves the previous state.

`training/state.json` holds `State` (optimizer steps, labels seen, the cursor and the recipe);
`training/sittings.json` holds the sittings log, which only grows. The weights are the
drafter's own in bfloat16 (z-lab layout). `drafters.dflash.campaign` trains with these;
`drafters.dflash.keep_gate`, `card` and `evalset` read them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from drafters.dflash.checkpoint import load_dflash_model
from drafters.dflash.model import DFlashDraftModel
from drafters.dflash.vocab import D2T_KEY, read_draft_vocab, to_d2t

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET = "smollm2-135m-instruct"
DEFAULT_DRAFTER_DIR = REPO_ROOT / "engine" / "models" / "smollm2_drafter"
CACHE_ROOT = Path.home() / ".cache" / "flashbatch" / "campaign"
SIDECAR_DIR = "sidecar"  # under a target's cache folder (`sidecar_dir`)
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "draft_vocab.safetensors"
STATE_FILE = "training/state.json"
SITTINGS_FILE = "training/sittings.json"


def sidecar_dir(target: str, cache_root: Path = CACHE_ROOT) -> Path:
    """Where data generation keeps records' features for the campaign's feature pass
    (`features.FeatureSidecar`): derived data, recomputed by that pass wherever it is lost."""
    return cache_root / Path(target).name / SIDECAR_DIR


# =================================================================== recipe and cursor
@dataclass
class Recipe:
    """Everything that decides what a sitting trains; stored in state.json, kept on resume."""

    layers: int = 2
    block_size: int = 8
    mask_token_id: int = 16  # `<empty_output>`: the last vocabulary row is an ordinary word
    draft_vocab: int = 16384
    num_anchors: int = 64  # blocks per sequence
    batch_size: int = 4  # sequences per optimizer step
    max_len: int = 768
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 100  # from initialisation
    rewarm_steps: int = 50  # after every resume (fresh AdamW moments)
    horizon_steps: int = 20000  # cosine decay to min_lr_fraction over this many steps
    min_lr_fraction: float = 0.1
    shard_records: int = 512
    passes_per_shard: int = 3
    top_k: int = 8  # target top-k kept by the feature pass (~50 bytes a token)
    candidates: bool = False  # lever (i): candidate-set loss
    negatives: int = 256  # shared sampled negatives of the candidate set
    distill: float = 0.0  # lever (ii): weight of KL(target top-k || drafter)
    warm_start: bool = False  # lever (iii): drafter layers from the target's top layers
    gamma: float = 0.0  # block row j's loss weight exp(-(j-1)/gamma); 0: the paper's for the block
    ema: float = 0.0  # weight averaging: ship/measure avg <- ema*avg + (1-ema)*w each step; 0: off
    # lever (iv): anchors in the prompts too, labelled by the target's own argmax chain
    prompt_anchors: bool = False
    # lever (v): rows of a training block (anchor + masks); 0: block_size. Inference truncates
    # the block to the draft depth, so a short block is what a depth-3 draft runs, and it
    # buys more anchors for the same rows. The model keeps block_size (deeper drafts work).
    train_block: int = 0
    seed: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Recipe:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


# What a resumed campaign may change (`run --lr ...`): how it optimises. The rest fixes the model
# (layers, block size, draft vocabulary, mask token), the data cut (shards, max_len, top-k) or
# the schedule's shape, and is kept from the campaign's start.
RETUNABLE = ("lr", "gamma", "ema", "num_anchors", "batch_size", "passes_per_shard",
             "negatives", "distill", "candidates", "prompt_anchors", "train_block")  # fmt: skip


@dataclass
class Cursor:
    """Where the data stream stands: records `position` onward of pass `pass_` over shard
    `shard` are next; `wraps` counts the times the whole corpus was used up."""

    shard: int = 0
    pass_: int = 0
    position: int = 0
    wraps: int = 0
    return_to: int = -1  # on a detour over fresh shards: the shard to go back to (-1: none)

    def visit_fresh(self, shard: int, now: bool = False) -> None:
        """Go to the start of `shard`, which holds records no sitting has trained, and on from
        it to the corpus's end; then back to the start of the shard the cursor was on (a shard
        left half done is trained again: simpler than keeping its place, and cheap). Where
        `shard` comes next anyway (the first trip round the corpus), the cursor stays, unless
        `now` (it must not finish the shard it is on first)."""
        if shard == self.shard or (shard == self.shard + 1 and not now):
            return
        if self.return_to < 0:
            self.return_to = self.shard
        self.shard, self.pass_, self.position = shard, 0, 0

    def advance(self, records: int, shard_size: int, num_shards: int, passes: int) -> bool:
        """Move past `records` records of a shard of `shard_size`; True when the shard changed
        (the pass is done and it was the last pass over this shard)."""
        self.position += records
        if self.position < shard_size:
            return False
        self.position = 0
        self.pass_ += 1
        if self.pass_ < passes:
            return False
        self.pass_ = 0
        self.shard += 1
        if self.return_to >= 0 and self.shard >= num_shards:  # the detour is over
            self.shard, self.return_to = self.return_to, -1
        elif self.shard >= num_shards:
            self.shard = 0
            self.wraps += 1
        return True

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Cursor:
        return cls(**{k: int(v) for k, v in raw.items() if k in {f.name for f in fields(cls)}})


@dataclass
class State:
    """`training/state.json`: all a resume needs besides the weights."""

    recipe: Recipe = field(default_factory=Recipe)
    step: int = 0  # optimizer steps, all sittings
    labels_seen: int = 0  # weighted block rows with a label, all sittings
    sequences_seen: int = 0
    cursor: Cursor = field(default_factory=Cursor)
    # train records (in corpus order) that some sitting has started training on; records past
    # it are fresh. None: a state from before this was kept (`records_reached_before`).
    records_reached: int | None = None
    heldout: dict[str, Any] | None = None  # last held-out loss/acc and its step
    eval: dict[str, Any] | None = None  # last accepted tau eval
    saved_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["schedule"] = {
            "step": self.step,
            "horizon_steps": self.recipe.horizon_steps,
            "lr_after_warmup": learning_rate(self.recipe, self.step, 10**9),
        }
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> State:
        return cls(
            recipe=Recipe.from_dict(raw.get("recipe", {})),
            step=int(raw.get("step", 0)),
            labels_seen=int(raw.get("labels_seen", 0)),
            sequences_seen=int(raw.get("sequences_seen", 0)),
            cursor=Cursor.from_dict(raw.get("cursor", {})),
            records_reached=raw.get("records_reached"),
            heldout=raw.get("heldout"),
            eval=raw.get("eval"),
            saved_at=raw.get("saved_at", ""),
        )


def learning_rate(recipe: Recipe, step: int, sitting_step: int, resumed: bool = False) -> float:
    """Warmup (a short re-warm after a resume: AdamW starts without moments), then cosine decay
    over the campaign's horizon by the global step, down to `min_lr_fraction`."""
    warm = recipe.rewarm_steps if resumed else recipe.warmup_steps
    ramp = min(1.0, (sitting_step + 1) / max(1, warm))
    progress = min(1.0, step / max(1, recipe.horizon_steps))
    floor = recipe.min_lr_fraction
    return recipe.lr * ramp * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


# =================================================================== repository checkpoint
def has_state(directory: Path) -> bool:
    return (directory / STATE_FILE).is_file()


def read_state(directory: Path) -> State:
    return State.from_dict(json.loads((directory / STATE_FILE).read_text()))


def read_sittings(directory: Path) -> list[dict[str, Any]]:
    path = directory / SITTINGS_FILE
    return json.loads(path.read_text()) if path.exists() else []


def _replace(path: Path, write: Any) -> None:
    """Write `path` through a temporary file in the same directory and rename it over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are package data
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_json(path: Path, value: Any) -> None:
    _replace(path, lambda p: p.write_text(json.dumps(value, indent=1) + "\n"))


def save_checkpoint(
    directory: Path,
    model: DFlashDraftModel,
    state: State,
    draft_vocab: np.ndarray | None,
    sittings: list[dict[str, Any]],
    weights: dict[str, mx.array] | None = None,
) -> None:
    """The drafter (bf16, z-lab layout; `weights`, e.g. the average, instead of the model's
    own) and its training state, each file renamed into place, weights first, `state.json` last."""
    config = model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    flat = weights if weights is not None else dict(tree_flatten(model.parameters()))
    weights = {k: v.astype(mx.bfloat16) for k, v in flat.items()}
    _replace(
        directory / "config.json",
        lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
    )
    _replace(directory / WEIGHTS_FILE, lambda p: _save_tensors(p, weights))
    vocab_path = directory / VOCAB_FILE
    if draft_vocab is not None and not vocab_path.exists():
        _replace(vocab_path, lambda p: _save_tensors(p, {D2T_KEY: to_d2t(draft_vocab)}))
    state.saved_at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    write_json(directory / SITTINGS_FILE, sittings)
    write_json(directory / STATE_FILE, state.to_dict())


def _save_tensors(path: Path, tensors: dict[str, mx.array]) -> None:
    # mx.save_safetensors insists on a ".safetensors" name; stage it in a subdirectory, where
    # a drafter loader (every top-level *.safetensors) never sees a half-written file.
    staging = path.parent / "training" / ".staging"
    staging.mkdir(parents=True, exist_ok=True)
    staged = staging / (path.name + ".safetensors")
    mx.save_safetensors(str(staged), tensors, metadata={"format": "mlx"})
    os.replace(staged, path)


def load_checkpoint(directory: Path) -> tuple[DFlashDraftModel, State, np.ndarray | None]:
    """The drafter (float32, for training), its state and its draft vocabulary."""
    model = load_dflash_model(directory, dtype=mx.float32)
    return model, read_state(directory), read_draft_vocab(directory)


def log_entry(stage: str, command: str, state: State) -> dict[str, Any]:
    """The fields every non-sitting entry of the sittings log starts with."""
    return {
        "stage": stage,
        "command": command,
        "at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "step": state.step,
        "labels_seen": state.labels_seen,
    }
