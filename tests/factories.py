"""Builders for small real models used by the tests: a byte-level BPE tokenizer trained on local
text, random-weight mlx-lm targets saved to disk, and random DFlash drafters in z-lab layout.
Everything goes through the real save/load paths."""

from __future__ import annotations

import engine  # noqa: F401  (preloads a fast BLAS; must come before mlx)

# isort: split
import importlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from drafters.base import Candidates
from drafters.dflash.checkpoint import save_dflash_model
from drafters.dflash.config import DFlashConfig
from drafters.dflash.model import DFlashDraftModel
from engine.bundled.pretrain import build_bpe_tokenizer

TOKENIZER_VOCAB = 384


def prometheus_tool_absent(tool: str) -> str:
    """The skip reason of a test that needs promtool or prometheus: both come with Debian's
    `prometheus` package, which `.ci/run` installs and the README's set-up commands do not."""
    return (
        f"{tool} not installed: it comes with Debian's `prometheus` package, which .ci/run "
        "installs and the README's set-up commands do not (apt-get install prometheus)"
    )


PROMTOOL_ABSENT = prometheus_tool_absent("promtool")


def build_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer that `mlx_lm.load` accepts (trained in about a second)."""
    corpus = [inspect.getsource(m) for m in (json, inspect, importlib)]
    build_bpe_tokenizer(corpus, TOKENIZER_VOCAB, directory)


def target_config(model_type: str, vocab_size: int, layers: int = 6) -> dict:
    return {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,  # tied random models repeat one token forever
        "eos_token_id": 0,
    }


def family_config(model_type: str, vocab_size: int, **overrides) -> dict:
    """A tiny config of a family whose fields go beyond `target_config`'s: the hybrids
    (`qwen3_5`, `qwen3_5_moe`, `qwen3_next`, `lfm2`), the MoE `qwen3_moe`, `gpt_oss` and the sliding
    `gemma3_text`."""
    config = target_config(model_type, vocab_size, layers=4)
    linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                  rope_parameters={"type": "default", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5})  # fmt: skip
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               norm_topk_prob=True, decoder_sparse_step=1)  # fmt: skip
    if model_type == "qwen3_5":
        config.update(linear)
    elif model_type == "qwen3_5_moe":
        config.update(linear, **moe, shared_expert_intermediate_size=32)
    elif model_type == "qwen3_next":
        linear_only = {k: v for k, v in linear.items() if k != "rope_parameters"}
        config.update(linear_only, **moe, shared_expert_intermediate_size=32,
                      mlp_only_layers=[], partial_rotary_factor=0.5)  # fmt: skip
    elif model_type == "qwen3_moe":
        config.update(moe, mlp_only_layers=[])
    elif model_type == "lfm2":
        config.update(norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64,
                      block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                      block_auto_adjust_ff_dim=False, block_ff_dim=128,
                      layer_types=["conv", "full_attention", "conv", "full_attention"])  # fmt: skip
    elif model_type == "gemma3_text":
        config.update(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16)
    elif model_type == "gpt_oss":
        config.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"] * 2,
                      rope_scaling=None)  # fmt: skip
    config.update(overrides)
    return config


def build_target(directory: Path, tokenizer_dir: Path, model_type: str, seed: int,
                 config: dict | None = None, embed_scale: float = 3.0,
                 output_scale: float = 1.0) -> Path:  # fmt: skip
    """A random-weight float32 mlx-lm model of `model_type` (the `target_config`, or
    `config`), saved with the tokenizer. `output_scale` multiplies the layers' output
    projections: a tied random model (LFM2 has no untied head) otherwise repeats one token."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    config = target_config(model_type, vocab) if config is None else dict(config)
    config["vocab_size"] = vocab
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Larger embeddings make random models write varied (less repetitive) sequences.
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * embed_scale
    if output_scale != 1.0:
        from mlx.utils import tree_flatten, tree_unflatten

        scaled = [(k, v * output_scale) for k, v in tree_flatten(model.parameters())
                  if k.endswith(("out_proj.weight", "w2.weight", "down_proj.weight"))]  # fmt: skip
        model.update(tree_unflatten(scaled))
    mx.eval(model.parameters())
    save_model(directory, model)
    save_config(config, directory / "config.json")
    for file in tokenizer_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


