"""Records of the prefix store: what callers hand in and get back, and the tree's own nodes."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixd.scheduler.records import DeviceRows, DeviceState
from prefixd.scheduler.store.identity import ReuseKey, RowsKey

# Eviction reasons, used as the `reason` label of prefixd_prefix_cache_evictions_total.
MOVED_PAST = "moved_past"  # its conversation moved past it
NEVER_HIT = "never_hit"  # never restored
LRU = "lru"  # restored before, least recently used
SHARED = "shared"  # a cut several conversations used
REPLACED = "replaced"  # a new snapshot that did not fit replaced its restored ancestor
CLEARED = "cleared"  # clear() dropped it
REASONS = (MOVED_PAST, NEVER_HIT, LRU, SHARED, REPLACED, CLEARED)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What resuming at a cut needs beyond the KV pages.

    state: recurrent + conv state (None for attention-only families); carry: draft-head
    carry (None until drafting keeps one); logits: the float32 logits row of the cut's last
    row, so a request whose whole prompt is cached samples its first token with no forward.
    """

    state: DeviceState | None = None
    logits: DeviceRows | None = None
    carry: DeviceState | None = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.state, self.logits, self.carry) if x is not None)


@dataclass(frozen=True, slots=True)
class Hit:
    """A lookup's answer: resume at row `rows` of the prompt.

    `pages` cover rows [0, rows) in order; the caller increfs them and must copy the last one
    before writing into it when `rows` is not on a page edge. `snapshot` is None for a
    page-only hit of a row-invariant family. `source` is opaque (pin, unpin, publish).
    """

    rows: int
    pages: tuple[int, ...]
    snapshot: Snapshot | None
    source: object = None


@dataclass(frozen=True, slots=True)
class Eviction:
    """One victim, in the order evicted. trigger: "pages" | "budget" | "publish" | "clear"."""

    namespace: str
    cut: int
    reason: str
    trigger: str
    nbytes: int  # bytes the store's accounting dropped
    pages_freed: tuple[int, ...]  # pages that returned to the allocator


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One kept entry as `PrefixStore.describe()` reports it."""

    namespace: str
    cut: int
    nbytes: int  # what it alone holds: its snapshot, and pages nothing else in the store uses
    hits: int
    pinned: bool
    moved_past: bool
    shared: bool


@dataclass(frozen=True, slots=True)
class StoreStats:
    bytes: int  # every page the store holds x kv_bytes_per_page + snapshot bytes
    budget_bytes: int
    entries: int
    pages: int
    hits: int
    misses: int
    query_tokens: int
    hit_tokens: int
    evictions: dict[str, int]
    skipped_saves: int
    refused_keeps: int


@dataclass(eq=False)
class Node:
    """One full page of the tree: rows [depth*P - P, depth*P) under `key` (root: depth 0)."""

    depth: int
    key: tuple[RowsKey, tuple] | None  # (rows identity, chunk key); None at a root
    page: int | None  # None at a root
    parent: Node | None
    children: dict[RowsKey, dict[tuple, Node]] = field(default_factory=dict)  # by rows, chunks
    entries: dict[tuple, Entry] = field(default_factory=dict)
    num_entries_below: int = 0  # entries on this node and in its subtree
    alive: bool = True  # False once pruned


@dataclass(eq=False)
class Entry:
    """A snapshot hung on `node` at row `cut` (node.depth*P <= cut < node.depth*P + P, or == n)."""

    node: Node
    cut: int
    tail: RowsKey  # rows [node.depth*P, cut) and the lookahead past cut
    tail_page: int | None  # the partial page holding the tail rows (None on a page edge)
    cut_hash: bytes
    snapshot: Snapshot
    namespace: str
    seq: int  # creation order, the last tie-break
    last_used: float
    hits: int = 0
    pins: int = 0
    moved_past: bool = False
    shared: bool = False
    continuation: ReuseKey | None = None  # the longest key seen through this cut
    attached: bool = True

    @property
    def slot(self) -> tuple:
        return (self.cut, self.tail, self.cut_hash)
