"""Heavy chat renders in a child process, so they never hold the daemon's GIL.

A chat template renders in Python. In a worker thread of the daemon, a long render holds
the interpreter lock against the engine thread, which retakes it around every op of a round:
while the render runs, each retake waits out the switch interval, and a round of a few
hundred ops slows many times over. (Capping the render's CPU, host_work.py, shortens those
spells but does not end them.) So heavy renders (host_work.is_heavy) run in a child process
with an interpreter of its own:

- the child is started once, with the daemon (`start`), and given the model's tokenizer
  (`bind`); it runs one render at a time, at a lower CPU priority (`RENDER_NICE`), and keeps
  the heavy job's CPU share (host_work.CpuShare) in its own thread;
- a job is the chat and the template's keyword arguments; the reply is what the render
  returned (ids, message starts, text), or the exception it raised (the same classes as a render
  in the daemon: ChatTooLarge, RenderCancelled, ChatTemplateError, else RuntimeError);
- the caller's `should_stop` (its client has gone) is polled while it waits; the child is
  then told to cancel, and stops at its next message boundary;
- a client (peer process) that keeps the child busy gets its renders at idle priority: each
  render's CPU time is charged to its client (`RenderShares`, through `ClientRenderer`), the
  charge drains at `SHARE_PER_S` of a core, and while a client's charge is over
  `GRACE_CPU_S` its renders run in a thread of the child under SCHED_IDLE: on CPU only
  when the engine leaves a core idle. A long agent conversation (a few hundred messages,
  ~0.1 s of CPU a turn) stays under it; a client sending big chats back to back does not;
- a child that dies (killed, out of memory) is replaced and the job runs once more in the
  new one; a second death fails the job with an `internal` error. Where no child can be
  started at all (no processes or descriptors left), the render runs in the caller's thread,
  with a warning, rather than not at all. The child exits when the daemon closes its end (or
  dies: its socket then reads end-of-file).

`RenderPool.render` blocks: call it from a worker thread, as the request builder runs.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Hashable

from prefixd.ipc.errors import ErrorCode, ProtocolError

log = logging.getLogger("prefixd.render")

RENDER_NICE = 10  # the child's niceness above the daemon's: the engine's threads come first
GRACE_CPU_S = 0.5  # render CPU seconds a client may have on its charge before its renders idle
SHARE_PER_S = 0.05  # how fast a charge drains: a client's sustained share of a core at priority
_POLL_S = 0.01  # how often a waiting caller checks that its client is still there


class RenderPool:
    """One child process for heavy renders (heavy jobs run one at a time: host_work.py)."""

    def __init__(self, cpu_share: float) -> None:
        self.cpu_share = cpu_share
        self._tokenizer: Any = None
        self._tokenizer_blob: bytes | None = None  # what the child gets: the tokenizer, pickled once
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._jobs = itertools.count(1)
        self.started = 0  # children started over the daemon's life (a restart after a death adds one)
        self._holding_core = False  # a render at normal priority runs in the child now (one at a time)

    def start(self) -> None:
        """Start the child now (it imports while the model loads); a child that cannot be
        started (no processes or descriptors left) is tried again at the first render."""
        with self._lock:
            if self._child is None:
                try:
                    self._child = self._spawn()
                except OSError as e:
                    log.warning("the render process did not start (%s); heavy renders will try again", e)

    def bind(self, tokenizer: Any) -> None:
        """The tokenizer every render uses (sent to the child with its first job). One that
        cannot be pickled renders in the calling thread instead, with a warning."""
        try:
            blob = pickle.dumps(tokenizer)
        except Exception as e:  # noqa: BLE001 - any pickling failure means: render here
            log.warning("heavy chat renders run in the daemon: its tokenizer cannot go to the render process (%s)", e)
            blob = None
        with self._lock:
            self._tokenizer, self._tokenizer_blob = tokenizer, blob

    def cores_in_use(self) -> int:
        """Cores the child's renders hold now: 1 while one runs at its normal priority (the
        engine's CPU thread policy leaves it that core; a team member it preempted would stall
        every barrier of the round), else 0. A render at idle priority (a client past its
        share) holds none: it gets only what the engine leaves. Read from any thread."""
        return 1 if self._holding_core else 0

    @property
    def pid(self) -> int | None:
        child = self._child
        return None if child is None else child.proc.pid

    def render(self, messages: list[dict], *, should_stop: Callable[[], bool] | None = None,
               **template_kwargs: Any) -> Any:
        """`Tokenizer.render_chat(messages, **template_kwargs)` in the child (blocking)."""
        try:
            return self.render_timed(messages, should_stop=should_stop, **template_kwargs)[0]
        except RenderFailed as e:
            raise e.error from None

    def render_timed(self, messages: list[dict], *, should_stop: Callable[[], bool] | None = None,
                     idle: bool = False, **template_kwargs: Any) -> tuple[Any, float]:
        """`render`, and the CPU seconds it took; `idle`: at idle priority in the child.
        A render that raises is charged too (`RenderFailed` carries its CPU time)."""
        with self._lock:
            if self._tokenizer is None:
                raise RuntimeError("render pool: no tokenizer bound yet")
            if self._tokenizer_blob is None:
                return self._render_here(messages, should_stop, template_kwargs)
            for attempt in range(2):  # a child found dead gets one fresh successor (renders are pure)
                if self._child is None or not self._child.alive():
                    try:
                        self._child = self._spawn()
                    except OSError as e:  # rendered here rather than not at all
                        log.warning("the render process did not start (%s); rendering in the daemon", e)
                        return self._render_here(messages, should_stop, template_kwargs)
                child = self._child
                self._holding_core = not idle  # an idle render takes what the engine leaves: it holds no core
                try:
                    kind, cpu_s, *rest = child.run(next(self._jobs), self._tokenizer_blob, messages,
                                                   template_kwargs, should_stop, idle)
                    break
                except (EOFError, OSError) as e:
                    child.close()
                    self._child = None
                    if attempt:
                        raise ProtocolError(ErrorCode.INTERNAL, f"the chat render's process stopped twice "
                                            f"({e or 'no reply'}); the next render starts a new one") from None
                finally:
                    self._holding_core = False
        if kind == "ok":
            return rest[0], cpu_s
        raise RenderFailed(_exception(*rest), cpu_s)

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None

    def _render_here(self, messages: list[dict], should_stop: Callable[[], bool] | None,
                     template_kwargs: dict[str, Any]) -> tuple[Any, float]:
        start = time.thread_time()
        try:
            rendered = self._tokenizer.render_chat(messages, should_stop=should_stop, **template_kwargs)
        except Exception as e:
            raise RenderFailed(e, time.thread_time() - start) from None
        return rendered, time.thread_time() - start

    def _spawn(self) -> _Child:
        self.started += 1
        return _Child.spawn(self.cpu_share)


class _Child:
    """The daemon's end of one render process."""

    def __init__(self, proc: subprocess.Popen, conn: Connection) -> None:
        self.proc = proc
        self.conn = conn
        self.tokenizer: bytes | None = None  # the pickled tokenizer the child holds

    @classmethod
    def spawn(cls, cpu_share: float) -> _Child:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            # the tokenizer encodes in the job's own thread, so an idle job's encode is idle too
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                   "TOKENIZERS_PARALLELISM": "false"}
            code = "from prefixd.daemon.render_process import child_main; child_main()"
            proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), repr(cpu_share), str(RENDER_NICE)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                close_fds=True)
            return cls(proc, Connection(os.dup(ours.fileno())))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: int, tokenizer: bytes, messages: list[dict], kwargs: dict[str, Any],
            should_stop: Callable[[], bool] | None, idle: bool) -> tuple:
        if self.tokenizer is not tokenizer:
            self.conn.send(("tokenizer", tokenizer))
            self.tokenizer = tokenizer
        self.conn.send(("render", job, messages, kwargs, idle))
        cancelled = False
        while True:
            if self.conn.poll(_POLL_S):
                kind, answered, cpu_s, *rest = self.conn.recv()
                # one job at a time per child, and a child whose job failed is discarded
                assert answered == job, (answered, job)
                return (kind, cpu_s, *rest)
            if not self.alive():
                raise EOFError(f"exit status {self.proc.returncode}")
            if not cancelled and should_stop is not None and should_stop():
                self.conn.send(("cancel", job))
                cancelled = True

    def close(self) -> None:
        try:
            self.conn.close()  # the child reads end-of-file and exits
        finally:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_RAISED = ("ChatTooLarge", "RenderCancelled", "ChatTemplateError")