def drafter_config(vocab_size: int, **overrides) -> DFlashConfig:
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab_size,
        block_size=8,
        mask_token_id=2,
        target_layer_ids=[1, 4],
        num_target_layers=6,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return DFlashConfig(**fields)


def build_drafter(directory: Path, config: DFlashConfig, seed: int) -> Path:
    mx.random.seed(seed)
    model = DFlashDraftModel(config)
    mx.eval(model.parameters())
    save_dflash_model(model, directory)
    return directory


@dataclass
class _ScriptedSession:
    reference: list[int]
    tokens: list[int]  # tokens at the positions reported as committed (in the target cache)
    proposals: int = 0

    @property
    def context_rows(self) -> int:
        return len(self.tokens)

    @property
    def pending_rows(self) -> int:
        return 0


@dataclass
class ScriptedDrafter:
    """A fake drafter that knows each request's greedy continuation (`references`: prompt +
    continuation) and proposes it, spoiled after `correct_per_step[k]` tokens on a session's
    k-th proposal (cycled), so partial, full and zero acceptance all occur. Implements the
    `Drafter` protocol, batched; it checks that the loop reports committed tokens in order."""

    references: list[list[int]]
    vocab_size: int
    correct_per_step: list[int]
    block_size: int = 8
    strict: bool = True  # sampled runs leave the reference path; then drafts are just guesses
    calls: list[int] = field(default_factory=list)

    @property
    def max_depth(self) -> int:
        return self.block_size - 1

    def open(self, prompt_ids: Sequence[int] = ()) -> _ScriptedSession:
        prompt = list(prompt_ids)
        matches = [r for r in self.references if r[: len(prompt)] == prompt]
        return _ScriptedSession(reference=matches[0] if matches else prompt, tokens=[])

    def commit(self, session: _ScriptedSession, features, tokens: Sequence[int] = ()) -> None:
        assert len(tokens) == features.shape[0], "every committed row comes with its token"
        session.tokens += list(tokens)

    def commit_step(self, features, blocks) -> None:
        for session, start, tokens in blocks:
            assert start + len(tokens) <= features.shape[0], "a block past the step's rows"
            self.commit(session, features[start : start + len(tokens)], tokens)

    def propose(self, sessions, anchors, depths) -> Candidates:
        rows = []
        width = max(depths)
        for session, anchor, depth in zip(sessions, anchors, depths):
            position = len(session.tokens)  # the anchor's position
            reference = session.reference
            if self.strict:
                assert session.tokens == reference[:position], "committed tokens out of order"
                assert reference[position] == anchor, "anchor must be the last committed token"
            right = self.correct_per_step[session.proposals % len(self.correct_per_step)]
            session.proposals += 1
            self.calls.append(depth)
            drafts = []
            for j in range(1, width + 1):
                truth = reference[position + j] if position + j < len(reference) else 0
                drafts.append(truth if j <= right else (truth + 1) % self.vocab_size)
            rows.append(drafts)
        tokens = mx.array(rows, dtype=mx.int32)
        return Candidates(tokens=tokens, probs=mx.ones(tokens.shape), depths=list(depths))

    def take_unevaluated(self) -> list[mx.array]:
        return []

    def close(self, session: _ScriptedSession) -> None:
        pass


def wait_until_ready(url: str, process, timeout: float) -> bool:
    """Poll `url`/ready until it answers 200 (True), the server process ends or `timeout`
    seconds pass (False)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            return False
        time.sleep(0.1)
    return False
