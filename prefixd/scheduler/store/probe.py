"""How far a key agrees with what the tree holds, for cache diagnostics (never for serving).

`longest_match` walks the key's namespace by identity alone (any chunking), as far as the
tree has its full pages, then compares the key with the branches and entry tails where it
leaves the tree:

    root ── page 0 ── page 1 ──┬── page 2  ids 8..11 = key's      (followed)
                               │     └─ page 3: ids 12 13 [99] 15  key: 12 13 [40] ...
                               └── entry @ 10                     -> rows 14, cached id 99

Work is bounded: at most MAX_LEVEL_NODES nodes a level (chunk variants of the same rows),
MAX_BRANCHES entries a node looked at for a snapshot, and MAX_BRANCHES branches compared where
the key leaves the tree. It reads the tree and
changes nothing in it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from prefixd.scheduler.store.cursor import Cursor
from prefixd.scheduler.store.entries import Node
from prefixd.scheduler.store.identity import images_over

MAX_LEVEL_NODES = 16  # nodes of one level followed (the same rows chunked otherwise)
MAX_BRANCHES = 64  # branches and entry tails compared where the key leaves the tree
AHEAD = 8  # cached ids reported from the divergence on


@dataclass(frozen=True, slots=True)
class Match:
    """The longest prefix of a key the tree holds in its namespace, by identity.

    rows: prompt rows [0, rows) are identity-equal to held rows (rows == len(key): all).
    cached: the held ids from `rows` on (up to AHEAD); () where the held rows end there.
    snapshot_cut: the deepest entry cut <= rows whose rows are identity-equal to the key's
    (0: none), whatever its schedule hash.
    """

    rows: int
    cached: tuple[int, ...]
    snapshot_cut: int


@dataclass(frozen=True, slots=True)
class Probe:
    """What the store can say about a key beyond its lookup: its longest held prefix (None:
    the namespace holds nothing) and the most rows of it an earlier prompt had kept."""

    match: Match | None
    kept_before: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences."""
    limit = min(len(a), len(b))
    if tuple(a[:limit]) == tuple(b[:limit]):
        return limit
    for i in range(limit):
        if a[i] != b[i]:
            return i
    return limit


def longest_match(roots: dict[str, Node], cur: Cursor, page_size: int,
                  path: list[Node] | None = None) -> Match | None:
    """The key's longest held prefix (None: its namespace holds nothing).

    `path`: for a row-invariant family (one chunking, every row usable), the key's path the
    lookup walked: the walk starts at its end, and `snapshot_cut` is not looked for (0).
    """
    key, P = cur.key, page_size
    root = roots.get(key.namespace)
    if root is None:
        return None
    level, depth, snapshot_cut = ([path[-1]], len(path) - 1, 0) if path else ([root], 0, 0)
    while True:
        if path is None:
            snapshot_cut = max(snapshot_cut, _snapshot_cut(level, cur, P))
        if not key.has_rows((depth + 1) * P):
            break
        rk = cur.rows(depth)
        below = [c for node in level for c in node.children.get(rk, {}).values()][:MAX_LEVEL_NODES]
        if not below:
            break
        level, depth = below, depth + 1
    base = depth * P
    want = key.tokens[base:]
    best, cached, seen, used = 0, (), 0, None  # used: last use of the entry `cached` is from
    for node in level:
        for rows_key, variants in node.children.items():
            if seen >= MAX_BRANCHES:
                break
            seen += 1
            ids = rows_key[0]
            j = _agree(common_prefix(ids, want), key, base, rows_key[1])
            if j > best or not cached and j == best:
                child = next(iter(variants.values()))
                best, cached = j, _ahead(ids, child, P, j)
        for e in node.entries.values():
            if seen >= MAX_BRANCHES:
                break
            seen += 1
            held = e.tail[0][: e.cut - base]
            j = _agree(common_prefix(held, want), key, base, e.tail[1])
            if j > best or j == best and (not cached or used is not None and e.last_used > used):
                best, cached, used = j, tuple(held[j:j + AHEAD]), e.last_used  # ties: the latest used
    rows = min(base + best, len(key.tokens))
    return Match(rows, cached if rows < len(key.tokens) else (), snapshot_cut)


def _agree(j: int, key, base: int, held_images: tuple) -> int:
    """`j` ids agree from `base`; an image over them on one side only cuts the match at its start."""
    if not held_images and not key.images:
        return j
    for im in set(held_images) ^ set(images_over(key.images, base, base + j)):
        if im.at < base + j:
            j = max(0, im.at - base)
    return j


def _ahead(ids: tuple[int, ...], child: Node, page_size: int, j: int) -> tuple[int, ...]:
    """The held ids from `j` of a branch whose page holds `ids`, following its first branch
    down (or an entry's tail rows past the last page) until AHEAD ids are found."""
    seq, node = ids[:page_size], child
    while len(seq) - j < AHEAD:
        if node.children:
            node = next(iter(next(iter(node.children.values())).values()))
            seq += node.key[0][0][:page_size]  # type: ignore[index]
        elif node.entries:
            base = node.depth * page_size
            seq += max((e.tail[0][:e.cut - base] for e in node.entries.values()), key=len)
            break
        else:
            break
    if len(seq) < len(ids):  # a branch cut short by its lookahead ids alone
        seq = ids
    return tuple(seq[j:j + AHEAD])


def _snapshot_cut(level: list[Node], cur: Cursor, page_size: int) -> int:
    """The deepest entry on `level` whose rows are identity-equal to the key's (0: none)."""
    key, best = cur.key, 0
    for node in level:
        for e in itertools.islice(node.entries.values(), MAX_BRANCHES):
            if e.cut > best and key.has_rows(e.cut) and key.rows_key(node.depth * page_size, e.cut) == e.tail:
                best = e.cut
    return best
