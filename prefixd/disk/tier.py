"""`DiskTier`: the prefix store's second tier, written through and read on a RAM miss.

Every entry the RAM store keeps is offered here (`offer`, the store's keep hook): the pages its
parent file lacks are held and exported to host memory by the next round (`PageExport`, an
item of the engine's plan), and when that round lands the file is queued; the writer thread
writes it. A lookup that misses RAM, or hits shallower than disk could, asks `fetch`: the
entry's chain is read and checked, fresh pages are taken for it and it is published into the
RAM store with its state and logits row still to be made (`FromDisk`); the next round loads
the pages first (`DiskLoad`), before any item that reads them, and the request then hits
there like any other. The tier makes no device call of its own: the round is the only one.

Files that are torn, truncated, corrupt or foreign are never served: skipped, logged,
counted (`corrupt`) and removed. Torch-free.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from prefixd.disk.format import (SUFFIX, TEMP_SUFFIX, BadFile, FileMeta, check_layout, encode_head, file_bytes,
                                 read_body, read_head)
from prefixd.disk.index import DiskEntry, DiskIndex, KeyDigests, TierIdentity, cut_hashes
from prefixd.disk.shared import Fetched, SharedTier
from prefixd.disk.writer import FAILED, OFF, WRITTEN, DiskWriter, WriteJob, parts_of
from prefixd.scheduler.pages import PageAllocator
from prefixd.scheduler.chunks import Schedule
from prefixd.scheduler.device import TierSource
from prefixd.scheduler.records import DiskLoad, FromDisk, PageExport, PageLoad, PagePayload
from prefixd.scheduler.store import PRESENT, REPLACED, SAVED, PrefixStore, ReuseKey, Snapshot

log = logging.getLogger("prefixd.disk")
LOCK_FILE = "lock"


@dataclass(frozen=True, slots=True)
class DiskStats:
    bytes: int  # files indexed (written or queued)
    budget_bytes: int
    entries: int
    written_bytes: int
    corrupt: int  # files never served: torn, truncated, corrupt, foreign
    skipped: int  # entries not written: the queue was full, or bigger than the budget
    hit_tokens: int
    off: str | None  # why the tier stopped, or None
    # the shared tier (shared.py): None when off, else "up", "busy: why" or "down: why"
    shared: str | None = None
    shared_hit_tokens: int = 0  # rows served from entries fetched from the shared store
    shared_fetched: int = 0  # chains fetched and verified
    shared_published: int = 0  # files sent to the shared store
    shared_dropped: int = 0  # values that failed a check: never served, deleted there
    shared_errors: int = 0  # times the store failed or did not answer in time
    shared_skipped: int = 0  # files not sent: the store was down, the queue full, or too big


@dataclass(frozen=True, slots=True)
class _Write:
    """A kept entry's file: its export (an item of the next round) and what the file needs after."""

    export: PageExport
    pages: list[int]  # held until the round lands
    head: bytes
    entry: DiskEntry


class DiskObserver:
    """Receives the tier's counts (metrics implement it); every call is cheap."""

    def on_disk(self, stats: DiskStats) -> None:
        return None


