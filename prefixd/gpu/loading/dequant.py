"""Vectorized GGUF dequantizers (torch): raw block bytes -> float32 values.

Each function takes the tensor's bytes as a (num_blocks, block_bytes) uint8 tensor and
returns (num_blocks, block_elems) float32. Arithmetic is done in float32 in the same order
as ggml's reference (scale products first, then the multiply, then the offset), so results
equal `gguf.quants.dequantize` bit for bit.

Block layouts (bytes):

    Q8_0 (32 values, 34 B):  d:f16 | q:i8[32]                       x = d*q
    Q4_0 (32 values, 18 B):  d:f16 | nib[16]                        x = d*(q-8)
    Q4_1 (32 values, 20 B):  d:f16 | m:f16 | nib[16]                x = d*q + m
        nibbles: value j < 16 is the low nibble of byte j, value j+16 its high nibble
    Q4_K (256 values, 144 B): d:f16 | dmin:f16 | scales[12] | nib[128]
    Q5_K (256 values, 176 B): d:f16 | dmin:f16 | scales[12] | qh[32] | nib[128]
        8 sub-blocks of 32 with 6-bit scale and min: x = (d*sc)*q - (dmin*min);
        nib: each 32-byte run holds two sub-blocks (low nibbles, then high nibbles);
        Q5_K's 5th bit of sub-block s, value l is bit s of qh[l]
    Q6_K (256 values, 210 B): ql[128] | qh[64] | scales:i8[16] | d:f16
        x = (d*scale[i//16]) * (q-32), q = 4 low bits from ql, 2 high bits from qh
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType as QT

_F16, _F32 = torch.float16, torch.float32


def _half(raw: torch.Tensor) -> torch.Tensor:
    """(n, 2k) uint8 -> (n, k) float32 read as little-endian float16."""
    return raw.contiguous().view(_F16).to(_F32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, ..., k) bytes -> (n, ..., 2, k) uint8: low nibbles, then high nibbles."""
    out = torch.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=out.select(-2, 0))
    torch.bitwise_right_shift(qs, 4, out=out.select(-2, 1))
    return out


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, :2])
    q = b[:, 2:].contiguous().view(torch.int8).to(_F32)
    return q.mul_(d)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _half(b[:, :2])
    q = _nibbles(b[:, 2:]).reshape(b.shape[0], 32).to(_F32)
    return q.sub_(8.0).mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _half(b[:, :2]), _half(b[:, 2:4])
    q = _nibbles(b[:, 4:]).reshape(b.shape[0], 32).to(_F32)
    # d*q is exact in float32 (11-bit by 4-bit mantissas), so the fused form rounds once, as d*q + m does.
    return torch.addcmul(m, d, q)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte K-quant scales: 8 six-bit scales and 8 six-bit mins, (n, 8) each.

    Sub-blocks 0-3 keep their 6 bits in bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7
    keep their low 4 bits in bytes 8-11 and their top 2 bits in the spare top bits of 0-7.
    """
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)), dim=1)
    mins = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return scale.to(_F32), mins.to(_F32)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d*scale)*q - (dmin*min) per sub-block; q is (n, 8, 32) float32."""
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    # (d*scale)*q is exact in float32 (at most 22 significant bits): one rounding, as in ggml.
    return torch.addcmul((dmin * mn).neg_().unsqueeze(-1), (d * sc).unsqueeze(-1), q).reshape(b.shape[0], 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).to(_F32)
    return _k_affine(b, q)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = b[:, 16:48]
    low = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (qh.unsqueeze(1) >> shifts) & 1
    return _k_affine(b, (low | (high << 4)).to(_F32))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).to(_F32)
    d = _half(b[:, 208:210])
    low = _nibbles(ql).reshape(n, 2, 128)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = ((qh.unsqueeze(2) >> shifts) & 3).reshape(n, 2, 128)
    q = ((low | (high << 4)).to(torch.int8) - 32).to(_F32).reshape(n, 16, 16)
    return ((d * scales).unsqueeze(-1) * q).reshape(n, 256)


# qtype -> (values per block, bytes per block, block dequantizer)
BLOCK_TYPES: dict[QT, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    QT.Q8_0: (32, 34, _q8_0),
    QT.Q4_0: (32, 18, _q4_0),
    QT.Q4_1: (32, 20, _q4_1),
    QT.Q4_K: (256, 144, _q4_k),
    QT.Q5_K: (256, 176, _q5_k),
    QT.Q6_K: (256, 210, _q6_k),
}
PLAIN_TYPES: dict[QT, torch.dtype] = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
SUPPORTED_TYPES = frozenset(BLOCK_TYPES) | frozenset(PLAIN_TYPES)

# Values decoded per step. On CPU each op stays under torch's parallel grain (32768
# elements), so it runs on the calling thread: forking for memory-bound byte ops is slower,
# and far slower when the cores are shared. On CUDA, large steps keep launches few.
_CPU_STEP_VALUES = 1 << 14
_CUDA_STEP_VALUES = 1 << 24


def dequantize(raw: torch.Tensor, qtype: QT, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Decode a GGUF tensor's raw bytes (uint8, any shape) to `shape` in `dtype`.

    `shape` is in torch order (GGUF's dims reversed). Raises ValueError for an unsupported
    type or a byte count that does not match the shape.
    """
    flat = raw.reshape(-1)
    numel = 1
    for dim in shape:
        numel *= dim
    if qtype in PLAIN_TYPES:
        src = PLAIN_TYPES[qtype]
        if flat.numel() != numel * src.itemsize:
            raise ValueError(f"{qtype.name}: {flat.numel()} bytes for {numel} values")
        return flat.view(src).reshape(shape).to(dtype, copy=True)
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"unsupported quantization type {qtype.name}")
    block_elems, block_bytes, fn = BLOCK_TYPES[qtype]
    if numel % block_elems or flat.numel() != numel // block_elems * block_bytes:
        raise ValueError(f"{qtype.name}: {flat.numel()} bytes for {numel} values")
    blocks = flat.view(-1, block_bytes)
    out = torch.empty((blocks.shape[0], block_elems), dtype=dtype, device=raw.device)
    step = (_CUDA_STEP_VALUES if raw.device.type == "cuda" else _CPU_STEP_VALUES) // block_elems
    for start in range(0, blocks.shape[0], step):
        stop = start + step
        out[start:stop] = fn(blocks[start:stop])
    return out.reshape(shape)
