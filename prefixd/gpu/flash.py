"""Paged flash attention on CUDA, one Triton kernel for prefill, decode and verify rows.

It reads the same plan as attention.py's blocked attention (an `AttentionTile`: each lane's
query rows, their positions, the lane's page table and its end) and writes the same output
rows, but in one launch per tile and without materializing scores:

    program (lane, row block, kv head): BLOCK_M query vectors, the (row, q head) pairs of up
    to BLOCK_M // group consecutive rows of one lane and the q heads of one kv head

    for key block j = 0, 1, ... while j * BLOCK_N < the lane's end (keys at absolute positions
    [j * BLOCK_N, (j + 1) * BLOCK_N), gathered through the page table):
        s     = q . k                      (BLOCK_M, BLOCK_N), fp32 accumulation
        s     = -inf where the key is past the row's position or the lane's end
        m'    = max(m, max_j s);  a = exp(m - m');  p = exp(s - m')
        l     = l a + sum_j p;    acc = acc a + p @ v   (p in the pool's dtype, as attention.py)
        (a row with no live key in block j keeps m, l and acc as they were)
    out = acc / l

Why a row's bits never depend on the call (row-invariant by construction):
- One fixed configuration (BLOCK_M, BLOCK_N, warps) per model, from its head shape alone: no
  choice by row count, lane count or context, and no split of a row's keys across programs.
- Each row runs the same sequence of operations over key blocks 0, 1, 2, ... in order. A
  block past the row's position is skipped for that row by the select above, not added as
  zeros, so a longer lane in the same program (more blocks) cannot touch the row's m, l or acc.
- The products and the row sums act on each of the BLOCK_M rows alike and never combine two
  rows; padding rows read q as zeros and are never stored.
- Keys at or past the lane's end are not loaded (a reused page's stale rows, NaN included,
  are read as zeros and their scores are -inf), so p @ v never meets a non-finite stale value.
So a row prefilled in one chunk or in pieces, decoded alone or beside other lanes, in any
program bucket, gets the same bits; tests/gpu/test_flash.py checks it on the device it has.

The bits differ from attention.py's blocked form (an online max instead of one max over all
blocks): a device uses one of the two for every round, so resumed, concurrent and drafted
rows still equal cold ones. `kernels.triton_path(device)` says which: CUDA with Triton.

Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run this kernel) computes a bf16
`tl.dot` wrongly in Triton 3.9, so when interpreting, the products take fp32 operands in full
fp32 precision; on a GPU bf16 operands go to the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import torch

from prefixd.gpu import kernels

if kernels.triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover - depends on the install
    triton = None

MAX_BLOCK_N = 64  # keys a program reads per step, at most
TILE_ELEMENTS = 4096  # a step's K (and V) tile, BLOCK_N x BLOCK_D, at most
MIN_BLOCK_M = 32  # query vectors per program: (row, q head) pairs; a power of two >= the group
INTERPRETING = kernels.INTERPRETING


def block_m(group: int) -> int:
    """The program's query vectors for a model whose kv heads serve `group` q heads each."""
    return max(MIN_BLOCK_M, 1 << (group - 1).bit_length())


