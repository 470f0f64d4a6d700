"""Prefix store against a model of the KV pool: every row a hit hands out holds what a cold run
of the same request would have written, and the store's books always balance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.chunks import Schedule, plan_schedule
from prefixd.scheduler.records import ImageIdentity
from prefixd.scheduler.store import PrefixStore, ReuseKey, Snapshot

P, G, KVPP = 4, 4, 100


@dataclass(frozen=True)
class Tagged:
    """A fake device tensor that remembers what it was computed from."""

    nbytes: int
    tag: object


class Model:
    """A lane simulator over a fake KV pool: page -> {slot: the identity of the row written}."""

    def __init__(self, invariant: bool, budget: int, num_pages: int = 48) -> None:
        self.invariant = invariant
        self.alloc = PageAllocator(num_pages)
        self.pool: dict[int, dict[int, object]] = {}
        self.t = 0.0
        self.rows_reused = 0
        self.store = PrefixStore(self.alloc, page_size=P, kv_bytes_per_page=KVPP,
                                 budget_bytes=budget, invariant_rows=invariant, clock=self.tick)

    def tick(self) -> float:
        self.t += 1
        return self.t

    def row(self, key: ReuseKey, sched: Schedule, r: int) -> object:
        """What a row's KV depends on: its identity, and for a family that is not row-invariant
        the chunk boundaries up to the end of the chunk holding it."""
        stop = r + 1 + key.lookahead
        imgs = tuple(im for im in key.images if im.at < stop)
        chunk_end = next(b for b in sched.boundaries if b > r)
        chunks = () if self.invariant else tuple(b for b in sched.boundaries if b <= chunk_end)
        return (key.namespace, key.tokens[:stop], imgs, chunks)

    def take(self, n: int) -> list[int]:
        if not self.alloc.can_allocate(n):
            self.store.make_room(n)
        pages = self.alloc.allocate(n)
        assert pages is not None, "model ran out of pages"
        for p in pages:
            self.pool[p] = {}
        return pages

    def serve(self, key: ReuseKey, starts: Sequence[int]) -> int:
        run = self.run(key, starts)
        for _ in run:
            pass
        return self.rows_reused

    def run(self, key: ReuseKey, starts: Sequence[int]) -> Iterator[None]:
        """Serve one request, yielding after each chunk so lanes can interleave."""
        n = len(key.tokens)
        sched = plan_schedule(n, starts, G)
        hit = self.store.lookup(key, sched)
        pages: list[int] = []
        rows = 0
        if hit is not None:
            for r in range(hit.rows):
                assert self.pool[hit.pages[r // P]][r % P] == self.row(key, sched, r), r
            if hit.snapshot is not None and hit.snapshot.state is not None:
                assert hit.snapshot.state.tag == self.row(key, sched, hit.rows - 1)
            self.store.pin(hit)
            self.alloc.incref(hit.pages)
            pages, rows = list(hit.pages), hit.rows
            if rows % P:
                fresh = self.take(1)[0]
                self.pool[fresh] = dict(self.pool[pages[-1]])
                self.alloc.decref([pages[-1]])
                pages[-1] = fresh
        for _, end in sched.chunks(rows):
            pages += self.take(-(-end // P) - len(pages))
            for r in range(rows, end):
                self.pool[pages[r // P]][r % P] = self.row(key, sched, r)
            rows = end
            yield
            if sched.is_cut(end) and key.has_rows(end):
                state = Tagged(3, self.row(key, sched, end - 1))
                logits = Tagged(5, None) if end == n else None
                self.store.publish(key, sched, end, pages, Snapshot(state=state, logits=logits),
                                   prefilled_upto=end, restored=hit)
        if hit is not None:
            self.store.unpin(hit)
        self.alloc.decref(pages)
        self.rows_reused = hit.rows if hit is not None else 0

    def check_books(self) -> None:
        self.store.check_integrity()
        self.alloc.check_integrity()
        s = self.store.stats()
        snapshot_bytes = s.bytes - s.pages * KVPP
        assert self.store.exclusive_bytes() == s.bytes  # no lane holds a page between requests
        assert self.alloc.num_used * KVPP + snapshot_bytes == s.bytes
        assert s.bytes <= s.budget_bytes


ALPHABET = st.integers(0, 2)  # few ids, so prompts share prefixes often
BASES = (tuple(range(10, 28)), tuple(range(10, 20)) + tuple(range(40, 48)), (5,) * 18)


@st.composite
def requests(draw: st.DrawFn) -> tuple[ReuseKey, tuple[int, ...]]:
    n = draw(st.integers(1, 18))
    shared = draw(st.integers(0, n))  # rows taken from one of a few common prefixes
    tail = draw(st.lists(ALPHABET, min_size=n - shared, max_size=n - shared))
    tokens = draw(st.sampled_from(BASES))[:shared] + tuple(tail)
    images: tuple[ImageIdentity, ...] = ()
    if n >= 3 and draw(st.booleans()):
        at = draw(st.integers(0, n - 2))
        images = (ImageIdentity(at, 2, 1, 2, draw(st.sampled_from([b"A", b"B"]))),)
    starts = draw(st.sampled_from([(), (), (6,), (3, 9), (5, 13)]))  # few, so they repeat
    starts = tuple(s for s in starts if s < n)
    ns = draw(st.sampled_from(["", "x"]))
    lookahead = draw(st.sampled_from([0, 0, 1]))
    return ReuseKey(tokens, ns, images, lookahead), starts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invariant=st.booleans(), budget=st.sampled_from([250, 900, 3000, 10**6]),
       reqs=st.lists(requests(), min_size=1, max_size=12))
def test_every_hit_holds_the_rows_a_cold_run_writes_and_the_books_balance(
        invariant: bool, budget: int, reqs: list[tuple[ReuseKey, tuple[int, ...]]]) -> None:
    model = Model(invariant, budget)
    for key, starts in reqs + reqs:  # then a replay of the same requests
        model.serve(key, starts)
        model.check_books()
    model.store.clear()
    assert model.alloc.num_free == model.alloc.num_pages
    assert model.store.stats().bytes == 0


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(requests(), min_size=2, max_size=8))
def test_a_repeated_request_resumes_at_its_last_cut_when_nothing_was_evicted(
        reqs: list[tuple[ReuseKey, tuple[int, ...]]]) -> None:
    model = Model(invariant=False, budget=10**9, num_pages=200)
    for key, starts in reqs:
        model.serve(key, starts)
    key, starts = reqs[-1]
    if key.has_rows(len(key.tokens)):
        assert model.serve(key, starts) == len(key.tokens)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invariant=st.booleans(), budget=st.sampled_from([250, 900, 3000]),
       reqs=st.lists(requests(), min_size=2, max_size=8), order=st.lists(st.integers(0, 2)))
def test_interleaved_lanes_only_ever_resume_from_rows_a_cold_run_writes(
        invariant: bool, budget: int, reqs: list[tuple[ReuseKey, tuple[int, ...]]],
        order: list[int]) -> None:
    model = Model(invariant, budget, num_pages=96)
    waiting = [model.run(k, s) for k, s in reqs]
    lanes: list[Iterator[None]] = []
    picks = iter(order)
    while waiting or lanes:
        while waiting and len(lanes) < 3:
            lanes.append(waiting.pop(0))
        i = next(picks, 0) % len(lanes)
        if next(lanes[i], StopIteration) is StopIteration:
            lanes.pop(i)
        model.store.check_integrity()
    model.check_books()
