"""No OpenAI field silently ignored: every field either works or is a 400 naming it (`param`),
unknown fields included; batched prompts in /v1/completions; penalties over HTTP."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from test_penalties import penalised_reference
from test_server import ServerProcess

from engine.models.loading import load_target_model
from engine.step.sampling import SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "name a fruit"}]


@pytest.fixture(scope="module")
def fields_server(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, "--num-speculative-tokens", "3",
                      "--draft-sources", "lookup")  # fmt: skip
    yield s
    s.stop()


def _chat(**extra) -> dict:
    return {"messages": USER, "max_tokens": 2, **extra}


def _prompt(**extra) -> dict:
    return {"prompt": "x", "max_tokens": 2, **extra}


# (path, body, param)
REFUSED = [
    # wrong types
    (CHAT, _chat(response_format=7), "response_format"),
    (CHAT, _chat(tools=5), "tools"),
    (CHAT, _chat(tool_choice=5), "tool_choice"),
    (COMPLETIONS, _prompt(logit_bias={"abc": "x"}), "logit_bias"),
    (COMPLETIONS, _prompt(logit_bias={"abc": 1}), "logit_bias"),
    (COMPLETIONS, _prompt(logit_bias={"5": 101}), "logit_bias"),
    (COMPLETIONS, _prompt(logit_bias={"100000000": 1}), "logit_bias"),
    (COMPLETIONS, _prompt(logit_bias=[1]), "logit_bias"),
    (COMPLETIONS, _prompt(frequency_penalty="x"), "frequency_penalty"),
    (CHAT, _chat(presence_penalty="x"), "presence_penalty"),
    (COMPLETIONS, _prompt(frequency_penalty=2.5), "frequency_penalty"),
    (COMPLETIONS, _prompt(presence_penalty=-3), "presence_penalty"),
    (COMPLETIONS, _prompt(repetition_penalty=0), "repetition_penalty"),
    (COMPLETIONS, _prompt(best_of="2"), "best_of"),
    (CHAT, _chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
    (CHAT, _chat(messages=[{"role": "user", "content": "x", "name": 5}]), "messages[0].name"),
    # fields the server cannot honour
    (COMPLETIONS, _prompt(best_of=2), "best_of"),
    (COMPLETIONS, _prompt(suffix="return x"), "suffix"),
    (
        CHAT,
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        ),
        "messages[0].content[0]",
    ),  # fmt: skip
    (CHAT, _chat(messages=[{"role": "user", "content": "x", "name": "ann"}]), "messages[0].name"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
        "messages[0].tool_calls",
    ),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]),
        "messages[0].tool_call_id",
    ),
    (
        CHAT,
        _chat(messages=[*USER, {"role": "assistant", "tool_calls": [{"function": 5}]}]),
        "messages[1].tool_calls[0]",
    ),
    (CHAT, _chat(messages=[*USER, {"role": "tool", "content": "1"}]), "messages[1].tool_call_id"),
    (CHAT, _chat(functions=[{"name": "f"}]), "functions"),
    (CHAT, _chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (CHAT, _chat(modalities=["text", "audio"]), "modalities"),
    (CHAT, _chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (CHAT, _chat(reasoning_effort="low"), "reasoning_effort"),
    (CHAT, _chat(store=True), "store"),
    (CHAT, _chat(metadata={"a": "b"}), "metadata"),
    (CHAT, _chat(service_tier="flex"), "service_tier"),
    # unknown fields: refused by name (the documented choice), at any depth
    (COMPLETIONS, _prompt(max_token=5), "max_token"),
    (CHAT, _chat(echo=True), "echo"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]),
        "messages[0].mood",
    ),  # fmt: skip
    (CHAT, _chat(stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED,
                         ids=[f"{p[-11:]}:{param}" for p, _, param in REFUSED])  # fmt: skip
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(fields_server, path, body, param):
    response = httpx.post(fields_server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


ACCEPTED = [
    (COMPLETIONS, _prompt(best_of=1, user="u", logit_bias={}, frequency_penalty=0)),
    (
        CHAT,
        _chat(
            user="u",
            store=False,
            modalities=["text"],
            service_tier="auto",
            parallel_tool_calls=True,
            tool_choice="none",
            prompt_cache_key="k",
            safety_identifier="s",
            response_format={"type": "text"},
        ),
    ),  # fmt: skip
    (CHAT, _chat(messages=[{"role": "developer", "content": "be brief"}, *USER])),
]


@pytest.mark.parametrize(("path", "body"), ACCEPTED)
def test_fields_that_ask_for_nothing_else_are_accepted(fields_server, path, body):
    response = httpx.post(fields_server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text


def _complete(server, **body) -> dict:
    response = httpx.post(server.url + COMPLETIONS, json={"temperature": 0, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_logit_bias_and_penalties_over_http_equal_the_documented_formula(
    fields_server, qwen3_target_dir
):
    """Greedy decoding over HTTP with every first-choice token banned, and with penalties,
    equals the reference loop applying OpenAI's formula (drafting at depth 3 meanwhile)."""
    model, tokenizer = load_target_model(qwen3_target_dir)
    prompt, n = [40, 41, 42, 40, 41, 42], 12
    plain = penalised_reference(model, prompt, n, SamplingParams())
    cases = [
        dict(logit_bias={str(t): -100 for t in set(plain)}),
        dict(frequency_penalty=1.5, presence_penalty=0.5),
        dict(repetition_penalty=1.3, logit_bias={str(plain[0]): 2.0}),
    ]
    for fields in cases:
        params = SamplingParams(**{**fields, "logit_bias": {
            int(k): v for k, v in fields.get("logit_bias", {}).items()}})  # fmt: skip
        want = penalised_reference(model, prompt, n, params)
        got = _complete(fields_server, prompt=prompt, max_tokens=n, ignore_eos=True, **fields)
        assert got["choices"][0]["text"] == _detokenize(tokenizer, want), fields
        assert want != plain
    assert not set(penalised_reference(model, prompt, n, SamplingParams(
        logit_bias={t: -100.0 for t in set(plain)}))) & set(plain)  # fmt: skip


