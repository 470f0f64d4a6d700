"""What the store tells a router it holds: KV events in vLLM's shapes (docs/scale.md, *KV events*).

Two groups of blocks, each a chain of hashes a router can compute from a prompt's ids:

    group 0 (pages):      every full page of the tree        page_hash(parent, ns, P ids, images)
    group 1 (snapshots):  every snapshot's cut, for a family   the cut's page, or its tail rows
                          that resumes only at cuts (hybrid)  [depth*P, cut) hashed the same way

Nodes that only differ past what the hash covers (the chunking of a hybrid family, the
lookahead ids of a drafting head) share a hash; `Announcer` counts holders per hash and
announces a hash when its first holder comes and removes it when its last one goes.
Pure Python, no sockets: the engine process publishes what `Announcer.take` returns.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from prefixd.scheduler.records import ImageIdentity
from prefixd.scheduler.store.entries import Entry, Node

PAGES = 0  # group_idx of page blocks
SNAPSHOTS = 1  # group_idx of snapshot blocks (families that resume only at cuts)
HASH_DOMAIN = b"prefixd-kv-1\x00"
NO_PARENT = b"\xff" * 8  # a real hash is below 2**63, so it never reads as these bytes
HASH_MASK = (1 << 63) - 1  # hashes fit a signed 64-bit integer, as routers decode them


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A chain of blocks now held: block_hashes[0]'s parent is `parent_block_hash`, each next
    hash's parent the one before; `token_ids` are theirs, `block_size` per full block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    group: int = PAGES


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    group: int = PAGES


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def page_hash(parent: int | None, namespace: str, token_ids: Sequence[int],
              images: Sequence[ImageIdentity] = (), start: int = 0) -> int:
    """The hash of one block: rows [start, start + len(token_ids)) of a prompt whose block
    before is `parent` (None for the first), with the images overlapping those rows.

    sha256 over, in order: HASH_DOMAIN; the parent as 8 bytes big-endian (NO_PARENT for
    none); the namespace as a u32 byte length and its UTF-8; the number of ids as a u32 and
    each id as a u32; the number of images as a u32 and for each its `at - start` as an i32,
    `tokens`, `gh`, `gw` as u32, its hash's length as a u32 and the hash's bytes (all
    big-endian). The first 8 bytes of the digest, big-endian, masked to 63 bits.
    """
    h = hashlib.sha256(HASH_DOMAIN)
    h.update(NO_PARENT if parent is None else parent.to_bytes(8, "big"))
    ns = namespace.encode()
    h.update(struct.pack(">I", len(ns)) + ns)
    h.update(struct.pack(f">I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(struct.pack(">I", len(images)))
    for im in images:
        h.update(struct.pack(">iIIII", im.at - start, im.tokens, im.gh, im.gw, len(im.hash)) + im.hash)
    return int.from_bytes(h.digest()[:8], "big") & HASH_MASK


def prompt_hashes(token_ids: Sequence[int], page_size: int, namespace: str = "",
                  images: Sequence[ImageIdentity] = ()) -> list[int]:
    """The page hashes of a prompt's full pages, first to last: what a router computes."""
    out: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        stop = start + page_size
        parent = page_hash(parent, namespace, token_ids[start:stop], _over(images, start, stop), start)
        out.append(parent)
    return out


def _over(images: Iterable[ImageIdentity], start: int, stop: int) -> tuple[ImageIdentity, ...]:
    return tuple(im for im in images if im.at < stop and im.at + im.tokens > start)


def _page_of(node: Node, parent: int | None, namespace: str, page_size: int) -> tuple[int, tuple[int, ...]]:
    """A node's hash and its page's ids (its key also holds lookahead ids past the page)."""
    (ids, images), _ = node.key  # type: ignore[misc]
    start = (node.depth - 1) * page_size
    page = ids[:page_size]
    return page_hash(parent, namespace, page, _over(images, start, start + page_size), start), page


def _snapshot_of(e: Entry, node_hash: int | None, parent_hash: int | None,
                 page_size: int) -> BlockStored:
    """The block that announces entry `e`: its node's page on a page edge, else its tail rows."""
    start = e.node.depth * page_size
    if e.cut == start:
        (ids, _), _ = e.node.key  # type: ignore[misc]
        return BlockStored((node_hash,), parent_hash, tuple(ids[:page_size]), page_size, SNAPSHOTS)  # type: ignore[arg-type]
    ids, images = e.tail
    tail = tuple(ids[:e.cut - start])
    h = page_hash(node_hash, e.namespace, tail, _over(images, start, e.cut), start)
    return BlockStored((h,), node_hash, tail, page_size, SNAPSHOTS)


