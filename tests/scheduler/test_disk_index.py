"""The disk index: digests of a key's prefixes, parent chains, and eviction in the RAM store's
order (moved past, never hit, least recently used, shared last; leaves before their parents)."""

from __future__ import annotations

import pytest

from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.records import ImageIdentity
from prefixd.scheduler.store import ReuseKey
from prefixd.disk.index import DiskEntry, DiskIndex, KeyDigests, cut_hashes
from tests.scheduler.disk_rig import disk_engine
from tests.scheduler.engines import req, turn


def entry(name: str, parent: str | None = None, *, cut: int = 4, t: float = 0.0, hits: int = 0) -> DiskEntry:
    d = name.encode().ljust(16, b".")
    p = parent.encode().ljust(16, b".") if parent else None
    return DiskEntry(d, p, cut, 0, 1, 100, True, seq=0, last_used=t, hits=hits, durable=True)


def order_fixture() -> tuple[DiskIndex, dict[str, DiskEntry]]:
    idx = DiskIndex(page_size=4, invariant_rows=True)
    es = {}
    for i, (name, parent, t, hits) in enumerate([
        ("R1", None, 1, 0), ("R1a", "R1", 2, 0),  # a conversation: R1a extends R1 (moved past)
        ("N", None, 3, 0),  # never hit
        ("H", None, 0.5, 1),  # hit once, the oldest last use
        ("S", None, 5, 0), ("S1", "S", 6, 0), ("S2", "S", 7, 0),  # S: two continuations, shared
        ("M", None, 8, 0),  # a later prompt ran past it
    ]):
        e = entry(name, parent, cut=8 if parent else 4, t=t, hits=hits)
        e.seq = idx.next_seq()
        idx.add(e)
        es[name] = e
    es["M"].moved_past = True
    return idx, es


def names(entries) -> list[str]:
    return [e.digest.rstrip(b".").decode() for e in entries]


def test_victims_follow_the_ram_order_and_take_leaves_before_their_parents():
    idx, es = order_fixture()
    assert es["R1"].moved_past and es["S"].shared and not es["S1"].shared
    assert names(idx.victims(0)) == ["M", "R1a", "R1", "N", "S1", "S2", "H", "S"]


def test_victims_stop_once_the_total_fits_and_spare_the_protected():
    idx, es = order_fixture()
    assert idx.bytes == 800
    assert names(idx.victims(400)) == ["M", "R1a", "R1", "N"]
    assert names(idx.victims(400, protect=frozenset({es["M"].digest}))) == ["R1a", "R1", "N", "S1"]


def test_a_parent_is_never_removed_before_its_children():
    idx, es = order_fixture()
    with pytest.raises(RuntimeError, match="chain on it"):
        idx.remove(es["S"])
    for name in ("S1", "S2", "S"):
        idx.remove(es[name])
    idx.check_integrity()
    assert idx.bytes == 500


def test_digests_cover_ids_namespace_images_and_the_schedule_hash():
    im = ImageIdentity(at=1, tokens=2, gh=1, gw=2, hash=b"A")
    base = KeyDigests(ReuseKey((1, 2, 3, 4, 5))).at(4, b"")
    assert KeyDigests(ReuseKey((1, 2, 3, 4, 9))).at(4, b"") == base  # rows past the cut do not count
    assert KeyDigests(ReuseKey((1, 2, 3, 5, 5))).at(4, b"") != base
    assert KeyDigests(ReuseKey((1, 2, 3, 4, 5), namespace="b")).at(4, b"") != base
    assert KeyDigests(ReuseKey((1, 2, 3, 4, 5), images=(im,))).at(4, b"") != base
    assert KeyDigests(ReuseKey((1, 2, 3, 4, 5))).at(4, b"h") != base


def test_find_in_a_family_that_is_not_row_invariant_takes_only_cuts_of_the_schedule():
    idx = DiskIndex(page_size=4, invariant_rows=False)
    key = ReuseKey(tuple(range(12)))
    sched = plan_schedule(12, (6,), 4)  # boundaries 4, 6, 10, 12; cuts 6 and 12
    for cut in (4, 6):
        e = entry(f"c{cut}", cut=cut)
        e.digest = KeyDigests(key).at(cut, cut_hashes(key, plan_schedule(12, (cut,), 4), False)(cut))
        idx.add(e)
    assert idx.find(key, sched).cut == 6
    # without a start at 6, row 6 is no cut; cut 4 is, with the same (empty) starts below it
    assert idx.find(key, plan_schedule(12, (), 4)).cut == 4
    assert idx.find(key, plan_schedule(12, (2,), 4)) is None  # a start at 2: rows 4 and 6 are no cuts


def test_the_tier_stays_within_its_budget_and_its_files_match_its_index(tmp_path):
    engine, _, tier = disk_engine(tmp_path, disk_budget=20_000)
    for sid, head in enumerate((10, 20, 30, 40)):
        turn(engine, req(sid, list(range(head, head + 12)), max_tokens=1))
    tier.flush()
    stats = tier.stats()
    assert stats.bytes <= 20_000 and 0 < stats.entries < 12
    on_disk = sorted(p.name for p in tmp_path.glob("*.pxc"))
    assert on_disk == sorted(f"{e.name}.pxc" for e in tier.index.entries.values())
    assert stats.bytes == sum(p.stat().st_size for p in tmp_path.glob("*.pxc"))
    tier.index.check_integrity()
