"""The HTTP edge under malformed, hostile and departing clients, on real uvicorn processes.

One server answers the whole malformed-request corpus (each case: no 5xx, OpenAI's error shape,
nothing logged as an error, and a normal request still served right after); others check slow
clients, the connection cap and the shutdown signals.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import signal
import socket
import time
import zlib
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from test_server import ServerProcess, _metric

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LOG_ALARMS = ("Traceback", "ERROR", "Exception in ASGI", "CancelledError")


@pytest.fixture(scope="module")
def edge_server(qwen3_target_dir, tmp_path_factory):
    # The key from a file, the documented way: it stays out of the command line (`ps`).
    key_file = tmp_path_factory.mktemp("secrets") / "api-key"
    key_file.write_text(KEY + "\n")
    s = ServerProcess(qwen3_target_dir, None, "--log-level", "info", "--max-body-bytes", "65536",
                      "--api-key-file", str(key_file))  # fmt: skip
    yield s
    s.stop()


def _log_since(server: ServerProcess, offset: int) -> str:
    server.log.flush()
    with open(server.log.name) as log:
        log.seek(offset)
        return log.read()


def _log_size(server: ServerProcess) -> int:
    with open(server.log.name) as log:
        return len(log.read())


def _assert_quiet_log(text: str) -> None:
    for alarm in LOG_ALARMS:
        assert alarm not in text, f"{alarm!r} in the server log:\n{text}"


def _assert_openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)  # never the HTTP status
    return error


def _assert_still_serving(server: ServerProcess) -> None:
    body = {"prompt": "def f(", "max_tokens": 2, "temperature": 0}
    response = httpx.post(server.url + COMPLETIONS, json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


# ----------------------------------------------------------------------------- the corpus
@dataclass
class Case:
    """One malformed request: sent by httpx (method, path, body, headers) or, for what httpx
    will not send, as raw bytes on a socket."""

    name: str
    status: int | tuple[int, ...]
    body: bytes | dict | list | str | int | None = None
    path: str = COMPLETIONS
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    raw: bytes | None = None


def _nest(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


def _chat(content=None, **fields) -> dict:
    messages = [{"role": "user", "content": "hi" if content is None else content}]
    return {"messages": messages, "max_tokens": 2, **fields}


def _raw(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode("latin-1") + b"\r\n" + body


# A table: one case per line reads better than the formatter's layout.
# fmt: off
CORPUS = [
    # --- encodings and JSON syntax
    Case("empty body", 400, b""),
    Case("not JSON", 400, b"hello"),
    Case("truncated JSON", 400, b'{"prompt": "x"'),
    Case("invalid UTF-8", 400, b'{"prompt": "\xff\xfe"}'),
    Case("latin-1 bytes", 400, b'{"prompt": "caf\xe9"}'),
    Case("lone surrogate escape", 400, b'{"prompt": "a\\ud800b"}'),
    Case("lone low surrogate", 400, b'{"prompt": "a\\udc00"}'),
    Case("UTF-16 body", 400, '{"prompt": "x"}'.encode("utf-16")),
    Case("byte-order mark", 400, b'\xef\xbb\xbf{"prompt": "x"}'),
    Case("top-level array", 400, b'[{"prompt": "x"}]'),
    Case("top-level string", 400, b'"x"'),
    Case("top-level null", 400, b"null"),
    Case("top-level number", 400, b"42"),
    Case("NaN literal", 400, b'{"prompt": "x", "temperature": NaN}'),
    Case("Infinity literal", 400, b'{"prompt": "x", "temperature": Infinity}'),
    Case("trailing garbage", 400, b'{"prompt": "x"} trailing'),
    Case("two objects", 400, b'{"prompt": "x"}{"prompt": "y"}'),
    Case("single quotes", 400, b"{'prompt': 'x'}"),
    Case("unquoted key", 400, b'{prompt: "x"}'),
    Case("trailing comma", 400, b'{"prompt": "x",}'),
    Case("control character in string", 400, b'{"prompt": "a\x01b"}'),
    Case("bad escape", 400, b'{"prompt": "\\q"}'),
    Case("brotli body", 415, b"\x1b\x0e\x00\xf8", headers={**AUTH, "Content-Encoding": "br"}),
    Case("two content codings", 415, gzip.compress(gzip.compress(b'{"prompt": "x"}')),
         headers={**AUTH, "Content-Encoding": "gzip, gzip"}),
    Case("gzip header, plain body", 400, b'{"prompt": "x"}',
         headers={**AUTH, "Content-Encoding": "gzip"}),
    Case("truncated gzip", 400, gzip.compress(b'{"prompt": "x"}')[:-6],
         headers={**AUTH, "Content-Encoding": "gzip"}),
    Case("gzip bomb", 413, gzip.compress(b" " * 20_000_000),
         headers={**AUTH, "Content-Encoding": "gzip"}),
    Case("gzip, then garbage", 400, gzip.compress(b'{"prompt": "x"}') + b"junk",
         headers={**AUTH, "Content-Encoding": "gzip"}),
    Case("form-encoded body", 400, b"prompt=x&max_tokens=2",
         headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"}),
    Case("multipart body", 400,
         b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n--b--',
         headers={**AUTH, "Content-Type": "multipart/form-data; boundary=b"}),
    # --- nesting
    Case("990 levels, ignored field", 400, f'{{"prompt": "x", "junk": {_nest(990)}}}'.encode()),
    Case("30000 levels", 400, f'{{"prompt": "x", "junk": {_nest(30_000)}}}'.encode()),
    Case("65 levels of objects", 400, b'{"a":' * 65 + b"1" + b"}" * 65),
    Case("deep prompt list", 400, f'{{"prompt": {_nest(50)}}}'.encode()),
    Case("deep content part", 400, json.dumps(_chat([{"type": "text", "text": "x",
         "extra": json.loads(_nest(60))}])).encode(), path=CHAT),
    # --- types and ranges (completions)
    Case("no prompt", 400, {"max_tokens": 2}),
    Case("prompt number", 400, {"prompt": 5}),
    Case("prompt null", 400, {"prompt": None}),
    Case("prompt bool", 400, {"prompt": True}),
    Case("prompt object", 400, {"prompt": {"text": "x"}}),
    Case("prompt empty list", 400, {"prompt": []}),
    Case("prompt empty string", 400, {"prompt": ""}),
    Case("prompt list of empty list", 400, {"prompt": [[]]}),
    Case("prompt batch with an empty string", 400, {"prompt": ["a", ""]}),
    Case("prompt batch with an empty id list", 400, {"prompt": [[1, 2], []]}),
    Case("prompt float ids", 400, {"prompt": [1.5, 2]}),
    Case("prompt bool ids", 400, {"prompt": [True, False]}),
    Case("prompt negative id", 400, {"prompt": [-1]}),
    Case("prompt id past vocabulary", 400, {"prompt": [10**9]}),
    Case("prompt id past int64", 400, {"prompt": [2**70]}),
    Case("prompt mixed list", 400, {"prompt": ["a", 1]}),
    Case("context overflow", 400, {"prompt": "x " * 3000, "max_tokens": 2000}),
    Case("max_tokens string", 400, {"prompt": "x", "max_tokens": "10"}),
    Case("max_tokens zero", 400, {"prompt": "x", "max_tokens": 0}),
    Case("max_tokens negative", 400, {"prompt": "x", "max_tokens": -1}),
    Case("max_tokens float", 400, {"prompt": "x", "max_tokens": 1.5}),
    Case("max_tokens bool", 400, {"prompt": "x", "max_tokens": True}),
    Case("max_tokens huge", 400, {"prompt": "x", "max_tokens": 10**30}),
    Case("max_tokens over the cap", 400, {"prompt": "x", "max_tokens": 5000}),
    Case("temperature string", 400, {"prompt": "x", "temperature": "hot"}),
    Case("temperature negative", 400, {"prompt": "x", "temperature": -0.5}),
    Case("temperature overflow", 400, b'{"prompt": "x", "temperature": 1e999}'),
    Case("temperature list", 400, {"prompt": "x", "temperature": [1]}),
    Case("top_p zero", 400, {"prompt": "x", "top_p": 0}),
    Case("top_p above one", 400, {"prompt": "x", "top_p": 1.5}),
    Case("top_p string", 400, {"prompt": "x", "top_p": "x"}),
    Case("top_k below -1", 400, {"prompt": "x", "top_k": -2}),
    Case("top_k float", 400, {"prompt": "x", "top_k": 1.5}),
    Case("min_p above one", 400, {"prompt": "x", "min_p": 2}),
    Case("min_p negative", 400, {"prompt": "x", "min_p": -0.1}),
    Case("seed negative", 400, {"prompt": "x", "seed": -1}),
    Case("seed past 64 bits", 400, {"prompt": "x", "seed": 2**64}),
    Case("seed string", 400, {"prompt": "x", "seed": "x"}),
    Case("stop number", 400, {"prompt": "x", "stop": 5}),
    Case("stop numbers", 400, {"prompt": "x", "stop": [1, 2]}),
    Case("stop empty string", 400, {"prompt": "x", "stop": ""}),
    Case("stop list with empty string", 400, {"prompt": "x", "stop": [""]}),
    Case("stop nested list", 400, {"prompt": "x", "stop": [["a"]]}),
    Case("stop object", 400, {"prompt": "x", "stop": {"a": 1}}),
    Case("stop_token_ids string", 400, {"prompt": "x", "stop_token_ids": "1"}),
    Case("stop_token_ids negative", 400, {"prompt": "x", "stop_token_ids": [-1]}),
    Case("stop_token_ids past vocabulary", 400, {"prompt": "x", "stop_token_ids": [10**12]}),
    Case("n zero", 400, {"prompt": "x", "n": 0}),
    Case("n two", 400, {"prompt": "x", "n": 2}),
    Case("n string", 400, {"prompt": "x", "n": "1"}),
    Case("stream string", 400, {"prompt": "x", "stream": "yes"}),
    Case("stream number", 400, {"prompt": "x", "stream": 1}),
    Case("stream_options string", 400, {"prompt": "x", "stream": True, "stream_options": "x"}),
    Case("include_usage string", 400, {"prompt": "x", "stream_options": {"include_usage": "y"}}),
    Case("ignore_eos string", 400, {"prompt": "x", "ignore_eos": "x"}),
    Case("num_speculative_tokens negative", 400, {"prompt": "x", "num_speculative_tokens": -1}),
    Case("num_speculative_tokens string", 400, {"prompt": "x", "num_speculative_tokens": "3"}),
    Case("model number", 400, {"prompt": "x", "model": 5}),
    Case("unknown model", 404, {"prompt": "x", "model": "other"}),
    Case("user number", 400, {"prompt": "x", "user": 5}),
    # --- sizes
    Case("body over the limit", 413, b'{"prompt": "' + b"x" * 70_000 + b'"}'),
    Case("declared length over the limit", 413, b'{"prompt": "x"}',
         raw=_raw(f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY}\n"
                  "Content-Length: 1000000000000\nConnection: close\n")),
    Case("long prompt string", 400, {"prompt": "word " * 12_000, "max_tokens": 2}),
    Case("many stop strings", 400, {"prompt": "x", "stop": ["a"] * 5000 + [""]}),
    # --- chat content
    Case("messages missing", 400, {"max_tokens": 2}, path=CHAT),
    Case("messages null", 400, {"messages": None}, path=CHAT),
    Case("messages object", 400, {"messages": {"role": "user"}}, path=CHAT),
    Case("messages string", 400, {"messages": "hi"}, path=CHAT),
    Case("messages empty", 400, {"messages": []}, path=CHAT),
    Case("message number", 400, {"messages": [1]}, path=CHAT),
    Case("message without role", 400, {"messages": [{"content": "hi"}]}, path=CHAT),
    Case("role number", 400, {"messages": [{"role": 5, "content": "hi"}]}, path=CHAT),
    Case("content number", 400, _chat(5), path=CHAT),
    Case("content object", 400, _chat({"type": "text", "text": "x"}), path=CHAT),
    Case("content part number", 400, _chat([5]), path=CHAT),
    Case("content part string", 400, _chat(["hi"]), path=CHAT),
    Case("text part without text", 400, _chat([{"type": "text"}]), path=CHAT),
    Case("text part text number", 400, _chat([{"type": "text", "text": 123}]), path=CHAT),
    Case("text part text null", 400, _chat([{"type": "text", "text": None}]), path=CHAT),
    Case("text part text list", 400, _chat([{"type": "text", "text": ["a"]}]), path=CHAT),
    Case("text part text object", 400, _chat([{"type": "text", "text": {"a": 1}}]), path=CHAT),
    Case("part without type", 400, _chat([{"text": "x"}]), path=CHAT),
    Case("part type number", 400, _chat([{"type": 5, "text": "x"}]), path=CHAT),
    Case("image part", 400, _chat([{"type": "image_url", "image_url": {"url": "x"}}]), path=CHAT),
    Case("text then audio part", 400,
         _chat([{"type": "text", "text": "a"}, {"type": "input_audio"}]), path=CHAT),
    Case("max_completion_tokens zero", 400, _chat(max_completion_tokens=0), path=CHAT),
    Case("max_completion_tokens negative", 400, _chat(max_completion_tokens=-5), path=CHAT),
    Case("max_completion_tokens string", 400, _chat(max_completion_tokens="5"), path=CHAT),
    Case("max_completion_tokens over the cap", 400, _chat(max_completion_tokens=5000), path=CHAT),
    Case("chat max_tokens zero", 400, _chat(max_tokens=0), path=CHAT),
    # --- routes and methods
    Case("GET completions", 405, method="GET"),
    Case("PUT chat", 405, method="PUT", path=CHAT, body={}),
    Case("DELETE chat", 405, method="DELETE", path=CHAT),
    Case("POST models", 405, method="POST", path="/v1/models", body={}),
    Case("DELETE models", 405, method="DELETE", path="/v1/models"),
    Case("POST health", 405, method="POST", path="/health", body={}),
    Case("PATCH ready", 405, method="PATCH", path="/ready", body={}),
    Case("POST metrics", 405, method="POST", path="/metrics", body={}),
    Case("OPTIONS completions", 405, method="OPTIONS"),
    Case("unknown path", 404, method="GET", path="/nope"),
    Case("unknown v1 path", 404, method="POST", path="/v1/embeddings", body={"input": "x"}),
    Case("path with a suffix", 404, method="POST", path="/v1/completions/x", body={}),
    Case("trailing slash", 404, {"prompt": "x"}, path="/v1/completions/"),
    Case("trailing slash, chat", 404, _chat(), path="/v1/chat/completions/"),
    Case("trailing slash, GET", 404, method="GET", path="/v1/models/"),
    Case("upper-case path", 404, method="GET", path="/V1/MODELS"),
    Case("double slash", 404, method="GET", path="//v1/models"),
    Case("percent-encoded junk", 404, method="GET", path="/%ff%fe"),
    Case("root", 404, method="GET", path="/"),
    Case("dot segments", 404, raw=_raw("GET /v1/../../etc/passwd HTTP/1.1\nHost: t\n"
                                      "Connection: close\n")),
    # --- headers and HTTP framing
    Case("no API key", 401, {"prompt": "x"}, headers={}),
    Case("wrong API key", 401, {"prompt": "x"}, headers={"Authorization": "Bearer wrong"}),
    Case("key without scheme", 401, {"prompt": "x"}, headers={"Authorization": KEY}),
    Case("basic auth", 401, {"prompt": "x"}, headers={"Authorization": "Basic c2VrcmV0Og=="}),
    Case("empty bearer", 401, {"prompt": "x"}, headers={"Authorization": "Bearer"}),
    Case("key in the query string only", 401, {"prompt": "x"}, path=COMPLETIONS + f"?key={KEY}",
         headers={}),
    Case("models without key", 401, method="GET", path="/v1/models", headers={}),
    Case("non-ASCII authorization", 401,
         raw=_raw(f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nAuthorization: Bearer s\xe9kret\n"
                  "Content-Length: 2\nConnection: close\n", b"{}")),
    Case("garbage request line", 400, raw=b"GARBAGE\r\n\r\n"),
    Case("HTTP/2 preface", (400, 404), raw=b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    Case("no Host header", 400, raw=_raw("GET /health HTTP/1.1\nConnection: close\n")),
    Case("bad Content-Length", 400,
         raw=_raw(f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nContent-Length: abc\n")),
    Case("two Content-Lengths", 400,
         raw=_raw(f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nContent-Length: 2\n"
                  "Content-Length: 3\n", b"{}")),
    Case("Content-Length and chunked", 400,
         raw=_raw(f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY}\n"
                  "Content-Length: 2\nTransfer-Encoding: chunked\n",
                  b"2\r\n{}\r\n0\r\n\r\n")),
    Case("bad chunk size", 400,
         raw=_raw(f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY}\n"
                  "Transfer-Encoding: chunked\n", b"zz\r\n{}\r\n0\r\n\r\n")),
    Case("NUL byte in a header", 400, raw=_raw("GET /health HTTP/1.1\nHost: t\nX-Bad: a\x00b\n")),
    Case("header without colon", 400, raw=_raw("GET /health HTTP/1.1\nHost: t\nNoColon\n")),
    Case("oversized header", 400,
         raw=_raw(f"GET /health HTTP/1.1\nHost: t\nX-Big: {'a' * 300_000}\n")),
    Case("long URL", (400, 404), raw=_raw(f"GET /{'a' * 70_000} HTTP/1.1\nHost: t\n")),
    Case("text/plain, invalid", 400, b"{", headers={**AUTH, "Content-Type": "text/plain"}),
]
# fmt: on


def _send_raw(server: ServerProcess, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        chunks = []
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                chunks.append(chunk)
                if _complete(b"".join(chunks)):
                    break
        except (BrokenPipeError, ConnectionResetError):
            assert chunks, "the server closed the connection without an answer"
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    if "content-length" in headers:  # the first answer only (pipelined input may get more)
        body = body[: int(headers["content-length"])]
    return int(lines[0].split()[1]), headers, body


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b": ")
        if sep and name.lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: read until the server closes


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_malformed_request_gets_an_openai_error_and_the_server_carries_on(edge_server, case):
    offset = _log_size(edge_server)
    if case.raw is not None:
        status, headers, body = _send_raw(edge_server, case.raw)
    else:
        content = case.body
        if not isinstance(content, bytes) and content is not None:
            content = json.dumps(content).encode()
        headers = {"Content-Type": "application/json", **case.headers}
        if content is None:
            headers.pop("Content-Type")
        response = httpx.request(case.method, edge_server.url + case.path, content=content,
                                 headers=headers, timeout=30)  # fmt: skip
        status, headers, body = response.status_code, response.headers, response.content
    expected = case.status if isinstance(case.status, tuple) else (case.status,)
    assert status in expected, body
    error = _assert_openai_error(body)
    if status == 401:
        assert headers["www-authenticate"] == "Bearer"
    if status == 405:
        assert "GET" in headers["allow"] or "POST" in headers["allow"]
    if status == 404 and case.raw is None and "model" not in (error["param"] or ""):
        # "Invalid URL (GET /nope)", as OpenAI words it, with the path as sent
        assert f"({case.method} {case.path.split('?')[0]})" in error["message"]
    assert "location" not in headers  # never a redirect
    _assert_still_serving(edge_server)
    log = _log_since(edge_server, offset)
    _assert_quiet_log(log)
    assert "WARNING" not in log  # malformed HTTP is counted, not logged line by line


EXTREME_BUT_VALID = [
    {"top_k": 10**18},
    {"top_k": -1},
    {"num_speculative_tokens": 2**63},
    {"temperature": 1e308},
    {"temperature": 1e-300},
    {"top_p": 1e-300},
    {"min_p": 1.0},
    {"seed": 2**63 - 1},
    {"stop": ["a" * 10_000]},
    {"stop": ["\u0000"]},
    {"stop_token_ids": [0] * 5_000},
    {"prompt": [0] * 1_500, "max_tokens": 1},
    {"prompt": "\u0000\u0001\u007f"},
    {"prompt": "\U0001f600" * 200},
]


@pytest.mark.parametrize("extra", EXTREME_BUT_VALID, ids=[str(e)[:40] for e in EXTREME_BUT_VALID])
def test_extreme_but_valid_values_are_served(edge_server, extra):
    """The other side of validation: what is valid, however odd, gets an answer, streamed too."""
    offset = _log_size(edge_server)
    body = {"prompt": "def f(", "max_tokens": 4, **extra}
    url = edge_server.url + COMPLETIONS
    done = httpx.post(url, json=body, headers=AUTH, timeout=60)
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["finish_reason"] in ("length", "stop")
    streamed = httpx.post(url, json={**body, "stream": True}, headers=AUTH, timeout=60)
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    _assert_quiet_log(_log_since(edge_server, offset))


def test_corpus_is_broad():
    assert len(CORPUS) >= 150
    assert len({c.name for c in CORPUS}) == len(CORPUS)


def test_malformed_http_is_counted(edge_server):
    name = "flashbatch_http_connections_closed_by_server_total"
    before = _metric(edge_server.metrics(), name, reason="malformed_request")
    status, _, body = _send_raw(edge_server, b"GARBAGE\r\n\r\n")
    assert status == 400 and _assert_openai_error(body)
    assert _wait_for(lambda: _metric(edge_server.metrics(), name, reason="malformed_request")
                     == before + 1)  # fmt: skip


# ----------------------------------------------------------------------------- clients leaving
def _disconnects(server: ServerProcess, phase: str) -> float:
    name = "flashbatch_http_requests_client_disconnected_total"
    return _metric(server.metrics(), name, phase=phase)


def _wait_for(predicate, seconds: float = 20.0) -> bool:
    """A bounded wait; a request refused meanwhile (a closing connection still counted against
    a small cap, say) counts as not yet."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def test_hang_up_mid_body_is_counted_not_logged(edge_server):
    offset, before = _log_size(edge_server), _disconnects(edge_server, "upload")
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")  # fmt: skip
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", edge_server.port), timeout=10) as sock:
            sock.sendall(head.encode() + b'{"prompt": "abc')
            time.sleep(0.1)  # the server is waiting for the rest of the body
    assert _wait_for(lambda: _disconnects(edge_server, "upload") >= before + 5)
    _assert_still_serving(edge_server)
    log = _log_since(edge_server, offset)
    _assert_quiet_log(log)
    assert "WARNING" not in log


