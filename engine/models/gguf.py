"""Convert a llama.cpp GGUF checkpoint into an mlx-lm model directory.

The directory holds `config.json`, `model.safetensors` (float weights) and the tokenizer rebuilt
from the GGUF metadata (`engine.models.gguf_tokenizer`), so `mlx_lm.load` and `transformers`
read it like any Hugging Face checkpoint. Quantized tensors (Q4_0, Q4_1, Q8_0) are dequantized:
on MLX's CPU backend the 4-bit kernels measured slower than float32 matmuls through OpenBLAS
(90 ms vs 68 ms a decode step on SmolLM2-135M), and float weights keep every backend's
arithmetic the same as an mlx-lm checkpoint's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.models.gguf_header import GGUFError, check_readable
from engine.models.gguf_rope import llama3_scaling
from engine.models.gguf_tokenizer import write_tokenizer

GROUP_SIZE = 32  # every ggml quant type MLX decodes uses blocks of 32 values


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture maps onto an mlx-lm model type."""

    model_type: str
    hf_class: str
    permuted_qk: bool  # llama.cpp's converter reorders q/k rows for its RoPE layout
    qkv_bias: bool = False  # mlx-lm builds q/k/v with biases (qwen2)
    head_dim_in_config: bool = False  # mlx-lm's ModelArgs requires head_dim (qwen3)


ARCHITECTURES = {
    "llama": Architecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False, qkv_bias=True),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False, head_dim_in_config=True),
}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}  # fmt: skip
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def _required(meta: dict[str, Any], key: str) -> Any:
    value = _scalar(meta, key)
    if value is None:
        raise GGUFError(f"GGUF metadata lacks {key}")
    return value


def mlx_name(gguf_name: str) -> str:
    """mlx-lm's parameter name for a llama.cpp tensor name (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise GGUFError(f"unexpected tensor {gguf_name}")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if base == "rope_freqs":
        raise GGUFError("tensor rope_freqs (RoPE frequency factors) is supported for llama only")
    raise GGUFError(f"tensor {gguf_name} has no mlx-lm counterpart in this converter")


def unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row order: it interleaves the two rotary halves of each head."""
    out = w.shape[0]
    head_dim = out // n_head
    rest = w.shape[1:]
    w = w.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2)
    return w.reshape(out, *rest)


def _float_tensors(raw: dict[str, mx.array]) -> dict[str, mx.array]:
    """GGUF name -> float tensor; MLX's quantized triples (`x.weight` words with `x.scales` /
    `x.biases`) are dequantized in float32, the bit width read from the shapes."""
    out: dict[str, mx.array] = {}
    for name, value in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.rsplit(".", 1)[0]
        scales = raw.get(f"{base}.scales")
        if scales is None:
            out[name] = value
            continue
        bits = value.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 values
        out[name] = mx.dequantize(
            value, scales.astype(mx.float32), raw[f"{base}.biases"].astype(mx.float32),
            group_size=GROUP_SIZE, bits=bits,
        )  # fmt: skip
    return out


def source_float_dtype(raw: dict[str, mx.array]) -> str:
    """The float precision the GGUF itself carries (its F16 tensors, its quant scales):
    what a GPU computes in, as it would for an mlx-lm checkpoint stored in that dtype."""
    return "float16" if any(v.dtype == mx.float16 for v in raw.values()) else "float32"


