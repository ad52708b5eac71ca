"""A reader for the header of a GGUF file: its metadata and tensor table (names, ggml types,
shapes, offsets), without touching the tensor data.

Types are checked here, from the header, before any tensor is read: a type neither MLX nor
gguf-py decodes is refused by name (`engine.models.gguf_dequant` says which decode). The header
also gives the exact size the file must have, which catches truncation. Metadata is read by this
small reader rather than gguf-py's `GGUFReader`, which takes ~16 s to parse a 262k-entry
vocabulary into per-element parts; numeric arrays come back as numpy arrays in one read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.models.gguf_dequant import decodable_types

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: id -> struct format of a scalar (8 = string, 9 = array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be used: not GGUF, truncated, or with an unsupported part."""


def type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # row-major (numpy order): the GGUF dims reversed
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def count(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return self.count // block * size


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    architecture: str | None
    tensors: list[TensorInfo]
    data_start: int
    metadata: dict[str, Any]

    def unsupported(self) -> list[TensorInfo]:
        decodable = decodable_types()
        return [t for t in self.tensors if t.type_id not in decodable]

    def expected_size(self) -> int:
        """Bytes the file must hold at least (data start + the furthest tensor's end)."""
        ends = [t.offset + t.nbytes for t in self.tensors]
        return self.data_start + max(ends, default=0)


class _Reader:
    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file, self.path = file, path

    def _read(self, size: int) -> bytes:
        raw = self.file.read(size)
        if len(raw) != size:
            raise GGUFError(f"{self.path}: the GGUF header ends early (truncated file?)")
        return raw

    def take(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self._read(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str:
        return self._read(self.take("Q")).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.take("I"), self.take("Q")
            if item_kind in _SCALARS:  # numeric arrays in one read
                dtype = np.dtype("<" + _SCALARS[item_kind].replace("?", "b1"))
                return np.frombuffer(self._read(dtype.itemsize * count), dtype=dtype)
            if item_kind == _STRING:
                return self._strings(count)
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {kind}")

    def _strings(self, count: int) -> list[str]:
        out = []
        read, unpack = self.file.read, struct.Struct("<Q").unpack
        for _ in range(count):
            head = read(8)
            if len(head) != 8:
                raise GGUFError(f"{self.path}: the GGUF header ends early (truncated file?)")
            raw = read(unpack(head)[0])
            out.append(raw.decode("utf-8", errors="replace"))
        return out


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file."""
    path = Path(path)
    with path.open("rb") as file:
        reader = _Reader(file, path)
        if file.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
        version = reader.take("I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = reader.take("Q"), reader.take("Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, kind = reader.string(), reader.take("I")
            metadata[key] = reader.value(kind)
        architecture = metadata.get("general.architecture")
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        tensors = []
        for _ in range(tensor_count):
            name = reader.string()
            dims = [reader.take("Q") for _ in range(reader.take("I"))]
            type_id, offset = reader.take("I"), reader.take("Q")
            tensors.append(TensorInfo(name, type_id, tuple(reversed(dims)), offset))
        position = file.tell()
    data_start = (position + alignment - 1) // alignment * alignment
    arch = str(architecture) if architecture is not None else None
    return GGUFHeader(version, arch, tensors, data_start, metadata)


def check_readable(path: str | Path) -> GGUFHeader:
    """The header, once every tensor has a type MLX or gguf-py decodes and the file is
    complete."""
    path = Path(path)
    header = read_header(path)
    bad = header.unsupported()
    if bad:
        listed = ", ".join(f"{t.name} ({t.type_name})" for t in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        supported = ", ".join(type_name(t) for t in sorted(decodable_types()))
        raise GGUFError(
            f"{path}: tensor type not supported: {listed}{more}. Supported types: {supported} "
            "(re-quantize the model to one of them, e.g. Q8_0 or Q4_K_M)"
        )
    size = path.stat().st_size
    if size < header.expected_size():
        raise GGUFError(
            f"{path} is truncated: {size} bytes, the header needs {header.expected_size()}"
        )
    return header
