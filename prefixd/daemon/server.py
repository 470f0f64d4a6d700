"""The front process's serve loop: startup() -> main_loop() -> shutdown(), anyio on uvloop.

The engine runs in a process of its own (prefixd.engine), started here and supervised by
the engine link (front/engine_link.py): readiness is announced once it has loaded, and a
death of it ends the requests in flight with `internal`, never the daemon. Signal handlers
only set flags; every task lives in a task group; cancellation is re-raised; cleanup is
shielded.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

import prefixd
from prefixd.daemon.config import DaemonConfig
from prefixd.daemon.startup import StartupError, activation_socket, bind_socket, check_device, open_exporter
from prefixd.daemon.systemd import Notifier
from prefixd.engine.memory import IDLE_TRIM_S, freeze_loaded_heap, one_malloc_arena, return_idle_memory
from prefixd.front.accept import AcceptErrors, refuse_connection, return_freed_memory
from prefixd.front.bounds import ConnectionBounds
from prefixd.front.connection import Connection, Services
from prefixd.front.engine_link import EngineLink, Launcher, ProcessLauncher, RestartPolicy
from prefixd.front.gate import Gate
from prefixd.front.heavy import HeavyWorkers
from prefixd.front.http.serve import HttpServer
from prefixd.front.http.worker import KvEventSource
from prefixd.front.listener import PeerCred, PeerPolicy, SocketPathError, peer_cred
from prefixd.front.requests import RequestBuilder
from prefixd.ipc.framing import Limits
from prefixd.ipc.transport import BufferBudget, FramedStream
from prefixd.metrics import Metrics, MetricsExporter, MetricsObserver

log = logging.getLogger("prefixd.server")
_TRIM_AFTER_BYTES = 1 << 20  # a connection that buffered this much hands freed heap back on close
# The front's event loop and its render/encode worker threads share one interpreter lock; a
# thread that wants it waits up to this switch interval (CPython's default: 5 ms) behind a
# render. Soak, three runs each: honest p99 TTFT 253-325 ms at 5 ms, 187-214 ms at 0.5 ms
# (docs/benchmarks.md, *Engine process*); heavy renders have since moved to worker processes
# (front/heavy.py), and light ones still share the lock. The engine process keeps the
# default: nothing else there wants the lock.
FRONT_SWITCH_S = 0.0005
_CANCEL_FLUSH_S = 5.0  # after the grace period: time for cancelled streams to send their done


class Server:
    """One daemon. `run()` returns the process exit code."""

    def __init__(self, cfg: DaemonConfig, *, engine: Launcher | None = None,
                 env: dict[str, str] | None = None, out: Any = None,
                 bounds: ConnectionBounds | None = None, freeze_heap: bool = False,
                 restart: RestartPolicy | None = None) -> None:
        self.cfg = cfg
        self._freeze_heap = freeze_heap  # the serve process's: freeze_loaded_heap after the load
        self._launcher = engine or ProcessLauncher(cfg)
        self._restart = restart or RestartPolicy()
        self.bounds = bounds or ConnectionBounds.for_config(cfg)
        self.buffers = BufferBudget(self.bounds.max_buffered_bytes)
        self._env = os.environ if env is None else env
        self._out = sys.stderr if out is None else out
        self.notifier = Notifier(self._env)
        self.metrics = Metrics()
        self.limits = Limits()
        self.socket_path: Path | None = None
        self.metrics_port: int | None = None
        self._owns_socket_file = False
        self._exporter: MetricsExporter | None = None
        self.http: HttpServer | None = None
        self._listener: anyio.abc.SocketListener | None = None
        self.link: EngineLink | None = None
        self.gate: Gate | None = None
        self._builder: RequestBuilder | None = None
        self.model_info: dict[str, Any] = {}
        self.num_trims = 0  # idle spells after which the front handed freed heap back
        self._connections: set[Connection] = set()
        self._stream_ids = itertools.count(1)
        self._started_s = time.monotonic()
        self.should_exit = False
        self.exit_code = 0
        self._exit_event: anyio.Event | None = None
        self.listening = anyio.Event()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self) -> int:
        self._exit_event = anyio.Event()
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            if self.notifier.watchdog_interval_s is not None:  # also while the model loads
                tg.start_soon(self._watchdog, self.notifier.watchdog_interval_s)
            await tg.start(self._watch_hangup)  # before the model loads: SIGHUP never kills the daemon
            try:
                await self.startup()
                await self.main_loop()
            except Exception as e:  # re-raised below as itself, not inside an exception group
                failure = e
            finally:
                with anyio.CancelScope(shield=True):
                    await self.shutdown()
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return self.exit_code

    async def startup(self) -> None:
        """Cheap checks first (metrics address, socket, device), then the model load."""
        self._exporter = open_exporter(self.metrics.registry, self.cfg.metrics_addr)
        if self._exporter is not None:
            self.metrics_port = self._exporter.port
        self._listener = await self._open_listener()
        check_device(self.cfg)
        self.notifier.status("loading model")
        self._out.write(f"prefixd: loading model {self.cfg.model} on {self.cfg.device} ({self.cfg.dtype})\n")
        self.link = EngineLink(self._launcher, observer=MetricsObserver(self.metrics), policy=self._restart,
                               on_restart=lambda why: self.metrics.engine_restarts.inc(), out=self._out,
                               stall_s=self.cfg.engine_stall_s or None)
        ready = await self.link.start()
        if self._freeze_heap:
            freeze_loaded_heap()
        for warning in ready.warnings:
            log.warning("%s", warning)
            self._out.write(f"prefixd: warning: {warning}\n")
        info = self.model_info = ready.model_info
        self.metrics.set_build_info(version=prefixd.__version__, model=str(info.get("name", "")), dtype=self.cfg.dtype,
                                    device=self.cfg.device, mode=str(info.get("mode", "invariant")))
        link = self.link
        self.metrics.track(lambda: len(self._connections), lambda: link.pages,
                           lambda: 1 if link.serving else 0)
        self._builder = RequestBuilder(ready.tokenizer, info, self.limits)
        heavy = HeavyWorkers(functools.partial(RequestBuilder, ready.tokenizer, info, self.limits),
                             self.bounds.max_heavy_jobs)
        self.gate = Gate(link, self.bounds, int(info.get("lanes") or self.cfg.num_lanes), self._builder, heavy)
        await anyio.to_thread.run_sync(self._builder.warm)  # before READY: no request waits for it

    async def main_loop(self) -> None:
        assert self._listener is not None and self._exit_event is not None
        assert self.link is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_signals, tg.cancel_scope)
            await tg.start(self.link.supervise)
            tg.start_soon(self._trim_when_idle)
            if self.cfg.idle_exit_s is not None:
                tg.start_soon(self._watch_idle, self.cfg.idle_exit_s)
            async with anyio.create_task_group() as conns:
                conns.start_soon(self._accept_loop, conns)
                if self.cfg.http_addr:
                    self.http = HttpServer.build(self._services(), self.cfg.http_addr, self.cfg.http_token_file,
                                                 self.cfg.prompt_hygiene, kv_event_source(self.cfg))
                    await conns.start(self.http.serve)
                self._announce()
                await self._exit_event.wait()
                self.notifier.stopping()
                await self._stop_accepting()
                if self.http is not None:
                    self.http.stop()  # uvicorn stops listening; open responses go on while streams drain
                await self._drain(self.cfg.grace_s)
                conns.cancel_scope.cancel()
            tg.cancel_scope.cancel()

    async def shutdown(self) -> None:
        await self._stop_accepting()
        if self.gate is not None:
            await anyio.to_thread.run_sync(self.gate.heavy.close)
        if self.link is not None:
            await self.link.stop()  # the engine flushes the disk tier, then exits
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        if self.link is not None and self.link.ready is not None:
            log.info("stopped after %.1fs: exit code %d, %d requests served", time.monotonic() - self._started_s,
                     self.exit_code, self.metrics.num_requests())

    def request_exit(self, code: int = 0) -> None:
        """Ask the daemon to stop gracefully (what SIGTERM does)."""
        self.should_exit = True
        self.exit_code = self.exit_code or code
        if self._exit_event is not None:
            self._exit_event.set()

    # -- tasks ------------------------------------------------------------------------------

    async def _watch_signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self.should_exit:
                    log.warning("second %s: stopping now", signal.Signals(signum).name)
                    self._out.write("prefixd: stopping now\n")
                    await self._drain(0.0)
                    scope.cancel()
                    return
                self._out.write(f"prefixd: {signal.Signals(signum).name}: stopping (grace {self.cfg.grace_s:g}s)\n")
                self.request_exit(0)

    async def _watch_hangup(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """SIGHUP is logged and otherwise ignored: prefixd writes only to stderr, there is no log to reopen."""
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            task_status.started()
            async for _ in signals:
                log.info("SIGHUP ignored (logs go to stderr; nothing to reopen or reload)")

    async def _watch_idle(self, idle_s: float) -> None:
        """Exit (gracefully: the disk tier is flushed) after `idle_s` with no client connected
        and no request open; a socket-activated unit is started again by the next client."""
        assert self.link is not None
        last_busy = time.monotonic()
        while not self.should_exit:
            await anyio.sleep(min(1.0, idle_s / 4))
            if self._connections or self.link.num_open_streams:
                last_busy = time.monotonic()
            elif time.monotonic() - last_busy >= idle_s:
                self._out.write(f"prefixd: idle for {idle_s:g}s: exiting\n")
                self.request_exit(0)
                return

    async def _trim_when_idle(self) -> None:
        """Once per idle spell (IDLE_TRIM_S with no generate in flight and no heavy work after
        some), collect garbage and hand the front's freed heap back: a burst of big renders
        or frames otherwise leaves the front at its peak RSS. The engine trims its own."""
        assert self.link is not None and self.gate is not None
        quiet_since, due = time.monotonic(), False
        while not self.should_exit:
            await anyio.sleep(min(1.0, IDLE_TRIM_S / 4))
            if self.link.num_open_streams or self.gate.heavy_running or self.gate.heavy_waiting:
                quiet_since, due = time.monotonic(), True
            elif due and time.monotonic() - quiet_since >= IDLE_TRIM_S:
                await anyio.to_thread.run_sync(return_idle_memory)
                due = False
                self.num_trims += 1

    async def _watchdog(self, interval_s: float) -> None:
        while True:
            self.notifier.watchdog()
            await anyio.sleep(interval_s)

    async def _accept_loop(self, conns: anyio.abc.TaskGroup) -> None:
        """Accept until the listener closes. A failed accept (EMFILE, ENFILE, ENOBUFS,
        ENOMEM or any other OSError) is logged, rate-limited, and retried after a pause: it
        never ends the loop."""
        assert self._listener is not None
        policy = PeerPolicy.for_this_process(self.cfg.allow_group)
        errors = AcceptErrors(log)
        while True:
            try:
                stream = await self._listener.accept()
            except anyio.ClosedResourceError:
                return
            except (anyio.BrokenResourceError, OSError) as e:  # anyio wraps accept's OSError
                if self._listener is None:
                    return  # closed while accepting
                errors.record(e.__cause__ if isinstance(e.__cause__, OSError) else e)
                await anyio.sleep(self.bounds.accept_backoff_s)
                continue
            errors.recovered()
            conns.start_soon(self._admit, stream, policy)

    async def _admit(self, stream: anyio.abc.SocketStream, policy: PeerPolicy) -> None:
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        try:
            cred = peer_cred(raw)
            allowed = policy.allows(cred, raw)
        except OSError as e:  # the peer left before we looked
            log.debug("dropped a connection whose peer left: %s", e)
            allowed, cred = False, None
        if not allowed:
            if cred is not None:
                log.warning("refused a peer: pid %d uid %d gid %d", cred.pid, cred.uid, cred.gid)
            await stream.aclose()
            return
        if len(self._connections) >= self.bounds.max_connections:
            await refuse_connection(stream, self.bounds.max_connections)
            return
        assert cred is not None  # allowed
        await self._serve_connection(stream, cred)

    async def _serve_connection(self, stream: anyio.abc.SocketStream, cred: PeerCred) -> None:
        framed = FramedStream(stream, self.limits, send_timeout_s=self.bounds.send_timeout_s,
                              frame_deadline_s=self.bounds.frame_deadline_s, budget=self.buffers,
                              off_loop_bytes=self.bounds.off_loop_bytes)
        assert self.gate is not None
        client = self.gate.join((cred.pid, cred.uid))
        connection = Connection(framed, self._services(), self.bounds, client)
        self._connections.add(connection)
        try:
            await connection.serve()
        except Exception:  # a bug met by one connection closes only that connection
            log.exception("connection failed; closed it")
        finally:
            self.gate.leave(client)
            self._connections.discard(connection)
            if framed.peak_buffered_bytes >= _TRIM_AFTER_BYTES:
                return_freed_memory()

    # -- helpers ----------------------------------------------------------------------------

    async def _open_listener(self) -> anyio.abc.SocketListener:
        activated = activation_socket(self._env)
        if activated is not None:
            name = activated.getsockname()
            self.socket_path = Path(name) if isinstance(name, str) and name else None
            activated.setblocking(False)
            return await anyio.abc.SocketListener.from_socket(activated)
        path = self.cfg.resolved_socket_path()
        sock = bind_socket(path, self._group_gid())
        self.socket_path = path
        self._owns_socket_file = True
        sock.setblocking(False)
        return await anyio.abc.SocketListener.from_socket(sock)

    def _group_gid(self) -> int | None:
        try:
            return PeerPolicy.for_this_process(self.cfg.allow_group).allowed_gid
        except SocketPathError as e:
            raise StartupError(str(e)) from None

    def _announce(self) -> None:
        where = str(self.socket_path) if self.socket_path else "the activation socket"
        self._out.write(f"prefixd: listening on {where}\n")
        if self.socket_path:
            self._out.write(f"prefixd: chat with it: prefixd chat --socket {self.socket_path}\n")
        if self.http is not None:
            self._out.write(f"prefixd: OpenAI-compatible HTTP on http://{self.http.host}:{self.http.port}/v1\n")
        if self.metrics_port is not None:
            self._out.write(f"prefixd: metrics on {self.cfg.metrics_addr.rpartition(':')[0]}:{self.metrics_port}\n")
        self._out.flush()
        self.notifier.ready(f"listening on {where}")
        self.listening.set()

    async def _stop_accepting(self) -> None:
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await listener.aclose()
            if self._owns_socket_file and self.socket_path is not None:
                self.socket_path.unlink(missing_ok=True)

    async def _drain(self, grace_s: float) -> None:
        """Let in-flight streams finish within `grace_s`, then cancel the rest and flush."""
        with anyio.move_on_after(grace_s):
            while any(c.num_streams for c in self._stream_holders()):
                await anyio.sleep(0.05)
        for holder in self._stream_holders():
            holder.cancel_streams()
        with anyio.move_on_after(_CANCEL_FLUSH_S):
            while any(c.num_streams for c in self._stream_holders()):
                await anyio.sleep(0.02)
        async with anyio.create_task_group() as tg:  # every done event reaches its client
            for connection in list(self._connections):
                tg.start_soon(connection.flush)

    def _stream_holders(self) -> list[Any]:
        """Socket connections and the HTTP front: whatever has generates in flight."""
        return [*self._connections, *([self.http.front] if self.http is not None else [])]

    def _services(self) -> Services:
        assert self.gate is not None and self._builder is not None
        return Services(
            gate=self.gate,
            builder=self._builder,
            hello_reply=self._hello_reply,
            status=self._status,
            shutting_down=lambda: self.should_exit,
            next_stream_id=lambda: next(self._stream_ids),
        )

    def _hello_reply(self) -> dict[str, Any]:
        return {"server": f"prefixd {prefixd.__version__}", "model": dict(self.model_info),
                "limits": self.limits.to_wire()}

    async def _status(self, *, check: bool = False) -> dict[str, Any]:
        """The status reply's map: the engine's own, then the front's."""
        assert self.link is not None and self.gate is not None
        engine = await self.link.status(check=check)
        return {
            **engine,
            "server": f"prefixd {prefixd.__version__}",
            "model": dict(self.model_info),
            "connections": len(self._connections),
            "buffered_bytes": self.buffers.used_bytes,
            **self.gate.stats(),
            "engine": {"pid": self.link.pid, "state": self.link.state, "restarts": self.link.restarts,
                       "stalls": self.link.stalls, "last_death": self.link.last_death},
            "front_trims": self.num_trims,
            "uptime_s": time.monotonic() - self._started_s,
            "socket": str(self.socket_path) if self.socket_path else None,
            "shutting_down": self.should_exit,
        }


def kv_event_source(cfg: DaemonConfig) -> KvEventSource | None:
    """Where the engine publishes KV events, for the HTTP front's router probes; None without --kv-events."""
    if not cfg.kv_events:
        return None
    from prefixd.engine.kv_events import RING_BATCHES, SEND_HWM, parse_endpoint

    endpoint = parse_endpoint(cfg.kv_events)
    replay = parse_endpoint(cfg.kv_events_replay).address if cfg.kv_events_replay else None
    return KvEventSource(endpoint=endpoint.address, topic=endpoint.topic.decode(), replay_endpoint=replay,
                         buffer_steps=RING_BATCHES, hwm=SEND_HWM)


def serve(cfg: DaemonConfig) -> int:
    """Run a daemon in the foreground until SIGTERM/SIGINT; returns the exit code."""
    logging.basicConfig(level=cfg.log_level.upper(), format="prefixd %(levelname)s %(name)s: %(message)s")
    one_malloc_arena()  # process-wide, before any worker thread: the idle trim then reaches their frees
    sys.setswitchinterval(FRONT_SWITCH_S)  # process-wide, so set by the front's entry point only
    server = Server(cfg, freeze_heap=True)
    return anyio.run(server.run, backend="asyncio", backend_options={"use_uvloop": True})
