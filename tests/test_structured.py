"""Structured output (llguidance masks) under batched speculation: exact for greedy, the same
seeded samples at every depth, valid JSON for every sampled answer, 400s naming bad specs."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_engine import ScriptedEngine
from test_server import ServerProcess

from engine import AsyncEngine, EngineConfig, InvalidRequest, SamplingParams
from engine.step.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "count", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA))
REGEX = StructuredOutput(kind="regex", spec=r"(ab|cd){2,6}x[0-9]{1,3}")
PROMPTS = [[5, 17, 99], [40, 41, 42, 40], [7, 8, 9, 7, 8], [300, 12]]


async def _generate(engine, prompt, **params):
    tokens, last = [], None
    async for out in engine.generate(prompt, SamplingParams(**params)):
        tokens += out.token_ids
        last = out
    return tokens, last


def _config(target, **kw) -> EngineConfig:
    return EngineConfig(target=str(target), max_num_seqs=8, **kw)


async def test_greedy_constrained_output_with_lookup_drafts_equals_drafting_off(
    qwen3_target_dir,
):
    config = _config(qwen3_target_dir, num_speculative_tokens=4, draft_sources=["lookup"])
    async with AsyncEngine(config) as engine:
        runs = []
        for depth in (0, None):
            runs.append(await asyncio.gather(
                *[_generate(engine, p, max_tokens=60, structured=s, num_speculative_tokens=depth)
                  for p in PROMPTS for s in (JSON, REGEX)],
                _generate(engine, PROMPTS[0], max_tokens=20, num_speculative_tokens=depth),
            ))  # fmt: skip
        off, on = runs
        assert [t for t, _ in on] == [t for t, _ in off]
        assert sum(last.accepted_tokens for _, last in on) > 0
        for (_prompt, structured), (tokens, last) in zip(
            [(p, s) for p in PROMPTS for s in (JSON, REGEX)], on
        ):
            assert last.finish_reason == "stop", last
            text = engine.tokenizer.decode([t for t in tokens if t != 0])
            if structured is JSON:
                jsonschema.validate(json.loads(text), SCHEMA)
            else:
                assert re.fullmatch(REGEX.spec, text), text


async def test_drafts_are_cut_at_the_grammar_and_accepted_ones_stay_exact(
    qwen3_target_dir, vocab_size
):
    """A DFlash-like drafter proposing the constrained continuation, spoiled after 0..7
    tokens (spoiled tokens are mostly rejected by the grammar and cut before the verify)."""
    config = _config(qwen3_target_dir, num_speculative_tokens=0)
    async with AsyncEngine(config) as engine:
        plain = await asyncio.gather(
            *[_generate(engine, p, max_tokens=60, structured=JSON) for p in PROMPTS]
        )
    references = [p + t for p, (t, _) in zip(PROMPTS, plain)]
    config = _config(qwen3_target_dir, num_speculative_tokens=7)
    async with ScriptedEngine(config, references, vocab_size, [7, 2, 0, 5, 1]) as engine:
        drafted = await asyncio.gather(
            *[_generate(engine, p, max_tokens=60, structured=JSON) for p in PROMPTS]
        )
    assert [t for t, _ in drafted] == [t for t, _ in plain]
    assert sum(last.accepted_tokens for _, last in drafted) > 20


async def test_seeded_sampling_is_the_same_at_every_depth_and_always_validates(qwen3_target_dir):
    """T=1 json_schema answers at c=8 with drafting on: every one parses and validates, and
    each seed's answer is the same with drafting off and at fixed depths 2 and 5."""
    config = _config(qwen3_target_dir, num_speculative_tokens=5, draft_sources=["lookup"])
    outputs = {}
    async with AsyncEngine(config) as engine:
        for depth in (0, 2, None):
            outputs[depth] = await asyncio.gather(
                *[_generate(engine, PROMPTS[i % 4], max_tokens=80, temperature=1.0, seed=i,
                            structured=JSON, num_speculative_tokens=depth)
                  for i in range(16)]
            )  # fmt: skip
        tokenizer = engine.tokenizer
    assert [t for t, _ in outputs[0]] == [t for t, _ in outputs[2]] == [t for t, _ in outputs[None]]
    for tokens, last in outputs[None]:
        assert last.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode([t for t in tokens if t != 0])), SCHEMA)
    assert len({tuple(t) for t, _ in outputs[None]}) > 8  # sampled, not one answer


