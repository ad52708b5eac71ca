"""OpenAI-compatible request schemas and response bodies (msgspec).

Nothing is silently dropped. Every OpenAI field of /v1/completions and /v1/chat/completions is
declared here with its type (a wrong type is a 400 naming it), and either works or is refused
with a 400 whose `param` names it (`best_of > 1`, `suffix`, image and audio parts, `audio`,
`prediction`, `functions`, ...; see `refuse_unsupported`). **Unknown fields are refused too**:
a 400 with `param` naming the field, so a typo (`max_token`) or another server's extension
is never mistaken for a setting that took effect. The extensions served are vLLM's names:
`top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, and flashbatch's
`num_speculative_tokens` and `draft_sources`. Accepted without effect, because they ask for
nothing the server could do otherwise: `user` and `safety_identifier` (identifiers),
`prompt_cache_key` (the prefix cache is automatic), `service_tier` "auto"/"default",
`store: false`, `modalities: ["text"]`. Tools and tool messages: `engine.http.tool_calls`.

Logprobs follow OpenAI's shapes: completions `logprobs: n` (0-5) gives
`{tokens, token_logprobs, top_logprobs, text_offset}`; chat `logprobs: true` with
`top_logprobs: n` (0-20) gives `{content: [{token, logprob, bytes, top_logprobs}]}`. Values are
the target's raw log-probabilities (before temperature and top-p, vLLM's default). With echo,
completions' logprobs start with the prompt's own tokens (the first has none).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.step.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from engine.step.sampling import SamplingParams
from engine.step.structured import StructuredOutput
from scheduler.sources import parse_sources


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
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
    # OpenAI's penalties (`engine.step.penalties`); token ids arrive as strings (JSON keys).
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM's): > 0, 1 = off
    # extension (vLLM's names): exactly one of {"json": schema, "regex": str, "grammar": Lark
    # str, "choice": [str], "json_object": true}
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of token ids, or a list of either (one request each: `prompts`).
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None  # 1 only (one choice per prompt)
    suffix: str | None = None  # refused: no infilling template


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None  # typed here, so `"text": 123` is a 400 naming the field
    # Declared so that a non-text part is refused by name, not as an unknown field.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # refused: the chat templates served have no participant names
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: Any = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields the server cannot honour: declared (typed), refused by name when set.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Identifiers and hints that ask for nothing the server would do differently.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


# Deeper than any OpenAI request needs, far shallower than the parser's recursion limit (which
# a ~1000-level array, even in an ignored field, would otherwise reach).
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: fast on long strings
_BRACKET_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKET_STEP)
_ERROR_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")


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
        raise InvalidRequest(f"invalid request: {exc}", param=_error_param(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # a backstop: the depth check above should always come first
        raise InvalidRequest("the request nests too deeply") from None


def _error_param(message: str) -> str | None:
    """The field a msgspec validation error blames, in OpenAI's `param` spelling: the path
    (`messages[0].content`), with an unknown field's own name appended; a dict value's
    `[...]` is dropped (`logit_bias`)."""
    path = _ERROR_PATH.search(message)
    param = (path[1] if path else "").replace("[...]", "")
    unknown = _UNKNOWN_FIELD.search(message)
    if unknown:
        param = f"{param}.{unknown[1]}" if param else unknown[1]
    return param or None


def _refuse(param: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{param} is not supported by this server: {why}", param=param)


def refuse_unsupported(request: _SamplingFields) -> None:
    """A 400 naming the first field set to something the server cannot honour."""
    if isinstance(request, CompletionRequest):
        if request.best_of not in (None, 1):
            raise _refuse("best_of", "one choice per prompt is generated (best_of 1)")
        if request.suffix:
            raise _refuse("suffix", "the served model has no infilling (fill-in-the-middle) "
                          "template")  # fmt: skip
        return
    refused = {
        "functions": "the deprecated functions API (use tools)",
        "function_call": "the deprecated functions API (use tool_choice)",
        "audio": "audio output",
        "prediction": "predicted outputs",
        "reasoning_effort": "reasoning models",
        "verbosity": "reasoning models",
        "web_search_options": "web search",
        "metadata": "stored completions (nothing is stored)",
    }
    for name, why in refused.items():
        if getattr(request, name) is not None:
            raise _refuse(name, why)
    if request.store:
        raise _refuse("store", "stored completions (nothing is stored)")
    if request.modalities is not None and request.modalities != ["text"]:
        raise _refuse("modalities", 'text output only (modalities: ["text"])')
    if request.service_tier not in (None, "auto", "default"):
        raise _refuse("service_tier", 'one tier ("auto" or "default")')


def structured_output(request: _SamplingFields) -> StructuredOutput | None:
    """The request's output constraint: chat's `response_format` (`json_object`, or
    `json_schema` with {name, schema, strict, description}) or the `structured_outputs`
    extension; a malformed one is a 400 naming the field (schema errors: at admission)."""
    response_format = getattr(request, "response_format", None)
    extension = request.structured_outputs
    if response_format is not None and response_format.get("type") != "text":
        if extension is not None:
            raise InvalidRequest("send response_format or structured_outputs, not both",
                                 param="structured_outputs")  # fmt: skip
        return _response_format(response_format)
    if extension is None:
        return None
    param = "structured_outputs"
    if len(extension) != 1:
        raise InvalidRequest("structured_outputs takes exactly one of json, regex, grammar, "
                             "choice, json_object", param=param)  # fmt: skip
    ((key, value),) = extension.items()
    if key == "json":
        if isinstance(value, str):
            value = _json_value(value, f"{param}.json")
        if not isinstance(value, dict):
            raise InvalidRequest("structured_outputs.json must be a JSON schema object",
                                 param=f"{param}.json")  # fmt: skip
        return StructuredOutput(kind="json_schema", spec=json.dumps(value), param=f"{param}.json")
    if key in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"structured_outputs.{key} must be a non-empty string",
                                 param=f"{param}.{key}")  # fmt: skip
        return StructuredOutput(kind=key, spec=value, param=f"{param}.{key}")
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c
                                                          for c in value)):  # fmt: skip
            raise InvalidRequest("structured_outputs.choice must be a list of strings",
                                 param=f"{param}.choice")  # fmt: skip
        pattern = "|".join(f"({re.escape(c)})" for c in value)
        return StructuredOutput(kind="regex", spec=pattern, param=f"{param}.choice")
    if key == "json_object":
        if value is not True:
            raise InvalidRequest("structured_outputs.json_object must be true",
                                 param=f"{param}.json_object")  # fmt: skip
        return StructuredOutput(kind="json_object", param=f"{param}.json_object")
    raise InvalidRequest(f"unknown structured_outputs kind {key!r}: choose json, regex, "
                         "grammar, choice or json_object", param=f"{param}.{key}")  # fmt: skip


def _json_value(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequest(f"{param} is not valid JSON", param=param) from None


def _response_format(response_format: dict[str, Any]) -> StructuredOutput:
    kind = response_format.get("type")
    if kind == "json_object":
        if set(response_format) != {"type"}:
            extra = sorted(set(response_format) - {"type"})[0]
            raise InvalidRequest(f"unknown field {extra!r}", param=f"response_format.{extra}")
        return StructuredOutput(kind="json_object", param="response_format")
    if kind != "json_schema":
        raise InvalidRequest(f"response_format type must be text, json_object or json_schema, "
                             f"got {kind!r}", param="response_format.type")  # fmt: skip
    spec = response_format.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema must be an object", param=param)
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequest(f"unknown field {name!r}", param=f"{param}.{name}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("json_schema.name must be a non-empty string", param=f"{param}.name")
    strict = spec.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("json_schema.strict must be a boolean", param=f"{param}.strict")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema.schema must be an object", param=f"{param}.schema")
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema), strict=bool(strict),
                            param=f"{param}.schema")  # fmt: skip


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON string keys) as ids; a key that is not a
    token id is a 400 naming the field (ranges: `SamplingParams.validate`)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.strip().lstrip("-").isdigit():
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}",
                                 param="logit_bias")  # fmt: skip
        out[int(key)] = value
    return out


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


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
        logit_bias=_logit_bias(request.logit_bias),
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        structured=structured_output(request),
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


MAX_PROMPTS = 64  # prompts in one completions request (each is its own engine request)


def _token_ids(prompt: Any) -> bool:
    return bool(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, a list of token ids, or a list of several of either
    (batched prompts: one choice each, `index` in this order)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS:
        if all(isinstance(p, str) and p for p in prompt) or all(
            isinstance(p, list) and _token_ids(p) for p in prompt
        ):
            return list(prompt)
    raise InvalidRequest(
        "prompt must be a non-empty string, a list of token ids, or a list of up to "
        f"{MAX_PROMPTS} of either (all strings or all token-id lists)",
        param="prompt",
    )


_MESSAGE_FIELDS_REFUSED = {
    "name": "participant names (the chat templates served have no place for them)",
    "audio": "audio",
    "refusal": "assistant refusals in the history",
}


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (`engine.http.tool_calls.render` finishes
    them). `developer` is OpenAI's newer name for `system` and is passed as that; fields the
    template cannot carry are refused by name."""
    out = []
    for i, message in enumerate(messages):
        for name, why in _MESSAGE_FIELDS_REFUSED.items():
            if getattr(message, name) is not None:
                raise _refuse(f"messages[{i}].{name}", why)
        extra = _tool_fields(i, message)
        content = message.content
        if isinstance(content, list):  # content parts: text ones only, joined
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        "only text content parts ({'type': 'text', 'text': '...'}) are supported",
                        param=f"messages[{i}].content[{j}]",
                    )
            content = "".join(part.text for part in content)
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content or "", **extra})
    if not out:
        raise InvalidRequest("messages must not be empty", param="messages")
    return out


