"""Load a GGUF file into HF-named tensors in the compute dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from prefixd.gpu.config import (
    GGUF_TENSOR_SHAPES_KEY,
    ConfigError,
    ModelConfig,
    config_from_gguf,
    gguf_fixup,
    gguf_tensor_names,
    gguf_unpermute_heads,
    tensor_shapes,
)
from prefixd.gpu.loading.dequant import SUPPORTED_TYPES, dequantize
from prefixd.gpu.loading.errors import ModelLoadError, same_up_to_unit_dims
from prefixd.gpu.loading.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor
from prefixd.gpu.tokenizer import Tokenizer, TokenizerError


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, GGUF interleaves the two rotary halves
    (rows j, j+hd/2 become rows 2j, 2j+1); HF keeps the halves apart."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _plan(path: Path, gf: GGUFFile, config: ModelConfig) -> dict[str, tuple[GGUFTensor, tuple[int, ...]]]:
    """HF name -> GGUF entry for every expected tensor, validated before anything is read."""
    names = gguf_tensor_names(config)
    plan: dict[str, tuple[GGUFTensor, tuple[int, ...]]] = {}
    for hf_name, shape in tensor_shapes(config).items():
        gg_name = names.get(hf_name)
        if gg_name is None:
            raise ModelLoadError(str(path), f"tensor {hf_name!r} has no GGUF name in family {config.family!r}")
        entry = gf.tensors.get(gg_name)
        if entry is None:
            raise ModelLoadError(str(path), f"missing tensor {gg_name!r} ({hf_name})")
        if not same_up_to_unit_dims(entry.shape, shape):
            raise ModelLoadError(str(path), f"tensor {gg_name!r} has shape {entry.shape}, expected {shape}")
        if entry.qtype not in SUPPORTED_TYPES:
            qname = entry.qtype.name if isinstance(entry.qtype, GGMLQuantizationType) else f"type {entry.qtype}"
            raise ModelLoadError(str(path), f"tensor {gg_name!r}: unsupported quantization {qname}")
        plan[hf_name] = (entry, shape)
    return plan


def read_gguf_header(path: Path) -> tuple[GGUFFile, ModelConfig, Tokenizer]:
    """Open and validate: config, tokenizer. ModelLoadError names the file and key."""
    try:
        gf = GGUFFile(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(str(path), str(exc)) from exc
    meta = dict(gf.metadata)
    meta[GGUF_TENSOR_SHAPES_KEY] = {name: t.shape for name, t in gf.tensors.items()}
    try:
        config = config_from_gguf(meta)
    except ConfigError as exc:
        raise ModelLoadError(str(path), str(exc)) from exc
    try:
        tokenizer = Tokenizer.from_gguf_fields(meta)
    except TokenizerError as exc:
        raise ModelLoadError(str(path), f"tokenizer: {exc}") from exc
    return gf, config, tokenizer


def load_gguf(
    path: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str, int, int], None] | None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """(config, tensors, tokenizer) from a GGUF; everything is checked before any tensor is built."""
    gf, config, tokenizer = read_gguf_header(path)
    plan = _plan(path, gf, config)
    heads = gguf_unpermute_heads(config)
    total = sum(e.num_bytes for e, _ in plan.values())
    done = 0
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for hf_name, (entry, shape) in plan.items():
            raw = torch.from_numpy(gf.raw(entry.name)).to(device)
            assert isinstance(entry.qtype, GGMLQuantizationType), "validated in _plan"
            value = dequantize(raw, entry.qtype, entry.shape, dtype)
            if hf_name in heads:
                value = unpermute_rope_rows(value, heads[hf_name])
            tensors[hf_name] = value.reshape(shape).contiguous()
            done += entry.num_bytes
            if progress is not None:
                progress(f"loading {path.name}", done, total)
    fix = gguf_fixup(config)
    if fix is not None:
        fix(config, tensors)
    return config, tensors, tokenizer