async def test_leaving_a_stream_or_a_wait_is_counted_not_logged(edge_server):
    offset = _log_size(edge_server)
    stream_before = _disconnects(edge_server, "stream")
    wait_before = _disconnects(edge_server, "wait")
    running = "flashbatch_num_requests_running"
    body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=edge_server.url, headers=AUTH, timeout=30) as client:
        async with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk
    assert _wait_for(lambda: _disconnects(edge_server, "stream") >= stream_before + 1)
    assert _wait_for(lambda: _metric(edge_server.metrics(), running) == 0)

    async with httpx.AsyncClient(base_url=edge_server.url, headers=AUTH, timeout=30) as client:
        waiting = asyncio.create_task(client.post(COMPLETIONS, json=body))
        for _ in range(200):
            if _metric(edge_server.metrics(), running) >= 1:
                break
            await asyncio.sleep(0.05)
        waiting.cancel()  # the client gives up on the non-streamed answer
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert _wait_for(lambda: _disconnects(edge_server, "wait") >= wait_before + 1)
    assert _wait_for(lambda: _metric(edge_server.metrics(), running) == 0)
    _assert_still_serving(edge_server)
    _assert_quiet_log(_log_since(edge_server, offset))


# ----------------------------------------------------------------------------- small points
def test_access_log_redacts_query_strings(edge_server):
    secret = "sk-querysecret-1234"
    offset = _log_size(edge_server)
    models = httpx.get(edge_server.url + f"/v1/models?api_key={secret}", headers=AUTH)
    assert models.status_code == 200
    assert httpx.get(edge_server.url + f"/nope?token={secret}&x=1").status_code == 404
    assert _wait_for(lambda: "/nope?[redacted]" in _log_since(edge_server, offset))
    log = _log_since(edge_server, offset)
    assert '"GET /v1/models?[redacted] HTTP/1.1" 200' in log
    assert secret not in log and "token=" not in log


