"""Llama 3.1-style RoPE scaling from a GGUF's `rope_freqs` tensor.

Hugging Face configs state the scaling as four numbers (`factor`, `low_freq_factor`,
`high_freq_factor`, `original_max_position_embeddings`); llama.cpp's converter instead stores
the per-frequency multipliers they produce, as the tensor `rope_freqs`, and drops the numbers.
mlx-lm wants the numbers. The multipliers determine them: the largest is `factor`, and in the
band between the two cut-offs the smoothing term is linear in 1 / wavelength, so a line through
the band's points gives the two frequency factors once the original context length is fixed
(only their ratio to it matters). The result is checked by recomputing every multiplier.
"""

from __future__ import annotations

import math

import numpy as np

from engine.models.gguf_header import GGUFError

DEFAULT_ORIGINAL_CONTEXT = 8192  # Llama 3.1's; any value gives the same multipliers


def llama3_multipliers(dims: int, base: float, scaling: dict) -> np.ndarray:
    """The wavelength multipliers of mlx-lm's (and Hugging Face's) Llama 3 RoPE."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (old / wavelens - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelens > old / low, factor, np.where(wavelens < old / high, 1.0, medium))


def llama3_scaling(rope_freqs: np.ndarray, dims: int, base: float,
                   original_context: int | None = None) -> dict | None:  # fmt: skip
    """The `rope_scaling` config whose multipliers are `rope_freqs` (None: no scaling)."""
    m = np.asarray(rope_freqs, dtype=np.float64)
    if m.shape != (dims // 2,):
        raise GGUFError(f"rope_freqs has shape {m.shape}, the RoPE needs {dims // 2} values")
    if np.allclose(m, 1.0):
        return None
    factor = float(m.max())
    old = original_context or DEFAULT_ORIGINAL_CONTEXT
    wavelens = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    band = (m > 1 + 1e-6) & (m < factor * (1 - 1e-6))
    if band.sum() < 2:
        raise GGUFError(
            "rope_freqs has fewer than two smoothed frequencies: its Llama 3 scaling "
            "parameters cannot be recovered"
        )
    # 1/m = 1/factor + s * (1 - 1/factor), and s = (old/wavelen - low) / (high - low)
    smooth = (1 / m[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(old / wavelens[band], smooth, 1)
    low = -intercept / slope
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + 1 / slope),
        "original_max_position_embeddings": int(old),
    }
    if not np.allclose(llama3_multipliers(dims, base, scaling), m, rtol=1e-4, atol=1e-5):
        raise GGUFError("rope_freqs does not follow Llama 3's RoPE scaling rule")
    return scaling
