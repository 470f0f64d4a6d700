"""Consistency check of the prefix store's tree, entries and byte ledger (tests, idle time)."""

from __future__ import annotations

from collections import Counter
from prefixd.scheduler.store.allowance import Ledger
from prefixd.scheduler.store.entries import Entry, Node
from prefixd.scheduler.store.tree import Tree


def check(page_size: int, tree: Tree, ledger: Ledger) -> None:
    """Raise RuntimeError on the first disagreement found."""
    P = page_size
    roots, entries = tree.roots, list(tree.entries.values())
    uses: Counter[int] = Counter()
    extra = 0
    seen: list[Entry] = []

    def walk(node: Node) -> int:
        nonlocal extra
        count = 0
        for slot, e in node.entries.items():
            if e.node is not node or e.slot != slot or not e.attached:
                raise RuntimeError(f"entry at cut {e.cut} misfiled")
            if not node.depth * P <= e.cut < node.depth * P + P:
                raise RuntimeError(f"entry at cut {e.cut} hangs on a node of depth {node.depth}")
            if (e.tail_page is None) != (e.cut % P == 0):
                raise RuntimeError(f"entry at cut {e.cut}: tail page {e.tail_page}")
            if e.pins < 0:
                raise RuntimeError(f"entry at cut {e.cut} has {e.pins} pins")
            if e.tail_page is not None:
                uses[e.tail_page] += 1
            extra += e.snapshot.nbytes
            seen.append(e)
            count += 1
        for rk, variants in node.children.items():
            if not variants:
                raise RuntimeError(f"node at depth {node.depth} keeps an empty child slot")
            for ck, child in variants.items():
                if child.parent is not node or child.key != (rk, ck) or child.depth != node.depth + 1:
                    raise RuntimeError(f"node at depth {child.depth} misfiled")
                uses[child.page] += 1  # type: ignore[index]
                count += walk(child)
        if count != node.num_entries_below:
            raise RuntimeError(f"node at depth {node.depth}: {node.num_entries_below} entries "
                               f"counted below, {count} found")
        if count == 0:
            raise RuntimeError(f"node at depth {node.depth} keeps no entry")
        return count

    for ns, root in roots.items():
        if root.parent is not None or root.page is not None:
            raise RuntimeError(f"root of namespace {ns!r} is not a root")
        walk(root)
    if dict(uses) != ledger.refs:
        raise RuntimeError(f"page uses {dict(uses)} but the ledger holds {ledger.refs}")
    if extra != ledger.extra_bytes:
        raise RuntimeError(f"snapshot bytes {extra} but the ledger counts {ledger.extra_bytes}")
    held = len(uses) * ledger.kv_bytes_per_page + extra
    if held != ledger.bytes:
        raise RuntimeError(f"the store holds {held} bytes but its running total is {ledger.bytes}")
    if sorted(e.seq for e in seen) != sorted(e.seq for e in entries):
        raise RuntimeError("the entry list and the tree disagree")
    for p in ledger.refs:
        if ledger.allocator.refcount(p) < 1:
            raise RuntimeError(f"store holds page {p} but the allocator has it free")
