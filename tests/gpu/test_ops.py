"""The fewer-op forms the forward uses give the bits of the plain forms they replace."""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import kernels
from prefixd.gpu.model import rms_norm
from prefixd.gpu.rope import apply_rope, rotate, rotation_tables


def _composite_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(kernels.mean_last(x.pow(2)) + eps) * weight


@pytest.mark.parametrize("width", [16, 64, 576, 960, 1536, 4096])
def test_cpu_rms_norm_equals_the_composite(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(37, width, generator=g) * torch.rand(37, 1, generator=g) * 10
    w = torch.randn(width, generator=g)
    assert torch.equal(rms_norm(x, w, 1e-6), _composite_rms_norm(x, w, 1e-6))
    heads = torch.randn(5, 9, width, generator=g)[:, ::2]  # per-head norms read strided heads
    assert torch.equal(rms_norm(heads, w, 1e-5), _composite_rms_norm(heads, w, 1e-5))


def test_rotate_equals_apply_rope_on_strided_heads_and_signed_zeros():
    g = torch.Generator().manual_seed(0)
    rows, heads, head_dim = 33, 12, 64
    qkv = torch.randn(rows, (heads + 4) * head_dim, generator=g) * 50
    qkv[3, :head_dim] = 0.0
    qkv[4, :head_dim] = -0.0
    x = qkv[:, : heads * head_dim].unflatten(-1, (heads, head_dim))  # a column slice, as the model's
    angles = torch.rand(rows, 1, head_dim // 2, generator=g) * 1000
    cos, sin = angles.cos(), angles.sin()
    sin[0] = 0.0
    got = rotate(x, *rotation_tables(cos, sin))
    want = apply_rope(x, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (48, torch.bfloat16), (64, torch.float32)])
def test_rope_into_the_pool_dtype_gives_the_bits_of_rotating_and_scaling_in_fp32(head_dim, dtype):
    # head_dim 64: the scale 1/8 is folded into q's tables; 48: it is not a power of two
    from prefixd.gpu.model import rope_qk_into, scale_q_tables

    g = torch.Generator().manual_seed(head_dim)
    rows, heads, kv_heads = 9, 6, 2
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g) * 30).to(dtype)
    qkv[2, :head_dim] = -0.0
    qk = qkv[:, : (heads + kv_heads) * head_dim].unflatten(-1, (heads + kv_heads, head_dim))
    angles = torch.rand(rows, 1, head_dim // 2, generator=g) * 1000
    tables = rotation_tables(angles.cos(), angles.sin())
    scale = 1.0 / head_dim ** 0.5
    rotated = rotate(qk.float(), *tables)
    want = torch.cat([rotated[:, :heads] * scale, rotated[:, heads:]], dim=1).to(dtype)
    scaled = tuple(scale_q_tables(t, heads, kv_heads, scale) for t in tables) if head_dim == 64 else None
    got = torch.empty(rows, heads + kv_heads, head_dim, dtype=dtype)
    rope_qk_into(qk, got, heads, scale, tables, scaled)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_bf16_attention_pads_no_query_rows_and_keeps_the_padded_tiles_bits():
    from prefixd.gpu.attention import AttentionSpan, attend, plan_attention

    g = torch.Generator().manual_seed(3)
    page, kv_heads, heads, d = 16, 2, 6, 32
    pool = torch.randn(2, 40, page, kv_heads, d, generator=g).to(torch.bfloat16)
    spans = [AttentionSpan(0, 300, 1, tuple(range(0, 20))), AttentionSpan(1, 40, 1, tuple(range(20, 23)))]
    q = torch.randn(2, heads, d, generator=g) * 0.2

    def run(plan_dtype):
        tiles = plan_attention(spans, total_rows=2, group=heads // kv_heads, page_size=page,
                               device=torch.device("cpu"), dtype=plan_dtype)
        return tiles, attend(q, pool[0], pool[1], tiles)

    tiles, got = run(torch.bfloat16)
    padded_tiles, want = run(torch.float32)  # fp32 pads each lane to 16 / group query rows
    assert tiles[0].rows == 1 and padded_tiles[0].rows > 1  # two decode lanes, one row each
    assert torch.equal(got, want)
