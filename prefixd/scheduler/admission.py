"""Admission: the FIFO wait queue and seating streams on lanes (resident, store hit, or cold)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from prefixd.scheduler.device import LowerTier
from prefixd.scheduler.lanes import (Lane, PageTables, ResidentMatch, best_resident, free_seat, pages_for,
                                     resident_resume, resident_victims, starts_below)
from prefixd.scheduler.chunks import plan_schedule
from prefixd.scheduler.diagnosis import CACHE_OFF, EVICTED, Diagnosis, diagnose, full_hit
from prefixd.scheduler.records import CacheResult, DeviceRows, DeviceState, PageCopy
from prefixd.scheduler.store import Hit, PrefixStore, Snapshot, make_key
from prefixd.scheduler.streams import Stream


class WaitQueue:
    """Streams waiting for a lane, in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Stream] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Stream]:
        return iter(list(self._queue))

    def ordered(self, key: Callable[[Stream], Any] | None) -> list[Stream]:
        """The waiting streams sorted by `key` (arrival order without one; sorting is stable)."""
        return sorted(self._queue, key=key) if key is not None else list(self._queue)

    def push(self, stream: Stream) -> None:
        self._queue.append(stream)

    def remove(self, stream: Stream) -> bool:
        try:
            self._queue.remove(stream)
        except ValueError:
            return False
        return True


@dataclass(frozen=True, slots=True)
class Seating:
    """Admission's decision for one stream. The lane's pages and row identity are already set
    (later decisions count on them); the engine binds the stream and turns the rest into the
    round's plan items, which the device runs before the round's forward.
    """

    stream: Stream
    lane: int
    resume: int  # rows reused: the lane's own (resident) or a hit's borrowed pages
    result: CacheResult
    reset: bool = False  # zero the lane's non-page state
    restore: DeviceState | None = None  # or put this state on it (a snapshot or a resident cut)
    page_copies: tuple[PageCopy, ...] = ()  # copy-on-write of the page holding row `resume`
    stored_logits: DeviceRows | None = None  # a full hit: the first token comes from this row


