"""Prefix store cursors: observing only what changed marks entries as a rescan of the tree
would (exactly for requests one at a time; never later for interleaved lanes, and alike once
they are done), and a request's publishes walk only the pages it adds."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.store import Hit, ReuseKey
from prefixd.scheduler.store.entries import Node
from prefixd.scheduler.store.identity import agrees_from
from prefixd.scheduler.store.tree import Tree
from tests.scheduler.test_store_common import KVPP, LOGITS, P, Rig, image, key


def rescan_observe(tree: Tree, k: ReuseKey, moved_below: int) -> None:
    """Observe `k` by walking every node with its rows, however chunked, from the root."""
    root = tree.roots.get(k.namespace)
    nodes: list[Node] = []
    level = [] if root is None else [root]
    while level:
        nodes += level
        end = (level[0].depth + 1) * P
        if end > moved_below or not k.has_rows(end):
            break
        rk = k.rows_key(end - P, end)
        level = [c for n in level for c in n.children.get(rk, {}).values()]
    for e in tree.prefix_entries(nodes, k):
        if e.cut < moved_below:
            e.moved_past = True
        cont = e.continuation
        if cont is None or (agrees_from(cont, k, e.cut) and len(k.tokens) > len(cont.tokens)):
            e.continuation = k
        elif not agrees_from(cont, k, e.cut):
            e.shared = True


def rescanning(rig: Rig) -> Rig:
    tree = rig.store._tree
    tree.observe = lambda cur, moved_below: rescan_observe(tree, cur.key, moved_below)  # type: ignore[method-assign]
    return rig


def marks(rig: Rig) -> list[tuple]:
    return [(e.namespace, e.cut, e.moved_past, e.shared, id(e.continuation), e.hits)
            for e in rig.store._tree.entries.values()]


def same(hit: Hit | None) -> tuple | None:
    return None if hit is None else (hit.rows, hit.pages, hit.snapshot)


OPS = st.lists(st.tuples(st.sampled_from(["serve", "again", "note", "lookup"]),
                         st.integers(0, 5), st.integers(1, 30), st.integers(0, 3)),
               min_size=1, max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, invariant=st.booleans(), budget=st.sampled_from([10**9, 9 * KVPP]))
def test_incremental_observe_marks_entries_as_a_rescan_does(ops, invariant, budget) -> None:
    convs = [(1, 2, 3, 4, 5, 6, 7, 8) + (c % 3,) * 12 + tuple(range(c, c + 12)) for c in range(6)]
    fast = Rig(num_pages=200, budget=budget, invariant=invariant)
    slow = rescanning(Rig(num_pages=200, budget=budget, invariant=invariant))
    keys: list[tuple[ReuseKey, tuple[int, ...]]] = []
    for op, c, n, s in ops:
        ns = "ab"[c % 2] if c > 3 else ""
        images = (image(9, 3, b"x"),) if c == 5 and n > 12 else ()
        starts = tuple(x for x in (5, 11, 17)[:s] if x < n)
        if op == "again" and keys:
            k, starts = keys[n % len(keys)]  # the same key object: its cursor carries on
        else:
            k = key(convs[c][:n], ns=ns, images=images)
            keys.append((k, starts))
        if op in ("serve", "again"):
            a, b = fast.serve(k, starts), slow.serve(k, starts)
            assert (same(a.hit), a.results) == (same(b.hit), b.results)
        elif op == "note":
            fast.store.note_latest(k)
            slow.store.note_latest(k)
        else:
            assert same(fast.lookup(k, starts)) == same(slow.lookup(k, starts))
        assert marks(fast) == marks(slow)
        assert fast.victims() == slow.victims()
    fast.store.set_budget(0)
    slow.store.set_budget(0)
    assert fast.victims() == slow.victims()


def test_publishing_a_long_prompt_walks_each_page_once() -> None:
    rig = Rig(num_pages=300)
    calls = 0
    real = ReuseKey.rows_key

    def counting(self: ReuseKey, start: int, end: int):
        nonlocal calls
        calls += 1
        return real(self, start, end)

    ReuseKey.rows_key = counting  # type: ignore[method-assign]
    try:
        served = rig.serve(key(range(1000, 1000 + 256 * P)))  # 256 pages, a cut at each
    finally:
        ReuseKey.rows_key = real  # type: ignore[method-assign]
    assert [r for _, r in served.results] == ["saved"] * 256
    # one identity per page for the tree, one per entry's slot and one per entry when it is
    # observed moved past (a rescan at every cut would compare each entry at every later cut)
    assert calls == 256 + 256 + 256
    assert rig.store.stats().bytes == 256 * KVPP + LOGITS


LANE_OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 30),
                              st.integers(0, 3)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=LANE_OPS, invariant=st.booleans())
def test_interleaved_lanes_mark_no_later_than_a_rescan_and_alike_once_done(ops, invariant) -> None:
    """Lanes publishing in turn: an entry another lane adds below a cut a key's lookup ran past
    is moved past at once (the rescan waits for the key's next publish); no mark is ever missed,
    and once every lane is done the marks are the rescan's."""
    convs = [(1, 2, 3, 4, 5, 6, 7, 8) + (c % 3,) * 12 + tuple(range(c, c + 12)) for c in range(6)]
    rigs = (Rig(num_pages=400, invariant=invariant), rescanning(Rig(num_pages=400, invariant=invariant)))
    lanes: list[list] = []  # key, schedule, per rig [hit, pages], chunks left

    def step(lane: list) -> None:
        k, sched, held, chunks = lane
        end = chunks.pop(0)[1] if chunks else None  # None: a whole-prompt hit, nothing to run
        results = []
        for rig, h in zip(rigs, held if end is not None else ()):
            h[1] += rig.alloc.allocate(-(-end // P) - len(h[1]))
            if sched.is_cut(end):
                results.append(rig.store.publish(k, sched, end, h[1], rig.snapshot(end, sched.n),
                                                 prefilled_upto=end, restored=h[0]))
        assert results[:1] == results[1:]
        if not chunks:
            for rig, h in zip(rigs, held):
                if h[0] is not None:
                    rig.store.unpin(h[0])
                rig.alloc.decref(h[1])
            lanes.remove(lane)

    for start, c, n, s in ops:
        if start and len(lanes) < 3 or not lanes:
            k = key(convs[c][:n], ns="ab"[c % 2] if c > 3 else "")
            sched = plan_schedule(n, tuple(x for x in (5, 11, 17)[:s] if x < n), 4)
            held = []
            for rig in rigs:
                hit = rig.store.lookup(k, sched)
                pages = [] if hit is None else list(hit.pages)
                if hit is not None:
                    rig.store.pin(hit)
                    rig.alloc.incref(pages)
                    if hit.rows % P:  # copy-on-write of the shared partial page
                        rig.alloc.decref([pages[-1]])
                        pages[-1] = rig.alloc.allocate(1)[0]  # type: ignore[index]
                held.append([hit, pages])
            assert same(held[0][0]) == same(held[1][0])
            lanes.append([k, sched, held, sched.chunks(0 if held[0][0] is None else held[0][0].rows)])
        else:
            step(lanes[n % len(lanes)])
        for a, b in zip(marks(rigs[0]), marks(rigs[1])):
            assert a[:2] == b[:2] and (a[2] or not b[2]) and (a[3] or not b[3])
    while lanes:
        step(lanes[0])
    assert [m[:4] for m in marks(rigs[0])] == [m[:4] for m in marks(rigs[1])]
    for rig in rigs:
        rig.store.check_integrity()
