"""The lingering close's bounds, on a real uvicorn server with the guarded h11 protocol (in a
thread of this process, small bounds): within them the client reads the early answer and a
clean end; past the byte bound or the idle bound the server closes anyway."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from engine.http.guard import guarded_protocol

LINGER_BYTES = 1 << 20
ANSWER = b'{"error": {"message": "too large", "type": "x", "param": null, "code": null}}'


async def _answer_at_once(scope, receive, send) -> None:
    """Answers 413 without reading the body, as the server does for a declared length."""
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
               (b"content-length", str(len(ANSWER)).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


@pytest.fixture(scope="module")
def port():
    closes: list[str] = []
    protocol = guarded_protocol(30.0, 100, closes.append, linger=(LINGER_BYTES, 5.0, 0.5))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    config = uvicorn.Config(_answer_at_once, host="127.0.0.1", port=free, lifespan="off",
                            log_config=None, http=protocol)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield free
    server.should_exit = True
    thread.join(timeout=30)


def _head(length: int) -> bytes:
    return (f"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: {length}\r\n\r\n").encode()


def _read_to_end(sock: socket.socket) -> tuple[bytes, bool]:
    """What arrives until the connection ends, and whether it ended cleanly (EOF, no reset)."""
    data = b""
    sock.settimeout(20)  # a bound on the test; the server's own bounds are far shorter
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        return data, False
    return data, True


def test_a_client_that_sends_everything_first_reads_the_answer(port):
    body = b"x" * (LINGER_BYTES // 2)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head(len(body)) + body)  # all of it, before reading: as async clients do
        time.sleep(0.2)
        sock.shutdown(socket.SHUT_WR)
        data, clean = _read_to_end(sock)
    assert data.startswith(b"HTTP/1.1 413 ") and data.endswith(ANSWER)
    assert clean


def test_past_the_byte_bound_the_server_closes(port):
    declared, sent = 200 << 20, 0
    chunk = b"x" * (256 << 10)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(20)
        sock.sendall(_head(declared))
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < declared:
                sock.sendall(chunk)
                sent += len(chunk)
    assert sent < declared // 4  # the bound (plus socket buffers), not the whole body


def test_an_idle_client_is_closed_after_the_idle_bound(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_head(10 << 20) + b"x" * 1000)  # then nothing more
        data, _ = _read_to_end(sock)  # ends: the server closed after its idle bound
    assert data.startswith(b"HTTP/1.1 413 ") and data.endswith(ANSWER)
