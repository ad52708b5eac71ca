"""Tool calls in the Hermes/Qwen format: tools into the prompt, `<tool_call>` blocks out.

The model is told about the tools by its chat template where the template takes `tools`
(Qwen2.5/3, Hermes); otherwise by a documented system prompt in the same format (appended to
the system message, or a system message of its own first):

    # Tools
    ...
    <tools>
    {"type": "function", "function": {...}}
    </tools>
    ... <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

Its output's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI's
`tool_calls` (`arguments` as a JSON string), the text before the first block the `content`,
and `finish_reason` `tool_calls`. `tool_choice`: `none` (tools left out of the prompt),
`auto` (the model decides; text that is not a well-formed call of a listed tool stays
content), `required` or a named function: the output is constrained by a grammar (one or more
calls; one when `parallel_tool_calls` is false) whose arguments follow each function's
`parameters` schema, so it is always a valid call. History goes back through the template:
assistant `tool_calls` and `tool` messages natively where the template takes tools, else as
the same `<tool_call>` text and `<tool_response>` user turns.

Llama 3.x templates (they mention `<|python_tag|>` or the `ipython` role) get the
`llama3_json` parser instead: the whole answer is the call, `{"name": ..., "parameters":
{...}}` (several separated by `;`), optionally after `<|python_tag|>`; `required`/named
choices are constrained to that form. `flashbatch serve --tool-call-parser hermes|llama3_json`
overrides the choice.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest
from engine.step.structured import JSON_OPTIONS, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolSetup:
    """A chat request's tools, validated: the function specs and what `tool_choice` asks."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's {"type", "function"}
    mode: str = "none"  # none | auto | required | named
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"  # PARSERS: the call format asked for and parsed

    @property
    def active(self) -> bool:
        """Whether tools reach the prompt and the output is parsed for calls."""
        return bool(self.tools) and self.mode != "none"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def choose_parser(tokenizer: Any, override: str | None = None) -> str:
    """The call format: the override where given, else by the chat template."""
    if override is not None:
        return override
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str) and (PYTHON_TAG in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def setup(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
          parser: str = "hermes") -> ToolSetup:  # fmt: skip
    """Validate `tools` and `tool_choice` (a 400 naming the field at fault)."""
    checked = [_tool(i, tool) for i, tool in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool function names must be unique", param="tools")
    out = ToolSetup(checked, parallel=parallel is not False, parser=parser)
    if tool_choice is None:
        out.mode = "auto" if checked else "none"
    elif tool_choice in ("none", "auto", "required"):
        out.mode = tool_choice
    elif isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequest('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}',
                                 param="tool_choice")  # fmt: skip
        out.mode, out.name = "named", function.get("name")
        if out.name not in names:
            raise InvalidRequest(f"tool_choice names {out.name!r}, which is not in tools",
                                 param="tool_choice.function.name")  # fmt: skip
    else:
        raise InvalidRequest(f"tool_choice {tool_choice!r} is not one of none, auto, required "
                             "or a named function", param="tool_choice")  # fmt: skip
    if out.mode in ("required", "named") and not checked:
        raise InvalidRequest(f"tool_choice {out.mode!r} needs tools", param="tool_choice")
    return out


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    param = f"tools[{i}]"
    if tool.get("type") != "function":
        raise InvalidRequest('tools must have type "function"', param=f"{param}.type")
    unknown = set(tool) - {"type", "function"}
    if unknown:
        raise InvalidRequest(f"unknown field {sorted(unknown)[0]!r}",
                             param=f"{param}.{sorted(unknown)[0]}")  # fmt: skip
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest("a tool needs a function object", param=f"{param}.function")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        name = sorted(unknown)[0]
        raise InvalidRequest(f"unknown field {name!r}", param=f"{param}.function.{name}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest("function names are 1-64 letters, digits, _ or -",
                             param=f"{param}.function.name")  # fmt: skip
    if not isinstance(function.get("description", ""), str):
        raise InvalidRequest("description must be a string",
                             param=f"{param}.function.description")  # fmt: skip
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequest("parameters must be a JSON schema object",
                             param=f"{param}.function.parameters")  # fmt: skip
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("strict must be a boolean", param=f"{param}.function.strict")
    return {"type": "function", "function": {**function, "parameters": parameters}}


# ----------------------------------------------------------------------------- prompt
def system_prompt(tools: list[dict[str, Any]]) -> str:
    """The generic tools prompt (Hermes's format), for templates without tools support."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_takes_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def render(messages: list[dict[str, Any]], tools: ToolSetup,
           native: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """(messages, extra template arguments): native templates get `tools=` and the history's
    calls as they are (arguments as objects); others the generic system prompt and the calls
    and results as text."""
    if native:
        out = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _arguments_object(c)}}
                    for c in message["tool_calls"]
                ]
            out.append(message)
        return out, ({"tools": tools.tools} if tools.active else {})
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [_block(c["function"]["name"], _arguments_object(c))
                     for c in message["tool_calls"]]  # fmt: skip
            content = "\n".join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools.active:
        prompt = system_prompt(tools.tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _arguments_object(call: dict[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _block(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


# ----------------------------------------------------------------------------- grammar
def grammar(tools: ToolSetup) -> StructuredOutput | None:
    """`required` and named choices: a Lark grammar of `<tool_call>` blocks whose JSON is
    `{"name": <a tool>, "arguments": <its parameters schema>}` (None for none/auto)."""
    if tools.mode not in ("required", "named"):
        return None
    chosen = [t for t in tools.tools if tools.mode == "required" or
              t["function"]["name"] == tools.name]  # fmt: skip
    key = "parameters" if tools.parser == "llama3_json" else "arguments"
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: t["function"]["parameters"],
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": True}}
    if tools.parser == "llama3_json":
        repeat = ' ("; " body)*' if tools.parallel else ""
        lark = f"start: body{repeat}\nbody: %json {json.dumps(schema)}\n"
        return StructuredOutput(kind="grammar", spec=lark, param="tools")
    repeat = ' ("\\n" call)*' if tools.parallel else ""
    lark = (
        f"start: call{repeat}\n"
        f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
        f"body: %json {json.dumps(schema)}\n"
    )
    return StructuredOutput(kind="grammar", spec=lark, param="tools")


# ----------------------------------------------------------------------------- output
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    """A `<tool_call>` block's JSON as OpenAI's call, or None if it is not a call of a tool."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    else:
        text = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function",
            "function": {"name": data["name"], "arguments": text}}  # fmt: skip


def _llama3_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """Llama 3.x: the whole answer is one or more JSON calls (`;` between), perhaps after
    `<|python_tag|>`; None when it is not."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG) :].lstrip()
    if not text.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            data, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call(json.dumps(data), names)
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return calls


def parse(text: str, tools: ToolSetup) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole answer. Only when every block is a call of a listed
    tool are they taken as calls; otherwise the whole text is content."""
    if tools.parser == "llama3_json":
        calls = _llama3_calls(text, tools.names)
        return (None, calls) if calls else (text, [])
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls = [_call(b[1], tools.names) for b in blocks]
    if any(c is None for c in calls):
        return text, []
    content = text[: blocks[0].start()].strip()
    return (content or None), calls


class StreamParser:
    """Streaming: text before a `<tool_call>` goes out as content deltas (a possible start of
    the tag is held back), each complete block as OpenAI's tool-call deltas (first the id and
    name, then the arguments)."""

    def __init__(self, tools: ToolSetup) -> None:
        self.tools = tools
        self.buffer = ""
        self.in_call = False
        self.calls = 0
        self.content_seen = False

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) for newly generated text."""
        if self.tools.parser == "llama3_json":
            return self._feed_llama3(text, final)
        self.buffer += text
        content, deltas = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, OPEN)
                    cut = len(self.buffer) - keep
                    content += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    break
                content += self.buffer[:start]
                self.buffer = self.buffer[start + len(OPEN) :]
                self.in_call = True
            end = self.buffer.find(CLOSE)
            if end < 0:
                if final:  # an unfinished block stays text
                    content += OPEN + self.buffer
                    self.buffer = ""
                    self.in_call = False
                break
            call = _call(self.buffer[:end].strip(), self.tools.names)
            if call is None:
                content += OPEN + self.buffer[: end + len(CLOSE)]
            else:
                function = call["function"]
                header = {"name": function["name"], "arguments": ""}
                deltas.append({"index": self.calls, "id": call["id"], "type": "function",
                               "function": header})  # fmt: skip
                arguments = {"arguments": function["arguments"]}
                deltas.append({"index": self.calls, "function": arguments})
                self.calls += 1
            self.buffer = self.buffer[end + len(CLOSE) :]
            self.in_call = False
        if self.calls and not content.strip():
            content = ""  # whitespace between calls
        return content, deltas

    def _feed_llama3(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Llama 3.x: an answer that opens like a call is held whole until it ends."""
        if self.content_seen:
            return text, []
        self.buffer += text
        head = self.buffer.lstrip()
        if head and not (head.startswith("{") or head.startswith(PYTHON_TAG[: len(head)])
                         or head.startswith(PYTHON_TAG)):  # fmt: skip
            self.content_seen = True
            out, self.buffer = self.buffer, ""
            return out, []
        if not final:
            return "", []
        calls = _llama3_calls(self.buffer, self.tools.names)
        if not calls:
            out, self.buffer = self.buffer, ""
            return out, []
        deltas = []
        for call in calls:
            function = call["function"]
            header = {"name": function["name"], "arguments": ""}
            deltas.append({"index": self.calls, "id": call["id"], "type": "function",
                           "function": header})  # fmt: skip
            deltas.append({"index": self.calls, "function": {"arguments": function["arguments"]}})
            self.calls += 1
        self.buffer = ""
        return "", deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
