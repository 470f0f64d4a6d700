"""The paged KV pool: K and V rows of every attention layer, indexed by page id.

Layout (one tensor per layer and kind, compute dtype)::

    k[layer]: (num_pages, page_size, num_kv_heads, head_dim)
              page p, offset o  <->  the row of a lane whose page_table[pos // P] == p,
                                     pos % P == o

A pool made with `codes8=True` (mode int4, whose CPU attention reads the pages in place, where
head_dim is a multiple of 32: `kv_pages`) holds 8-bit pages: each row's K and V as 8-bit codes
with one fp32 scale per kv head and block of 32 dims (`quantize_blocks`). A page is its codes,
P * kv_heads * D bytes (K as unsigned code + 128 in quads of dims, byte ((g * D/4 + d/4) * P +
o) * 4 + d % 4 for kv head g, dim d, offset o; V in rows (P, kv_heads, D)), then its scales
(kv_heads, D/32, P): storage uint8 (2, layers, pages, P, kv_heads, D + D/8), a byte count per
page, not its order. A row's codes and scales are its own: no neighbour, chunking or lane
changes them.

A pool made with `key_pages=True` (mode int4 at other head widths) holds bf16 K pages in the
order of `to_key_pages`, the layout the CPU attention reads bf16 pools in.

Every kind is one tensor with pages on dim 2, so page copies, captures and the disk tier move a
page as bytes whatever it holds.

Page ids come from the scheduler's PageAllocator; the pool never decides who owns a page.
All storage lives in one tensor so a copy engine can move a page of every layer in one go.
"""

from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch


def _zeroed_storage(shape: tuple[int, ...], device: torch.device,
                    dtype: torch.dtype) -> tuple[mmap.mmap | None, torch.Tensor]:
    """A zero tensor; on CPU backed by an anonymous mapping, so untouched pages cost no RAM."""
    if device.type != "cpu":
        return None, torch.zeros(shape, device=device, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, max(nbytes, 1))  # anonymous mappings read as zeros until written
    return mapping, torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape)).view(shape)


QBLOCK = 32  # dims sharing a scale in 8-bit pages
QUANT_TINY = 2.0 ** -60  # a block whose largest magnitude is below: zero codes, scale 0


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as int8 codes (..., D) and fp32 scales (..., D/32), the bits of
    csrc/attention.cpp's `quantize_block`: per block of 32 values (read as fp32), a = max |x|;
    a not finite: codes 0, scale NaN; a < 2^-60: codes 0, scale 0; else codes
    round-half-even(x * (127 / a)) and scale a / 127, each op rounded in fp32."""
    xf = x.float().unflatten(-1, (-1, QBLOCK))
    a = xf.abs().amax(-1, keepdim=True)  # NaN when some value is
    bad = ~torch.isfinite(a)
    zero = bad | (a < QUANT_TINY)
    c127 = torch.full_like(a, 127.0)  # tensor by tensor: a true division (a scalar's may be a reciprocal's product)
    safe = torch.where(zero, torch.ones_like(a), a)
    inv = torch.where(zero, torch.zeros_like(a), torch.div(c127, safe))
    codes = torch.round(torch.where(zero, torch.zeros_like(xf), xf) * inv).clamp_(-127, 127)
    scale = torch.where(bad, torch.full_like(a, float("nan")), torch.where(zero, torch.zeros_like(a), torch.div(safe, c127)))
    return codes.to(torch.int8).flatten(-2), scale.squeeze(-1)


def kv_pages(mode: str, head_dim: int) -> dict[str, bool]:
    """The pool kind a mode keeps: mode int4 (the CPU attention reads its pages in place) 8-bit
    pages where head_dim is a multiple of 32, else bf16 K pages in `to_key_pages` order; other
    modes rows in the compute dtype. `KVPool`'s keyword arguments."""
    if mode != "int4":
        return {}
    return {"codes8": True} if head_dim % QBLOCK == 0 else {"key_pages": True}


