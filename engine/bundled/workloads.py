"""Workloads for acceptance and speed measurement, cut from the held-out stdlib files.

- code completion: a file's text up to a function's first body line; continue the function;
- code editing: a function given in full, then asked again with one identifier renamed — a
  model that copies well re-types most of it (speculation's best case);
- prose: the opening of a docstring or comment block; continue the prose.

Deterministic: the same held-out files give the same prompts on every machine.
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

WORKLOADS = ("completion", "editing", "prose")


def _functions(source: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.end_lineno and n.end_lineno - n.lineno >= 4
    ]


def completion_prompts(source: str, max_context_chars: int = 1200) -> list[str]:
    lines = source.splitlines(keepends=True)
    prompts = []
    for fn in _functions(source):
        body_start = fn.body[0].lineno - 1
        if isinstance(fn.body[0], ast.Expr) and len(fn.body) > 1:  # keep the docstring
            body_start = fn.body[1].lineno - 1
        text = "".join(lines[:body_start])
        prompts.append(text[-max_context_chars:])
    return prompts


def editing_prompts(source: str, max_function_chars: int = 900) -> list[str]:
    lines = source.splitlines(keepends=True)
    prompts = []
    for fn in _functions(source):
        original = "".join(lines[fn.lineno - 1 : fn.end_lineno])
        if len(original) > max_function_chars or not fn.args.args:
            continue
        old = fn.args.args[-1].arg
        if old in ("self", "cls") or len(old) < 2:
            continue
        new = f"{old}_value"
        indent = len(original) - len(original.lstrip())
        header = original.splitlines(keepends=True)[0].replace(old, new, 1)
        prompts.append(
            f"{original}\n\n# The same function with the parameter `{old}` renamed to `{new}`:\n"
            f"{' ' * indent}{header.lstrip()}"
        )
    return prompts


def prose_prompts(source: str, words: int = 12) -> list[str]:
    prompts = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return prompts
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
            doc = ast.get_docstring(node, clean=False)
            if doc and len(doc.split()) > 3 * words:
                prompts.append('"""' + " ".join(doc.split()[:words]) + " ")
    return prompts


def build_workloads(held_out_sources: list[str], per_workload: int = 40, seed: int = 0) -> dict:
    """Up to `per_workload` prompts of each kind, sampled deterministically."""
    makers = {"completion": completion_prompts, "editing": editing_prompts, "prose": prose_prompts}
    rng = random.Random(seed)
    out = {}
    for name, make in makers.items():
        prompts = [p for source in held_out_sources for p in make(source)]
        rng.shuffle(prompts)
        out[name] = prompts[:per_workload]
    return out


def save_workloads(workloads: dict, path: Path) -> None:
    path.write_text(json.dumps(workloads, indent=1))


def load_workloads(path: Path | None = None) -> dict[str, list[str]]:
    """The bundled workloads (shipped beside the bundled weights)."""
    path = path or Path(__file__).with_name("workloads.json")
    return json.loads(path.read_text())
