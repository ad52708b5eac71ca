"""OpenAI-compatible HTTP server: Starlette on uvicorn (uvloop), handlers thin over AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (liveness),
GET /ready (503 while loading or draining), GET /metrics (Prometheus).

Every non-2xx answer is OpenAI's nested body `{"error": {message, type, param, code}}`
(`engine/http/errors.py`): 400 validation and context overflow, 401 bad or missing API key,
404 unknown model or path (no slash redirects), 405 wrong method, 408 body too slow, 413 body
too large (`Content-Encoding` gzip and deflate are decoded within the same limit; any other
is 415; `engine/http/body.py`), 429 with
Retry-After when the engine's queue is full, 503 while loading or draining. A client disconnect
aborts its request in the engine and is counted, not logged. Slow and surplus connections are
bounded in `engine/http/guard.py`. SIGTERM/SIGINT: readiness turns 503 and new requests get 503
while in-flight ones finish (up to the drain timeout), then the process exits with status 0; a
second signal aborts the in-flight requests at once (each stream still ends with a final
`finish_reason: "abort"` chunk and `[DONE]`); a third exits without waiting for connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hmac
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine.async_engine import AsyncEngine
from engine.errors import EngineClosed, EngineFailed, InvalidRequest
from engine.http import openai_api as api
from engine.http import tool_calls
from engine.http.body import check_encoding, read_limited, too_large
from engine.http.errors import ErrorBoundary, HTTPError, exception_handlers, json_response
from engine.http.guard import guarded_protocol
from engine.http.logs import install_http_log_filters
from metrics import HTTPMetrics

log = logging.getLogger("flashbatch.server")
# Seconds past the failure exit's delay after which faulthandler ends the process itself.
FAILURE_EXIT_BACKSTOP_S = 10.0


@dataclass
class ServerSettings:
    api_key: str | None = None  # required as `Authorization: Bearer ...` on /v1/* when set
    protect_metrics: bool = False  # also require the key on /metrics
    max_body_bytes: int = 1 << 20
    max_tokens_cap: int = 4096  # the most tokens one request may ask for
    drain_timeout: float = 30.0
    failure_exit_delay: float = 1.0  # seconds the 503s of a failed engine get before exit
    read_timeout: float = 30.0  # headers, then the body, must each arrive within this
    max_connections: int = 512  # open connections; one more is closed when accepted
    tool_call_parser: str | None = None  # "hermes" | "llama3_json"; None: by the chat template


def _client_left(phase: str) -> HTTPError:
    # nginx's 499: never seen by the client, but it keeps the access log truthful.
    return HTTPError(499, f"the client closed the connection ({phase})", "client_closed_request")


class FlashbatchServer:
    """The routes, bound to one engine."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.draining = False
        self.load_error: BaseException | None = None  # the model never loaded (exit 1)
        self.http_metrics = HTTPMetrics(engine.model_name, engine.metrics.registry)
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
        app = Starlette(routes=routes, lifespan=self._lifespan,
                        exception_handlers=exception_handlers())  # fmt: skip
        # No slash redirects: Starlette builds their Location from the Host header, which the
        # client controls, and answers with an empty body. `/v1/completions/` is a 404 with
        # OpenAI's error body, as OpenAI's own API answers it.
        app.router.redirect_slashes = False
        return app

    def asgi(self) -> ErrorBoundary:
        """What uvicorn serves: the app inside the boundary that nothing escapes."""
        return ErrorBoundary(self.app())

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # Load in the background so /health answers (and /ready says 503) while loading.
        self.engine.failure_hooks.append(self._exit_after_failure)
        self._load_task = asyncio.create_task(self.engine.start())
        self._load_task.add_done_callback(self._load_done)
        yield
        if not self._load_task.done():
            self._load_task.cancel()
        await self.engine.shutdown(drain_timeout=0)

    def _load_done(self, task: asyncio.Task) -> None:
        """A load that failed (a bad checkpoint, a target its ranks cannot shard) leaves
        nothing to serve: exit non-zero rather than answer 503 forever."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("model loading failed: %s", task.exception())
        self.load_error = task.exception()
        self._exit_after_failure(task.exception())

    def _exit_after_failure(self, exc: BaseException) -> None:
        """The engine stopped for good (distributed mode: a rank lost). The requests in flight
        have their 503s or error events by now; give them a moment to leave, then exit
        non-zero at once: the MLX thread may be stuck in a collective no rank will finish,
        so an orderly shutdown could hang. Should uvicorn return first (a drain was under
        way), `serve` leaves the same way; should the loop never run the exit, faulthandler's
        own thread, which needs neither the loop nor the GIL, prints every thread's stack
        and exits."""
        self.draining = True
        log.error("exiting (status 1): %s", exc)
        delay = self.settings.failure_exit_delay
        asyncio.get_running_loop().call_later(delay, leave_now, 1)
        faulthandler.dump_traceback_later(delay + FAILURE_EXIT_BACKSTOP_S, exit=True)

    async def drain(self) -> None:
        """Stop taking requests and let in-flight ones finish (up to the drain timeout)."""
        self.draining = True
        if self._load_task is not None and not self._load_task.done():
            return  # nothing is in flight yet; the lifespan's end stops the loading
        await self.engine.shutdown(drain_timeout=self.settings.drain_timeout)

    def abort_in_flight(self) -> None:
        """End every request now: each stream gets its final `abort` output, so clients see
        a proper end (and the drain, waiting for them, finishes)."""
        scheduler = self.engine.scheduler
        for request_id in list(scheduler.requests) if scheduler is not None else []:
            self.engine.abort(request_id)

    # ----------------------------------------------------------------- probes
    async def health(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.engine.ready and not self.draining:
            return json_response({"status": "ready", "model": self.engine.model_name})
        state = "draining" if self.draining else "loading"
        # An error body too: every non-2xx answer has OpenAI's shape.
        error = HTTPError(503, f"the server is {state}", "service_unavailable",
                          code="service_unavailable", headers={"Retry-After": "5"})  # fmt: skip
        body = api.error_body(str(error), error.kind, error.code)
        return json_response({"status": state, **body}, 503, error.headers)

    async def metrics(self, request: Request) -> Response:
        if self.settings.protect_metrics and (error := self._auth_error(request)):
            raise error
        return Response(self.engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        if error := self._auth_error(request):
            raise error
        created = int(time.time())
        card = {"id": self.engine.model_name, "object": "model", "created": created,
                "owned_by": "flashbatch"}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    # ----------------------------------------------------------------- generation
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        # Errors raised here become OpenAI error bodies in `engine/http/errors.py`.
        if error := self._auth_error(request):
            raise error
        body = await self._read_body(request)
        if self.draining or not self.engine.ready:
            raise EngineClosed("the server is not ready (loading or draining); retry shortly")
        kind = api.ChatCompletionRequest if chat else api.CompletionRequest
        parsed = api.decode_request(body, kind)
        self._check_model(parsed.model)
        api.refuse_unsupported(parsed)
        tools = None
        if chat:
            parser = tool_calls.choose_parser(self.engine.tokenizer, self.settings.tool_call_parser)
            tools = tool_calls.setup(parsed.tools, parsed.tool_choice,
                                     parsed.parallel_tool_calls, parser)  # fmt: skip
        prompts, max_tokens = self._prompt(parsed, chat, tools)
        # Batched prompts (completions): each is its own request in the batch, choice i.
        runs: list[_Run] = []
        try:
            for prompt in prompts:
                shape = self._shape(parsed, chat, prompt, max_tokens)
                if shape.prompt_ids is not None:
                    prompt = shape.prompt_ids
                params = api.sampling_params(parsed, 1 if shape.score_only else max_tokens)
                if tools is not None and tools.active:
                    params = _with_tools(params, tools)
                request_id, stream = self.engine.add_request(prompt, params)
                outputs = self.engine.outputs(request_id, stream)
                runs.append(_Run(request_id, outputs, shape, tools))
                if params.logprobs is not None:
                    offset = 0 if shape.prompt_ids is not None else len(shape.echo)
                    shape.formatter = api.LogprobsFormatter(self.engine.tokenizer, chat, offset)
        except BaseException:
            for run in runs:  # a later prompt was refused: the earlier ones must not run on
                self.engine.abort(run.request_id)
            raise
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            events = self._sse(runs, rid, chat, include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        return await self._collect(request, runs, rid, chat)

    def _shape(self, parsed: Any, chat: bool, prompt: Any, max_tokens: int) -> _Shape:
        """What the response adds to the generated text: echo (completions) and the prompt's
        own logprobs with it; `max_tokens: 0` with echo scores the prompt only (evaluation
        harnesses do this): one token is generated and left out."""
        if chat or not parsed.echo:
            return _Shape()
        tokenizer = self.engine.tokenizer
        echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        prompt_ids = None
        if parsed.logprobs not in (None, False):
            prompt_ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else prompt
        return _Shape(echo=echo, prompt_ids=prompt_ids, score_only=max_tokens == 0)

    def _prompt(self, parsed: Any, chat: bool,
                tools: tool_calls.ToolSetup | None = None) -> tuple[list[Any], int]:  # fmt: skip
        """The request's prompts (one for chat; completions may batch several) and its
        max_tokens."""
        cap = self.settings.max_tokens_cap
        if chat:
            tokenizer = self.engine.tokenizer
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidRequest("this model has no chat template; use /v1/completions")
            native = tool_calls.template_takes_tools(tokenizer)
            messages = api.chat_messages(parsed.messages)
            messages, extra = tool_calls.render(messages, tools or tool_calls.ToolSetup(), native)
            try:
                prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            **extra))  # fmt: skip
            except Exception as exc:  # the template's own checks (roles, order) raise anything
                raise InvalidRequest(f"the chat template rejected the messages: {exc}",
                                     param="messages") from None  # fmt: skip
            prompts = [prompt]
            # max_completion_tokens (OpenAI's newer name) wins; 0 is a value, not "unset".
            name = "max_completion_tokens" if parsed.max_completion_tokens is not None else (
                "max_tokens")  # fmt: skip
            requested = getattr(parsed, name)
            if requested is None:
                room = self.engine.scheduler.limits.max_model_len - len(prompt)
                requested = max(1, min(cap, room))
        else:
            prompts = api.prompts(parsed.prompt)
            name = "max_tokens"
            requested = parsed.max_tokens if parsed.max_tokens is not None else 16
        # 0 scores the prompt alone, which only echo returns (see `_shape`)
        if requested < 1 and not (requested == 0 and not chat and parsed.echo):
            raise InvalidRequest(f"{name} must be at least 1, got {requested}", param=name)
        if requested > cap:
            raise InvalidRequest(
                f"{name} {requested} exceeds this server's cap of {cap}", param=name
            )
        return prompts, requested

    async def _sse(self, runs: list[_Run], rid: str, chat: bool, include_usage: bool):
        name, created = self.engine.model_name, int(time.time())
        echoes = [run.shape.echo for run in runs]
        last: dict[int, Any] = {}
        parsers = [tool_calls.StreamParser(r.tools) if r.active_tools else None for r in runs]
        try:
            if chat:
                yield _event(api.chunk_body(rid, name, created, True, "", None, role=True))
            # aclosing: its pumps stop before the outputs they read are closed below
            merged = contextlib.aclosing(_merged(runs))
            async with merged as indexed:
                async for index, output in indexed:
                    shape = runs[index].shape
                    if echoes[index]:
                        prompt_logprobs = shape.prompt_part(output)
                        yield _event(api.chunk_body(rid, name, created, False, echoes[index], None,
                                                    logprobs=prompt_logprobs,
                                                    index=index))  # fmt: skip
                        echoes[index] = ""
                    if output.finish_reason == "error" and self.engine.failure is not None:
                        # Not an answer: an error event and no [DONE], so no client reads
                        # the partial text as complete.
                        failed = EngineFailed(f"the engine stopped: {self.engine.failure}")
                        yield _event(api.error_body(str(failed), "service_unavailable",
                                                    "service_unavailable"))  # fmt: skip
                        return
                    output = last[index] = shape.visible(output)
                    logprobs = None
                    if shape.formatter is not None and output.logprobs:
                        logprobs = shape.formatter.format(output.logprobs)
                    text, calls, parser = output.text, None, parsers[index]
                    if parser is not None:
                        text, calls = parser.feed(text, final=output.finished)
                    if text or calls or output.finished or logprobs is not None:
                        reason = output.finish_reason if output.finished else None
                        if reason == "stop" and parser is not None and parser.calls:
                            reason = "tool_calls"
                        yield _event(api.chunk_body(rid, name, created, chat, text, reason,
                                                    logprobs=logprobs, index=index,
                                                    tool_calls=calls))  # fmt: skip
            if include_usage and last:
                yield _event(api.usage_chunk(rid, name, created, chat, list(last.values())))
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.http_metrics.on_disconnect("stream")  # Starlette cancels us when it leaves
            raise
        finally:
            for run in runs:  # a disconnect cancels us here: abort the requests now
                await run.outputs.aclose()

    async def _collect(self, request: Request, runs: list[_Run], rid: str,
                       chat: bool) -> Response:  # fmt: skip
        """Non-streaming: gather the outputs, aborting if the client goes away meanwhile."""
        texts: list[list[str]] = [[run.shape.echo] for run in runs]
        entries: list[list] = [[] for _ in runs]
        prompt_logprobs: list[dict | None] = [None] * len(runs)
        last: list[Any] = [None] * len(runs)

        async def gather(cancel: anyio.CancelScope) -> None:
            async with contextlib.aclosing(_merged(runs)) as indexed:
                async for index, output in indexed:
                    shape = runs[index].shape
                    if last[index] is None:
                        prompt_logprobs[index] = shape.prompt_part(output)
                    output = shape.visible(output)
                    texts[index].append(output.text)
                    entries[index].extend(output.logprobs or [])
                    last[index] = output
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
            for run in runs:
                await run.outputs.aclose()
        if self.engine.failure is not None and any(
            output is not None and output.finish_reason == "error" for output in last
        ):
            raise EngineFailed(f"the engine stopped: {self.engine.failure}")
        if any(output is None or not output.finished for output in last):
            self.http_metrics.on_disconnect("wait")
            raise _client_left("waiting for the answer")
        logprobs = []
        for index, run in enumerate(runs):
            formatter = run.shape.formatter
            logprobs.append(None if formatter is None else
                            api.join_logprobs(prompt_logprobs[index],
                                              formatter.format(entries[index])))  # fmt: skip
        answers: list[str | None] = ["".join(t) for t in texts]
        calls = None
        if runs[0].active_tools:  # chat: one run
            answers[0], calls = tool_calls.parse(answers[0], runs[0].tools)
        body = api.completion_body(rid, self.engine.model_name, answers, last, chat, logprobs,
                                   calls)  # fmt: skip
        return json_response(body)

    # ----------------------------------------------------------------- checks
    def _auth_error(self, request: Request) -> HTTPError | None:
        key = self.settings.api_key
        if not key:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, supplied = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(supplied.encode(), key.encode()):
            return HTTPError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                             "authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        return None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        coding = check_encoding(request.headers.get("content-encoding"))
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit)
        try:
            return await read_limited(request.stream(), coding, limit)
        except ClientDisconnect:  # hung up mid-body: normal at an edge, counted, not logged
            self.http_metrics.on_disconnect("upload")
            raise _client_left("sending the body") from None

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.engine.model_name):
            served = self.engine.model_name
            # One model, one name: any other is refused by name, never silently served.
            message = (
                f"the model {model!r} does not exist; this server serves {served!r} "
                "(GET /v1/models lists it; send that name or leave `model` out)"
            )
            raise HTTPError(404, message, "not_found_error", code="model_not_found", param="model")


async def _merged(runs: list[_Run]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) from every run as they arrive; a single run is read directly
    (no task or queue per token in the common case)."""
    if len(runs) == 1:
        async for output in runs[0].outputs:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, outputs: AsyncIterator[Any]) -> None:
        try:
            async for output in outputs:
                queue.put_nowait((index, output, None))
        except BaseException as exc:  # handed to the reader, which raises it
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.create_task(pump(i, run.outputs)) for i, run in enumerate(runs)]
    try:
        running = len(tasks)
        while running:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                running -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Run:
    """One engine request of a response: choice `index` is the run at that position."""

    request_id: str
    outputs: AsyncIterator[Any]
    shape: _Shape
    tools: tool_calls.ToolSetup | None = None

    @property
    def active_tools(self) -> bool:
        return self.tools is not None and self.tools.active


