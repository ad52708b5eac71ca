"""Tool calls (Hermes/Qwen `<tool_call>` format): parsing, streaming deltas, the prompt, and
`tool_choice` required/named enforced by grammar, through the official SDK."""

from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from test_server import ServerProcess

from engine.errors import InvalidRequest
from engine.http import tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SMALL_INT = {"type": "integer", "minimum": -99, "maximum": 99}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": SMALL_INT, "b": SMALL_INT},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ANSWER = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
    "\n</tool_call>"
)


def test_parse_takes_well_formed_calls_of_listed_tools_only():
    tools = tool_calls.setup([WEATHER, ADD], "auto", None)
    content, calls = tool_calls.parse(ANSWER, tools)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for text in ("plain answer", ANSWER.replace("add", "sub"), "<tool_call>{nope</tool_call>"):
        assert tool_calls.parse(text, tools) == (text, [])


@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_reassemble_to_the_parsed_answer(seed):
    tools = tool_calls.setup([WEATHER, ADD], "auto", None)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ANSWER)), 12))
    pieces = [ANSWER[i:j] for i, j in zip([0, *cuts], [*cuts, len(ANSWER)])]
    parser = tool_calls.StreamParser(tools)
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        text, deltas = parser.feed(piece, final=k == len(pieces) - 1)
        assert "<tool" not in text
        content += text
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"]["arguments"]
    want_content, want_calls = tool_calls.parse(ANSWER, tools)
    assert content.strip() == want_content
    assert [c["name"] for c in calls.values()] == [c["function"]["name"] for c in want_calls]
    assert [c["arguments"] for c in calls.values()] == [
        c["function"]["arguments"] for c in want_calls
    ]


def test_history_renders_natively_or_as_the_documented_text():
    tools = tool_calls.setup([WEATHER], "auto", None)
    arguments = '{"city": "Oslo", "unit": "c"}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4 degrees", "tool_call_id": "call_1"},
    ]
    native, extra = tool_calls.render(messages, tools, native=True)
    assert extra == {"tools": [WEATHER]}
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "c"}
    assert native[2]["role"] == "tool"
    generic, extra = tool_calls.render(messages, tools, native=False)
    assert extra == {} and generic[0]["role"] == "system" and "<tools>" in generic[0]["content"]
    assert (
        '"name": "get_weather"' in generic[2]["content"] and "<tool_call>" in generic[2]["content"]
    )
    assert generic[3] == {"role": "user", "content": "<tool_response>\n4 degrees\n</tool_response>"}
    none, _ = tool_calls.render(messages, tool_calls.setup([WEATHER], "none", None), False)
    assert "<tools>" not in json.dumps(none)


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "code", "function": {"name": "f"}}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": 5}}], None,
         "tools[0].function.parameters"),
        ([WEATHER], {"type": "function", "function": {"name": "no"}}, "tool_choice.function.name"),
        ([WEATHER], "always", "tool_choice"),
        (None, "required", "tool_choice"),
        ([WEATHER, WEATHER], None, "tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_by_name(tools, choice, param):
    with pytest.raises(InvalidRequest) as caught:
        tool_calls.setup(tools, choice, None)
    assert caught.value.param == param


# ----------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def tools_server(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, "--num-speculative-tokens", "3",
                      "--draft-sources", "lookup")  # fmt: skip
    yield s
    s.stop()


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_yields_valid_calls_streamed_and_not(tools_server):
    """Sampled at T=1 (a random model: it would never call a tool unprompted): every answer
    is a valid call. One call per answer (parallel_tool_calls false) so the grammar, not the
    token budget, ends it; with parallel calls the complete ones are valid too."""
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "weather in Paris, and 1 + 2?"}]
    for seed in range(4):
        kw = dict(model="qwen3", messages=messages, tools=[WEATHER, ADD], tool_choice="required",
                  temperature=1.0, seed=seed, max_tokens=120,
                  parallel_tool_calls=seed % 2 == 1)  # fmt: skip
        done = client.chat.completions.create(**kw)
        choice = done.choices[0]
        if seed % 2 == 0:
            assert choice.finish_reason == "tool_calls", choice
            assert len(choice.message.tool_calls) == 1
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            _valid(call)
        calls: dict[int, dict] = {}
        reason = None
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            reason = chunk.choices[0].finish_reason or reason
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
        assert reason == choice.finish_reason
        # the same seed: the same calls, streamed (ids are fresh)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
        assert all(c["id"] for c in calls.values())


