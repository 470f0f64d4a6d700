"""Load a GGUF file into HF-named tensors in the compute dtype."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import numpy as np

import torch
from gguf import GGMLQuantizationType

from prefixd.gpu.config import (
    GGUF_TENSOR_SHAPES_KEY,
    ConfigError,
    ModelConfig,
    RopeScaling,
    config_from_gguf,
    gguf_fixup,
    gguf_tensor_names,
    gguf_unpermute_heads,
    tensor_shapes,
)
from prefixd.gpu.loading.dequant import PLAIN_TYPES, SUPPORTED_TYPES, dequantize
from prefixd.gpu.loading.errors import ModelLoadError, same_up_to_unit_dims
from prefixd.gpu.loading.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor
from prefixd.text.tokenizer import Tokenizer, TokenizerError


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, GGUF interleaves the two rotary halves
    (rows j, j+hd/2 become rows 2j, 2j+1); HF keeps the halves apart."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


_ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x ship these band edges; a rope_freqs tensor is checked against them exactly.
_LLAMA3_BANDS = ((1.0, 4.0, 8192),)


def llama3_factors(scaling: RopeScaling, theta: float, head_dim: int) -> list[float]:
    """Per-frequency divisors llama3 scaling applies (what llama.cpp stores as rope_freqs)."""
    out = []
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(scaling.factor)
        else:
            smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor)
            out.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    return out


def _rope_from_freqs(path: Path, gf: GGUFFile, config: ModelConfig) -> ModelConfig:
    """llama.cpp writes llama3 rope scaling as a rope_freqs tensor: recover its parameters."""
    entry = gf.tensors[_ROPE_FREQS]
    if entry.qtype != GGMLQuantizationType.F32 or entry.shape != (config.head_dim // 2,):
        raise ModelLoadError(str(path), f"tensor {_ROPE_FREQS!r}: expected F32 of shape ({config.head_dim // 2},)")
    factors = gf.raw(_ROPE_FREQS).view(np.float32)
    for low, high, original in _LLAMA3_BANDS:
        scaling = RopeScaling("llama3", float(factors.max()), low, high, original)
        expected = np.array(llama3_factors(scaling, config.rope_theta, config.head_dim), dtype=np.float32)
        if np.allclose(factors, expected, rtol=1e-5, atol=0):
            return dataclasses.replace(config, rope_scaling=scaling)
    raise ModelLoadError(str(path), f"tensor {_ROPE_FREQS!r}: not a llama3 rope scaling this loader knows")


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
    if _ROPE_FREQS in gf.tensors and config.rope_scaling is None:
        config = _rope_from_freqs(path, gf, config)
    return gf, config, tokenizer


def load_gguf(
    path: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Callable[[str, int, int], None] | None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, Callable[[str], torch.Tensor | None]]:
    """(config, tensors, tokenizer, exact) from a GGUF; everything is checked before any tensor
    is built. `exact(name)`: the tensor's stored values in fp32, read again from the file (a
    block type's d * q (+ m) exactly, which the compute dtype may round), or None where the
    loaded tensor already holds them (a plain type) or the family rewrites its tensors after
    the load. A mode that requantizes weights (int4) starts from these, one tensor at a time."""
    gf, config, tokenizer = read_gguf_header(path)
    plan = _plan(path, gf, config)
    heads = gguf_unpermute_heads(config)
    total = sum(e.num_bytes for e, _ in plan.values())
    done = 0

    def build(hf_name: str, dtype: torch.dtype) -> torch.Tensor:
        entry, shape = plan[hf_name]
        raw = torch.from_numpy(gf.raw(entry.name)).to(device)
        assert isinstance(entry.qtype, GGMLQuantizationType), "validated in _plan"
        value = dequantize(raw, entry.qtype, entry.shape, dtype)
        if hf_name in heads:
            value = unpermute_rope_rows(value, heads[hf_name])
        return value.reshape(shape).contiguous()

    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for hf_name, (entry, _) in plan.items():
            tensors[hf_name] = build(hf_name, dtype)
            done += entry.num_bytes
            if progress is not None:
                progress(f"loading {path.name}", done, total)
    fix = gguf_fixup(config)
    if fix is not None:
        fix(config, tensors)

    def exact(hf_name: str) -> torch.Tensor | None:
        if fix is not None or hf_name not in plan or plan[hf_name][0].qtype in PLAIN_TYPES:
            return None
        with torch.no_grad():
            return build(hf_name, torch.float32)

    return config, tensors, tokenizer, exact

