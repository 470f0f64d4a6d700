"""`EngineHost`: runs the single-threaded scheduler Engine in its own thread.

    event loop                         engine thread
    ----------                         -------------
    submit/cancel/call ── commands ──▶ drained before every step()
    per-stream receive  ◀── batches ── after every step(), one call_soon_threadsafe

The event loop never blocks on a forward: every engine call crosses the command queue, and
the engine thread sleeps on a condition while it has nothing to run.

While busy the process keeps freed heap for the next round (`retain_freed_memory`); once
the engine has been idle for `idle_trim_s` it hands that heap back to the system, once per
idle spell, so a burst does not leave the daemon at its peak RSS.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import hashlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from prefixd.daemon.admission import return_freed_memory

log = logging.getLogger("prefixd.engine")
T = TypeVar("T")

DEFAULT_EVENT_BUFFER = 1024  # events queued per stream before its client counts as not reading
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc mallopt parameters (malloc.h)
RETAINED_FREE_BYTES = 1 << 30  # free heap kept before malloc gives memory back to the kernel
IDLE_TRIM_S = 5.0  # idle time after which the retained heap goes back to the system


@dataclass(frozen=True, slots=True)
class StreamTokens:
    """Tokens of one round for one stream, with the sha256 of each logits row when asked."""

    stream_id: int
    ids: tuple[int, ...]
    logits_sha256: tuple[str, ...] | None = None
    logprobs: tuple[Any, ...] | None = None  # scheduler.records.TokenLogprob per id, when asked


class EngineFailed(RuntimeError):
    """The engine thread stopped on an error; every open stream ends with finish_reason error."""


def logits_sha256(rows: Any) -> tuple[str, ...]:
    """Hex sha256 of each row's float32 bytes (rows: a (n, vocab) float32 array-like)."""
    if hasattr(rows, "detach"):  # device tensors come back to host memory first
        rows = rows.detach().cpu()
    array = np.ascontiguousarray(np.asarray(rows, dtype=np.float32))
    if array.ndim == 1:
        array = array[None, :]
    return tuple(hashlib.sha256(row.tobytes()).hexdigest() for row in array)


def retain_freed_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse instead of handing it back to the kernel.

    Every lane round allocates and frees the same large temporaries; memory given back (a
    trimmed heap top, an unmapped block) is faulted in again page by page on the next round.
    So: no blocks of their own mapping, and no trimming below RETAINED_FREE_BYTES. The
    process then holds its largest round's working memory. Process-wide; returns False,
    changing nothing, where the C library has no mallopt (not glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, RETAINED_FREE_BYTES)) and bool(mallopt(_M_MMAP_MAX, 0))


