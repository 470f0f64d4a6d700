"""fused.py's kernels (the CUDA path's norm, SiLU product and rope with the K/V write): right
against torch's ops, and a row's bits independent of the other rows of the call.

On CUDA the compiled kernels; elsewhere Triton's interpreter on the CPU (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from prefixd.gpu import fused, kernels
from prefixd.gpu.rope import rotate, rotation_tables

pytestmark = pytest.mark.skipif(not kernels.triton_available() or not (torch.cuda.is_available() or kernels.INTERPRETING),
                                reason="needs Triton on CUDA, or interpreting (TRITON_INTERPRET=1)")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROW_COUNTS = (1, 2, 5, 16, 17, 40)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("width", [576, 64, 100])
def test_fused_rms_norm_adds_the_residual_and_normalizes_each_row_alone(width: int) -> None:
    h, res, w = _randn(40, width, seed=1), _randn(40, width, seed=2, dtype=torch.bfloat16), _randn(width, seed=3)
    summed = h + res.float()
    full_h = h.clone()
    full = fused.rms_norm(full_h, w, 1e-5, residual=res, out_dtype=torch.bfloat16)
    assert torch.equal(full_h, summed), "h += residual is one fp32 add"
    ref = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(full.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.allclose(fused.rms_norm(summed.clone(), w, 1e-5), ref, rtol=1e-5, atol=1e-5)
    for m in ROW_COUNTS:
        for lo in (0, 40 - m):
            part = h[lo:lo + m].clone()
            got = fused.rms_norm(part, w, 1e-5, residual=res[lo:lo + m], out_dtype=torch.bfloat16)
            assert torch.equal(got, full[lo:lo + m]), f"rows {lo}..{lo + m}"


def test_fused_silu_mul_is_each_rows_own() -> None:
    gate_up = _randn(40, 2 * 300, seed=4, dtype=torch.bfloat16)
    out = torch.empty(40, 300, dtype=torch.bfloat16, device=DEVICE)
    fused.silu_mul(gate_up, out)
    g, u = gate_up.float().chunk(2, dim=-1)
    assert torch.allclose(out.float(), torch.nn.functional.silu(g) * u, rtol=1e-2, atol=1e-2)
    for m in ROW_COUNTS:
        part = torch.empty(m, 300, dtype=torch.bfloat16, device=DEVICE)
        assert torch.equal(fused.silu_mul(gate_up[40 - m:], part), out[40 - m:]), f"last {m} rows"


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fused_rope_write_rotates_scales_and_writes_only_real_rows(bias: bool) -> None:
    heads, kv_heads, d, page = 4, 2, 16, 8
    rows, real = 21, 19  # two padding rows: their q is computed, their K/V never written
    width = (heads + 2 * kv_heads) * d
    qkv = _randn(rows, width, seed=5, dtype=torch.bfloat16)
    b = _randn(width, seed=6) if bias else None
    positions = torch.randint(0, 200, (rows,), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    angles = torch.arange(256, device=DEVICE).float()[:, None] / 10000 ** (torch.arange(0, d, 2, device=DEVICE) / d)
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(10 * page, generator=torch.Generator().manual_seed(8))[:real].to(DEVICE)

    def run(lo: int, hi: int, n_real: int):
        q = torch.zeros(hi - lo + 1, heads + kv_heads, d, dtype=torch.bfloat16, device=DEVICE)
        k = torch.full((10, page, kv_heads, d), 7.0, dtype=torch.bfloat16, device=DEVICE)
        v = torch.full_like(k, 7.0)
        fused.rope_write(qkv[lo:hi], b, positions[lo:hi], cos, sin, 0.25, q, k, v, slots[lo:lo + n_real],
                         heads=heads, kv_heads=kv_heads)
        return q, k, v

    q, k, v = run(0, rows, real)
    x = (qkv.float() + b if bias else qkv.float()).view(rows, -1, d)
    cos_full, sin_full = rotation_tables(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    rotated = rotate(x[:, :heads + kv_heads], cos_full, sin_full)
    assert torch.allclose(q[:rows, :heads].float(), rotated[:, :heads] * 0.25, rtol=1e-2, atol=1e-2)
    assert not q[:, heads:].any() and not q[rows].any(), "only q heads of the round's rows are written"
    flat_k, flat_v = k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    assert torch.allclose(flat_k[slots].float(), rotated[:real, heads:], rtol=1e-2, atol=1e-2)
    want_v = x[:real, heads + kv_heads:].to(torch.bfloat16)
    if bias and DEVICE.type == "cpu":  # Triton's interpreter rounds fp32 to bf16 its own way
        assert torch.allclose(flat_v[slots].float(), want_v.float(), rtol=2 ** -7, atol=0)
    else:  # v is q/k/v's own row (+ bias), rounded to the pool's dtype
        assert torch.equal(flat_v[slots], want_v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (flat_k[untouched] == 7).all() and (flat_v[untouched] == 7).all(), "a padding row wrote K/V"
    # a row's bits alone or among others
    for lo, hi in ((0, 1), (3, 4), (2, 19), (5, 21)):
        q2, k2, v2 = run(lo, hi, min(hi, real) - lo)
        assert torch.equal(q2[:hi - lo, :heads], q[lo:hi, :heads]), f"q of rows {lo}..{hi}"
        mine = slots[lo:min(hi, real)]
        assert torch.equal(k2.view(-1, kv_heads, d)[mine], flat_k[mine]), f"k of rows {lo}..{hi}"
        assert torch.equal(v2.view(-1, kv_heads, d)[mine], flat_v[mine]), f"v of rows {lo}..{hi}"
