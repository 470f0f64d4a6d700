"""Load a Hugging Face directory: config.json, *.safetensors (sharded too), tokenizer files.

safetensors layout: header_len:u64 | header JSON {name: {dtype, shape, data_offsets}} | data.
Headers are parsed here (so truncation and bad entries are reported by name before any
tensor is built); tensor bytes are read through a read-only memory map.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from prefixd.gpu.config import ConfigError, ModelConfig, config_from_hf, tensor_shapes
from prefixd.gpu.loading.errors import ModelLoadError, same_up_to_unit_dims
from prefixd.text.tokenizer import Tokenizer, TokenizerError

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(str(path), "missing") from exc
    except (OSError, ValueError) as exc:
        raise ModelLoadError(str(path), f"cannot parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(str(path), "expected a JSON object")
    return data


def _index_file(path: Path) -> dict[str, _Entry]:
    """Every tensor entry of one .safetensors file, checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(str(path), "truncated: no safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ModelLoadError(str(path), f"truncated: header needs {8 + header_len} bytes, file has {size}")
        try:
            header = json.loads(fh.read(header_len))
        except ValueError as exc:
            raise ModelLoadError(str(path), f"bad safetensors header: {exc}") from exc
    base = 8 + header_len
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in info["data_offsets"])
            entry = _Entry(path, str(info["dtype"]), tuple(int(d) for d in info["shape"]), base + start, base + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(str(path), f"tensor {name!r}: bad header entry") from exc
        if entry.end > size:
            raise ModelLoadError(str(path), f"truncated: tensor {name!r} needs bytes up to {entry.end}, file has {size}")
        entries[name] = entry
    return entries


def _safetensor_files(root: Path) -> list[Path]:
    index = root / _INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(str(index), "key 'weight_map' missing")
        files = sorted({root / str(f) for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(str(f), f"missing shard listed in {_INDEX}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(root), "no *.safetensors files")
    return files


def _plan(root: Path, config: ModelConfig) -> dict[str, tuple[_Entry, tuple[int, ...]]]:
    entries: dict[str, _Entry] = {}
    for f in _safetensor_files(root):
        entries.update(_index_file(f))
    plan: dict[str, tuple[_Entry, tuple[int, ...]]] = {}
    for name, shape in tensor_shapes(config).items():
        entry = entries.get(name)
        if entry is None:
            raise ModelLoadError(str(root), f"missing tensor {name!r}")
        if not same_up_to_unit_dims(entry.shape, shape):
            raise ModelLoadError(str(entry.file), f"tensor {name!r} has shape {entry.shape}, expected {shape}")
        if entry.dtype not in _DTYPES:
            raise ModelLoadError(str(entry.file), f"tensor {name!r}: unsupported dtype {entry.dtype}")
        numel = int(np.prod(entry.shape, dtype=np.int64))
        if entry.end - entry.start != numel * _DTYPES[entry.dtype].itemsize:
            raise ModelLoadError(str(entry.file), f"tensor {name!r}: byte range does not match its shape")
        plan[name] = (entry, shape)
    return plan


def load_hf_dir(
    root: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str, int, int], None] | None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, tensors, tokenizer) from an HF directory; all checks run before any tensor is built."""
    cfg_path = root / "config.json"
    try:
        config = config_from_hf(_read_json(cfg_path))
    except ConfigError as exc:
        raise ModelLoadError(str(cfg_path), str(exc)) from exc
    try:
        tokenizer = Tokenizer.from_hf_dir(root)
    except TokenizerError as exc:
        raise ModelLoadError(str(root), f"tokenizer: {exc}") from exc
    plan = _plan(root, config)
    total = sum(e.end - e.start for e, _ in plan.values())
    done = 0
    maps: dict[Path, mmap.mmap] = {}
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, (entry, shape) in plan.items():
            if entry.file not in maps:
                with open(entry.file, "rb") as fh:
                    maps[entry.file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            raw = np.frombuffer(maps[entry.file], dtype=np.uint8, count=entry.end - entry.start, offset=entry.start)
            value = torch.from_numpy(raw).to(device).view(_DTYPES[entry.dtype])
            # A copy: the returned tensors never alias the file mapping.
            tensors[name] = value.reshape(shape).to(dtype, copy=True)
            done += entry.end - entry.start
            if progress is not None:
                progress(f"loading {root.name}", done, total)
    return config, tensors, tokenizer
