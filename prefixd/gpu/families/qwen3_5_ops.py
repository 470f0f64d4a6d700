"""Row-invariant building blocks of the hybrid family: padded linear, norms, partial rotary."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixd.gpu import kernels
from prefixd.gpu.families.gdn import silu

MIN_ROWS = 16  # fp32 GEMM picks other kernels (other bits) for small M: pad up to this


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) with M padded to MIN_ROWS, so a row's bits never depend on M."""
    rows = x.shape[0]
    x = kernels.pad_rows(x, MIN_ROWS)
    if x.is_cuda or kernels.fixed_row_calls(x):
        # kernels.py: one fixed kernel for every M (CUDA; calls of fixed rows on an AMX CPU),
        # the bias added outside it
        out = kernels.mm_t(x, weight, x.dtype)
        return (out if bias is None else out + bias)[:rows]
    return kernels.one_thread(F.linear, x, weight, bias)[:rows]


def rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: computed in float32, scaled by (1 + w), cast back to x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(kernels.mean_last(xf.pow(2)) + eps)
    return (out * weight_plus_one).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm(x) * w * silu(gate) over the last dim (the GDN output norm), result in dtype."""
    xf = x.to(dtype).float()
    normed = (xf * torch.rsqrt(kernels.mean_last(xf.pow(2)) + eps)).to(dtype)
    return ((weight * normed).float() * silu(gate)).to(dtype)


class PartialRope:
    """Rotary embedding on the first `rotary_dim` dims of each head (rotate-half layout).

    cos/sin come from a table filled in blocks of _ROPE_BLOCK positions, each block always
    computed with the same shape, so a position's angles never depend on the batch.
    """

    _ROPE_BLOCK = 1024

    def __init__(self, rotary_dim: int, theta: float, device: torch.device) -> None:
        self.rotary_dim = rotary_dim
        self.device = device
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
        self.inv_freq = 1.0 / (theta ** (steps / rotary_dim))
        self._cos = torch.empty(0, rotary_dim, device=device)
        self._sin = torch.empty(0, rotary_dim, device=device)

    def _table(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        while self._cos.shape[0] < end:
            lo = self._cos.shape[0]
            pos = torch.arange(lo, lo + self._ROPE_BLOCK, dtype=torch.float32, device=self.device)
            freqs = pos[:, None] * self.inv_freq  # (block, rot/2)
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos = torch.cat([self._cos, emb.cos()])
            self._sin = torch.cat([self._sin, emb.sin()])
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, 1, rotary_dim) in dtype for integer `positions` (T,)."""
        cos, sin = self._table(int(positions.max()) + 1)
        return cos[positions].to(dtype)[:, None, :], sin[positions].to(dtype)[:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, head_dim)."""
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
