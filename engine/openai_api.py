"""OpenAI-compatible request schemas and response bodies (msgspec; unknown fields ignored).

Only what the engine can honour is accepted; anything else gets a clear 400 rather than being
silently dropped (n > 1, logprobs, echo, batched prompts).
"""

from __future__ import annotations

import re
import time
import uuid
from itertools import accumulate
from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.sampling import SamplingParams
from scheduler.sources import parse_sources


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None  # extension: per-request draft cap (0 = off)
    draft_sources: list[str] | None = None  # extension: "dflash", "lookup" ([] = no drafting)
    user: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, token ids, or a one-element list of either
    max_tokens: int | None = 16
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None  # typed here, so `"text": 123` is a 400 naming the field


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


# Deeper than any OpenAI request needs, far shallower than the parser's recursion limit (which
# a ~1000-level array, even in an ignored field, would otherwise reach).
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: fast on long strings
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKET_STEP)
_ERROR_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (brackets inside strings ignored)."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper than the bound: skip the scan (the common case)
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate(_BRACKET_STEP[b] for b in brackets), default=0)


def decode_request(body: bytes, kind: type) -> Any:
    """Decode and type-check a request body; any failure is an InvalidRequest, never another
    exception (a 400 with the offending field as `param` where msgspec names it)."""
    if json_depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the request nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        path = _ERROR_PATH.search(str(exc))
        raise InvalidRequest(f"invalid request: {exc}", param=path and path[1] or None) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # a backstop: the depth check above should always come first
        raise InvalidRequest("the request nests too deeply") from None


def sampling_params(request: _SamplingFields, max_tokens: int) -> SamplingParams:
    """Map OpenAI fields to SamplingParams; reject what the engine does not support."""
    if request.n != 1:
        raise InvalidRequest(
            f"n={request.n} is not supported: this server returns one choice (n=1)"
        )
    if request.logprobs not in (None, False, 0) or request.top_logprobs:
        raise InvalidRequest("logprobs are not supported by this server")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    top_k = request.top_k if request.top_k is not None else 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
        min_p=request.min_p or 0.0,
        seed=request.seed,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        num_speculative_tokens=request.num_speculative_tokens,
        draft_sources=_draft_sources(request.draft_sources),
    )
    return params


def _draft_sources(names: list[str] | None) -> list[str] | None:
    try:
        return parse_sources(names)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def single_prompt(prompt: Any) -> str | list[int]:
    """A string, a list of token ids, or a one-element list holding either (unwrapped once)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise InvalidRequest(
        "send one prompt per request (a string or a list of token ids)", param="prompt"
    )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):  # content parts: text ones only, joined
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        "only text content parts ({'type': 'text', 'text': '...'}) are supported",
                        param=f"messages[{i}].content[{j}]",
                    )
            content = "".join(part.text for part in content)
        out.append({"role": message.role, "content": content or ""})
    if not out:
        raise InvalidRequest("messages must not be empty", param="messages")
    return out


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def speculation(output: Any) -> dict[str, Any]:
    """The `flashbatch` object: speculation totals and, per draft source, what it drafted
    and what was accepted (so a client sees which drafter did the work)."""
    drafted, accepted = output.drafted_by_source, output.accepted_by_source
    return {
        "drafted_tokens": output.drafted_tokens,
        "accepted_tokens": output.accepted_tokens,
        "verify_steps": output.verify_steps,
        "sources": {
            source: {"drafted_tokens": drafted[source], "accepted_tokens": accepted.get(source, 0)}
            for source in sorted(drafted)
        },
    }


def completion_body(rid: str, model: str, text: str, output: Any, chat: bool) -> dict:
    created = int(time.time())
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": output.finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
        kind = "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(output.prompt_tokens, output.completion_tokens),
        "flashbatch": speculation(output),
    }


def chunk_body(rid: str, model: str, created: int, chat: bool, text: str | None,
               finish_reason: str | None, role: bool = False) -> dict:  # fmt: skip
    if chat:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, output: Any) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(output.prompt_tokens, output.completion_tokens),
        "flashbatch": speculation(output),
    }


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error body; `code` is a machine-readable string where one applies, else null
    (OpenAI's own convention: never the HTTP status)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
