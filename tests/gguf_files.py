"""Test helpers: GGUF files laid out as llama.cpp's converter lays them out, from an mlx-lm
model directory (tensor names, q/k rows permuted for `llama`, `{arch}.*` metadata and the
tokenizer fields).

Float files are written with MLX's own writer (`mx.save_gguf`). It cannot write quantized
types (it refuses uint32 and bfloat16 arrays), so Q4_0 / Q4_1 / Q8_0 files, and files with a
type MLX does not decode, go through `write_gguf`, a minimal writer of the GGUF v3 format.
"""

from __future__ import annotations

import importlib
import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import save_config, save_model

from engine.bundled.pair import BUNDLED_TARGET


def build_source(directory: Path, model_type: str, seed: int, **overrides) -> Path:
    """A tiny random mlx-lm model with the bundled tokenizer (so the GGUF carries a real one)."""
    from factories import target_config

    vocab = json.loads((BUNDLED_TARGET / "config.json").read_text())["vocab_size"]
    config = {**target_config(model_type, vocab, layers=2), **overrides}
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    directory.mkdir(parents=True)
    save_model(directory, model)
    save_config(config, directory / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TARGET / name, directory / name)
    return directory


F32, F16, Q4_0, Q4_1, Q8_0, Q4_K = 0, 1, 2, 3, 8, 12

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `permute` of q/k rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_weights(model_dir: Path) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        for name, value in mx.load(str(file)).items():
            weights[name] = np.array(value.astype(mx.float32))
    return weights


