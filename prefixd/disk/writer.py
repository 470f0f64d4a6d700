"""The writer thread: entry files written off the engine thread, with bounded memory.

    engine thread                         writer thread
    -------------                         -------------
    submit_write(job) ── queue (bytes ≤ max_pending_bytes) ──▶ temp file, write, fsync,
    submit_delete(name)                                        rename, fsync the directory
    drain() ◀── results: written / failed / off ──────────────

The writer runs no torch op: the engine thread has already copied the page bytes into host
buffers (torch's OpenMP pool belongs to the thread that first runs a parallel op). Any
OSError (ENOSPC, EIO, a read-only directory, ...) turns writing off for good, with one
warning; the daemon serves on from RAM.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from prefixd.disk.format import SUFFIX, TEMP_SUFFIX, body_hasher

log = logging.getLogger("prefixd.disk")
DEFAULT_MAX_PENDING_BYTES = 256 << 20

WRITTEN, FAILED, OFF = "written", "failed", "off"


@dataclass(frozen=True, slots=True)
class WriteJob:
    digest: bytes
    parent: bytes | None
    head: bytes
    parts: tuple[memoryview, ...]  # the body, in order
    nbytes: int  # what the file will hold

    @property
    def buffered_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass(frozen=True, slots=True)
class Result:
    kind: str  # WRITTEN | FAILED | OFF
    digest: bytes | None
    nbytes: int = 0
    message: str = ""


class DiskWriter:
    """One thread writing entry files into `directory`. `write` and `fsync` are os.write and
    os.fsync (tests pass failing ones)."""

    def __init__(self, directory: Path, *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 write: Callable[[int, memoryview], int] = os.write,
                 fsync: Callable[[int], None] = os.fsync) -> None:
        self.directory = Path(directory)
        self.max_pending_bytes = max_pending_bytes
        self._write = write
        self._fsync = fsync
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._results: deque[Result] = deque()
        self._failed: set[bytes] = set()
        self.off: str | None = None  # why writing stopped
        self._thread = threading.Thread(target=self._run, name="prefixd-disk-writer", daemon=True)
        self._thread.start()

    # -- engine thread ------------------------------------------------------------------
    def has_room(self, nbytes: int) -> bool:
        with self._lock:
            return self.off is None and self._pending_bytes + nbytes <= self.max_pending_bytes

    def submit_write(self, job: WriteJob) -> bool:
        """Queue a file; False (nothing queued) when the queue's bytes would pass the bound."""
        size = job.buffered_bytes
        with self._lock:
            if self.off is not None or self._pending_bytes + size > self.max_pending_bytes:
                return False
            self._pending_bytes += size
        self._jobs.put(job)
        return True

    def submit_delete(self, digest: bytes) -> None:
        self._jobs.put(("delete", digest))

    def drain(self) -> list[Result]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every job queued so far is done; False on timeout."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        return done.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish the queued jobs and end the thread."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    # -- writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if isinstance(job, WriteJob):
                    self._do_write(job)
                elif job[0] == "delete":
                    self._do_delete(job[1])
                else:
                    job[1].set()
            except Exception as e:  # a bug must not stop the thread: flush() and close() wait on it
                log.exception("disk cache writer failed")
                self._turn_off(f"writer error {e!r}")

    def _do_write(self, job: WriteJob) -> None:
        try:
            if self.off is not None or job.parent in self._failed:
                self._failed.add(job.digest)
                self._results.append(Result(FAILED, job.digest, message="not written"))
                return
            self._write_file(job)
            self._results.append(Result(WRITTEN, job.digest, job.nbytes))
        except OSError as e:
            self._failed.add(job.digest)
            self._turn_off(f"{e.strerror or e} writing {self.directory}")
            self._results.append(Result(FAILED, job.digest, message=str(e)))
        finally:
            with self._lock:
                self._pending_bytes -= job.buffered_bytes

    def _write_file(self, job: WriteJob) -> None:
        name = job.digest.hex()
        temp = self.directory / f".{name}.{os.getpid()}{TEMP_SUFFIX}"
        final = self.directory / f"{name}{SUFFIX}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            h = body_hasher()
            self._write_all(fd, memoryview(job.head))
            for part in job.parts:
                self._write_all(fd, part)
                h.update(part)
            self._write_all(fd, memoryview(h.digest()))
            self._fsync(fd)
        except OSError:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(temp, final)
        self._fsync_dir()

    def _write_all(self, fd: int, data: memoryview) -> None:
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while data:
            n = self._write(fd, data)
            data = data[n:]

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._fsync(fd)
        finally:
            os.close(fd)

    def _do_delete(self, digest: bytes) -> None:
        try:
            (self.directory / f"{digest.hex()}{SUFFIX}").unlink(missing_ok=True)
        except OSError as e:
            self._turn_off(f"{e.strerror or e} removing from {self.directory}")

    def _turn_off(self, why: str) -> None:
        with self._lock:
            if self.off is not None:
                return
            self.off = why
        log.warning("disk cache off: %s; serving on from RAM", why)
        self._results.append(Result(OFF, None, message=why))


def parts_of(buffers: Sequence[object | None]) -> tuple[memoryview, ...]:
    """The non-empty buffers as byte views."""
    out = []
    for b in buffers:
        if b is None:
            continue
        view = memoryview(b)  # type: ignore[arg-type]
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if view.nbytes:
            out.append(view)
    return tuple(out)