def _with_tools(params: Any, tools: tool_calls.ToolSetup) -> Any:
    """A tools request's sampling: `required`/named choices constrained by their grammar;
    other output constraints cannot be combined with tools."""
    if params.structured is not None:
        raise InvalidRequest("response_format and structured_outputs cannot be combined with "
                             "tools (send tool_choice: none)", param="response_format")  # fmt: skip
    grammar = tool_calls.grammar(tools)
    if grammar is None:
        return params
    return msgspec.structs.replace(params, structured=grammar)


@dataclass
class _Shape:
    """How one completion's response differs from its generated text (see `_shape`)."""

    echo: str = ""  # the prompt's text, sent before the completion
    prompt_ids: list[int] | None = None  # with echo and logprobs: the prompt, for its logprobs
    score_only: bool = False  # max_tokens 0 with echo: the generated token is left out
    formatter: api.LogprobsFormatter | None = None

    def prompt_part(self, output: Any) -> dict | None:
        """The prompt's logprobs object (echo with logprobs; the first output has them)."""
        if self.prompt_ids is None or self.formatter is None:
            return None
        return self.formatter.format_prompt(self.prompt_ids, output.prompt_logprobs or [])

    def visible(self, output: Any) -> Any:
        if not self.score_only:
            return output
        return msgspec.structs.replace(output, text="", token_ids=[], logprobs=None,
                                       completion_tokens=0)  # fmt: skip


