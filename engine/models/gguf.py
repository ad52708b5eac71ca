"""Convert a llama.cpp GGUF checkpoint into an mlx-lm model directory.

The directory holds `config.json`, `model.safetensors` (float32 weights) and the tokenizer
rebuilt from the GGUF metadata (`engine.models.gguf_tokenizer`), so `mlx_lm.load` and
`transformers` read it like any Hugging Face checkpoint. Quantized tensors of every type MLX or
gguf-py decodes (`engine.models.gguf_dequant`) are dequantized: on MLX's CPU backend the 4-bit
kernels measured slower than float32 matmuls through OpenBLAS (90 ms vs 68 ms a decode step on
SmolLM2-135M), the K-quants and i-quants have no MLX kernel at all, and float weights keep
every backend's arithmetic the same as an mlx-lm checkpoint's.

The conversion streams: the file is memory-mapped, one tensor at a time is decoded and written
(`engine.models.safetensors_stream`), so a 7B file converts in the memory of its largest tensor.
Architectures and their quirks are in `engine.models.gguf_arch`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

from engine.models.gguf_arch import (
    ARCHITECTURES,
    arch_config,
    architecture,
    gguf_names,
    model_parameters,
    required,
    scalar,
)
from engine.models.gguf_dequant import dequantize
from engine.models.gguf_header import GGUFError, GGUFHeader, TensorInfo, check_readable
from engine.models.gguf_rope import llama3_scaling
from engine.models.gguf_tokenizer import write_tokenizer
from engine.models.safetensors_stream import write_streamed

__all__ = ["ARCHITECTURES", "convert_gguf", "architecture_of", "unpermute_rows"]

Progress = Callable[[int, int], None]  # (source bytes converted, all of them)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it interleaves the two rotary halves of each head."""
    out = w.shape[0]
    head_dim = out // n_head
    rest = w.shape[1:]
    w = w.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2)
    return w.reshape(out, *rest)


def source_float_dtype(tensors: list[TensorInfo]) -> str:
    """The float precision the GGUF itself carries (its F16 tensors, its quant scales, which
    are float16 in every ggml quant type): what a GPU computes in, as it would for an mlx-lm
    checkpoint stored in that dtype."""
    kinds = {t.type_name for t in tensors}
    if kinds - {"F32", "BF16"}:
        return "float16"
    return "bfloat16" if "BF16" in kinds else "float32"


