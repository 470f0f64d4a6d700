"""Prefix store eviction: the order of victims, what is never evicted, and namespaces."""

from __future__ import annotations

from tests.scheduler.test_store_common import KVPP, LOGITS, Rig, key

SYS = tuple(range(400, 408))  # a shared 8-token prefix


def conv(first: int) -> tuple[int, ...]:
    return tuple(range(first, first + 8))


def _build_every_class(rig: Rig) -> None:
    rig.serve(key(conv(10)), cuts=(8,))  # N1: never hit
    rig.serve(key(conv(20)), cuts=(8,))  # H1: hit first
    rig.serve(key(conv(30)), cuts=(8,))  # H2: hit last
    rig.serve(key(conv(40)), cuts=(8,))  # MV: its conversation moves past it
    rig.serve(key(SYS + (1, 1, 1, 1)))  # A: cuts 4, 8, 12
    rig.serve(key(SYS + (2, 2, 2, 2)), cuts=(12,))  # B resumes at 8 and keeps 12
    rig.serve(key(conv(50)), cuts=(8,))  # N2: never hit, newest
    assert rig.lookup(key(conv(20))).rows == 8  # type: ignore[union-attr]
    assert rig.lookup(key(conv(30))).rows == 8  # type: ignore[union-attr]
    rig.store.note_latest(key(conv(40) + (9, 9)))


def test_eviction_order_is_moved_past_then_never_hit_then_lru_then_shared() -> None:
    rig = Rig(state_bytes=5)
    _build_every_class(rig)
    rig.store.set_budget(0)
    assert rig.victims() == [
        ("", 8, "moved_past"),  # MV
        ("", 8, "never_hit"),  # N1
        ("", 12, "never_hit"),  # A
        ("", 12, "never_hit"),  # B
        ("", 8, "never_hit"),  # N2
        ("", 8, "lru"),  # H1
        ("", 8, "lru"),  # H2
        ("", 4, "shared"),  # SYS[:4]: A and B diverge past it
        ("", 8, "shared"),  # SYS
    ]
    assert rig.alloc.num_free == rig.alloc.num_pages
    rig.store.check_integrity()


def test_make_room_frees_pages_in_eviction_order_and_stops_when_enough_are_free() -> None:
    rig = Rig(num_pages=20)
    _build_every_class(rig)
    assert rig.alloc.num_free == 20 - 14
    assert rig.store.make_room(10) == 4
    assert [(v.cut, v.reason, v.trigger, v.pages_freed, v.nbytes)
            for v in rig.store.drain_evictions()] == [
        (8, "moved_past", "pages", (7, 6), 2 * KVPP + LOGITS),
        (8, "never_hit", "pages", (1, 0), 2 * KVPP + LOGITS)]
    assert rig.store.make_room(11) == 1  # A's page past SYS goes; its cut 4 frees no page
    assert rig.victims() == [("", 12, "never_hit")]
    assert rig.store.stats().evictions["never_hit"] == 2


def test_a_pinned_resume_source_and_pages_a_lane_holds_are_never_evicted() -> None:
    rig = Rig()
    rig.serve(key(conv(10)), cuts=(8,))
    lane = rig.serve(key(conv(20)), cuts=(8,), keep=True)
    hit = rig.lookup(key(conv(10)))
    assert hit is not None
    rig.store.pin(hit)
    rig.store.set_budget(0)
    assert rig.store.make_room(rig.alloc.num_pages) == 0
    assert rig.victims() == []
    assert rig.store.stats().entries == 2
    rig.store.unpin(hit)
    rig.alloc.decref(lane.pages)
    assert rig.store.make_room(rig.alloc.num_pages) == 4
    assert rig.victims() == [("", 8, "never_hit"), ("", 8, "lru")]


