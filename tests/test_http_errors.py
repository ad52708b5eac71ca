"""The error path's last resort: an unexpected exception, on a real uvicorn server (in a thread
of this process, so the log records can be counted)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from engine.http.errors import ErrorBoundary, exception_handlers


async def _boom(request: Request):
    raise RuntimeError("secret detail of a bug")


async def _boom_mid_stream(request: Request):
    async def events():
        yield b"data: 1\n\n"
        raise RuntimeError("a bug after the first event")

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def buggy_server():
    routes = [Route("/boom", _boom), Route("/stream", _boom_mid_stream)]
    app = ErrorBoundary(Starlette(routes=routes, exception_handlers=exception_handlers()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # log_config=None: uvicorn's loggers propagate, so caplog sees what uvicorn would log.
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None,
                            http="h11")  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def _errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_unexpected_exception_is_a_500_in_openai_shape_logged_once(buggy_server, caplog):
    caplog.set_level(logging.INFO)
    response = httpx.get(buggy_server + "/boom", timeout=10)
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "internal server error",
                                         "type": "internal_error", "param": None,
                                         "code": None}}  # fmt: skip
    errors = _errors(caplog)
    assert len(errors) == 1 and errors[0].name == "flashbatch.server", errors
    assert errors[0].exc_info is not None  # the traceback is for the operator, once
    assert "secret detail" not in response.text


def test_unexpected_exception_mid_stream_ends_the_stream_logged_once(buggy_server, caplog):
    caplog.set_level(logging.INFO)
    with httpx.stream("GET", buggy_server + "/stream", timeout=10) as response:
        assert response.status_code == 200
        body = b"".join(response.iter_bytes())
    assert body == b"data: 1\n\n"
    time.sleep(0.2)  # let uvicorn finish the cycle (it would log an unfinished response)
    errors = _errors(caplog)
    assert len(errors) == 1 and errors[0].name == "flashbatch.server", errors
