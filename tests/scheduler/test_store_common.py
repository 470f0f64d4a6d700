"""Shared rig for the prefix store tests: an allocator, a store and a lane simulator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.chunks import Schedule, plan_schedule
from prefixd.scheduler.records import ImageIdentity
from prefixd.scheduler.store import Hit, PrefixStore, ReuseKey, Snapshot

P = 4  # page size
G = 4  # grid
KVPP = 100  # kv bytes per page
LOGITS = 40  # bytes of a logits row


@dataclass(frozen=True)
class Blob:
    """A stand-in device tensor: only its size matters to the store."""

    nbytes: int


def image(at: int, tokens: int, tag: bytes) -> ImageIdentity:
    return ImageIdentity(at=at, tokens=tokens, gh=1, gw=tokens, hash=tag)


@dataclass
class Served:
    hit: Hit | None
    results: list[tuple[int, str]]
    pages: list[int]
    schedule: Schedule


@dataclass
class Rig:
    num_pages: int = 64
    budget: int = 10**9
    invariant: bool = False
    grid: int = G
    state_bytes: int = 0
    t: float = 0.0
    alloc: PageAllocator = field(init=False)
    store: PrefixStore = field(init=False)

    def __post_init__(self) -> None:
        self.alloc = PageAllocator(self.num_pages)
        self.store = PrefixStore(self.alloc, page_size=P, kv_bytes_per_page=KVPP,
                                 budget_bytes=self.budget, invariant_rows=self.invariant,
                                 clock=self.tick)

    def tick(self) -> float:
        self.t += 1.0
        return self.t

    def snapshot(self, cut: int, n: int) -> Snapshot:
        state = Blob(self.state_bytes) if self.state_bytes else None
        return Snapshot(state=state, logits=Blob(LOGITS) if cut == n else None)

    def serve(self, key: ReuseKey, starts: Sequence[int] = (), *, keep: bool = False,
              publish: bool = True, cuts: Sequence[int] | None = None) -> Served:
        """Run a request as a lane would: look up, share the hit's pages (copying a partial
        last page), prefill the rest chunk by chunk, publish at each cut, let go of pages."""
        n = len(key.tokens)
        sched = plan_schedule(n, starts, self.grid)
        hit = self.store.lookup(key, sched)
        pages: list[int] = []
        rows = 0
        if hit is not None:
            self.store.pin(hit)
            self.alloc.incref(hit.pages)
            pages, rows = list(hit.pages), hit.rows
            if rows % P:  # copy-on-write of the shared partial page
                fresh = self.alloc.allocate(1)
                assert fresh is not None
                self.alloc.decref([pages[-1]])
                pages[-1] = fresh[0]
        results: list[tuple[int, str]] = []
        want = set(sched.cuts if cuts is None else cuts)
        for _, end in sched.chunks(rows):
            more = self.alloc.allocate(-(-end // P) - len(pages))
            assert more is not None, "rig ran out of pages"
            pages += more
            if publish and end in want:
                res = self.store.publish(key, sched, end, pages, self.snapshot(end, n),
                                         prefilled_upto=end, restored=hit)
                results.append((end, res))
        if hit is not None:
            self.store.unpin(hit)
        if not keep:
            self.alloc.decref(pages)
        self.store.check_integrity()
        return Served(hit, results, pages, sched)

    def lookup(self, key: ReuseKey, starts: Sequence[int] = ()) -> Hit | None:
        return self.store.lookup(key, plan_schedule(len(key.tokens), starts, self.grid))

    def victims(self) -> list[tuple[str, int, str]]:
        return [(v.namespace, v.cut, v.reason) for v in self.store.drain_evictions()]


def key(tokens: Sequence[int], ns: str = "", images: Sequence[ImageIdentity] = (), lookahead: int = 0) -> ReuseKey:
    return ReuseKey(tuple(tokens), ns, tuple(images), lookahead)
