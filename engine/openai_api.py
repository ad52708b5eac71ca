"""OpenAI-compatible request schemas and response bodies (msgspec; unknown fields ignored).

Only what the engine can honour is accepted; anything else gets a clear 400 rather than being
silently dropped (n > 1, logprobs, echo, batched prompts).
"""

from __future__ import annotations

import time
import uuid
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


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


def decode_request(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


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
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        return single_prompt(prompt[0])
    raise InvalidRequest("send one prompt per request (a string or a list of token ids)")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text", "") for p in content if p.get("type") == "text"]
            if len(texts) != len(content):
                raise InvalidRequest("only text content parts are supported")
            content = "".join(texts)
        out.append({"role": message.role, "content": content or ""})
    if not out:
        raise InvalidRequest("messages must not be empty")
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


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