def _detokenize(tokenizer, ids: list[int]) -> str:
    """The text as the server streams it (its detokenizer, not a one-shot decode)."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in ids:
        detokenizer.add_token(token)
    detokenizer.finalize()
    return detokenizer.text


PROMPTS_4 = ["def push(self, item):", "import json\n", "class Stack:", "return x +"]


def test_a_list_of_prompts_returns_one_choice_each_equal_to_its_single_answer(fields_server):
    common = dict(max_tokens=8, ignore_eos=True, logprobs=1)
    singles = [_complete(fields_server, prompt=p, **common)["choices"][0] for p in PROMPTS_4]
    batched = _complete(fields_server, prompt=PROMPTS_4, **common)
    assert [c["index"] for c in batched["choices"]] == [0, 1, 2, 3]
    for single, choice in zip(singles, batched["choices"]):
        assert choice["text"] == single["text"]
        assert choice["logprobs"]["tokens"] == single["logprobs"]["tokens"]
    assert batched["usage"]["completion_tokens"] == 4 * 8
    # token-id prompts, batched, and echo: each choice its own prompt
    ids = [[5, 17, 99], [40, 41, 42, 40]]
    one = [_complete(fields_server, prompt=p, max_tokens=4, echo=True)["choices"][0]["text"]
           for p in ids]  # fmt: skip
    both = _complete(fields_server, prompt=ids, max_tokens=4, echo=True)["choices"]
    assert [c["text"] for c in both] == one


def test_batched_prompts_stream_with_their_indices(fields_server):
    client = openai.OpenAI(base_url=fields_server.url + "/v1", api_key="unused")
    extra = {"extra_body": {"ignore_eos": True}}
    done = client.completions.create(model="qwen3", prompt=PROMPTS_4, max_tokens=6, temperature=0,
                                     **extra)  # fmt: skip
    texts, reasons = [""] * 4, [None] * 4
    usage = None
    for chunk in client.completions.create(model="qwen3", prompt=PROMPTS_4, max_tokens=6,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           **extra):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.text for c in sorted(done.choices, key=lambda c: c.index)]
    assert reasons == ["length"] * 4
    assert usage.completion_tokens == 24


@pytest.mark.parametrize(
    "prompt", [[], ["a", ""], [[1, 2], []], ["a", [1]], [[1], "a"], ["x"] * 65, [[1.5]]]
)
def test_malformed_prompt_lists_are_refused(fields_server, prompt):
    response = httpx.post(fields_server.url + COMPLETIONS, json={"prompt": prompt}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


def test_an_unknown_field_is_named_in_the_message(fields_server):
    response = httpx.post(fields_server.url + COMPLETIONS, content=json.dumps(_prompt(x=1)),
                          headers={"Content-Type": "application/json"}, timeout=30)  # fmt: skip
    assert response.status_code == 400
    assert "unknown field `x`" in response.json()["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_leaving_a_batched_request_aborts_every_prompt(fields_server, stream):
    """Four prompts in flight, the client hangs up: all four requests end (abort), none runs
    on, and the server keeps serving."""
    from test_server import _metric

    body = {"prompt": PROMPTS_4, "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    before = _metric(fields_server.metrics(), "flashbatch_request_success_total",
                     finished_reason="abort")  # fmt: skip
    async with httpx.AsyncClient(base_url=fields_server.url, timeout=30) as client:
        if stream:
            async with client.stream("POST", COMPLETIONS, json=body) as response:
                assert response.status_code == 200
                async for _ in response.aiter_lines():
                    running = _metric(fields_server.metrics(), "flashbatch_num_requests_running")
                    if running >= 4:
                        break
        else:
            request = asyncio.ensure_future(client.post(COMPLETIONS, json=body))
            for _ in range(200):
                if _metric(fields_server.metrics(), "flashbatch_num_requests_running") >= 4:
                    break
                await asyncio.sleep(0.05)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
    for _ in range(200):
        values = fields_server.metrics()
        if _metric(values, "flashbatch_num_requests_running") == 0:
            break
        await asyncio.sleep(0.05)
    assert _metric(values, "flashbatch_num_requests_running") == 0
    aborted = _metric(values, "flashbatch_request_success_total", finished_reason="abort")
    assert aborted - before == 4
    assert _complete(fields_server, prompt="x", max_tokens=2)["choices"][0]["finish_reason"]