def test_metrics_carry_no_created_series(edge_server):
    text = httpx.get(edge_server.url + "/metrics").text
    assert "flashbatch_request_success_total" in text
    assert "_created" not in text


# ----------------------------------------------------------------------------- issue 45
def test_api_key_file_keeps_the_key_out_of_the_command_line(edge_server):
    with open(f"/proc/{edge_server.process.pid}/cmdline", "rb") as cmdline:
        assert KEY.encode() not in cmdline.read()
    url = edge_server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=AUTH).status_code == 200


async def _chunks(total: int, size: int = 1 << 20):
    prefix, sent = b'{"prompt": "', 0
    yield prefix
    while sent < total:
        yield b"x" * min(size, total - sent)
        sent += size
    yield b'"}'


@pytest.mark.parametrize("megabytes", [2, 5, 50])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_early_413_reaches_async_clients(edge_server, megabytes, framing):
    """The 413 is sent before the body is read; the lingering close lets clients that write
    the whole body before reading (httpx.AsyncClient, AsyncOpenAI) read it: no reset."""
    offset = _log_size(edge_server)
    size = megabytes << 20
    async with httpx.AsyncClient(base_url=edge_server.url, headers=AUTH, timeout=60) as client:
        if framing == "chunked":  # no Content-Length: the limit is found while reading
            response = await client.post(COMPLETIONS, content=_chunks(size))
        else:
            response = await client.post(COMPLETIONS, json={"prompt": "x" * size})
        assert response.status_code == 413, response.text
        assert _assert_openai_error(response.content)["code"] == "request_too_large"
        assert response.headers["connection"] == "close"
        followed = await client.get("/v1/models")  # the pool opens a new connection
        assert followed.status_code == 200
    if framing == "content-length":
        model = followed.json()["data"][0]["id"]
        client = openai.AsyncOpenAI(base_url=edge_server.url + "/v1", api_key=KEY,
                                    max_retries=0, timeout=60)  # fmt: skip
        try:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.completions.create(model=model, prompt="x" * size, max_tokens=1)
        finally:
            await client.close()
        assert caught.value.status_code == 413
        assert caught.value.body["code"] == "request_too_large"
    _assert_quiet_log(_log_since(edge_server, offset))


