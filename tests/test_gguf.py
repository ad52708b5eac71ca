"""GGUF targets: llama.cpp-layout files written here load as the mlx-lm models they came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf_files as gf
import mlx.core as mx
import numpy as np
import pytest

from engine.bundled.pair import BUNDLED_TARGET
from engine.models import cache, gguf
from engine.models.gguf_header import GGUFError
from engine.models.loading import load_target_model
from engine.models.resolve import resolve_target

PROMPT = [5, 17, 300, 2048, 4000, 11, 99, 1234, 7, 3000, 42, 8]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test converts into its own cache."""
    monkeypatch.setenv("FLASHBATCH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-sources")
    return {
        # llama with its own output head; qwen3 tied, with head_dim != hidden / heads;
        # qwen2 with its q/k/v biases
        "llama": gf.build_source(root / "llama", "llama", seed=11),
        "qwen2": gf.build_source(root / "qwen2", "qwen2", seed=14),
        "qwen3": gf.build_source(
            root / "qwen3", "qwen3", seed=12, head_dim=32, tie_word_embeddings=True
        ),  # fmt: skip
    }


def logits(model, ids=PROMPT) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def reference_model(source: Path, weights: dict[str, np.ndarray] | None = None):
    """The mlx-lm model of `source` in float32, optionally with replaced weights."""
    from mlx_lm import load

    model, _ = load(str(source))
    model.set_dtype(mx.float32)
    if weights is not None:
        model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=False)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_float_gguf_gives_the_logits_of_its_source(sources, tmp_path, arch):
    source = sources[arch]
    path = gf.write_model_gguf(source, tmp_path / f"{arch}.gguf")
    model, _ = load_target_model(path)
    expected = logits(reference_model(source))
    np.testing.assert_allclose(logits(model), expected, rtol=1e-5, atol=1e-5)
    config = json.loads((resolve_target(path) / "config.json").read_text())
    assert config["tie_word_embeddings"] is (arch == "qwen3")
    assert config["head_dim"] == (32 if arch == "qwen3" else 16)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in dict(_flat(model.parameters()))


