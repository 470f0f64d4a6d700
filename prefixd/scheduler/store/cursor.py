"""A request's place in the tree, kept between its lookup and its publishes.

A request publishes at every cut of its prompt; walking the tree from the root at each
cut would cost the whole prompt per cut. A cursor remembers, for one key, the identity of
its pages, its path under its own schedule, the nodes of every chunking of its rows and
how far the key has been observed, so each call only does the work of the rows it adds.
The tree logs the nodes other keys change; a cursor replays that log when it is next used.
"""

from __future__ import annotations

from prefixd.scheduler.chunks import CutHasher, Schedule
from prefixd.scheduler.store.entries import Entry, Node
from prefixd.scheduler.store.identity import ReuseKey, RowsKey


class Cursor:
    def __init__(self, key: ReuseKey, schedule: Schedule | None, page_size: int,
                 invariant_rows: bool, log_at: int) -> None:
        self.key = key
        self.schedule = schedule
        self.page_size = page_size
        self.invariant_rows = invariant_rows
        self._rows: list[RowsKey] = []  # identity of page i: rows [iP, iP+P) and lookahead
        self._chunks: list[tuple] = []  # chunk key of page i under `schedule`
        self.path: list[Node] = []  # root, then the key's pages chunked as `schedule`
        self.levels: list[list[Node]] = []  # nodes at depth d with the key's rows, any chunking
        self.member: set[int] = set()  # ids of the nodes in `levels`
        self.observed = -1  # the deepest moved_below observed (-1: levels not built)
        self.pending: list[Entry] = []  # own entries not yet observed past
        self.log_at = log_at  # position in the tree's change log replayed so far
        self.hasher: CutHasher | None = None

    def rows(self, i: int) -> RowsKey:
        """Identity of the key's page i (rows [iP, iP+P) and the lookahead past them)."""
        while len(self._rows) <= i:
            j = len(self._rows)
            self._rows.append(self.key.rows_key(j * self.page_size, (j + 1) * self.page_size))
        return self._rows[i]

    def chunks(self, i: int) -> tuple:
        """Chunk key of page i: () for a row-invariant family."""
        if self.invariant_rows:
            return ()
        assert self.schedule is not None
        while len(self._chunks) <= i:
            self._chunks.append(self.schedule.chunk_key((len(self._chunks) + 1) * self.page_size))
        return self._chunks[i]

    def cut_hash(self, cut: int) -> bytes:
        if self.hasher is None:
            assert self.schedule is not None
            k = self.key
            self.hasher = CutHasher(k.tokens, self.schedule.starts, self.schedule.grid,
                                    namespace=k.namespace, images=k.images)
        return self.hasher.at(cut)

    def trim_path(self) -> None:
        """Drop pruned nodes from the end of the path (a node outlives none of its children)."""
        while self.path and not self.path[-1].alive:
            self.path.pop()

    def add_level_node(self, node: Node) -> bool:
        """Take `node` into the levels when it carries the key's rows under a known node."""
        d = node.depth
        if id(node) in self.member or d >= len(self.levels) or node.parent is None:
            return id(node) in self.member
        if id(node.parent) not in self.member or not self.key.has_rows(d * self.page_size):
            return False
        if node.key is None or node.key[0] != self.rows(d - 1):
            return False
        self.levels[d].append(node)
        self.member.add(id(node))
        return True