async def test_a_bad_constraint_is_refused_at_admission(qwen3_target_dir):
    async with AsyncEngine(_config(qwen3_target_dir)) as engine:
        for bad in (
            StructuredOutput(kind="json_schema", spec='{"type": "nonsense"}', param="p1"),
            StructuredOutput(kind="regex", spec="(unclosed", param="p2"),
            StructuredOutput(kind="grammar", spec="start: ???", param="p3"),
        ):
            with pytest.raises(InvalidRequest) as caught:
                engine.add_request([1, 2], SamplingParams(structured=bad))
            assert caught.value.param == bad.param
        with pytest.raises(InvalidRequest) as caught:
            engine.add_request([1, 2], SamplingParams(structured=JSON, ignore_eos=True))
        assert caught.value.param == "ignore_eos"


# ----------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def structured_server(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, "--num-speculative-tokens", "3",
                      "--draft-sources", "lookup")  # fmt: skip
    yield s
    s.stop()


class Item(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    count: int = pydantic.Field(ge=0, le=999)


def test_openai_sdk_parse_with_a_pydantic_model(structured_server):
    client = openai.OpenAI(base_url=structured_server.url + "/v1", api_key="unused")
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="qwen3", messages=[{"role": "user", "content": "an item"}], response_format=Item,
            temperature=1.0, seed=seed, max_completion_tokens=60,
        )  # fmt: skip
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Item)


def test_response_format_json_object_and_the_extensions_over_http(structured_server):
    url = structured_server.url
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 80, "temperature": 0,
        "response_format": {"type": "json_object"}}).json()  # fmt: skip
    # any object (free keys: a random model may still be writing one at the budget's end)
    choice = chat["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    for extension, check in (
        ({"regex": r"[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
        ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"grammar": 'start: "a" ("b" | "c")+ "d"'}, lambda t: re.fullmatch("a[bc]+d", t)),
        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
    ):
        body = {"prompt": "q", "max_tokens": 60, "temperature": 1.0, "seed": 3,
                "structured_outputs": extension}  # fmt: skip
        choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (extension, choice)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "wat"}}}}, "response_format.json_schema.schema"),
        ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("chat", {"response_format": {"type": "json_object", "x": 1}}, "response_format.x"),
        ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ("completions", {"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml"),
        ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ],
)  # fmt: skip
def test_an_invalid_constraint_is_a_400_with_param(structured_server, path, body, param):
    base = {"messages": [{"role": "user", "content": "x"}]} if path == "chat" else {"prompt": "x"}
    response = httpx.post(f"{structured_server.url}/v1/{path.replace('chat', 'chat/completions')}",
                          json={**base, **body}, timeout=60)  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_masked_position_samples_the_renormalised_distribution():
    """Disallowed tokens are never drawn, however likely; the allowed ones keep their
    relative odds (the constrained distribution), greedy and sampled."""
    import mlx.core as mx
    import numpy as np

    from engine.step.sampling import request_stream, sample

    logits = mx.repeat(mx.array([[10.0, 10.0, 0.0, 1.0, -2.0]]), 4000, axis=0)
    mask = np.zeros((4000, 1), dtype=np.int32) + (1 << 2 | 1 << 3)  # tokens 2 and 3
    greedy = sample(logits[:3], SamplingParams(), None, mask=mask[:3])
    assert greedy.tolist() == [3, 3, 3]
    drawn = np.array(sample(logits, SamplingParams(temperature=1.0), request_stream(7), mask=mask))
    assert set(drawn.tolist()) <= {2, 3}
    expected = np.e / (1 + np.e)  # p(3) among {2, 3}
    assert abs((drawn == 3).mean() - expected) < 0.03
