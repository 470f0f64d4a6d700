"""Row-invariant linear layers.

A row of `x @ W.T` must have the same bits whatever the number of rows M in the call.
On this project's CPUs (MKL, oneDNN), on one thread (kernels.one_thread: with several, the
library's split of a call changes a row's bits), an fp32 GEMM gives other bits below M = 16
(the last rows of a small call take another kernel; bmm behaves the same), and a bf16 GEMM
gives other bits at M = 1 (a GEMV path; rare, since outputs are rounded to bf16). So calls
are padded to at least `MIN_FP32_ROWS` / `MIN_LOW_ROWS` rows (on a CPU with AMX, kernels.mm_t
then runs bf16 products as calls of a fixed row count). docs/runtime.md has the probe.
On CUDA the product runs in kernels.py (one fixed Triton configuration for every M); the
padding is harmless there. Its invariance is checked by the CUDA tests.

Mode "int4" (CPU, bf16) keeps each projection as 4-bit codes in groups of 32 inputs with an
fp16 scale and base per group (`Int4Weight`: w = q * scale + base, 5 bits per weight streamed;
bf16 for a weight whose scales fp16 would hold less closely: `scale_dtype`),
run by prefixd's own CPU kernel (cpu_kernels.py, csrc/int4_mm.cpp): each row of the input is
quantized to 8 bits per group of 32 inside the call, the group products are exact integer sums
(AVX-512 VNNI where the CPU has it) and the rest a fixed sequence of fp32 operations per output,
so a row's bits depend on that row alone, at every M, thread count and instruction set.
A weight whose 4-bit rounding costs too much accuracy (the lm_head) is kept as 8-bit codes
with a group scale and base (`quantize_int8`, 9 bits per weight streamed; a GGUF Q8_0 weight's
own values), which the same kernel reads with the same arithmetic, in two passes over the
activations: their 8-bit codes, then those of their rounding error (`Int8Weight.passes`; the
8-bit activations were a third of int4's KL divergence from fp32); or (a bench variant, the
head of revisions 2 to 6) as two 4-bit layers, the weight's codes and those of its rounding
error, side by side along the inputs (`quantize_int4_residual`): one call of the kernel, which
reads the input twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixd.gpu import cpu_kernels, kernels

MIN_FP32_ROWS = 16
MIN_LOW_ROWS = 4  # bf16 / fp16


def invariant_rows(n: int, dtype: torch.dtype) -> int:
    """The number of rows to run so that each of n rows gets its invariant bits."""
    if dtype == torch.float32:
        return max(n, MIN_FP32_ROWS)
    return max(n, MIN_LOW_ROWS)


INT4_GROUP = cpu_kernels.GROUP  # inputs sharing one scale and base: a GGUF Q4_0 / Q4_1 block


@dataclass(frozen=True)
class Int4Weight:
    """A (out, in) projection as 4-bit codes: w[n, k] = q[n, k] * scale[n, g] + base[n, g].

    g = k // INT4_GROUP; `codes` and `scales` are the kernel's layout (`cpu_kernels.pack`).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    residual: bool = False  # codes hold (out, 2 * in): the weight's, then its error's; x read twice

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K) int32 in 0..15, scale (N, K/32), base (N, K/32)) of an (N, K) weight.

    Asymmetric per group of 32 inputs: scale = (max - min) / 15 and base = min, both rounded to
    `scale_dtype` (fp16 for a model's weights), codes rounded to the nearest step from base.
    Weights dequantized from a GGUF Q4_1 block (x = d*q + m, q spanning 0..15, d and m stored
    as fp16) come back exactly: their own codes q, d and m.
    """
    return _group_codes(weight, 15, "int4")


BF16_ROUNDING = 2.0 ** -8  # bf16's largest relative rounding error: half a step of 8 significant bits


def scale_dtype(values: torch.Tensor) -> torch.dtype:
    """The dtype a weight's group scales and bases are kept in: fp16 when it holds every one of
    `values` within bf16's relative rounding error (fp16 has 11 significant bits in its normal
    range, and a GGUF's own block scales are fp16: exact), else bf16 (values beyond fp16's
    range, or so small that its subnormals keep fewer bits than bf16)."""
    values = values.float()
    rounded = values.to(torch.float16).float()
    if bool(torch.isfinite(rounded).all()) and bool(((rounded - values).abs() <= values.abs() * BF16_ROUNDING).all()):
        return torch.float16
    return torch.bfloat16


def _group_codes(weight: torch.Tensor, top: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes in 0..top per group of INT4_GROUP inputs: scale = (max - min) / top and base =
    min, both rounded to `scale_dtype`, codes rounded to the nearest step from base."""
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"{name} weights need in_features divisible by {INT4_GROUP}, got {k}")
    groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)  # (N, G, 32)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, G)
    scale = (high - low) / top
    dtype = scale_dtype(torch.stack([scale, low]))
    scale, base = scale.to(dtype).float(), low.to(dtype).float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - base[..., None]) / step[..., None]).clamp_(0, top)
    return codes.reshape(n, k).to(torch.int32), scale, base


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """The (N, K) weight as 4-bit group-32 codes in the kernel's layout (`int4_codes`)."""
    n, k = weight.shape
    codes, scales = cpu_kernels.pack(*int4_codes(weight))
    return Int4Weight(codes=codes, scales=scales, shape=(n, k))


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """fp32 (N, K) weight of `int4_codes`' output: q * scale + base per group."""
    n, k = codes.shape
    groups = codes.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    return (groups * scale[..., None] + base[..., None]).reshape(n, k)