class Announcer:
    """Listens to the store's tree (`Tree.listener`) and says what changed since the last take.

    Stores come parent first, removals child first; a round whose changes leave nothing held
    says AllBlocksCleared instead of its removals.
    """

    def __init__(self, page_size: int, *, snapshots: bool) -> None:
        self.page_size = page_size
        self.snapshots = snapshots
        self._node: dict[Node, tuple[int, str]] = {}  # hash, namespace of each live page node
        self._entry: dict[Entry, tuple[int, int]] = {}  # (group, hash) of each announced entry
        self._count: dict[tuple[int, int], int] = {}  # holders of each (group, hash)
        self._changed: dict[tuple[int, int], list] = {}  # [count at the last take, BlockStored, depth]

    # ---- the tree's calls -----------------------------------------------------------------

    def page_added(self, node: Node, namespace: str) -> None:
        parent = self._node[node.parent][0] if node.parent is not None and node.parent.page is not None else None
        h, ids = _page_of(node, parent, namespace, self.page_size)
        self._node[node] = (h, namespace)
        self._up((PAGES, h), BlockStored((h,), parent, ids, self.page_size), node.depth)

    def page_dropped(self, node: Node) -> None:
        h, _ = self._node.pop(node)
        self._down((PAGES, h), node.depth)

    def snapshot_added(self, e: Entry) -> None:
        if not self.snapshots:
            return
        node_hash, parent_hash = self._hashes_at(e.node)
        block = _snapshot_of(e, node_hash, parent_hash, self.page_size)
        self._entry[e] = (SNAPSHOTS, block.block_hashes[0])
        self._up(self._entry[e], block, e.node.depth)

    def snapshot_dropped(self, e: Entry) -> None:
        key = self._entry.pop(e, None)
        if key is not None:
            self._down(key, e.node.depth)

    def _hashes_at(self, node: Node) -> tuple[int | None, int | None]:
        if node.page is None:
            return None, None
        parent = node.parent
        return self._node[node][0], self._node[parent][0] if parent is not None and parent.page is not None else None

    def _up(self, key: tuple[int, int], block: BlockStored, depth: int) -> None:
        n = self._count.get(key, 0)
        change = self._changed.setdefault(key, [n, None, depth])
        change[1] = block
        self._count[key] = n + 1

    def _down(self, key: tuple[int, int], depth: int) -> None:
        n = self._count[key]
        self._changed.setdefault(key, [n, None, depth])
        if n == 1:
            del self._count[key]
        else:
            self._count[key] = n - 1

    # ---- what the engine publishes ----------------------------------------------------------

    @property
    def num_held(self) -> int:
        """Distinct blocks held now, both groups."""
        return len(self._count)

    def take(self) -> list[KvEvent]:
        """The events since the last take (and forgets them)."""
        changed, self._changed = self._changed, {}
        stored, removed = [], []
        for key, (before, block, depth) in changed.items():
            now = key in self._count
            if now and not before:
                stored.append((key[0], depth, block))
            elif before and not now:
                removed.append((key[0], depth, key[1]))
        out: list[KvEvent] = []
        if removed:
            if not self._count:
                out.append(AllBlocksCleared())
            else:
                removed.sort(key=lambda r: (-r[0], -r[1]))
                for group in (SNAPSHOTS, PAGES):
                    hashes = tuple(h for g, _, h in removed if g == group)
                    if hashes:
                        out.append(BlockRemoved(hashes, group))
        stored.sort(key=lambda s: (s[0], s[1]))
        out += chains(block for _, _, block in stored)
        return out


def chains(blocks: Iterable[BlockStored]) -> list[BlockStored]:
    """Single blocks, parents first, joined into chains where a block's parent ends one."""
    out: list[BlockStored] = []
    open_at: dict[tuple[int, int], int] = {}  # (group, last hash) -> index in out
    for b in blocks:
        i = open_at.pop((b.group, b.parent_block_hash), None) if b.parent_block_hash is not None else None
        if i is None or len(b.token_ids) != b.block_size or len(out[i].token_ids) != len(out[i].block_hashes) * b.block_size:
            i = len(out)
            out.append(b)
        else:
            c = out[i]
            out[i] = BlockStored(c.block_hashes + b.block_hashes, c.parent_block_hash, c.token_ids + b.token_ids,
                                 c.block_size, c.group)
        open_at[(b.group, out[i].block_hashes[-1])] = i
    return out


