"""Lanes: seats in the batched forward, each with its page table and the identity of its rows.

A lane's page table maps rows to pages, P rows a page:

    rows   0 ........ P-1 | P ....... 2P-1 | 2P ... num_rows-1 .. |
    pages  pages[0]       | pages[1]       | pages[2] (partial)   |
           <- borrowed (read-only) ->|<- the lane's own ------->|

Pages borrowed from the store are never written: a write inside one copies it first.
Pages the lane allocated it may keep appending to even when the store also holds them,
because a holder only reads rows below the cut it took them at. A rewind below the rows
written copies a partial page that someone else still holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.records import ImageIdentity, PageCopy
from prefixd.scheduler.streams import Stream


class ScheduleLike(Protocol):
    """What resident matching needs from a prefill schedule (`chunks.Schedule` provides it)."""

    @property
    def cuts(self) -> tuple[int, ...]: ...


def pages_for(rows: int, page_size: int) -> int:
    return -(-rows // page_size)


@dataclass(eq=False)
class Lane:
    """One seat. `ids` are the identity tokens of the rows whose KV is written."""

    index: int
    pages: list[int] = field(default_factory=list)
    num_borrowed: int = 0  # leading pages shared read-only from the store
    ids: list[int] = field(default_factory=list)
    namespace: str = ""
    images: tuple[ImageIdentity, ...] = ()
    prefilled_upto: int = 0  # rows [0, prefilled_upto) came from the prefill form
    starts: tuple[int, ...] = ()  # chunk starts of the pass that prefilled those rows
    stream: Stream | None = None
    resident: bool = False
    last_stream_id: int | None = None  # the stream that left this lane resident
    last_used: int = 0
    restored: object | None = None  # the store hit this lane resumed from (pinned while busy)
    cut_states: dict[int, object] = field(default_factory=dict)  # cut -> DeviceState (non-invariant)

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def busy(self) -> bool:
        return self.stream is not None

    @property
    def free(self) -> bool:
        return self.stream is None and not self.resident


def check_page_refs(
    allocator: PageAllocator, lanes: Sequence[Lane], page_size: int, other_refs: Sequence[int], store_pages: int
) -> None:
    """Raise RuntimeError unless every page's refcount is its lanes' holds, `other_refs`
    (held for waiting streams), and at most one more for each of the store's `store_pages`."""
    allocator.check_integrity()
    held = [0] * allocator.num_pages
    for p in other_refs:
        held[p] += 1
    for lane in lanes:
        for p in lane.pages:
            held[p] += 1
        if lane.busy and lane.resident:
            raise RuntimeError(f"lane {lane.index} is both busy and resident")
        if len(lane.pages) < pages_for(lane.num_rows, page_size):
            raise RuntimeError(f"lane {lane.index}: {lane.num_rows} rows but {len(lane.pages)} pages")
        if lane.free and lane.pages:
            raise RuntimeError(f"free lane {lane.index} holds pages {lane.pages}")
    extra = [allocator.refcount(p) - held[p] for p in range(allocator.num_pages)]
    if any(x not in (0, 1) for x in extra) or sum(extra) != store_pages:
        bad = [p for p, x in enumerate(extra) if x not in (0, 1)]
        raise RuntimeError(f"page refcounts disagree with lanes + store ({store_pages} pages): {bad or extra}")


def match_rows(lane: Lane, key: Sequence[int], namespace: str, images: Sequence[ImageIdentity]) -> int:
    """How many leading rows of `lane` carry the identity a request with `key` would give them."""
    if namespace != lane.namespace:
        return 0
    k = _common_prefix(lane.ids, key)
    for image in set(images) ^ set(lane.images):  # an image on one side only cuts the match at its start
        k = min(k, max(image.at, 0))
    return k


