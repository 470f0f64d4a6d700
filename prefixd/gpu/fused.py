"""Fused element-wise kernels of the CUDA path, in Triton: each a fixed program per row.

Where `kernels.triton_path(device)` holds (CUDA), the llama-style forward runs a layer as

    x   = rms_norm(h += pending)            one kernel: the residual add and the norm
    qkv = x @ Wqkv                          kernels.mm_t
    rope_write(qkv)                         one kernel: (+ bias), rope, q's scale, q into the
                                            attention buffer, K and V into their pool slots
    o   = flash attention @ Wo              flash.py, kernels.mm_t
    x   = rms_norm(h += o)                  one kernel
    act = silu_mul(x @ Wgate|up)            one kernel
    pending = act @ Wdown                   (added by the next layer's norm)

nine launches a layer where torch's ops took about thirty, which is what a replayed decode
graph spends its time on at small batches.

Why a row's bits never depend on the call: a program takes 16 rows (the norm: as many as
fit in 4,096 elements; the last program's padding rows masked), with a configuration that depends only on the model's widths, never
on the row count, and computes each row alike and apart from the others; the norm's sum of
squares is one `tl.sum` over the whole row held in registers, in the order the fixed layout
gives every row; everything else is element-wise. Their bits differ from
torch's ops (a device runs one form for every round): the CPU keeps torch's ops.
tests/gpu/test_fused.py checks them against torch (tolerance) and for row invariance; the CPU
tests run them through Triton's interpreter.
"""

from __future__ import annotations

import torch

from prefixd.gpu import kernels

if kernels.triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - depends on the install
    triton = None

ROWS = 16  # rows per program (fewer programs for a prefill; a decode row's program masks the rest)
ELEMENTS = 256  # columns per program of silu_mul
NORM_ELEMENTS = 4096  # the norm's rows per program: as many whole rows as fit in this many elements
NUM_WARPS = 4