def blocks_of(roots: dict[str, Node], page_size: int, *, snapshots: bool) -> list[BlockStored]:
    """Every block the tree holds, computed afresh from its nodes (not from an Announcer):
    what a router that saw every event holds, and what a replay too old for the ring sends."""
    pages: dict[int, BlockStored] = {}
    snaps: dict[int, BlockStored] = {}
    for ns, root in roots.items():
        for node, h, parent in _walk(root, ns, page_size):
            if node.page is not None and h not in pages:
                pages[h] = BlockStored((h,), parent, tuple(node.key[0][0][:page_size]), page_size)  # type: ignore[index]
            if snapshots:
                for e in node.entries.values():
                    b = _snapshot_of(e, h, parent, page_size)
                    snaps.setdefault(b.block_hashes[0], b)
    return chains(list(pages.values()) + list(snaps.values()))


def _walk(root: Node, namespace: str, page_size: int) -> Iterator[tuple[Node, int | None, int | None]]:
    """(node, its hash, its parent's hash), parents before children; the root's hash is None."""
    stack: list[tuple[Node, int | None, int | None]] = [(root, None, None)]
    while stack:
        node, h, parent = stack.pop()
        yield node, h, parent
        for variants in node.children.values():
            for child in variants.values():
                ch, _ = _page_of(child, h, namespace, page_size)
                stack.append((child, ch, h))


def held(blocks: Iterable[BlockStored]) -> set[tuple[int, int]]:
    """(group, hash) of every block in `blocks`."""
    return {(b.group, h) for b in blocks for h in b.block_hashes}


# ---- the wire: vLLM's array-like tagged structs as plain lists (msgpack them as they are) --

LAYOUTS = ("array", "map")  # an event as vLLM's legacy array, or as the tagged map vLLM now sends


def to_wire(event: KvEvent, medium: str, layout: str = "array") -> list | dict:
    """vLLM's shape. "array": [tag, fields...] with BlockStored's lora_id, lora_name and
    extra_keys None, group_idx last, so a decoder that predates it ignores it. "map": the same
    fields by name under "type" (vLLM's tagged structs without array_like; vllm-router reads it)."""
    if isinstance(event, BlockStored):
        fields: dict = {"block_hashes": list(event.block_hashes), "parent_block_hash": event.parent_block_hash,
                        "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": None,
                        "medium": medium, "lora_name": None, "extra_keys": None, "group_idx": event.group}
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": list(event.block_hashes), "medium": medium, "group_idx": event.group}
    else:
        fields = {}
    if layout == "map":
        return {"type": type(event).__name__, **fields}
    assert layout == "array", f"unknown KV event layout {layout!r}"
    return [type(event).__name__, *fields.values()]


def batch_to_wire(ts: float, events: Sequence[KvEvent], medium: str, rank: int = 0, layout: str = "array") -> list:
    """One EventBatch: [ts, events, data_parallel_rank] (an array in either layout, as vLLM's)."""
    return [ts, [to_wire(e, medium, layout) for e in events], rank]


class View:
    """What a router keeps from the events: the (group, hash) of every block held. A
    reference for subscribers and the tests' judge of what the events say."""

    def __init__(self) -> None:
        self.blocks: set[tuple[int, int]] = set()
        self.parents: dict[tuple[int, int], int | None] = {}

    def apply_wire(self, batch: list) -> None:
        for ev in batch[1]:
            if isinstance(ev, dict):  # the map layout, as the array one
                names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                         "lora_name", "extra_keys", "group_idx") if ev["type"] == "BlockStored" else (
                    "block_hashes", "medium", "group_idx") if ev["type"] == "BlockRemoved" else ()
                ev = [ev["type"], *(ev[n] for n in names)]
            tag = ev[0]
            group = ev[9] if tag == "BlockStored" and len(ev) > 9 else ev[3] if tag == "BlockRemoved" and len(ev) > 3 else PAGES
            if tag == "BlockStored":
                parent = ev[2]
                for h in ev[1]:
                    self.blocks.add((group, h))
                    self.parents[(group, h)] = parent
                    parent = h
            elif tag == "BlockRemoved":
                for h in ev[1]:
                    self.blocks.discard((group, h))
                    self.parents.pop((group, h), None)
            elif tag == "AllBlocksCleared":
                self.blocks.clear()
                self.parents.clear()
            else:
                raise ValueError(f"unknown KV event {tag!r}")
