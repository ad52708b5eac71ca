"""OpenAI-compatible HTTP server: Starlette on uvicorn (uvloop), handlers thin over AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (liveness),
GET /ready (503 while loading or draining), GET /metrics (Prometheus).

Errors use OpenAI's nested body `{"error": {message, type, param, code}}`: 400 validation and
context overflow, 401 bad or missing API key, 404 unknown model, 413 body too large, 429 with
Retry-After when the engine's queue is full, 503 while loading or draining. SIGTERM: readiness
turns 503 and new requests get 503 while in-flight ones finish (up to the drain timeout); then
the process exits. A client disconnect aborts its request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine import openai_api as api
from engine.async_engine import AsyncEngine
from engine.errors import EngineClosed, EngineOverloaded, InvalidRequest

log = logging.getLogger("flashbatch.server")


@dataclass
class ServerSettings:
    api_key: str | None = None  # required as `Authorization: Bearer ...` on /v1/* when set
    protect_metrics: bool = False  # also require the key on /metrics
    max_body_bytes: int = 1 << 20
    max_tokens_cap: int = 4096  # the most tokens one request may ask for
    drain_timeout: float = 30.0


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, headers: dict | None = None,
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.headers, self.param = status, kind, headers or {}, param


def _json(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def _error_response(error: HTTPError) -> Response:
    return _json(api.error_body(str(error), error.kind, error.status, error.param), error.status,
                 error.headers)  # fmt: skip


def _translate(exc: Exception) -> HTTPError:
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, InvalidRequest):
        return HTTPError(400, str(exc), "invalid_request_error")
    if isinstance(exc, EngineOverloaded):
        retry = str(max(1, round(exc.retry_after)))
        return HTTPError(429, str(exc), "server_overloaded", {"Retry-After": retry})
    if isinstance(exc, EngineClosed):
        return HTTPError(503, str(exc), "service_unavailable", {"Retry-After": "5"})
    log.exception("internal error")
    return HTTPError(500, "internal server error", "internal_error")


class FlashbatchServer:
    """The routes, bound to one engine."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.draining = False
        self._load_task: asyncio.Task | None = None

    # ----------------------------------------------------------------- app
    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Load in the background so /health answers (and /ready says 503) while loading.
        self._load_task = asyncio.create_task(self.engine.start())
        self._load_task.add_done_callback(_log_load_failure)
        yield
        if not self._load_task.done():
            self._load_task.cancel()
        await self.engine.shutdown(drain_timeout=0)

    async def drain(self) -> None:
        """Stop taking requests and let in-flight ones finish (up to the drain timeout)."""
        self.draining = True
        await self.engine.shutdown(drain_timeout=self.settings.drain_timeout)

    # ----------------------------------------------------------------- probes
    async def health(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.engine.ready and not self.draining:
            return _json({"status": "ready", "model": self.engine.model_name})
        state = "draining" if self.draining else "loading"
        return _json({"status": state}, 503, {"Retry-After": "5"})

    async def metrics(self, request: Request) -> Response:
        if self.settings.protect_metrics and (error := self._auth_error(request)):
            return _error_response(error)
        return Response(self.engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        if error := self._auth_error(request):
            return _error_response(error)
        created = int(time.time())
        card = {"id": self.engine.model_name, "object": "model", "created": created,
                "owned_by": "flashbatch"}  # fmt: skip
        return _json({"object": "list", "data": [card]})

    # ----------------------------------------------------------------- generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            if error := self._auth_error(request):
                raise error
            body = await self._read_body(request)
            if self.draining or not self.engine.ready:
                raise EngineClosed("the server is not ready (loading or draining); retry shortly")
            kind = api.ChatCompletionRequest if chat else api.CompletionRequest
            parsed = api.decode_request(body, kind)
            self._check_model(parsed.model)
            prompt, max_tokens = self._prompt(parsed, chat)
            params = api.sampling_params(parsed, max_tokens)
            request_id, stream = self.engine.add_request(prompt, params)
        except Exception as exc:  # noqa: BLE001  (every failure becomes an OpenAI error body)
            return _error_response(_translate(exc))
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        outputs = self.engine.outputs(request_id, stream)
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            events = self._sse(outputs, rid, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await self._collect(request, outputs, rid, chat)

    def _prompt(self, parsed: Any, chat: bool) -> tuple[Any, int]:
        cap = self.settings.max_tokens_cap
        if chat:
            messages = api.chat_messages(parsed.messages)
            tokenizer = self.engine.tokenizer
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidRequest("this model has no chat template; use /v1/completions")
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            requested = parsed.max_completion_tokens or parsed.max_tokens
            if requested is None:
                room = self.engine.scheduler.limits.max_model_len - len(prompt)
                requested = max(1, min(cap, room))
        else:
            if parsed.echo:
                raise InvalidRequest("echo is not supported by this server")
            prompt = api.single_prompt(parsed.prompt)
            requested = parsed.max_tokens if parsed.max_tokens is not None else 16
        if requested > cap:
            raise InvalidRequest(
                f"max_tokens {requested} exceeds this server's cap of {cap}",
            )
        return prompt, requested

    async def _sse(self, outputs, rid: str, chat: bool, include_usage: bool):
        name, created = self.engine.model_name, int(time.time())
        last = None
        try:
            if chat:
                yield _event(api.chunk_body(rid, name, created, True, "", None, role=True))
            async for output in outputs:
                last = output
                if output.text or output.finished:
                    reason = output.finish_reason if output.finished else None
                    yield _event(api.chunk_body(rid, name, created, chat, output.text, reason))
            if include_usage and last is not None:
                yield _event(api.usage_chunk(rid, name, created, chat, last))
            yield b"data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # a disconnect cancels us here: abort the request now

    async def _collect(self, request: Request, outputs, rid: str, chat: bool) -> Response:
        """Non-streaming: gather the outputs, aborting if the client goes away meanwhile."""
        texts: list[str] = []
        last = None

        async def gather(cancel: anyio.CancelScope) -> None:
            nonlocal last
            async for output in outputs:
                texts.append(output.text)
                last = output
            cancel.cancel()

        async def watch_disconnect(cancel: anyio.CancelScope) -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(gather, group.cancel_scope)
                group.start_soon(watch_disconnect, group.cancel_scope)
        finally:
            await outputs.aclose()
        if last is None or not last.finished:
            return Response(status_code=499)  # the client went away (nginx's convention)
        return _json(api.completion_body(rid, self.engine.model_name, "".join(texts), last, chat))

    # ----------------------------------------------------------------- checks
    def _auth_error(self, request: Request) -> HTTPError | None:
        key = self.settings.api_key
        if not key:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(supplied.encode(), key.encode()):
            return HTTPError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                             "authentication_error")  # fmt: skip
        return None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body exceeds {limit} bytes", "invalid_request_error")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body exceeds {limit} bytes", "invalid_request_error")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.engine.model_name):
            served = self.engine.model_name
            message = f"the model {model!r} does not exist; this server serves {served!r}"
            raise HTTPError(404, message, "not_found_error", param="model")


