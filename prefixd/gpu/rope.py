"""Rotary position embeddings from a precomputed fp32 table.

The table is computed once per process for every position up to its size, so a position's
cos/sin bits never depend on which other positions a round holds (row invariance).
Layout follows Hugging Face: the head's first half pairs with its second half.
"""

from __future__ import annotations

import math

import torch

from prefixd.gpu.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim // 2,) fp32 inverse frequencies, with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"unsupported rope scaling {scaling.kind!r}")
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old = scaling.original_max_position
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


INITIAL_POSITIONS = 32768  # grown on demand: long-context models need not pay up front


class RopeTable:
    """cos/sin for positions [0, size), grown by doubling when a round goes past it."""

    def __init__(self, config: ModelConfig, *, device: torch.device, size: int | None = None,
                 rotary_dim: int | None = None) -> None:
        self.rotary_dim = rotary_dim or config.head_dim
        self.inv_freq = inverse_frequencies(self.rotary_dim, config.rope_theta, config.rope_scaling)
        self.device = device
        self._build(max(16, size or min(config.max_context, INITIAL_POSITIONS)))

    def _build(self, size: int) -> None:
        pos = torch.arange(size, dtype=torch.int64).to(torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # (size, rotary_dim/2)
        self.cos = freqs.cos().to(self.device)
        self.sin = freqs.sin().to(self.device)
        self.size = size
        self._scaled: dict[tuple[int, int, float], tuple[torch.Tensor, torch.Tensor]] = {}  # q_scaled's, built again after growth

    def q_scaled(self, positions: torch.Tensor, heads: int, kv_heads: int, scale: float,
                 top: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`scale_q_tables` of `rotation_tables` of `lookup(positions, top)`, bit for bit, each
        (rows, heads + kv_heads, rotary_dim) fp32 and contiguous: the q heads' rows times
        `scale`, the kv heads' as they are. From tables kept for every covered position (2 x
        positions x 2 x rotary_dim floats a scale), in two ops a round where the per-round
        build takes a dozen: on the CPU a decode round's share of them was about 0.1 ms."""
        if top is None:
            top = int(positions.max()) if positions.numel() else -1
        both, heads_of = self._scaled_tables(heads, kv_heads, scale, top)
        rows = both[:, positions].index_select(2, heads_of)  # (2, rows, heads + kv_heads, width)
        return rows[0], rows[1]

    def scaled_table(self, heads: int, kv_heads: int, scale: float, top: int) -> torch.Tensor:
        """What `q_scaled` gathers from, covering position `top`: (2: cos | sin, positions, 2: q's
        scaled | kv's, width) fp32, contiguous; row r's table for head h is [:, position of r,
        0 if h < heads else 1] (csrc/layers.cpp's `layers_int4_rows` copies it so)."""
        return self._scaled_tables(heads, kv_heads, scale, top)[0]

    def _scaled_tables(self, heads: int, kv_heads: int, scale: float, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.cover(top)
        key = (heads, kv_heads, scale)
        if key not in self._scaled:
            cos, sin = rotation_tables(self.cos, self.sin)  # (size, 2 * half): the full width
            both = torch.stack([torch.stack([cos * scale, cos], 1), torch.stack([sin * scale, sin], 1)])
            self._scaled[key] = (both, torch.tensor([0] * heads + [1] * kv_heads, device=self.device))
        return self._scaled[key]  # (2: cos | sin, size, 2: scaled | not, width); head -> which

    def lookup(self, positions: torch.Tensor, top: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (rows, 1, rotary_dim/2) fp32, for a (rows,) position tensor.

        `top`: a bound on the positions that the caller knows (no read of the tensor, so no
        wait for the device); else their maximum is read. The table grows to cover it."""
        if top is None:
            top = int(positions.max()) if positions.numel() else -1
        self.cover(top)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def cover(self, top: int) -> None:
        """Grow the table (by doubling) until it holds position `top`."""
        top += 1
        if top > self.size:
            size = self.size
            while size < top:
                size *= 2
            self._build(size)


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos|cos, -sin|sin), each (rows, 1, 2 * half): the full-width tables `rotate` reads.

    Built once per round from `RopeTable.lookup` and shared by every layer.
    """
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, cos_full: torch.Tensor, sin_full: torch.Tensor) -> torch.Tensor:
    """`apply_rope` over the whole head (rotary_dim == head_dim) in four ops, with its bits.

    x * (cos|cos) + (x2|x1) * (-sin|sin): x2 * -sin is exactly -(x2 * sin) and a + (-b) is
    exactly a - b, so each half equals apply_rope's. x: (rows, heads, head_dim) fp32, any
    row and head strides (a column slice of the fused qkv).
    """
    half = x.shape[-1] // 2
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # (rows, heads, head_dim): x2 | x1
    return x * cos_full + swapped * sin_full


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate fp32 x (rows, heads, head_dim) on its first rotary_dim features."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:
        parts.append(x[..., 2 * half :])
    return torch.cat(parts, dim=-1)
