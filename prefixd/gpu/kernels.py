"""Matrix products and sums whose bits for a row never depend on the rest of the call.

On CPU these are the plain torch ops, each library product (oneDNN / MKL GEMM and batched
GEMM) run on one intra-op thread (`one_thread`): with several threads the library splits a
call by its shape (over rows, or over K for some row counts), so a row's bits would follow
the call's row count and even the buffers' alignment (seen on a 2-core AVX-512 CPU without
BF16 instructions; docs/runtime.md has the probe). On one thread a call has no split, and
the callers pad row counts where the BLAS still picks a kernel by M (linear.py). On a CPU
with AMX, where oneDNN picks its bf16 kernel by M in ways no padding fixes, every bf16
product runs as calls of exactly CPU_PRODUCT_ROWS rows instead (`mm_t`). torch's
own CPU reductions and mode int4's kernels (cpu_kernels.py) add a row's elements in an
order fixed by the row alone, on any thread count, and keep every thread.

On CUDA the libraries choose a kernel per call shape: cuBLAS may split K across thread blocks
when a call has few rows or few batches, and torch's reductions split a row across more
threads when there are few rows. Either changes the order of the additions, so a row's bits
would depend on how many rows share the round. Here CUDA runs Triton kernels with one fixed
configuration: each output tile is reduced over K in BLOCK_K steps, in order, by one program,
and a row sum adds fixed-width column chunks, then reduces the chunk lanes in a fixed tree.
Rows, batches and masks only choose which programs run, never what a program adds.
backend.resolve refuses a CUDA device when Triton is missing (CUDA builds of torch bring it).
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")

try:  # Triton ships with CUDA builds of torch; CPU builds may not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available() -> bool:
    return triton is not None


INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The CPU tests set this (with Triton interpreting) to run a CPU model's attention, norms,
# rope and SiLU through the CUDA path's Triton kernels (flash.py, fused.py): that path's
# plans, indices and kernels, checked end to end on any machine.
TRITON_ON_CPU = False


def triton_path(device: torch.device) -> bool:
    """Whether a forward on `device` runs flash.py's attention and fused.py's kernels: on
    CUDA with Triton (the CPU keeps torch's ops and mode int4's kernels), or on the CPU in the
    tests that ask (`TRITON_ON_CPU`, interpreted)."""
    if triton is None:
        return False
    return device.type == "cuda" or (TRITON_ON_CPU and INTERPRETING)


def block_width(n: int) -> int:
    """The Triton block that holds n elements: the power of two at least n, and at least 16
    (the smallest dimension of a product)."""
    return max(16, 1 << (n - 1).bit_length())


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def one_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on one torch intra-op thread (then the count in use before).

    For CPU library products: their bits must not depend on how the library splits a call
    across threads. Costs ~0.3 us a call when more than one thread is in use."""
    threads = torch.get_num_threads()
    if threads == 1:
        return fn(*args, **kwargs)
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (e.g. "amx_bf16") for this machine's CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


# On a CPU with AMX, oneDNN picks its bf16 kernel by a call's row count even on one thread
# (against a 512-row call, rows took other bits at M 20..32 on 3072x576 and at every M >= 33
# on 49152x576), and no padding rule fixes that. A call of one fixed row count always runs the
# same kernel, and a row's bits in it do not depend on the other rows or its position among
# them: so there every bf16 product runs in calls of exactly CPU_PRODUCT_ROWS rows (the last
# padded with zero rows). Elsewhere None: one call, padded by the callers (linear.py).
AMX_PRODUCT_ROWS = 16
CPU_PRODUCT_ROWS: int | None = AMX_PRODUCT_ROWS if cpu_has("amx_bf16") else None


def fixed_row_calls(x: torch.Tensor) -> bool:
    """Whether a CPU product of x runs as calls of CPU_PRODUCT_ROWS rows (`mm_t`): low
    precision operands on a CPU with AMX."""
    return CPU_PRODUCT_ROWS is not None and not x.is_cuda and x.dtype != torch.float32


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it already has them)."""
    if x.shape[0] >= rows:
        return x
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad], dim=0)


class RowVarianceError(RuntimeError):
    """A CPU library product gives a row other bits depending on the call's row count."""


_cpu_products_checked = False
PROBE_ROWS = (2, 3, 5, 8, 17, 20, 24, 31, 32, 33, 48)  # AMX kernels differed at 20..32 and 33+ (docs/runtime.md)


