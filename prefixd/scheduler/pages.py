"""Refcounted page ids.

Lanes and the prefix store hold pages through this allocator; the device only owns the
KV pool tensors the ids index. A page returns to the free list when its last holder lets go.
"""

from __future__ import annotations

from typing import Iterable


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2...
        self._refs: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take n fresh pages with refcount 1, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"decref of free page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a page is on the free list twice")
        for p, r in enumerate(self._refs):
            if (r == 0) != (p in free):
                raise RuntimeError(f"page {p}: refcount {r} but free={p in free}")
