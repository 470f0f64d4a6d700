"""The radix tree of the prefix store: one node per full page, entries hung at cuts.

A node's key is the identity of its rows and, for a family that is not row-invariant, how
they were chunked (`Schedule.chunk_key`): pages computed under other chunks are siblings.

Every node keeps at least one entry at or below it; a node left with none is pruned and
its page released. Each namespace has its own root, so nothing is shared across them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Sequence

from prefixd.scheduler.chunks import Schedule
from prefixd.scheduler.store.allowance import Ledger
from prefixd.scheduler.store.cursor import Cursor
from prefixd.scheduler.store.entries import Entry, Node, Snapshot
from prefixd.scheduler.store.identity import ReuseKey, agrees_from

Treat = Callable[[Entry, int], None]

MAX_CURSORS = 64  # keys whose place in the tree is remembered (one per running request)
MAX_LOG = 1 << 14  # change log length before its older half is dropped


class Tree:
    def __init__(self, ledger: Ledger, page_size: int, invariant_rows: bool,
                 clock: Callable[[], float]) -> None:
        self.ledger = ledger
        self.invariant_rows = invariant_rows
        self.page_size = page_size
        self.clock = clock
        self.roots: dict[str, Node] = {}  # by namespace
        self.entries: dict[int, Entry] = {}  # by seq, in creation order
        self.seq = 0
        self.cursors: OrderedDict[int, Cursor] = OrderedDict()  # by id(key)
        self.log: list[Node] = []  # nodes created, given an entry or a new continuation
        self.log_base = 0  # log positions dropped from the front
        # told of every page node made and pruned and every entry attached and detached
        # (store/announce.py: Announcer); must not change the tree
        self.listener: Any = None

    def cursor(self, key: ReuseKey, schedule: Schedule | None) -> Cursor:
        """The cursor of `key` (under `schedule`, when given), made on first use."""
        cur = self.cursors.get(id(key))
        if cur is not None and cur.key is key and (schedule is None or cur.schedule is schedule
                                                   or cur.schedule == schedule):
            self.cursors.move_to_end(id(key))
            return cur
        if cur is not None and cur.schedule is not None and schedule is None:
            schedule = cur.schedule
        cur = Cursor(key, schedule, self.page_size, self.invariant_rows, self.log_end)
        self.cursors[id(key)] = cur
        self.cursors.move_to_end(id(key))
        while len(self.cursors) > MAX_CURSORS:
            self.cursors.popitem(last=False)
        return cur

    @property
    def log_end(self) -> int:
        return self.log_base + len(self.log)

    def _logged(self, node: Node) -> None:
        self.log.append(node)
        if len(self.log) > MAX_LOG:
            half = len(self.log) // 2
            del self.log[:half]
            self.log_base += half

    def path(self, cur: Cursor, upto: int) -> list[Node]:
        """The key's root and the nodes of its full pages below `upto` (their lookahead inside
        the key) chunked as its schedule chunks them, as far as the tree has them; [] when the
        key's root does not exist."""
        cur.trim_path()
        if not cur.path:
            root = self.roots.get(cur.key.namespace)
            if root is None:
                return []
            cur.path.append(root)
        path, P = cur.path, self.page_size
        node = path[-1]
        while (node.depth + 1) * P <= upto and cur.key.has_rows((node.depth + 1) * P):
            child = node.children.get(cur.rows(node.depth), {}).get(cur.chunks(node.depth))
            if child is None:
                break
            path.append(child)
            node = child
        return path[:upto // P + 1]

    def grow(self, cur: Cursor, cut: int, pages: Sequence[int]) -> Node:
        """The node of the key's last full page below `cut`, creating missing nodes on the
        lane's `pages` (with no entry yet: the caller attaches one or prunes)."""
        key, P = cur.key, self.page_size
        path = self.path(cur, cut)
        if not path:
            root = Node(0, None, None, None)
            self.roots[key.namespace] = root
            cur.path.append(root)
            path = [root]
        node = path[-1]
        while (node.depth + 1) * P <= cut:
            nk = (cur.rows(node.depth), cur.chunks(node.depth))
            variants = node.children.setdefault(nk[0], {})
            child = variants.get(nk[1])
            if child is None:
                child = Node(node.depth + 1, nk, pages[node.depth], node)
                self.ledger.hold(pages[node.depth])
                variants[nk[1]] = child
                self._logged(child)
                cur.add_level_node(child)
                if self.listener is not None:
                    self.listener.page_added(child, key.namespace)
            cur.path.append(child)
            node = child
        return node

    def attach(self, node: Node, key: ReuseKey, slot: tuple, tail_page: int | None,
               snapshot: Snapshot) -> Entry:
        self.seq += 1
        e = Entry(node=node, cut=slot[0], tail=slot[1], tail_page=tail_page, cut_hash=slot[2],
                  snapshot=snapshot, namespace=key.namespace, seq=self.seq,
                  last_used=self.clock(), continuation=key)
        node.entries[slot] = e
        if tail_page is not None:
            self.ledger.hold(tail_page)
        self.ledger.extra_bytes += snapshot.nbytes
        self.entries[e.seq] = e
        self._logged(node)
        if self.listener is not None:
            self.listener.snapshot_added(e)
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
        if self.listener is not None:
            self.listener.snapshot_dropped(e)
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
            node.alive = False
            if self.listener is not None:
                self.listener.page_dropped(node)
            node = node.parent
        if node.parent is None and node.num_entries_below == 0:
            node.alive = False
            self.roots = {k: r for k, r in self.roots.items() if r is not node}
        return freed

    def prefix_entries(self, nodes: Iterable[Node], key: ReuseKey) -> Iterator[Entry]:
        """Entries on `nodes` whose rows (and lookahead) are identity-equal to the key's."""
        for node in nodes:
            for e in list(node.entries.values()):
                if key.has_rows(e.cut) and key.rows_key(node.depth * self.page_size, e.cut) == e.tail:
                    yield e

    def observe(self, cur: Cursor, moved_below: int) -> None:
        """The cursor's key is its conversation's latest: entries of its identity with a cut
        below `moved_below` are moved past, and cuts it diverges from after them are shared.

        Work is done only for what changed since the key was last observed: nodes other keys
        logged, levels of rows not observed before, and the key's own new entries.
        """
        treat = self._treater(cur.key)
        P, key = self.page_size, cur.key
        if cur.log_at < self.log_base or (cur.levels and not cur.levels[0][0].alive):
            cur.observed = -1  # the log no longer reaches back, or the key's root was pruned
        if cur.observed < 0:
            root = self.roots.get(key.namespace)
            cur.levels, cur.member, cur.pending = [], set(), []
            if root is not None:
                cur.levels.append([root])
                cur.member.add(id(root))
            for level in cur.levels:
                self._treat_all(level, key, moved_below, treat)
            cur.observed = moved_below
        else:
            for node in self.log[cur.log_at - self.log_base:]:
                if node.alive and cur.add_level_node(node):
                    self._treat_all((node,), key, cur.observed, treat, skip=cur.pending)
        old = cur.observed
        top = max(old, moved_below)
        if not cur.levels and key.namespace in self.roots:  # a root made since
            root = self.roots[key.namespace]
            cur.levels.append([root])
            cur.member.add(id(root))
            self._treat_all((root,), key, top, treat, skip=cur.pending)
        while cur.levels and len(cur.levels) * P <= top and key.has_rows(len(cur.levels) * P):
            rk = cur.rows(len(cur.levels) - 1)
            level = [c for n in cur.levels[-1] if n.alive for c in n.children.get(rk, {}).values()]
            if not level:
                break
            cur.levels.append(level)
            cur.member.update(id(n) for n in level)
            self._treat_all(level, key, top, treat, skip=cur.pending)
        if moved_below > old:  # entries at cuts in [old, moved_below) are now moved past
            for level in cur.levels[old // P:moved_below // P + 1]:
                self._treat_all(level, key, moved_below, treat)
        cur.observed = top
        for e in cur.pending:
            if e.attached and e.cut < moved_below:
                treat(e, moved_below)
        cur.pending = [e for e in cur.pending if e.attached and e.cut >= moved_below]
        cur.log_at = self.log_end

    def _treat_all(self, nodes: Iterable[Node], key: ReuseKey, moved_below: int, treat: Treat,
                   skip: Sequence[Entry] = ()) -> None:
        for e in self.prefix_entries((n for n in nodes if n.alive), key):
            if e not in skip:
                treat(e, moved_below)

    def _treater(self, key: ReuseKey) -> Treat:
        """Observes one entry of the key's identity; compares the key with each continuation
        once (both agree below the entry's cut, so agreeing from it is agreeing from row 0)."""
        agree: dict[int, bool] = {}

        def treat(e: Entry, moved_below: int) -> None:
            if e.cut < moved_below:
                e.moved_past = True
            cont = e.continuation
            if cont is key:
                return
            ok = True
            if cont is not None:
                ok = agree.get(id(cont), None)  # type: ignore[assignment]
                if ok is None:
                    ok = agree[id(cont)] = agrees_from(cont, key, 0)
            if cont is None or (ok and len(key.tokens) > len(cont.tokens)):
                e.continuation = key
                self._logged(e.node)
            elif not ok:
                e.shared = True

        return treat
