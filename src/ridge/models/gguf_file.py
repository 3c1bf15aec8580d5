"""A GGUF file opened in one pass: its metadata as Python values, each tensor's data a view of the mapped file.

Layout (little-endian; GGUF versions 2 and 3): magic "GGUF", version u32, tensor count u64, key count u64;
the keys (string name, u32 value type, value); the tensor table (name, u32 rank, u64 dims innermost
first, u32 block type, u64 offset); then the data, from the next multiple of `general.alignment` (32).

By hand rather than through gguf's GGUFReader, which builds a numpy view for every element of every array:
for the tokenizer arrays of a 150k-token vocabulary that made opening Qwen2.5-Coder-0.5B take 16 s and
SmolLM2 5 s, before any weight was read (this: 0.1-0.3 s). The block formats' sizes and dequantization
stay gguf's (GGML_QUANT_SIZES, gguf.quants).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# value types of fixed size: struct format and numpy dtype
_SCALARS: dict[GGUFValueType, tuple[str, type]] = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.FLOAT64: ("<d", np.float64),
    GGUFValueType.BOOL: ("<?", np.bool_),
}
# tensor types stored as plain elements; every other type is blocks of bytes
_ELEMENT_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                   GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                   GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                   GGMLQuantizationType.I64: np.int64}
if hasattr(GGMLQuantizationType, "BF16"):
    _ELEMENT_DTYPES[GGMLQuantizationType.BF16] = np.uint16  # raw bits, as gguf's dequantize expects them


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order, rows first (the file lists dims innermost first)
    data: np.ndarray  # elements for float / int types, else bytes [*shape[:-1], bytes per row]


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> int / float / bool / str, or a list of them
    tensors: list[GGUFTensor]

    @property
    def metadata(self) -> dict[str, Any]:
        """The scalar and string keys (arrays, such as the vocabulary, are the tokenizer's)."""
        return {k: v for k, v in self.fields.items() if not isinstance(v, list)}


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.offset + n > len(self.buffer):
            raise ValueError(f"a string of {n} bytes at offset {self.offset} runs past the end of the file")
        self.offset += n
        return self.buffer[self.offset - n:self.offset].decode("utf-8")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if item in _SCALARS:  # one numpy read for the whole array
                fmt, dtype = _SCALARS[item]
                values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
                self.offset += values.nbytes
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        return self.scalar(_SCALARS[kind][0])


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and tensor table; tensor data stays in the mapped file until read. Raises ValueError
    (or struct.error on a file cut short in its header) naming what is wrong."""
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    if buffer[:4] != b"GGUF":
        raise ValueError(f"not a GGUF file (starts with {bytes(buffer[:4])!r}, not b'GGUF')")
    cursor.offset = 4
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as a "
                         "huge version)")
    n_tensors, n_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cursor.string()
        fields[key] = cursor.value(GGUFValueType(cursor.scalar("<I")))
    table = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        table.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    start = -(-cursor.offset // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, kind, offset in table:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        shape = tuple(int(d) for d in reversed(dims))
        block_values, block_bytes = GGML_QUANT_SIZES[kind]
        if kind in _ELEMENT_DTYPES:
            dtype, view_shape = _ELEMENT_DTYPES[kind], shape
        else:
            if shape[-1] % block_values:
                raise ValueError(f"tensor {name}: a row of {shape[-1]} values is not whole {kind.name} blocks "
                                 f"of {block_values}")
            dtype, view_shape = np.uint8, (*shape[:-1], shape[-1] // block_values * block_bytes)
        n_bytes = int(np.prod(view_shape)) * np.dtype(dtype).itemsize
        if start + offset + n_bytes > len(buffer):
            raise ValueError(f"truncated GGUF file (tensor {name} runs past the end of the file)")
        data = np.frombuffer(buffer, dtype=dtype, count=n_bytes // np.dtype(dtype).itemsize, offset=start + offset)
        tensors.append(GGUFTensor(name, kind, shape, data.reshape(view_shape)))
    return GGUFFile(fields, tensors)
