"""The HTTP server, as a real process on loopback, driven by real clients (openai, httpx)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
from factories import PROMTOOL_ABSENT, wait_until_ready
from mlx_lm.generate import generate_step

from engine.models.loading import load_target_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`flashbatch serve` on a free loopback port (target None: the default model)."""

    def __init__(self, target: Path | None, drafter: Path | None, *extra: str,
                 env: dict | None = None, ready_timeout: float = 60.0):  # fmt: skip
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port),
                   "--log-level", "warning", *extra]  # fmt: skip
        if target is not None:
            command += ["--target", str(target)]
        if drafter is not None:
            command += ["--drafter", str(drafter)]
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"server-{self.port}.log", "w+")
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        if wait_until_ready(self.url, self.process, ready_timeout):
            return
        self.stop()
        self.log.seek(0)
        raise RuntimeError("server did not become ready:\n" + self.log.read())

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        values = {}
        for line in text.splitlines():
            if line.startswith("flashbatch_"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(qwen3_target_dir, drafter_dir):
    # A fixed depth: these tests count drafts, and the adaptive controller may rightly park a
    # toy pair's drafting on a loaded machine (CI once served three requests without a draft).
    # The servers started with defaults below serve at adaptive depth.
    s = ServerProcess(qwen3_target_dir, drafter_dir, "--max-num-seqs", "32",
                      "--num-speculative-tokens", "4")  # fmt: skip
    yield s
    s.stop()


def _metric(values: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in values.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def test_openai_client_completions_and_chat(server, qwen3_target_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model, tokenizer = load_target_model(qwen3_target_dir)
    prompt = "def add(a, b):"
    ids = list(tokenizer.encode(prompt))
    steps = generate_step(mx.array(ids), model, max_tokens=12, sampler=lambda x: mx.argmax(x, -1))
    reference = [int(t) for t, _ in steps]
    expected = tokenizer.decode(reference[: reference.index(0)] if 0 in reference else reference)

    done = client.completions.create(model="qwen3", prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == expected
    assert done.usage.prompt_tokens == len(ids) and done.usage.completion_tokens <= 12

    stream = client.completions.create(
        model="qwen3", prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens

    messages = [{"role": "user", "content": "write a loop"}]
    chat = client.chat.completions.create(
        model="qwen3", messages=messages, max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model="qwen3", messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["qwen3"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "n": 2}, 400, "n=2"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens 5000 exceeds"),
        ({"prompt": "x " * 3000, "max_tokens": 2000}, 400, "maximum context length is 4096"),
        ({"prompt": "x", "model": "other"}, 404, "does not exist"),
        ({"prompt": 5}, 400, "invalid request"),
        ({"messages": []}, 400, "messages must not be empty"),
        ({"prompt": "x", "draft_sources": ["eagle"]}, 400, "unknown draft sources"),
        ({"prompt": "x", "logprobs": 6}, 400, "logprobs must be in 0..5"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs needs logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs must be in 0..20",
        ),
    ],
)
def test_errors_use_the_openai_shape(server, body, status, needle):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(server.url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert error["code"] is None or isinstance(error["code"], str)  # OpenAI's: never a number


def test_oversized_body_gets_413(server):
    response = httpx.post(server.url + "/v1/completions", content=b"x" * (2 << 20),
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 413 and "exceeds" in response.json()["error"]["message"]


def test_metrics_count_what_was_served(server):
    before = server.metrics()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    drafted = accepted = tokens = 0
    for i in range(3):
        raw = client.completions.with_raw_response.create(
            model="qwen3", prompt=f"import os{i}", max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        body = json.loads(raw.text)
        drafted += body["flashbatch"]["drafted_tokens"]
        accepted += body["flashbatch"]["accepted_tokens"]
        tokens += body["usage"]["completion_tokens"]
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("flashbatch_generation_tokens_total") == tokens == 30
    assert delta("flashbatch_request_success_total", finished_reason="length") == 3
    assert delta("flashbatch_spec_decode_num_draft_tokens_total") == drafted > 0
    assert delta("flashbatch_spec_decode_num_accepted_tokens_total") == accepted
    assert delta("flashbatch_time_to_first_token_seconds_count") == 3
    assert delta("flashbatch_e2e_request_latency_seconds_count") == 3
    assert delta("flashbatch_spec_decode_draft_depth_count") > 0
    assert _metric(after, "flashbatch_num_requests_running") == 0


def test_draft_sources_per_request_with_per_source_accounting(qwen3_target_dir, drafter_dir):
    """`draft_sources` narrows a request's drafters; the `flashbatch` object and the metrics'
    `source` label say which drafter proposed what. (A fixed-depth server: an adaptive one may
    park a 12-token request on a loaded machine, and this test is about the accounting.)"""
    server = ServerProcess(qwen3_target_dir, drafter_dir, "--num-speculative-tokens", "4")
    try:
        before = server.metrics()
        bodies = {}
        for source in ("dflash", "lookup"):
            response = httpx.post(server.url + "/v1/completions", json={
                "prompt": [5, 6, 7, 8] * 5, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "draft_sources": [source],
            })  # fmt: skip
            assert response.status_code == 200, response.text
            bodies[source] = response.json()["flashbatch"]
        after = server.metrics()
    finally:
        server.stop()
    for source, body in bodies.items():
        assert set(body["sources"]) <= {source}
        per_source = body["sources"].get(source, {"drafted_tokens": 0, "accepted_tokens": 0})
        assert per_source["drafted_tokens"] == body["drafted_tokens"]
        assert per_source["accepted_tokens"] == body["accepted_tokens"]
        name = "flashbatch_spec_decode_num_draft_tokens_total"
        delta = _metric(after, name, source=source) - _metric(before, name, source=source)
        assert delta == body["drafted_tokens"], source
    assert bodies["dflash"]["drafted_tokens"] > 0  # a fixed depth always drafts


def test_draft_sources_flag_serves_lookup_alone(qwen3_target_dir, drafter_dir):
    s = ServerProcess(qwen3_target_dir, drafter_dir, env={"FLASHBATCH_DRAFT_SOURCES": "lookup"})
    try:
        body = {"prompt": [5, 6, 7] * 4, "max_tokens": 6, "temperature": 0}
        ok = httpx.post(s.url + "/v1/completions", json=body)
        assert ok.status_code == 200 and set(ok.json()["flashbatch"]["sources"]) <= {"lookup"}
        refused = httpx.post(s.url + "/v1/completions", json={**body, "draft_sources": ["dflash"]})
        assert refused.status_code == 400 and "not served" in refused.json()["error"]["message"]
    finally:
        s.stop()


@pytest.mark.skipif(shutil.which("promtool") is None, reason=PROMTOOL_ABSENT)
def test_promtool_accepts_the_exposition(server):
    text = httpx.get(server.url + "/metrics").text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


async def test_disconnect_mid_stream_frees_the_request(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        body = {"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                if _metric(server.metrics(), "flashbatch_num_requests_running") >= 1:
                    break
    for _ in range(100):
        values = server.metrics()
        if _metric(values, "flashbatch_num_requests_running") == 0:
            break
        await asyncio.sleep(0.05)
    assert _metric(values, "flashbatch_num_requests_running") == 0
    assert _metric(values, "flashbatch_request_success_total", finished_reason="abort") >= 1


async def test_two_hundred_concurrent_streams_complete(server):
    limits = httpx.Limits(max_connections=250)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:

        async def one(i: int) -> int:
            body = {"prompt": f"def f{i}(", "max_tokens": 6, "stream": True, "ignore_eos": True,
                    "temperature": 0}  # fmt: skip
            pieces = 0
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        return pieces
                    if line.startswith("data: "):
                        pieces += 1
            return -1

        results = await asyncio.gather(*[one(i) for i in range(200)])
    assert all(r >= 1 for r in results)


def _greedy_with_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[list[float]]]:
    """mlx-lm's own greedy tokens for `prompt` and the log-softmax at each of them."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    tokens = [int(t) for t, _ in steps]
    return tokens, _reference_logprobs(model, prompt, tokens)


def _reference_logprobs(model, prompt: list[int], output: list[int]) -> list[list[float]]:
    logits = model(mx.array([prompt + output]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logprobs[len(prompt) - 1 : len(prompt) - 1 + len(output)].tolist()


def test_openai_client_reads_logprobs_streamed_and_not(server, qwen3_target_dir):
    """Completions `logprobs: 3` and chat `logprobs + top_logprobs: 4`, streamed and not,
    read by the official client: the target's log-softmax at every generated token."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model, tokenizer = load_target_model(qwen3_target_dir)
    extra = {"extra_body": {"ignore_eos": True}}
    prompt = "def add(a, b):"
    ids = list(tokenizer.encode(prompt))
    tokens, reference = _greedy_with_logprobs(model, ids, 10)
    names = [tokenizer.decode([t]) for t in tokens]

    done = client.completions.create(model="qwen3", prompt=prompt, max_tokens=10, temperature=0,
                                     logprobs=3, **extra)  # fmt: skip
    stream = client.completions.create(model="qwen3", prompt=prompt, max_tokens=10,
                                       temperature=0, logprobs=3, stream=True, **extra)  # fmt: skip
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    for logprobs in (done.choices[0].logprobs, streamed):
        if isinstance(logprobs, list):  # the stream's deltas, joined
            joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for part in logprobs:
                for key in joined:
                    joined[key] += getattr(part, key)
            logprobs = openai.types.completion_choice.Logprobs(**joined)
        assert logprobs.tokens == names
        assert logprobs.text_offset == [len("".join(names[:j])) for j in range(10)]
        for j, value in enumerate(logprobs.token_logprobs):
            assert abs(value - reference[j][tokens[j]]) < 1e-4
            top = logprobs.top_logprobs[j]
            assert 3 <= len(top) <= 4 and names[j] in top  # the sampled token is always there
            best = sorted(reference[j], reverse=True)[:3]
            assert sorted(top.values(), reverse=True)[:3] == pytest.approx(best, abs=1e-4)

    messages = [{"role": "user", "content": "write a loop"}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    chat_tokens, chat_reference = _greedy_with_logprobs(model, chat_ids, 8)
    chat = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=4,
                                          **extra)  # fmt: skip
    streamed = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=4,
                                              stream=True, **extra)  # fmt: skip
    streamed_content = [i for c in streamed if c.choices and c.choices[0].logprobs
                        for i in c.choices[0].logprobs.content]  # fmt: skip
    for content in (chat.choices[0].logprobs.content, streamed_content):
        assert len(content) == 8
        for j, item in enumerate(content):
            assert item.token == tokenizer.decode([chat_tokens[j]])
            assert bytes(item.bytes) == item.token.encode()
            assert abs(item.logprob - chat_reference[j][chat_tokens[j]]) < 1e-4
            assert len(item.top_logprobs) == 4
            assert item.top_logprobs[0].logprob == pytest.approx(max(chat_reference[j]), abs=1e-4)
    plain = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("depth", [0, 3])
def test_logprobs_over_http_at_fixed_depth_and_drafting_off_at_the_range_ends(
    server, qwen3_target_dir, depth
):
    """The per-request depth (0: drafting off; 3: fixed) leaves HTTP logprobs equal to the
    target's forward, streamed and not, at the ends of the ranges (completions 0 and 5, chat
    `top_logprobs` 0 and 20)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model, tokenizer = load_target_model(qwen3_target_dir)
    extra = {"extra_body": {"ignore_eos": True, "num_speculative_tokens": depth}}
    prompt = "class Stack:\n    def push(self, item):"
    ids = list(tokenizer.encode(prompt))
    tokens, reference = _greedy_with_logprobs(model, ids, 8)
    for n in (0, 5):
        done = client.completions.create(model="qwen3", prompt=prompt, max_tokens=8,
                                         temperature=0, logprobs=n, **extra)  # fmt: skip
        stream = client.completions.create(model="qwen3", prompt=prompt, max_tokens=8,
                                           temperature=0, logprobs=n, stream=True,
                                           **extra)  # fmt: skip
        streamed = [v for c in stream if c.choices and c.choices[0].logprobs
                    for v in c.choices[0].logprobs.token_logprobs]  # fmt: skip
        for values in (done.choices[0].logprobs.token_logprobs, streamed):
            assert values == pytest.approx([reference[j][t] for j, t in enumerate(tokens)],
                                           abs=1e-4)  # fmt: skip
        # n alternatives plus the sampled token where it is not among them (fewer where two
        # tokens decode to the same text: OpenAI's shape keys them by text)
        tops = done.choices[0].logprobs.top_logprobs
        assert all(1 <= len(top) <= n + 1 for top in tops)
        assert max(map(len, tops)) >= max(n, 1)

    messages = [{"role": "user", "content": "name a fruit"}]
    chat_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    chat_tokens, chat_reference = _greedy_with_logprobs(model, chat_ids, 6)
    for top in (0, 20):
        chat = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=6,
                                              temperature=0, logprobs=True, top_logprobs=top,
                                              **extra)  # fmt: skip
        stream = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=6,
                                                temperature=0, logprobs=True,
                                                top_logprobs=top, stream=True,
                                                **extra)  # fmt: skip
        streamed = [i for c in stream if c.choices and c.choices[0].logprobs
                    for i in c.choices[0].logprobs.content]  # fmt: skip
        for content in (chat.choices[0].logprobs.content, streamed):
            assert [i.logprob for i in content] == pytest.approx(
                [chat_reference[j][t] for j, t in enumerate(chat_tokens)], abs=1e-4
            )
            assert all(len(i.top_logprobs) == top for i in content)
            if top:
                best = sorted(chat_reference[0], reverse=True)[:top]
                assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(best, abs=1e-4)


def test_echo_with_logprobs_scores_the_prompt(server, qwen3_target_dir):
    """The evaluation harnesses' call: echo, logprobs and max_tokens 0 give the prompt's own
    logprobs (the first token has none) and nothing generated; with max_tokens 3 the
    generated tokens follow the prompt's."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model, tokenizer = load_target_model(qwen3_target_dir)
    prompt = "def add(a, b):\n    return a + b"
    ids = list(tokenizer.encode(prompt))
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    reference = (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    for max_tokens, stream in ((0, False), (0, True), (3, False)):
        kwargs = dict(model="qwen3", prompt=prompt, echo=True, logprobs=2, temperature=0,
                      max_tokens=max_tokens, extra_body={"ignore_eos": True})  # fmt: skip
        if stream:
            parts = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
            text = "".join(c.choices[0].text for c in parts)
            tokens = [
                t for c in parts if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
            ]
            values = [v for c in parts if c.choices[0].logprobs
                      for v in c.choices[0].logprobs.token_logprobs]  # fmt: skip
        else:
            done = client.completions.create(**kwargs)
            text, logprobs = done.choices[0].text, done.choices[0].logprobs
            tokens, values = logprobs.tokens, logprobs.token_logprobs
            assert logprobs.text_offset[: len(ids)] == [
                len("".join(tokens[:j])) for j in range(len(ids))
            ]
            assert done.usage.completion_tokens == max_tokens
        assert text.startswith(prompt) and (max_tokens or text == prompt)
        assert len(tokens) == len(values) == len(ids) + max_tokens
        assert tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert values[0] is None
        for j in range(1, len(ids)):
            assert abs(values[j] - reference[j - 1][ids[j]]) < 1e-4, j


def test_completions_echo_prepends_the_prompt(server):
    body = {"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0, "echo": True}
    plain = httpx.post(server.url + "/v1/completions", json={**body, "echo": False}).json()
    echoed = httpx.post(server.url + "/v1/completions", json=body).json()
    assert echoed["choices"][0]["text"] == body["prompt"] + plain["choices"][0]["text"]
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**body, "stream": True}) as response:  # fmt: skip
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
    assert text == echoed["choices"][0]["text"]


def test_full_queue_answers_429_while_streams_continue(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:

        async def scenario():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                body = {"prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
                async with client.stream("POST", "/v1/completions", json=body) as running:
                    lines = running.aiter_lines()
                    await lines.__anext__()  # the first request is decoding
                    waiting = asyncio.create_task(
                        client.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
                    )
                    for _ in range(100):
                        if _metric(s.metrics(), "flashbatch_num_requests_waiting") >= 1:
                            break
                        await asyncio.sleep(0.02)
                    rejected = await client.post("/v1/completions", json={"prompt": "z"})
                    assert rejected.status_code == 429
                    assert int(rejected.headers["retry-after"]) >= 1
                    assert rejected.json()["error"]["type"] == "server_overloaded"
                    rest = [line async for line in lines if line]
                    assert rest[-1] == "data: [DONE]"
                    assert (await waiting).status_code == 200

        asyncio.run(scenario())
    finally:
        s.stop()


def test_api_key_guards_v1_but_not_probes(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, env={"FLASHBATCH_API_KEY": "sekret"})
    try:
        before = _metric(s.metrics(), "flashbatch_request_success_total")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert _metric(s.metrics(), "flashbatch_request_success_total") == before  # never reached
        ok = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                        headers={"Authorization": "Bearer sekret"})  # fmt: skip
        assert ok.status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
    finally:
        s.stop()


def test_prefix_cache_over_http_reuses_the_history_and_answers_the_same(
    qwen3_target_dir, drafter_dir
):
    """--prefix-cache-bytes sets the cache's budget: a second chat turn reuses the first
    turn's KV (usage.prompt_tokens_details.cached_tokens, the metrics count it in tokens) and
    answers what a server with the cache off (FLASHBATCH_PREFIX_CACHE_BYTES=0) answers."""
    s = ServerProcess(qwen3_target_dir, drafter_dir, "--prefix-cache-bytes", str(64 << 20))
    off = ServerProcess(qwen3_target_dir, drafter_dir, env={"FLASHBATCH_PREFIX_CACHE_BYTES": "0"})
    try:
        warm = openai.OpenAI(base_url=s.url + "/v1", api_key="unused")
        cold = openai.OpenAI(base_url=off.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "def fib(n):\n    " * 20}]
        kwargs = {"model": "qwen3", "max_tokens": 12, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}  # fmt: skip
        first = warm.chat.completions.create(messages=messages, **kwargs)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and now in C"}]  # fmt: skip
        second = warm.chat.completions.create(messages=messages, **kwargs)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
        expected = cold.chat.completions.create(messages=messages, **kwargs)
        assert second.choices[0].message.content == expected.choices[0].message.content
        values = s.metrics()
        assert _metric(values, "flashbatch_prefix_cache_hits_total") == cached
        assert _metric(values, "flashbatch_prefix_cache_queries_total") == (
            first.usage.prompt_tokens + second.usage.prompt_tokens
        )
        assert expected.usage.prompt_tokens_details.cached_tokens == 0
        assert _metric(off.metrics(), "flashbatch_prefix_cache_queries_total") == 0
    finally:
        s.stop()
        off.stop()


def test_sigterm_drains_in_flight_and_refuses_new_work(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, "--drain-timeout", "30")
    try:

        async def scenario():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                body = {"prompt": "x", "max_tokens": 300, "stream": True, "ignore_eos": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    lines = response.aiter_lines()
                    await lines.__anext__()
                    s.process.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.3)
                    assert (await client.get("/ready")).status_code == 503
                    refused = await client.post("/v1/completions", json={"prompt": "y"})
                    assert refused.status_code == 503 and "retry-after" in refused.headers
                    rest = [line async for line in lines if line]
                    assert rest[-1] == "data: [DONE]"
                    finals = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
                    assert finals[-1]["choices"][0]["finish_reason"] == "length"

        asyncio.run(scenario())
        assert s.process.wait(timeout=30) == 0  # a requested shutdown that completed: success
        s.log.seek(0)
        assert "Traceback" not in s.log.read()
    finally:
        s.stop()
