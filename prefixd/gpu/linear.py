"""Row-invariant linear layers.

A row of `x @ W.T` must have the same bits whatever the number of rows M in the call.
On this project's CPUs (MKL, oneDNN) an fp32 GEMM gives other bits below M = 12 (the last
M % 4 rows of a small call take another kernel; bmm behaves the same), and a bf16 GEMM gives
other bits at M = 1 (a GEMV path; rare, since outputs are rounded to bf16). So calls are
padded to at least `MIN_FP32_ROWS` / `MIN_LOW_ROWS` rows. docs/runtime.md has the probe.
On CUDA the product runs in kernels.py (one fixed Triton configuration for every M); the
padding is harmless there. Its invariance is checked by the CUDA tests.
"""

from __future__ import annotations

import torch

from prefixd.gpu import kernels

MIN_FP32_ROWS = 16
MIN_LOW_ROWS = 4  # bf16 / fp16


def invariant_rows(n: int, dtype: torch.dtype) -> int:
    """The number of rows to run so that each of n rows gets its invariant bits."""
    if dtype == torch.float32:
        return max(n, MIN_FP32_ROWS)
    return max(n, MIN_LOW_ROWS)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it already has them)."""
    if x.shape[0] >= rows:
        return x
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad], dim=0)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 (M, out) = x (M, in) @ weight.T (+ bias), the GEMM in weight's dtype.

    x must already hold `invariant_rows(M, weight.dtype)` rows; the bias is added in fp32
    outside the GEMM so its bits do not depend on a fused epilogue.
    """
    out = kernels.mm_t(x.to(weight.dtype), weight).float()
    if bias is not None:
        out = out + bias
    return out


def fuse(weights: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate projections that read the same input into one (sum(out), in) weight."""
    return torch.cat(weights, dim=0).contiguous()
