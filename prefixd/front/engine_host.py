"""`EngineHost`: runs the single-threaded scheduler Engine in its own thread.

    event loop                         engine thread
    ----------                         -------------
    submit/cancel/call ── commands ──▶ drained before every step()
    per-stream receive  ◀── batches ── after every step(), one call_soon_threadsafe

The event loop never blocks on a forward: every engine call crosses the command queue, and
the engine thread sleeps on a condition while it has nothing to run.

Overlap (`overlap=True`, the daemon's choice on CUDA): each round's device call runs on a
device thread of its own while the engine thread takes the submits and cancels that arrive
and seats waiting streams for the next round (`Engine.admit_ahead`: admission, store lookups,
page bookkeeping); the round then lands on the engine thread. Only host work that cannot
change the round in flight overlaps it: any other call waits until the round has landed.

While busy the process keeps freed heap for the next round (`retain_freed_memory`); once
the engine has been idle for `idle_trim_s` it hands that heap back to the system, once per
idle spell, so a burst does not leave the daemon at its peak RSS.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from prefixd.front.accept import return_freed_memory

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
                 trim: Callable[[], object] | None = None, overlap: bool = False) -> None:
        self.engine = engine
        self._idle_trim_s = idle_trim_s  # None: never trim
        self._trim = trim or return_idle_memory  # on the engine thread after idle_trim_s without work
        self._trim_due = False  # rounds or calls ran since the last trim
        self.num_trims = 0
        self._before_round = before_round  # called on the thread that runs rounds (thread policy)
        # overlap: rounds run here while the engine thread does the next round's host work
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="prefixd-device") if overlap else None
        self._event_buffer = event_buffer
        self._on_overflow = on_overflow
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[], None], bool]] = deque()  # (command, host only)
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
            if self._device_thread is not None:
                self._device_thread.shutdown()
            if self.failure is None:  # a failed device is left as it is
                self.engine.close()  # the thread is gone: nothing steps the engine any more
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()

    @property
    def num_open_streams(self) -> int:
        return len(self._sinks)

    # -- calls (event loop) -----------------------------------------------------------------

    async def call(self, fn: Callable[[Any], T], *, host_only: bool = False) -> T:
        """Run `fn(engine)` on the engine thread between steps; its exception is re-raised here.
        `host_only`: `fn` makes no device call and leaves every running stream as it is (a
        submit, a cancel mark), so it may run while a round is in flight (overlap)."""
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

        self._push(run, host_only)
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
            await self.call(lambda engine: engine.submit(request), host_only=True)
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
            self._push(lambda: self.engine.cancel(stream_id), host_only=True)
        else:
            self._push(lambda: self.engine.cancel(stream_id, keep_rows), host_only=True)

    # -- engine thread ----------------------------------------------------------------------

    def _push(self, command: Callable[[], None], host_only: bool = False) -> None:
        with self._cond:
            self._commands.append((command, host_only))
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
                for command, _ in commands:
                    command()
                if not self.engine.idle and not self._stopping:
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
            events = self._overlapped_round() if self._device_thread is not None else self._round()
        except Exception as e:
            log.exception("lane round failed; ending every stream with finish_reason error")
            self.num_failed_rounds += 1
            return self.engine.abort(f"the device failed during a lane round: {e!r}")
        for event in events:
            if getattr(event, "finish_reason", None) == "error":
                log.warning("stream %d ended with error: %s", event.stream_id, event.note)
        return events

    def _round(self) -> list[Any]:
        if self._before_round is not None:
            self._before_round()
        return self.engine.step()

    def _overlapped_round(self) -> list[Any]:
        """One round with its device call on the device thread; meanwhile the host-only commands
        that arrive run here and waiting streams are seated for the next round."""
        engine = self.engine
        launched = engine.launch()
        if launched.plan.empty:
            return engine.land(launched, None)
        running = self._device_thread.submit(self._run_on_device, launched)
        running.add_done_callback(self._wake)
        try:
            while True:
                commands = self._host_commands(running)
                for command, _ in commands:
                    command()
                engine.admit_ahead(launched)
                if running.done():
                    break
        except BaseException:
            wait([running])  # the device finishes its round before the engine gives up on it
            raise
        return engine.land(launched, running.result())

    def _run_on_device(self, launched: Any) -> Any:
        if self._before_round is not None:
            self._before_round()  # torch keeps CPU thread counts per thread: set them where rounds run
        return self.engine.run(launched)

    def _wake(self, _: Future) -> None:
        with self._cond:
            self._cond.notify()

    def _host_commands(self, running: Future) -> list[tuple[Callable[[], None], bool]]:
        """Wait until a host-only command is at the head of the queue or the round is done; take
        the host-only commands at the head (a later one never runs before an earlier call)."""
        with self._cond:
            while not (self._commands and self._commands[0][1]) and not running.done():
                self._cond.wait()
            taken = []
            while self._commands and self._commands[0][1]:
                taken.append(self._commands.popleft())
            return taken

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
    """Engine events as the loop sees them: tokens with the digests the device computed."""
    ids = getattr(event, "ids", None)
    if ids is None:
        return event  # a DoneEvent passes through unchanged
    return StreamTokens(event.stream_id, tuple(ids), event.logits_sha256, event.logprobs)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
