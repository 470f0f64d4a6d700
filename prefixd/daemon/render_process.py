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
from multiprocessing.connection import Connection
from typing import Any, Callable

from prefixd.ipc.errors import ErrorCode, ProtocolError

log = logging.getLogger("prefixd.render")

RENDER_NICE = 10  # the child's niceness above the daemon's: the engine's threads come first
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

    @property
    def pid(self) -> int | None:
        child = self._child
        return None if child is None else child.proc.pid

    def render(self, messages: list[dict], *, should_stop: Callable[[], bool] | None = None,
               **template_kwargs: Any) -> Any:
        """`Tokenizer.render_chat(messages, **template_kwargs)` in the child (blocking)."""
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
                try:
                    kind, *rest = child.run(next(self._jobs), self._tokenizer_blob, messages, template_kwargs,
                                            should_stop)
                    break
                except (EOFError, OSError) as e:
                    child.close()
                    self._child = None
                    if attempt:
                        raise ProtocolError(ErrorCode.INTERNAL, f"the chat render's process stopped twice "
                                            f"({e or 'no reply'}); the next render starts a new one") from None
        if kind == "ok":
            return rest[0]
        raise _exception(*rest)

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None

    def _render_here(self, messages: list[dict], should_stop: Callable[[], bool] | None,
                     template_kwargs: dict[str, Any]) -> Any:
        return self._tokenizer.render_chat(messages, should_stop=should_stop, **template_kwargs)

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
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            code = "from prefixd.daemon.render_process import child_main; child_main()"
            proc = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno()), repr(cpu_share), str(RENDER_NICE)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                close_fds=True)
            return cls(proc, Connection(os.dup(ours.fileno())))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: int, tokenizer: bytes, messages: list[dict], kwargs: dict[str, Any],
            should_stop: Callable[[], bool] | None) -> tuple:
        if self.tokenizer is not tokenizer:
            self.conn.send(("tokenizer", tokenizer))
            self.tokenizer = tokenizer
        self.conn.send(("render", job, messages, kwargs))
        cancelled = False
        while True:
            if self.conn.poll(_POLL_S):
                kind, answered, *rest = self.conn.recv()
                # one job at a time per child, and a child whose job failed is discarded
                assert answered == job, (answered, job)
                return (kind, *rest)
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
            _, job, messages, kwargs = msg
            reply = _render_one(conn, tokenizer, job, messages, kwargs, share, CpuShare)
            try:
                conn.send(reply)
            except OSError:
                return  # the daemon went away during the render


def _render_one(conn: Connection, tokenizer: Any, job: int, messages: list[dict], kwargs: dict[str, Any],
                share: float, cpu_share: type) -> tuple:
    def cancelled() -> bool:
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "cancel" and msg[1] == job:
                return True
        return False

    try:
        rendered = tokenizer.render_chat(messages, should_stop=cpu_share(share, cancelled), **kwargs)
    except Exception as e:  # sent back and raised in the daemon as a render in it would be
        return ("raise", job, type(e).__name__, str(e))
    return ("ok", job, rendered)
