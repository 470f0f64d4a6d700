"""The hybrid family's own norms: zero-centred RMSNorm and the GDN output's gated RMSNorm.

Its products (`linear.project`) and rotary embedding (`rope.RopeTable`, `rope.apply_rope`) are
the runtime's shared ones."""

from __future__ import annotations

import torch

from prefixd.gpu import fused, kernels
from prefixd.gpu.families.gdn import silu


def rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: computed in float32, scaled by (1 + w), cast back to x's dtype
    (on the CUDA path one kernel, fused.rms_norm)."""
    if kernels.triton_path(x.device) and x.numel():
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return fused.rms_norm(rows, weight_plus_one, eps, out_dtype=x.dtype).view(x.shape)
    xf = x.float()
    out = xf * torch.rsqrt(kernels.mean_last(xf.pow(2)) + eps)
    return (out * weight_plus_one).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm(x) * w * silu(gate) over the last dim (the GDN output norm), result in dtype."""
    xf = x.to(dtype).float()
    normed = (xf * torch.rsqrt(kernels.mean_last(xf.pow(2)) + eps)).to(dtype)
    return ((weight * normed).float() * silu(gate)).to(dtype)