def one_malloc_arena() -> bool:
    """Make every thread allocate from glibc's main heap (one arena).

    An idle trim (`malloc_trim`) gives back the main heap's free top, but a worker thread's own
    arena keeps its free top resident for good: after a soak, the memory left above the
    daemon's starting RSS sat in three such arenas. With one arena the idle trim returns it.
    Call it before the process starts threads (threads keep the arena they first used).
    Returns False, changing nothing, where the C library has no mallopt (not glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, 1))


def return_idle_memory() -> None:
    """Collect cyclic garbage (a render's cancelled frames, exception tracebacks), then hand
    freed heap back to the system: what an idle daemon does once per idle spell."""
    gc.collect()
    return_freed_memory()


class EngineHost:
    """Owns the engine thread and routes each stream's events to a bounded memory stream.

    `on_overflow(stream_id)` is called in the event loop when a stream's buffer is full
    (its client does not read); the stream is then cancelled in the engine and its receive
    side sees the end of stream.
    """

    def __init__(self, engine: Any, *, event_buffer: int = DEFAULT_EVENT_BUFFER,
                 on_overflow: Callable[[int], None] | None = None,
                 before_round: Callable[[], object] | None = None,
                 idle_trim_s: float | None = IDLE_TRIM_S,
                 trim: Callable[[], object] | None = None) -> None:
        self.engine = engine
        self._idle_trim_s = idle_trim_s  # None: never trim
        self._trim = trim or return_idle_memory  # on the engine thread after idle_trim_s without work
        self._trim_due = False  # rounds or calls ran since the last trim
        self.num_trims = 0
        self._before_round = before_round  # called on the engine thread (thread policy)
        self._event_buffer = event_buffer
        self._on_overflow = on_overflow
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sinks: dict[int, MemoryObjectSendStream[Any]] = {}
        self.failure: BaseException | None = None
        self.num_failed_rounds = 0
        self.failed = anyio.Event()

    # -- lifecycle (event loop) -------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread (and keep freed memory for its rounds, `retain_freed_memory`)."""
        retain_freed_memory()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="prefixd-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Let the thread finish its current step and pending commands, then join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await anyio.to_thread.run_sync(self._thread.join)
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()

    @property
    def num_open_streams(self) -> int:
        return len(self._sinks)

    # -- calls (event loop) -----------------------------------------------------------------

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; its exception is re-raised here."""
        if self.failure is not None:
            raise EngineFailed(f"engine stopped: {self.failure!r}")
        if self._stopping:
            raise EngineFailed("engine is shutting down")
        assert self._loop is not None, "EngineHost.start() was not awaited"
        future: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:  # handed to the awaiting task, which decides
                self._post(_set_exception, future, e)
            else:
                self._post(_set_result, future, result)

        self._push(run)
        return await future

    async def submit(self, request: Any) -> MemoryObjectReceiveStream[Any]:
        """Submit a StreamRequest; returns the stream of its StreamTokens ending with its DoneEvent.

        Raises the engine's RequestError for a bad request (nothing is left registered).
        """
        stream_id = request.stream_id
        if stream_id in self._sinks:
            raise ValueError(f"stream {stream_id} is already open")
        send, receive = anyio.create_memory_object_stream[Any](self._event_buffer)
        self._sinks[stream_id] = send
        try:
            await self.call(lambda engine: engine.submit(request))
        except BaseException:
            self._drop(stream_id)
            receive.close()
            self.cancel_nowait(stream_id)  # a wait cancelled after the submit was queued: end it too
            raise
        return receive

    def cancel_nowait(self, stream_id: int, keep_rows: int | None = None) -> None:
        """Ask the engine to cancel a stream; its DoneEvent (cancelled) still arrives.
        `keep_rows`: see Engine.cancel."""
        if keep_rows is None:
            self._push(lambda: self.engine.cancel(stream_id))
        else:
            self._push(lambda: self.engine.cancel(stream_id, keep_rows))

    # -- engine thread ----------------------------------------------------------------------

    def _push(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and self.engine.idle and not self._stopping:
                        if not self._cond.wait(self._idle_wait_s()):
                            break  # idle for idle_trim_s: trim below, outside the lock
                    if self._stopping and not self._commands:
                        return
                    commands, self._commands = self._commands, deque()
                if not commands and self.engine.idle:
                    self._trim_idle()
                    continue
                self._trim_due = True
                for command in commands:
                    command()
                if not self.engine.idle and not self._stopping:
                    if self._before_round is not None:
                        self._before_round()
                    events = self._step()
                    if events:
                        self._post(self._dispatch, [_host_event(e) for e in events])
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which shuts down
            log.exception("engine thread stopped")
            self._post(self._fail, e)

    def _idle_wait_s(self) -> float | None:
        """How long to sleep before an idle trim is due (None: until woken)."""
        return self._idle_trim_s if self._trim_due else None

    def _trim_idle(self) -> None:
        """`idle_trim_s` passed with no command and no round: return the retained heap."""
        self._trim_due = False
        self._trim()
        self.num_trims += 1
        log.debug("engine idle for %.1fs: returned freed heap to the system", self._idle_trim_s)

    def _step(self) -> list[Any]:
        """One round. A lane that failed alone ends only its stream (the engine did that); a
        failed round, the device's own failure, ends every stream with "error"; serving goes on."""
        try:
            events = self.engine.step()
        except Exception as e:
            log.exception("lane round failed; ending every stream with finish_reason error")
            self.num_failed_rounds += 1
            return self.engine.abort(f"the device failed during a lane round: {e!r}")
        for event in events:
            if getattr(event, "finish_reason", None) == "error":
                log.warning("stream %d ended with error: %s", event.stream_id, event.note)
        return events

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            log.debug("event loop closed; dropping %s", getattr(fn, "__name__", fn))

    # -- delivery (event loop) --------------------------------------------------------------

    def _dispatch(self, events: list[Any]) -> None:
        for event in events:
            if not isinstance(event, StreamTokens):
                log_done(event)
            sink = self._sinks.get(event.stream_id)
            if sink is None:
                if isinstance(event, StreamTokens):
                    self.cancel_nowait(event.stream_id)  # nobody reads it any more: free its lane
                continue
            try:
                sink.send_nowait(event)
            except anyio.WouldBlock:
                self._overflow(event.stream_id)
                continue
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._drop(event.stream_id)
                self.cancel_nowait(event.stream_id)
                continue
            if not isinstance(event, StreamTokens):
                self._drop(event.stream_id)

    def _overflow(self, stream_id: int) -> None:
        self._drop(stream_id)
        self.cancel_nowait(stream_id)
        if self._on_overflow is not None:
            self._on_overflow(stream_id)

    def _drop(self, stream_id: int) -> None:
        sink = self._sinks.pop(stream_id, None)
        if sink is not None:
            sink.close()

    def _fail(self, error: BaseException) -> None:
        self.failure = error
        for stream_id in list(self._sinks):
            self._drop(stream_id)
        self.failed.set()


def log_done(event: Any) -> None:
    """One info line per finished request (a DoneEvent): id, tokens, cache, TTFT, finish reason."""
    u = event.usage
    log.info("request %d %s: prompt %d tokens, %d cached (%s), %d generated, ttft %.3fs, total %.3fs%s",
             event.stream_id, event.finish_reason, u.prompt_tokens, u.cached_tokens, u.cache,
             u.completion_tokens, u.ttft_s, u.total_s, f" ({event.note})" if event.note else "")


def _host_event(event: Any) -> Any:
    """Engine events as the loop sees them: tokens with digests instead of device rows."""
    ids = getattr(event, "ids", None)
    if ids is None:
        return event  # a DoneEvent passes through unchanged
    rows = getattr(event, "logits", None)
    digests = None if rows is None else logits_sha256(rows)
    return StreamTokens(event.stream_id, tuple(ids), digests, getattr(event, "logprobs", None))


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
