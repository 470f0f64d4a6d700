"""One client connection: frames in, replies and stream events out.

    reader ──▶ dispatch ──▶ replies ─────────────────┐
                 └─ generate ─▶ forward task per stream ─┴─▶ bounded out queue ─▶ writer ─▶ socket

Every reply goes through one bounded queue. When it is full, whoever sends waits: the
reader stops reading the client's frames until the writer has made room (backpressure),
and only a client that takes no bytes for `send_timeout_s` is disconnected (its streams are
cancelled). Bad requests get `{code, message}` and the connection goes on; a frame that
breaks framing closes only this connection. A frame's memfd payloads are read only after
the checks that need none of them, and off the event loop.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from prefixd.front.bounds import ConnectionBounds
from prefixd.front.diagnostics import excerpt_reports, with_excerpt
from prefixd.front.engine_link import EngineLost, EngineUnavailable
from prefixd.front.gate import Gate, GateClient, engine_error
from prefixd.front.heavy import BuildJob
from prefixd.front.peer_probe import peer_probe
from prefixd.front.requests import RequestBuilder
from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.events import ErrorReply, OkReply, StatusReply
from prefixd.ipc.fields import request_id_of
from prefixd.ipc.framing import Frame, close_fds
from prefixd.ipc.memfd import check_refs, resolve_payloads
from prefixd.ipc.messages import check_before_payloads
from prefixd.scheduler.streams import DoneEvent, TokenEvent, Usage

log = logging.getLogger("prefixd.connection")

_LOOP_DETOKENIZE_IDS = 1024  # longer detokenizes run off the event loop
_FLUSH_S = 1.0  # how long a closing connection may take to send its last frames
_WRITE_BATCH = 64  # frames the writer takes from its queue for one write
_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError)


@dataclass(eq=False)
class Services:
    """What every front shares: the gate (and through it the engine), request building,
    daemon facts."""

    gate: Gate
    builder: RequestBuilder
    hello_reply: Callable[[], dict[str, Any]]
    status: Callable[[], Awaitable[dict[str, Any]]]  # the status reply's map: the engine's and the daemon's
    shutting_down: Callable[[], bool]
    next_stream_id: Callable[[], int]

    def max_context(self) -> int | None:
        """The longest prompt the model takes, as the hello reply's model map says."""
        value = self.builder.model_info.get("max_context")
        return value if type(value) is int else None