def _event(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def _log_load_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("model loading failed: %s", task.exception())


# ----------------------------------------------------------------------------- running
class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT drains the engine (readiness and
    new requests answer 503 meanwhile) before the usual shutdown; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, server_app: FlashbatchServer) -> None:
        super().__init__(config)
        self.server_app = server_app

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.server_app.draining or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self.server_app.draining = True  # /ready and new requests answer 503 from now on
        timeout = self.server_app.settings.drain_timeout
        log.info("signal %s: draining in-flight requests (up to %.0fs)", sig, timeout)
        # Signal handlers run between bytecodes: hand the work to the loop, waking it up.
        self._loop.call_soon_threadsafe(self._start_drain, sig, frame)

    def _start_drain(self, sig: int, frame: Any) -> None:
        task = asyncio.get_running_loop().create_task(self.server_app.drain())
        task.add_done_callback(lambda _: super(DrainingServer, self).handle_exit(sig, frame))

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


def serve(engine: AsyncEngine, settings: ServerSettings, host: str, port: int,
          log_level: str = "info") -> None:  # fmt: skip
    """Run the server until a signal; see `DrainingServer`."""
    server_app = FlashbatchServer(engine, settings)
    loop_impl = "uvloop" if _has_uvloop() else "asyncio"
    config = uvicorn.Config(server_app.app(), host=host, port=port, loop=loop_impl,
                            log_level=log_level, timeout_graceful_shutdown=5)  # fmt: skip
    DrainingServer(config, server_app).run()


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
