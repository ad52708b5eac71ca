"""The import graph of the project's own modules, read from the source with `ast`.

Every `import` counts, the ones inside functions (lazy imports) included, and so do the
lazy public names of `engine/__init__.py` (`_EXPORTS`). Two rules:

- no cycle between modules, in any package (`bench/` and `metrics/` included);
- `drafters/` and `scheduler/` import only `engine`'s public API and its lowest layer
  (`engine.step`, `engine.backend`, `engine.models`, `engine.config`, `engine.errors`),
  never the HTTP edge, the CLI or the engine loop.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "scheduler", "drafters", "metrics", "bench")


def project_modules() -> dict[str, Path]:
    modules = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            if "results" in path.relative_to(ROOT).parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _lazy_exports(tree: ast.Module) -> list[str]:
    """The module paths of a package's lazy `_EXPORTS = {"Name": "module.path"}` table."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            return [v.value for v in node.value.values if isinstance(v, ast.Constant)]
    return []


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` imports (the deepest module each import names)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set(_lazy_exports(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                found.add(submodule if submodule in modules else origin)
    edges = set()
    for target in found:
        # `import a.b.c` names a.b.c; keep the deepest prefix that is a project module.
        parts = target.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts and ".".join(parts) != name:
            edges.add(".".join(parts))
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(find_cycles(graph)) == [["a", "b", "c"], ["e"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    modules = {"pkg": tmp_path / "pkg.py", "pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n    from . import b\n")
    assert imports_of("pkg.a", tmp_path / "a.py", modules) == {"pkg.b"}


def test_no_import_cycle_between_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_drafters_and_scheduler_import_only_the_public_api_and_the_lowest_layer():
    allowed = ("engine.step", "engine.backend", "engine.models", "engine.bundled")
    allowed_modules = {"engine", "engine.config", "engine.errors"}
    wrong = {}
    for name, edges in import_graph().items():
        if name.split(".")[0] not in {"drafters", "scheduler"}:
            continue
        bad = {
            e
            for e in edges
            if e.startswith("engine")
            and e not in allowed_modules
            and not any(e == a or e.startswith(a + ".") for a in allowed)
        }
        if bad:
            wrong[name] = sorted(bad)
    assert not wrong, f"reaching above the lowest layer: {wrong}"


def test_engine_top_level_holds_the_public_api_and_sub_packages():
    modules = sorted(p.stem for p in (ROOT / "engine").glob("*.py"))
    assert modules == ["__init__", "async_engine", "cli", "config", "errors"]
    packages = sorted(p.parent.name for p in (ROOT / "engine").glob("*/__init__.py"))
    assert packages == ["backend", "bundled", "distributed", "http", "models", "step"]
