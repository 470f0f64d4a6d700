"""The prefix store: a radix tree of KV pages keyed by reuse identity, with snapshots at cuts.

    root(namespace, frame)
      └─ page 0: ids[0:P] + lookahead, images over them
           └─ page 1: ids[P:2P] + lookahead, images ──► entry at cut 2P (no tail page)
                ├─ page 2 (branch A) ──► entry at cut 2P+5: tail page holds rows [2P, 2P+5)
                └─ page 2' (branch B: same ids, another image)
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.planner import Schedule, cut_hash
from prefixd.scheduler.store import eviction
from prefixd.scheduler.store.allowance import Ledger
from prefixd.scheduler.store.entries import (CLEARED, REASONS, Entry, Eviction, Hit, Node,
                                             Snapshot, StoreStats)
from prefixd.scheduler.store.entries import REPLACED as REPLACED_REASON
from prefixd.scheduler.store.identity import ReuseKey, agrees_from

SAVED = "saved"  # kept
PRESENT = "present"  # an equal snapshot was already kept; nothing added
REPLACED = "replaced"  # kept in place of the restored ancestor it extends
SKIPPED = "skipped"  # does not fit the allowance; counted
REFUSED = "refused"  # cut past the prefilled rows (or its lookahead past the key); counted


class PrefixStore:
    """Radix pages + snapshots under a byte allowance.

    Namespace and frame select separate roots, so no page or entry is shared across them.
    Holds one allocator reference per page it keeps; never writes a page. Single-threaded.
    """

    def __init__(self, allocator: PageAllocator, *, page_size: int, kv_bytes_per_page: int,
                 budget_bytes: int, invariant_rows: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if page_size <= 0 or kv_bytes_per_page < 0 or budget_bytes < 0:
            raise ValueError("page_size must be positive, byte sizes non-negative")
        self.allocator = allocator
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        self.invariant_rows = invariant_rows
        self._clock = clock
        self._ledger = Ledger(allocator, kv_bytes_per_page)
        self._roots: dict[tuple[str, int], Node] = {}
        self._entries: list[Entry] = []
        self._seq = 0
        self._pending: list[Eviction] = []
        self._evictions = {r: 0 for r in REASONS}
        self._hits = self._misses = self._query_tokens = self._hit_tokens = 0
        self._skipped = self._refused = 0

    # ---- lookup -------------------------------------------------------------------------

    def lookup(self, key: ReuseKey, schedule: Schedule) -> Hit | None:
        """The deepest usable resume point of `key`, or None (a miss).

        invariant_rows: any identity-equal row (full pages, or a snapshot's cut); otherwise
        only a snapshot at a cut of `schedule` whose schedule hash agrees. A hit at row n
        needs the snapshot's logits row; without it a row-invariant hit stops at n - 1.
        Counts a hit or a miss, marks entries the key moved past, touches the hit's entry.
        Takes no page reference: the caller increfs `hit.pages`.
        """
        n = len(key.tokens)
        path = self._path(key, n)
        best: Entry | None = None
        for e in self._prefix_entries(path, key):
            if self._usable(e, key, schedule) and (best is None or e.cut > best.cut):
                best = e
        hit = self._hit_from(path, best, n)
        self._observe(path, key, moved_below=n)
        self._query_tokens += n
        if hit is None:
            self._misses += 1
            return None
        self._hits += 1
        self._hit_tokens += hit.rows
        if best is not None and hit.source is best:
            best.hits += 1
            best.last_used = self._clock()
        return hit

    def _usable(self, e: Entry, key: ReuseKey, schedule: Schedule) -> bool:
        if e.cut == len(key.tokens) and e.snapshot.logits is None:
            return False
        if self.invariant_rows:
            return True
        return schedule.is_cut(e.cut) and e.cut_hash == self._cut_hash(key, schedule, e.cut)

    def _hit_from(self, path: list[Node], best: Entry | None, n: int) -> Hit | None:
        page_rows = 0
        if self.invariant_rows:
            page_rows = min((len(path) - 1) * self.page_size, n - 1)
        if best is not None and best.cut >= page_rows:
            tail = () if best.tail_page is None else (best.tail_page,)
            pages = tuple(nd.page for nd in path[1:best.node.depth + 1]) + tail
            return Hit(best.cut, pages, best.snapshot, best)  # type: ignore[arg-type]
        if page_rows <= 0:
            return None
        num = -(-page_rows // self.page_size)
        return Hit(page_rows, tuple(nd.page for nd in path[1:num + 1]), None, None)  # type: ignore[misc]

    def pin(self, hit: Hit) -> None:
        """Keep the hit's entry from eviction while a running request resumes from it."""
        if isinstance(hit.source, Entry):
            hit.source.pins += 1

    def unpin(self, hit: Hit) -> None:
        if isinstance(hit.source, Entry):
            if hit.source.pins <= 0:
                raise RuntimeError(f"unpin of an entry at cut {hit.source.cut} that is not pinned")
            hit.source.pins -= 1

    def note_latest(self, key: ReuseKey) -> None:
        """The conversation's latest prompt is `key` (e.g. a resident continuation that did not
        look up): entries it runs past are marked moved past, and cuts it diverges from shared."""
        self._observe(self._path(key, len(key.tokens)), key, moved_below=len(key.tokens))

    # ---- publish ------------------------------------------------------------------------

    def publish(self, key: ReuseKey, schedule: Schedule, cut: int, pages: Sequence[int],
                snapshot: Snapshot, *, prefilled_upto: int, restored: Hit | None = None) -> str:
        """Keep the rows [0, cut) of `key` and `snapshot` at `cut`.

        `pages` is the lane's page table (covers at least rows [0, cut)); the store increfs the
        pages it keeps. `prefilled_upto`: rows the lane's pass prefilled (or restored).
        Returns SAVED, PRESENT, REPLACED (dropped `restored`, a strict prefix, to fit),
        SKIPPED (does not fit, counted) or REFUSED (cut > prefilled_upto, counted). May evict
        other entries to fit. Raises ValueError when `cut` is not a cut of `schedule` in a
        family that is not row-invariant.
        """
        n, P = len(key.tokens), self.page_size
        if schedule.n != n or not 0 < cut <= n or len(pages) < -(-cut // P):
            raise ValueError(f"publish at cut {cut}: schedule of {schedule.n} rows, key of {n}, "
                             f"{len(pages)} pages")
        if not self.invariant_rows and not schedule.is_cut(cut):
            raise ValueError(f"row {cut} is not a cut of the request's schedule {schedule.cuts}")
        if cut > prefilled_upto or not key.has_rows(cut):
            self._refused += 1
            return REFUSED
        node = self._grow(key, cut, pages)
        slot = (cut, key.rows_key(node.depth * P, cut), self._cut_hash(key, schedule, cut))
        if slot in node.entries:
            node.entries[slot].last_used = self._clock()
            result = PRESENT
        else:
            entry = self._attach(node, key, slot, pages[cut // P] if cut % P else None, snapshot)
            result = self._fit(entry, key, restored)
        if result != SKIPPED:
            self._observe(self._path(key, cut), key, moved_below=cut)
        return result

    def _fit(self, entry: Entry, key: ReuseKey, restored: Hit | None) -> str:
        if self._ledger.bytes <= self.budget_bytes:
            return SAVED
        victims = eviction.plan_to_budget(self._ledger, self._entries, self.budget_bytes, entry)
        if victims is not None:
            for v in victims:
                self._evict(v, "budget")
            return SAVED
        anc = restored.source if restored is not None else None
        if isinstance(anc, Entry) and anc.attached and self._extends(entry, anc, key):
            r = eviction.Shadow(self._ledger).release(anc)
            if self._ledger.bytes - r.nbytes <= self.budget_bytes:
                self._evict(anc, "publish", reason=REPLACED_REASON)
                return REPLACED
        self._detach(entry)
        self._skipped += 1
        return SKIPPED

    def _extends(self, entry: Entry, anc: Entry, key: ReuseKey) -> bool:
        """True when `anc` is a strict prefix of `entry` (made from `key`) under one identity."""
        if anc.cut >= entry.cut:
            return False
        node: Node | None = entry.node
        while node is not None and node is not anc.node:
            node = node.parent
        if node is None:
            return False
        return key.rows_key(anc.node.depth * self.page_size, anc.cut) == anc.tail

    # ---- eviction and allowance ----------------------------------------------------------

    def make_room(self, num_pages: int) -> int:
        """Evict in eviction order until the allocator has `num_pages` free or nothing more can
        go; returns the number of pages freed."""
        freed = 0
        while self.allocator.num_free < num_pages:
            victim = eviction.next_for_pages(self._ledger, self._entries)
            if victim is None:
                break
            freed += len(self._evict(victim, "pages"))
        return freed

    def set_budget(self, budget_bytes: int) -> None:
        """Change the allowance, evicting down to it (as far as unpinned entries allow)."""
        self.budget_bytes = budget_bytes
        victims = eviction.plan_to_budget(self._ledger, self._entries, budget_bytes)
        for v in victims if victims is not None else []:
            self._evict(v, "budget")

    def clear(self) -> int:
        """Drop every unpinned entry; returns pages freed."""
        freed = 0
        for e in eviction.candidates(self._entries):
            freed += len(self._evict(e, "clear", reason=CLEARED))
        return freed

    def drain_evictions(self) -> list[Eviction]:
        """The evictions since the last drain, in order (the engine feeds metrics from them)."""
        out, self._pending = self._pending, []
        return out

    def _evict(self, e: Entry, trigger: str, reason: str | None = None) -> list[int]:
        reason = reason or eviction.reason_of(e)
        before = self._ledger.bytes
        freed = self._detach(e)
        self._evictions[reason] += 1
        self._pending.append(Eviction(e.namespace, e.frame, e.cut, reason, trigger,
                                      before - self._ledger.bytes, tuple(freed)))
        return freed

    # ---- tree ----------------------------------------------------------------------------

    def _path(self, key: ReuseKey, upto: int) -> list[Node]:
        """The root and the nodes of the key's full pages whose rows (and lookahead) lie below
        `upto` and inside the key, as far as the tree has them."""
        node = self._roots.get((key.namespace, key.frame))
        if node is None:
            return []
        path, P = [node], self.page_size
        while (node.depth + 1) * P <= upto and key.has_rows((node.depth + 1) * P):
            child = node.children.get(key.rows_key(node.depth * P, (node.depth + 1) * P))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _grow(self, key: ReuseKey, cut: int, pages: Sequence[int]) -> Node:
        """The node of the key's last full page below `cut`, creating missing nodes (with no
        entries yet: the caller attaches one or prunes)."""
        node = self._roots.setdefault((key.namespace, key.frame), Node(0, None, None, None))
        P = self.page_size
        while (node.depth + 1) * P <= cut:
            rk = key.rows_key(node.depth * P, (node.depth + 1) * P)
            child = node.children.get(rk)
            if child is None:
                child = Node(node.depth + 1, rk, pages[node.depth], node)
                self._ledger.hold(pages[node.depth])
                node.children[rk] = child
            node = child
        return node

    def _attach(self, node: Node, key: ReuseKey, slot: tuple, tail_page: int | None,
                snapshot: Snapshot) -> Entry:
        self._seq += 1
        e = Entry(node=node, cut=slot[0], tail=slot[1], tail_page=tail_page, cut_hash=slot[2],
                  snapshot=snapshot, namespace=key.namespace, frame=key.frame, seq=self._seq,
                  last_used=self._clock(), continuation=key)
        node.entries[slot] = e
        if tail_page is not None:
            self._ledger.hold(tail_page)
        self._ledger.extra_bytes += snapshot.nbytes
        self._entries.append(e)
        walk: Node | None = node
        while walk is not None:
            walk.num_entries_below += 1
            walk = walk.parent
        return e

    def _detach(self, e: Entry) -> list[int]:
        """Remove `e`, prune nodes left with no entry below them; returns pages freed."""
        if not e.attached:
            raise RuntimeError(f"entry at cut {e.cut} removed twice")
        e.attached = False
        del e.node.entries[e.slot]
        self._entries.remove(e)
        self._ledger.extra_bytes -= e.snapshot.nbytes
        freed = [] if e.tail_page is None else self._ledger.release(e.tail_page)
        walk: Node | None = e.node
        while walk is not None:
            walk.num_entries_below -= 1
            walk = walk.parent
        return freed + self._prune(e.node)

    def _prune(self, node: Node) -> list[int]:
        freed: list[int] = []
        while node.parent is not None and node.num_entries_below == 0:
            del node.parent.children[node.key]  # type: ignore[arg-type]
            freed += self._ledger.release(node.page)  # type: ignore[arg-type]
            node = node.parent
        if node.parent is None and node.num_entries_below == 0:
            self._roots = {k: r for k, r in self._roots.items() if r is not node}
        return freed

    def _prefix_entries(self, path: list[Node], key: ReuseKey) -> Iterator[Entry]:
        """Entries on the path whose rows (and lookahead) are identity-equal to the key's."""
        for node in path:
            for e in list(node.entries.values()):
                if key.has_rows(e.cut) and key.rows_key(node.depth * self.page_size, e.cut) == e.tail:
                    yield e

    def _observe(self, path: list[Node], key: ReuseKey, moved_below: int) -> None:
        """Mark entries `key` runs past as moved past, and cuts it diverges from as shared."""
        for e in self._prefix_entries(path, key):
            if e.cut < moved_below:
                e.moved_past = True
            cont = e.continuation
            if cont is None or (agrees_from(cont, key, e.cut) and len(key.tokens) > len(cont.tokens)):
                e.continuation = key
            elif not agrees_from(cont, key, e.cut):
                e.shared = True

    def _cut_hash(self, key: ReuseKey, schedule: Schedule, cut: int) -> bytes:
        if self.invariant_rows:
            return b""  # row-invariant rows do not depend on the schedule
        return cut_hash(key.tokens, schedule.starts, schedule.grid, cut, namespace=key.namespace,
                        frame=key.frame, images=key.images)

    # ---- reporting -----------------------------------------------------------------------

    def stats(self) -> StoreStats:
        return StoreStats(bytes=self._ledger.bytes, exclusive_bytes=self._ledger.exclusive_bytes,
                          budget_bytes=self.budget_bytes, entries=len(self._entries),
                          pages=len(self._ledger.refs), hits=self._hits, misses=self._misses,
                          query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
                          evictions=dict(self._evictions), skipped_saves=self._skipped,
                          refused_keeps=self._refused)

    def check_integrity(self) -> None:
        """Raise RuntimeError if page references, byte totals or tree counts disagree."""
        from prefixd.scheduler.store.integrity import check

        check(self, self._roots, self._entries, self._ledger)
