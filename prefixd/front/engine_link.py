"""`EngineLink`: the front's end of the engine contract (prefixd.engine.contract), and the
supervision of the engine process.

    event loop (front)                              engine process
    ------------------                              --------------
    submit / cancel / status  ── frames ──────────▶ applied between rounds
    per-stream receive        ◀── one frame a round: token and done events, observer calls

Each stream's events go to a bounded memory stream; a stream whose client does not read
them is cancelled. If the engine process dies (killed, a segfault, out of memory), every
stream in flight gets `EngineLost` as its last item, the death is logged and counted, and
the engine is started again (warm from the disk tier) after a back-off that grows with
repeated deaths; submits made meanwhile wait for it, up to `RestartPolicy.wait_s`.

An engine that is alive but no longer answers (a device call that never returns, a
deadlock, SIGSTOP) is treated the same way once it has been silent too long (`stall_s`):
with work in flight, no message for `stall_s`; idle, a status ping (sent once it has been
silent for `PING_SHARE` of that) unanswered for `stall_s`. The front kills it (SIGKILL, which
a stopped process takes too) and the requests in flight end as after a death. Loading has
no bound: it sends nothing until ready, and its length is the model's and the disk's.

Launchers say where the engine runs: `ProcessLauncher` in a process of its own (the
daemon's), `ThreadLauncher` in a thread of this process over the same socket and frames
(tests whose fake device they drive directly).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from prefixd.engine.contract import VERSION, EngineSpec, decode, encode, message, pack_object, unpack_object
from prefixd.engine.link import LinkReader, pack, receive_some, send_frame
from prefixd.engine.openmp import engine_omp_env
from prefixd.ipc.framing import close_fds
from prefixd.scheduler.streams import DoneEvent, StreamRequest, TokenEvent

log = logging.getLogger("prefixd.engine_link")

DEFAULT_EVENT_BUFFER = 1024  # events queued per stream before its client counts as not reading
STOP_WAIT_S = 150.0  # at shutdown: time the engine gets to flush the disk tier and exit
PING_SHARE = 0.25  # an engine silent for this share of the stall bound is asked for its status
REAP_WARN_S = 10.0  # a killed engine not gone after this is stuck in the kernel: said, not waited for


class EngineUnavailable(RuntimeError):
    """The engine is not serving (restarting, or stopped); the message says why."""


class EngineRefused(Exception):
    """The engine refused a submit (`code`: one of contract.REFUSAL_CODES)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class EngineLost:
    """The last item of a stream whose engine process died before the stream finished."""

    stream_id: int
    note: str


@dataclass(frozen=True)
class RestartPolicy:
    """Back-off between restarts: none for the first death, then `first_s` doubling up to
    `max_s`; an engine that served `healthy_s` without dying starts the count again."""

    first_s: float = 1.0
    max_s: float = 30.0
    healthy_s: float = 60.0
    wait_s: float = 60.0  # how long a submit waits for a restarting engine before `busy`

    def delay_s(self, deaths_in_a_row: int) -> float:
        if deaths_in_a_row <= 1:
            return 0.0
        return min(self.max_s, self.first_s * 2 ** (deaths_in_a_row - 2))


@dataclass
class EngineReady:
    """What the engine said once loaded."""

    model_info: dict[str, Any]
    tokenizer: Any
    warnings: tuple[str, ...] = ()
    pid: int | None = None


class Child(Protocol):
    def kill(self) -> None: ...
    def wait(self) -> str: ...  # blocks until it ended; how it ended, in words


class Launcher(Protocol):
    def launch(self) -> tuple[socket.socket, Child]: ...


# -- launchers -----------------------------------------------------------------------------------


