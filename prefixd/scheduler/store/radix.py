"""The prefix store: a radix tree of KV pages keyed by reuse identity, with snapshots at cuts."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.planner import Schedule
from prefixd.scheduler.store.entries import Eviction, Hit, Snapshot, StoreStats
from prefixd.scheduler.store.identity import ReuseKey

SAVED = "saved"  # kept
PRESENT = "present"  # an equal snapshot was already kept; nothing added
REPLACED = "replaced"  # kept in place of the restored ancestor it extends
SKIPPED = "skipped"  # does not fit the allowance; counted
REFUSED = "refused"  # cut past the prefilled rows (or its lookahead past the key); counted


class PrefixStore:
    """Radix pages + snapshots under a byte allowance.

    Holds one allocator reference per page it keeps; never writes a page. Single-threaded.
    """

    def __init__(self, allocator: PageAllocator, *, page_size: int, kv_bytes_per_page: int,
                 budget_bytes: int, invariant_rows: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        raise NotImplementedError

    def lookup(self, key: ReuseKey, schedule: Schedule) -> Hit | None:
        """The deepest usable resume point of `key`, or None (a miss).

        invariant_rows: any identity-equal row (full pages, or a snapshot's cut); otherwise
        only a snapshot at a cut of `schedule` whose schedule hash agrees. A hit at row n
        needs the snapshot's logits row; without it a row-invariant hit stops at n - 1.
        Counts a hit or a miss, marks entries the key moved past, touches the hit's entry.
        Takes no page reference: the caller increfs `hit.pages`.
        """
        raise NotImplementedError

    def pin(self, hit: Hit) -> None:
        """Keep the hit's entry from eviction while a running request resumes from it."""
        raise NotImplementedError

    def unpin(self, hit: Hit) -> None:
        raise NotImplementedError

    def publish(self, key: ReuseKey, schedule: Schedule, cut: int, pages: Sequence[int],
                snapshot: Snapshot, *, prefilled_upto: int, restored: Hit | None = None) -> str:
        """Keep the rows [0, cut) of `key` and `snapshot` at `cut`.

        `pages` is the lane's page table (covers at least rows [0, cut)); the store increfs the
        pages it keeps. `prefilled_upto`: rows the lane's pass prefilled (or restored).
        Returns SAVED, PRESENT, REPLACED (dropped `restored`, a strict prefix, to fit),
        SKIPPED (does not fit, counted) or REFUSED (cut > prefilled_upto, counted). May evict
        other entries to fit. Raises ValueError when `cut` is not a cut of `schedule` in a
        family that is not row-invariant.
        """
        raise NotImplementedError

    def note_latest(self, key: ReuseKey) -> None:
        """The conversation's latest prompt is `key` (e.g. a resident continuation that did not
        look up): entries it runs past are marked moved past, and cuts it diverges from shared."""
        raise NotImplementedError

    def make_room(self, num_pages: int) -> int:
        """Evict in eviction order until the allocator has `num_pages` free or nothing more can
        go; returns the number of pages freed."""
        raise NotImplementedError

    def set_budget(self, budget_bytes: int) -> None:
        """Change the allowance, evicting down to it."""
        raise NotImplementedError

    def clear(self) -> int:
        """Drop every unpinned entry; returns pages freed."""
        raise NotImplementedError

    def drain_evictions(self) -> list[Eviction]:
        """The evictions since the last drain, in order (the engine feeds metrics from them)."""
        raise NotImplementedError

    def stats(self) -> StoreStats:
        raise NotImplementedError

    def check_integrity(self) -> None:
        """Raise RuntimeError if page references, byte totals or tree counts disagree."""
        raise NotImplementedError