def _common_prefix(ids: list[int], key: Sequence[int]) -> int:
    """Length of the common prefix, by slice comparisons (C speed on long prompts)."""
    limit = min(len(ids), len(key))
    if ids[:limit] == list(key[:limit]):
        return limit
    lo, hi = 0, limit  # ids[:lo] matches, ids[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ids[lo:mid] == list(key[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class PageTables:
    """Grows, rewinds and releases lanes' page tables against the shared allocator.

    Never touches the device: a copy-on-write comes back as a `PageCopy` for the round's plan.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size

    def pages_needed(self, lane: Lane, rows: int) -> int:
        """Fresh pages `lane` needs so its table covers rows [0, rows)."""
        return max(0, pages_for(rows, self.page_size) - len(lane.pages))

    def grow(self, lane: Lane, rows: int) -> bool:
        """Extend `lane`'s table to cover rows [0, rows); False (nothing taken) if pages are short."""
        need = self.pages_needed(lane, rows)
        if need == 0:
            return True
        fresh = self.allocator.allocate(need)
        if fresh is None:
            return False
        lane.pages.extend(fresh)
        return True

    def trim(self, lane: Lane) -> None:
        """Drop pages past the lane's rows (they held only rejected verify rows)."""
        keep = pages_for(lane.num_rows, self.page_size)
        if len(lane.pages) > keep:
            self.allocator.decref(lane.pages[keep:])
            del lane.pages[keep:]

    def rewind(self, lane: Lane, row: int) -> tuple[PageCopy, ...]:
        """Forget rows [row, ...) of `lane` and make row `row` writable; returns the page copy
        the round must run before its forward (none when the page holding `row` is the lane's own).

        Needs one free page when the page holding `row` must be copied (`cow_pages_needed`);
        raises if none is free.
        """
        if row > lane.num_rows:
            raise RuntimeError(f"lane {lane.index}: rewind to row {row} past its {lane.num_rows} rows")
        must_copy = self.cow_pages_needed(lane, row)
        self._forget_rows(lane, row)
        copies = (self._copy_last_page(lane),) if must_copy else ()
        if must_copy or row % self.page_size == 0:
            lane.num_borrowed = min(lane.num_borrowed, row // self.page_size)
        return copies

    def truncate(self, lane: Lane, row: int) -> None:
        """Forget rows [row, ...) of a lane that is not running (no copy: whoever writes at
        `row` later rewinds first). A row at or past its rows changes nothing."""
        if row >= lane.num_rows:
            return
        self._forget_rows(lane, row)

    def _forget_rows(self, lane: Lane, row: int) -> None:
        """Drop the lane's rows [row, ...): the pages past the one holding row - 1, ids, cut states."""
        keep = pages_for(row, self.page_size)
        self.allocator.decref(lane.pages[keep:])
        del lane.pages[keep:]
        del lane.ids[row:]
        lane.prefilled_upto = min(lane.prefilled_upto, row)
        lane.cut_states = {c: st for c, st in lane.cut_states.items() if c <= row}
        lane.num_borrowed = min(lane.num_borrowed, keep)

    def cow_pages_needed(self, lane: Lane, row: int) -> int:
        """1 if writing at `row` (<= lane's rows) must first copy the page holding it, else 0."""
        if row % self.page_size == 0 or row > lane.num_rows:
            return 0
        idx = row // self.page_size
        if idx >= len(lane.pages):
            return 0
        if idx < lane.num_borrowed:
            return 1  # borrowed from the store: never written
        # Overwriting rows that another holder may read needs a private copy; appending does not.
        overwrite = row < lane.num_rows
        return 1 if overwrite and self.allocator.refcount(lane.pages[idx]) > 1 else 0

    def _copy_last_page(self, lane: Lane) -> PageCopy:
        """Swap the lane's last page for a fresh one. The old page may be freed and taken again
        this round: the plan runs copies in order and before the forward, so it is read first."""
        fresh = self.allocator.allocate(1)
        if fresh is None:
            raise RuntimeError(f"lane {lane.index}: no free page for a copy-on-write")
        old = lane.pages[-1]
        self.allocator.decref([old])
        lane.pages[-1] = fresh[0]
        return PageCopy(old, fresh[0])

    def release(self, lane: Lane) -> None:
        """Drop every page and the identity of `lane`'s rows."""
        self.allocator.decref(lane.pages)
        lane.pages.clear()
        lane.ids.clear()
        lane.num_borrowed = 0
        lane.prefilled_upto = 0
        lane.starts = ()
        lane.images = ()
        lane.namespace = ""
        lane.resident = False
        lane.last_stream_id = None
        lane.restored = None
        lane.cut_states = {}


def starts_below(starts: Sequence[int], cut: int) -> tuple[int, ...]:
    return tuple(s for s in starts if s < cut)


def resident_resume(lane: Lane, stream: Stream, schedule: ScheduleLike, *, invariant_rows: bool) -> int:
    """Rows `stream` may reuse in place from resident `lane` (0: none).

    Only a prompt whose identity extends all the lane's rows continues it. Invariant families
    then resume right after those rows; others only at a cut whose state the lane captured,
    when it is also a cut of the stream's own schedule with the same starts below it.
    At least the prompt's last row is always computed again, for its logits.
    """
    req = stream.req
    images = tuple(im.identity for im in req.images)
    k = match_rows(lane, stream.key_tokens, req.namespace, images)
    if k == 0 or k < lane.num_rows:
        return 0  # the prompt must extend every row the lane holds; partial matches go through the store
    limit = min(k, stream.num_prompt - 1)
    if invariant_rows:
        return limit
    usable = [
        cut for cut in lane.cut_states
        if 0 < cut <= limit and cut in schedule.cuts
        and starts_below(lane.starts, cut) == starts_below(req.chunk_starts, cut)
    ]
    return max(usable, default=0)


@dataclass(frozen=True, slots=True)
class ResidentMatch:
    lane: Lane
    rows: int


def best_resident(
    lanes: Sequence[Lane], stream: Stream, schedule: ScheduleLike, *, invariant_rows: bool
) -> ResidentMatch | None:
    """The resident lane `stream` extends furthest, or None."""
    best: ResidentMatch | None = None
    for lane in lanes:
        if not lane.resident:
            continue
        rows = resident_resume(lane, stream, schedule, invariant_rows=invariant_rows)
        if rows > 0 and (best is None or rows > best.rows):
            best = ResidentMatch(lane, rows)
    return best


def free_seat(lanes: Sequence[Lane]) -> Lane | None:
    """The lowest free lane, or None."""
    for lane in lanes:
        if lane.free:
            return lane
    return None


def resident_victims(lanes: Sequence[Lane], spare: Sequence[Lane]) -> list[Lane]:
    """Resident lanes in eviction order: least recently used first, lanes in `spare` last."""
    residents = [lane for lane in lanes if lane.resident]
    return sorted(residents, key=lambda lane: (lane in spare, lane.last_used))
