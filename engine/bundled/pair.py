"""Stages 4-7 of the bundled pair's build: export the target, drafter data from the target
itself (batched through the engine), drafter training, export and evaluation.

The exported weights are stored in bfloat16 (half the bytes of float32; CPUs compute in float32
after loading) and sharded so no file is large.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from itertools import zip_longest
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.bundled.pretrain import read_files, split_corpus
from engine.bundled.workloads import build_workloads

PACKAGE_DIR = Path(__file__).parent
BUNDLED_TARGET = PACKAGE_DIR / "target"
BUNDLED_DRAFTER = PACKAGE_DIR / "drafter"
MASK_TOKEN = "<|mask|>"
SHARD_BYTES = 12 << 20


def bundled_paths() -> tuple[Path, Path]:
    """Directories of the bundled target and drafter (they exist once the pair is built)."""
    return BUNDLED_TARGET, BUNDLED_DRAFTER


def save_sharded(weights: dict[str, mx.array], directory: Path, dtype: mx.Dtype) -> None:
    """Write `model-0000k-of-0000n.safetensors` shards of at most SHARD_BYTES each."""
    for old in directory.glob("model*.safetensors"):
        old.unlink()
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name, value in sorted(weights.items()):
        value = value.astype(dtype)
        if size and size + value.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(directory / name), shard, metadata={"format": "mlx"})


def export_target(work: Path, dest: Path = BUNDLED_TARGET) -> Path:
    """The pretrained target as an mlx-lm model directory with its tokenizer (bf16 storage)."""
    source = work / "pretrain"
    dest.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(source / "model.safetensors"))
    save_sharded(weights, dest, mx.bfloat16)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file in (work / "tokenizer").iterdir():
        shutil.copy(file, dest / file.name)
    return dest


# ----------------------------------------------------------------------------- drafter data
def data_prompts(work: Path, count: int, seed: int = 0, chars: int = 400) -> list[str]:
    """Prompts cut from the *training* files at random line starts."""
    texts = [t for t in read_files(split_corpus(work), "train") if len(t) > 2 * chars]
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        text = rng.choice(texts)
        start = text.rfind("\n", 0, rng.randrange(0, len(text) - chars)) + 1
        prompts.append(text[start : start + rng.randint(chars // 4, chars)])
    return prompts


def workload_data_prompts(work: Path, count: int, seed: int = 1) -> list[str]:
    """Prompts in the three workload formats, made from the *training* files.

    Random cuts (`data_prompts`) are 100-400 characters; the workloads' completion prompts run
    to ~300 tokens and their editing prompts repeat a function. A drafter trained on cuts alone
    never sees those context lengths (RoPE positions) or a target re-typing its context.
    Same makers as the held-out workloads, never the held-out files. The kinds alternate and
    each is a fixed shuffle, so a larger `count` extends the same list.
    """
    if count <= 0:
        return []
    sources = read_files(split_corpus(work), "train")
    kinds = list(build_workloads(sources, per_workload=count, seed=seed).values())
    mixed = [p for group in zip_longest(*kinds) for p in group if p is not None]
    return mixed[:count]


async def _generate_records(target_dir: Path, prompts: list[str], max_tokens: int, out, log):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.step.sampling import SamplingParams

    config = EngineConfig(target=str(target_dir), max_num_seqs=32, max_waiting_requests=10**6)
    started, produced = time.perf_counter(), 0
    async with AsyncEngine(config) as engine:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

        async def one(prompt: str) -> None:
            nonlocal produced
            prompt_ids = list(engine.tokenizer.encode(prompt))
            tokens: list[int] = []
            async for output in engine.generate(prompt_ids, params):
                tokens += output.token_ids
            record = {
                "prompt": prompt,
                "prompt_tokens": len(prompt_ids),
                "tokens": prompt_ids + tokens,
            }
            out.write(json.dumps(record) + "\n")
            produced += len(tokens)

        for i in range(0, len(prompts), 256):
            await asyncio.gather(*[one(p) for p in prompts[i : i + 256]])
            out.flush()
            rate = produced / (time.perf_counter() - started)
            log(f"data: {i + len(prompts[i : i + 256])}/{len(prompts)} prompts ({rate:.0f} tok/s)")


def generate_drafter_data(
    work: Path,
    target_dir: Path,
    count: int,
    workload_count: int = 0,
    max_tokens: int = 160,
    log=print,
) -> Path:
    """The target's own greedy continuations of training-file prompts (JSONL, resumable):
    `count` random cuts, then `workload_count` workload-format prompts."""
    out_path = work / "drafter_data.jsonl"
    done = {record["prompt"] for record in _records(work)}  # a torn last record is dropped
    prompts = data_prompts(work, count) + workload_data_prompts(work, workload_count)
    todo = [p for p in dict.fromkeys(prompts) if p not in done]
    if todo:
        with out_path.open("a") as out:
            asyncio.run(_generate_records(target_dir, todo, max_tokens, out, log))
    return out_path


def count_records(work: Path) -> int:
    """Complete records in the drafter data file (what a training run reads)."""
    return len(_records(work))


def _records(work: Path) -> list[dict]:
    """The drafter data file's complete records (a torn last line is cut off the file)."""
    from drafters.dflash.train import read_jsonl_records

    return read_jsonl_records(work / "drafter_data.jsonl")


