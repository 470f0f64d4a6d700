"""The radix tree of the prefix store: one node per full page, entries hung at cuts.

A node's key is the identity of its rows and, for a family that is not row-invariant, how
they were chunked (`Schedule.chunk_key`): pages computed under other chunks are siblings.

Every node keeps at least one entry at or below it; a node left with none is pruned and
its page released. Namespace and frame select separate roots, so nothing is shared across
them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

from prefixd.scheduler.planner import Schedule
from prefixd.scheduler.store.allowance import Ledger
from prefixd.scheduler.store.entries import Entry, Node, Snapshot
from prefixd.scheduler.store.identity import ReuseKey, agrees_from


class Tree:
    def __init__(self, ledger: Ledger, page_size: int, invariant_rows: bool,
                 clock: Callable[[], float]) -> None:
        self.ledger = ledger
        self.invariant_rows = invariant_rows
        self.page_size = page_size
        self.clock = clock
        self.roots: dict[tuple[str, int], Node] = {}
        self.entries: dict[int, Entry] = {}  # by seq, in creation order
        self.seq = 0

    def path(self, key: ReuseKey, upto: int, schedule: Schedule) -> list[Node]:
        """The key's root and the nodes of its full pages below `upto` (their lookahead inside
        the key) chunked as `schedule` chunks them, as far as the tree has them; [] when the
        key's root does not exist."""
        node = self.roots.get((key.namespace, key.frame))
        if node is None:
            return []
        path, P = [node], self.page_size
        while (node.depth + 1) * P <= upto and key.has_rows((node.depth + 1) * P):
            end = (node.depth + 1) * P
            child = node.children.get(key.rows_key(end - P, end), {}).get(self._chunks(schedule, end))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def same_rows(self, key: ReuseKey, upto: int) -> list[Node]:
        """Every node whose rows (and lookahead) are identity-equal to the key's below `upto`,
        however they were chunked."""
        root = self.roots.get((key.namespace, key.frame))
        out, level, P = [], [] if root is None else [root], self.page_size
        while level:
            out += level
            end = (level[0].depth + 1) * P
            if end > upto or not key.has_rows(end):
                break
            rk = key.rows_key(end - P, end)
            level = [c for n in level for c in n.children.get(rk, {}).values()]
        return out

    def grow(self, key: ReuseKey, cut: int, pages: Sequence[int], schedule: Schedule) -> Node:
        """The node of the key's last full page below `cut`, creating missing nodes on the
        lane's `pages` (with no entry yet: the caller attaches one or prunes)."""
        node = self.roots.setdefault((key.namespace, key.frame), Node(0, None, None, None))
        P = self.page_size
        while (node.depth + 1) * P <= cut:
            end = (node.depth + 1) * P
            nk = (key.rows_key(end - P, end), self._chunks(schedule, end))
            variants = node.children.setdefault(nk[0], {})
            child = variants.get(nk[1])
            if child is None:
                child = Node(node.depth + 1, nk, pages[node.depth], node)
                self.ledger.hold(pages[node.depth])
                variants[nk[1]] = child
            node = child
        return node

    def _chunks(self, schedule: Schedule, end: int) -> tuple:
        # a family that is not row-invariant shares a page only between equal chunkings
        return () if self.invariant_rows else schedule.chunk_key(end)

    def attach(self, node: Node, key: ReuseKey, slot: tuple, tail_page: int | None,
               snapshot: Snapshot) -> Entry:
        self.seq += 1
        e = Entry(node=node, cut=slot[0], tail=slot[1], tail_page=tail_page, cut_hash=slot[2],
                  snapshot=snapshot, namespace=key.namespace, frame=key.frame, seq=self.seq,
                  last_used=self.clock(), continuation=key)
        node.entries[slot] = e
        if tail_page is not None:
            self.ledger.hold(tail_page)
        self.ledger.extra_bytes += snapshot.nbytes
        self.entries[e.seq] = e
        walk: Node | None = node
        while walk is not None:
            walk.num_entries_below += 1
            walk = walk.parent
        return e

    def detach(self, e: Entry) -> list[int]:
        """Remove `e` and prune nodes left with no entry below them; returns pages freed."""
        if not e.attached:
            raise RuntimeError(f"entry at cut {e.cut} removed twice")
        e.attached = False
        del e.node.entries[e.slot]
        del self.entries[e.seq]
        self.ledger.extra_bytes -= e.snapshot.nbytes
        freed = [] if e.tail_page is None else self.ledger.release(e.tail_page)
        walk: Node | None = e.node
        while walk is not None:
            walk.num_entries_below -= 1
            walk = walk.parent
        return freed + self.prune(e.node)

    def prune(self, node: Node) -> list[int]:
        """Drop `node` and its ancestors while they keep no entry; returns pages freed."""
        freed: list[int] = []
        while node.parent is not None and node.num_entries_below == 0:
            rk, ck = node.key  # type: ignore[misc]
            variants = node.parent.children[rk]
            del variants[ck]
            if not variants:
                del node.parent.children[rk]
            freed += self.ledger.release(node.page)  # type: ignore[arg-type]
            node = node.parent
        if node.parent is None and node.num_entries_below == 0:
            self.roots = {k: r for k, r in self.roots.items() if r is not node}
        return freed

    def prefix_entries(self, nodes: Iterable[Node], key: ReuseKey) -> Iterator[Entry]:
        """Entries on `nodes` whose rows (and lookahead) are identity-equal to the key's."""
        for node in nodes:
            for e in list(node.entries.values()):
                if key.has_rows(e.cut) and key.rows_key(node.depth * self.page_size, e.cut) == e.tail:
                    yield e

    def observe(self, key: ReuseKey, moved_below: int) -> None:
        """`key` is its conversation's latest: entries of its identity with a cut below
        `moved_below` are moved past, and cuts it diverges from after them are shared."""
        for e in self.prefix_entries(self.same_rows(key, moved_below), key):
            if e.cut < moved_below:
                e.moved_past = True
            cont = e.continuation
            if cont is None or (agrees_from(cont, key, e.cut) and len(key.tokens) > len(cont.tokens)):
                e.continuation = key
            elif not agrees_from(cont, key, e.cut):
                e.shared = True
