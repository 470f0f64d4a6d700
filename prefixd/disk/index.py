"""The disk tier's index: which entries the cache directory holds, how they chain, and the
order they leave in. Torch-free and file-free (tier.py reads and writes the files); it
reads the scheduler's identity and schedule records, and the scheduler imports nothing here.

An entry on disk is a snapshot at a cut, like an entry in RAM. Its file holds only the pages
its parent entry does not: the parent is the deepest entry on disk whose rows are a prefix of
its rows (same identity), and the child's file starts at the parent's last full page:

    parent  cut 37, P = 16:  pages 0 1 | 2 (tail, rows 32..36)      file: pages 0..2
    child   cut 70:                    | 2 3 4 (tail, rows 64..69)  file: pages 2..4

So a conversation's turns cost one copy of their rows, not one per turn. Reading an entry
reads its chain, root first. Eviction takes leaves only (a parent goes after its children),
in the RAM store's order: moved past first, then never hit, then least recently used, shared
cuts last.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from array import array
from dataclasses import dataclass, fields
from typing import Callable, Iterator

from prefixd.scheduler.chunks import CutHasher, Schedule
from prefixd.scheduler.store.identity import ReuseKey, images_over

FORMAT_VERSION = 2  # bump whenever the file layout or what decides a row's bits changes


@dataclass(frozen=True, slots=True)
class TierIdentity:
    """Everything outside a request that decides a cached row's bits. Files of another
    identity are foreign: never served."""

    model_hash: str  # content hash of the model file(s)
    dtype: str
    device_kind: str  # "cpu" | "cuda"
    mode: str  # numeric mode
    page_size: int
    kv_bytes_per_page: int
    lane_state_bytes: int
    logits_row_bytes: int
    lookahead: int
    invariant_rows: bool
    format_version: int = FORMAT_VERSION

    def digest(self) -> bytes:
        text = "|".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


class KeyDigests:
    """The disk digest of a key's prefix at ascending cuts, hashing each token once.

    A digest covers namespace, lookahead, the ids of rows [0, cut) and the lookahead
    past them, every image over those rows, the cut and the schedule hash below it (b"" for a
    row-invariant family).
    """

    def __init__(self, key: ReuseKey) -> None:
        self.key = key
        ns = key.namespace.encode()
        self._head = struct.pack("<qq", key.lookahead, len(ns)) + ns
        self._h = hashlib.blake2b(self._head, digest_size=16)
        self._stop = 0

    def at(self, cut: int, cut_hash: bytes) -> bytes:
        stop = cut + self.key.lookahead
        if not 0 < cut or stop > len(self.key.tokens):
            raise ValueError(f"cut {cut} (+{self.key.lookahead} lookahead) outside a key of {len(self.key.tokens)}")
        if stop < self._stop:
            self._h, self._stop = hashlib.blake2b(self._head, digest_size=16), 0
        self._h.update(array("q", self.key.tokens[self._stop:stop]).tobytes())
        self._stop = stop
        h = self._h.copy()
        for im in images_over(self.key.images, 0, stop):
            h.update(struct.pack("<qqqqq", im.at, im.tokens, im.gh, im.gw, len(im.hash)) + im.hash)
        h.update(struct.pack("<qq", cut, len(cut_hash)) + cut_hash)
        return h.digest()


def cut_hashes(key: ReuseKey, schedule: Schedule, invariant_rows: bool) -> Callable[[int], bytes]:
    """The schedule hash at a cut as the RAM store records it (b"" when rows are invariant)."""
    if invariant_rows:
        return lambda cut: b""
    hasher = CutHasher(key.tokens, schedule.starts, schedule.grid, namespace=key.namespace, images=key.images)
    return hasher.at


@dataclass(eq=False)
class DiskEntry:
    """One entry file: pages [first_page, num_pages) of the rows below `cut`, and the snapshot."""

    digest: bytes
    parent: bytes | None
    cut: int
    first_page: int
    num_pages: int  # pages covering rows [0, cut)
    nbytes: int  # the file's size
    has_logits: bool
    seq: int
    last_used: float
    hits: int = 0
    moved_past: bool = False
    shared: bool = False
    children: int = 0
    durable: bool = False  # its file is written (renamed into place)

    @property
    def name(self) -> str:
        return self.digest.hex()


def order_key(e: DiskEntry) -> tuple:
    """The RAM store's order (store/eviction.py): the first in sorted order goes first."""
    return (e.shared, not e.moved_past, e.hits > 0, e.last_used, e.seq)


