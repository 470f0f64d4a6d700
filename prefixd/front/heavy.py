"""Heavy builds in worker processes of their own, not threads of the front.

A heavy request (`gate.is_heavy`: a chat of many messages, a long text) spends hundreds of
milliseconds in Python: rendering 8,000 short messages and tokenizing the result takes about
250 ms. In a thread of the front it holds the interpreter lock the event loop needs, and
while the system gives that thread's core to the engine the loop waits for a lock whose
holder is not running (bench/soak.py: beside huge chats alone the honest p99 TTFT was 154 ms
against 32 ms without them; at the thread's normal niceness, 324 ms). A process shares no
lock with the loop. It runs under the scheduling class SCHED_IDLE where the system has one
(Linux), else at niceness HEAVY_NICE, the lowest, so it takes only what the engine and the
loop leave: beside a hostile client rendering huge chats back to back the soak's honest p99
TTFT was 1.35-1.39x its baseline at niceness 10 and 1.18x at 19. Niceness alone still let the
worker hold a core for tens of milliseconds: the engine's threads sleep for moments between
the operations of a round, the worker takes the core, and a thread that wakes is not sure to
get it back at once. Rounds of 40 ms and more (10-13 ms is usual) came with its renders;
under SCHED_IDLE any other task that wakes takes the core from it at once (huge chats beside
honest clients: 7 such rounds in 45 s at niceness 19, none under SCHED_IDLE; docs/benchmarks.md).
A heavy request of an agent (a long system prompt and tool list) renders in tens of
milliseconds on an idle engine; beside a busy one it runs in the moments the engine leaves,
next to prefill work of seconds.

`HeavyWorkers` keeps one process per heavy slot (`ConnectionBounds.max_heavy_jobs`), started
on the first heavy job and kept for the daemon's life. Each builds its own builder with
`make_builder` (a picklable callable: the daemon's is `RequestBuilder` over the front's
tokenizer, model info and limits). A job is a `BuildJob`: the builder method's name and its
arguments, all plain data; its answer, or the `ProtocolError` it raised, comes back pickled.
A client that leaves while its job runs: the front sets the job's flag in shared memory,
which the render polls between messages (the `client_gone` a thread's render polls). A worker
that dies (killed, out of memory) fails the jobs it held with `internal`; the next job starts
the workers anew.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Literal

import anyio

from prefixd.engine.memory import trim_heap
from prefixd.ipc.errors import ErrorCode, ProtocolError

log = logging.getLogger("prefixd.front")

HEAVY_NICE = 19  # a heavy job's worker process runs at this niceness (the lowest), and under SCHED_IDLE
PROBE_EVERY_S = 0.1  # how often a running job's client is checked


@dataclass(frozen=True)
class BuildJob:
    """One build: a builder method by name and its arguments (plain data, so a worker process
    runs it on a builder of its own). `chat` goes to `generate` as its `chat` keyword."""

    method: Literal["tokenize", "generate"]
    args: tuple[Any, ...]
    chat: Any = None  # requests.ChatOptions, for "generate"

    def run(self, builder: Any, client_gone: Callable[[], bool] | None = None) -> Any:
        kwargs = {} if self.chat is None else {"chat": self.chat}
        return getattr(builder, self.method)(*self.args, client_gone=client_gone, **kwargs)


# -- in the worker process ------------------------------------------------------------------

_builder: Any = None
_gone: Any = None  # the shared flags: slot -> 1 once that slot's client has left


def lower_priority(nice: int) -> None:
    """Run the calling process (its main thread, and the threads it starts after) at niceness
    `nice`, and under SCHED_IDLE where the system has it; whatever the system refuses stays."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        pass
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def _start_worker(make_builder: Callable[[], Any], gone: Any, nice: int) -> None:
    global _builder, _gone
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when its workers stop
    lower_priority(nice)
    _builder, _gone = make_builder(), gone
    warm = getattr(_builder, "warm", None)
    if warm is not None:
        warm()


def _run_job(job: BuildJob, slot: int) -> Any:
    try:
        return job.run(_builder, lambda: _gone[slot] != 0)
    finally:
        # A render of thousands of messages leaves tens of megabytes of freed heap that glibc
        # keeps; handing it back costs ~3 ms (the soak's worker: 90 -> 119 MB in 30 s without).
        trim_heap()


# -- in the front ---------------------------------------------------------------------------


class HeavyWorkers:
    """`slots` worker processes for heavy builds (event loop only). `run` takes one slot; the
    caller (the gate) bounds how many run at once to `slots`."""

    def __init__(self, make_builder: Callable[[], Any], slots: int, *, nice: int = HEAVY_NICE) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._ctx = multiprocessing.get_context("spawn")  # the front runs threads: no fork
        self._make_builder = make_builder
        self._nice = nice
        self._slots = slots
        self._gone = self._ctx.RawArray("b", slots)
        self._free = list(range(slots))
        self._pool: ProcessPoolExecutor | None = None

    @property
    def started(self) -> bool:
        return self._pool is not None

    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self._slots, mp_context=self._ctx, initializer=_start_worker,
                                             initargs=(self._make_builder, self._gone, self._nice))
        return self._pool

    async def run(self, job: BuildJob, probe: Callable[[], bool]) -> Any:
        """`job` in a worker process; `probe()` true (checked every PROBE_EVERY_S) tells the
        render its client is gone. Once started, the job is waited for even if the caller is
        cancelled (its slot is busy until it ends), and its render told to stop."""
        if not self._free:
            raise RuntimeError("more heavy jobs than slots: the gate bounds them")
        slot = self._free.pop()
        self._gone[slot] = 0
        try:
            future = self._workers().submit(_run_job, job, slot)
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    try:
                        while not probe():
                            await anyio.sleep(PROBE_EVERY_S)
                    finally:  # the client left, or the caller was cancelled
                        self._gone[slot] = 1

                tg.start_soon(watch)
                with anyio.CancelScope(shield=True):
                    try:
                        result, error = await asyncio.wrap_future(future), None
                    except Exception as e:  # noqa: BLE001 - raised below, outside the task group
                        result, error = None, e
                tg.cancel_scope.cancel()
        finally:
            self._free.append(slot)
        if isinstance(error, BrokenProcessPool):
            self._broken()
            raise ProtocolError(ErrorCode.INTERNAL, "the worker process rendering this request died; "
                                "send it again") from None
        if error is not None:
            raise error
        return result

    def _broken(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            log.warning("a heavy-work process died; the next heavy request starts them again")
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the workers (a render in progress is told to stop; then they exit)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for slot in range(self._slots):
                self._gone[slot] = 1
            pool.shutdown(wait=True, cancel_futures=True)
