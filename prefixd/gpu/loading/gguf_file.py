"""A small, fast GGUF reader: metadata, tensor index, memory-mapped tensor bytes.

Layout (little-endian):

    "GGUF" | version:u32 | tensor_count:u64 | kv_count:u64
    kv_count  x  key:str | type:u32 | value
    tensor_count x name:str | n_dims:u32 | dims:u64[n_dims] | type:u32 | offset:u64
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)

A str is len:u64 | utf-8 bytes; an array is elem_type:u32 | count:u64 | elems.
GGUF dims are innermost-first: dims [576, 49152] is a torch (49152, 576) tensor.
Everything is validated (types, lengths, every tensor inside the file) before returning.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF (truncated, bad magic, bad type code...)."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's index entry: torch-order shape, type, and absolute byte range."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType | int
    start: int
    num_bytes: int


class _Cursor:
    def __init__(self, buf: memoryview, what: str) -> None:
        self.buf, self.pos, self.what = buf, 0, what

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise GGUFFormatError(f"truncated while reading {self.what} (need {end} bytes, file has {len(self.buf)})")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
                return [bool(x) for x in arr] if etype == 7 else arr.tolist()
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            return [self.value(etype) for _ in range(count)]
        raise GGUFFormatError(f"unknown value type {vtype} in {self.what}")


class GGUFFile:
    """An open GGUF: `metadata` (key -> python value), `tensors` (name -> GGUFTensor).

    `raw(name)` returns the tensor's bytes as a writable copy-on-write numpy view of the
    mapped file (the file itself is never written).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            size = self.path.stat().st_size
            if size < 24:
                raise GGUFFormatError(f"truncated: {size} bytes is shorter than a GGUF header")
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        self.file_bytes = size
        cur = _Cursor(memoryview(self._map), "header")
        if bytes(cur.take(4)) != _MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version}")
        num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            cur.what = "metadata"
            key = cur.string()
            cur.what = f"metadata key {key!r}"
            self.metadata[key] = cur.value(cur.scalar("<I"))
        entries = []
        for _ in range(num_tensors):
            cur.what = "tensor index"
            name = cur.string()
            cur.what = f"tensor index of {name!r}"
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            entries.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = (cur.pos + align - 1) // align * align
        self.tensors = {name: self._entry(name, shape, t, off) for name, shape, t, off in entries}

    def _entry(self, name: str, shape: tuple[int, ...], type_code: int, offset: int) -> GGUFTensor:
        try:
            qtype: GGMLQuantizationType | int = GGMLQuantizationType(type_code)
        except ValueError:
            qtype = type_code
        numel = 1
        for d in shape:
            numel *= d
        if isinstance(qtype, GGMLQuantizationType) and qtype in GGML_QUANT_SIZES:
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
            num_bytes = numel // block_elems * block_bytes
        else:
            num_bytes = 0  # unknown type: size unknown; the loader rejects the type by name
        start = self.data_start + offset
        if start + num_bytes > self.file_bytes:
            raise GGUFFormatError(
                f"truncated: tensor {name!r} needs bytes up to {start + num_bytes}, file has {self.file_bytes}"
            )
        return GGUFTensor(name, shape, qtype, start, num_bytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (uint8, 1-D) viewed from the mapping, without copying."""
        t = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=t.num_bytes, offset=t.start)

    def close(self) -> None:
        """Release the mapping (views from raw() must be gone)."""
        self._map.close()
