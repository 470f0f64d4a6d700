"""The admission gate: the one way every front's request reaches the engine.

    front (socket connection, HTTP route, ...)
      │ join(client)                  pacing budget: the client's requests are read at its rate
      │ build(client, msg, job)       small builds run on the loop, light ones on a thread;
      │                               heavy renders/encodes take one of a few slots, in turn,
      │                               and run in a worker process (heavy.py)
      │ seat(client, owner)           abandon holds, then a fair seat (one per lane)
      │ submit(request)               the engine link; its errors become protocol errors
      ▼ cancel / unseat / abandon     when the stream ends or its client leaves

A *client* is whoever the front can tell apart: the peer process (pid, uid) of a socket
connection, the namespace or address of an HTTP caller. Seats are fair across clients
(fair.py), holds fall on clients that keep abandoning their generates (abandon.py), the
pacing budget is per client (pacing.py), and each client (for the socket front: each
connection) has at most `max_streams` generates in flight. The gate changes no request: the
same conversation through any front reaches the engine as the same `StreamRequest`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Hashable

import anyio

from prefixd.front.abandon import AbandonLedger
from prefixd.front.bounds import ConnectionBounds
from prefixd.front.engine_link import EngineLink, EngineRefused, EngineUnavailable
from prefixd.front.fair import FairSeats
from prefixd.front.heavy import PROBE_EVERY_S, BuildJob, HeavyWorkers
from prefixd.front.pacing import ClientBudget, Pacer
from prefixd.ipc.errors import ErrorCode, ProtocolError

HEAVY_MESSAGES = 256  # chat messages above which a render is heavy
HEAVY_CHARS = 64 << 10  # characters of text (message contents, a prompt) above which work is heavy
# A build with no chat, images, tools or response format, at most this many prompt ids and
# this many characters of text, runs on the event loop: it costs it 0.02 ms (96 ids) to
# 0.2 ms (4,096 ids, or 1,024 characters to tokenize), and the hop to a worker thread and back
# cost 0.5-1 ms (the soak's honest requests, token prompts of 24-96 ids: build 0.6 ms p50 on a
# thread, 0.1 ms on the loop), more when the thread must wait for a core.
INLINE_TOKENS = 4096
INLINE_CHARS = 1024

# The engine's refusal codes (engine.contract.REFUSAL_CODES) as the protocol spells them.
_REFUSALS = {"invalid_token": ErrorCode.INVALID_TOKEN, "context_overflow": ErrorCode.CONTEXT_OVERFLOW,
             "bad_request": ErrorCode.BAD_REQUEST}


def engine_error(error: Exception) -> ProtocolError:
    """The protocol error a front answers for an engine refusal or an engine that is not serving."""
    if isinstance(error, EngineRefused):
        return ProtocolError(_REFUSALS.get(error.code, ErrorCode.BAD_REQUEST), error.message)
    if isinstance(error, EngineUnavailable):
        return ProtocolError(ErrorCode.BUSY, str(error), fatal=False)
    raise TypeError(f"not an engine error: {error!r}")


def client_name(peer: Hashable) -> str:
    """A client's name in the engine's round policy: "pid 812 uid 1000", "http default"."""
    return " ".join(str(part) for part in peer) if isinstance(peer, tuple) else str(peer)


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


def is_inline(msg: Mapping[str, Any]) -> bool:
    """Whether a tokenize or generate map's build is cheaper than a thread hop: no chat,
    images, tools or response format, a short token prompt or a short text."""
    if msg.get("messages") is not None or msg.get("images") or msg.get("tools"):
        return False
    if msg.get("response_format") not in (None, {"type": "text"}):
        return False
    tokens = msg.get("tokens")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) > INLINE_TOKENS):
        return False
    chars = 0
    for key in ("prompt", "text"):
        value = msg.get(key)
        if value is not None and not isinstance(value, str):
            return False
        chars += len(value) if value is not None else 0
    return chars <= INLINE_CHARS


@dataclass(eq=False)
class GateClient:
    """One client as the gate sees it (a front keeps it while the client is connected)."""

    peer: Hashable
    budget: ClientBudget | None = None  # None: not paced
    heavy_lock: anyio.Lock = field(default_factory=anyio.Lock)  # one heavy job at a time per client


class Gate:
    """Shared by every front of one daemon (event loop only)."""

    def __init__(self, link: EngineLink, bounds: ConnectionBounds, num_lanes: int, builder: Any,
                 heavy: HeavyWorkers, *, fair: bool = True) -> None:
        """`builder` runs light builds (in a worker thread); `heavy` the heavy ones, in its
        processes, `bounds.max_heavy_jobs` at a time (its slots)."""
        self.link = link
        self.builder = builder
        self.heavy = heavy
        self.seats = FairSeats(num_lanes) if fair else None
        self.abandons = AbandonLedger(bounds.abandon)
        self.pacer = Pacer(bounds.pace)
        self.max_streams = bounds.max_streams
        self._heavy_slots = anyio.Semaphore(bounds.max_heavy_jobs)
        self.heavy_running = 0
        self.heavy_waiting = 0
        self._in_flight: Counter[Hashable] = Counter()

    # -- clients ----------------------------------------------------------------------------

    def join(self, peer: Hashable, *, connection: bool = True) -> GateClient:
        """A client arrives: a connection (charged the pacing's connect cost) or one HTTP request."""
        budget = None
        if self.pacer.limits.rate is not None:
            budget = self.pacer.join(peer) if connection else self.pacer.visit(peer)
        return GateClient(peer, budget)

    def leave(self, client: GateClient) -> None:
        if client.budget is not None:
            self.pacer.leave(client.budget)

    async def paced(self, client: GateClient, *, refused: bool = False) -> None:
        """Charge one request (or refused frame) to the client and wait while it is in debt."""
        if client.budget is not None:
            client.budget.frame(refused=refused)
            await client.budget.wait()

    async def refused(self, peer: Hashable) -> None:
        """A request of a connectionless front (HTTP) refused with a 4xx, wherever it was
        refused (its body, its fields, its model, its token): charged `error_cost` to `peer`,
        as a refused socket frame is, and answered once its client is out of debt. Without
        this a flood of bad requests cost its sender nothing (bench/soak.py --http)."""
        client = self.join(peer, connection=False)
        try:
            await self.paced(client, refused=True)
        finally:
            self.leave(client)

    # -- in flight --------------------------------------------------------------------------

    def reserve(self, key: Hashable) -> None:
        """Count one more generate in flight for `key`; too_many_streams past `max_streams`."""
        if self._in_flight[key] >= self.max_streams:
            raise ProtocolError(ErrorCode.TOO_MANY_STREAMS, f"{self._in_flight[key]} generates are already in flight")
        self._in_flight[key] += 1

    def release(self, key: Hashable) -> None:
        self._in_flight[key] -= 1
        if self._in_flight[key] <= 0:
            del self._in_flight[key]

    # -- heavy work -------------------------------------------------------------------------

    async def build(self, client: GateClient, msg: Mapping[str, Any], job: BuildJob, *,
                    probe: Callable[[], bool]) -> Any:
        """`job` for the request `msg`: a small one (`is_inline`) on the event loop; a light
        one on the builder in a worker thread; a heavy one, once it has the client's heavy
        lock and one of the daemon's heavy slots (a client gone while it waits never runs), in
        a heavy worker process."""
        if is_inline(msg):
            return job.run(self.builder, probe)
        if not is_heavy(msg):
            return await anyio.to_thread.run_sync(job.run, self.builder, probe)
        async with self._heavy(client, probe):
            return await self.heavy.run(job, probe)

    @asynccontextmanager
    async def _heavy(self, client: GateClient, probe: Callable[[], bool]) -> AsyncIterator[None]:
        async with client.heavy_lock:
            self.heavy_waiting += 1
            try:
                taken = await self._wait_for_slot(probe)
            finally:
                self.heavy_waiting -= 1
            if not taken:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "the client left before its render started")
            self.heavy_running += 1
            try:
                yield
            finally:
                self.heavy_running -= 1
                self._heavy_slots.release()

    async def _wait_for_slot(self, probe: Callable[[], bool]) -> bool:
        taken = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while not probe():
                    await anyio.sleep(PROBE_EVERY_S)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            await self._heavy_slots.acquire()
            taken = True
            tg.cancel_scope.cancel()
        return taken

    # -- seats ------------------------------------------------------------------------------

    async def seat(self, client: GateClient, owner: Hashable) -> bool:
        """Wait out the client's abandon hold, then for a fair seat; False without seats.
        `owner`: (client peer, ...) — the path fairness is counted over."""
        seats = self.seats
        if seats is None:
            return False
        await self.abandons.wait(client.peer, lambda: seats.others_active(owner), lambda: seats.held_by((client.peer,)))
        await seats.take(owner)
        return True

    def unseat(self, owner: Hashable) -> None:
        if self.seats is not None:
            self.seats.give_back(owner)

    def abandon(self, client: GateClient, count: int = 1) -> None:
        """`count` of the client's generates that reached the engine were left (abandon.py)."""
        if count:
            self.abandons.abandon(client.peer, count)

    # -- the engine -------------------------------------------------------------------------

    async def submit(self, request: Any, client: GateClient | None = None, *,
                     on_end: Callable[[], None] | None = None) -> Any:
        """Submit to the engine as `client`'s (the round policy serves the least-served client
        first: scheduler/fairness.py); its refusals and unavailability as ProtocolErrors.
        `on_end()` runs once the engine has ended the stream (its done event, or the engine's death)."""
        if client is not None:
            request = dataclasses.replace(request, client=client_name(client.peer))
        try:
            return await self.link.submit(request, on_end=on_end)
        except (EngineRefused, EngineUnavailable) as e:
            raise engine_error(e) from None

    def cancel(self, stream_id: int, keep_rows: int | None = None) -> None:
        self.link.cancel_nowait(stream_id, keep_rows)

    def stats(self) -> dict[str, Any]:
        return {**self.pacer.stats(), **self.abandons.stats(), "heavy_running": self.heavy_running,
                "heavy_waiting": self.heavy_waiting}