def from_key_quads(u: torch.Tensor, p: int, kv: int, d: int) -> torch.Tensor:
    """An 8-bit page's K code bytes (pages, P * kv_heads * D) uint8 (quads of dims, code + 128)
    as codes (pages, P, kv_heads, D) int8."""
    pages = u.shape[0]
    codes = (u.to(torch.int16) - 128).to(torch.int8)
    return codes.view(pages, kv, d // 4, p, 4).permute(0, 3, 1, 2, 4).reshape(pages, p, kv, d)


def to_key_pages(k: torch.Tensor) -> torch.Tensor:
    """K rows (pages, P, kv_heads, D) in the order mode int4's attention reads K pages (the same
    shape; csrc/attention.cpp): in a page, each kv head's dims 2i, 2i + 1 of its P keys side by side."""
    pages, p, kv, d = k.shape
    return k.view(pages, p, kv, d // 2, 2).permute(0, 2, 3, 1, 4).contiguous().view(pages, p, kv, d)


def from_key_pages(k: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_key_pages`: K pages back to rows (pages, P, kv_heads, D)."""
    pages, p, kv, d = k.shape
    return k.view(pages, kv, d // 2, p, 2).permute(0, 3, 1, 2, 4).contiguous().view(pages, p, kv, d)


class KVPool:
    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, dtype: torch.dtype, key_pages: bool = False,
                 codes8: bool = False) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages {num_pages} and page_size {page_size} must be positive")
        if codes8 and (key_pages or head_dim % QBLOCK):
            raise ValueError(f"8-bit pages need a head_dim that is a multiple of {QBLOCK} (got {head_dim})"
                             if head_dim % QBLOCK else "a pool holds 8-bit pages or bf16 key pages, not both")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.key_pages = key_pages  # bf16 K pages in `to_key_pages` order
        self.codes8 = codes8  # 8-bit pages (written by mode int4's kernels)
        self.dtype = torch.uint8 if codes8 else dtype  # the storage's
        # Zeros, not empty: masked-out rows are multiplied by exactly 0 and must be finite.
        width = head_dim + head_dim // 8 if codes8 else head_dim
        shape = (2, num_layers, num_pages, page_size, num_kv_heads, width)
        self._mapping, self.storage = _zeroed_storage(shape, torch.device(device), self.dtype)
        self.k = [self.storage[0, i] for i in range(num_layers)]
        self.v = [self.storage[1, i] for i in range(num_layers)]

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page holds over all layers, K and V."""
        return self.storage[:, :, 0].numel() * self.storage.element_size()

    def _codes_and_scales(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An 8-bit pool's pages (pages, ...) as codes bytes (pages, P * kv_heads * D) uint8 and
        scales (pages, kv_heads, D/32, P) fp32: views of the pool."""
        flat = pool.view(pool.shape[0], -1)
        split = self.page_size * self.num_kv_heads * self.head_dim
        scales = flat[:, split:].view(torch.float32)
        return flat[:, :split], scales.view(-1, self.num_kv_heads, self.head_dim // QBLOCK, self.page_size)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def pools(self) -> list[torch.Tensor]:
        """Every per-layer tensor, each (num_pages, ...): what a page copy must move."""
        return self.k + self.v

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v (n, num_kv_heads, head_dim) at flat slots page * P + offset."""
        flat = (self.num_pages * self.page_size, self.num_kv_heads, self.head_dim)
        if self.codes8:
            self._write_codes8(layer, slots, k, v)
            return
        if self.key_pages:  # row o of page p: [p, :, :, o, :] of the pages' (kv_heads, D/2, P, 2) view
            pairs = self.k[layer].view(self.num_pages, self.num_kv_heads, self.head_dim // 2, self.page_size, 2)
            pairs[slots // self.page_size, :, :, slots % self.page_size] = k.to(self.dtype).unflatten(-1, (-1, 2))
        else:
            self.k[layer].view(flat).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.dtype))

    def _write_codes8(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows k, v (n, kv_heads, D) as 8-bit codes and scales at their slots (K from k's values
        as given, V from v's read as fp32: what csrc/attention.cpp's rope_kv writes)."""
        pages, offsets = slots // self.page_size, slots % self.page_size
        p, kv, d = self.page_size, self.num_kv_heads, self.head_dim
        for pool, rows, is_key in ((self.k[layer], k, True), (self.v[layer], v, False)):
            codes, scales = quantize_blocks(rows)  # (n, kv, D), (n, kv, D/32)
            code_bytes, scale_view = self._codes_and_scales(pool)
            scale_view[pages, :, :, offsets] = scales
            if is_key:  # byte (kv head g, quad i, offset o, j): ((g * D/4 + i) * P + o) * 4 + j
                quads = code_bytes.view(-1, kv, d // 4, p, 4)
                quads[pages, :, :, offsets] = (codes.to(torch.int16) + 128).to(torch.uint8).view(-1, kv, d // 4, 4)
            else:
                code_bytes.view(-1, p, kv, d)[pages, offsets] = codes.view(torch.uint8)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """pool[dst[i]] = pool[src[i]] for every layer and kind; returns bytes copied."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} sources for {len(dst)} destinations")
        if not src:
            return 0
        device = self.storage.device
        s = torch.tensor(list(src), dtype=torch.long, device=device)
        d = torch.tensor(list(dst), dtype=torch.long, device=device)
        self.storage.index_copy_(2, d, self.storage.index_select(2, s))
        return len(src) * self.bytes_per_page

    def rows(self, layer: int, page_table: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n rows (n, num_kv_heads, head_dim) of K and V through a page table."""
        pages = -(-n // self.page_size)
        if pages > len(page_table):
            raise ValueError(f"page table of {len(page_table)} pages cannot hold {n} rows")
        idx = torch.tensor(list(page_table[:pages]), dtype=torch.long, device=self.storage.device)
        if self.codes8:  # dequantized: code * scale in fp32
            out = []
            for pool, is_key in ((self.k[layer], True), (self.v[layer], False)):
                code_bytes, scales = self._codes_and_scales(pool.index_select(0, idx))
                p, kv, d = self.page_size, self.num_kv_heads, self.head_dim
                codes = from_key_quads(code_bytes, p, kv, d) if is_key else code_bytes.view(torch.int8).view(-1, p, kv, d)
                scale = scales.permute(0, 3, 1, 2).repeat_interleave(QBLOCK, dim=-1)  # (pages, P, kv, D)
                out.append((codes.float() * scale).reshape(-1, kv, d)[:n])
            return out[0], out[1]
        k = self.k[layer].index_select(0, idx)
        k = (from_key_pages(k) if self.key_pages else k).reshape(-1, self.num_kv_heads, self.head_dim)[:n]
        v = self.v[layer].index_select(0, idx).reshape(-1, self.num_kv_heads, self.head_dim)[:n]
        return k, v
