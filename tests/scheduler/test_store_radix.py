"""Prefix store: save/restore, partial match, and the full reuse identity of a page."""

from __future__ import annotations

from tests.scheduler.test_store_common import LOGITS, Blob, Rig, image, key

from prefixd.scheduler.store import PRESENT, SAVED, Snapshot

TEXT = tuple(range(100, 124))


def test_save_then_restore_returns_the_pages_and_the_snapshot_at_the_cut() -> None:
    rig = Rig()
    first = rig.serve(key(TEXT[:10]))
    assert first.hit is None
    assert first.results == [(4, SAVED), (8, SAVED), (10, SAVED)]
    hit = rig.lookup(key(TEXT[:10]))
    assert hit is not None
    assert (hit.rows, hit.pages) == (10, (0, 1, 2))  # page 2 is the tail page of cut 10
    assert hit.snapshot == Snapshot(state=None, logits=Blob(LOGITS))
    assert [rig.alloc.refcount(p) for p in (0, 1, 2)] == [1, 1, 1]  # the store's own
    assert rig.store.stats().hits == 1 and rig.store.stats().misses == 1


def test_partial_match_resumes_at_the_deepest_common_cut() -> None:
    rig = Rig()
    rig.serve(key(TEXT[:10]))
    other = TEXT[:9] + (7, 7, 7)
    hit = rig.lookup(key(other))
    assert hit is not None and (hit.rows, hit.pages) == (8, (0, 1))
    served = rig.serve(key(other))
    assert served.hit is not None and served.hit.rows == 8
    assert served.pages == [0, 1, 3]  # shared 0 and 1, prefilled 3
    hit2 = rig.lookup(key(other))
    assert hit2 is not None and (hit2.rows, hit2.pages) == (12, (0, 1, 3))


def test_publishing_an_equal_snapshot_again_keeps_one_entry_and_clear_frees_every_page() -> None:
    rig = Rig()
    rig.serve(key(TEXT[:10]))
    before = rig.store.stats()
    again = rig.serve(key(TEXT[:10]), cuts=(4, 8, 10))
    assert again.results == []  # a full hit prefills nothing, so it keeps nothing new
    lane = rig.alloc.allocate(3)
    assert lane == [3, 4, 5]
    from prefixd.scheduler.chunks import plan_schedule
    res = rig.store.publish(key(TEXT[:10]), plan_schedule(10, (), 4), 8, lane,
                            Snapshot(), prefilled_upto=8)
    assert res == PRESENT
    rig.alloc.decref(lane)
    after = rig.store.stats()
    assert (after.entries, after.pages, after.bytes) == (before.entries, before.pages, before.bytes)
    assert rig.store.clear() == 3
    assert rig.alloc.num_free == rig.alloc.num_pages
    assert rig.store.stats().entries == 0 and rig.store.stats().bytes == 0
    assert rig.lookup(key(TEXT[:10])) is None
    rig.store.check_integrity()


def test_two_images_under_equal_placeholder_tokens_are_two_branches() -> None:
    rig = Rig()
    toks = TEXT[:4] + (9,) * 4 + TEXT[8:12]  # rows 4..7 are image placeholders
    a = key(toks, images=[image(4, 4, b"A")])
    b = key(toks, images=[image(4, 4, b"B")])
    rig.serve(a)
    hit = rig.lookup(b)
    assert hit is not None and (hit.rows, hit.pages) == (4, (0,))  # text before stays shared
    served = rig.serve(b)
    assert served.pages == [0, 3, 4]
    assert rig.lookup(a).pages == (0, 1, 2)  # type: ignore[union-attr]
    assert rig.lookup(b).pages == (0, 3, 4)  # type: ignore[union-attr]
    assert rig.store.stats().pages == 5


