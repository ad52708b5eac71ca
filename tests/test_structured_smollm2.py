"""Structured output on the real default model (SmolLM2-135M-Instruct, pulled once per
machine): sampled json_schema answers at c=8 with lookup speculation all validate, and greedy
constrained output with speculation equals drafting off."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.models.pull import pull
from engine.models.registry import DEFAULT_MODEL
from engine.step.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 32},
                      "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}  # fmt: skip
QUESTIONS = ["Describe Paris as JSON.", "Describe Tokyo as JSON.", "Describe Lima as JSON.",
             "Describe Cairo as JSON.", "Describe Oslo as JSON."]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir():
    return pull(DEFAULT_MODEL)


async def _answer(engine, prompt, **params):
    sp = SamplingParams(max_tokens=160, structured=StructuredOutput(
        kind="json_schema", spec=json.dumps(SCHEMA)), **params)  # fmt: skip
    tokens, last = [], None
    async for out in engine.generate(prompt, sp):
        tokens += out.token_ids
        last = out
    return tokens, last


@pytest.mark.slow  # about 4.5 minutes on the loaded 2-core host
async def test_fifty_sampled_json_schema_answers_at_c8_all_validate(model_dir):
    config = EngineConfig(target=str(model_dir), max_num_seqs=8, num_speculative_tokens=4,
                          draft_sources=["lookup"], max_waiting_requests=64)  # fmt: skip
    async with AsyncEngine(config) as engine:
        tokenizer = engine.tokenizer
        prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                      add_generation_prompt=True))
                   for q in QUESTIONS]  # fmt: skip
        results = await asyncio.gather(*[
            _answer(engine, prompts[i % len(prompts)], temperature=1.0, seed=i)
            for i in range(50)])  # fmt: skip
        greedy = {}
        for depth in (0, None):
            greedy[depth] = await asyncio.gather(
                *[_answer(engine, p, num_speculative_tokens=depth) for p in prompts]
            )
    for tokens, last in results:
        assert last.finish_reason == "stop", tokenizer.decode(tokens)
        jsonschema.validate(json.loads(_text(tokenizer, tokens)), SCHEMA)
    assert sum(last.accepted_tokens for _, last in results) > 0
    assert [t for t, _ in greedy[0]] == [t for t, _ in greedy[None]]


def _text(tokenizer, tokens: list[int]) -> str:
    eos = set(tokenizer.eos_token_ids)
    return tokenizer.decode([t for t in tokens if t not in eos])
