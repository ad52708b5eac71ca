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


ARCHS = ["llama", "qwen3", "qwen2", "gemma3_text", "phi3", "qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Built on first use: llama with its own output head; qwen3 tied, with head_dim != hidden
    / heads; qwen2 with its q/k/v biases; gemma3 (6 layers, window 4), phi3, qwen3 MoE."""
    root = tmp_path_factory.mktemp("gguf-sources")
    overrides = {"qwen3": {"head_dim": 32, "tie_word_embeddings": True}}

    class Lazy(dict):
        def __missing__(self, arch: str) -> Path:
            self[arch] = gf.build_source(root / arch, arch, seed=11 + ARCHS.index(arch),
                                         **overrides.get(arch, {}))  # fmt: skip
            return self[arch]

    return Lazy()


def logits(model, ids=PROMPT) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def reference_model(source: Path, weights: dict[str, np.ndarray] | None = None):
    """The mlx-lm model of `source` in float32, optionally with replaced weights."""
    from mlx_lm import load

    model, _ = load(str(source))
    model.set_dtype(mx.float32)
    if weights is not None:
        model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


def assert_same_logits(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal within float32 rounding (summation order differs between the two models)."""
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_float_gguf_gives_the_logits_of_its_source(sources, tmp_path, arch):
    source = sources[arch]
    path = gf.write_model_gguf(source, tmp_path / f"{arch}.gguf")
    model, _ = load_target_model(path)
    assert_same_logits(logits(model), logits(reference_model(source)))
    config = json.loads((resolve_target(path) / "config.json").read_text())
    assert config["tie_word_embeddings"] is (arch == "qwen3")
    assert config["head_dim"] == (32 if arch == "qwen3" else 16)
    if arch in ("qwen2", "qwen2_moe"):
        assert "model.layers.1.self_attn.k_proj.bias" in dict(_flat(model.parameters()))


def test_llama_q_k_rows_must_be_unpermuted(sources):
    """The permutation is real: the same tensors read without un-permuting give other logits."""
    source = sources["llama"]
    names = {gf.gguf_name(n): n for n in gf.model_weights(source)}
    wrong = {names[g]: v for g, v in gf.llama_cpp_tensors(source).items()}
    assert not np.allclose(logits(reference_model(source, wrong)),
                           logits(reference_model(source)), atol=1e-3)  # fmt: skip


def test_gemma_norm_shift_is_real(sources):
    """llama.cpp's +1 on Gemma's norms matters: left in, the logits differ."""
    source = sources["gemma3_text"]
    names = {gf.gguf_name(n, "gemma3_text"): n for n in gf.model_weights(source)}
    unshifted = {names[g]: v for g, v in gf.llama_cpp_tensors(source).items()}
    assert not np.allclose(logits(reference_model(source, unshifted)),
                           logits(reference_model(source)), atol=1e-3)  # fmt: skip


def test_gemma3_sliding_window_and_rope_bases_reach_the_config(sources, tmp_path):
    path = gf.write_model_gguf(sources["gemma3_text"], tmp_path / "g.gguf")
    config = json.loads((resolve_target(path) / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (4, 6)
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 1e4)
    assert config["query_pre_attn_scalar"] == 16


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
    assert_same_logits(logits(model, ids), expected)
    unscaled = gf.write_float_gguf(tmp_path / "plain.gguf", gf.llama_cpp_tensors(source),
                                   gf.metadata(source))  # fmt: skip
    assert not np.allclose(logits(load_target_model(unscaled)[0], ids), expected, atol=1e-3)


QUANTIZED = [gf.F16, gf.Q8_0, gf.Q5_0, gf.Q4_0, gf.Q4_1]


@pytest.mark.parametrize("kind", QUANTIZED, ids=[k.name for k in QUANTIZED])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "phi3", "qwen3_moe",
                                  "qwen2_moe"])  # fmt: skip
def test_quantized_gguf_gives_the_logits_of_gguf_py_values(sources, tmp_path, arch, kind):
    """Tensors from gguf-py's quantizer; the reference is the mlx-lm model holding gguf-py's
    dequantized values (mapped back to mlx-lm names and row order by the test's own table)."""
    source = sources[arch]
    tensors, values = gf.quantized_tensors(gf.llama_cpp_tensors(source), kind)
    path = gf.write_gguf(tmp_path / "q.gguf", tensors, gf.metadata(source))
    model, _ = load_target_model(path)
    reference = gf.from_llama_cpp(values, source)
    loaded = dict(_flat(model.parameters()))
    for name, value in reference.items():
        np.testing.assert_array_equal(np.array(loaded[name]), value, err_msg=name)
    assert_same_logits(logits(model), logits(reference_model(source, reference)))