# ----------------------------------------------------------------------------- drafter
def train_bundled_drafter(
    work: Path, target_dir: Path, steps: int, num_layers: int = 2, num_features: int = 3, log=print
):
    from drafters.dflash.train import TrainConfig, drafter_config_for_target, load_sequences, train
    from engine.models.loading import load_target_model
    from engine.step.target import TargetAdapter

    out_dir = work / "drafter"
    config = TrainConfig(
        steps=steps, batch_size=4, lr=1e-3, num_anchors=48, max_len=512,
        out_dir=str(out_dir), resume=True, checkpoint_every=50, progress=False, log_every=10,
        feature_cache_mb=8192,
    )  # fmt: skip
    raw = json.loads((target_dir / "config.json").read_text())
    vocab = json.loads((target_dir / "tokenizer.json").read_text())["model"]["vocab"]
    drafter_config = drafter_config_for_target(
        raw, num_layers=num_layers, block_size=16, num_features=num_features,
        mask_token_id=vocab[MASK_TOKEN],
    )  # fmt: skip
    model, _ = load_target_model(target_dir)
    target = TargetAdapter(model, drafter_config.target_layer_ids)
    sequences = load_sequences(work / "drafter_data.jsonl", config.max_len)
    log(f"drafter: {len(sequences)} sequences, {steps} steps of {config.batch_size}")
    return train(target, sequences, config, drafter_config)