def model_config(
    arch_name: str,
    meta: dict[str, Any],
    tensors: dict[str, mx.array],
    rope_freqs: mx.array | None = None,
) -> dict:
    """config.json for mlx-lm / transformers from the `{arch}.*` metadata (and, for Llama 3.1
    and later, the RoPE scaling that the `rope_freqs` tensor encodes)."""
    arch = ARCHITECTURES[arch_name]

    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    hidden = int(_required(meta, key("embedding_length")))
    n_head = int(_required(meta, key("attention.head_count")))
    n_kv = int(_scalar(meta, key("attention.head_count_kv"), n_head))
    # key_length is written only when it differs from hidden / heads; the q rows tell as well
    q_rows = tensors["blk.0.attn_q.weight"].shape[0] if "blk.0.attn_q.weight" in tensors else 0
    head_dim = int(_scalar(meta, key("attention.key_length"), q_rows // n_head or hidden // n_head))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(_required(meta, key("block_count"))),
        "intermediate_size": int(_required(meta, key("feed_forward_length"))),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(_required(meta, key("attention.layer_norm_rms_epsilon"))),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "rope_theta": float(_scalar(meta, key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(_scalar(meta, key("context_length"), 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",  # as stored here; `gguf_dtype` is the source file's
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    scaling = _scalar(meta, key("rope.scaling.type"))
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"RoPE scaling {scaling!r} ({key('rope.scaling.type')}) is not "
                            "supported; only linear is")  # fmt: skip
        factor = float(_required(meta, key("rope.scaling.factor")))
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    rope_dims = int(_scalar(meta, key("rope.dimension_count"), head_dim))
    if rope_dims != head_dim:  # mlx-lm's llama/qwen rotate the whole head
        raise GGUFError(f"partial RoPE ({key('rope.dimension_count')} {rope_dims} of head_dim "
                        f"{head_dim}) is not supported")  # fmt: skip
    if rope_freqs is not None:
        original = _scalar(meta, key("rope.scaling.original_context_length"))
        scaling = llama3_scaling(
            np.array(rope_freqs.astype(mx.float32)), rope_dims, config["rope_theta"], original
        )
        if scaling is not None:
            config["rope_scaling"] = scaling
    for name in ("bos", "eos", "padding"):
        token_id = _scalar(meta, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token_id)
    return config


def architecture_of(path: str | Path) -> str:
    """The GGUF's architecture, once it is one this converter handles."""
    header = check_readable(path)
    if header.architecture not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {header.architecture!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return header.architecture


def convert_gguf(path: str | Path, out_dir: str | Path) -> dict:
    """Write the mlx-lm directory for a GGUF file into `out_dir` (which must exist and be
    empty); returns its config. Checks types and architecture before reading any tensor."""
    path, out_dir = Path(path), Path(out_dir)
    arch_name = architecture_of(path)
    raw, meta = mx.load(str(path), return_metadata=True)
    tensors = _float_tensors(raw)
    gguf_dtype = source_float_dtype(raw)
    del raw
    rope_freqs = tensors.pop("rope_freqs.weight", None) if arch_name == "llama" else None
    config = model_config(arch_name, meta, tensors, rope_freqs)
    config["gguf_dtype"] = gguf_dtype
    weights: dict[str, mx.array] = {}
    for name, value in tensors.items():
        if ARCHITECTURES[arch_name].permuted_qk:
            if name.startswith("blk.") and ".attn_q." in name:
                value = unpermute_rows(value, config["num_attention_heads"])
            elif name.startswith("blk.") and ".attn_k." in name:
                value = unpermute_rows(value, config["num_key_value_heads"])
        weights[mlx_name(name)] = value
    _check_complete(weights, config, ARCHITECTURES[arch_name])
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(meta, out_dir, model_max_length=config["max_position_embeddings"])
    return config


def _check_complete(weights: dict[str, mx.array], config: dict, arch: Architecture) -> None:
    """Every parameter mlx-lm's model will ask for is present (a clear error, not a failed
    load deep inside mlx-lm)."""
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                 "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    if arch.model_type == "qwen3":
        per_layer += ["self_attn.q_norm", "self_attn.k_norm"]
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        needed += [f"model.layers.{i}.{p}.weight" for p in per_layer]
        if arch.qkv_bias:
            needed += [f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"]
    missing = [name for name in needed if name not in weights]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise GGUFError(f"GGUF lacks tensors for {', '.join(missing[:5])}{more}")