def test_k_quants_and_i_quants_give_the_logits_of_gguf_py_values(tmp_path):
    """Every other type gguf-py decodes (and the three MLX decodes natively), one per matrix:
    random blocks with valid scales; the reference holds gguf-py's dequantization of them."""
    from gguf.quants import dequantize

    # rows of 256 values: the K-quant and i-quant super-block
    source = gf.build_source(tmp_path / "k", "qwen3", seed=31, hidden_size=256, head_dim=64,
                             intermediate_size=512, num_hidden_layers=3)  # fmt: skip
    rng = np.random.default_rng(5)
    kinds = iter(gf.RANDOM_BLOCK_TYPES * 2)
    tensors, values, used = {}, {}, []
    for name, value in gf.llama_cpp_tensors(source).items():
        if value.ndim == 1:
            tensors[name], values[name] = (gf.F32, value), value
            continue
        kind = next(kinds)
        raw = gf.random_blocks(value.shape, kind, rng)
        tensors[name] = (kind, raw)
        values[name] = dequantize(raw, kind).reshape(value.shape)
        assert np.isfinite(values[name]).all() and np.abs(values[name]).max() < 16, kind.name
        used.append(kind)
    assert set(gf.RANDOM_BLOCK_TYPES) <= set(used)
    path = gf.write_gguf(tmp_path / "k.gguf", tensors, gf.metadata(source))
    model, _ = load_target_model(path)
    reference = gf.from_llama_cpp(values, source)
    loaded = dict(_flat(model.parameters()))
    for name, value in reference.items():  # MLX's decoders too: bit for bit
        np.testing.assert_array_equal(np.array(loaded[name]), value, err_msg=name)
    assert_same_logits(logits(model), logits(reference_model(source, reference)))


def test_conversion_reports_progress(sources, tmp_path, capfd):
    resolve_target(gf.write_model_gguf(sources["qwen3"], tmp_path / "p.gguf"))
    err = capfd.readouterr().err
    assert "converting p.gguf: 0%" in err and "converting p.gguf: 100%" in err


def _flat(params):
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def test_unsupported_tensor_type_is_named_and_nothing_is_written(sources, tmp_path, cache_dir):
    from gguf import GGMLQuantizationType as Q

    source = sources["llama"]
    tensors, _ = gf.quantized_tensors(gf.llama_cpp_tensors(source), gf.Q8_0)
    # Q8_K: llama.cpp's intermediate type for dot products, which neither MLX nor gguf-py decode
    tensors["blk.1.ffn_down.weight"] = (Q.Q8_K, np.zeros((64, 292), np.uint8))
    path = gf.write_gguf(tmp_path / "k.gguf", tensors, gf.metadata(source))
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_down\.weight \(Q8_K\).*Q4_K"):
        load_target_model(path)
    entries = [p for p in (cache_dir / "models").glob("*") if p.is_dir()]
    assert entries == []


def test_unsupported_architecture_is_named(sources, tmp_path):
    source = sources["llama"]
    meta = {**gf.model_metadata(source, arch="starcoder2"),
            **gf.tokenizer_metadata(source, "gpt-2")}  # fmt: skip
    path = gf.write_float_gguf(tmp_path / "s.gguf", gf.llama_cpp_tensors(source), meta)
    with pytest.raises(GGUFError, match="architecture 'starcoder2' is not supported"):
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


@pytest.mark.parametrize("pre", ["default", "deepseek-llm", "deepseek-v3", "qwen35"])
def test_pre_tokenizers_of_ollamas_library_load_and_round_trip(sources, tmp_path, pre):
    """The splits Ollama's library ships under these names: the rebuilt tokenizer loads and
    gives back every sample text (byte-level BPE loses nothing whatever the split)."""
    from tokenizers import Tokenizer

    source = sources["qwen3"]
    meta = {**gf.model_metadata(source), **gf.tokenizer_metadata(source, pre)}
    path = gf.write_float_gguf(tmp_path / "t.gguf", gf.llama_cpp_tensors(source), meta)
    tokenizer = Tokenizer.from_file(str(resolve_target(path) / "tokenizer.json"))
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
    split = [p for p, _ in tokenizer.pre_tokenizer.pre_tokenize_str("abc 12345 x")]
    assert (
        split
        == {
            "default": ["abc", "Ġ", "123", "45", "Ġx"],
            "deepseek-llm": ["abc", "Ġ", "12345", "Ġx"],
            "deepseek-v3": ["abc", "Ġ", "123", "45", "Ġx"],
            "qwen35": ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġx"],
        }[pre]
    )