def block_n(head_dim: int) -> int:
    """Keys a program reads per step for heads `head_dim` wide: 64 up to 64-wide heads, 32 at
    128, 16 at 256. A step's K and V tiles are gathered through the page table, so each
    element has its own address in registers: at 64 keys and 4 warps, 128-wide heads took 222
    registers a thread on sm_90 and 256-wide ones (the hybrid family's attention) ran out of
    them and spilled, with 86 KB of shared memory a program; with these, 156 and 154 registers,
    27 and 34 KB, no spill (ptxas; tests/gpu/test_kernels_compile.py holds every launch to no
    spill)."""
    return max(16, min(MAX_BLOCK_N, TILE_ELEMENTS // kernels.block_width(head_dim)))


def num_warps(head_dim: int) -> int:
    """Warps a program runs: 4 up to 64-wide heads, else 8 (the accumulator and the tiles
    spread over twice the threads)."""
    return 4 if kernels.block_width(head_dim) <= 64 else 8


if triton is not None:

    # rows and pages_per_lane change from round to round: one compiled kernel for every value
    # (Triton would otherwise build another for a value of 1 or a multiple of 16)
    @triton.jit(do_not_specialize=["rows", "pages_per_lane"])
    def _flash_kernel(q_ptr, k_ptr, v_ptr, out_ptr, q_index_ptr, out_index_ptr, qpos_ptr, page_index_ptr,
                      end_ptr, rows, pages_per_lane, q_stride, out_stride, page_size, kv_heads,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr):
        lane = tl.program_id(0)
        row_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        rows_per_program: tl.constexpr = BLOCK_M // GROUP
        m = tl.arange(0, BLOCK_M)
        r = row_block * rows_per_program + m // GROUP  # the lane's row in the tile
        head = kv_head * GROUP + m % GROUP
        row_ok = (m < rows_per_program * GROUP) & (r < rows)
        at = lane * rows + r
        q_row = tl.load(q_index_ptr + at, mask=row_ok, other=0).to(tl.int64)
        pos = tl.load(qpos_ptr + at, mask=row_ok, other=-1)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (q_row * q_stride + head)[:, None] * HEAD_DIM + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        end = tl.load(end_ptr + lane)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for start in tl.range(0, end, BLOCK_N):
            kp = start + tl.arange(0, BLOCK_N)
            k_ok = kp < end
            page = tl.load(page_index_ptr + lane * pages_per_lane + kp // page_size, mask=k_ok, other=0)
            slot = page.to(tl.int64) * page_size + kp % page_size
            kv_at = (slot * kv_heads + kv_head)[:, None] * HEAD_DIM + d[None, :]
            kv_ok = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_at, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kv_at, mask=kv_ok, other=0.0)
            if F32_DOT:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            live = (kp[None, :] <= pos[:, None]) & k_ok[None, :]
            s = tl.where(live, s, float("-inf"))
            any_live = tl.max(live.to(tl.int32), axis=1) > 0
            m_new = tl.where(any_live, tl.maximum(m_i, tl.max(s, axis=1)), 0.0)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # 0 where not live
            if F32_DOT:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = tl.where(any_live[:, None], acc * alpha[:, None] + pv, acc)
            l_i = tl.where(any_live, l_i * alpha + tl.sum(p, axis=1), l_i)
            m_i = tl.where(any_live, m_new, m_i)
        out_row = tl.load(out_index_ptr + at, mask=row_ok, other=0).to(tl.int64)
        tl.store(out_ptr + out_row[:, None] * out_stride + head[:, None] * HEAD_DIM + d[None, :],
                 acc / tl.where(l_i > 0, l_i, 1.0)[:, None], mask=row_ok[:, None] & d_ok[None, :])


def attend_tile(q_ext: torch.Tensor, q_stride: int, k_pool: torch.Tensor, v_pool: torch.Tensor, tile,
                out: torch.Tensor) -> None:
    """attention.attend_tile's contract, by the kernel: the tile's rows of out (R + 1, heads * D)
    fp32 from q_ext ((R + 1) * q_stride, D), pre-scaled, in the pool's dtype. The tile's
    `qpos` holds each of its rows' positions (padding rows: any)."""
    if tile.qpos is None:
        raise ValueError("a flash tile needs its rows' positions (AttentionTile.qpos)")
    _, page_size, kv_heads, d = k_pool.shape
    heads = out.shape[1] // d
    group = heads // kv_heads
    bm = block_m(group)
    rows_per_program = bm // group
    pages_per_lane = tile.page_index.shape[0] // tile.num_lanes
    grid = (tile.num_lanes, -(-tile.rows // rows_per_program), kv_heads)
    _flash_kernel[grid](q_ext, k_pool, v_pool, out, tile.q_index, tile.out_index, tile.qpos, tile.page_index,
                        tile.dead_from, tile.rows, pages_per_lane, q_stride, out.stride(0), page_size, kv_heads,
                        GROUP=group, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=block_n(d),
                        BLOCK_D=kernels.block_width(d),
                        F32_DOT=INTERPRETING or k_pool.dtype == torch.float32, num_warps=num_warps(d))
