"""The README's examples as a newcomer meets them: run as written, or checked against the code."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine.async_engine import RequestOutput
from engine.bundled.pair import bundled_paths
from engine.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


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
