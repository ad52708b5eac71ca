"""How each llama.cpp architecture maps onto an mlx-lm model: its config and its tensor names.

Tensor names come from gguf-py's own maps (`gguf.TensorNameMap`, filtered by `MODEL_TENSORS`
for the architecture): they list, for every GGUF name, the Hugging Face names llama.cpp's
converter reads it from, and mlx-lm uses the Hugging Face names (with one exception, its merged
MoE experts, `switch_mlp`, which the map calls `experts`). So the converter builds the mlx-lm
model's parameter list (lazily, nothing allocated) and asks the map for each one's GGUF name:
a parameter without a tensor, or a tensor no parameter takes, is a clear error.

What names cannot say lives in `ARCHITECTURES`, one line of quirks per architecture.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, get_tensor_name_map

from engine.models.gguf_header import GGUFError


@dataclass(frozen=True)
class Architecture:
    """One llama.cpp architecture's mlx-lm counterpart and its conversion quirks."""

    model_type: str  # mlx-lm module (mlx_lm.models.<model_type>)
    hf_class: str  # `architectures` in config.json, for transformers
    gguf_arch: MODEL_ARCH  # gguf-py's key into its tensor-name maps
    permuted_qk: bool = False  # llama.cpp's converter interleaves q/k rows for its RoPE
    norm_shift: float = 0.0  # subtracted from every `*norm.weight` llama.cpp stored
    qk_norm: bool = False  # mlx-lm's ModelArgs requires head_dim (q/k norms per head)


ARCHITECTURES: dict[str, Architecture] = {
    # Llama 1-3, Mistral 7B, SmolLM: the only family whose q/k rows llama.cpp permutes.
    "llama": Architecture("llama", "LlamaForCausalLM", MODEL_ARCH.LLAMA, permuted_qk=True),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", MODEL_ARCH.QWEN2),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", MODEL_ARCH.QWEN3, qk_norm=True),
    # MoE: llama.cpp stores each layer's experts merged (ffn_*_exps), as mlx-lm's switch_mlp.
    "qwen2moe": Architecture("qwen2_moe", "Qwen2MoeForCausalLM", MODEL_ARCH.QWEN2MOE),
    "qwen3moe": Architecture(
        "qwen3_moe", "Qwen3MoeForCausalLM", MODEL_ARCH.QWEN3MOE, qk_norm=True
    ),  # fmt: skip
    # Phi-3: fused qkv and gate_up as in its HF checkpoint, no permutation. mlx-lm's phi3 has
    # no sliding window (Phi-3-mini-4k's is 2047 tokens): exact up to it. LongRoPE files
    # (rope_factors_long/short) are refused by the tensor-set check.
    "phi3": Architecture("phi3", "Phi3ForCausalLM", MODEL_ARCH.PHI3),
    # Gemma 1-3: llama.cpp's converter adds 1 to every RMSNorm weight (its norm multiplies by
    # w, Gemma's by 1 + w); mlx-lm's Gemma norm adds the 1 itself, so it is taken off again.
    # No q/k permutation. The sqrt(hidden) embedding scale is in mlx-lm's model code.
    # mlx-lm's gemma2 has no sliding window (4,096 tokens): exact up to it.
    "gemma": Architecture("gemma", "GemmaForCausalLM", MODEL_ARCH.GEMMA, norm_shift=1.0),
    "gemma2": Architecture("gemma2", "Gemma2ForCausalLM", MODEL_ARCH.GEMMA2, norm_shift=1.0),
    "gemma3": Architecture(
        "gemma3_text", "Gemma3ForCausalLM", MODEL_ARCH.GEMMA3, norm_shift=1.0, qk_norm=True
    ),  # fmt: skip
}

# Gemma 3's sliding-window layout, which llama.cpp hard-codes rather than stores: every 6th
# layer is global; the others are local (sliding window) with RoPE base 10,000.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return value


def required(meta: dict[str, Any], key: str) -> Any:
    value = scalar(meta, key)
    if value is None:
        raise GGUFError(f"GGUF metadata lacks {key}")
    return value


def architecture(name: str | None, path: object) -> Architecture:
    if name not in ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[name]


def arch_config(arch_name: str, meta: dict[str, Any], config: dict[str, Any]) -> dict:
    """The architecture-specific config.json fields, on top of the common ones."""

    def key(name: str, default: Any = None) -> Any:
        return scalar(meta, f"{arch_name}.{name}", default)

    extra: dict[str, Any] = {}
    if arch_name in ("qwen2moe", "qwen3moe"):
        extra["num_experts"] = int(required(meta, f"{arch_name}.expert_count"))
        extra["num_experts_per_tok"] = int(required(meta, f"{arch_name}.expert_used_count"))
        extra["moe_intermediate_size"] = int(
            required(meta, f"{arch_name}.expert_feed_forward_length")
        )
    if arch_name == "qwen2moe":
        extra["shared_expert_intermediate_size"] = int(
            required(meta, f"{arch_name}.expert_shared_feed_forward_length")
        )
    if arch_name == "qwen3moe":
        # llama.cpp renormalises the chosen experts' weights for qwen3moe (norm_w = true)
        extra.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch_name == "phi3":
        dims = int(key("rope.dimension_count", config["head_dim"]))
        extra["partial_rotary_factor"] = dims / config["head_dim"]
        extra["original_max_position_embeddings"] = config["max_position_embeddings"]
    if arch_name == "gemma2":
        extra["query_pre_attn_scalar"] = config["head_dim"]
        extra["attn_logit_softcapping"] = float(key("attn_logit_softcapping", 50.0))
        extra["final_logit_softcapping"] = float(key("final_logit_softcapping", 30.0))
    if arch_name == "gemma3":
        # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers):
        # 1/sqrt(hidden / heads), as its HF config's query_pre_attn_scalar says.
        big = config["num_hidden_layers"] == 62
        extra["query_pre_attn_scalar"] = (
            config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
        )
        extra["sliding_window"] = int(key("attention.sliding_window", 512))
        extra["sliding_window_pattern"] = GEMMA3_SWA_PATTERN
        extra["rope_local_base_freq"] = GEMMA3_LOCAL_ROPE_BASE
    return extra


def model_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """mlx-lm's parameter names and shapes for `config` (the model is built lazily: its
    random initial values are never computed)."""
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    params = {name: tuple(value.shape) for name, value in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        params.pop("lm_head.weight", None)
    return params


def gguf_names(arch: Architecture, params: dict[str, tuple[int, ...]], n_layers: int) -> dict:
    """mlx-lm parameter name -> GGUF tensor name, from gguf-py's map for the architecture."""
    table = get_tensor_name_map(arch.gguf_arch, n_layers)
    out = {}
    for name in params:
        hf_name = name.replace(".switch_mlp.", ".experts.")  # mlx-lm's merged experts
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFError(f"mlx-lm parameter {name} has no GGUF tensor name in gguf-py's map")
        out[name] = gguf_name
    return out
