"""Lane page tables: growth, rewind, copy-on-write of shared pages, and resident identity matching."""

from __future__ import annotations

from prefixd.scheduler.lanes import Lane, PageTables, match_rows
from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.records import ImageIdentity, PageCopy


def tables(num_pages=8):
    return PageTables(PageAllocator(num_pages), 4)


def written(lane: Lane, rows: int) -> Lane:
    lane.ids.extend(range(100, 100 + rows))
    return lane


def test_grow_takes_only_the_pages_rows_need_and_nothing_when_short():
    t = tables(num_pages=3)
    lane = Lane(0)
    assert t.grow(lane, 5) and lane.pages == [0, 1]
    assert t.grow(lane, 8) and lane.pages == [0, 1]
    assert not t.grow(lane, 13) and lane.pages == [0, 1]
    assert t.allocator.num_free == 1


def test_rewind_releases_pages_past_the_row_without_copying_own_pages():
    t = tables()
    lane = written(Lane(0), 10)
    t.grow(lane, 10)
    assert t.rewind(lane, 5) == ()
    assert lane.pages == [0, 1] and lane.ids == list(range(100, 105))
    assert t.allocator.refcount(2) == 0


def test_rewind_into_a_page_the_store_also_holds_copies_it():
    t = tables()
    lane = written(Lane(0), 10)
    t.grow(lane, 10)
    t.allocator.incref([1])  # the store keeps rows of page 1
    assert t.cow_pages_needed(lane, 6) == 1
    assert t.rewind(lane, 6) == (PageCopy(src=1, dst=2),)  # for the round's plan, before its forward
    assert lane.pages == [0, 2] and t.allocator.refcount(1) == 1  # page 2 was freed first


def test_appending_into_an_own_page_the_store_holds_copies_nothing():
    t = tables()
    lane = written(Lane(0), 6)
    t.grow(lane, 6)
    t.allocator.incref([1])  # the store kept a cut at row 6
    assert t.cow_pages_needed(lane, 6) == 0
    assert t.rewind(lane, 6) == () and lane.pages == [0, 1]


def test_a_borrowed_tail_page_is_copied_before_the_first_write():
    t = tables()
    store_pages = t.allocator.allocate(2)  # the store's pages for rows [0, 6)
    lane = Lane(0)
    t.allocator.incref(store_pages)
    lane.pages.extend(store_pages)
    lane.num_borrowed = 2
    written(lane, 6)
    assert t.rewind(lane, 6) == (PageCopy(src=1, dst=2),)
    assert lane.pages == [0, 2] and lane.num_borrowed == 1
    t.release(lane)
    assert [t.allocator.refcount(p) for p in (0, 1, 2)] == [1, 1, 0]


def test_match_rows_compares_tokens_namespace_and_images():
    image = ImageIdentity(at=2, tokens=2, gh=1, gw=2, hash=b"a")
    other = ImageIdentity(at=2, tokens=2, gh=1, gw=2, hash=b"b")
    lane = written(Lane(0), 8)
    lane.namespace, lane.images = "ns", (image,)
    key = list(range(100, 106)) + [7, 7]
    assert match_rows(lane, key, "ns", (image,)) == 6
    assert match_rows(lane, key, "other", (image,)) == 0
    assert match_rows(lane, key, "ns", (other,)) == 2
    assert match_rows(lane, key, "ns", ()) == 2