def export_drafter(work: Path, dest: Path = BUNDLED_DRAFTER) -> Path:
    from drafters.dflash.checkpoint import load_dflash_model
    from drafters.dflash.vocab import D2T_KEY, read_draft_vocab, to_d2t

    model = load_dflash_model(work / "drafter")
    dest.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config["torch_dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = dict(tree_flatten(model.parameters()))
    save_sharded(weights, dest, mx.bfloat16)
    draft_vocab = read_draft_vocab(work / "drafter")
    vocab_file = dest / "draft_vocab.safetensors"
    vocab_file.unlink(missing_ok=True)
    if draft_vocab is not None:  # int64 offsets, kept exact in a file of their own
        mx.save_safetensors(str(vocab_file), {D2T_KEY: to_d2t(draft_vocab)})
    return dest


# ----------------------------------------------------------------------------- evaluation
def evaluate_pair(
    target_dir: Path, drafter_dir: Path, workloads: dict[str, list[str]], prompts: int = 12,
    max_tokens: int = 128, short_depth: int = 3, log=print,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Greedy, block 16, one request at a time: tau per workload, and tokens/s of speculative
    decoding against mlx-lm's plain `stream_generate` on the same target, interleaved.

    Also at a fixed `short_depth` (the drafter then runs `short_depth + 1` block rows): the
    operating point a CPU favours when tau is modest, since a 16-position verify is not free.
    """
    from mlx_lm import stream_generate

    from engine.models.loading import load_pair
    from engine.step.sampling import SamplingParams
    from engine.step.speculative import generate

    pair = load_pair(target_dir, drafter_dir)
    tokenizer = pair.tokenizer
    block = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    short = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=short_depth
    )
    results = {}
    for name, texts in workloads.items():
        spec, shallow = _SpecTally(), _SpecTally()
        plain_tokens, plain_time = 0, 0.0
        for text in texts[:prompts]:
            ids = list(tokenizer.encode(text))
            spec.run(generate, pair.target, ids, block, drafter=pair.drafter)
            shallow.run(generate, pair.target, ids, short, drafter=pair.drafter)
            started = time.perf_counter()
            n = 0
            for _ in stream_generate(pair.target.model, tokenizer, ids, max_tokens=max_tokens):
                n += 1
            plain_time += time.perf_counter() - started
            plain_tokens += n
        plain_rate = plain_tokens / plain_time
        results[name] = {
            "tau": spec.tau,
            "spec_tok_s": spec.rate,
            "mlx_lm_tok_s": plain_rate,
            "speedup": spec.rate / plain_rate,
            "short_depth": short_depth,
            "short_tau": shallow.tau,
            "short_tok_s": shallow.rate,
            "short_speedup": shallow.rate / plain_rate,
        }
        log(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[name].items()))
    return results


class _SpecTally:
    """Tokens, verify steps, committed tokens and seconds of speculative runs."""

    def __init__(self) -> None:
        self.tokens = self.steps = self.committed = 0
        self.seconds = 0.0

    def run(self, generate, *args, **kwargs) -> None:
        started = time.perf_counter()
        out = generate(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        self.tokens += len(out.token_ids)
        self.steps += len(out.steps)
        self.committed += sum(s.committed for s in out.steps)

    @property
    def tau(self) -> float:
        return self.committed / self.steps

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


# ----------------------------------------------------------------------------- model card
def held_out_target_loss(work: Path, target_dir: Path) -> float:
    """Next-token cross entropy of the exported target on the held-out stdlib files."""
    import numpy as np
    from tokenizers import Tokenizer

    from engine.bundled.pretrain import held_out_loss
    from engine.models.loading import load_target_model

    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for encoding in tok.encode_batch(read_files(split_corpus(work), "held_out")):
        stream += encoding.ids + [eos]
    model, _ = load_target_model(target_dir)
    return held_out_loss(model, np.asarray(stream, dtype=np.int32))


def write_model_card(work: Path, facts: dict, path: Path = PACKAGE_DIR / "MODEL_CARD.md") -> None:
    """MODEL_CARD.md beside the weights, from the build's recorded facts."""
    ev = facts["eval"]
    rows = "\n".join(
        f"| {name} | {r['tau']:.2f} | {r['spec_tok_s']:.1f} | {r['mlx_lm_tok_s']:.1f} | "
        f"{r['speedup']:.2f}x | {r['tau'] / r['speedup']:.1f} |"
        for name, r in ev.items()
    )
    step_cost = sum(r["tau"] / r["speedup"] for r in ev.values()) / len(ev)
    short_rows = "\n".join(
        f"| {name} | {r['short_tau']:.2f} | {r['short_tok_s']:.1f} | {r['short_speedup']:.2f}x |"
        for name, r in ev.items()
        if "short_tau" in r
    )
    paying = ", ".join(n for n, r in ev.items() if round(r["speedup"], 2) > 1) or "no workload here"
    short_depth = next(iter(ev.values())).get("short_depth", 0)
    short_table = (
        f"""
At depth {short_depth} (the drafter runs {short_depth + 1} block rows, the target verifies \
{short_depth + 1} positions), same prompts, same mlx-lm runs:

| workload | tau | speculative tok/s | speedup |
|---|---:|---:|---:|
{short_rows}
"""
        if short_rows
        else ""
    )
    hours = (facts["pretrain_minutes"] + facts["drafter_minutes"]) / 60
    drafter_commands = "\n".join(
        f"python -m engine.bundled.build --stages data,drafter --data-prompts "
        f"{run['data_prompts']}"
        + (
            f" --workload-data-prompts {run['workload_data_prompts']}"
            if run.get("workload_data_prompts")
            else ""
        )
        + f" --drafter-steps {run['steps']}"
        for run in facts["drafter_runs"]
    )
    last_run = facts["drafter_runs"][-1]
    workload_prompts = last_run.get("workload_data_prompts", 0)
    data_sources = (
        f"{facts['data_prompts'] - workload_prompts} random cuts of the training files and "
        f"{workload_prompts} prompts in the workloads' formats made from the training files "
        "(the random cuts are short; the workload formats carry the context lengths served)"
        if workload_prompts
        else f"{facts['data_prompts']} prompts cut from the training files"
    )
    text = f"""# flashbatch bundled model pair

A small Qwen3-architecture target and a DFlash drafter trained for it, built from scratch on
this machine kind (2-core x86_64 CPU, MLX CPU backend, float32 compute, OpenBLAS) by
`python -m engine.bundled.build`. They exist so that serving, tests and benchmarks run on a
fresh machine with no downloads, on a pair that behaves like a real one: a target that writes
Python-like text and a drafter that was really trained for it.

## Data

- Corpus: the Python standard library of the interpreter that ran the build
  ({facts["python"]}), `*.py` files without tests or site-packages: {facts["train_files"]}
  training files, {facts["held_out_files"]} held out (chosen by a hash of the relative path;
  the held-out files are never trained on and supply the workloads).
- Tokenizer: byte-level BPE, {facts["vocab_size"]} tokens, trained on the training files;
  special tokens `<|endoftext|>` (EOS), `<|im_start|>`, `<|im_end|>` (chat template),
  `<|mask|>` (the drafter's mask token). {facts["train_tokens"] / 1e6:.2f}M training tokens.

## Target (`target/`)

- Qwen3 architecture (mlx-lm `qwen3`): hidden {facts["target"]["hidden_size"]}, \
{facts["target"]["num_hidden_layers"]} layers, {facts["target"]["num_attention_heads"]} query / \
{facts["target"]["num_key_value_heads"]} KV heads of {facts["target"]["head_dim"]}, MLP \
{facts["target"]["intermediate_size"]}, tied embeddings; {facts["target_params"] / 1e6:.1f}M \
parameters; stored in bfloat16, computed in float32 on CPU.
- Pretraining: {facts["pretrain"]["steps"]} steps of {facts["pretrain"]["batch_size"]} x \
{facts["pretrain"]["seq_len"]} tokens ({facts["pretrain_tokens"] / 1e6:.1f}M tokens), AdamW \
(lr {facts["pretrain"]["learning_rate"]}, weight decay {facts["pretrain"]["weight_decay"]}, \
4% warmup, cosine), gradient clipping 1.0; about {facts["pretrain_minutes"]:.0f} minutes.
- Loss: training {facts["train_loss"]:.3f} (last checkpoint window), held-out \
{facts["held_out_loss"]:.3f} nats/token.

## Drafter (`drafter/`)

- DFlash, z-lab layout: {facts["drafter"]["num_hidden_layers"]} target-shaped layers, block size \
{facts["drafter"]["block_size"]}, tapped target layers {facts["drafter"]["target_layer_ids"]}, \
mask token id {facts["drafter"]["mask_token_id"]}; {facts["drafter_params"] / 1e6:.1f}M parameters.
- Data: the target's own greedy continuations ({facts["data_tokens"] / 1e3:.0f}k tokens) of \
{data_sources}.
- Training (`drafters/dflash/train.py`): {facts["drafter_steps"]} steps of 4 sequences, 48 random \
anchors per sequence, loss decay gamma 7, AdamW lr 1e-3 with warmup and cosine; final loss \
{facts["drafter_loss"]:.3f}, weighted accuracy {facts["drafter_acc"]:.3f}; about \
{facts["drafter_minutes"]:.0f} minutes.

## Measured (greedy, block 16, one request at a time, {facts["eval_prompts"]} prompts per \
workload, {facts["eval_max_tokens"]} tokens each)

| workload | tau | speculative tok/s | mlx-lm `stream_generate` tok/s | speedup | step cost |
|---|---:|---:|---:|---:|---:|
{rows}

*Step cost* = tau / speedup: what one speculative step (drafter forward + 16-position verify)
costs in plain decode steps of mlx-lm. Speculation pays exactly when tau exceeds it.
{short_table}
Produced by `python -m engine.bundled.build --stages eval` (numbers in
`~/.cache/flashbatch/bundle-build/eval.json`), flashbatch's reference loop with the drafter
against mlx-lm's plain `stream_generate` on the same target, interleaved per prompt.

## Limits

This is a small pair trained in about {hours:.1f} hours of 2-core CPU time. The target saw
{facts["pretrain_tokens"] / 1e6:.1f}M tokens and the drafter {facts["data_tokens"] / 1e3:.0f}k
target-generated tokens (published DFlash drafters train on hundreds of thousands of
samples), so acceptance is modest. On this CPU a 16-position speculative step costs about
{step_cost:.1f} plain steps (a 16-position verify is far from free when matrix products are
small and the backend is a CPU), so block 16 pays only where tau clears that ({paying}); a
shallower depth costs less per step, and the engine's adaptive controller drafts at the depth
the measured acceptance and cost favour, or not at all. On a GPU, where decoding is bound by
memory bandwidth, the same verify costs close to one plain step. Longer target pretraining and
more drafter data and steps (every stage resumes: rerun with more `--steps` /
`--data-prompts` / `--workload-data-prompts` / `--drafter-steps`) raise tau; every drafter
sitting so far did.

## Rebuild

```bash
python -m engine.bundled.build --stages corpus,tokenizer,pretrain \\
    --steps {facts["pretrain"]["steps"]}
python -m engine.bundled.build --stages export-target,workloads
{drafter_commands}
python -m engine.bundled.build --stages export-drafter,eval,card
```

The drafter was trained in {len(facts["drafter_runs"])} sitting(s); each resumed the previous
checkpoint with a new total, which restarts the cosine schedule for that total, so the
sittings above are the exact recipe (data prompts are cut with a fixed seed: a larger
`--data-prompts` extends the same list).

Every stage checkpoints into `~/.cache/flashbatch/bundle-build` and resumes after an
interruption. Exact numbers vary with the Python version's standard library.
"""
    path.write_text(text)


def collect_facts(work: Path, target_dir: Path = BUNDLED_TARGET,
                  drafter_dir: Path = BUNDLED_DRAFTER) -> dict:  # fmt: skip
    """Everything the model card states, read back from the build's work directory."""
    import platform as host

    import numpy as np

    from drafters.dflash.checkpoint import read_config

    split = split_corpus(work)
    state = json.loads((work / "pretrain" / "state.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    drafter = read_config(drafter_dir)
    summary = json.loads((work / "drafter_summary.json").read_text())
    evaluation = json.loads((work / "eval.json").read_text())
    records = _records(work)

    def count(directory: Path) -> int:
        return sum(int(np.prod(v.shape)) for f in directory.glob("model*.safetensors")
                   for v in mx.load(str(f)).values())  # fmt: skip

    config = state["config"]
    tokens = config["steps"] * config["batch_size"] * config["seq_len"]
    losses = [h["loss"] for h in state["history"] if h["loss"] is not None]
    return {
        "python": f"Python {host.python_version()}",
        "train_files": len(split["train"]),
        "held_out_files": len(split["held_out"]),
        "vocab_size": target["vocab_size"],
        "train_tokens": int(np.load(work / "train_tokens.npy").shape[0]),
        "target": target,
        "target_params": count(target_dir),
        "pretrain": config,
        "pretrain_tokens": tokens,
        "pretrain_minutes": tokens / state.get("tokens_per_second", _logged_rate(work)) / 60,
        "train_loss": losses[-1] if losses else float("nan"),
        "held_out_loss": held_out_target_loss(work, target_dir),
        "drafter": {
            "num_hidden_layers": drafter.num_hidden_layers,
            "block_size": drafter.block_size,
            "target_layer_ids": drafter.target_layer_ids,
            "mask_token_id": drafter.mask_token_id,
        },
        "drafter_params": count(drafter_dir),
        "data_prompts": len(records),
        "data_tokens": sum(len(r["tokens"]) - r["prompt_tokens"] for r in records),
        "drafter_steps": summary["steps"],
        "drafter_runs": _drafter_runs(work, summary["steps"], len(records)),
        "drafter_loss": summary["loss"],
        "drafter_acc": summary["acc"],
        "drafter_minutes": summary["seconds"] / 60,
        "eval": evaluation["results"],
        "eval_prompts": evaluation["prompts"],
        "eval_max_tokens": evaluation["max_tokens"],
    }


def _drafter_runs(work: Path, steps: int, data_prompts: int) -> list[dict]:
    """The drafter's training sittings (one, if the build did not record them)."""
    runs_file = work / "drafter_runs.json"
    if runs_file.exists():
        return json.loads(runs_file.read_text())
    return [{"steps": steps, "data_prompts": data_prompts}]


def _logged_rate(work: Path) -> float:
    """Pretraining tokens/s from the build log (runs that predate the rate in state.json)."""
    import re

    log_file = work.parent / "bundle-build.log"
    rates = re.findall(r"\((\d+) tok/s\)", log_file.read_text()) if log_file.exists() else []
    return float(rates[-1]) if rates else 700.0