def test_another_namespaces_longer_prompt_never_moves_a_conversation_past_a_state() -> None:
    rig = Rig(state_bytes=5)
    rig.serve(key(conv(10), ns="a"), cuts=(8,))  # W, older
    rig.serve(key(conv(20), ns="a"), cuts=(8,))  # X, newer
    assert rig.lookup(key(conv(20) + (5, 5, 5), ns="b")) is None
    rig.store.note_latest(key(conv(20) + (6, 6), ns="b"))
    rig.store.set_budget(0)
    assert rig.victims() == [("a", 8, "never_hit"), ("a", 8, "never_hit")]
    assert rig.store.stats().evictions["moved_past"] == 0


def test_a_shared_cut_in_one_namespace_is_not_shared_in_another() -> None:
    rig = Rig(state_bytes=5)
    rig.serve(key(SYS + (3, 3, 3, 3), ns="b"), cuts=(8, 12))  # one conversation in b
    rig.serve(key(SYS + (1, 1, 1, 1), ns="a"), cuts=(8, 12))
    rig.serve(key(SYS + (2, 2, 2, 2), ns="a"), cuts=(8, 12))  # a second one in a
    rig.store.set_budget(0)
    assert rig.victims() == [
        ("b", 8, "moved_past"),
        ("b", 12, "never_hit"),
        ("a", 12, "never_hit"),
        ("a", 12, "never_hit"),
        ("a", 8, "shared"),
    ]


def test_an_entry_that_would_free_nothing_waits_for_the_entries_below_it() -> None:
    rig = Rig()  # empty snapshots: an interior cut alone holds no bytes
    rig.serve(key(SYS + (1, 1, 1, 1)))  # cuts 4 and 8 (moved past, 0 bytes) and 12
    rig.store.set_budget(2 * KVPP)
    assert rig.victims() == [("", 12, "never_hit")]  # page 2 and the logits row go
    assert [i.cut for i in rig.store.describe()] == [4, 8]
    rig.store.set_budget(KVPP)
    assert rig.victims() == [("", 8, "moved_past")]  # now it alone holds page 1
    assert rig.store.stats().bytes == KVPP


def test_make_room_evicts_in_order_entries_that_free_pages_only_together() -> None:
    rig = Rig(num_pages=3)  # exactly the prompt's pages
    rig.serve(key(conv(10) + (7, 7, 7)), starts=(9,))  # cuts 9 and 11 share tail page 2
    assert [(i.cut, i.nbytes) for i in rig.store.describe()] == [(9, 0), (11, LOGITS)]
    assert rig.alloc.num_free == 0
    assert rig.store.make_room(3) == 3
    assert [(v.cut, v.reason, v.trigger, v.pages_freed, v.nbytes)
            for v in rig.store.drain_evictions()] == [
        (9, "moved_past", "pages", (), 0),
        (11, "never_hit", "pages", (2, 1, 0), 3 * KVPP + LOGITS)]
    assert rig.alloc.num_free == 3
    rig.store.check_integrity()


def test_make_room_frees_a_single_victim_first_and_never_a_lane_held_group() -> None:
    rig = Rig(num_pages=7)
    rig.serve(key(conv(10) + (7, 7, 7)), starts=(9,))  # pages 0-2, cuts 9 and 11 together
    lane = rig.serve(key(conv(20)), cuts=(8,), keep=True)  # pages 3, 4: a lane still holds them
    rig.serve(key(conv(30)), cuts=(8,))  # pages 5, 6: one victim frees them
    assert rig.alloc.num_free == 0
    assert rig.store.make_room(2) == 2
    assert rig.victims() == [("", 8, "never_hit")]  # conv(30), not the pair ahead of it
    assert rig.store.make_room(7) == 3  # then the pair; conv(20)'s pages stay with the lane
    assert rig.victims() == [("", 9, "moved_past"), ("", 11, "never_hit")]
    assert rig.alloc.num_free == 5
    rig.alloc.decref(lane.pages)
    rig.store.check_integrity()