async def test_malformed_corpus_with_an_async_client(edge_server):
    """The corpus again, through one httpx.AsyncClient, eight at a time: the same answers."""
    cases = [case for case in CORPUS if case.raw is None]
    limit = asyncio.Semaphore(8)

    async def send(client: httpx.AsyncClient, case: Case) -> tuple[Case, httpx.Response]:
        content = case.body
        if not isinstance(content, bytes) and content is not None:
            content = json.dumps(content).encode()
        headers = {"Content-Type": "application/json", **case.headers}
        if content is None:
            headers.pop("Content-Type")
        async with limit:
            return case, await client.request(case.method, case.path, content=content,
                                              headers=headers)  # fmt: skip

    offset = _log_size(edge_server)
    async with httpx.AsyncClient(base_url=edge_server.url, timeout=60) as client:
        answers = await asyncio.gather(*(send(client, case) for case in cases))
    for case, response in answers:
        expected = case.status if isinstance(case.status, tuple) else (case.status,)
        assert response.status_code in expected, (case.name, response.text)
        _assert_openai_error(response.content)
    _assert_still_serving(edge_server)
    _assert_quiet_log(_log_since(edge_server, offset))


def test_trailing_slash_is_a_404_not_a_redirect_built_from_host(edge_server):
    request = (f"POST {COMPLETIONS}/ HTTP/1.1\nHost: evil.example\n"
               f"Authorization: Bearer {KEY}\nContent-Type: application/json\n"
               "Content-Length: 15\nConnection: close\n")  # fmt: skip
    status, headers, body = _send_raw(edge_server, _raw(request, b'{"prompt": "x"}'))
    assert status == 404 and "location" not in headers
    error = _assert_openai_error(body)
    assert error["message"] == f"Invalid URL (POST {COMPLETIONS}/)"