def _exception(name: str, message: str) -> Exception:
    """The daemon-side exception for one the child's render raised."""
    from prefixd.text import chat

    cls = getattr(chat, name) if name in _RAISED else RuntimeError
    return cls(message)


def child_main() -> None:
    """The render process: `python -c ... FD CPU_SHARE NICE` (see RenderPool)."""
    fd, share, nice = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    try:
        os.nice(nice)
    except OSError:
        pass
    from prefixd.daemon.host_work import CpuShare

    conn = Connection(fd)
    tokenizer = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the daemon closed its end, or died
        if msg[0] == "tokenizer":
            tokenizer = pickle.loads(msg[1])
        elif msg[0] == "render":
            _, job, messages, kwargs, idle = msg
            replies: list[tuple] = []
            # a thread per job: SCHED_IDLE cannot be undone unprivileged, so it ends with the job
            worker = threading.Thread(target=lambda: replies.append(
                _render_one(conn, tokenizer, job, messages, kwargs, share, CpuShare, idle)))
            worker.start()
            worker.join()
            reply = replies[0] if replies else ("raise", job, 0.0, "RuntimeError", "the render thread failed")
            try:
                conn.send(reply)
            except OSError:
                return  # the daemon went away during the render


def _render_one(conn: Connection, tokenizer: Any, job: int, messages: list[dict], kwargs: dict[str, Any],
                share: float, cpu_share: type, idle: bool) -> tuple:
    def cancelled() -> bool:
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "cancel" and msg[1] == job:
                return True
        return False

    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass  # no SCHED_IDLE here: the job runs at the child's niceness
    start = time.thread_time()
    try:
        rendered = tokenizer.render_chat(messages, should_stop=cpu_share(share, cancelled), **kwargs)
    except Exception as e:  # sent back and raised in the daemon as a render in it would be
        return ("raise", job, time.thread_time() - start, type(e).__name__, str(e))
    return ("ok", job, time.thread_time() - start, rendered)