class DiskTier:
    """The scheduler's `LowerTier` (prefixd/scheduler/device.py) over one cache directory."""

    def __init__(self, directory: Path, identity: TierIdentity, *, budget_bytes: int,
                 writer: DiskWriter | None = None, observer: Any = None,
                 clock: Callable[[], float] = time.time, shared: SharedTier | None = None) -> None:
        self.directory = Path(directory)
        self.identity = identity
        self._ident = identity.digest()
        self.budget_bytes = budget_bytes
        self.index = DiskIndex(identity.page_size, identity.invariant_rows)
        self.observer = observer if observer is not None else DiskObserver()
        self.clock = clock
        self.off: str | None = None
        self.written_bytes = self.corrupt = self.skipped = self.hit_tokens = 0
        self.shared = shared  # the store other daemons share (shared.py), or None
        self._from_shared: set[bytes] = set()  # fetched from it, not yet written here: not sent back
        self.store: PrefixStore | None = None  # set by attach, before any other call
        self.allocator: PageAllocator | None = None
        self._lock_fd: int | None = None
        # device work for the next round (`take_work`), then in flight until `landed`
        self._loads: list[tuple[DiskLoad, list[int]]] = []  # (load, its pages, held)
        self._exports: list[_Write] = []
        self._loads_in_flight: list[tuple[DiskLoad, list[int]]] = []
        self._exports_in_flight: list[_Write] = []
        self._open()
        self.writer = writer if writer is not None else DiskWriter(self.directory)
        self._report()

    def attach(self, *, store: PrefixStore, allocator: PageAllocator) -> None:
        """Wire to the engine's RAM store and page allocator; the store's keeps come here."""
        self.store, self.allocator = store, allocator
        store.on_keep = self.offer

    # -- device work: items of the next round ---------------------------------------
    @property
    def has_work(self) -> bool:
        """Loads or exports wait for a round (the engine runs one for them even when idle)."""
        return bool(self._loads or self._exports)

    def take_work(self) -> tuple[tuple[DiskLoad, ...], tuple[PageExport, ...]]:
        """The loads and exports for the round being planned; `landed` takes its answer."""
        self._loads_in_flight, self._loads = self._loads_in_flight + self._loads, []
        self._exports_in_flight, self._exports = self._exports_in_flight + self._exports, []
        return (tuple(load for load, _ in self._loads_in_flight),
                tuple(w.export for w in self._exports_in_flight))

    def landed(self, exported: Sequence[PagePayload]) -> None:
        """The round ran the work `take_work` gave it: queue the exports' files (in order: a
        file whose parent was skipped is skipped too) and let every held page go."""
        writes, self._exports_in_flight = self._exports_in_flight, []
        loads, self._loads_in_flight = self._loads_in_flight, []
        if len(exported) != len(writes):
            raise RuntimeError(f"the device answered {len(exported)} exports for {len(writes)}")
        try:
            for w, payload in zip(writes, exported):
                if self.index.entries.get(w.entry.digest) is not w.entry:
                    continue  # evicted from the index (or its parent's write failed) meanwhile
                job = WriteJob(w.entry.digest, w.entry.parent, w.head,
                               parts_of((payload.kv, payload.state, payload.logits)), w.entry.nbytes)
                if not self.writer.submit_write(job):
                    self.skipped += 1
                    self.index.remove_subtree(w.entry)
        finally:
            for w in writes:
                self.allocator.decref(w.pages)
            for _, pages in loads:
                self.allocator.decref(pages)
            self._report()

    def drop_work(self) -> None:
        """After a device failure: forget every load and export not yet landed (their entries
        leave the index unwritten) and let their pages go."""
        for w in self._exports_in_flight + self._exports:
            if self.index.entries.get(w.entry.digest) is w.entry:
                self.index.remove_subtree(w.entry)
            self.allocator.decref(w.pages)
        for _, pages in self._loads_in_flight + self._loads:
            self.allocator.decref(pages)
        self._exports = self._exports_in_flight = []
        self._loads = self._loads_in_flight = []

    def held_pages(self) -> list[int]:
        """Pages held for loads and exports not yet landed (one reference each)."""
        return [p for w in self._exports_in_flight + self._exports for p in w.pages] + \
            [p for _, pages in self._loads_in_flight + self._loads for p in pages]

    # -- start-up ---------------------------------------------------------------------
    def _open(self) -> None:
        """Rebuild the index from the files: stray temp files and bad files are removed."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_directory()
        metas: dict[bytes, tuple[FileMeta, float]] = {}
        for item in os.scandir(self.directory):
            if item.name.endswith(TEMP_SUFFIX):
                self._bad(Path(item.path), "an unfinished write")
            elif item.name.endswith(SUFFIX):
                got = self._scan(Path(item.path))
                if got is not None:
                    metas[got[0].digest] = got
        added: set[bytes] = set()
        for digest in sorted(metas, key=lambda d: metas[d][1]):
            self._add_scanned(digest, metas, added)

    def _lock_directory(self) -> None:
        """One daemon per directory: another would take this one's temp files for torn writes.
        Raises OSError (the caller turns the tier off) when another process holds it."""
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"another process uses {self.directory}") from None
        self._lock_fd = fd  # held until close() or the process ends

    def _scan(self, path: Path) -> tuple[FileMeta, float] | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                meta, _ = read_head(f, self._ident, st.st_size)
            if path.name != meta.digest.hex() + SUFFIX:
                raise BadFile("named for another entry")
            check_layout(meta, self.identity)
            return meta, st.st_mtime
        except BadFile as e:
            self._bad(path, str(e))
        except OSError as e:
            self._bad(path, f"unreadable: {e}")
        return None

    def _add_scanned(self, digest: bytes, metas: dict, added: set[bytes]) -> None:
        """Index `digest` after its ancestors; a file whose chain breaks is removed."""
        chain = []
        while digest is not None and digest not in added:  # walk up to an indexed ancestor or a root
            meta, mtime = metas.pop(digest, (None, 0.0))
            if meta is None:
                for orphan, _, _ in chain:
                    self._remove_file(orphan.digest, f"its parent {digest.hex()[:12]} is gone")
                return
            chain.append((meta, mtime, digest))
            digest = meta.parent
        for meta, mtime, d in reversed(chain):
            size = (self.directory / f"{d.hex()}{SUFFIX}").stat().st_size
            self.index.add(DiskEntry(d, meta.parent, meta.cut, meta.first_page, meta.num_pages, size,
                                     meta.logits_bytes > 0, self.index.next_seq(), mtime, durable=True))
            added.add(d)

    # -- write-through ----------------------------------------------------------------
    def offer(self, key: ReuseKey, schedule: Schedule, cut: int, pages: Sequence[int], snapshot: Snapshot) -> str:
        """Index the entry the RAM store just kept and hold its pages for an export in the next
        round; its file is queued when that round lands. Returns "queued", "present",
        "skipped" or "off"."""
        if self.off is not None:
            return "off"
        self.poll()
        digest = KeyDigests(key).at(cut, cut_hashes(key, schedule, self.identity.invariant_rows)(cut))
        known = self.index.entries.get(digest)
        if known is not None:
            known.last_used = self.clock()
            return "present"
        parent = self.index.find(key, schedule, below=cut, durable_only=False)
        P = self.identity.page_size
        first, num = (parent.cut // P if parent is not None else 0), -(-cut // P)
        state = snapshot.state if snapshot.state is not None and snapshot.state.nbytes else None
        meta = FileMeta(digest, parent.digest if parent else None, cut, first, num,
                        (num - first) * self.identity.kv_bytes_per_page,
                        state.nbytes if state is not None else 0,
                        snapshot.logits.nbytes if snapshot.logits is not None else 0)
        head = encode_head(self._ident, meta)
        nbytes = file_bytes(head, meta)
        if nbytes > self.budget_bytes or not self.writer.has_room(meta.body_bytes):
            self.skipped += 1
            self._report()
            return "skipped"
        held = list(pages[first:num])
        self.allocator.incref(held)  # never freed (nor written again) before the export reads them
        entry = DiskEntry(digest, meta.parent, cut, first, num, nbytes, meta.logits_bytes > 0,
                          self.index.next_seq(), self.clock())
        self._exports.append(_Write(PageExport(tuple(held), state, snapshot.logits), held, head, entry))
        self.index.add(entry)
        self._fit(frozenset(e.digest for e in self.index.chain(entry)))
        self._report()
        return "queued"

    def _fit(self, protect: frozenset[bytes]) -> None:
        for victim in self.index.victims(self.budget_bytes, protect):
            self.index.remove(victim)
            self.writer.submit_delete(victim.digest)

    def poll(self) -> None:
        """Take the writer's results: entries become servable, failed ones leave the index.
        Reports the stats when anything changed (the shared tier's threads change its counts
        and state between calls)."""
        results = self.writer.drain()
        for r in results:
            entry = self.index.entries.get(r.digest) if r.digest is not None else None
            fetched = r.digest in self._from_shared  # came from the shared store: not sent back
            self._from_shared.discard(r.digest)
            if r.kind == WRITTEN:
                self.written_bytes += r.nbytes
                if entry is not None:
                    entry.durable = True
                    if self.shared is not None and not fetched:
                        self.shared.publish(entry.digest, entry.cut, self.directory / f"{entry.name}{SUFFIX}",
                                            [e.digest for e in self.index.chain(entry)[:-1]])
            elif r.kind == FAILED and entry is not None:
                self.index.remove_subtree(entry)
            elif r.kind == OFF:
                self.off = r.message
        if results or self.stats() != self._reported:
            self._report()

    # -- read -------------------------------------------------------------------------
    def fetch(self, key: ReuseKey, schedule: Schedule, have_rows: int) -> TierSource | None:
        """Put the deepest entry of `key` deeper than `have_rows` into the RAM store: from the
        shared store when it holds one deeper than this disk, else from this disk. "shared" or
        "disk" (where it came from) when the store now holds it (a lookup will hit it); None
        changes nothing the request can see (a bad file found on the way is removed and counted)."""
        if self.off is not None or (not self.index.entries and self.shared is None):
            return None
        self.poll()
        entry = self.index.find(key, schedule, observe=True) if self.index.entries else None
        if self.shared is not None:
            chain = self.shared.fetch(key, schedule, max(have_rows, entry.cut if entry is not None else 0))
            bodies = self._adopt(chain) if chain is not None else None
            if bodies is not None:
                return "shared" if self._serve(key, schedule, bodies, shared=True) else None
        if entry is None or entry.cut <= have_rows:
            return None
        bodies = self._read_chain(entry)
        if bodies is None:
            return None
        return "disk" if self._serve(key, schedule, bodies, shared=False) else None

    def _adopt(self, chain: list[Fetched]) -> list[tuple[DiskEntry, bytearray, FileMeta]] | None:
        """Index a chain fetched from the shared store and queue its files here (so the next
        hit is local); its entries are in the index before the RAM store's keep hook sees
        them. None (nothing indexed) when the writer or the budget has no room."""
        if sum(file_bytes(f.head, f.meta) for f in chain) > self.budget_bytes \
                or not self.writer.has_room(sum(f.meta.body_bytes for f in chain)):
            self.skipped += 1
            return None
        out, added = [], []
        for f in chain:
            entry = self.index.entries.get(f.meta.digest)
            if entry is None:
                nbytes = file_bytes(f.head, f.meta)
                entry = DiskEntry(f.meta.digest, f.meta.parent, f.meta.cut, f.meta.first_page, f.meta.num_pages,
                                  nbytes, f.meta.logits_bytes > 0, self.index.next_seq(), self.clock())
                self.index.add(entry)
                added.append(entry)
                job = WriteJob(entry.digest, entry.parent, f.head, parts_of((f.body,)), nbytes)
                if not self.writer.submit_write(job):
                    self.skipped += 1
                    self.index.remove_subtree(added[0])
                    return None
                self._from_shared.add(entry.digest)
            out.append((entry, f.body, f.meta))
        self._fit(frozenset(e.digest for e, _, _ in out))
        return out

    def _serve(self, key: ReuseKey, schedule: Schedule, bodies: list[tuple[DiskEntry, bytearray, FileMeta]], *,
               shared: bool) -> bool:
        """Publish the checked chain `bodies` (root first) into the RAM store, its pages to be
        loaded by the next round."""
        entry = bodies[-1][0]
        pages = self._take_pages(entry.num_pages)
        if pages is None:
            return False
        load = self._load(entry, bodies, pages)
        snapshot = Snapshot(state=load.state_to, logits=load.logits_to)
        result = self.store.publish(key, schedule, entry.cut, pages, snapshot, prefilled_upto=entry.cut)
        if result in (SAVED, REPLACED):
            self._loads.append((load, pages))  # held until the load has run: the store may let go first
        else:
            self.allocator.decref(pages)  # nothing kept needs them
        if result not in (SAVED, PRESENT, REPLACED):
            return False
        entry.hits += 1
        entry.last_used = self.clock()
        if shared:
            self.shared.hit_tokens += entry.cut
        else:
            self.hit_tokens += entry.cut
        self._touch(entry)
        self._report()
        return True

    def _read_chain(self, entry: DiskEntry) -> list[tuple[DiskEntry, bytearray, FileMeta]] | None:
        out = []
        for e in self.index.chain(entry):
            path = self.directory / f"{e.name}{SUFFIX}"
            try:
                with open(path, "rb") as f:
                    meta, offset = read_head(f, self._ident, os.fstat(f.fileno()).st_size)
                    if meta.digest != e.digest:
                        raise BadFile("named for another entry")
                    out.append((e, read_body(f, meta, offset), meta))
            except (BadFile, OSError) as err:
                self._drop_bad(e, str(err))
                return None
        return out

    def _take_pages(self, num: int) -> list[int] | None:
        if not self.allocator.can_allocate(num):
            self.store.make_room(num)
        return self.allocator.allocate(num)

    def _load(self, entry: DiskEntry, bodies: list, pages: list[int]) -> DiskLoad:
        """The load of `entry`'s chain into `pages`, for the next round; its state and logits
        row are made on the device then (`FromDisk`)."""
        bpp = self.identity.kv_bytes_per_page
        loads = []
        for i, (e, body, meta) in enumerate(bodies):
            end = bodies[i + 1][0].first_page if i + 1 < len(bodies) else e.num_pages
            view = memoryview(body)
            loads.append(PageLoad(tuple(pages[e.first_page:end]), view[: (end - e.first_page) * bpp]))
        _, body, meta = bodies[-1]
        view = memoryview(body)
        state = view[meta.kv_bytes: meta.kv_bytes + meta.state_bytes] if meta.state_bytes else None
        logits = view[meta.kv_bytes + meta.state_bytes:] if meta.logits_bytes else None
        return DiskLoad(tuple(loads), state, logits,
                        FromDisk(len(state)) if state is not None else None,
                        FromDisk(len(logits)) if logits is not None else None)

    def _touch(self, entry: DiskEntry) -> None:
        try:  # the last use survives a restart as the file's mtime
            os.utime(self.directory / f"{entry.name}{SUFFIX}")
        except OSError:
            pass  # a file we cannot touch still serves; its order after a restart is older

    # -- bad files --------------------------------------------------------------------
    def _bad(self, path: Path, why: str) -> None:
        self.corrupt += 1
        log.warning("disk cache: removed %s: %s", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk cache: cannot remove %s: %s", path.name, e)

    def _remove_file(self, digest: bytes, why: str) -> None:
        log.warning("disk cache: removed %s: %s", digest.hex()[:12], why)
        (self.directory / f"{digest.hex()}{SUFFIX}").unlink(missing_ok=True)

    def _drop_bad(self, entry: DiskEntry, why: str) -> None:
        """A file failed its check on read: it and the entries chaining on it leave."""
        self.corrupt += 1
        log.warning("disk cache: %s not served: %s", entry.name[:12], why)
        for e in self.index.remove_subtree(entry):
            self.writer.submit_delete(e.digest)
        self._report()

    # -- reporting and shutdown -------------------------------------------------------
    def stats(self) -> DiskStats:
        shared = {} if self.shared is None else {f"shared_{k}" if k != "state" else "shared": v
                                                 for k, v in self.shared.stats().items()}
        return DiskStats(self.index.bytes, self.budget_bytes, len(self.index), self.written_bytes,
                         self.corrupt, self.skipped, self.hit_tokens, self.off, **shared)

    def _report(self) -> None:
        self._reported = self.stats()
        self.observer.on_disk(self._reported)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for every queued write (and take their results); False on timeout."""
        done = self.writer.flush(timeout_s)
        self.poll()
        if self.shared is not None:  # what was just written is sent on too
            done = self.shared.flush(timeout_s) and done
        return done

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the queued writes, end the writer, and let another process use the directory."""
        self.writer.close(timeout_s)
        self.poll()
        if self.shared is not None:
            self.shared.close(timeout_s)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