def test_double_slash_path_is_reported_as_sent(edge_server):
    request = f"POST /{COMPLETIONS} HTTP/1.1\nHost: t\nContent-Length: 2\nConnection: close\n"
    status, _, body = _send_raw(edge_server, _raw(request, b"{}"))
    assert status == 404
    assert _assert_openai_error(body)["message"] == f"Invalid URL (POST /{COMPLETIONS})"


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    sock.settimeout(30)
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_transfer_encoding_with_content_length_is_a_400_and_closes(edge_server):
    """RFC 9112 section 6.1: a well-formed chunked body beside a Content-Length, on a
    keep-alive connection, with a second request behind it (what a smuggler would hide)."""
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = (f"POST {COMPLETIONS} HTTP/1.1\nHost: t\nAuthorization: Bearer {KEY}\n"
            f"Content-Type: application/json\nContent-Length: {len(chunked)}\n"
            "Transfer-Encoding: chunked\n")  # fmt: skip
    behind = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    with socket.create_connection(("127.0.0.1", edge_server.port), timeout=30) as sock:
        sock.sendall(_raw(head, chunked) + behind)
        answer = _read_all(sock)  # ends: the server closed the connection
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1  # the request behind it was not served
    head_part, _, error_body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head_part.lower()
    assert "Transfer-Encoding" in _assert_openai_error(error_body)["message"]