def quantize_int4_residual(weight: torch.Tensor) -> Int4Weight:
    """The (N, K) weight as two 4-bit layers in one (N, 2K) weight: w's codes, then the codes
    of w minus their dequantized values. x @ w.T is then [x | x] @ both.T, one call of the
    kernel (which reads x twice) with one fp32 accumulation: about 8 bits of precision for 10
    bits streamed."""
    n, k = weight.shape
    error = weight.float() - dequantize_int4(*int4_codes(weight))
    codes, scales = cpu_kernels.pack(*int4_codes(torch.cat([weight.float(), error], dim=1)))  # groups never straddle
    return Int4Weight(codes=codes, scales=scales, shape=(n, k), residual=True)


@dataclass(frozen=True)
class Int8Weight:
    """A (out, in) projection as 8-bit codes: w[n, k] = q[n, k] * scale[n, g] + base[n, g], q in
    0..255, g = k // INT4_GROUP; `codes` and `scales` are the kernel's layout (`cpu_kernels.pack8`).
    passes: how many 8-bit codes each activation gets in the product (`cpu_kernels.matmul`):
    2 for the lm_head, whose activations' rounding cost more than its weights' 8 bits do."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    passes: int = 1

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K) int32 in 0..255, scale (N, K/32), base (N, K/32)) of an (N, K) weight.

    Per group of 32 inputs, the better (smaller largest error) of two grids: `int4_codes`' with
    255 steps (scale = (max - min) / 255, base = min) and a symmetric one (scale = max|w| / 127,
    base = -128 * scale), each `scale_dtype`. Weights dequantized from a GGUF Q8_0 block
    (x = d*q, q in -127..127, d fp16) come back exactly on the symmetric grid: scale d, codes
    q + 128 (base is d times a power of two, exact)."""
    codes, scale, base = _group_codes(weight, 255, "int8")
    n, k = weight.shape
    groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    amax = groups.abs().amax(dim=-1)
    step = (amax / 127).to(scale_dtype(torch.stack([amax / 127, amax / 127 * -128]))).float()
    sym_base = step * -128
    safe = torch.where(step > 0, step, torch.ones_like(step))
    sym = (torch.round(groups / safe[..., None]) + 128).clamp_(0, 255)
    err_asym = (codes.reshape(n, -1, INT4_GROUP).float() * scale[..., None] + base[..., None] - groups).abs().amax(-1)
    err_sym = (sym * step[..., None] + sym_base[..., None] - groups).abs().amax(-1)
    take = err_sym < err_asym
    if not bool(take.any()):
        return codes, scale, base
    if scale_dtype(torch.stack([scale, base, step, sym_base])) != torch.float16:
        return codes, scale, base  # one dtype for every group's scales: keep the asymmetric grid
    codes = torch.where(take[..., None], sym.to(torch.int32), codes.reshape(n, -1, INT4_GROUP)).reshape(n, k)
    return codes, torch.where(take, step, scale), torch.where(take, sym_base, base)


def quantize_int8(weight: torch.Tensor, passes: int = 1) -> Int8Weight:
    """The (N, K) weight as 8-bit group-32 codes in the kernel's layout (`int8_codes`), its
    products taking `passes` codes of each activation."""
    n, k = weight.shape
    codes, scales = cpu_kernels.pack8(*int8_codes(weight))
    return Int8Weight(codes=codes, scales=scales, shape=(n, k), passes=passes)


Weight = torch.Tensor | Int4Weight | Int8Weight


def matmul(x: torch.Tensor, weight: Weight, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x (M, in) @ weight.T in the GEMM's own output dtype (the weight's; fp32 for int4 and int8).

    x must already hold `invariant_rows(M, dtype)` rows (any M for int4); it is cast to the
    GEMM's input dtype (a no-op when it has it; int4 reads bf16 or fp32 as they are).
    norm = (weight, eps), int4 only: x's rows RMS-normalized inside the kernel first."""
    if isinstance(weight, (Int4Weight, Int8Weight)):
        passes = weight.passes if isinstance(weight, Int8Weight) else 1
        return cpu_kernels.matmul(x, weight.codes, weight.scales, weight.shape[0], norm=norm, passes=passes)
    if norm is not None:
        raise ValueError("a norm inside the product is mode int4's")
    return kernels.mm_t(x.to(weight.dtype), weight)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 (M, out) = x (M, in) @ weight.T (+ bias), the GEMM in weight's dtype (int4: its kernel).

    x must already hold `invariant_rows(M, dtype)` rows; the bias is added in fp32
    outside the GEMM so its bits do not depend on a fused epilogue.
    """
    out = matmul(x, weight).float()
    if bias is not None:
        out = out + bias
    return out


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ weight.T (+ bias) in x's dtype, for any M: the call padded to
    `invariant_rows(M, x.dtype)` rows and cut back, the bias added after the product (the same
    op whatever the library). For families whose activations stay in the compute dtype."""
    rows = x.shape[0]
    out = kernels.mm_t(kernels.pad_rows(x, invariant_rows(rows, x.dtype)), weight, x.dtype)[:rows]
    return out if bias is None else out + bias


def fuse(weights: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate projections that read the same input into one (sum(out), in) weight."""
    return torch.cat(weights, dim=0).contiguous()