class DiskIndex:
    """Entries on disk by digest, their parent links and byte total. Single-threaded."""

    def __init__(self, page_size: int, invariant_rows: bool) -> None:
        self.page_size = page_size
        self.invariant_rows = invariant_rows
        self.entries: dict[bytes, DiskEntry] = {}
        self.bytes = 0
        self._cuts: list[int] = []  # sorted, one per entry
        self.seq = 0

    def __len__(self) -> int:
        return len(self.entries)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def add(self, e: DiskEntry) -> None:
        if e.digest in self.entries:
            raise ValueError(f"entry {e.name} added twice")
        if e.parent is not None:
            parent = self.entries.get(e.parent)
            if parent is None:
                raise ValueError(f"entry {e.name}: parent {e.parent.hex()} is not indexed")
            parent.children += 1
            parent.moved_past = True  # a later entry of the same identity extends it
            parent.shared = parent.shared or parent.children >= 2
        self.entries[e.digest] = e
        bisect.insort(self._cuts, e.cut)
        self.bytes += e.nbytes
        self.seq = max(self.seq, e.seq)

    def remove(self, e: DiskEntry) -> None:
        """Drop a leaf entry (a parent goes only after its children)."""
        if e.children:
            raise RuntimeError(f"entry {e.name} removed while {e.children} entries chain on it")
        del self.entries[e.digest]
        del self._cuts[bisect.bisect_left(self._cuts, e.cut)]
        self.bytes -= e.nbytes
        if e.parent is not None:
            self.entries[e.parent].children -= 1

    def chain(self, e: DiskEntry) -> list[DiskEntry]:
        """The entry's files, root first."""
        out = [e]
        while out[-1].parent is not None:
            out.append(self.entries[out[-1].parent])
        return out[::-1]

    def remove_subtree(self, e: DiskEntry) -> list[DiskEntry]:
        """Drop `e` and every entry chaining on it; returns them, leaves first."""
        gone = self.subtree(e)
        for x in gone:
            self.remove(x)
        return gone

    def subtree(self, e: DiskEntry) -> list[DiskEntry]:
        """`e` and every entry chaining on it, leaves first (the order they can be removed)."""
        below: dict[bytes, list[DiskEntry]] = {}
        for c in self.entries.values():
            if c.parent is not None:
                below.setdefault(c.parent, []).append(c)
        order, todo = [], [e]
        while todo:  # parents before children, then reversed; chains may be thousands deep
            x = todo.pop()
            order.append(x)
            todo.extend(below.get(x.digest, ()))
        return order[::-1]

    def find(self, key: ReuseKey, schedule: Schedule, *, below: int | None = None,
             durable_only: bool = True, observe: bool = False) -> DiskEntry | None:
        """The deepest entry whose rows are a prefix of `key`'s and that the request may resume
        from (a cut of its schedule with an equal hash, unless rows are invariant; at row n
        only with a logits row); cuts >= `below` are not considered. With `observe`, entries
        the key runs past are marked moved past."""
        n = len(key.tokens)
        limit = n + 1 if below is None else min(below, n + 1)
        digests, hashes = KeyDigests(key), cut_hashes(key, schedule, self.invariant_rows)
        best: DiskEntry | None = None
        for cut in self._candidate_cuts(key, schedule, limit):
            e = self.entries.get(digests.at(cut, hashes(cut)))
            if e is None or e.cut != cut:
                continue
            if observe and cut < n:
                e.moved_past = True
            if (durable_only and not e.durable) or (cut == n and not e.has_logits):
                continue
            best = e
        return best

    def _candidate_cuts(self, key: ReuseKey, schedule: Schedule, limit: int) -> Iterator[int]:
        last = None
        for cut in self._cuts[:bisect.bisect_left(self._cuts, limit)]:
            if cut == last or not key.has_rows(cut):
                continue
            last = cut
            if self.invariant_rows or schedule.is_cut(cut):
                yield cut

    def victims(self, budget_bytes: int, protect: frozenset[bytes] = frozenset()) -> list[DiskEntry]:
        """Leaves to remove, in eviction order, until the total fits `budget_bytes`; removing a
        leaf may make its parent the next leaf. Changes nothing: the caller removes them."""
        out: list[DiskEntry] = []
        gone: set[bytes] = set()
        children = {d: e.children for d, e in self.entries.items()}
        total = self.bytes
        while total > budget_bytes:
            leaves = [e for d, e in self.entries.items()
                      if d not in gone and d not in protect and children[d] == 0]
            if not leaves:
                break
            v = min(leaves, key=order_key)
            out.append(v)
            gone.add(v.digest)
            total -= v.nbytes
            if v.parent is not None:
                children[v.parent] -= 1
        return out

    def check_integrity(self) -> None:
        """Raise RuntimeError when parent links, child counts or the byte total disagree."""
        counts = {d: 0 for d in self.entries}
        for e in self.entries.values():
            if e.parent is not None:
                if e.parent not in self.entries:
                    raise RuntimeError(f"entry {e.name}: parent missing")
                counts[e.parent] += 1
        for d, e in self.entries.items():
            if e.children != counts[d]:
                raise RuntimeError(f"entry {e.name}: {e.children} children counted, {counts[d]} found")
        if self.bytes != sum(e.nbytes for e in self.entries.values()):
            raise RuntimeError("disk index byte total disagrees with its entries")
        if self._cuts != sorted(e.cut for e in self.entries.values()):
            raise RuntimeError("disk index cut list disagrees with its entries")