def test_llama_q_k_rows_must_be_unpermuted(sources, tmp_path):
    """The permutation is real: the same file read without un-permuting gives other logits."""
    source = sources["llama"]
    tensors = gf.llama_cpp_tensors(source)
    plain = {name: mx.array(v) for name, v in tensors.items()}
    weights = {gguf.mlx_name(name): v for name, v in plain.items()}
    wrong = reference_model(source)
    wrong.load_weights(list(weights.items()), strict=False)
    assert not np.allclose(logits(wrong), logits(reference_model(source)), atol=1e-3)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}  # fmt: skip
    source = gf.build_source(tmp_path / "l3", "llama", seed=13, head_dim=32, rope_scaling=scaling)
    tensors = gf.llama_cpp_tensors(source)
    tensors["rope_freqs.weight"] = gf.llama3_rope_freqs(32, 10000.0, scaling)
    path = gf.write_float_gguf(tmp_path / "l3.gguf", tensors, gf.metadata(source))
    model, _ = load_target_model(path)
    ids = PROMPT * 20  # long enough for the low frequencies' scaling to show in the logits
    expected = logits(reference_model(source), ids)
    np.testing.assert_allclose(logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    unscaled = gf.write_float_gguf(tmp_path / "plain.gguf", gf.llama_cpp_tensors(source),
                                   gf.metadata(source))  # fmt: skip
    assert not np.allclose(logits(load_target_model(unscaled)[0], ids), expected, atol=1e-3)


def test_float16_gguf_matches_its_rounded_source(sources, tmp_path):
    source = sources["llama"]
    path = gf.write_model_gguf(source, tmp_path / "f16.gguf", mx.float16)
    model, _ = load_target_model(path)
    rounded = {k: v.astype(np.float16).astype(np.float32) if v.ndim == 2 else v
               for k, v in gf.model_weights(source).items()}  # fmt: skip
    np.testing.assert_allclose(
        logits(model), logits(reference_model(source, rounded)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kind", [gf.Q8_0, gf.Q4_0, gf.Q4_1], ids=["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_gguf_matches_its_dequantized_reference(sources, tmp_path, arch, kind):
    source = sources[arch]
    tensors, values = gf.quantized_tensors(gf.llama_cpp_tensors(source), kind)
    path = gf.write_gguf(tmp_path / "q.gguf", tensors, gf.metadata(source))
    model, _ = load_target_model(path)
    # ggml's own dequantization (numpy, from the blocks), back in mlx-lm names and row order
    reference = {}
    config = json.loads((source / "config.json").read_text())
    for name, value in values.items():
        if arch == "llama" and ".attn_q." in name:
            value = np.array(gguf.unpermute_rows(mx.array(value), config["num_attention_heads"]))
        elif arch == "llama" and ".attn_k." in name:
            value = np.array(gguf.unpermute_rows(mx.array(value), config["num_key_value_heads"]))
        reference[gguf.mlx_name(name)] = value
    loaded = dict(_flat(model.parameters()))
    for name, value in reference.items():
        # MLX stores Q8_0's and Q4_0's offset (-128 d, -8 d) as float16: values move by up to
        # 2^-11 of the offset, i.e. about 1/16 (Q8_0) or 1/256 (Q4_0) of one quantization step.
        step = np.abs(value).max() / (127 if kind == gf.Q8_0 else 7)
        np.testing.assert_allclose(np.array(loaded[name]), value, atol=step / 8, rtol=0)
    ref_logits = logits(reference_model(source, reference))
    np.testing.assert_allclose(logits(model), ref_logits, atol=2e-2 * np.abs(ref_logits).max())
    assert np.argmax(logits(model), -1).tolist() == np.argmax(ref_logits, -1).tolist()


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def test_unsupported_tensor_type_is_named_and_nothing_is_written(sources, tmp_path, cache_dir):
    source = sources["llama"]
    tensors, _ = gf.quantized_tensors(gf.llama_cpp_tensors(source), gf.Q8_0)
    tensors["blk.1.ffn_down.weight"] = (gf.Q4_K, (64, 256), b"\0" * (144 * 64))
    path = gf.write_gguf(tmp_path / "k.gguf", tensors, gf.metadata(source))
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_down\.weight \(Q4_K\)"):
        load_target_model(path)
    entries = [p for p in (cache_dir / "models").glob("*") if p.is_dir()]
    assert entries == []


def test_unsupported_architecture_is_named(sources, tmp_path):
    source = sources["llama"]
    meta = {**gf.model_metadata(source, arch="phi3"), **gf.tokenizer_metadata(source, "gpt-2")}
    path = gf.write_float_gguf(tmp_path / "phi.gguf", gf.llama_cpp_tensors(source), meta)
    with pytest.raises(GGUFError, match="architecture 'phi3' is not supported"):
        load_target_model(path)


def test_unknown_pre_tokenizer_is_refused(sources, tmp_path):
    source = sources["llama"]
    meta = {**gf.model_metadata(source), **gf.tokenizer_metadata(source, "falcon")}
    path = gf.write_float_gguf(tmp_path / "t.gguf", gf.llama_cpp_tensors(source), meta)
    with pytest.raises(GGUFError, match="pre-tokenizer 'falcon'"):
        load_target_model(path)


def test_truncated_gguf_is_refused(sources, tmp_path):
    path = gf.write_model_gguf(sources["llama"], tmp_path / "full.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match="truncated"):
        load_target_model(cut)


# ----------------------------------------------------------------------------- the cache
def test_repeated_load_uses_the_cache_and_a_corrupt_entry_is_rebuilt(sources, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    calls = []
    real = gguf.convert_gguf
    monkeypatch.setattr(gguf, "convert_gguf", lambda *a: calls.append(a) or real(*a))
    path = gf.write_model_gguf(sources["qwen3"], tmp_path / "m.gguf")
    first = resolve_target(path)
    copy = tmp_path / "renamed.gguf"
    shutil.copy(path, copy)
    assert resolve_target(path) == first and resolve_target(copy) == first  # keyed by content
    assert len(calls) == 1
    expected = logits(load_target_model(path)[0])

    weights = first / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    assert resolve_target(path) == first and len(calls) == 2
    np.testing.assert_array_equal(logits(load_target_model(path)[0]), expected)

    data = bytearray(weights.read_bytes())  # same size, other bytes
    data[-100:] = b"\x7f" * 100
    weights.write_bytes(bytes(data))
    assert resolve_target(path) == first and len(calls) == 3

    (first / cache.MANIFEST).unlink()  # as an interrupted conversion leaves it
    assert resolve_target(path) == first and len(calls) == 4
    np.testing.assert_array_equal(logits(load_target_model(path)[0]), expected)


def test_a_failed_conversion_leaves_no_entry(sources, tmp_path, cache_dir, monkeypatch):
    def broken(src, out):
        (Path(out) / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf, "convert_gguf", broken)
    path = gf.write_model_gguf(sources["llama"], tmp_path / "m.gguf")
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_target(path)
    assert [p.name for p in (cache_dir / "models").iterdir() if p.is_dir()] == []


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHBATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.models_dir() == tmp_path / "xdg" / "flashbatch" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.models_dir() == Path.home() / ".cache" / "flashbatch" / "models"


# ----------------------------------------------------------------------------- tokenizer
SAMPLES = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib(n-2)\n",
    "Digits: 0 7 42 1234567890 3.14159 -12e10 0x1F",
    "whitespace    runs\t\ttabs\n\n\n   \n  trailing   ",
    "unicode: naïve café, Ελληνικά, 日本語のテキスト, emoji 🙂👍🏽, math ∑∫√, ü",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "special mid-text<|endoftext|>and after <|mask|> done",
    "class A(B):\n\tpass  # comment\r\nx = {'k': [1, 2], \"s\": None}",
    "",
    " leading space and 'quotes' don't we'll I'M",
]


def test_tokenizer_rebuilt_from_metadata_matches_the_source(sources, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    source = sources["qwen3"]
    directory = resolve_target(gf.write_model_gguf(source, tmp_path / "t.gguf"))
    original = Tokenizer.from_file(str(BUNDLED_TARGET / "tokenizer.json"))
    rebuilt = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in SAMPLES:
        ids = original.encode(text).ids
        assert rebuilt.encode(text).ids == ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == original.decode(
            ids, skip_special_tokens=False
        )
    hf_original = AutoTokenizer.from_pretrained(str(BUNDLED_TARGET))
    hf_rebuilt = AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "user", "content": "Rewrite `x = 1` with y."},
        {"role": "assistant", "content": "y = 1"},
        {"role": "user", "content": "ok"},
    ]
    for kwargs in ({"add_generation_prompt": True}, {}):
        text = hf_original.apply_chat_template(messages, tokenize=False, **kwargs)
        assert hf_rebuilt.apply_chat_template(messages, tokenize=False, **kwargs) == text
        assert hf_rebuilt(text)["input_ids"] == hf_original(text)["input_ids"]
    assert hf_rebuilt.eos_token == hf_original.eos_token == "<|endoftext|>"
    assert hf_rebuilt.pad_token == hf_original.pad_token


def test_mlx_lm_and_transformers_accept_the_converted_directory(sources, tmp_path):
    from mlx_lm import load
    from transformers import AutoConfig, AutoTokenizer

    directory = resolve_target(gf.write_model_gguf(sources["llama"], tmp_path / "m.gguf"))
    model, tokenizer = load(str(directory))
    assert tokenizer.eos_token_ids == {0}
    assert tokenizer.encode("def f(x):") == AutoTokenizer.from_pretrained(str(directory)).encode(
        "def f(x):"
    )
    config = AutoConfig.from_pretrained(str(directory))
    assert config.model_type == "llama" and config.num_key_value_heads == 2
    assert logits(model).shape == (len(PROMPT), 4096)


def test_on_a_gpu_a_gguf_computes_in_its_own_precision(sources, tmp_path, monkeypatch):
    import engine.models.loading

    monkeypatch.setattr(engine.models.loading, "compute_dtype", lambda: None)  # as on Metal / CUDA
    source = sources["llama"]
    tensors, _ = gf.quantized_tensors(gf.llama_cpp_tensors(source), gf.Q4_1)
    quantized = gf.write_gguf(tmp_path / "q.gguf", tensors, gf.metadata(source))
    model, _ = load_target_model(quantized)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float16
    model, _ = load_target_model(gf.write_model_gguf(source, tmp_path / "f32.gguf"))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    model, _ = load_target_model(source)  # an mlx-lm directory keeps its stored dtype
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32


def test_a_new_converter_version_replaces_the_old_entry(sources, tmp_path):
    path = gf.write_model_gguf(sources["llama"], tmp_path / "m.gguf")
    current = cache.entry_dir(cache.source_sha256(path))
    old = current.with_name(current.name.rsplit("-v", 1)[0] + f"-v{cache.CONVERTER_VERSION - 1}")
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"old weights")
    assert resolve_target(path) == current
    assert not old.exists()
