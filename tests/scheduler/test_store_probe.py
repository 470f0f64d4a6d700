"""The store's probe for cache diagnostics: how far a key agrees with the tree, and what an
earlier prompt had kept (store/probe.py, store/recent.py)."""

from __future__ import annotations

from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.store.probe import Match
from tests.scheduler.test_store_common import G, Rig, key

A = tuple(range(100, 114))  # 14 ids: full pages 0..2, cuts 4, 8, 12, 14 (P = G = 4)


def probe(rig: Rig, k):
    return rig.store.probe(k, plan_schedule(len(k.tokens), (), G))


def test_the_walk_names_the_row_a_key_leaves_the_tree_at_and_the_held_ids_from_there():
    rig = Rig()
    rig.serve(key(A))
    b = key(A[:9] + (99,) + A[10:])
    assert rig.lookup(b).rows == 8  # what is served: the cut below the divergence
    # page 2 holds ids 108..111; the key leaves it at row 9; the entry at 14 holds 112, 113
    assert probe(rig, b).match == Match(rows=9, cached=(109, 110, 111, 112, 113), snapshot_cut=8)


def test_past_the_last_full_page_the_walk_compares_entry_tails():
    rig = Rig()
    rig.serve(key(A))
    b = key(A[:13] + (99,))
    assert probe(rig, b).match == Match(rows=13, cached=(113,), snapshot_cut=12)


def test_a_key_that_is_all_held_has_no_divergence_and_another_namespace_holds_nothing():
    rig = Rig()
    rig.serve(key(A))
    assert probe(rig, key(A[:10])).match == Match(rows=10, cached=(), snapshot_cut=8)
    assert probe(rig, key(A, ns="other")).match is None


def test_the_first_id_differing_still_names_the_held_id_there():
    rig = Rig()
    rig.serve(key(A))
    assert probe(rig, key((7,) + A[1:])).match == Match(rows=0, cached=A[:8], snapshot_cut=0)


def test_rows_an_earlier_prompt_kept_are_remembered_after_they_are_evicted():
    rig = Rig()
    rig.serve(key(A))
    b = key(A[:9] + (99,) + A[10:])
    assert probe(rig, b).kept_before == 8  # whole pages shared with what A kept
    rig.store.clear()
    p = probe(rig, b)
    assert (p.match, p.kept_before) == (None, 8)
    assert probe(rig, key(A, ns="other")).kept_before == 0  # the record is per namespace


def test_a_probe_changes_nothing_the_store_decides():
    rig, twin = Rig(), Rig()
    for r in (rig, twin):
        r.serve(key(A))
        r.serve(key(A[:6] + (5, 6, 7, 8, 9, 10)))
    b = key(A[:9] + (99,) + A[10:])
    probe(rig, b)
    assert rig.store.describe() == twin.store.describe()
    assert rig.store.stats() == twin.store.stats()
    mine, theirs = rig.lookup(b), twin.lookup(b)
    assert (mine.rows, mine.pages, mine.snapshot, mine.source.cut) == (theirs.rows, theirs.pages,
                                                                     theirs.snapshot, theirs.source.cut)
    assert rig.victims() == twin.victims()


def test_where_a_key_leaves_the_tree_at_most_max_branches_branches_are_compared():
    from prefixd.scheduler.store.probe import MAX_BRANCHES

    rig = Rig(invariant=True, num_pages=4 * MAX_BRANCHES)
    for i in range(MAX_BRANCHES + 6):  # the same first page, then a branch each
        rig.serve(key((1, 2, 3, 4, 500 + i, 7, 8, 9)))
    last = key((1, 2, 3, 4, 500 + MAX_BRANCHES + 5, 7, 99, 9))  # agrees with the last branch to row 6
    assert probe(rig, last).match == Match(rows=4, cached=(500, 7, 8, 9), snapshot_cut=0)
    first = key((1, 2, 3, 4, 500, 7, 99, 9))  # the first branch is compared
    assert probe(rig, first).match == Match(rows=6, cached=(8, 9), snapshot_cut=0)
