"""The README's examples as a newcomer meets them: run as written, or checked against the code.

The examples of "Set-up" and "HTTP" run against a real `flashbatch serve` (the default model,
SmolLM2-135M-Instruct, pulled once per machine like `test_smollm2.py`'s), exactly as written
but for the port; each is followed in the README by the answer it gives (greedy), which the
test compares.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_server import ServerProcess

from engine.async_engine import RequestOutput
from engine.bundled.pair import bundled_paths
from engine.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(text: str = README) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order, read as CommonMark reads fences: a
    line opening with three or more backticks; the block ends at a line of at least as many
    (so a body may hold ``` lines inside a ```` fence, or ``` within a line)."""
    blocks, fence, language, lines = [], "", "", []
    for line in text.splitlines(keepends=True):
        opening = re.match(r"(`{3,})(.*)", line)
        if not fence and opening:
            fence, language, lines = opening[1], opening[2].strip(), []
        elif fence and re.fullmatch(rf"{fence}`*\s*", line):
            blocks.append((language, "".join(lines)))
            fence = ""
        elif fence:
            lines.append(line)
    return blocks


def _code_blocks(language: str) -> list[str]:
    return [body for lang, body in _blocks() if lang == language]


def _curl_bodies() -> list[dict]:
    bodies = []
    for block in _code_blocks("bash"):
        for data in re.findall(r"curl [^\n]*\\\n\s*-d '(.*?)'", block, flags=re.S):
            bodies.append(json.loads(data))
    return bodies


def test_streaming_examples_bound_their_length():
    """A streaming example without max_tokens streams up to the context limit (a minute)."""
    streaming = [body for body in _curl_bodies() if body.get("stream")]
    assert streaming, "no streaming curl example found in the README"
    for body in streaming:
        assert body.get("max_tokens") or body.get("max_completion_tokens"), body


def _embedded_example() -> str:
    section = README.split("### Embedded", 1)[1]
    return re.search(r"```python\n(.*?)```", section, flags=re.S)[1]


def test_embedded_example_names_only_what_request_output_has():
    fields = set(RequestOutput.__struct_fields__)
    example = _embedded_example()
    used = set(re.findall(r"\bout\.(\w+)", example))
    assert used and used <= fields, used - fields
    assert "usage" in fields or "usage" not in example  # its comments promised one once
    prose = README.split("### Embedded", 1)[1].split("\n#", 1)[0]
    for name in re.findall(r"`(\w+)`", prose.split("```", 2)[2]):
        if name.endswith("_tokens") or name in ("finished", "finish_reason", "verify_steps"):
            assert name in fields, f"the README names RequestOutput.{name}, which does not exist"


def test_embedded_example_runs_as_written():
    target, drafter = bundled_paths()
    assert (target / "config.json").is_file() and (drafter / "config.json").is_file()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _embedded_example()], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    summary = re.search(r"\[(\w+): (\d+) prompt \+ (\d+) completion tokens", run.stdout)
    assert summary, run.stdout[-2000:]
    assert summary[1] in ("length", "stop") and 1 <= int(summary[3]) <= 64