def check_cpu_products() -> None:
    """Raise RowVarianceError unless bf16 products keep a row's bits at every probed row count
    (once per process; ~50 ms): `mm_t` at the default model's widest projection, and `bmm` at
    attention's shapes (torch's CPU bf16 bmm is row-invariant at every M by probe, not by
    construction). Runs when a CPU runner is built, so a CPU or library that breaks a rule
    the forward relies on is refused instead of serving rows whose bits follow the round."""
    global _cpu_products_checked
    if _cpu_products_checked:
        return
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    x, w = randn(512, 576), randn(3072, 576)
    q, keys = randn(9, 96, 64), randn(9, 256, 64)
    bad = []
    with torch.inference_mode():
        ref = mm_t(x, w)
        bad += [f"mm_t at {m} rows" for m in PROBE_ROWS if not torch.equal(mm_t(x[:m].clone(), w), ref[:m])]
        ref = bmm(q, keys.transpose(1, 2))
        bad += [f"bmm at {m} rows" for m in (1, 3, 6, 17, 48)
                if not torch.equal(bmm(q[:, :m].clone(), keys.transpose(1, 2)), ref[:, :m])]
    if bad:
        raise RowVarianceError(
            f"bf16 products on this CPU give a row other bits depending on the call's row count "
            f"({', '.join(bad)}), so outputs would depend on the round; prefixd cannot run exactly "
            f"here with torch {torch.__version__} (CPU_PRODUCT_ROWS={CPU_PRODUCT_ROWS}, "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')})")
    _cpu_products_checked = True


MM_BLOCK_M, MM_BLOCK_N, MM_BLOCK_K, MM_WARPS, MM_STAGES = 64, 64, 32, 4, 3
SUM_BLOCK_R, SUM_BLOCK_C = 16, 256
MAX_GRID_Z = 65535  # CUDA's limit on the third grid dimension (the batch)

if triton is not None:

    # a call's row count changes from round to round: one compiled kernel for every count
    # (Triton would otherwise build another, mid-serving, for 1 or a multiple of 16)
    @triton.jit(do_not_specialize=["M"])
    def _bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        batch = tl.program_id(2).to(tl.int64)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + batch * s_ab + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
        b_ptrs = b_ptr + batch * s_bb + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * s_ak
            b_ptrs += BLOCK_K * s_bk
        c_ptrs = c_ptr + batch * s_cb + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["R"])
    def _row_sum_kernel(x_ptr, out_ptr, R, C, s_r, s_c,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        row_off = rows[:, None].to(tl.int64) * s_r
        acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for c0 in tl.range(0, C, BLOCK_C):
            mask = (rows[:, None] < R) & (cols[None, :] + c0 < C)
            x = tl.load(x_ptr + row_off + (cols[None, :] + c0) * s_c, mask=mask, other=0.0)
            acc += x.to(tl.float32)
        tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rows < R)


def bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, M, K) @ (B, K, N) -> (B, M, N) in `out_dtype` (default a's dtype), fp32 accumulation.

    Both operands share a dtype; fp32 operands multiply in full fp32 (no TF32)."""
    out_dtype = out_dtype or a.dtype
    if not _use_triton(a):
        c = one_thread(torch.bmm, a, b)
        return c if c.dtype == out_dtype else c.to(out_dtype)
    if a.dtype != b.dtype:
        raise TypeError(f"bmm operands differ in dtype: {a.dtype} and {b.dtype}")
    batches, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batches, m, n), dtype=out_dtype, device=a.device)
    for lo in range(0, batches, MAX_GRID_Z):
        hi = min(batches, lo + MAX_GRID_Z)
        _launch_bmm(a[lo:hi], b[lo:hi], c[lo:hi], m, n, k)
    return c


def _launch_bmm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, m: int, n: int, k: int) -> None:
    grid = (triton.cdiv(m, MM_BLOCK_M), triton.cdiv(n, MM_BLOCK_N), a.shape[0])
    _bmm_kernel[grid](a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
                      BLOCK_M=MM_BLOCK_M, BLOCK_N=MM_BLOCK_N, BLOCK_K=MM_BLOCK_K,
                      IEEE=a.dtype == torch.float32, num_warps=MM_WARPS, num_stages=MM_STAGES)


def mm_t(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T -> (M, N) in `out_dtype` (default weight's dtype)."""
    out_dtype = out_dtype or weight.dtype
    if not _use_triton(x):
        if fixed_row_calls(x):
            out = one_thread(_linear_fixed_rows, x, weight, CPU_PRODUCT_ROWS)
        else:
            out = one_thread(torch.nn.functional.linear, x, weight)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    return bmm(x.unsqueeze(0), weight.t().unsqueeze(0), out_dtype)[0]


def _linear_fixed_rows(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """x @ weight.T as calls of exactly `rows` rows each (the last padded with zero rows)."""
    m = x.shape[0]
    padded = -(-m // rows) * rows
    x = pad_rows(x, padded)
    if padded == rows:
        return torch.nn.functional.linear(x, weight)[:m]
    outs = [torch.nn.functional.linear(x[i:i + rows], weight) for i in range(0, padded, rows)]
    return torch.cat(outs)[:m]


def sum_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over `dim` (dropped), fp32 on CUDA; on CPU `x.sum(dim)` in x's dtype."""
    if not _use_triton(x):
        return x.sum(dim=dim)
    moved = x.movedim(dim, -1)
    shape = moved.shape[:-1]
    rows = moved.reshape(-1, moved.shape[-1])  # a copy only when the dims do not flatten
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        grid = (triton.cdiv(rows.shape[0], SUM_BLOCK_R),)
        _row_sum_kernel[grid](rows, out, rows.shape[0], rows.shape[1], rows.stride(0), rows.stride(1),
                              BLOCK_R=SUM_BLOCK_R, BLOCK_C=SUM_BLOCK_C, num_warps=4)
    return out.view(shape)


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, kept as a dim of 1 (fp32 input)."""
    if not _use_triton(x):
        return x.mean(-1, keepdim=True)
    return (sum_dim(x, -1) / x.shape[-1]).unsqueeze(-1)
