"""Eviction order and what evicting an entry gives back.

Order (an entry is a snapshot at a cut; its pages go when no entry below them and no lane
holds them):
  1. never: a pinned entry (a running request's resume source), or one whose release would
     drop a page a lane holds;
  2. first: entries whose conversation moved past them;
  3. then never-hit before hit;
  4. then least recently used (creation order breaks ties);
  5. last: shared cuts, prefixes several conversations used.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from prefixd.scheduler.store.allowance import Ledger
from prefixd.scheduler.store.entries import LRU, MOVED_PAST, NEVER_HIT, SHARED, Entry, Node


def order_key(e: Entry) -> tuple:
    """Sort key: the first entry in sorted order goes first."""
    return (e.shared, not e.moved_past, e.hits > 0, e.last_used, e.seq)


def reason_of(e: Entry) -> str:
    if e.shared:
        return SHARED
    if e.moved_past:
        return MOVED_PAST
    return NEVER_HIT if e.hits == 0 else LRU


@dataclass(frozen=True, slots=True)
class Release:
    """What removing one entry drops, given the state it was computed against."""

    entry: Entry
    pruned: tuple[Node, ...]  # nodes left with no entry below them, deepest first
    dropped_pages: tuple[int, ...]  # pages the store stops holding
    nbytes: int  # bytes the store's accounting drops
    lane_held: bool  # a dropped page is also held by a lane


class Shadow:
    """Pending removals layered over the real tree and ledger, to plan before evicting."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.page_uses: Counter[int] = Counter()  # uses removed per page
        self.below: Counter[int] = Counter()  # entries removed below each node (by id)

    def release(self, e: Entry) -> Release:
        """What removing `e` would drop now, without changing anything."""
        uses: list[int] = [] if e.tail_page is None else [e.tail_page]
        pruned: list[Node] = []
        node: Node | None = e.node
        while node is not None and node.page is not None:
            if node.num_entries_below - self.below[id(node)] - 1 > 0:
                break
            pruned.append(node)
            uses.append(node.page)
            node = node.parent
        dropped = [p for p, k in Counter(uses).items()
                   if self.ledger.refs[p] - self.page_uses[p] - k == 0]
        lane = any(self.ledger.lane_held(p) for p in dropped)
        nbytes = e.snapshot.nbytes + len(dropped) * self.ledger.kv_bytes_per_page
        return Release(e, tuple(pruned), tuple(dropped), nbytes, lane)

    def commit(self, r: Release) -> None:
        if r.entry.tail_page is not None:
            self.page_uses[r.entry.tail_page] += 1
        node: Node | None = r.entry.node
        while node is not None:
            self.below[id(node)] += 1
            node = node.parent
        for n in r.pruned:
            self.page_uses[n.page] += 1  # type: ignore[index]


def candidates(entries: Iterable[Entry], exclude: Entry | None = None) -> list[Entry]:
    """Unpinned entries in eviction order."""
    return sorted((e for e in entries if e.pins == 0 and e is not exclude), key=order_key)


def plan_to_budget(ledger: Ledger, entries: Iterable[Entry], budget_bytes: int,
                   exclude: Entry | None = None, *, partial: bool = False) -> list[Entry] | None:
    """Victims, in order, that bring the store's bytes within `budget_bytes`. When evicting
    every eligible entry would not: None, or with `partial` every eligible entry.

    An entry whose removal would drop no bytes yet (an interior cut with an empty snapshot)
    waits for a later pass, after the entries below it have gone.
    """
    over = ledger.bytes - budget_bytes
    if over <= 0:
        return []
    shadow = Shadow(ledger)
    victims: list[Entry] = []
    waiting = candidates(entries, exclude)
    while waiting:
        deferred: list[Entry] = []
        for e in waiting:
            r = shadow.release(e)
            if r.lane_held or r.nbytes == 0:
                deferred.append(e)
                continue
            shadow.commit(r)
            victims.append(e)
            over -= r.nbytes
            if over <= 0:
                return victims
        if len(deferred) == len(waiting):
            break
        waiting = deferred
    return victims if partial else None


def next_for_pages(ledger: Ledger, entries: Iterable[Entry]) -> list[Entry]:
    """The next victims, in eviction order, that return a page to the allocator.

    The first entry whose removal alone frees a page; when none does (entries that hold a
    page only together, e.g. two cuts sharing a tail page), the entries in order, counted
    together, up to the first whose removal with those before it frees a page. Entries whose
    release would drop a page a lane holds are passed over. [] when nothing frees a page.
    """
    order = candidates(entries)
    shadow = Shadow(ledger)
    for e in order:
        r = shadow.release(e)
        if not r.lane_held and r.dropped_pages:
            return [e]
    group: list[Entry] = []
    for e in order:
        r = shadow.release(e)
        if r.lane_held:
            continue
        shadow.commit(r)
        group.append(e)
        if r.dropped_pages:
            return group
    return []
