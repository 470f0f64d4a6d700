"""Prefix store: radix pages with reuse identity, snapshots at cuts, allowance and eviction.

See docs/store.md. Pure Python: pages are ids of `PageAllocator`, device tensors are opaque.
"""

from __future__ import annotations

from prefixd.scheduler.store.entries import REASONS, EntryInfo, Eviction, Hit, Snapshot, StoreStats
from prefixd.scheduler.store.identity import ReuseKey, make_key
from prefixd.scheduler.store.radix import (PRESENT, REFUSED, REPLACED, SAVED, SKIPPED,
                                           PrefixStore)

__all__ = ["PrefixStore", "ReuseKey", "make_key", "Snapshot", "Hit", "Eviction", "EntryInfo", "StoreStats",
           "REASONS", "SAVED", "PRESENT", "REPLACED", "SKIPPED", "REFUSED"]
