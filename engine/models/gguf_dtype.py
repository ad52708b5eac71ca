"""The compute dtype of a converted GGUF on a GPU.

Converted weights are stored in float32 (dequantizing is exact there, and float32 is what the
CPU backend computes in). On a GPU the engine keeps a checkpoint's own dtype; for a GGUF that
is the precision of the file itself, recorded at conversion as `gguf_dtype` in config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def converted_gguf_dtype(directory: Path) -> mx.Dtype | None:
    """The GGUF source's float dtype for a converted directory; None for any other model."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return _DTYPES.get(config.get("gguf_dtype", ""))
