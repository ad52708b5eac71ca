"""One error path for the HTTP surface: every non-2xx answer is OpenAI's nested error body
`{"error": {"message", "type", "param", "code"}}`, with `code` a string or null.

Handlers raise; Starlette's exception handlers (registered by the server) turn typed errors
into answers here, routing errors (404, 405) included. `ErrorBoundary`, outermost, catches what
escapes everything else: it logs a real failure once and answers 500, and lets a client that
left go quietly.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import EngineClosed, EngineOverloaded, FlashbatchError, InvalidRequest
from engine.http import openai_api as api

log = logging.getLogger("flashbatch.server")


class HTTPError(Exception):
    """An answer other than 2xx: status, OpenAI error type and code, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param
        self.headers = headers or {}


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def error_response(error: HTTPError) -> Response:
    body = api.error_body(str(error), error.kind, error.code, error.param)
    return json_response(body, error.status, error.headers)


def to_http_error(exc: Exception, request: Request | None = None) -> HTTPError:
    """The answer for an error raised on purpose (ours, the engine's, or Starlette's routing)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequest):
        return HTTPError(400, str(exc), "invalid_request_error", code=exc.code, param=exc.param)
    if isinstance(exc, EngineOverloaded):
        retry = str(max(1, round(exc.retry_after)))
        return HTTPError(
            429, str(exc), "server_overloaded", code="queue_full", headers={"Retry-After": retry}
        )
    if isinstance(exc, EngineClosed):
        return HTTPError(
            503,
            str(exc),
            "service_unavailable",
            code="service_unavailable",
            headers={"Retry-After": "5"},
        )
    if isinstance(exc, HTTPException):
        return _routing_error(exc, request)
    raise TypeError(f"not an error with a planned answer: {exc!r}")


def _routing_error(exc: HTTPException, request: Request | None) -> HTTPError:
    where = "this request"
    if request is not None:
        where = f"{request.method} {path_as_sent(request.scope)}"
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return HTTPError(404, f"Invalid URL ({where})", "not_found_error", headers=headers)
    if exc.status_code == 405:
        allowed = headers.get("Allow", "")
        return HTTPError(
            405,
            f"method not allowed ({where}); allowed: {allowed}",
            "invalid_request_error",
            code="method_not_allowed",
            headers=headers,
        )
    kind = "internal_error" if exc.status_code >= 500 else "invalid_request_error"
    return HTTPError(exc.status_code, str(exc.detail), kind, headers=headers)


def path_as_sent(scope: Scope) -> str:
    """The request target's path as the client wrote it (percent-encoding kept), not
    Starlette's `request.url.path`, which is re-parsed from a URL rebuilt with the client's
    Host header (a path such as `//v1/completions` then depends on what that header holds)."""
    raw = scope.get("raw_path")
    return raw.decode("latin-1") if isinstance(raw, bytes) else scope["path"]


async def planned_error(request: Request, exc: Exception) -> Response:
    """Starlette exception handler for every error class `to_http_error` knows."""
    return error_response(to_http_error(exc, request))


async def unexpected_error(request: Request, exc: Exception) -> Response:
    """Starlette's last-resort handler: a 500 in OpenAI's shape. Starlette re-raises the
    exception afterwards; `ErrorBoundary` logs it (once)."""
    return error_response(HTTPError(500, "internal server error", "internal_error"))


def exception_handlers() -> dict:
    """Starlette's `exception_handlers` for this error path."""
    handlers: dict = {exc: planned_error for exc in (HTTPError, FlashbatchError, HTTPException)}
    handlers[Exception] = unexpected_error  # Starlette's last resort (its 500 middleware)
    return handlers


class ErrorBoundary:
    """Outermost ASGI layer: nothing escapes to uvicorn (which would log each one as an
    'Exception in ASGI application' with a traceback)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = completed = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, completed
            started = started or message["type"] == "http.response.start"
            completed = message["type"] == "http.response.body" and not message.get("more_body")
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # the client left: a normal event, counted where noticed
            log.debug("client disconnected: %s %s", scope["method"], scope["path"])
        except asyncio.CancelledError:  # a forced shutdown cancels connections still open
            log.debug("request cancelled at shutdown: %s %s", scope["method"], scope["path"])
        except Exception:
            log.exception("internal error serving %s %s", scope["method"], scope["path"])
            if not started:
                response = await unexpected_error(Request(scope), RuntimeError())
                await response(scope, receive, send)
            elif not completed:  # end the body (uvicorn would log the unfinished one)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
