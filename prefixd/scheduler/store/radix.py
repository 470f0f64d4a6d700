"""The prefix store: a radix tree of KV pages keyed by reuse identity, with snapshots at cuts.

    root(namespace)
      └─ page 0: ids[0:P] + lookahead, images over them
           └─ page 1: ids[P:2P] + lookahead, images ──► entry at cut 2P (no tail page)
                ├─ page 2 (branch A) ──► entry at cut 2P+5: tail page holds rows [2P, 2P+5)
                └─ page 2' (branch B: same ids, another image)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.chunks import Schedule
from prefixd.scheduler.store import eviction
from prefixd.scheduler.store.allowance import Ledger
from prefixd.scheduler.store.announce import BlockStored, blocks_of
from prefixd.scheduler.store.cursor import Cursor
from prefixd.scheduler.store.entries import (CLEARED, REASONS, Entry, EntryInfo, Eviction, Hit,
                                             Node, Snapshot, StoreStats)
from prefixd.scheduler.store.entries import REPLACED as REPLACED_REASON
from prefixd.scheduler.store.identity import ReuseKey
from prefixd.scheduler.store.probe import Probe, longest_match
from prefixd.scheduler.store.recent import RecentPrompts
from prefixd.scheduler.store.tree import Tree

SAVED = "saved"  # kept
PRESENT = "present"  # an equal snapshot was already kept; nothing added
REPLACED = "replaced"  # kept in place of the restored ancestor it extends
SKIPPED = "skipped"  # does not fit the allowance; counted
REFUSED = "refused"  # cut past the prefilled rows (or its lookahead past the key); counted


class PrefixStore:
    """Radix pages + snapshots under a byte allowance.

    Each namespace has its own root, so no page or entry is shared across them.
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
        self._tree = Tree(self._ledger, page_size, invariant_rows, clock)
        self._pending: list[Eviction] = []
        self._evictions = {r: 0 for r in REASONS}
        self._hits = self._misses = self._query_tokens = self._hit_tokens = 0
        self._skipped = self._refused = 0
        self._recent = RecentPrompts(page_size)  # what earlier prompts kept, for `probe`
        # Called with (key, schedule, cut, pages, snapshot) after a publish keeps a snapshot
        # (SAVED or REPLACED): the disk tier writes it through. Must not change the store.
        self.on_keep: Callable[[ReuseKey, Schedule, int, Sequence[int], Snapshot], object] | None = None

    # ---- lookup -------------------------------------------------------------------------

    def lookup(self, key: ReuseKey, schedule: Schedule, *, count: bool = True) -> Hit | None:
        """The deepest usable resume point of `key`, or None (a miss).

        invariant_rows: any identity-equal row (full pages, or a snapshot's cut); otherwise
        only a snapshot at a cut of `schedule` whose schedule hash agrees. A hit at row n
        needs the snapshot's logits row; without it a row-invariant hit stops at n - 1.
        Counts a hit or a miss, marks entries the key moved past, touches the hit's entry.
        Takes no page reference: the caller increfs `hit.pages`. `count=False`: a second look
        for the same request (after the disk tier filled the store) counts nothing again.
        """
        n = len(key.tokens)
        if schedule.n != n:
            raise ValueError(f"lookup of a key of {n} rows with a schedule of {schedule.n}")
        cur = self._tree.cursor(key, schedule)
        path = self._tree.path(cur, n)
        best: Entry | None = None
        # ascending cuts: the schedule hashes of all of them cost one pass over the prompt
        for e in sorted(self._tree.prefix_entries(path, key), key=lambda e: e.cut):
            if self._usable(e, key, schedule, cur) and (best is None or e.cut > best.cut):
                best = e
        hit = self._hit_from(path, best, n)
        self._tree.observe(cur, moved_below=n)
        if not count:
            return hit
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

    def _usable(self, e: Entry, key: ReuseKey, schedule: Schedule, cur: Cursor) -> bool:
        if e.cut == len(key.tokens) and e.snapshot.logits is None:
            return False
        if self.invariant_rows:
            return True
        return schedule.is_cut(e.cut) and e.cut_hash == self._cut_hash(cur, e.cut)

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

    def probe(self, key: ReuseKey, schedule: Schedule) -> Probe:
        """Cache diagnostics for `key` (after its lookup): how far the tree holds its rows, by
        identity and whatever the chunking, and how many of them an earlier prompt in its
        namespace had kept (more than held now: they were evicted). Bounded work
        (`store.probe`); changes nothing the store decides."""
        cur = self._tree.cursor(key, schedule)
        path = self._tree.path(cur, len(key.tokens)) if self.invariant_rows else None  # the lookup's walk
        return Probe(longest_match(self._tree.roots, cur, self.page_size, path), self._recent.shared_kept(key))

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
        self._tree.observe(self._tree.cursor(key, None), moved_below=len(key.tokens))

    # ---- publish ------------------------------------------------------------------------

    def publish(self, key: ReuseKey, schedule: Schedule, cut: int, pages: Sequence[int],
                snapshot: Snapshot, *, prefilled_upto: int, restored: Hit | None = None) -> str:
        """Keep the rows [0, cut) of `key` and `snapshot` at `cut`.

        `pages` is the lane's page table (covers at least rows [0, cut)); the store increfs the
        pages it keeps. `prefilled_upto`: rows the lane's pass prefilled (or restored).
        Returns SAVED (also when an equal entry kept without a logits row takes this snapshot
        with one), PRESENT (an equal entry is kept; only its last use changes), REPLACED
        (dropped `restored`, a strict prefix, to fit), SKIPPED (does not fit, counted) or
        REFUSED (cut > prefilled_upto, counted). May evict other entries to fit. Raises
        ValueError when `cut` is not a cut of `schedule` in a family that is not row-invariant.
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
        cur = self._tree.cursor(key, schedule)
        node = self._tree.grow(cur, cut, pages)
        slot = (cut, key.rows_key(node.depth * P, cut), self._cut_hash(cur, cut))
        old = node.entries.get(slot)
        if old is not None:
            old.last_used = self._clock()
            gains_logits = old.snapshot.logits is None and snapshot.logits is not None
            result = self._overwrite(old, snapshot) if gains_logits else PRESENT
        else:
            entry = self._tree.attach(node, key, slot, pages[cut // P] if cut % P else None, snapshot)
            cur.pending.append(entry)
            result = self._fit(entry, key, restored)
        if result != SKIPPED:
            self._tree.observe(cur, moved_below=cut)
            self._recent.kept(key, cut)
        if result in (SAVED, REPLACED) and self.on_keep is not None:
            self.on_keep(key, schedule, cut, pages, snapshot)
        return result

    def _fit(self, entry: Entry, key: ReuseKey, restored: Hit | None) -> str:
        if self._ledger.bytes <= self.budget_bytes:
            return SAVED
        victims = eviction.plan_to_budget(self._ledger, self._tree.entries.values(),
                                          self.budget_bytes, entry)
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
        self._tree.detach(entry)
        self._skipped += 1
        return SKIPPED

    def _overwrite(self, old: Entry, snapshot: Snapshot) -> str:
        """An equal entry kept without a logits row takes the new snapshot that has one."""
        prev, old.snapshot = old.snapshot, snapshot
        self._ledger.extra_bytes += snapshot.nbytes - prev.nbytes
        if self._ledger.bytes <= self.budget_bytes:
            return SAVED
        victims = eviction.plan_to_budget(self._ledger, self._tree.entries.values(),
                                          self.budget_bytes, old)
        if victims is not None:
            for v in victims:
                self._evict(v, "budget")
            return SAVED
        old.snapshot = prev
        self._ledger.extra_bytes -= snapshot.nbytes - prev.nbytes
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
        go; returns the number of pages freed. Entries that free pages only together go
        together, in order (see `eviction.next_for_pages`)."""
        freed = 0
        while self.allocator.num_free < num_pages:
            victims = eviction.next_for_pages(self._ledger, self._tree.entries.values())
            if not victims:
                break
            for v in victims:
                freed += len(self._evict(v, "pages"))
        return freed

    def set_budget(self, budget_bytes: int) -> None:
        """Change the allowance, evicting down to it (as far as unpinned entries allow)."""
        self.budget_bytes = budget_bytes
        for v in eviction.plan_to_budget(self._ledger, self._tree.entries.values(), budget_bytes,
                                         partial=True) or []:
            self._evict(v, "budget")

    def clear(self) -> int:
        """Drop every unpinned entry; returns pages freed."""
        freed = 0
        for e in eviction.candidates(self._tree.entries.values()):
            freed += len(self._evict(e, "clear", reason=CLEARED))
        return freed

    def drain_evictions(self) -> list[Eviction]:
        """The evictions since the last drain, in order (the engine feeds metrics from them)."""
        out, self._pending = self._pending, []
        return out

    def _evict(self, e: Entry, trigger: str, reason: str | None = None) -> list[int]:
        reason = reason or eviction.reason_of(e)
        before = self._ledger.bytes
        freed = self._tree.detach(e)
        self._evictions[reason] += 1
        self._pending.append(Eviction(e.namespace, e.cut, reason, trigger,
                                      before - self._ledger.bytes, tuple(freed)))
        return freed

    def _cut_hash(self, cur: Cursor, cut: int) -> bytes:
        if self.invariant_rows:
            return b""  # row-invariant rows do not depend on the schedule
        return cur.cut_hash(cut)

    # ---- reporting -----------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """Running totals: costs the same however much the store holds."""
        return StoreStats(bytes=self._ledger.bytes, budget_bytes=self.budget_bytes, entries=len(self._tree.entries),
                          pages=len(self._ledger.refs), hits=self._hits, misses=self._misses,
                          query_tokens=self._query_tokens, hit_tokens=self._hit_tokens,
                          evictions=dict(self._evictions), skipped_saves=self._skipped,
                          refused_keeps=self._refused)

    def exclusive_bytes(self) -> int:
        """Bytes no lane shares now: what evicting everything would give back. Walks every
        page the store holds (lanes change refcounts without telling the store)."""
        return self._ledger.exclusive_bytes

    def describe(self) -> list[EntryInfo]:
        """Every entry in creation order, with the bytes it alone holds."""
        shadow = eviction.Shadow(self._ledger)
        return [EntryInfo(e.namespace, e.cut, shadow.release(e).nbytes, e.hits, e.pins > 0,
                          e.moved_past, e.shared) for e in self._tree.entries.values()]

    def announce_to(self, announcer: Any) -> None:
        """Tell `announcer` (store/announce.py) of every page and snapshot from now on; the
        store must be empty (what it held before would never be announced)."""
        if self._tree.entries:
            raise RuntimeError("announce_to on a store that already holds entries")
        self._tree.listener = announcer

    def kv_blocks(self, *, snapshots: bool) -> list[BlockStored]:
        """Every block the store holds now, as KV events announce them (computed afresh)."""
        return blocks_of(self._tree.roots, self.page_size, snapshots=snapshots)

    def check_integrity(self) -> None:
        """Raise RuntimeError if page references, byte totals or tree counts disagree."""
        from prefixd.scheduler.store.integrity import check

        check(self.page_size, self._tree, self._ledger)