if triton is not None:

    # row counts change from round to round: one compiled kernel for every count (Triton would
    # otherwise build another, mid-serving, for a count of 1 or a multiple of 16)
    @triton.jit(do_not_specialize=["R"])
    def _rms_norm_kernel(h_ptr, res_ptr, w_ptr, out_ptr, R, C, eps, s_h, s_r, s_o,
                         HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r64 = rows.to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_C)[None, :]
        ok = (rows[:, None] < R) & (cols < C)
        x = tl.load(h_ptr + r64 * s_h + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            x = x + tl.load(res_ptr + r64 * s_r + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(h_ptr + r64 * s_h + cols, x, mask=ok)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
        w = tl.load(w_ptr + cols, mask=cols < C, other=0.0)
        tl.store(out_ptr + r64 * s_o + cols, (x * inv[:, None] * w).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["R"])
    def _silu_mul_kernel(gu_ptr, out_ptr, R, I, s_gu, s_o, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r64 = rows.to(tl.int64)[:, None]
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
        ok = (rows[:, None] < R) & (cols < I)
        g = tl.load(gu_ptr + r64 * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + r64 * s_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r64 * s_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["R", "num_rows"])
    def _rope_write_kernel(qkv_ptr, bias_ptr, pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
                           R, num_rows, s_qkv, s_q, scale, half_stride,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HALF: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r64 = rows.to(tl.int64)[:, None]
        d = tl.arange(0, HALF)[None, :]
        in_round = rows[:, None] < R
        real = rows[:, None] < num_rows  # rows with a KV slot (the rest are padding)
        pos = tl.load(pos_ptr + rows, mask=rows < R, other=0).to(tl.int64)[:, None]
        c = tl.load(cos_ptr + pos * half_stride + d, mask=in_round, other=0.0)
        s = tl.load(sin_ptr + pos * half_stride + d, mask=in_round, other=0.0)
        slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=0).to(tl.int64)[:, None]
        for head in tl.static_range(HEADS + 2 * KV_HEADS):  # q heads, then k heads, then v heads
            at = head * HEAD_DIM + d
            x1 = tl.load(qkv_ptr + r64 * s_qkv + at, mask=in_round, other=0.0).to(tl.float32)
            x2 = tl.load(qkv_ptr + r64 * s_qkv + at + HALF, mask=in_round, other=0.0).to(tl.float32)
            if HAS_BIAS:
                x1 = x1 + tl.load(bias_ptr + at)
                x2 = x2 + tl.load(bias_ptr + at + HALF)
            if head < HEADS + KV_HEADS:
                y1 = x1 * c - x2 * s
                y2 = x2 * c + x1 * s
                if head < HEADS:  # q: scaled, into the attention's q buffer (padding rows too)
                    out = q_ptr + r64 * s_q + head * HEAD_DIM + d
                    tl.store(out, (y1 * scale).to(q_ptr.dtype.element_ty), mask=in_round)
                    tl.store(out + HALF, (y2 * scale).to(q_ptr.dtype.element_ty), mask=in_round)
                else:  # k: into its pool slot
                    out = k_ptr + (slot * KV_HEADS + head - HEADS) * HEAD_DIM + d
                    tl.store(out, y1.to(k_ptr.dtype.element_ty), mask=real)
                    tl.store(out + HALF, y2.to(k_ptr.dtype.element_ty), mask=real)
            else:  # v: into its pool slot as it is
                out = v_ptr + (slot * KV_HEADS + head - HEADS - KV_HEADS) * HEAD_DIM + d
                tl.store(out, x1.to(v_ptr.dtype.element_ty), mask=real)
                tl.store(out + HALF, x2.to(v_ptr.dtype.element_ty), mask=real)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """RMSNorm of rows h (R, C), in fp32, times weight, in out_dtype; with `residual` (h fp32),
    first h += residual (any float dtype, added in fp32) in place: the norm reads the sum."""
    rows, width = h.shape
    if h.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm takes rows with contiguous columns")
    out = torch.empty((rows, width), dtype=out_dtype, device=h.device)
    if rows:
        res = residual if residual is not None else h
        block_c = kernels.block_width(width)
        block_r = max(1, min(ROWS, NORM_ELEMENTS // block_c))  # a program's rows stay in registers
        _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            h, res, weight, out, rows, width, eps, h.stride(0), res.stride(0), out.stride(0),
            HAS_RES=residual is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=NUM_WARPS)
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (R, I) = silu(gate) * up in fp32, stored in out's dtype, of gate_up (R, 2I) = gate | up."""
    rows, width = out.shape
    if gate_up.shape != (rows, 2 * width) or gate_up.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"silu_mul of {tuple(gate_up.shape)} into {tuple(out.shape)}")
    if rows:
        grid = (triton.cdiv(rows, ROWS), triton.cdiv(width, ELEMENTS))
        _silu_mul_kernel[grid](gate_up, out, rows, width, gate_up.stride(0), out.stride(0), BLOCK_R=ROWS,
                               BLOCK=ELEMENTS, num_warps=NUM_WARPS)
    return out


def rope_write(qkv: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, scale: float, q_out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor, *, heads: int, kv_heads: int) -> None:
    """From the fused projection qkv (rows, (heads + 2 kv_heads) * D) (+ bias, fp32): rope
    over the whole head at each row's position (tables cos, sin (size, D/2) fp32, covering
    every position), then q's heads times `scale` into q_out (rows of heads * ... D, any row
    stride: the attention buffer), and the k heads and v heads of the first `len(slots)` rows
    into their pool slots (k_pool, v_pool: (pages, P, kv_heads, D), contiguous)."""
    rows = qkv.shape[0]
    d = k_pool.shape[-1]
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"rope_write needs a head_dim of twice a power of two, got {d}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous() and qkv.stride(1) == 1):
        raise ValueError("rope_write takes contiguous pools and projection rows")
    if cos.stride(1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope tables must share a row-major layout")
    if rows:
        _rope_write_kernel[(triton.cdiv(rows, ROWS),)](
            qkv, bias if bias is not None else qkv, positions, cos, sin, q_out, k_pool, v_pool, slots,
            rows, slots.shape[0], qkv.stride(0), q_out.stride(0), scale, cos.stride(0),
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d, HALF=d // 2, HAS_BIAS=bias is not None, BLOCK_R=ROWS,
            num_warps=NUM_WARPS)
