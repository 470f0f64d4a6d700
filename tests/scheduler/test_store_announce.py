"""KV events: what the store announces equals what it holds, in hashes a router can compute."""

from __future__ import annotations

import random

from tests.scheduler.engines import make_engine, req, turn
from tests.scheduler.test_store_common import P, Rig, image, key

from prefixd.scheduler.store.announce import (PAGES, SNAPSHOTS, AllBlocksCleared, Announcer, BlockRemoved,
                                              BlockStored, View, batch_to_wire, held, page_hash, prompt_hashes,
                                              to_wire)

TEXT = tuple(range(100, 124))


def watched(rig: Rig) -> tuple[Announcer, View]:
    announcer = Announcer(P, snapshots=not rig.invariant)
    rig.store.announce_to(announcer)
    return announcer, View()


def deliver(announcer: Announcer, view: View) -> list:
    """One round's events through the wire shape into the subscriber's view."""
    events = announcer.take()
    view.apply_wire(batch_to_wire(1.0, events, "CPU"))
    return events


def store_view(rig: Rig) -> set[tuple[int, int]]:
    return held(rig.store.kv_blocks(snapshots=not rig.invariant))


def test_the_hash_is_the_documented_sha256_chain() -> None:
    import hashlib
    import struct

    digest = hashlib.sha256(b"prefixd-kv-1\x00" + b"\xff" * 8 + struct.pack(">I", 2) + b"ns"
                            + struct.pack(">5I", 4, 1, 2, 3, 4) + struct.pack(">I", 0)).digest()
    first = int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)
    assert page_hash(None, "ns", (1, 2, 3, 4)) == first
    digest = hashlib.sha256(b"prefixd-kv-1\x00" + first.to_bytes(8, "big") + struct.pack(">I", 2) + b"ns"
                            + struct.pack(">5I", 4, 5, 6, 7, 8) + struct.pack(">I", 1)
                            + struct.pack(">iIIII", -1, 3, 1, 3, 2) + b"im").digest()
    im = image(3, 3, b"im")
    second = page_hash(first, "ns", (5, 6, 7, 8), (im,), 4)
    assert second == int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)
    late = image(5, 2, b"im")  # over page 1 only
    assert prompt_hashes((1, 2, 3, 4, 5, 6, 7, 8, 9), 4, "ns", (late,)) == [
        first, page_hash(first, "ns", (5, 6, 7, 8), (late,), 4)]


def test_stored_pages_are_the_prompts_full_pages_in_hashes_a_router_computes() -> None:
    rig = Rig(invariant=True)
    announcer, view = watched(rig)
    rig.serve(key(TEXT[:10]))
    events = deliver(announcer, view)
    h = prompt_hashes(TEXT[:10], P)
    assert events == [BlockStored(tuple(h), None, TEXT[:8], P)]  # page 2 holds a tail: not a full page
    assert view.blocks == {(PAGES, h[0]), (PAGES, h[1])} == store_view(rig)
    assert to_wire(events[0], "CPU") == ["BlockStored", h, None, list(TEXT[:8]), P, None, "CPU", None, None, 0]
    assert to_wire(events[0], "CPU", "map") == {
        "type": "BlockStored", "block_hashes": h, "parent_block_hash": None, "token_ids": list(TEXT[:8]),
        "block_size": P, "lora_id": None, "medium": "CPU", "lora_name": None, "extra_keys": None, "group_idx": 0}
    assert to_wire(BlockRemoved((h[1],)), "GPU", "map") == {"type": "BlockRemoved", "block_hashes": [h[1]],
                                                            "medium": "GPU", "group_idx": 0}
    assert to_wire(AllBlocksCleared(), "GPU", "map") == {"type": "AllBlocksCleared"}
    mapped = View()
    mapped.apply_wire(batch_to_wire(1.0, events, "CPU", layout="map"))
    assert mapped.blocks == view.blocks
    rig.serve(key(TEXT[:9] + (7, 7, 7)))  # shares page 0 and 1, adds page 3 under page 1
    other = prompt_hashes(TEXT[:9] + (7, 7, 7), P)
    assert deliver(announcer, view) == [BlockStored((other[2],), h[1], TEXT[8:9] + (7, 7, 7), P)]
    assert other[:2] == h
    assert deliver(announcer, view) == []  # nothing changed


def test_namespaces_and_images_give_other_hashes() -> None:
    rig = Rig(invariant=True)
    announcer, view = watched(rig)
    rig.serve(key(TEXT[:8]))
    rig.serve(key(TEXT[:8], ns="team-b"))
    im = image(2, 3, b"cat")
    rig.serve(key(TEXT[:8], images=(im,)))
    deliver(announcer, view)
    plain, team, pictured = (prompt_hashes(TEXT[:8], P), prompt_hashes(TEXT[:8], P, "team-b"),
                             prompt_hashes(TEXT[:8], P, images=(im,)))
    assert len({*plain, *team, *pictured}) == 6
    assert view.blocks == {(PAGES, x) for x in plain + team + pictured} == store_view(rig)


