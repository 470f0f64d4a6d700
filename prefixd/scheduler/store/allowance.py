"""Exact byte accounting of what the prefix store holds.

The store keeps one allocator reference per distinct page it uses (a page can be a tree node
and a snapshot's tail page at once); `refs` counts those uses. Its bytes are every such page
x kv_bytes_per_page plus the bytes of every snapshot (state, logits, carry).
"""

from __future__ import annotations

from typing import Iterable

from prefixd.scheduler.pages import PageAllocator


class Ledger:
    def __init__(self, allocator: PageAllocator, kv_bytes_per_page: int) -> None:
        self.allocator = allocator
        self.kv_bytes_per_page = kv_bytes_per_page
        self.refs: dict[int, int] = {}  # page -> uses by the store
        self.extra_bytes = 0  # snapshot bytes

    @property
    def bytes(self) -> int:
        return len(self.refs) * self.kv_bytes_per_page + self.extra_bytes

    @property
    def exclusive_bytes(self) -> int:
        """Bytes no lane shares now: what evicting everything would give back."""
        alone = sum(1 for p in self.refs if self.allocator.refcount(p) == 1)
        return alone * self.kv_bytes_per_page + self.extra_bytes

    def new_pages(self, pages: Iterable[int]) -> set[int]:
        """The pages among `pages` the store does not hold yet."""
        return {p for p in pages if p not in self.refs}

    def hold(self, page: int) -> None:
        n = self.refs.get(page, 0)
        if n == 0:
            self.allocator.incref([page])  # raises on a free page: a caller bug
        self.refs[page] = n + 1

    def release(self, page: int) -> list[int]:
        """Drop one use of `page`; returns the pages that went back to the allocator."""
        n = self.refs.get(page, 0)
        if n <= 0:
            raise RuntimeError(f"store releases page {page} it does not hold")
        if n > 1:
            self.refs[page] = n - 1
            return []
        del self.refs[page]
        return self.allocator.decref([page])

    def lane_held(self, page: int) -> bool:
        """True when someone besides the store (a lane) holds `page`."""
        return self.allocator.refcount(page) > 1
