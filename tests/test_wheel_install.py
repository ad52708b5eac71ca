"""The package as a user installs it: a wheel (not `-e`) in a fresh virtual environment.

An editable install makes every folder of the checkout importable, so a package that
`pyproject.toml` forgets still imports in the rest of the suite. Here the wheel is built from
the checkout, installed without its dependencies into a new venv whose only other path is this
environment's site-packages (for mlx and friends; its `.pth` files, the editable hook among
them, are not run), and then used from a directory outside the checkout:

- every module of every installed package imports, from the wheel, not from the checkout;
- `flashbatch serve --target bundled` answers a completion over HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("engine", "scheduler", "drafters", "metrics", "bench")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel; returns its `bin` directory."""
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy: an in-tree build leaves `build/lib`, whose stale modules a later
    # build would package. Only what a clean clone holds is copied.
    source = work / "source"
    skip = shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "results", ".*cache"
    )
    shutil.copytree(ROOT, source, ignore=skip)
    # No build isolation: the build backend comes from this environment (offline, fast).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(work / "dist"), str(source)],
        check=True, cwd=work, capture_output=True,
    )  # fmt: skip
    (wheel,) = (work / "dist").glob("flashbatch-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # The dependencies come from this environment's site-packages. A path line in a .pth does
    # not make that a site directory, so its own .pth files (the editable hook) never run.
    dependency_paths = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "dependencies.pth").write_text("\n".join(dependency_paths) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-deps", "--no-index", "-q", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    return venv / "bin"


def _outside_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_every_installed_module_imports_from_the_wheel(installed: Path, tmp_path: Path):
    script = f"""
import importlib, json, pkgutil
import engine  # preloads the BLAS before anything imports mlx
found = {{}}
for top in {TOP_LEVEL!r}:
    package = importlib.import_module(top)
    found[top] = package.__file__
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        module = importlib.import_module(info.name)
        found[info.name] = module.__file__
print(json.dumps(found))
"""
    result = subprocess.run(
        [str(installed / "python"), "-c", script],
        cwd=tmp_path, env=_outside_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    venv = installed.parent
    outside = {name: path for name, path in found.items() if not path.startswith(str(venv))}
    assert not outside, f"imported from outside the wheel: {outside}"
    # Every module of the checkout's packages is in the wheel (bench's scripts included).
    in_checkout = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for top in TOP_LEVEL
        for p in (ROOT / top).rglob("*.py")
        if "results" not in p.parts
    }
    assert in_checkout <= set(found), f"not in the wheel: {sorted(in_checkout - set(found))}"


def test_installed_server_answers_a_completion(installed: Path, tmp_path: Path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    process = subprocess.Popen(
        [str(installed / "flashbatch"), "serve", "--target", "bundled", "--port", str(port),
         "--log-level", "warning"],
        cwd=tmp_path, env=_outside_env(), stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            log.seek(0)
            pytest.fail("the installed server did not become ready:\n" + log.read())
        body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
        response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] and response.json()["usage"]["completion_tokens"] > 0
    finally:
        process.kill()
        process.wait()
        log.close()
