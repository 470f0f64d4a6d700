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

Mode "int4" (CPU, bf16) keeps each projection as 4-bit codes in groups of 32 inputs with a
bf16 scale and zero per group (`Int4Weight`), run by torch's weight-packed CPU kernel with
bf16 activations: w = (q - 8) * scale + zero, 5 bits per weight streamed. The probe
(bench/probe_cpu.py, docs/runtime.md) found its rows invariant for every M and row position.
A weight whose 4-bit rounding costs too much accuracy (the lm_head) is kept as two 4-bit
layers, the weight's codes and those of its rounding error, side by side along the inputs
(`quantize_int4_residual`): one call of the same kernel over the input read twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixd.gpu import kernels

MIN_FP32_ROWS = 16
MIN_LOW_ROWS = 4  # bf16 / fp16


def invariant_rows(n: int, dtype: torch.dtype) -> int:
    """The number of rows to run so that each of n rows gets its invariant bits."""
    if dtype == torch.float32:
        return max(n, MIN_FP32_ROWS)
    return max(n, MIN_LOW_ROWS)


INT4_GROUP = 32  # inputs sharing one scale and zero: a GGUF Q4_0 / Q4_1 block
_INT4_INNER_K_TILES = 2  # packing layout of the CPU kernel (any of 1, 2, 4, 8 gives the same bits)


@dataclass(frozen=True)
class Int4Weight:
    """A (out, in) projection as 4-bit codes: w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n].

    g = k // INT4_GROUP. `packed` is the CPU kernel's (out, in / 2) uint8 layout of q;
    `scale_zeros` is (in / INT4_GROUP, out, 2) bf16: [..., 0] the scale, [..., 1] the zero.
    """

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    shape: tuple[int, int]
    residual: bool = False  # packed is (out, in) codes: the weight's, then its error's; x read twice

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zeros.nbytes


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (N, K) int32 in 0..15, scale (N, K/32), zero (N, K/32)) of an (N, K) weight.

    Asymmetric per group of 32 inputs: scale = (max - min) / 15, zero = min + 8 * scale, both
    rounded to bf16 (the kernel's), codes rounded to the nearest step from min. Weights
    dequantized from a GGUF Q4_1 block (x = d*q + m, q spanning 0..15) come back with their
    own codes q, and d, m up to the rounding of scale and zero to bf16.
    """
    n, k = weight.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 weights need in_features divisible by {INT4_GROUP}, got {k}")
    groups = weight.float().reshape(n, k // INT4_GROUP, INT4_GROUP)  # (N, G, 32)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, G)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    codes = torch.round((groups - (zero - 8 * scale)[..., None]) / step[..., None]).clamp_(0, 15)
    return codes.reshape(n, k).to(torch.int32), scale, zero


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """The (N, K) weight as 4-bit group-32 codes packed for the CPU kernel (`int4_codes`)."""
    n, k = weight.shape
    codes, scale, zero = int4_codes(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), _INT4_INNER_K_TILES)
    scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (G, N, 2)
    return Int4Weight(packed=packed, scale_zeros=scale_zeros, shape=(n, k))


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 (N, K) weight of `int4_codes`' output: (q - 8) * scale + zero per group."""
    n, k = codes.shape
    groups = codes.float().reshape(n, k // INT4_GROUP, INT4_GROUP) - 8
    return (groups * scale[..., None] + zero[..., None]).reshape(n, k)


def quantize_int4_residual(weight: torch.Tensor) -> Int4Weight:
    """The (N, K) weight as two 4-bit layers in one (N, 2K) packed weight: w's codes, then the
    codes of w minus their dequantized values. x @ w.T is then [x | x] @ packed.T, one call of
    the kernel with one fp32 accumulation: about 8 bits of precision for 10 bits streamed."""
    n, k = weight.shape
    error = weight.float() - dequantize_int4(*int4_codes(weight))
    both = quantize_int4(torch.cat([weight.float(), error], dim=1))  # groups never straddle: k % 32 == 0
    return Int4Weight(packed=both.packed, scale_zeros=both.scale_zeros, shape=(n, k), residual=True)


Weight = torch.Tensor | Int4Weight


def matmul(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x (M, in) @ weight.T in the GEMM's own output dtype (the weight's; bf16 for int4).

    x must already hold `invariant_rows(M, dtype)` rows; it is cast to the GEMM's input dtype
    (a no-op when it has it)."""
    if isinstance(weight, Int4Weight):
        x = x.to(torch.bfloat16)
        if weight.residual:
            x = torch.cat([x, x], dim=1)  # (M, 2 * in): the weight's codes, then its error's
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight.packed, INT4_GROUP, weight.scale_zeros)
    return kernels.mm_t(x.to(weight.dtype), weight)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 (M, out) = x (M, in) @ weight.T (+ bias), the GEMM in weight's dtype (bf16 for int4).

    x must already hold `invariant_rows(M, dtype)` rows; the bias is added in fp32
    outside the GEMM so its bits do not depend on a fused epilogue.
    """
    out = matmul(x, weight).float()
    if bias is not None:
        out = out + bias
    return out


def fuse(weights: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate projections that read the same input into one (sum(out), in) weight."""
    return torch.cat(weights, dim=0).contiguous()