def model_config(arch_name: str, meta: dict[str, Any], tensors: dict[str, TensorInfo],
                 rope_freqs: np.ndarray | None = None) -> dict:  # fmt: skip
    """config.json for mlx-lm / transformers from the `{arch}.*` metadata (and, for Llama 3.1
    and later, the RoPE scaling that the `rope_freqs` tensor encodes)."""
    arch = ARCHITECTURES[arch_name]

    def key(name: str) -> str:
        return f"{arch_name}.{name}"

    hidden = int(required(meta, key("embedding_length")))
    n_head = int(required(meta, key("attention.head_count")))
    n_kv = int(scalar(meta, key("attention.head_count_kv"), n_head))
    # key_length is written only when it differs from hidden / heads; the q rows tell as well
    q = tensors.get("blk.0.attn_q.weight")
    q_rows = q.shape[0] if q is not None else 0
    head_dim = int(scalar(meta, key("attention.key_length"), q_rows // n_head or hidden // n_head))
    moe = arch_name.endswith("moe")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(required(meta, key("block_count"))),
        "intermediate_size": int(
            scalar(meta, key("feed_forward_length"), 0)
            if moe
            else required(meta, key("feed_forward_length"))
        ),  # fmt: skip
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(required(meta, key("attention.layer_norm_rms_epsilon"))),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "rope_theta": float(scalar(meta, key("rope.freq_base"), 10000.0)),
        "max_position_embeddings": int(scalar(meta, key("context_length"), 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",  # as stored here; `gguf_dtype` is the source file's
    }
    if arch.model_type == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    scaling = scalar(meta, key("rope.scaling.type"))
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"RoPE scaling {scaling!r} ({key('rope.scaling.type')}) is not "
                            "supported; only linear is")  # fmt: skip
        factor = float(required(meta, key("rope.scaling.factor")))
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    rope_dims = int(scalar(meta, key("rope.dimension_count"), head_dim))
    if rope_dims != head_dim and arch_name != "phi3":  # these rotate the whole head
        raise GGUFError(f"partial RoPE ({key('rope.dimension_count')} {rope_dims} of head_dim "
                        f"{head_dim}) is not supported")  # fmt: skip
    if rope_freqs is not None:
        original = scalar(meta, key("rope.scaling.original_context_length"))
        scaling = llama3_scaling(rope_freqs, rope_dims, config["rope_theta"], original)
        if scaling is not None:
            config["rope_scaling"] = scaling
    for name in ("bos", "eos", "padding"):
        token_id = scalar(meta, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token_id)
    config.update(arch_config(arch_name, meta, config))
    return config


def architecture_of(path: str | Path) -> str:
    """The GGUF's architecture, once it is one this converter handles."""
    header = check_readable(path)
    architecture(header.architecture, path)
    return str(header.architecture)


class _Tensors:
    """Decoded tensors of a memory-mapped GGUF, one at a time."""

    def __init__(self, path: Path, header: GGUFHeader) -> None:
        self.header = header
        self.infos = {t.name: t for t in header.tensors}
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

    def get(self, name: str) -> np.ndarray:
        info = self.infos[name]
        start = self.header.data_start + info.offset
        return dequantize(self.data[start : start + info.nbytes], info.type_id, info.shape)


def stderr_progress(label: str) -> Progress:
    """A progress line on stderr every 10% of the source's bytes, with the elapsed time."""
    start, shown = time.monotonic(), [-1]

    def report(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth != shown[0]:
            shown[0] = tenth
            print(f"flashbatch: converting {label}: {done * 100 // max(total, 1)}% "
                  f"({done / 1e6:.0f} of {total / 1e6:.0f} MB, {time.monotonic() - start:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip

    return report


def convert_gguf(path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> dict:
    """Write the mlx-lm directory for a GGUF file into `out_dir` (which must exist and be
    empty); returns its config. Checks types, architecture and the tensor set before decoding
    any tensor."""
    path, out_dir = Path(path), Path(out_dir)
    header = check_readable(path)
    arch_name = str(header.architecture)
    arch = architecture(header.architecture, path)
    meta = header.metadata
    source = _Tensors(path, header)
    rope_freqs = None
    if "rope_freqs.weight" in source.infos and arch_name == "llama":
        rope_freqs = source.get("rope_freqs.weight")
    config = model_config(arch_name, meta, source.infos, rope_freqs)
    config["gguf_dtype"] = source_float_dtype(header.tensors)
    params = model_parameters(config)
    names = gguf_names(arch, params, config["num_hidden_layers"])
    _check_tensor_set(names, source.infos, arch_name)
    for name, shape in params.items():
        info = source.infos[names[name]]
        if info.count != int(np.prod(shape)):
            raise GGUFError(f"GGUF tensor {info.name} has shape {info.shape}, mlx-lm's {name} "
                            f"needs {shape}")  # fmt: skip

    def produce(name: str) -> np.ndarray:
        gguf_name = names[name]
        value = source.get(gguf_name)
        if arch.permuted_qk and ".attn_q." in gguf_name:
            value = unpermute_rows(value, config["num_attention_heads"])
        elif arch.permuted_qk and ".attn_k." in gguf_name:
            value = unpermute_rows(value, config["num_key_value_heads"])
        if arch.norm_shift and gguf_name.endswith("norm.weight"):
            value = value - np.float32(arch.norm_shift)
        return value.reshape(params[name])

    # the tokenizer first: a vocabulary it refuses fails before minutes of dequantizing
    write_tokenizer(meta, out_dir, model_max_length=config["max_position_embeddings"])
    report = progress or stderr_progress(path.name)
    done_bytes = [0, *accumulate(source.infos[names[name]].nbytes for name in params)]
    report(0, done_bytes[-1])
    write_streamed(out_dir / "model.safetensors", list(params.items()), produce,
                   metadata={"format": "mlx"},
                   progress=lambda done, _: report(done_bytes[done], done_bytes[-1]))  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _check_tensor_set(names: dict[str, str], tensors: dict[str, TensorInfo], arch: str) -> None:
    """Every parameter mlx-lm's model will ask for is in the file, and every tensor of the
    file has a place (a clear error, not a failed load deep inside mlx-lm)."""
    missing = [g for g in names.values() if g not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise GGUFError(f"GGUF lacks tensors for {', '.join(missing[:5])}{more}")
    used = set(names.values()) | ({"rope_freqs.weight"} if arch == "llama" else set())
    extra = sorted(set(tensors) - used)
    if extra:
        if "rope_freqs.weight" in extra:
            raise GGUFError(
                "tensor rope_freqs (RoPE frequency factors) is supported for llama only"
            )
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise GGUFError(f"tensor {', '.join(extra[:5])}{more} has no mlx-lm counterpart in "
                        f"this converter ({arch})")  # fmt: skip