class RenderFailed(Exception):
    """A render's own exception (`error`), with the CPU seconds it used before it raised."""

    def __init__(self, error: Exception, cpu_s: float) -> None:
        super().__init__(error)
        self.error = error
        self.cpu_s = cpu_s


class RenderShares:
    """Render CPU charged by client: over `grace_s` (draining at `per_s`), renders idle.
    Thread-safe: renders run in worker threads."""

    def __init__(self, grace_s: float = GRACE_CPU_S, per_s: float = SHARE_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self.per_s = grace_s, per_s
        self._clock = clock
        self._charges: dict[Hashable, tuple[float, float]] = {}  # client -> (charge, when)
        self._lock = threading.Lock()
        self.idle_renders = 0  # renders run at idle priority, over the daemon's life

    def charge(self, client: Hashable) -> float:
        with self._lock:
            return self._charge(client, self._clock())

    def take_idle(self, client: Hashable) -> bool:
        """Whether `client`'s next render runs idle (counted in `idle_renders` if so)."""
        with self._lock:
            idle = self._charge(client, self._clock()) > self.grace_s
            self.idle_renders += idle
            return idle

    def add(self, client: Hashable, cpu_s: float) -> None:
        with self._lock:
            now = self._clock()
            for other in [c for c in self._charges if not self._charge(c, now)]:
                del self._charges[other]  # drained: forgotten
            self._charges[client] = (self._charge(client, now) + cpu_s, now)

    def _charge(self, client: Hashable, now: float) -> float:
        charge, when = self._charges.get(client, (0.0, now))
        return max(0.0, charge - (now - when) * self.per_s)


class ClientRenderer:
    """The render pool as one client's requests see it (requests.Renderer): each render is
    charged to the client, and runs at idle priority while the client is over its share."""

    def __init__(self, pool: RenderPool, shares: RenderShares, client: Hashable) -> None:
        self.pool, self.shares, self.client = pool, shares, client

    def render(self, messages: list[dict], *, should_stop: Callable[[], bool] | None = None,
               **template_kwargs: Any) -> Any:
        idle = self.shares.take_idle(self.client)
        try:
            rendered, cpu_s = self.pool.render_timed(messages, should_stop=should_stop, idle=idle, **template_kwargs)
        except RenderFailed as e:
            self.shares.add(self.client, e.cpu_s)
            raise e.error from None
        self.shares.add(self.client, cpu_s)
        return rendered