def llama_cpp_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp names, q/k permuted as llama.cpp does for llama."""
    config = json.loads((model_dir / "config.json").read_text())
    out = {}
    for name, value in model_weights(model_dir).items():
        if config["model_type"] == "llama" and ".q_proj." in name:
            value = permute_rows(value, config["num_attention_heads"])
        elif config["model_type"] == "llama" and ".k_proj." in name:
            value = permute_rows(value, config["num_key_value_heads"])
        out[gguf_name(name)] = value
    return out


def tokenizer_metadata(tokenizer_dir: Path, pre: str) -> dict:
    """`tokenizer.*` metadata as llama.cpp writes it for a byte-level BPE tokenizer."""
    doc = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [1] * len(tokens)
    for added in doc["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    template_file = tokenizer_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.exists() else config["chat_template"]
    eos = vocab[config["eos_token"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": eos,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.padding_token_id": vocab[config.get("pad_token", config["eos_token"])],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": template,
    }


def model_metadata(model_dir: Path, arch: str | None = None) -> dict:
    """`general.*` and `{arch}.*` metadata as llama.cpp writes it."""
    c = json.loads((model_dir / "config.json").read_text())
    arch = arch or c["model_type"]
    meta = {
        "general.architecture": arch,
        "general.name": model_dir.name,
        f"{arch}.block_count": c["num_hidden_layers"],
        f"{arch}.context_length": c["max_position_embeddings"],
        f"{arch}.embedding_length": c["hidden_size"],
        f"{arch}.feed_forward_length": c["intermediate_size"],
        f"{arch}.attention.head_count": c["num_attention_heads"],
        f"{arch}.attention.head_count_kv": c["num_key_value_heads"],
        f"{arch}.rope.freq_base": float(c["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c["rms_norm_eps"]),
        f"{arch}.vocab_size": c["vocab_size"],
    }
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if arch == "qwen3" or head_dim != c["hidden_size"] // c["num_attention_heads"]:
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    if arch != "qwen3":
        meta[f"{arch}.rope.dimension_count"] = head_dim
    return meta


def _mx_meta(meta: dict) -> dict:
    """mx.save_gguf takes strings, lists of strings and arrays (typed like llama.cpp's)."""
    out = {}
    for key, value in meta.items():
        if isinstance(value, bool):
            out[key] = mx.array(value)
        elif isinstance(value, int):
            out[key] = mx.array(value, dtype=mx.uint32)
        elif isinstance(value, float):
            out[key] = mx.array(value, dtype=mx.float32)
        elif isinstance(value, list) and value and isinstance(value[0], int):
            out[key] = mx.array(value, dtype=mx.int32)
        else:
            out[key] = value
    return out


def write_float_gguf(path: Path, tensors: dict[str, np.ndarray], meta: dict,
                     dtype=mx.float32) -> Path:  # fmt: skip
    """A float GGUF through MLX's writer; norms stay float32 as llama.cpp keeps them."""
    arrays = {
        name: mx.array(v).astype(mx.float32 if v.ndim == 1 else dtype)
        for name, v in tensors.items()
    }
    mx.save_gguf(str(path), arrays, _mx_meta(meta))
    return path


def metadata(source: Path) -> dict:
    """All the metadata llama.cpp writes for `source` (its tokenizer: GPT-2 pre-tokenizer)."""
    return {**model_metadata(source), **tokenizer_metadata(source, "gpt-2")}


def write_model_gguf(source: Path, path: Path, dtype=mx.float32) -> Path:
    """`source` as a float GGUF file in llama.cpp's layout."""
    return write_float_gguf(path, llama_cpp_tensors(source), metadata(source), dtype)


def llama3_rope_freqs(head_dim: int, base: float, scaling: dict) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a Llama 3.1-style config."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * base ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


# ----------------------------------------------------------------------------- quantized
def q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q8_0 blocks of x (rows of a multiple of 32) and the values they stand for (d * q)."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(blocks).max(1, keepdims=True) / 127).astype(np.float16)
    q = np.round(blocks / np.maximum(d.astype(np.float32), 1e-12)).clip(-127, 127).astype(np.int8)
    raw = b"".join(d[i].tobytes() + q[i].tobytes() for i in range(len(q)))
    return raw, (d.astype(np.float32) * q).reshape(x.shape)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """ggml's 4-bit block packing: byte j holds value j (low nibble) and value j + 16."""
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def q4_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q4_0 blocks (d = max-magnitude / -8, q in 0..15, value d * (q - 8)) and their values."""
    blocks = x.astype(np.float32).reshape(-1, 32)
    idx = np.abs(blocks).argmax(1)
    d = (blocks[np.arange(len(blocks)), idx] / -8)[:, None].astype(np.float16)
    inv = 1 / np.where(d == 0, 1, d.astype(np.float32))
    q = np.clip(np.floor(blocks * inv + 8.5), 0, 15).astype(np.int32)
    packed = _nibbles(q)
    raw = b"".join(d[i].tobytes() + packed[i].tobytes() for i in range(len(q)))
    return raw, (d.astype(np.float32) * (q - 8)).reshape(x.shape)


def q4_1(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q4_1 blocks from MLX's own affine 4-bit quantization (scale d, offset m, value d*q + m:
    exactly ggml's Q4_1 with d and m stored as float16), and their values."""
    wq, scales, biases = mx.quantize(mx.array(x.astype(np.float32)), group_size=32, bits=4)
    d = np.array(scales.astype(mx.float16)).reshape(-1, 1)
    m = np.array(biases.astype(mx.float16)).reshape(-1, 1)
    words = np.array(wq).view(np.uint8).reshape(-1, 16)  # 32 values per block, 2 per byte
    q = np.stack([words & 0xF, words >> 4], axis=-1).reshape(-1, 32)
    packed = _nibbles(q)
    raw = b"".join(d[i].tobytes() + m[i].tobytes() + packed[i].tobytes() for i in range(len(q)))
    return raw, (d.astype(np.float32) * q + m.astype(np.float32)).reshape(x.shape)


QUANTIZERS = {Q8_0: q8_0, Q4_0: q4_0, Q4_1: q4_1}


def quantized_tensors(tensors: dict[str, np.ndarray], kind: int):
    """(GGUF tensors with every matrix quantized, float values those tensors stand for)."""
    out, values = {}, {}
    for name, value in tensors.items():
        if value.ndim == 2:
            raw, values[name] = QUANTIZERS[kind](value)
            out[name] = (kind, value.shape, raw)
        else:
            values[name] = value.astype(np.float32)
            out[name] = (F32, value.shape, values[name].tobytes())
    return out, values


# ----------------------------------------------------------------------------- raw writer
def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(value) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    if value and isinstance(value[0], str):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
    return struct.pack("<IIQ", 9, 5, len(value)) + np.asarray(value, np.int32).tobytes()


def write_gguf(path: Path, tensors: dict[str, tuple[int, tuple[int, ...], bytes]],
               meta: dict, alignment: int = 32) -> Path:  # fmt: skip
    """A GGUF v3 file; tensors are name -> (ggml type id, numpy-order shape, raw bytes)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    head += b"".join(_string(k) + _value(v) for k, v in meta.items())
    data, offset = [], 0
    for name, (kind, shape, raw) in tensors.items():
        dims = list(reversed(shape))
        head += _string(name) + struct.pack("<I", len(dims))
        head += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind, offset)
        padded = raw + b"\0" * (-len(raw) % alignment)
        data.append(padded)
        offset += len(padded)
    head += b"\0" * (-len(head) % alignment)
    path.write_bytes(head + b"".join(data))
    return path
