"""Bounds on slow and numerous clients, at the HTTP protocol level (uvicorn's h11 protocol).

uvicorn closes idle keep-alive connections, but nothing else: a client that opens a connection
and sends half a request (or a body that never ends) holds it for as long as it likes. Here:

- a request's headers must arrive within `read_timeout` seconds of the connection opening (or
  of the previous response on a kept-alive connection), else the connection is closed;
- its body must arrive within `read_timeout` seconds after the headers, else a 408 answers it
  and the connection is closed;
- at most `max_connections` connections are open; one more is closed as soon as it is accepted;
- a connection closed while the client is still sending its body lingers (`engine/http/linger.py`)
  so that the client reads the answer (a 413, say) rather than a connection reset.

A request the HTTP parser rejects gets uvicorn's 400, in OpenAI's error shape, and its
connection closes. So does one with both `Transfer-Encoding` and `Content-Length` (RFC 9112
§6.1: h11 would read it as chunked and keep the connection, which is how request smuggling
behind a proxy starts). Each close is counted (`flashbatch_http_connections_closed_by_server_total`
by reason), not logged: a client must not be able to flood the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.http import openai_api as api
from engine.http.errors import HTTPError
from engine.http.linger import LINGER_BYTES, LINGER_IDLE_SECONDS, LINGER_SECONDS, LingeringTransport


class RequestReadTimeout(HTTPError):
    def __init__(self, seconds: float) -> None:
        super().__init__(
            408,
            f"the request body did not arrive within {seconds:g} s",
            "invalid_request_error",
            code="request_timeout",
            headers={"Connection": "close"},
        )


def guarded_protocol(
    read_timeout: float,
    max_connections: int,
    on_close: Callable[[str], None],
    linger: tuple[int, float, float] = (LINGER_BYTES, LINGER_SECONDS, LINGER_IDLE_SECONDS),
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with these bounds; `on_close(reason)` counts the closes;
    `linger` bounds a lingering close (bytes, total seconds, idle seconds)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._inner_app = self.app
            self.app = self._app_with_body_deadline
            self._header_timer: asyncio.TimerHandle | None = None
            self._reading_body = False

        # --- connection count and header deadline
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._linger = LingeringTransport(transport, self.loop, self._client_still_sending,
                                              *linger)  # fmt: skip
            super().connection_made(self._linger)  # type: ignore[arg-type]
            if len(self.connections) > max_connections:
                on_close("connection_limit")
                transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if self._linger.lingering:
                self._linger.close_now()
            super().connection_lost(exc)

        # --- lingering close
        def _client_still_sending(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

        def data_received(self, data: bytes) -> None:
            if self._linger.lingering:
                self._linger.discard(data)  # the answer is out; the rest is dropped unparsed
                return
            super().data_received(data)

        def eof_received(self) -> None:
            if self._linger.lingering:
                self._linger.close_now()  # the client has sent everything: close cleanly

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers have the same bound

        def shutdown(self) -> None:
            # A request whose body is still arriving was never taken on: close it now rather
            # than let uvicorn's graceful timeout cancel it (an ERROR line) later.
            if self._linger.lingering:
                self._linger.close_now()
                return
            if self._reading_body and not self.transport.is_closing():
                self._linger.close_now()
                return
            super().shutdown()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(read_timeout, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                on_close("read_timeout")
                self.transport.close()

        # --- body deadline
        async def _app_with_body_deadline(self, scope: Any, receive: Any, send: Any) -> None:
            self._disarm_header_timer()  # the headers are in
            if _ambiguous_framing(scope["headers"]):
                on_close("malformed_request")
                await _send_framing_400(send)
                return
            deadline = anyio.current_time() + read_timeout
            # True while part of the body is still on its way (not for a body already in).
            self._reading_body = self.cycle is not None and self.cycle.more_body

            async def receive_by_deadline() -> Any:
                if not self._reading_body:
                    return await receive()
                with anyio.move_on_after(deadline - anyio.current_time()) as wait:
                    message = await receive()
                if wait.cancelled_caught:
                    self._reading_body = False
                    on_close("read_timeout")
                    raise RequestReadTimeout(read_timeout)
                more = message["type"] == "http.request" and message.get("more_body", False)
                self._reading_body = more
                return message

            try:
                await self._inner_app(scope, receive_by_deadline, send)
            finally:
                self._reading_body = False

        # --- malformed requests: uvicorn's 400, in OpenAI's shape
        def send_400_response(self, msg: str) -> None:
            on_close("malformed_request")
            body = msgspec.json.encode(
                api.error_body(f"invalid HTTP request: {msg}", "invalid_request_error")
            )
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]  # fmt: skip
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return GuardedH11Protocol


def _ambiguous_framing(headers: list[tuple[bytes, bytes]]) -> bool:
    """Both Transfer-Encoding and Content-Length (RFC 9112 §6.1: "ought to be handled as an
    error"; a server that reads it one way behind a proxy that reads it the other is open to
    request smuggling)."""
    names = {name for name, _ in headers}
    return b"transfer-encoding" in names and b"content-length" in names


async def _send_framing_400(send: Any) -> None:
    message = ("invalid HTTP request: both Transfer-Encoding and Content-Length are set "
               "(RFC 9112 section 6.1); the connection closes")  # fmt: skip
    body = msgspec.json.encode(api.error_body(message, "invalid_request_error"))
    headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