class Admitter:
    """Seats waiting streams on lanes: resident continuation, store hit, or cold.

    Owns the wait queue; may evict resident lanes (publishing them first) and ask the store
    for room. Makes no device call: each seating says what the device must do for it.
    """

    def __init__(
        self,
        *,
        lanes: list[Lane],
        tables: PageTables,
        store: PrefixStore | None,
        grid: int,
        headroom_rows: int,
        max_context: int,
        cache: bool,
        invariant_rows: bool,
        lookahead: int,
        disk: LowerTier | None = None,
        order_key: Callable[[Stream], Any] | None = None,
    ) -> None:
        self.lanes = lanes
        self.tables = tables
        self.store = store
        self.grid = grid
        self.headroom_rows = headroom_rows
        self.max_context = max_context
        self.cache = cache
        self.invariant_rows = invariant_rows
        self.lookahead = lookahead
        self.page_size = tables.page_size
        self.disk = disk  # asked when RAM misses (None: no lower tier)
        self.waiting = WaitQueue()
        self.order_key = order_key  # the order waiting streams are seated in (None: arrival)

    def reuse_allowed(self, stream: Stream) -> bool:
        return self.cache and stream.req.cache and stream.key is not None

    def admit(self) -> list[Seating]:
        """Seat waiting streams in `order_key`'s order (least served client first, FIFO within
        one); a stream whose resident lane exists goes first. A stream that cannot be seated
        stops the rest: nothing overtakes it."""
        seated = []
        for stream in self.waiting.ordered(self.order_key):
            match = self._resident_match(stream)
            if match is not None:
                seated.append(self._place(stream, match.lane, match.rows, "resident", None))
        for stream in self.waiting.ordered(self.order_key):
            seating = self._try_seat(stream)
            if seating is None:
                break
            seated.append(seating)
        return seated

    def forget(self, stream: Stream) -> None:
        """A waiting stream left: let go of its hit's pages and pin."""
        self.waiting.remove(stream)
        self._drop_hit(stream)

    def _drop_hit(self, stream: Stream) -> None:
        if stream.hit is not None:
            self.tables.allocator.decref(stream.hit.pages)
            self.store.unpin(stream.hit)
        stream.hit = None

    def _resident_match(self, stream: Stream) -> ResidentMatch | None:
        if not self.reuse_allowed(stream):
            return None
        match = best_resident(self.lanes, stream, stream.schedule, invariant_rows=self.invariant_rows)
        if match is None:
            return None
        need = self._pages_to_seat(stream, match.rows) + self.tables.cow_pages_needed(match.lane, match.rows)
        if not self.free_pages(need, spare=(match.lane,)):
            return None
        return match

    def _try_seat(self, stream: Stream) -> Seating | None:
        lane = free_seat(self.lanes)
        if lane is None:
            others = [s for s in self.waiting if s is not stream]
            victims = resident_victims(self.lanes, spare=[v for v in self.lanes if self._wanted(v, others)])
            if not victims:
                return None
            lane = victims[0]
            self.evict_resident(lane)
        if not stream.looked_up and self.store is not None and self.reuse_allowed(stream):
            self._look_up(stream)
        hit = stream.hit
        rows = hit.rows if hit is not None else 0
        need = self._pages_to_seat(stream, rows)
        need += 1 if hit is not None and rows % self.page_size else 0  # copy of a borrowed tail page
        if not self.free_pages(need, spare=(lane,)):
            if any(other.busy for other in self.lanes):
                return None  # running lanes will give pages back
            # Nothing runs, so waiting frees nothing: let go of the hit's pin and, if still
            # short, of everything the store holds unpinned.
            self._drop_hit(stream)
            stream.diagnosis = Diagnosis(EVICTED)
            hit, rows = None, 0
            if not self.free_pages(self._pages_to_seat(stream, 0), spare=(lane,), last_resort=True):
                return None
        result = ("shared" if stream.hit_shared else "hit") if hit is not None \
            else "miss" if self.reuse_allowed(stream) else "off"
        if result == "off":
            stream.diagnosis = Diagnosis(CACHE_OFF)
        return self._place(stream, lane, rows, result, hit)

    def _look_up(self, stream: Stream) -> None:
        """Ask the store once per stream; a hit's pages are held (and its entry pinned) from now
        on, so making room for the stream cannot evict what it resumes from."""
        stream.looked_up = True
        hit = self.store.lookup(stream.key, stream.schedule)
        source = self.disk.fetch(stream.key, stream.schedule, hit.rows if hit is not None else 0) \
            if self.disk is not None else None
        if source:
            hit = self.store.lookup(stream.key, stream.schedule, count=False)  # the disk entry, now in RAM
            stream.hit_shared = source == "shared"
        if not full_hit(stream, hit):  # read-only: what it finds goes to usage, never to the seating
            stream.diagnosis = diagnose(stream, hit, self.store, self.lanes, invariant_rows=self.invariant_rows)
        if hit is not None:
            self.tables.allocator.incref(hit.pages)
            self.store.pin(hit)
            stream.hit = hit

    def _wanted(self, lane: Lane, waiting: list[Stream]) -> bool:
        """True if some waiting stream would continue resident `lane`."""
        for stream in waiting:
            if lane.resident and self.reuse_allowed(stream):
                if resident_resume(lane, stream, stream.schedule, invariant_rows=self.invariant_rows) > 0:
                    return True
        return False

    def _pages_to_seat(self, stream: Stream, resume: int) -> int:
        """Fresh pages to hold the prompt and the decode headroom when `resume` rows are reused."""
        rows = min(stream.num_prompt + min(self.headroom_rows, stream.req.max_tokens), self.max_context)
        pages = min(pages_for(rows, self.page_size), self.tables.allocator.num_pages)  # headroom never blocks forever
        return max(0, pages - pages_for(resume, self.page_size))

    def free_pages(self, need: int, spare: Sequence[Lane], *, last_resort: bool = False) -> bool:
        """Make `need` pages free: ask the store, then evict resident lanes (LRU), never `spare`;
        with `last_resort`, then clear the store's unpinned entries."""
        allocator = self.tables.allocator
        if allocator.can_allocate(need):
            return True
        if self.store is not None:
            self.store.make_room(need)
        for victim in resident_victims(self.lanes, spare=spare):
            if allocator.can_allocate(need) or victim in spare:
                break
            self.evict_resident(victim)
            if self.store is not None and not allocator.can_allocate(need):
                self.store.make_room(need)
        if last_resort and self.store is not None and not allocator.can_allocate(need):
            self.store.clear()  # last resort: every lane is waiting on pages the store still holds
        return allocator.can_allocate(need)

    def evict_resident(self, lane: Lane) -> None:
        """Free a resident lane; an invariant family's rows are published to the store first."""
        if self.store is not None and self.invariant_rows and lane.num_rows > 0:
            key, _ = make_key(lane.ids, namespace=lane.namespace, images=lane.images, lookahead=self.lookahead)
            if key is not None and key.has_rows(lane.num_rows):
                n = lane.num_rows
                schedule = plan_schedule(n, starts_below(lane.starts, n), self.grid)
                self.store.publish(key, schedule, n, lane.pages, Snapshot(), prefilled_upto=n)
        self.tables.release(lane)

    def _place(self, stream: Stream, lane: Lane, resume: int, result: CacheResult, hit: Hit | None) -> Seating:
        """Bind `stream` to `lane`, reusing `resume` rows (the lane's own, or `hit`'s pages)."""
        req = stream.req
        self.waiting.remove(stream)
        if result == "resident":
            self._drop_hit(stream)  # found while it waited; continuing in place wins over any copy
            stream.diagnosis = None
            state = self._continue_resident(stream, lane, resume)
        else:
            self.tables.release(lane)
            state = self._take_hit(lane, stream, hit)
        copies = self.tables.rewind(lane, resume)
        lane.stream = stream
        lane.namespace = req.namespace
        lane.images = tuple(im.identity for im in req.images)
        lane.starts = req.chunk_starts
        if not self.tables.grow(lane, stream.num_prompt):
            raise RuntimeError(f"lane {lane.index}: pages checked free for admission are gone")
        stored = None
        if resume == stream.num_prompt:  # a full hit: the first token comes from the stored logits row
            stored = hit.snapshot.logits if hit is not None and hit.snapshot is not None else None
            if stored is None:
                raise RuntimeError(f"stream {stream.stream_id}: a hit on the whole prompt without a logits row")
        reset = result != "resident" and state is None
        return Seating(stream, lane.index, resume, result, reset=reset, restore=state, page_copies=copies,
                       stored_logits=stored)

    def _continue_resident(self, stream: Stream, lane: Lane, resume: int) -> DeviceState | None:
        """The lane keeps its rows; a non-invariant family goes back to its state at `resume`."""
        lane.resident = False
        if self.store is not None:
            self.store.note_latest(stream.key)
        return None if self.invariant_rows else lane.cut_states[resume]

    def _take_hit(self, lane: Lane, stream: Stream, hit: Hit | None) -> DeviceState | None:
        """Start `lane` from `hit` (borrowed pages; returns its snapshot state) or from zero (None)."""
        stream.hit = None
        if hit is None:
            return None
        lane.pages.extend(hit.pages)  # the stream's references pass to the lane
        lane.num_borrowed = len(hit.pages)
        lane.ids.extend(stream.key_tokens[: hit.rows])
        lane.prefilled_upto = hit.rows
        lane.restored = hit
        return hit.snapshot.state if hit.snapshot is not None else None
