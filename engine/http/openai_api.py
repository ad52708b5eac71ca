"""OpenAI-compatible request schemas and response bodies (msgspec; unknown fields ignored).

Only what the engine can honour is accepted; anything else gets a clear 400 rather than being
silently dropped (n > 1, batched prompts).

Logprobs follow OpenAI's shapes: completions `logprobs: n` (0-5) gives
`{tokens, token_logprobs, top_logprobs, text_offset}`; chat `logprobs: true` with
`top_logprobs: n` (0-20) gives `{content: [{token, logprob, bytes, top_logprobs}]}`. Values are
the target's raw log-probabilities (before temperature and top-p, vLLM's default). With echo,
completions' logprobs start with the prompt's own tokens (the first has none).
"""

from __future__ import annotations

import re
import time
import uuid
from itertools import accumulate
from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.step.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from engine.step.sampling import SamplingParams
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
        logprobs=(logprobs := requested_logprobs(request)),
        # echo with logprobs: the prompt's own (completions only)
        prompt_logprobs=logprobs if getattr(request, "echo", False) else None,
    )
    return params


def _draft_sources(names: list[str] | None) -> list[str] | None:
    try:
        return parse_sources(names)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


COMPLETION_MAX_LOGPROBS = 5  # OpenAI's limit for /v1/completions


def requested_logprobs(request: _SamplingFields) -> int | None:
    """Alternatives per token the request asks for (None: no logprobs), checked against
    OpenAI's rules for its endpoint."""
    if isinstance(request, ChatCompletionRequest):
        if request.logprobs in (None, False):
            if request.top_logprobs:
                raise InvalidRequest("top_logprobs needs logprobs: true")
            return None
        if request.logprobs is not True:
            raise InvalidRequest("logprobs must be true or false for chat completions")
        top = request.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
        return top
    if request.top_logprobs:
        raise InvalidRequest("completions take logprobs: <n> (top_logprobs is for chat)")
    value = request.logprobs
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"logprobs must be an integer in 0..{COMPLETION_MAX_LOGPROBS}")
    if not 0 <= value <= COMPLETION_MAX_LOGPROBS:
        raise InvalidRequest(
            f"logprobs must be in 0..{COMPLETION_MAX_LOGPROBS} for completions, got {value}"
        )
    return value


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # OpenAI's field: prompt tokens served from the prefix cache
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
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


class LogprobsFormatter:
    """Turns a request's TokenLogprobs into OpenAI's logprobs objects, delta by delta (a
    completion's `text_offset` runs on across the deltas of a stream)."""

    def __init__(self, tokenizer: Any, chat: bool, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.text_offset = text_offset

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def format(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self._text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for entry in entries:
            top = [item(t, v) for t, v in entry.top]
            content.append({**item(entry.token_id, entry.logprob), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _completion(self, entries: list[TokenLogprob]) -> dict:
        return self._completion_items([(e.token_id, e) for e in entries])

    def format_prompt(self, prompt_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        """Echo with logprobs: the prompt's tokens, the first one without a logprob."""
        items = [(t, entries[i] if i < len(entries) else None) for i, t in enumerate(prompt_ids)]
        return self._completion_items(items)

    def _completion_items(self, items: list[tuple[int, TokenLogprob | None]]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in items:
            text = self._text(token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(entry.logprob)
            # OpenAI: the sampled token is always listed, so up to n + 1 entries.
            top = {self._text(t): v for t, v in entry.top}
            top.setdefault(text, entry.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}  # fmt: skip


def join_logprobs(first: dict | None, second: dict) -> dict:
    """A completion's prompt logprobs (echo) followed by its generated tokens'."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


def completion_body(rid: str, model: str, text: str, output: Any, chat: bool,
                    logprobs: dict | None = None) -> dict:  # fmt: skip
    created = int(time.time())
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs,
                  "finish_reason": output.finish_reason}  # fmt: skip
        kind = "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens),
        "flashbatch": speculation(output),
    }


def chunk_body(rid: str, model: str, created: int, chat: bool, text: str | None,
               finish_reason: str | None, role: bool = False,
               logprobs: dict | None = None) -> dict:  # fmt: skip
    if chat:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
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
        "usage": usage(output.prompt_tokens, output.completion_tokens, output.cached_tokens),
        "flashbatch": speculation(output),
    }


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error body; `code` is a machine-readable string where one applies, else null
    (OpenAI's own convention: never the HTTP status)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