class _Process:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait(self) -> str:
        code = self.proc.wait()
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class ProcessLauncher:
    """The engine in a process of its own: `python -m prefixd.engine FD`."""

    def __init__(self, config: Any, *, factory: str = "prefixd.engine.runtime:default_factory",
                 factory_args: dict[str, Any] | None = None, python: str = sys.executable) -> None:
        self.spec = EngineSpec(factory=factory, config=config, factory_args=factory_args,
                               sys_path=tuple(p for p in sys.path if p), log_level=getattr(config, "log_level", "info"))
        self.python = python

    def launch(self) -> tuple[socket.socket, Child]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            env = {**os.environ, **engine_omp_env(os.environ),
                   "PREFIXD_FRONT_PID": str(os.getpid())}  # engine.runtime.FRONT_PID_ENV
            proc = subprocess.Popen([self.python, "-m", "prefixd.engine", str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        data, fds = pack(message("start", version=VERSION, spec=pack_object(self.spec)))
        try:
            ours.sendall(data) if not fds else send_frame(ours, data, fds)
        finally:
            close_fds(fds)
        return ours, _Process(proc)


class _Thread:
    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def kill(self) -> None:
        raise RuntimeError("an engine thread cannot be killed")

    def wait(self) -> str:
        self.thread.join()
        return "the engine thread returned"


class ThreadLauncher:
    """The engine loop in a thread of this process, over the same socket and frames."""

    def __init__(self, factory: Callable[[Any, Any], Any], config: Any = None) -> None:
        self.factory = factory
        self.config = config
        self.local: dict[str, Any] = {}  # what the engine hands over as objects (its tokenizer)

    def launch(self) -> tuple[socket.socket, Child]:
        from prefixd.engine.link import BlockingLink
        from prefixd.engine.process import serve_link

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

        def run() -> None:
            link = BlockingLink(theirs)
            try:
                serve_link(link, self.factory, self.config, local=self.local)
            except Exception:  # noqa: BLE001 - the front sees the link close, as after a death
                log.exception("engine thread failed")
            finally:
                link.close()

        thread = threading.Thread(target=run, name="prefixd-engine", daemon=True)
        thread.start()
        return ours, _Thread(thread)


# -- the link --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Connection:
    """One launched engine: its socket, reader, write queue and what waits on it."""

    sock: socket.socket
    child: Child
    reader: LinkReader = field(default_factory=LinkReader)
    out: deque = field(default_factory=deque)  # [memoryview, fds] still to send
    closed: bool = False
    lost: anyio.Event = field(default_factory=anyio.Event)
    ready: asyncio.Future | None = None
    started_s: float = field(default_factory=time.monotonic)
    heard_s: float = field(default_factory=time.monotonic)  # when the engine last sent anything
    ping_q: int | None = None  # the status query asking whether it still answers, while unanswered
    ping_sent_s: float = 0.0

    def owed_s(self, now: float, *, busy: bool) -> float:
        """How long the engine has owed an answer: with work in flight (`busy`) since it last
        spoke (a round message each round), and since the ping while one is unanswered."""
        owed = [now - self.heard_s] if busy else []
        if self.ping_q is not None:
            owed.append(now - self.ping_sent_s)
        return max(owed, default=0.0)


class EngineLink:
    """Talks to one engine at a time and starts another when it dies."""

    def __init__(self, launcher: Launcher, *, observer: Any = None, policy: RestartPolicy | None = None,
                 event_buffer: int = DEFAULT_EVENT_BUFFER, on_overflow: Callable[[int], None] | None = None,
                 on_restart: Callable[[str], None] | None = None, out: Any = None,
                 stall_s: float | None = None) -> None:
        self.launcher = launcher
        self.stall_s = stall_s  # None: a silent engine is never taken for stalled
        self.observer = observer  # the front's EngineObserver (metrics): the engine's calls replayed
        self.policy = policy or RestartPolicy()
        self._event_buffer = event_buffer
        self._on_overflow = on_overflow
        self._on_restart = on_restart
        self._out = out or sys.stderr
        self._conn: _Connection | None = None
        self._sinks: dict[int, MemoryObjectSendStream[Any]] = {}
        self._ends: dict[int, Callable[[], None]] = {}  # stream id -> on_end (submit)
        self._accepts: dict[int, asyncio.Future] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count(1)
        self._serving = anyio.Event()  # set while an engine is ready
        self._stopping = False
        self.ready: EngineReady | None = None
        self.pages: tuple[int, int] = (0, 0)  # the KV pool's (free, used), as of the last round
        self.deaths = 0  # deaths in a row (back-off)
        self.restarts = 0
        self.stalls = 0  # engines killed for not answering
        self.pings = 0  # status pings sent to a silent engine
        self.last_death: str | None = None
        self.state = "starting"  # starting | ready | restarting | stopped

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> EngineReady:
        """Launch the engine and wait for it to load. StartupError when it cannot."""
        from prefixd.daemon.startup import StartupError

        try:
            return await self._launch()
        except EngineUnavailable as e:
            raise StartupError(str(e)) from None

    async def supervise(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Restart the engine whenever it dies or stalls, until `stop`."""
        async with anyio.create_task_group() as tg:
            if self.stall_s is not None:
                tg.start_soon(self._watch_stalls, self.stall_s, tg)
            task_status.started()
            await self._restart_when_lost()
            tg.cancel_scope.cancel()

    async def _restart_when_lost(self) -> None:
        while not self._stopping:
            conn = self._conn
            if conn is None:
                return
            await conn.lost.wait()
            if self._stopping:
                return
            while not self._stopping:
                delay = self.policy.delay_s(self.deaths)
                if delay:
                    self._say(f"restarting the engine in {delay:g}s ({self.deaths} deaths in a row)")
                    await anyio.sleep(delay)
                try:
                    await self._launch()
                except EngineUnavailable as e:
                    self._say(f"engine restart failed: {e}")
                    self.deaths += 1
                    continue
                self.restarts += 1
                if self._on_restart is not None:
                    self._on_restart(self.last_death or "")
                self._say(f"engine restarted (pid {self.ready.pid if self.ready else '?'})")
                break

    async def _watch_stalls(self, stall_s: float, tg: anyio.abc.TaskGroup) -> None:
        """Ping a silent engine, and kill one that owes an answer for `stall_s` (it is then
        lost: the restart loop starts another; `tg` reaps it). Not while it loads or stops."""
        ping_s = stall_s * PING_SHARE
        while not self._stopping:
            await anyio.sleep(min(1.0, ping_s / 4))
            conn = self._conn
            if conn is None or conn.closed or self.state != "ready" or self._stopping:
                continue
            self._readable(conn)  # what arrived while this loop ran other work was heard in time
            if conn.closed:
                continue
            now = time.monotonic()
            owed_s = conn.owed_s(now, busy=bool(self._sinks or self._accepts))
            if owed_s >= stall_s:
                self._kill_stalled(conn, owed_s, tg)
            elif conn.ping_q is None and now - conn.heard_s >= ping_s:
                conn.ping_q, conn.ping_sent_s = next(self._query_ids), now
                self.pings += 1
                self._send(message("status", q=conn.ping_q, check=False))

    def _kill_stalled(self, conn: _Connection, owed_s: float, tg: anyio.abc.TaskGroup) -> None:
        self.stalls += 1
        pid = self.pid
        self._say(f"the engine (pid {pid}) stopped answering for {owed_s:.0f}s with {len(self._sinks)} "
                  f"requests in flight: killing it")
        try:
            conn.child.kill()
        except RuntimeError as e:  # an engine thread: it is left behind, its link closed
            self._say(f"the engine could not be killed: {e}")
        else:
            tg.start_soon(self._reap, conn.child, pid)
        self._lose(conn, f"the engine stopped answering for {owed_s:.0f}s")

    async def _reap(self, child: Child, pid: int | None) -> None:
        """Wait for a killed engine to end; one in an uninterruptible kernel call (a device
        driver's) ends only when that call does, so after REAP_WARN_S it is said and left."""
        with anyio.move_on_after(REAP_WARN_S) as late:
            await anyio.to_thread.run_sync(child.wait, abandon_on_cancel=True)
        if late.cancelled_caught:
            self._say(f"the killed engine (pid {pid}) has not exited {REAP_WARN_S:g}s after SIGKILL: it is stuck "
                      f"in the kernel (a device driver call?); the new engine starts beside it")

    async def stop(self) -> None:
        """Tell the engine to stop (it flushes the disk tier) and wait for it to exit."""
        self._stopping = True
        self.state = "stopped"
        conn = self._conn
        if conn is None or conn.closed:
            return
        self._send(message("stop"))
        with anyio.move_on_after(STOP_WAIT_S):
            await conn.lost.wait()
        if not conn.closed:
            log.warning("the engine did not stop within %.0fs: killing it", STOP_WAIT_S)
            try:
                conn.child.kill()
            except RuntimeError:
                pass
            self._lose(conn, "stopped")
        await anyio.to_thread.run_sync(conn.child.wait)

    def kill(self) -> None:
        """Kill the engine process now (tests; the front restarts it)."""
        if self._conn is not None:
            self._conn.child.kill()

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready is not None else None

    @property
    def num_open_streams(self) -> int:
        return len(self._sinks)

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    # -- calls ------------------------------------------------------------------------------

    async def submit(self, request: StreamRequest, *,
                     on_end: Callable[[], None] | None = None) -> MemoryObjectReceiveStream[Any]:
        """Submit a request; returns the stream of its TokenEvents ending with its DoneEvent
        (or EngineLost). Raises EngineRefused for a request the engine will not run, and
        EngineUnavailable when no engine serves within the restart wait. `on_end()` runs once
        the stream has ended in the engine (done, or the engine lost), read or not."""
        stream_id = request.stream_id
        if stream_id in self._sinks:
            raise ValueError(f"stream {stream_id} is already open")
        deadline = anyio.current_time() + self.policy.wait_s
        while True:
            await self._wait_serving(deadline)
            send, receive = anyio.create_memory_object_stream[Any](self._event_buffer)
            self._sinks[stream_id] = send
            accepted = asyncio.get_running_loop().create_future()
            self._accepts[stream_id] = accepted
            if on_end is not None:  # before the submit goes: its done may come in the frame after `accepted`
                self._ends[stream_id] = on_end
            try:
                self._send(message("submit", request=encode(request)))
                await accepted
                break
            except EngineUnavailable:
                self._unsubmit(stream_id, send, receive)
                if self._stopping or anyio.current_time() >= deadline:
                    raise
                # the engine died before it answered, so it never ran this: the next one will
            except BaseException:
                self._unsubmit(stream_id, send, receive)
                refused = accepted.done() and not accepted.cancelled() and isinstance(accepted.exception(), EngineRefused)
                if not refused:
                    self.cancel_nowait(stream_id)  # a wait cancelled after the submit went: end it too
                raise
        return receive

    def _unsubmit(self, stream_id: int, send: Any, receive: Any) -> None:
        """Forget a submit that did not go through (its sink, its accept, its on_end)."""
        self._ends.pop(stream_id, None)
        self._accepts.pop(stream_id, None)
        self._sinks.pop(stream_id, None)
        send.close()
        receive.close()

    def cancel_nowait(self, stream_id: int, keep_rows: int | None = None) -> None:
        """Ask the engine to end a stream; its DoneEvent (cancelled) still arrives.
        `keep_rows`: see Engine.cancel."""
        if self._conn is not None and not self._conn.closed:
            self._send(message("cancel", id=stream_id, keep=keep_rows))

    async def status(self, *, check: bool = False) -> dict[str, Any]:
        """The engine's status map (its `idle` flag and, with `check`, the result of its
        integrity check under "integrity": None when all agrees)."""
        await self._wait_serving()
        q = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._queries[q] = future
        try:
            self._send(message("status", q=q, check=check))
            reply = await future
        finally:
            self._queries.pop(q, None)
        return {**decode(reply["status"]), "engine_idle": reply["idle"], "integrity": reply["integrity"],
                "engine_trims": reply["trims"], "failed_rounds": reply["failed_rounds"]}

    async def _wait_serving(self, deadline: float | None = None) -> None:
        if self._stopping:
            raise EngineUnavailable("the engine is shutting down")
        if self._serving.is_set():
            return
        wait_s = self.policy.wait_s if deadline is None else max(0.0, deadline - anyio.current_time())
        with anyio.move_on_after(wait_s):
            await self._serving.wait()
            return
        raise EngineUnavailable(f"the engine is restarting ({self.last_death}); try again shortly")

    # -- launch -----------------------------------------------------------------------------

    async def _launch(self) -> EngineReady:
        self.state = "starting" if self.restarts == 0 and self.deaths == 0 else "restarting"
        sock, child = await anyio.to_thread.run_sync(self.launcher.launch)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        conn = _Connection(sock, child, ready=loop.create_future())
        self._conn = conn
        loop.add_reader(sock.fileno(), self._readable, conn)
        try:
            assert conn.ready is not None
            ready = await conn.ready
        except EngineUnavailable:
            await anyio.to_thread.run_sync(child.wait)
            raise
        self.ready = ready
        self.state = "ready"
        self._serving.set()
        return ready

    def _say(self, text: str) -> None:
        log.warning("%s", text)
        self._out.write(f"prefixd: {text}\n")
        self._out.flush()

    # -- socket -----------------------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            raise EngineUnavailable(f"the engine is not running ({self.last_death or 'not started'})")
        data, fds = pack(msg)
        conn.out.append([memoryview(data), fds])
        if len(conn.out) == 1:
            self._writable(conn)

    def _writable(self, conn: _Connection) -> None:
        while conn.out and not conn.closed:
            item = conn.out[0]
            view, fds = item
            try:
                sent = send_frame(conn.sock, view, fds) if fds else conn.sock.send(view)
            except BlockingIOError:
                break
            except OSError as e:
                self._lose(conn, f"the engine link broke: {e}")
                return
            if fds:
                close_fds(fds)
                item[1] = []
            if sent < len(view):
                item[0] = view[sent:]
                break
            conn.out.popleft()
        loop = asyncio.get_running_loop()
        if conn.out and not conn.closed:
            loop.add_writer(conn.sock.fileno(), self._writable, conn)
        elif not conn.closed:
            loop.remove_writer(conn.sock.fileno())

    def _readable(self, conn: _Connection) -> None:
        while not conn.closed:
            try:
                data, fds = receive_some(conn.sock)
            except BlockingIOError:
                return
            except ConnectionResetError:
                self._lose(conn, None)  # the engine's end went away with the engine
                return
            except OSError as e:
                self._lose(conn, f"the engine link broke: {e}")
                return
            if not data:
                close_fds(fds)
                self._lose(conn, None)
                return
            conn.heard_s = time.monotonic()
            try:
                msgs = conn.reader.feed(data, fds)
            except Exception as e:  # noqa: BLE001 - a contract bug: treat the engine as lost
                log.exception("engine link: bad frame")
                conn.child.kill() if isinstance(conn.child, _Process) else None
                self._lose(conn, f"the engine sent a bad frame: {e}")
                return
            for msg in msgs:
                self._dispatch(conn, msg)

    def _dispatch(self, conn: _Connection, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "round":
            self._deliver(msg["events"])
            self._observe(msg["observed"])
            self.pages = tuple(msg["pages"])  # type: ignore[assignment]
        elif kind == "accepted":
            future = self._accepts.pop(msg["id"], None)
            if future is not None and not future.done():
                future.set_result(None)
        elif kind == "refused":
            future = self._accepts.pop(msg["id"], None)
            if future is not None and not future.done():
                future.set_exception(EngineRefused(msg["code"], msg["message"]))
        elif kind == "status":
            if msg["q"] == conn.ping_q:
                conn.ping_q = None
                return
            future = self._queries.get(msg["q"])
            if future is not None and not future.done():
                future.set_result(msg)
        elif kind == "ready":
            if msg.get("version") != VERSION:
                self._fail_start(conn, f"engine contract version {msg.get('version')} (this front speaks {VERSION})")
                return
            data = msg["tokenizer"]
            tokenizer = unpack_object(data) if data is not None else getattr(self.launcher, "local", {})["tokenizer"]
            ready = EngineReady(dict(msg["model_info"]), tokenizer, tuple(msg["warnings"]), msg.get("pid"))
            self.pages = tuple(msg["pages"])  # type: ignore[assignment]
            if conn.ready is not None and not conn.ready.done():
                conn.ready.set_result(ready)
        elif kind == "failed":
            self._fail_start(conn, str(msg["message"]))
        else:
            log.error("engine link: unknown message %r", kind)

    def _fail_start(self, conn: _Connection, text: str) -> None:
        if conn.ready is not None and not conn.ready.done():
            conn.ready.set_exception(EngineUnavailable(text))
        self.last_death = text

    def _deliver(self, events: list[Any]) -> None:
        for data in events:
            event = decode(data)
            sink = self._sinks.get(event.stream_id)
            if isinstance(event, DoneEvent):
                self._ended(event.stream_id)  # the engine holds nothing of it any more
            if sink is None:
                if isinstance(event, TokenEvent):
                    self.cancel_nowait(event.stream_id)  # nobody reads it any more: free its lane
                continue
            try:
                sink.send_nowait(event)
            except anyio.WouldBlock:
                self._drop(event.stream_id)
                self.cancel_nowait(event.stream_id)
                if self._on_overflow is not None:
                    self._on_overflow(event.stream_id)
                continue
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._drop(event.stream_id)
                self.cancel_nowait(event.stream_id)
                continue
            if isinstance(event, DoneEvent):
                self._drop(event.stream_id)

    def _observe(self, observed: list[Any]) -> None:
        if self.observer is None:
            return
        for name, args in observed:
            try:  # a record (the disk tier's stats) crossed as a map of its fields
                getattr(self.observer, name)(*(SimpleNamespace(**a) if isinstance(a, dict) else a for a in args))
            except Exception:  # noqa: BLE001 - metrics never end serving
                log.exception("observer %s failed", name)

    def _ended(self, stream_id: int) -> None:
        on_end = self._ends.pop(stream_id, None)
        if on_end is not None:
            try:
                on_end()
            except Exception:  # noqa: BLE001 - one front's bookkeeping never stops delivery
                log.exception("on_end of stream %d failed", stream_id)

    def _drop(self, stream_id: int) -> None:
        sink = self._sinks.pop(stream_id, None)
        if sink is not None:
            sink.close()

    def _lose(self, conn: _Connection, why: str | None) -> None:
        """The engine is gone: end what waits on it."""
        if conn.closed:
            return
        conn.closed = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(conn.sock.fileno())
        loop.remove_writer(conn.sock.fileno())
        for _, fds in conn.out:
            close_fds(fds)
        conn.out.clear()
        conn.reader.close()
        conn.sock.close()
        if self._conn is conn:
            self._serving = anyio.Event()
        if self._stopping:
            note = "the daemon stopped its engine"
            if conn.ready is not None and not conn.ready.done():
                conn.ready.set_exception(EngineUnavailable("the daemon is stopping"))
        else:
            uptime = time.monotonic() - conn.started_s
            how = why or _how_it_ended(conn.child)
            self.last_death = f"the engine process died ({how})" if why is None else how
            self.deaths = 1 if uptime >= self.policy.healthy_s else self.deaths + 1
            note = f"{self.last_death}; it is being restarted"
            if conn.ready is not None and not conn.ready.done():
                conn.ready.set_exception(EngineUnavailable(self.last_death))
            else:
                self._say(f"{self.last_death} after {uptime:.1f}s; {len(self._sinks)} requests in flight end with error")
        for stream_id in list(self._sinks):
            sink = self._sinks.pop(stream_id)
            try:
                sink.send_nowait(EngineLost(stream_id, note))
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            sink.close()
        for future in [*self._accepts.values(), *self._queries.values()]:
            if not future.done():
                future.set_exception(EngineUnavailable(note))
        self._accepts.clear()
        for stream_id in list(self._ends):
            self._ended(stream_id)
        conn.lost.set()


def _how_it_ended(child: Child) -> str:
    """How a child whose socket closed ended (it may take a moment to be reaped)."""
    proc = getattr(child, "proc", None)
    if proc is None:
        return "its thread returned"
    try:
        code = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "its link closed"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"
