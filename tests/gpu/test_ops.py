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
