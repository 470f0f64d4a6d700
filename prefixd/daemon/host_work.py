"""Heavy host work (long chat renders, long prompt encodes) kept from starving the engine.

A render runs Python in a worker thread: it competes with the engine thread for the GIL
and for the CPU, and every round's many short GIL hand-offs wait behind it. So a request
whose text is large is *heavy*, its chat renders in the render process where the daemon has
one (render_process.py: no GIL shared with the engine), and heavy work is bounded:

- at most `max_heavy` heavy jobs run at once in the daemon (others wait, first come first
  served), and one connection runs at most one at a time;
- a job whose client leaves while it waits for its turn leaves the queue (it never runs);
- a heavy job yields the CPU: whenever its thread has used `SLICE_S` of CPU time it sleeps
  long enough to keep its share of one core at `cpu_share` (a render polls between
  messages, so the sleep comes between messages; a long encode runs in the tokenizer
  library without the GIL and is not cut).

Light requests (the usual chat turn) take neither the gate nor the pauses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio

from prefixd.ipc.errors import ErrorCode, ProtocolError

HEAVY_MESSAGES = 256  # chat messages above which a render is heavy
HEAVY_CHARS = 64 << 10  # characters of text (message contents, a prompt) above which work is heavy
SLICE_S = 0.01  # CPU time a heavy job runs between two pauses
_PROBE_EVERY_S = 0.1  # how often a heavy job waiting for its turn checks that its client is still there


def is_heavy(msg: Mapping[str, Any]) -> bool:
    """Whether a tokenize or generate map asks for heavy host work (a cheap look: counts and
    string lengths, no rendering)."""
    messages = msg.get("messages")
    chars = 0
    if isinstance(messages, list):
        if len(messages) > HEAVY_MESSAGES:
            return True
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            chars += len(content) if isinstance(content, str) else 0
    for key in ("prompt", "text"):
        value = msg.get(key)
        chars += len(value) if isinstance(value, str) else 0
    return chars > HEAVY_CHARS


class CpuShare:
    """A poll hook for a worker thread: sleeps so the thread uses at most `share` of a core.

    Call it from the thread doing the work (it reads that thread's CPU time); it returns
    what `inner()` returns (e.g. whether the client has gone).
    """

    def __init__(self, share: float, inner: Callable[[], bool] = lambda: False,
                 sleep: Callable[[float], None] = time.sleep,
                 cpu_s: Callable[[], float] = time.thread_time) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"cpu share {share}: must be in (0, 1]")
        self.share = share
        self._inner = inner
        self._sleep = sleep
        self._cpu_s = cpu_s
        self._mark_s: float | None = None
        self.slept_s = 0.0

    def __call__(self) -> bool:
        now = self._cpu_s()
        if self._mark_s is None:
            self._mark_s = now
        used = now - self._mark_s
        if used >= SLICE_S and self.share < 1:
            pause = used * (1 - self.share) / self.share
            self._sleep(pause)
            self.slept_s += pause
            self._mark_s = self._cpu_s()
        return self._inner()


class HostWork:
    """The daemon-wide gate for heavy jobs (see the module docstring)."""

    def __init__(self, max_heavy: int, cpu_share: float) -> None:
        if max_heavy < 1:
            raise ValueError(f"max_heavy {max_heavy}: needs at least 1")
        self.cpu_share = cpu_share
        self._slots = anyio.Semaphore(max_heavy)
        self.num_running = 0
        self.num_waiting = 0

    @asynccontextmanager
    async def heavy(self, connection_lock: anyio.Lock, probe: Callable[[], bool]) -> AsyncIterator[Callable[[], bool]]:
        """Hold this connection's heavy slot and a daemon-wide one; yields the poll hook the
        job must call (`probe` wrapped in a CpuShare)."""
        async with connection_lock:
            if not await self._take_slot(probe):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the client left before its render started")
            self.num_running += 1
            try:
                yield CpuShare(self.cpu_share, probe)
            finally:
                self.num_running -= 1
                self._slots.release()

    async def _take_slot(self, probe: Callable[[], bool]) -> bool:
        """Wait for a daemon-wide slot (in turn); False, holding none, once `probe()` says the
        client has gone."""
        taken = False
        self.num_waiting += 1
        try:
            taken = await self._wait_for_slot(probe)
        finally:
            self.num_waiting -= 1
        return taken

    async def _wait_for_slot(self, probe: Callable[[], bool]) -> bool:
        taken = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while not probe():
                    await anyio.sleep(_PROBE_EVERY_S)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await self._slots.acquire()
            taken = True
            tg.cancel_scope.cancel()
        return taken
