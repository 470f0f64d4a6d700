"""A bounded record of the prompts the store kept rows of, per namespace, to tell an evicted
prefix from one never kept (cache diagnostics only; nothing served depends on it).

Each record is a chain of page digests, `h[i] = hash((h[i-1], ids and images of page i))`, and
the rows kept: two keys share `s` full pages when their first `s` digests agree. A digest is
8 bytes a page, so a namespace's record costs at most MAX_PROMPTS x (prompt / P) x 8 bytes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from prefixd.scheduler.store.identity import ReuseKey, images_over

MAX_PROMPTS = 4  # prompts remembered a namespace
MAX_NAMESPACES = 64  # namespaces remembered, least recently kept dropped first


@dataclass(eq=False)
class _Kept:
    num_tokens: int
    first: int  # digest of page 0 (with num_tokens, tells a reused id(key) from its key)
    digests: array = field(default_factory=lambda: array("q"))
    rows: int = 0  # rows of the key the store kept (the deepest kept cut)


class RecentPrompts:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._by_ns: OrderedDict[str, OrderedDict[int, _Kept]] = OrderedDict()
        self._probed: OrderedDict[int, _Kept] = OrderedDict()  # chains shared_kept computed, for kept

    def kept(self, key: ReuseKey, rows: int) -> None:
        """The store keeps rows [0, rows) of `key`."""
        prompts = self._by_ns.setdefault(key.namespace, OrderedDict())
        self._by_ns.move_to_end(key.namespace)
        while len(self._by_ns) > MAX_NAMESPACES:
            self._by_ns.popitem(last=False)
        rec = prompts.get(id(key))
        if not self._same(rec, key):
            rec = self._probed.pop(id(key), None)
            rec = rec if self._same(rec, key) else _Kept(len(key.tokens), self._first(key))
            prompts[id(key)] = rec
        prompts.move_to_end(id(key))
        while len(prompts) > MAX_PROMPTS:
            prompts.popitem(last=False)
        self._extend(key, rec.digests, rows // self.page_size)
        rec.rows = max(rec.rows, rows)

    def shared_kept(self, key: ReuseKey) -> int:
        """The most rows of `key` (whole pages) some other recorded prompt shared and had kept."""
        prompts = self._by_ns.get(key.namespace)
        if not prompts:
            return 0
        mine = _Kept(len(key.tokens), self._first(key))
        self._probed[id(key)] = mine
        while len(self._probed) > MAX_PROMPTS:
            self._probed.popitem(last=False)
        best = 0
        for kid, rec in prompts.items():
            if kid == id(key) and rec.num_tokens == len(key.tokens):
                continue
            need = min(len(rec.digests), rec.rows // self.page_size, len(key.tokens) // self.page_size)
            self._extend(key, mine.digests, need)
            s = 0
            while s < need and mine.digests[s] == rec.digests[s]:
                s += 1
            best = max(best, s * self.page_size)
        return best

    def _same(self, rec: _Kept | None, key: ReuseKey) -> bool:
        """True when `rec`, found under id(key), is key's (not a dead key's whose id was reused)."""
        return rec is not None and rec.num_tokens == len(key.tokens) and rec.first == self._first(key)

    def _first(self, key: ReuseKey) -> int:
        return self._digest(0, key, 0) if len(key.tokens) >= self.page_size else 0

    def _extend(self, key: ReuseKey, digests: array, num_pages: int) -> None:
        P = self.page_size
        prev = digests[-1] if digests else 0
        for i in range(len(digests), min(num_pages, len(key.tokens) // P)):
            prev = self._digest(prev, key, i)
            digests.append(prev)

    def _digest(self, prev: int, key: ReuseKey, i: int) -> int:
        P = self.page_size
        ids = key.tokens[i * P:(i + 1) * P]
        return hash((prev, ids, images_over(key.images, i * P, (i + 1) * P))) if key.images else hash((prev, ids))
