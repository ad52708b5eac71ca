"""A reader for the header of a GGUF file: its tensor table (names, ggml types, shapes, offsets).

MLX's own reader (`mx.load`) returns the tensors and metadata, but it does not say which ggml
type a tensor had, and for types it cannot decode (the K-quants, for example) it silently
returns raw bytes as float16. So types are checked here, from the header, before MLX reads
anything. The header also gives the exact size the file must have, which catches truncation.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, elements per block, bytes per block); only the types MLX decodes.
SUPPORTED_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}
# Names of the ggml types MLX does not decode, for the error message.
OTHER_TYPE_NAMES = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
    14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

# GGUF metadata value types: id -> struct format of a scalar (8 = string, 9 = array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be used: not GGUF, truncated, or with an unsupported part."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]  # row-major (numpy order): the GGUF dims reversed
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        if self.type_id in SUPPORTED_TYPES:
            return SUPPORTED_TYPES[self.type_id][0]
        return OTHER_TYPE_NAMES.get(self.type_id, f"type {self.type_id}")

    @property
    def nbytes(self) -> int:
        _, block, size = SUPPORTED_TYPES[self.type_id]
        count = 1
        for dim in self.shape:
            count *= dim
        return count // block * size


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    architecture: str | None
    tensors: list[TensorInfo]
    data_start: int

    def unsupported(self) -> list[TensorInfo]:
        return [t for t in self.tensors if t.type_id not in SUPPORTED_TYPES]

    def expected_size(self) -> int:
        """Bytes the file must hold at least (data start + the furthest tensor's end)."""
        ends = [t.offset + t.nbytes for t in self.tensors]
        return self.data_start + max(ends, default=0)


class _Reader:
    def __init__(self, file: BinaryIO, path: Path) -> None:
        self.file, self.path = file, path

    def take(self, fmt: str) -> object:
        size = struct.calcsize("<" + fmt)
        raw = self.file.read(size)
        if len(raw) != size:
            raise GGUFError(f"{self.path}: the GGUF header ends early (truncated file?)")
        return struct.unpack("<" + fmt, raw)[0]

    def string(self) -> str:
        length = self.take("Q")
        raw = self.file.read(length)
        if len(raw) != length:
            raise GGUFError(f"{self.path}: the GGUF header ends early (truncated file?)")
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.take("I"), self.take("Q")
            if item_kind in _SCALARS:  # skip numeric arrays in one read
                size = struct.calcsize("<" + _SCALARS[item_kind]) * count
                self.file.seek(size, 1)
                return None
            return [self.value(item_kind) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {kind}")


def read_header(path: str | Path) -> GGUFHeader:
    """The tensor table of a GGUF file (metadata values are skipped, except the architecture
    and the alignment)."""
    path = Path(path)
    with path.open("rb") as file:
        reader = _Reader(file, path)
        if file.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
        version = reader.take("I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = reader.take("Q"), reader.take("Q")
        architecture, alignment = None, DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key, kind = reader.string(), reader.take("I")
            value = reader.value(kind)
            if key == "general.architecture":
                architecture = str(value)
            elif key == "general.alignment":
                alignment = int(value)  # type: ignore[arg-type]
        tensors = []
        for _ in range(tensor_count):
            name = reader.string()
            dims = [reader.take("Q") for _ in range(reader.take("I"))]
            type_id, offset = reader.take("I"), reader.take("Q")
            tensors.append(TensorInfo(name, type_id, tuple(reversed(dims)), offset))
        position = file.tell()
    data_start = (position + alignment - 1) // alignment * alignment
    return GGUFHeader(version, architecture, tensors, data_start)


def check_readable(path: str | Path) -> GGUFHeader:
    """The header, once every tensor has a type MLX decodes and the file is complete."""
    path = Path(path)
    header = read_header(path)
    bad = header.unsupported()
    if bad:
        listed = ", ".join(f"{t.name} ({t.type_name})" for t in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        supported = ", ".join(name for name, _, _ in SUPPORTED_TYPES.values())
        raise GGUFError(
            f"{path}: tensor type not supported: {listed}{more}. Supported types: {supported} "
            "(re-quantize the model to one of them, e.g. Q8_0 or Q4_0)"
        )
    size = path.stat().st_size
    if size < header.expected_size():
        raise GGUFError(
            f"{path} is truncated: {size} bytes, the header needs {header.expected_size()}"
        )
    return header
