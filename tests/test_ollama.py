"""Models by their Ollama name, from an Ollama store laid out here (manifests + blobs)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf_files as gf
import mlx.core as mx
import numpy as np
import pytest

from engine.cli import main
from engine.models.loading import load_target_model
from engine.models.ollama import OllamaModelNotFound, OllamaName, ollama_gguf
from engine.models.resolve import display_name, resolve_target

GO_TEMPLATE = "{{ if .System }}{{ .System }}{{ end }}{{ .Prompt }}"  # Ollama's, not Jinja


def add_model(store: Path, manifest_path: str, gguf: bytes) -> None:
    """One model in Ollama's layout: the GGUF and a template as blobs, and a manifest."""
    layers = []
    for media, data in (("model", gguf), ("template", GO_TEMPLATE.encode())):
        digest = hashlib.sha256(data).hexdigest()
        (store / "blobs").mkdir(parents=True, exist_ok=True)
        (store / "blobs" / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": f"application/vnd.ollama.image.{media}",
                       "digest": f"sha256:{digest}", "size": len(data)})  # fmt: skip
    manifest = store / "manifests" / manifest_path
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return gf.build_source(tmp_path_factory.mktemp("ollama") / "qwen3", "qwen3", seed=41)


@pytest.fixture
def store(tmp_path, monkeypatch, source) -> Path:
    store = tmp_path / "ollama-models"
    gguf = gf.write_model_gguf(source, tmp_path / "m.gguf").read_bytes()
    add_model(store, "registry.ollama.ai/library/tiny/0.1", gguf)
    add_model(store, "registry.ollama.ai/someone/tiny2/latest", gguf)
    add_model(store, "example.com:5000/team/tiny3/q4", gguf)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("FLASHBATCH_CACHE_DIR", str(tmp_path / "cache"))
    return store


def test_names_parse_as_ollama_spells_them():
    assert OllamaName.parse("qwen3") == OllamaName("registry.ollama.ai", "library", "qwen3",
                                                   "latest")  # fmt: skip
    assert OllamaName.parse("ollama:qwen3:0.6b").tag == "0.6b"
    assert OllamaName.parse("me/m:q4").namespace == "me"
    assert OllamaName.parse("host:5000/me/m") == OllamaName("host:5000", "me", "m", "latest")


def test_a_model_loads_by_its_ollama_name(store, source):
    ids = mx.array([[1, 50, 900, 3000, 7]])
    expected = np.array(load_target_model(source)[0](ids))
    for name in ("ollama:tiny:0.1", "tiny:0.1", "ollama:someone/tiny2",
                 "ollama:example.com:5000/team/tiny3:q4"):  # fmt: skip
        model, _ = load_target_model(name)
        np.testing.assert_allclose(np.array(model(ids)), expected, rtol=1e-5, atol=1e-5)
    assert display_name("ollama:tiny:0.1") == "tiny:0.1"
    # one conversion: the three names share one blob, and the cache is keyed by content
    assert resolve_target("tiny:0.1") == resolve_target("ollama:someone/tiny2")


def test_the_chat_template_is_the_ggufs_own(store, source):
    config = json.loads((resolve_target("ollama:tiny:0.1") / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (source / "chat_template.jinja").read_text()
    assert "{{ .Prompt }}" not in config["chat_template"]


def test_a_missing_model_lists_what_the_store_holds(store):
    with pytest.raises(OllamaModelNotFound) as error:
        ollama_gguf("ollama:qwen3:0.6b")
    message = str(error.value)
    assert "'qwen3:0.6b'" in message
    assert "tiny:0.1, someone/tiny2:latest, example.com:5000/team/tiny3:q4" in message or (
        "example.com:5000/team/tiny3:q4, someone/tiny2:latest, tiny:0.1" in message
    )


def test_generate_reports_a_missing_ollama_model_without_a_traceback(store, capsys):
    assert main(["generate", "--target", "ollama:qwen3:0.6b", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "no Ollama model 'qwen3:0.6b'" in err and "tiny:0.1" in err


def test_the_server_serves_an_ollama_name(store):
    import openai
    from test_server import ServerProcess

    server = ServerProcess("ollama:tiny:0.1", None, env={"OLLAMA_MODELS": str(store)})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["tiny:0.1"]
        out = client.completions.create(model="tiny:0.1", prompt="def f(x):", max_tokens=4,
                                        temperature=0)  # fmt: skip
        assert out.usage.completion_tokens == 4
    finally:
        server.stop()