def test_gzip_and_deflate_bodies_are_decoded(edge_server):
    body = json.dumps({"prompt": "def f(", "max_tokens": 2, "temperature": 0}).encode()
    plain = httpx.post(edge_server.url + COMPLETIONS, content=body, timeout=30,
                       headers={**AUTH, "Content-Type": "application/json"})  # fmt: skip
    assert plain.status_code == 200
    for coding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        headers = {**AUTH, "Content-Type": "application/json", "Content-Encoding": coding}
        answer = httpx.post(edge_server.url + COMPLETIONS, content=data, headers=headers,
                            timeout=30)  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_decoded_size_counts_against_the_body_limit(edge_server):
    """Under the limit as sent, over it decoded: a 413 (the limit is 64 KiB here)."""
    headers = {**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    fits = json.dumps({"prompt": "x" * 60_000, "max_tokens": 1}).encode()
    over = json.dumps({"prompt": "x" * 70_000, "max_tokens": 1}).encode()
    url = edge_server.url + COMPLETIONS
    fitting = httpx.post(url, content=gzip.compress(fits), headers=headers, timeout=30)
    assert fitting.status_code != 413, fitting.text  # (a 400: longer than this model's context)
    answer = httpx.post(url, content=gzip.compress(over), headers=headers, timeout=30)
    assert answer.status_code == 413
    assert _assert_openai_error(answer.content)["code"] == "request_too_large"
    unsupported = httpx.post(url, content=b"x", headers={**headers, "Content-Encoding": "zstd"})
    assert unsupported.status_code == 415
    assert _assert_openai_error(unsupported.content)["code"] == "unsupported_content_encoding"


# ----------------------------------------------------------------------------- slow clients
@pytest.fixture(scope="module")
def guarded_server(qwen3_target_dir):
    # One setting by flag, one by environment variable: both ways are the documented ones.
    s = ServerProcess(qwen3_target_dir, None, "--log-level", "info", "--request-read-timeout", "1",
                      env={"FLASHBATCH_MAX_CONNECTIONS": "3"})  # fmt: skip
    yield s
    s.stop()


def _closed_by_server(server: ServerProcess, reason: str) -> float:
    name = "flashbatch_http_connections_closed_by_server_total"
    return _metric(server.metrics(), name, reason=reason)


def _read_until_closed(sock: socket.socket, seconds: float = 15.0) -> bytes:
    sock.settimeout(seconds)  # a bounded wait: the server closes long before
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_slow_clients_are_timed_out(guarded_server):
    offset = _log_size(guarded_server)
    before = _closed_by_server(guarded_server, "read_timeout")
    port = guarded_server.port
    with socket.create_connection(("127.0.0.1", port)) as idle, \
            socket.create_connection(("127.0.0.1", port)) as half_headers, \
            socket.create_connection(("127.0.0.1", port)) as half_body:  # fmt: skip
        half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # fmt: skip
        assert _read_until_closed(idle) == b""
        assert _read_until_closed(half_headers) == b""
        answer = _read_until_closed(half_body)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert _assert_openai_error(body)["code"] == "request_timeout"
    assert _wait_for(lambda: _closed_by_server(guarded_server, "read_timeout") >= before + 3)
    body = {"prompt": "x", "max_tokens": 2}
    url = guarded_server.url + COMPLETIONS
    assert _wait_for(lambda: httpx.post(url, json=body, timeout=30).status_code == 200)
    _assert_quiet_log(_log_since(guarded_server, offset))


def test_connections_past_the_cap_are_closed_at_once(guarded_server):
    before = _closed_by_server(guarded_server, "connection_limit")
    port = guarded_server.port
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        with socket.create_connection(("127.0.0.1", port)) as surplus:
            try:
                surplus.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert _read_until_closed(surplus) == b""  # closed without an answer
    finally:
        for sock in held:
            sock.close()
    assert _wait_for(lambda: _closed_by_server(guarded_server, "connection_limit") == before + 1)
    assert _wait_for(lambda: httpx.get(guarded_server.url + "/health").status_code == 200)


# ----------------------------------------------------------------------------- shutdown
def test_second_signal_aborts_streams_with_a_final_chunk_and_exit_0(qwen3_target_dir):
    s = ServerProcess(qwen3_target_dir, None, "--drain-timeout", "120", "--log-level", "info")
    try:

        async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> list[str]:
            body = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            lines = []
            async with client.stream("POST", COMPLETIONS, json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line:
                        lines.append(line)
                        started.set()
            return lines

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
                events = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(stream(client, e)) for e in events]
                answer = asyncio.create_task(
                    client.post(
                        COMPLETIONS, json={"prompt": "y", "max_tokens": 3000, "ignore_eos": True}
                    )  # fmt: skip
                )
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
                half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                                  b"Content-Length: 100\r\n\r\n{")  # fmt: skip
                s.process.send_signal(signal.SIGTERM)  # drain: the streams go on
                await asyncio.sleep(1.0)
                assert not any(t.done() for t in streams) and not answer.done()
                s.process.send_signal(signal.SIGTERM)  # abort now
                results = await asyncio.wait_for(asyncio.gather(*streams), 30)
                for lines in results:
                    assert lines[-1] == "data: [DONE]"
                    chunks = [json.loads(x[6:]) for x in lines[:-1]]
                    finals = [c for c in chunks if c["choices"]]
                    assert finals[-1]["choices"][0]["finish_reason"] == "abort"
                    assert chunks[-1]["usage"]["completion_tokens"] < 3000
                done = await asyncio.wait_for(answer, 30)
                assert done.status_code == 200
                assert done.json()["choices"][0]["finish_reason"] == "abort"

        # A request still uploading when the signal comes is closed, not waited for.
        with socket.create_connection(("127.0.0.1", s.port)) as half_body:
            asyncio.run(scenario())
            assert _read_until_closed(half_body) == b""
        assert s.process.wait(timeout=30) == 0
        s.log.seek(0)
        _assert_quiet_log(s.log.read())
    finally:
        s.stop()