def _parsers(parser: argparse.ArgumentParser, name: str = "flashbatch"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_help_shows_every_default():
    for name, parser in _parsers(build_parser()):
        text = "".join(parser.format_help().split())  # argparse wraps lines (at hyphens too)
        for action in parser._actions:
            default = action.default
            if not action.option_strings or any(default is v for v in (None, False, True)):
                continue
            if default == argparse.SUPPRESS:
                continue
            shown = "default:" + "".join(str(default).split())
            assert shown in text, f"`{name} --help` hides {action.dest}={default}"


def test_every_option_has_help_and_one_default():
    """Each option of each command says what it does; no default is shown twice; an on/off
    flag shows no stored value (`--no-warmup (default: True)` reads as the opposite)."""
    for name, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = "/".join(action.option_strings)
            assert action.help and not action.help.startswith("default"), (
                f"`{name} {flag}` has no help"
            )
            shown = formatter._expand_help(action)  # the text --help prints beside it
            assert shown.lower().count("default") <= 1, f"`{name} {flag}`: {shown}"
            if action.nargs == 0:
                assert "(default: True)" not in shown and "(default: False)" not in shown, (
                    f"`{name} {flag}`: {shown}"
                )


# ----------------------------------------------------------------------------- run as written
PORT_WRITTEN = "8000"


def _section(title: str, end: str) -> str:
    return README.split(title, 1)[1].split(end, 1)[0]


def _live_examples() -> list[tuple[str, str, str, str]]:
    """(kind, code, answer language, answer) for each example in Set-up and HTTP that talks to
    the server or runs `flashbatch generate`, with the block that follows it (its answer)."""
    text = _section("## Set-up", "## Use") + _section("### HTTP (OpenAI-compatible)", "#### Errors")
    blocks = _blocks(text)
    examples = []
    for (language, code), (answer_language, answer) in zip(blocks, [*blocks[1:], ("", "")]):
        live = f":{PORT_WRITTEN}" in code or code.startswith("flashbatch generate")
        if language in ("bash", "python") and live:
            examples.append((language, code, answer_language, answer))
    return examples


@pytest.fixture(scope="module")
def readme_server():
    """`flashbatch serve`, as the README starts it (the default model), on a free port."""
    s = ServerProcess(None, None, ready_timeout=300)
    yield s
    s.stop()


def _run_as_written(language: str, code: str, port: int) -> str:
    code = code.replace(f":{PORT_WRITTEN}", f":{port}")
    bin_dir = str(Path(sys.executable).parent)  # where the project's `flashbatch` is installed
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    command = ["bash", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _shown_strings(answer: str) -> dict[str, str]:
    """The string fields a JSON excerpt shows ("content", "text", "finish_reason", ...)."""
    found = re.findall(r'"(\w+)": ("(?:[^"\\]|\\.)*")', answer)
    return {key: json.loads(value) for key, value in found}


def _streamed_text(stdout: str) -> str:
    pieces = []
    events = [line[6:] for line in stdout.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", stdout[-500:]
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            pieces.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(pieces)


def test_readme_examples_are_all_found():
    kinds = [(language, "stream" in code, "generate" in code) for language, code, *_ in
             _live_examples()]  # fmt: skip
    assert ("python", False, False) in kinds and ("bash", False, True) in kinds
    assert sum(1 for k in kinds if k[0] == "bash" and not k[2]) >= 3, kinds  # three curls
    for _, code, answer_language, _ in _live_examples():
        assert answer_language in ("json", "text"), f"no answer shown after:\n{code}"
        if "curl" in code:  # greedy, so the answer shown is the answer
            assert '"temperature": 0' in code, code


@pytest.mark.parametrize("index", range(len(_live_examples())))
def test_readme_example_gives_the_answer_shown(readme_server, index):
    language, code, answer_language, answer = _live_examples()[index]
    stdout = _run_as_written(language, code, readme_server.port)
    assert answer_language in ("json", "text"), f"the README shows no answer for:\n{code}"
    if answer_language == "text":
        got = _streamed_text(stdout) if '"stream": true' in code else stdout
        assert got.strip() == answer.strip()
        return
    response = json.loads(stdout)
    shown = _shown_strings(answer)
    choice = response["choices"][0]
    assert response["model"] == shown["model"]
    assert choice["finish_reason"] == shown["finish_reason"]
    got = choice["message"]["content"] if "message" in choice else choice["text"]
    assert got == shown.get("content", shown.get("text"))
    for name, value in re.findall(r'"(\w+_tokens)": (\d+)', answer):
        assert response["usage"][name] == int(value), (name, response["usage"])


def test_another_model_name_gets_a_404_that_names_the_served_one(readme_server):
    body = {"model": "target", "prompt": "x", "max_tokens": 1}
    response = httpx.post(readme_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    served = httpx.get(readme_server.url + "/v1/models").json()["data"][0]["id"]
    assert repr(served) in error["message"] and "GET /v1/models" in error["message"]


# ----------------------------------------------------------------------------- promtool
def test_promtool_skips_say_where_promtool_comes_from():
    """The tests that need promtool skip without it, saying it comes with .ci/run's system
    packages; the README says so beside its test command."""
    from factories import PROMTOOL_ABSENT

    assert ".ci/run" in PROMTOOL_ABSENT and "prometheus" in PROMTOOL_ABSENT
    for path in (ROOT / "tests").glob("test_*.py"):
        source = path.read_text()
        for match in re.finditer(r"pytest\.(?:mark\.)?skip(?:if)?\(([^\n]*promtool[^\n]*)", source):
            assert "PROMTOOL_ABSENT" in match[1], f"{path.name}: {match[0]}"
    around = README.split("python -m pytest -q", 1)[1][:800]
    assert "promtool" in around and "skipped" in around and ".ci/run" in around


# ----------------------------------------------------------------------------- generate
def _generate(target, capsys, *extra: str) -> tuple[str, str]:
    from engine.cli import main

    args = ["generate", "--target", str(target), "--drafter", "none", "--prompt", "def f(", *extra]
    assert main(args) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_generate_says_what_happened_for_a_one_token_answer(qwen3_target_dir, capsys):
    """The first token comes from the prompt's forward: no decode step, nothing to average."""
    _, err = _generate(qwen3_target_dir, capsys, "--max-tokens", "1")
    summary = err.strip().splitlines()[-1]
    assert "1 token in" in summary and "no decode steps" in summary, summary
    assert "tau" not in summary and "steps 0" not in summary, summary
    _, err = _generate(qwen3_target_dir, capsys, "--max-tokens", "3", "--temperature", "0")
    summary = err.strip().splitlines()[-1]
    assert "3 tokens in" in summary and "2 decode steps, nothing drafted" in summary, summary


def test_generate_says_whether_the_chat_template_was_used(qwen3_target_dir, capsys):
    """The test tokenizer has a chat template: used by default, raw text with --no-chat. (What
    the template changes for an instruct model is the README's `flashbatch generate` example:
    SmolLM2 answers the question in it, and gave an empty answer to the raw text.)"""
    _, err = _generate(qwen3_target_dir, capsys, "--max-tokens", "1")
    assert "[prompt: chat template]" in err
    _, err = _generate(qwen3_target_dir, capsys, "--max-tokens", "1", "--no-chat")
    assert "[prompt: raw text]" in err
