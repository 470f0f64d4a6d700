"""Prefix store allowance: exact bytes, skipped saves, replacing the restored ancestor."""

from __future__ import annotations

from tests.scheduler.test_store_common import KVPP, LOGITS, Rig, key

from prefixd.scheduler.store import REPLACED, SAVED, SKIPPED

TEXT = tuple(range(300, 330))
STATE = 7


def test_bytes_are_held_pages_times_kv_bytes_plus_snapshot_bytes_and_match_the_pool() -> None:
    rig = Rig(state_bytes=STATE)
    lane = rig.serve(key(TEXT[:10]), keep=True)  # entries at 4, 8, 10; pages 0, 1, 2
    want = 3 * KVPP + 3 * STATE + LOGITS
    s = rig.store.stats()
    assert (s.bytes, s.pages, s.entries) == (want, 3, 3)
    assert rig.store.exclusive_bytes() == 3 * STATE + LOGITS  # the lane still holds every page
    rig.alloc.decref(lane.pages)
    assert rig.store.exclusive_bytes() == want
    assert rig.alloc.num_used * KVPP + 3 * STATE + LOGITS == want


def test_pages_shared_by_two_conversations_are_counted_once() -> None:
    rig = Rig(state_bytes=STATE)
    rig.serve(key(TEXT[:10]))
    second = rig.serve(key(TEXT[:8] + (1, 2, 3, 4)))
    assert second.pages == [0, 1, 3]
    want = 4 * KVPP + 4 * STATE + 2 * LOGITS
    assert rig.store.stats().bytes == want
    assert rig.alloc.num_used * KVPP + 4 * STATE + 2 * LOGITS == want


def test_a_snapshot_that_does_not_fit_is_skipped_and_counted() -> None:
    rig = Rig(state_bytes=STATE, budget=KVPP - 1)
    served = rig.serve(key(TEXT[:10]))
    assert served.results == [(4, SKIPPED), (8, SKIPPED), (10, SKIPPED)]
    s = rig.store.stats()
    assert (s.skipped_saves, s.entries, s.bytes, s.pages) == (3, 0, 0, 0)
    assert rig.alloc.num_free == rig.alloc.num_pages


def test_a_new_snapshot_that_does_not_fit_replaces_the_restored_ancestor_it_extends() -> None:
    ancestor = 2 * KVPP + STATE + LOGITS  # cut 8
    extended = 3 * KVPP + STATE + LOGITS  # cut 12 over the same first two pages
    rig = Rig(state_bytes=STATE, budget=extended)
    assert rig.serve(key(TEXT[:8]), cuts=(8,)).results == [(8, SAVED)]
    assert rig.store.stats().bytes == ancestor
    turn2 = rig.serve(key(TEXT[:12]), cuts=(12,))
    assert turn2.hit is not None and turn2.hit.rows == 8
    assert turn2.results == [(12, REPLACED)]
    s = rig.store.stats()
    assert (s.bytes, s.entries, s.evictions["replaced"]) == (extended, 1, 1)
    assert [(v.cut, v.reason, v.trigger, v.nbytes) for v in rig.store.drain_evictions()] == [
        (8, "replaced", "publish", STATE + LOGITS)]
    assert rig.lookup(key(TEXT[:8])) is None
    assert rig.lookup(key(TEXT[:12])).rows == 12  # type: ignore[union-attr]


def test_a_snapshot_over_budget_with_no_restored_ancestor_evicts_in_order_to_fit() -> None:
    one = 3 * KVPP + STATE + LOGITS
    rig = Rig(state_bytes=STATE, budget=one)
    rig.serve(key(TEXT[:12]), cuts=(12,))
    res = rig.serve(key(TEXT[:12], ns="b"), cuts=(12,))
    assert res.results == [(12, SAVED)]
    assert rig.victims() == [("", 12, "never_hit")]
    assert rig.store.stats().bytes == one and rig.alloc.num_used == 3


def test_lowering_the_budget_evicts_down_to_it() -> None:
    rig = Rig(state_bytes=STATE)
    rig.serve(key(TEXT[:10]))
    rig.store.set_budget(3 * KVPP + STATE + LOGITS + 3)  # the leaf at 10 and 3 bytes spare
    assert rig.victims() == [("", 4, "moved_past"), ("", 8, "moved_past")]
    assert rig.store.stats().bytes == 3 * KVPP + STATE + LOGITS
    rig.store.set_budget(0)
    assert rig.victims() == [("", 10, "never_hit")]
    assert rig.store.stats().bytes == 0 and rig.alloc.num_free == rig.alloc.num_pages
    rig.store.check_integrity()


def test_an_entrys_bytes_are_what_it_alone_holds() -> None:
    rig = Rig(state_bytes=STATE)
    rig.serve(key(TEXT[:10]))  # cuts 4 and 8 on page edges, 10 with tail page 2
    assert [(i.cut, i.nbytes) for i in rig.store.describe()] == [
        (4, STATE), (8, STATE), (10, STATE + LOGITS + KVPP)]
    rig.serve(key(TEXT[:8] + (1, 2, 3, 4)))  # a second branch past page 1
    assert [(i.cut, i.nbytes) for i in rig.store.describe()] == [
        (4, STATE), (8, STATE), (10, STATE + LOGITS + KVPP), (12, STATE + LOGITS + KVPP)]
    rig.store.clear()
    rig.serve(key(TEXT[:8]), cuts=(8,))
    assert [(i.cut, i.nbytes) for i in rig.store.describe()] == [(8, STATE + LOGITS + 2 * KVPP)]