def _event(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


# ----------------------------------------------------------------------------- running
class DrainingServer(uvicorn.Server):
    """uvicorn's server with flashbatch's shutdown. The first SIGTERM/SIGINT drains the engine
    (readiness and new requests answer 503 meanwhile), then uvicorn shuts down; the second
    aborts the in-flight requests, which ends the drain at once; a third stops waiting for
    connections. Unlike uvicorn, the signal is not re-raised after the shutdown: a requested
    shutdown that completed exits with status 0, which supervisors read as success."""

    def __init__(self, config: uvicorn.Config, server_app: FlashbatchServer) -> None:
        super().__init__(config)
        self.server_app = server_app
        self._signals = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self._signals += 1
        # Signal handlers run between bytecodes: hand the work to the loop, waking it up.
        if self._signals == 1:
            self.server_app.draining = True  # /ready and new requests answer 503 from now on
            timeout = self.server_app.settings.drain_timeout
            log.info("signal %s: draining in-flight requests (up to %.0fs)", sig, timeout)
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._signals == 2:
            log.info("signal %s again: aborting the in-flight requests", sig)
            self._loop.call_soon_threadsafe(self.server_app.abort_in_flight)
        else:
            self.should_exit = self.force_exit = True

    def _start_drain(self) -> None:
        task = asyncio.get_running_loop().create_task(self.server_app.drain())
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("drain failed: %s", task.exception())
        self.should_exit = True  # uvicorn's own shutdown follows

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


def serve(engine: AsyncEngine, settings: ServerSettings, host: str, port: int,
          log_level: str = "info") -> int:  # fmt: skip
    """Run the server until a signal (see `DrainingServer`); return the exit status."""
    server_app = FlashbatchServer(engine, settings)
    loop_impl = "uvloop" if _has_uvloop() else "asyncio"
    protocol = guarded_protocol(settings.read_timeout, settings.max_connections,
                                server_app.http_metrics.on_server_close)  # fmt: skip
    config = uvicorn.Config(server_app.asgi(), host=host, port=port, loop=loop_impl,
                            http=protocol, log_level=log_level,
                            timeout_graceful_shutdown=5)  # fmt: skip
    install_http_log_filters()  # after uvicorn.Config, which configures uvicorn's loggers
    server = DrainingServer(config, server_app)
    server.run()
    if engine.failure is not None:
        # A rank was lost, and the MLX thread may still be inside a collective no rank will
        # finish: the interpreter's exit would join it forever.
        leave_now(1)
    if server_app.load_error is not None:  # the model never loaded
        return 1
    return 0 if server.started else 3  # 3: uvicorn's status for a failed start-up


def leave_now(status: int) -> None:
    """Exit at once with `status`, the logs flushed, joining no thread."""
    logging.shutdown()
    os._exit(status)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