def test_evictions_remove_the_pages_no_entry_keeps_and_clear_says_all_cleared() -> None:
    rig = Rig(invariant=True, num_pages=64)
    announcer, view = watched(rig)
    rig.serve(key(TEXT[:12]))
    rig.serve(key(TEXT[:4] + (9,) * 8))
    deliver(announcer, view)
    a, b = prompt_hashes(TEXT[:12], P), prompt_hashes(TEXT[:4] + (9,) * 8, P)
    rig.store.set_budget(0)
    events = deliver(announcer, view)
    assert events == [AllBlocksCleared()] and view.blocks == set() == store_view(rig)
    rig.store.set_budget(10**9)
    rig.serve(key(TEXT[:12]))
    rig.serve(key(TEXT[:4] + (9,) * 8))
    deliver(announcer, view)
    assert view.blocks == {(PAGES, x) for x in a + b}
    rig.alloc.allocate(rig.alloc.num_free)  # the pool is full: make_room evicts, oldest first
    rig.store.make_room(1)
    assert deliver(announcer, view) == [BlockRemoved((a[2],))]  # the cut at 12 went, its page with it
    rig.store.make_room(2)
    assert deliver(announcer, view) == [BlockRemoved((a[1],))]
    assert view.blocks == {(PAGES, x) for x in b} == store_view(rig)  # page a[0] is b[0]
    rig.store.clear()
    assert deliver(announcer, view) == [AllBlocksCleared()]
    assert view.blocks == set() == store_view(rig)


def test_a_hybrid_familys_snapshots_are_announced_at_their_cuts() -> None:
    rig = Rig(invariant=False)
    announcer, view = watched(rig)
    rig.serve(key(TEXT[:10]))  # cuts 4, 8 (grid) and 10 (the prompt's end)
    events = deliver(announcer, view)
    h = prompt_hashes(TEXT[:10], P)
    tail = page_hash(h[1], "", TEXT[8:10], (), 8)
    assert events == [BlockStored(tuple(h), None, TEXT[:8], P),
                      BlockStored(tuple(h), None, TEXT[:8], P, SNAPSHOTS),  # cuts 4 and 8: one chain
                      BlockStored((tail,), h[1], TEXT[8:10], P, SNAPSHOTS)]
    assert view.blocks == {(PAGES, h[0]), (PAGES, h[1]), (SNAPSHOTS, h[0]), (SNAPSHOTS, h[1]),
                           (SNAPSHOTS, tail)} == store_view(rig)
    rig.store.clear()
    assert deliver(announcer, view) == [AllBlocksCleared()]


def test_pages_under_other_chunks_share_one_hash_until_the_last_goes() -> None:
    rig = Rig(invariant=False)
    announcer, view = watched(rig)
    rig.serve(key(TEXT[:8]))
    rig.serve(key(TEXT[:8]), starts=(2,))  # the same rows chunked otherwise: sibling nodes
    deliver(announcer, view)
    assert rig.store.stats().pages > 2
    assert view.blocks == store_view(rig)
    assert {h for g, h in view.blocks if g == PAGES} == set(prompt_hashes(TEXT[:8], P))


def test_random_stores_evictions_and_clears_keep_the_view_equal_to_the_store() -> None:
    rnd = random.Random(7)
    for invariant in (True, False):
        rig = Rig(invariant=invariant, num_pages=40, budget=2400, state_bytes=30)
        announcer, view = watched(rig)
        prompts = [tuple(rnd.randrange(3) for _ in range(rnd.randrange(1, 20))) for _ in range(12)]
        for step in range(300):
            p = rnd.choice(prompts) + tuple(rnd.randrange(3) for _ in range(rnd.randrange(4)))
            rig.serve(key(p, ns=rnd.choice(("", "b"))), starts=rnd.choice(((), (1,))))
            if step % 50 == 49:
                rig.store.clear()
            if step % 3 == 0:
                deliver(announcer, view)
                assert view.blocks == store_view(rig), step
        deliver(announcer, view)
        assert view.blocks == store_view(rig)
        assert announcer.num_held == len(view.blocks)


def test_an_engine_on_the_fake_device_announces_what_its_store_holds() -> None:
    engine, _ = make_engine(num_lanes=2, grid=8, budget=64, cache=True, store=True, page_size=4, num_pages=40)
    assert engine.store is not None
    announcer = Announcer(4, snapshots=not engine.info.invariant_rows)
    engine.store.announce_to(announcer)
    view = View()
    prompt = tuple(range(30, 50))
    turn(engine, req(1, prompt))
    view.apply_wire(batch_to_wire(0.0, announcer.take(), "CPU"))
    assert view.blocks == held(engine.store.kv_blocks(snapshots=announcer.snapshots))
    assert set(prompt_hashes(prompt, 4)[:4]) <= {h for g, h in view.blocks if g == PAGES}
    turn(engine, req(2, prompt + (1, 2, 3, 4, 5, 6)))
    view.apply_wire(batch_to_wire(0.0, announcer.take(), "CPU"))
    assert view.blocks == held(engine.store.kv_blocks(snapshots=announcer.snapshots))
    engine.store.clear()
    view.apply_wire(batch_to_wire(0.0, announcer.take(), "CPU"))
    assert view.blocks == set() == held(engine.store.kv_blocks(snapshots=announcer.snapshots))