def test_an_image_at_a_page_edge_splits_the_page_before_it_only_under_lookahead() -> None:
    toks = TEXT[:8] + (9,) * 4 + TEXT[12:14]  # image rows 8..11 start on a page edge
    for lookahead, want_rows in ((0, 8), (1, 4)):
        rig = Rig()
        a = key(toks, images=[image(8, 4, b"A")], lookahead=lookahead)
        b = key(toks, images=[image(8, 4, b"B")], lookahead=lookahead)
        rig.serve(a, cuts=(4, 8, 12))
        hit = rig.lookup(b)
        assert hit is not None and hit.rows == want_rows, lookahead


def test_a_split_inside_an_image_keeps_its_identity_on_both_sides() -> None:
    rig = Rig()
    toks = TEXT[:6] + (9,) * 4 + TEXT[10:16]  # image rows 6..9 cross the page edge at 8
    x = image(6, 4, b"X")
    rig.serve(key(toks, images=[x]))
    same_left = key(toks[:12] + (1, 2, 3, 4), images=[x])
    hit = rig.lookup(same_left)
    assert hit is not None and (hit.rows, hit.pages) == (12, (0, 1, 2))
    other = rig.lookup(key(toks, images=[image(6, 4, b"Y")]))
    assert other is not None and (other.rows, other.pages) == (4, (0,))
    moved = rig.lookup(key(toks, images=[image(6, 3, b"X")]))  # same hash, fewer rows
    assert moved is not None and moved.rows == 4


def test_two_namespaces_share_no_page_and_no_hit() -> None:
    rig = Rig()
    rig.serve(key(TEXT[:8], ns="a"))
    assert rig.lookup(key(TEXT[:8], ns="b")) is None
    rig.serve(key(TEXT[:8], ns="b"))
    assert rig.lookup(key(TEXT[:8], ns="a")).pages == (0, 1)  # type: ignore[union-attr]
    assert rig.lookup(key(TEXT[:8], ns="b")).pages == (2, 3)  # type: ignore[union-attr]


def test_a_full_prompt_hit_needs_the_logits_row() -> None:
    rig = Rig()
    sched_key = key(TEXT[:8])
    rig.serve(sched_key, cuts=(4, 8))
    hit = rig.lookup(sched_key)
    assert hit is not None and hit.snapshot is not None and hit.snapshot.logits == Blob(LOGITS)
    rig2 = Rig()
    from prefixd.scheduler.chunks import plan_schedule
    lane = rig2.alloc.allocate(2)
    rig2.store.publish(sched_key, plan_schedule(8, (), 4), 8, lane, Snapshot(), prefilled_upto=8)
    rig2.store.publish(sched_key, plan_schedule(8, (), 4), 4, lane, Snapshot(), prefilled_upto=8)
    hit2 = rig2.lookup(sched_key)
    assert hit2 is not None and hit2.rows == 4  # no logits at 8: resume at the cut before


def test_row_invariant_family_resumes_at_the_last_whole_page_or_one_row_short() -> None:
    rig = Rig(invariant=True)
    rig.serve(key(TEXT[:12]), cuts=(12,))
    hit = rig.lookup(key(TEXT[:10] + (5, 5, 5)))
    assert hit is not None and (hit.rows, hit.pages, hit.snapshot) == (8, (0, 1), None)
    short = rig.lookup(key(TEXT[:8]))  # whole prompt in pages, no logits at 8
    assert short is not None and (short.rows, short.pages) == (7, (0, 1))


def test_an_equal_entry_kept_without_logits_takes_the_snapshot_that_has_them() -> None:
    rig = Rig()
    rig.serve(key(TEXT[:12]), starts=(4,))  # keeps cut 4 with no logits row
    assert rig.lookup(key(TEXT[:4])) is None  # cut 4 is its whole prompt: no logits, no hit
    again = rig.serve(key(TEXT[:4]))
    assert again.results == [(4, SAVED)]
    assert rig.store.stats().entries == 2
    hit = rig.lookup(key(TEXT[:4]))
    assert hit is not None and (hit.rows, hit.pages) == (4, (0,))
    assert hit.snapshot is not None and hit.snapshot.logits == Blob(LOGITS)
    assert rig.store.stats().bytes == 3 * 100 + LOGITS * 2
