"""Stages 1-3 of the bundled model pair's build: corpus split, tokenizer, target pretraining.

The corpus is the Python standard library of the running interpreter (code and docstrings; every
machine has it). Files are split into train and held-out by a hash of their relative path, so the
split is stable across machines. Each stage writes into a work directory and resumes from what
is there, so a multi-hour build can span several sittings.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HELD_OUT_PERCENT = 5


# ----------------------------------------------------------------------------- corpus
def stdlib_files(root: Path | None = None) -> list[Path]:
    """Python sources of the standard library, without tests and third-party packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def is_held_out(relative_path: str) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def split_corpus(work: Path, root: Path | None = None) -> dict[str, list[str]]:
    """Write `corpus.json`: the stdlib root and its train / held-out file lists."""
    out = work / "corpus.json"
    if out.exists():
        return json.loads(out.read_text())
    root = Path(root or sysconfig.get_paths()["stdlib"])
    relative = [str(p.relative_to(root)) for p in stdlib_files(root)]
    split = {
        "root": str(root),
        "train": [r for r in relative if not is_held_out(r)],
        "held_out": [r for r in relative if is_held_out(r)],
    }
    work.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(split, indent=1))
    return split


def read_files(split: dict, which: str) -> list[str]:
    root = Path(split["root"])
    return [(root / r).read_text(encoding="utf-8", errors="replace") for r in split[which]]


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(work: Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer saved in Hugging Face format under `work/tokenizer`."""
    out = work / "tokenizer"
    if not (out / "tokenizer.json").exists():
        build_bpe_tokenizer(read_files(split_corpus(work), "train"), vocab_size, out)
    return out


def build_bpe_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    """Train a byte-level BPE tokenizer on `texts` and save it where `mlx_lm.load` finds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(out))


def tokenize_corpus(work: Path) -> np.ndarray:
    """All training files as one uint16 token stream, files separated by <|endoftext|>."""
    out = work / "train_tokens.npy"
    if out.exists():
        return np.load(out)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for encoding in tok.encode_batch(read_files(split_corpus(work), "train")):
        stream.extend(encoding.ids)
        stream.append(eos)
    tokens = np.asarray(stream, dtype=np.uint16)
    np.save(out, tokens)
    return tokens


# ----------------------------------------------------------------------------- pretraining
@dataclass
class TargetSize:
    hidden_size: int = 384
    num_hidden_layers: int = 8
    intermediate_size: int = 1024
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096


@dataclass
class PretrainConfig:
    steps: int = 1000  # 4.1M tokens (~1.3 epochs of the stdlib), about 1.6 h on 2 cores
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 1e-3
    warmup_fraction: float = 0.04
    weight_decay: float = 0.1
    seed: int = 0
    checkpoint_every: int = 100


def target_config(size: TargetSize, vocab_size: int, eos_token_id: int) -> dict:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **asdict(size),
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "tie_word_embeddings": True,
        "eos_token_id": eos_token_id,
    }


def _schedule(config: PretrainConfig):
    warmup = max(1, int(config.steps * config.warmup_fraction))
    return optim.join_schedules(
        [
            optim.linear_schedule(config.learning_rate * 0.01, config.learning_rate, warmup),
            optim.cosine_decay(
                config.learning_rate, config.steps - warmup, config.learning_rate * 0.1
            ),
        ],
        [warmup],
    )


def pretrain_target(work: Path, size: TargetSize, config: PretrainConfig, log=print) -> Path:
    """Train a Qwen3 target on the token stream; checkpoints in `work/pretrain` and resumes."""
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model

    tokens = tokenize_corpus(work)
    tokenizer_dir = work / "tokenizer"
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    model_config = target_config(size, len(vocab), vocab["<|endoftext|>"])
    ckpt = work / "pretrain"
    ckpt.mkdir(parents=True, exist_ok=True)

    mx.random.seed(config.seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(model_config))
    optimizer = optim.AdamW(learning_rate=_schedule(config), weight_decay=config.weight_decay)
    start_step = 0
    state_file = ckpt / "state.json"
    if state_file.exists():
        state = json.loads(state_file.read_text())
        start_step = state["step"]
        model.load_weights(str(ckpt / "model.safetensors"))
        optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
        log(f"resuming target pretraining at step {start_step}/{config.steps}")
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"target: {n_params / 1e6:.1f}M parameters, {len(tokens) / 1e6:.2f}M training tokens")

    def loss_fn(model, inputs, labels):
        logits = model(inputs)
        return nn.losses.cross_entropy(logits, labels).mean()

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def save(step: int, losses: list[float]) -> None:
        save_model(ckpt, model)
        mx.save_safetensors(
            str(ckpt / "optimizer.safetensors"), dict(tree_flatten(optimizer.state))
        )
        history = json.loads(state_file.read_text())["history"] if state_file.exists() else []
        history.append({"step": step, "loss": float(np.mean(losses)) if losses else None})
        rate = (step - start_step) * config.batch_size * config.seq_len
        rate /= max(1e-9, time.perf_counter() - started)
        state = {"step": step, "config": asdict(config), "history": history}
        state_file.write_text(json.dumps({**state, "tokens_per_second": rate}))
        save_config(model_config, ckpt / "config.json")

    losses: list[float] = []
    started = time.perf_counter()
    for step in range(start_step, config.steps):
        rng = np.random.default_rng([config.seed, step])  # resumable without saved RNG state
        offsets = rng.integers(0, len(tokens) - config.seq_len - 1, config.batch_size)
        window = np.stack([tokens[o : o + config.seq_len + 1] for o in offsets]).astype(np.int32)
        batch = mx.array(window)
        loss, grads = loss_and_grad(model, batch[:, :-1], batch[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        losses.append(loss.item())
        done = step + 1
        if done % 10 == 0 or done == config.steps:
            rate = (done - start_step) * config.batch_size * config.seq_len
            rate /= time.perf_counter() - started
            log(f"step {done}/{config.steps} loss {np.mean(losses[-10:]):.3f} ({rate:.0f} tok/s)")
        if done % config.checkpoint_every == 0 or done == config.steps:
            save(done, losses[-config.checkpoint_every :])
    return ckpt


def held_out_loss(model: nn.Module, tokens: np.ndarray, seq_len: int = 256, n: int = 32) -> float:
    """Mean next-token cross entropy on `n` windows of a held-out token stream."""
    rng = np.random.default_rng(1234)
    offsets = rng.integers(0, len(tokens) - seq_len - 1, n)
    batch = mx.array(np.stack([tokens[o : o + seq_len + 1] for o in offsets]).astype(np.int32))
    loss = nn.losses.cross_entropy(model(batch[:, :-1]), batch[:, 1:]).mean()
    return float(loss.item()) if math.isfinite(loss.item()) else float("nan")