def _tool_fields(i: int, message: ChatMessage) -> dict[str, Any]:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id`, checked."""
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise InvalidRequest("only assistant messages carry tool_calls",
                                 param=f"messages[{i}].tool_calls")  # fmt: skip
        for j, call in enumerate(message.tool_calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not (
                isinstance(function, dict)
                and call.get("type", "function") == "function"
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str)
            ):
                raise InvalidRequest(
                    'a tool call is {"id", "type": "function", "function": {"name", '
                    '"arguments": "<JSON string>"}}',
                    param=f"messages[{i}].tool_calls[{j}]",
                )
        return {"tool_calls": message.tool_calls}
    if message.role == "tool":
        if not message.tool_call_id:
            raise InvalidRequest("a tool message needs the tool_call_id it answers",
                                 param=f"messages[{i}].tool_call_id")  # fmt: skip
        return {"tool_call_id": message.tool_call_id}
    if message.tool_call_id is not None:
        raise InvalidRequest("only tool messages carry tool_call_id",
                             param=f"messages[{i}].tool_call_id")  # fmt: skip
    return {}


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


@dataclass
class Totals:
    """Several choices' final outputs added up, for one response's `usage` and `flashbatch`
    objects (a completions request with batched prompts)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, outputs: list[Any]) -> Totals:
        totals = cls()
        for output in outputs:
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens",
                         "drafted_tokens", "accepted_tokens", "verify_steps"):  # fmt: skip
                setattr(totals, name, getattr(totals, name) + getattr(output, name))
            pairs = [(totals.drafted_by_source, output.drafted_by_source),
                     (totals.accepted_by_source, output.accepted_by_source)]  # fmt: skip
            for mine, theirs in pairs:
                for source, n in theirs.items():
                    mine[source] = mine.get(source, 0) + n
        return totals


def completion_body(rid: str, model: str, texts: list[str | None], outputs: list[Any],
                    chat: bool, logprobs: list[dict | None],
                    tool_calls: list | None = None) -> dict:  # fmt: skip
    """The whole response; choice i is prompt i's (completions with batched prompts), chat
    has one (with `tool_calls` when the answer called tools: finish_reason `tool_calls`)."""
    created = int(time.time())
    choices = []
    for index, (text, output, entries) in enumerate(zip(texts, outputs, logprobs)):
        if chat:
            message = {"role": "assistant", "content": text}
            reason = output.finish_reason
            if tool_calls:
                message["tool_calls"] = tool_calls
                reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": index, "message": message, "logprobs": entries,
                            "finish_reason": reason})  # fmt: skip
        else:
            choices.append({"index": index, "text": text, "logprobs": entries,
                            "finish_reason": output.finish_reason})  # fmt: skip
    totals = Totals.of(outputs)
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens),
        "flashbatch": speculation(totals),
    }


def chunk_body(rid: str, model: str, created: int, chat: bool, text: str | None,
               finish_reason: str | None, role: bool = False,
               logprobs: dict | None = None, index: int = 0,
               tool_calls: list | None = None) -> dict:  # fmt: skip
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, created: int, chat: bool, outputs: list[Any]) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    output = Totals.of(outputs)
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