def test_named_choice_calls_that_function_and_history_round_trips(tools_server):
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "add 2 and 3"}]
    done = client.chat.completions.create(
        model="qwen3", messages=messages, tools=[WEATHER, ADD], max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False,
    )  # fmt: skip
    calls = done.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    _valid(calls[0])
    history = messages + [
        done.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "5"},
    ]
    follow = client.chat.completions.create(model="qwen3", messages=history, tools=[WEATHER, ADD],
                                            max_tokens=4, tool_choice="auto")  # fmt: skip
    assert follow.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert follow.usage.prompt_tokens > done.usage.prompt_tokens  # the call and the result


def test_auto_may_answer_in_text_and_tools_refuse_other_constraints(tools_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
            "max_tokens": 6, "temperature": 0}  # fmt: skip
    answer = httpx.post(tools_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    message = answer["choices"][0]["message"]
    assert "tool_calls" not in message or answer["choices"][0]["finish_reason"] == "tool_calls"
    refused = httpx.post(tools_server.url + "/v1/chat/completions", timeout=60,
                         json={**body, "response_format": {"type": "json_object"}})  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    orphan = httpx.post(tools_server.url + "/v1/chat/completions", timeout=60, json={
        **body, "messages": [{"role": "tool", "content": "5"}]})  # fmt: skip
    assert orphan.status_code == 400
    assert orphan.json()["error"]["param"] == "messages[0].tool_call_id"


# ----------------------------------------------------------------------------- Llama 3.x
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
LLAMA3 += '{"name": "add", "parameters": {"a": 1, "b": 2}}'


def test_llama3_json_calls_are_parsed_whole_and_streamed_at_the_end():
    tools = tool_calls.setup([WEATHER, ADD], "auto", None, parser="llama3_json")
    content, calls = tool_calls.parse(LLAMA3, tools)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"}), ("add", {"a": 1, "b": 2})]  # fmt: skip
    assert tool_calls.parse("Oslo is cold.", tools) == ("Oslo is cold.", [])
    assert tool_calls.parse('{"name": "nope", "parameters": {}}', tools)[1] == []
    parser = tool_calls.StreamParser(tools)
    pieces = [LLAMA3[i : i + 7] for i in range(0, len(LLAMA3), 7)]
    out = [parser.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    assert all(text == "" for text, _ in out)
    assert [d["function"].get("name") for _, ds in out for d in ds if "id" in d] == [
        "get_weather", "add"]  # fmt: skip
    plain = tool_calls.StreamParser(tools)
    assert plain.feed("Oslo ")[0] == "Oslo " and plain.feed("is", final=True)[0] == "is"


def test_the_parser_follows_the_template_unless_overridden():
    class Tokenizer:
        chat_template = "{% if message.role == 'ipython' %}<|python_tag|>{% endif %}"

    assert tool_calls.choose_parser(Tokenizer()) == "llama3_json"
    assert tool_calls.choose_parser(Tokenizer(), "hermes") == "hermes"
    Tokenizer.chat_template = "{{ tools }}<tool_call>"
    assert tool_calls.choose_parser(Tokenizer()) == "hermes"


def test_llama3_parser_override_constrains_required_calls_over_http(qwen3_target_dir):
    server = ServerProcess(qwen3_target_dir, None, "--tool-call-parser", "llama3_json",
                           "--num-speculative-tokens", "0")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        for seed in range(2):
            done = client.chat.completions.create(
                model="qwen3", messages=[{"role": "user", "content": "1 + 2?"}], tools=[ADD],
                tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed,
                max_tokens=60,
            )  # fmt: skip
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert [c.function.name for c in choice.message.tool_calls] == ["add"]
            _valid(choice.message.tool_calls[0])
    finally:
        server.stop()
