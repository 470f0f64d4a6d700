"""The paged KV pool: K and V rows of every attention layer, indexed by page id.

Layout (one tensor per layer and kind, compute dtype)::

    k[layer]: (num_pages, page_size, num_kv_heads, head_dim)
              page p, offset o  <->  the row of a lane whose page_table[pos // P] == p,
                                     pos % P == o

A pool made with `key_pages=True` (mode int4, whose CPU attention reads K in place) holds each
K page in the order of `to_key_pages` instead: the same shape and bytes per page, so page copies,
captures and the disk tier move it as they move any page.

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
                 head_dim: int, device: torch.device, dtype: torch.dtype, key_pages: bool = False) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages {num_pages} and page_size {page_size} must be positive")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.key_pages = key_pages  # K pages in `to_key_pages` order (written by mode int4's kernels)
        # Zeros, not empty: masked-out rows are multiplied by exactly 0 and must be finite.
        shape = (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self._mapping, self.storage = _zeroed_storage(shape, torch.device(device), dtype)
        self.k = [self.storage[0, i] for i in range(num_layers)]
        self.v = [self.storage[1, i] for i in range(num_layers)]

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page holds over all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def pools(self) -> list[torch.Tensor]:
        """Every per-layer tensor, each (num_pages, ...): what a page copy must move."""
        return self.k + self.v

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows k, v (n, num_kv_heads, head_dim) at flat slots page * P + offset."""
        flat = (self.num_pages * self.page_size, self.num_kv_heads, self.head_dim)
        if self.key_pages:  # row o of page p: [p, :, :, o, :] of the pages' (kv_heads, D/2, P, 2) view
            pairs = self.k[layer].view(self.num_pages, self.num_kv_heads, self.head_dim // 2, self.page_size, 2)
            pairs[slots // self.page_size, :, :, slots % self.page_size] = k.to(self.dtype).unflatten(-1, (-1, 2))
        else:
            self.k[layer].view(flat).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(flat).index_copy_(0, slots, v.to(self.dtype))

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
        k = self.k[layer].index_select(0, idx)
        k = (from_key_pages(k) if self.key_pages else k).reshape(-1, self.num_kv_heads, self.head_dim)[:n]
        v = self.v[layer].index_select(0, idx).reshape(-1, self.num_kv_heads, self.head_dim)[:n]
        return k, v
