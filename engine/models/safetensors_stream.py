"""Write a safetensors file one tensor at a time.

`mx.save_safetensors` takes every array at once, so a converted 7B model (28 GB in float32)
would have to sit in memory whole. The format allows streaming: the JSON header lists every
tensor's dtype, shape and byte range up front, and all of that is known from the GGUF header
before any tensor is decoded. So the header is written first and each tensor's bytes follow
as they are produced.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np


def write_streamed(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """float32 tensors `entries` (name, shape), in that order, each from `produce(name)`;
    `progress(done, total)` after each."""
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for name, shape in entries:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as file:
        file.write(len(raw).to_bytes(8, "little") + raw)
        for done, (name, shape) in enumerate(entries, 1):
            value = np.ascontiguousarray(produce(name), dtype=np.float32)
            if value.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {value.shape}, declared {shape}")
            file.write(memoryview(value).cast("B"))
            if progress is not None:
                progress(done, len(entries))
