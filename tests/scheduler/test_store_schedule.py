"""Prefix store under the chunk planner: resumes only at a request's own cuts, keeps only
prefilled rows, and a key of another length reuses nothing."""

from __future__ import annotations

import pytest
from tests.scheduler.test_store_common import Rig, key

from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.store import REFUSED, SAVED, Snapshot, make_key

TEXT = tuple(range(200, 230))


def test_a_request_start_off_the_grid_resumes_there_and_never_at_a_grid_point_inside_its_chunk(
) -> None:
    rig = Rig()
    started = rig.serve(key(TEXT[:12]), starts=(6,))  # boundaries 4, 6, 10, 12
    assert started.results == [(6, SAVED), (12, SAVED)]
    plain = key(TEXT[:8] + (1, 1, 1, 1))  # no starts: cuts 4, 8, 12
    assert rig.lookup(plain) is None  # 6 is not its cut
    rig.serve(plain)  # keeps cuts 4 and 8
    assert rig.lookup(plain).rows == 12  # type: ignore[union-attr]
    same_starts = rig.lookup(key(TEXT[:10] + (3, 3)), starts=(6,))
    assert same_starts is not None and same_starts.rows == 6  # 4 and 8 lie inside its chunks
    assert same_starts.pages == (0, 1)  # page 1 is the tail page of cut 6


def test_a_snapshot_serves_only_a_request_whose_starts_below_the_cut_agree() -> None:
    rig = Rig()
    rig.serve(key(TEXT[:12]), starts=(6,))
    assert rig.lookup(key(TEXT[:12]), starts=(2, 6)) is None  # chunks below 6 differ
    hit = rig.lookup(key(TEXT[:12]), starts=(6, 9))  # a start past the cut is fine
    assert hit is not None and hit.rows == 6


def test_publishing_off_a_cut_is_a_caller_bug_for_a_family_that_is_not_row_invariant() -> None:
    rig = Rig()
    lane = rig.alloc.allocate(2)
    assert lane is not None
    with pytest.raises(ValueError, match="not a cut"):
        rig.store.publish(key(TEXT[:12]), plan_schedule(12, (6,), 4), 4, lane, Snapshot(),
                          prefilled_upto=6)


def test_a_row_invariant_family_resumes_at_any_identity_equal_row() -> None:
    rig = Rig(invariant=True)
    rig.serve(key(TEXT[:12]), starts=(6,))
    hit = rig.lookup(key(TEXT[:12] + (5, 5)), starts=(3,))
    assert hit is not None and (hit.rows, hit.pages) == (12, (0, 1, 2))


def test_a_key_of_another_length_reuses_and_keeps_nothing() -> None:
    k, note = make_key(TEXT[:12], cache_key=TEXT[:11])
    assert k is None and note is not None and "11" in note and "12" in note
    k2, note2 = make_key(TEXT[:12], cache_key=TEXT[12:24], namespace="n")
    assert note2 is None and k2 is not None and k2.tokens == TEXT[12:24] and k2.namespace == "n"


def test_a_keep_past_the_prefilled_rows_is_refused_and_counted() -> None:
    rig = Rig()
    lane = rig.alloc.allocate(3)
    assert lane is not None
    sched = plan_schedule(12, (), 4)
    res = rig.store.publish(key(TEXT[:12]), sched, 12, lane, Snapshot(), prefilled_upto=8)
    assert res == REFUSED
    assert rig.store.stats().refused_keeps == 1 and rig.store.stats().entries == 0
    assert [rig.alloc.refcount(p) for p in lane] == [1, 1, 1]  # nothing taken
    assert rig.store.publish(key(TEXT[:12]), sched, 8, lane, Snapshot(), prefilled_upto=8) == SAVED


def test_a_keep_whose_lookahead_runs_past_the_key_is_refused() -> None:
    rig = Rig()
    lane = rig.alloc.allocate(3)
    assert lane is not None
    res = rig.store.publish(key(TEXT[:12], lookahead=1), plan_schedule(12, (), 4), 12, lane,
                            Snapshot(), prefilled_upto=12)
    assert res == REFUSED


def test_pages_chunked_otherwise_are_never_handed_to_a_family_that_is_not_row_invariant() -> None:
    rig = Rig()
    rig.serve(key(TEXT[:8]))  # rows 4..7 prefilled as one chunk [4, 8) into page 1
    started = rig.serve(key(TEXT[:8]), starts=(6,))  # the same rows chunked [4, 6) + [6, 8)
    assert started.hit is None and started.pages == [2, 3]
    assert started.results == [(6, SAVED), (8, SAVED)]
    hit = rig.lookup(key(TEXT[:8]), starts=(6,))
    assert hit is not None and (hit.rows, hit.pages) == (8, (0, 3))  # page 0 chunked alike
    assert rig.lookup(key(TEXT[:8])).pages == (0, 1)  # type: ignore[union-attr]


def test_a_row_invariant_family_shares_the_page_however_it_was_chunked() -> None:
    rig = Rig(invariant=True)
    rig.serve(key(TEXT[:8]))
    hit = rig.lookup(key(TEXT[:8] + (1,)), starts=(6,))
    assert hit is not None and (hit.rows, hit.pages) == (8, (0, 1))