class Connection:
    """Serves one framed stream until the client leaves, breaks framing, or stops reading."""

    def __init__(self, framed: Any, services: Services, bounds: ConnectionBounds | None = None,
                 client: GateClient | None = None) -> None:
        bounds = bounds or ConnectionBounds()
        self.framed = framed
        # the client: its peer process (pid, uid) where the socket says, else this connection
        # alone (a token, not self: a cycle would keep a closed connection's buffers until a gc)
        token = object()
        self.client = client or GateClient(token)
        self.peer: Hashable = self.client.peer
        self._seat_owner = (self.peer, token)  # seats are fair across clients, then their connections
        self.budget = self.client.budget  # the client's frame credits (pacing.py); None: not paced
        self.max_streams = bounds.max_streams
        self.gate = services.gate
        self.services = services
        self._out_send, self._out_receive = anyio.create_memory_object_stream[dict](bounds.out_frames)
        self._streams: dict[int, int | None] = {}  # request id -> engine stream id (None: being built)
        self._cancel_early: set[int] = set()  # generates cancelled while being built
        self._seat_waits: dict[int, anyio.CancelScope] = {}  # generates waiting for a fair seat
        self._last_turn: anyio.Event | None = None  # set once the newest generate asked for its seat
        self._writer_done = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self.slow = False
        self.version = 1  # until a hello negotiates another

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def serve(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._writer)
                await self._reader()
                await self.flush()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if not self.services.shutting_down():
                    self._abandon(sum(1 for stream_id in self._streams.values() if stream_id is not None))
                self._cancel_all_streams()
                self._out_send.close()
                self._out_receive.close()
                await self.framed.aclose()

    def cancel_streams(self) -> None:
        """Ask the engine to end every stream of this connection (done: cancelled follows)."""
        for request_id, stream_id in self._streams.items():
            if stream_id is None:
                self._cancel_early.add(request_id)
                self._stop_seat_wait(request_id)
            else:
                self.gate.cancel(stream_id)

    # -- in ---------------------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            if self.budget is not None:
                await self.budget.wait()  # a client in debt is read no further until it is out
            try:
                frame = await self.framed.receive_frame()
            except ProtocolError as e:
                await self._refuse(e, charged=False)
                if e.fatal:
                    return
                continue
            except _CLOSED:
                return
            if self.budget is not None:
                self.budget.frame()
            try:
                msg = await self._open(frame)
            except ProtocolError as e:
                await self._refuse(e)
                continue
            if msg.get("type") == "generate":
                await self._start_generate(msg)  # several generates sent together start in the same round
            else:
                await self._handle(msg)

    async def _start_generate(self, msg: dict[str, Any]) -> None:
        """Reserve the generate's id now (so a cancel finds it), build and submit it in a task."""
        request_id = request_id_of(msg)
        try:
            self._admissible(msg)
        except ProtocolError as e:
            await self._refuse(e.with_id(request_id))
            return
        if request_id is not None:
            self._streams[request_id] = None
        after, turn = self._last_turn, anyio.Event()
        self._last_turn = turn
        assert self._tg is not None
        self._tg.start_soon(self._generate_task, msg, request_id, after, turn)

    async def _generate_task(self, msg: dict[str, Any], request_id: int | None,
                             after: anyio.Event | None, turn: anyio.Event) -> None:
        try:
            await self._handle(msg, functools.partial(self._on_generate, after=after, turn=turn))
        finally:
            turn.set()
            if request_id is not None and self._streams.get(request_id, 0) is None:
                self._streams.pop(request_id, None)  # refused before it reached the engine
            self._cancel_early.discard(request_id)

    async def _open(self, frame: Frame) -> dict[str, Any]:
        """The frame's map with its memfd payloads read, once every check that needs none
        of them has passed; closes the frame's descriptors."""
        if not frame.num_refs:
            close_fds(frame.fds)
            return frame.msg
        try:
            check_before_payloads(frame.msg, self.services.max_context())
            check_refs(frame, self.framed.limits)
        except ProtocolError as e:
            close_fds(frame.fds)
            raise e.with_id(request_id_of(frame.msg)) from None
        read = functools.partial(resolve_payloads, frame, self.framed.limits, arrays=True)
        return await anyio.to_thread.run_sync(read)

    async def _handle(self, msg: dict[str, Any], handler: Callable[[dict[str, Any]], Any] | None = None) -> None:
        request_id = request_id_of(msg)  # an error never repeats an id that is not a valid one
        try:
            if handler is None:
                kind = msg.get("type")
                handler = self._handlers().get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}")
            await handler(msg)
        except ProtocolError as e:
            await self._refuse(e.with_id(request_id))
        except EngineUnavailable as e:
            await self._send(engine_error(e).with_id(request_id).to_wire())

    async def _refuse(self, error: ProtocolError, charged: bool = True) -> None:
        """Reply `error`; the client pays a refused frame's cost (`charged`: its frame was
        already charged as read)."""
        if self.budget is not None:
            if charged:
                self.budget.refused()
            else:
                self.budget.frame(refused=True)
        await self._send(ErrorReply.of(error).to_wire())

    def _handlers(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        return {
            "hello": self._on_hello,
            "generate": self._on_generate,
            "cancel": self._on_cancel,
            "status": self._on_status,
            "tokenize": self._on_tokenize,
            "detokenize": self._on_detokenize,
        }

    async def _on_hello(self, msg: dict[str, Any]) -> None:
        reply = self.services.builder.hello(msg, self.services.hello_reply())
        self.version = reply.version
        await self._send(reply.to_wire())

    async def _on_status(self, msg: dict[str, Any]) -> None:
        request_id = self.services.builder.status(msg)
        status = excerpt_reports(await self.services.status(), self.services.builder.tokenizer)
        await self._send(StatusReply(request_id, status).to_wire())

    async def _on_tokenize(self, msg: dict[str, Any]) -> None:
        reply = await self._off_loop(msg, BuildJob("tokenize", (msg,)))
        await self._send(reply.to_wire())

    async def _off_loop(self, msg: dict[str, Any], job: BuildJob) -> Any:
        """`job` off the event loop, through the gate (heavy work: its slots and processes)."""
        return await self.gate.build(self.client, msg, job, probe=peer_probe(self.framed))

    async def _on_detokenize(self, msg: dict[str, Any]) -> None:
        ids = msg.get("ids")
        if isinstance(ids, (list, array)) and len(ids) > _LOOP_DETOKENIZE_IDS:
            reply = await anyio.to_thread.run_sync(self.services.builder.detokenize, msg)
        else:  # the common short case costs less than a thread hop
            reply = self.services.builder.detokenize(msg)
        await self._send(reply.to_wire())

    async def _on_cancel(self, msg: dict[str, Any]) -> None:
        request_id, target = self.services.builder.cancel(msg)
        if target not in self._streams:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no generate with id {target} is in flight")
        stream_id = self._streams[target]
        if stream_id is None:
            self._cancel_early.add(target)  # still being built: cancelled once submitted
            self._stop_seat_wait(target)
        else:
            self.gate.cancel(stream_id)
            self._abandon(1)
        await self._send(OkReply(request_id).to_wire())

    def _abandon(self, count: int) -> None:
        """`count` of this client's generates that reached the engine were left (abandon.py)."""
        self.gate.abandon(self.client, count)

    def _admissible(self, msg: dict[str, Any]) -> None:
        request_id = msg.get("id")
        if isinstance(request_id, int) and request_id in self._streams:
            raise ProtocolError(ErrorCode.DUPLICATE_ID, f"request id {request_id} is already in flight")
        if len(self._streams) >= self.max_streams:
            raise ProtocolError(ErrorCode.TOO_MANY_STREAMS,
                                f"this connection already has {len(self._streams)} generates in flight")
        if self.services.shutting_down():
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down and takes no new work")

    async def _on_generate(self, msg: dict[str, Any], after: anyio.Event | None = None,
                           turn: anyio.Event | None = None) -> None:
        """Build the generate off the loop, then take a seat, in the order the connection
        sent its generates (`after`: the previous one has asked for its seat; `turn`: this one
        has), whichever build finishes first, and submit it."""
        started_s = time.monotonic()
        stream_id = self.services.next_stream_id()
        built = await self._off_loop(msg, BuildJob("generate", (msg, stream_id, self.version)))
        seated = await self._take_seat(built.request_id, after)
        if turn is not None:
            turn.set()
        if not seated and self.gate.seats is not None:  # cancelled before it had a seat
            await self._end_unsubmitted(built, stream_id, time.monotonic() - started_s)
            return
        try:
            await self._submit_and_forward(built, stream_id)
        finally:
            if seated:
                self.gate.unseat(self._seat_owner)

    async def _submit_and_forward(self, built: Any, stream_id: int) -> None:
        receive = await self.gate.submit(built.request, self.client)
        self._streams[built.request_id] = stream_id
        if built.request_id in self._cancel_early:
            self.gate.cancel(stream_id)
        await self._forward(built, receive)

    async def _take_seat(self, request_id: int, after: anyio.Event | None = None) -> bool:
        """Wait until `after` is set, then for a fair seat (fair.py); False without one: no
        seats, or the generate was cancelled first."""
        if self.gate.seats is None or request_id in self._cancel_early:
            return False
        with anyio.CancelScope() as scope:
            self._seat_waits[request_id] = scope
            try:
                if after is not None:
                    await after.wait()
                return await self.gate.seat(self.client, self._seat_owner)
            finally:
                self._seat_waits.pop(request_id, None)
        return False

    async def _end_unsubmitted(self, built: Any, stream_id: int, total_s: float) -> None:
        """done: cancelled for a generate cancelled before it reached the engine, as the
        engine reports a stream cancelled before it was seated."""
        usage = Usage(prompt_tokens=len(built.request.tokens), cached_tokens=0, prefilled_tokens=0,
                      completion_tokens=0, cache="off", ttft_s=0.0, total_s=total_s)
        self._streams.pop(built.request_id, None)
        for final in self.services.builder.output(built).done(DoneEvent(stream_id, "cancelled", usage)):
            await self._send(final.to_wire())

    def _stop_seat_wait(self, request_id: int) -> None:
        scope = self._seat_waits.get(request_id)
        if scope is not None:
            scope.cancel()

    # -- out --------------------------------------------------------------------------------

    async def _forward(self, built: Any, receive: MemoryObjectReceiveStream[Any]) -> None:
        out = self.services.builder.output(built)
        done = None
        lost = "the engine stopped before this stream finished"
        async with receive:
            async for event in receive:
                if isinstance(event, EngineLost):
                    lost = event.note
                    continue
                if not isinstance(event, TokenEvent):
                    done = event
                    continue
                was_hit = out.stop_hit
                token = out.tokens(event)
                if token is not None:
                    await self._send(token.to_wire())
                if out.stop_hit and not was_hit:
                    keep = out.keep_generated
                    keep_rows = None if keep is None else len(built.request.tokens) + keep
                    self.gate.cancel(event.stream_id, keep_rows)
        self._streams.pop(built.request_id, None)
        if done is None:
            await self._send(ErrorReply(built.request_id, ErrorCode.INTERNAL.value, lost).to_wire())
            return
        if done.usage.divergence is not None:  # the excerpt's text: a few ids, decoded here
            done = dataclasses.replace(done, usage=with_excerpt(done.usage, self.services.builder.tokenizer))
        for final in out.done(done):
            await self._send(final.to_wire())

    async def _send(self, frame: dict[str, Any]) -> None:
        """Queue `frame` for the writer, waiting while the queue is full (the reader then
        reads nothing more from this client until the writer makes room)."""
        try:
            await self._out_send.send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.debug("dropping a frame for a closed connection")

    async def _writer(self) -> None:
        try:
            async for frame in self._out_receive:
                frames = [frame]
                while len(frames) < _WRITE_BATCH:  # what else is queued goes out in the same write
                    try:
                        frames.append(self._out_receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                try:
                    await self.framed.send_many(frames)
                except (*_CLOSED, TimeoutError) as e:
                    # Gone, or not reading within the send timeout: end the whole connection.
                    if isinstance(e, TimeoutError):
                        self.slow = True
                        log.info("closing a connection whose client does not read")
                    assert self._tg is not None
                    self._tg.cancel_scope.cancel()
                    return
        finally:
            self._writer_done.set()

    async def flush(self) -> None:
        """Stop taking frames, send what is queued (for at most _FLUSH_S), then return."""
        self._out_send.close()
        with anyio.move_on_after(_FLUSH_S):
            await self._writer_done.wait()

    def _cancel_all_streams(self) -> None:
        self.cancel_streams()
        self._streams.clear()

