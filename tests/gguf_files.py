"""Test helpers: GGUF files laid out as llama.cpp's converter lays them out, from an mlx-lm
model directory (tensor names, q/k rows permuted for `llama`, RMSNorm weights +1 for Gemma,
merged MoE experts, `{arch}.*` metadata and the tokenizer fields), written with llama.cpp's own
Python writer (gguf-py's `GGUFWriter`).

Quantized tensors come from gguf-py's quantizer (F16, Q8_0, Q5_0, Q4_0, Q4_1). It quantizes no
K-quant or i-quant, so those tensors are random bytes whose float16 scale fields are set to
small values (`random_blocks`): every bit pattern of the quantized values is a valid block.
The name table here is written by hand, independent of the converter's (gguf-py's maps).
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from mlx_lm.utils import save_config, save_model

from engine.bundled.pair import BUNDLED_TARGET

F32, F16, Q4_0, Q4_1, Q8_0, Q5_0, Q4_K = Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K

# mlx-lm model_type -> GGUF architecture name
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "qwen2_moe": "qwen2moe", "phi3": "phi3", "gemma3_text": "gemma3",
             "gemma2": "gemma2", "gemma": "gemma"}  # fmt: skip
GEMMA = ("gemma", "gemma2", "gemma3_text")

# Per-architecture extras on top of factories.target_config: small enough to convert in well
# under a second, with every feature the converter must carry (experts, windows, soft caps).
EXTRAS = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
    "phi3": {"original_max_position_embeddings": 4096},
    # sliding window 4 < the test prompts' 12 tokens, and 6 layers: llama.cpp's fixed pattern
    # makes layer 5 the global one
    "gemma3_text": {"num_hidden_layers": 6, "query_pre_attn_scalar": 16, "sliding_window": 4,
                    "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0},
}  # fmt: skip


def build_source(directory: Path, model_type: str, seed: int, **overrides) -> Path:
    """A tiny random mlx-lm model with the bundled tokenizer (so the GGUF carries a real one).
    Norm weights are random too, so a norm-shift mistake shows in the logits."""
    from factories import target_config

    vocab = json.loads((BUNDLED_TARGET / "config.json").read_text())["vocab_size"]
    config = {**target_config(model_type, vocab, layers=2), **EXTRAS.get(model_type, {}),
              **overrides}  # fmt: skip
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    from mlx.utils import tree_flatten

    norms = [(k, v + 0.3 * mx.random.normal(v.shape)) for k, v in
             tree_flatten(model.parameters()) if k.endswith("norm.weight")]  # fmt: skip
    model.load_weights(norms, strict=False)
    mx.eval(model.parameters())
    directory.mkdir(parents=True)
    save_model(directory, model)
    save_config(config, directory / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED_TARGET / name, directory / name)
    return directory


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
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3: [gate; up] rows, as in its HF checkpoint
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # [1, hidden] in HF, [hidden] in llama.cpp
}
# Gemma 2/3 have four norms per layer; post_attention_layernorm is *not* the FFN norm there.
_GEMMA2_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(name: str, model_type: str = "llama") -> str:
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    table = {**_LAYER, **_GEMMA2_LAYER} if model_type in ("gemma2", "gemma3_text") else _LAYER
    return f"blk.{layer}.{table[rest]}.{kind}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `permute` of q/k rows (convert_hf_to_gguf.py's LlamaModel.permute)."""
    out = w.shape[0]
    return w.reshape(n_head, 2, out // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_weights(model_dir: Path) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        for name, value in mx.load(str(file)).items():
            weights[name] = np.array(value.astype(mx.float32))
    return weights


def llama_cpp_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp names, q/k permuted for llama, norms +1 for Gemma
    (convert_hf_to_gguf.py's Gemma converters: `data_torch + 1` for every norm weight)."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    out = {}
    for name, value in model_weights(model_dir).items():
        if model_type == "llama" and ".q_proj." in name:
            value = permute_rows(value, config["num_attention_heads"])
        elif model_type == "llama" and ".k_proj." in name:
            value = permute_rows(value, config["num_key_value_heads"])
        if model_type in GEMMA and name.endswith("norm.weight"):
            value = value + 1
        if name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)
        out[gguf_name(name, model_type)] = value
    return out


def from_llama_cpp(values: dict[str, np.ndarray], model_dir: Path) -> dict[str, np.ndarray]:
    """The inverse of `llama_cpp_tensors`: llama.cpp-layout values back in mlx-lm names."""
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    shapes = {name: value.shape for name, value in model_weights(model_dir).items()}
    back = {gguf_name(name, model_type): name for name in shapes}
    out = {}
    for g, value in values.items():
        name = back[g]
        value = value.reshape(shapes[name])
        if model_type == "llama" and ".q_proj." in name:
            value = unpermute_rows(value, config["num_attention_heads"])
        elif model_type == "llama" and ".k_proj." in name:
            value = unpermute_rows(value, config["num_key_value_heads"])
        if model_type in GEMMA and name.endswith("norm.weight"):
            value = value - 1
        out[name] = value
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
    arch = arch or GGUF_ARCH[c["model_type"]]
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
    if (
        arch in ("qwen3", "qwen3moe", "gemma3")
        or head_dim != c["hidden_size"] // c["num_attention_heads"]
    ):
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    if arch not in ("qwen3", "qwen3moe", "gemma3"):
        meta[f"{arch}.rope.dimension_count"] = head_dim
    if arch in ("qwen3moe", "qwen2moe"):
        meta[f"{arch}.expert_count"] = c["num_experts"]
        meta[f"{arch}.expert_used_count"] = c["num_experts_per_tok"]
        meta[f"{arch}.expert_feed_forward_length"] = c["moe_intermediate_size"]
    if arch == "qwen2moe":
        meta[f"{arch}.expert_shared_feed_forward_length"] = c["shared_expert_intermediate_size"]
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = c["sliding_window"]
    return meta


def metadata(source: Path) -> dict:
    """All the metadata llama.cpp writes for `source` (its tokenizer: GPT-2 pre-tokenizer)."""
    return {**model_metadata(source), **tokenizer_metadata(source, "gpt-2")}


def _add_metadata(writer: gguf.GGUFWriter, meta: dict) -> None:
    V = gguf.GGUFValueType
    for key, value in meta.items():
        if key == "general.architecture":
            continue  # the writer's constructor wrote it
        if isinstance(value, bool):
            writer.add_key_value(key, value, V.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, V.UINT32)
        elif isinstance(value, float):
            writer.add_key_value(key, value, V.FLOAT32)
        elif isinstance(value, str):
            writer.add_key_value(key, value, V.STRING)
        elif value and isinstance(value[0], str):
            writer.add_key_value(key, value, V.ARRAY, V.STRING)
        elif value and isinstance(value[0], float):
            writer.add_key_value(key, np.asarray(value, np.float32).tolist(), V.ARRAY, V.FLOAT32)
        else:
            writer.add_key_value(key, [int(v) for v in value], V.ARRAY, V.INT32)


def write_gguf(path: Path, tensors: dict[str, tuple[int, np.ndarray]], meta: dict) -> Path:
    """A GGUF file through gguf-py's writer; tensors are name -> (ggml type, stored array:
    float values for F32/F16, the raw uint8 blocks [rows, bytes] for quantized types)."""
    writer = gguf.GGUFWriter(str(path), meta["general.architecture"])
    _add_metadata(writer, meta)
    for name, (kind, array) in tensors.items():
        if kind in (Q.F32, Q.F16):
            writer.add_tensor(name, array.astype(np.float32 if kind == Q.F32 else np.float16))
        else:
            writer.add_tensor(name, array, raw_dtype=Q(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_float_gguf(path: Path, tensors: dict[str, np.ndarray], meta: dict,
                     kind: int = F32) -> Path:  # fmt: skip
    """A float GGUF; norms (1-D) stay float32 as llama.cpp keeps them."""
    return write_gguf(path, {n: (F32 if v.ndim == 1 else kind, v) for n, v in tensors.items()},
                      meta)  # fmt: skip


def write_model_gguf(source: Path, path: Path, kind: int = F32) -> Path:
    """`source` as a float GGUF file in llama.cpp's layout."""
    return write_float_gguf(path, llama_cpp_tensors(source), metadata(source), kind)


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
def quantized_tensors(tensors: dict[str, np.ndarray], kind: int):
    """(GGUF tensors with every matrix quantized by gguf-py, the float values gguf-py's
    dequantizer gives back for them). 1-D tensors stay F32, as llama.cpp keeps norms."""
    out, values = {}, {}
    for name, value in tensors.items():
        if value.ndim >= 2 and kind != F32:
            stored = value.astype(np.float16) if kind == F16 else quantize(value, Q(kind))
            out[name] = (kind, stored)
            values[name] = dequantize(stored, Q(kind)).reshape(value.shape)
        else:
            out[name] = (F32, value.astype(np.float32))
            values[name] = value.astype(np.float32)
    return out, values


# Byte offsets of each block's float16 scale fields (ggml-common.h's block layouts).
SCALE_FIELDS = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ1_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,),
    Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2),
}  # fmt: skip
RANDOM_BLOCK_TYPES = [*SCALE_FIELDS, Q.IQ1_M, Q.MXFP4]


def random_blocks(shape: tuple[int, ...], kind: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [rows, bytes] of `kind` for a tensor of `shape`: random bytes with small
    valid scales (float16 in [1e-3, 4e-3]; MXFP4's power-of-two exponent near 2^-7)."""
    kind = Q(kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 4e-3, raw.shape[:2]).astype(np.float16)
    if kind == Q.MXFP4:
        raw[..., 0] = rng.integers(118, 122, raw.shape[:2], dtype=np.uint8)
    elif kind == Q.IQ1_M:  # the f16 scale is the top nibbles of the four trailing uint16s
        packed = raw[..., 48:56].copy().view(np.uint16)
        bits = scales.view(np.uint16)
        for k in range(4):
            nibble = ((bits >> (4 * k)) & 0xF) << 12
            packed[..., k] = (packed[..., k] & 0x0FFF) | nibble
        raw[..., 48:56] = packed.view(np.uint8)
    else:
        for at in SCALE_FIELDS[kind]:
            raw[..., at : at + 2] = scales[..., None].view(np.uint8).reshape(*scales.shape, 2)
    return raw.reshape(rows, -1)
