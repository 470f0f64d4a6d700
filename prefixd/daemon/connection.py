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

import functools
import logging
from array import array
from dataclasses import dataclass
from typing import Any, Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from prefixd.daemon.bounds import ConnectionBounds
from prefixd.daemon.engine_host import EngineFailed, EngineHost, StreamTokens
from prefixd.daemon.peer_probe import peer_probe
from prefixd.daemon.requests import RequestBuilder
from prefixd.daemon.stops import StopMatcher
from prefixd.ipc.errors import ErrorCode, ProtocolError
from prefixd.ipc.fields import request_id_of
from prefixd.ipc.framing import Frame, close_fds
from prefixd.ipc.memfd import check_refs, resolve_payloads
from prefixd.ipc.messages import check_before_payloads

log = logging.getLogger("prefixd.connection")

_LOOP_DETOKENIZE_IDS = 1024  # longer detokenizes run off the event loop
_FLUSH_S = 1.0  # how long a closing connection may take to send its last frames
_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError)


@dataclass(eq=False)
class Services:
    """What every connection shares: the engine host, request building, daemon facts."""

    host: EngineHost
    builder: RequestBuilder
    hello_reply: Callable[[], dict[str, Any]]
    status_extra: Callable[[], dict[str, Any]]
    shutting_down: Callable[[], bool]
    next_stream_id: Callable[[], int]

    def max_context(self) -> int | None:
        """The longest prompt the model takes, as the hello reply's model map says."""
        value = self.builder.model_info.get("max_context")
        return value if type(value) is int else None


class Connection:
    """Serves one framed stream until the client leaves, breaks framing, or stops reading."""

    def __init__(self, framed: Any, services: Services, bounds: ConnectionBounds | None = None) -> None:
        bounds = bounds or ConnectionBounds()
        self.framed = framed
        self.max_streams = bounds.max_streams
        self.services = services
        self._out_send, self._out_receive = anyio.create_memory_object_stream[dict](bounds.out_frames)
        self._streams: dict[int, int] = {}  # request id -> engine stream id
        self._writer_done = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self.slow = False

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
                self._cancel_all_streams()
                self._out_send.close()
                self._out_receive.close()
                await self.framed.aclose()

    def cancel_streams(self) -> None:
        """Ask the engine to end every stream of this connection (done: cancelled follows)."""
        for stream_id in self._streams.values():
            self.services.host.cancel_nowait(stream_id)

    # -- in ---------------------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            try:
                frame = await self.framed.receive_frame()
            except ProtocolError as e:
                await self._send(e.to_wire())
                if e.fatal:
                    return
                continue
            except _CLOSED:
                return
            try:
                msg = await self._open(frame)
            except ProtocolError as e:
                await self._send(e.to_wire())
                continue
            await self._handle(msg)

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

    async def _handle(self, msg: dict[str, Any]) -> None:
        request_id = request_id_of(msg)  # an error never repeats an id that is not a valid one
        try:
            kind = msg.get("type")
            handler = self._handlers().get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}")
            await handler(msg)
        except ProtocolError as e:
            await self._send(e.with_id(request_id).to_wire())
        except EngineFailed as e:
            await self._send(ProtocolError(ErrorCode.INTERNAL, str(e), request_id).to_wire())

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
        await self._send(self.services.builder.hello(msg, self.services.hello_reply()))

    async def _on_status(self, msg: dict[str, Any]) -> None:
        request_id = self.services.builder.status(msg)
        status = await self.services.host.call(lambda engine: engine.status())
        await self._send({**status, **self.services.status_extra(), "type": "status", "id": request_id})

    async def _on_tokenize(self, msg: dict[str, Any]) -> None:
        reply = await anyio.to_thread.run_sync(self.services.builder.tokenize, msg, peer_probe(self.framed))
        await self._send(reply)

    async def _on_detokenize(self, msg: dict[str, Any]) -> None:
        ids = msg.get("ids")
        if isinstance(ids, (list, array)) and len(ids) > _LOOP_DETOKENIZE_IDS:
            await self._send(await anyio.to_thread.run_sync(self.services.builder.detokenize, msg))
        else:  # the common short case costs less than a thread hop
            await self._send(self.services.builder.detokenize(msg))

    async def _on_cancel(self, msg: dict[str, Any]) -> None:
        request_id, target = self.services.builder.cancel(msg)
        stream_id = self._streams.get(target)
        if stream_id is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no generate with id {target} is in flight")
        self.services.host.cancel_nowait(stream_id)
        await self._send({"type": "ok", "id": request_id})

    async def _on_generate(self, msg: dict[str, Any]) -> None:
        request_id = msg.get("id")
        if isinstance(request_id, int) and request_id in self._streams:
            raise ProtocolError(ErrorCode.DUPLICATE_ID, f"request id {request_id} is already in flight")
        if len(self._streams) >= self.max_streams:
            raise ProtocolError(ErrorCode.TOO_MANY_STREAMS,
                                f"this connection already has {len(self._streams)} generates in flight")
        if self.services.shutting_down():
            raise ProtocolError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down and takes no new work")
        stream_id = self.services.next_stream_id()
        built = await anyio.to_thread.run_sync(self.services.builder.generate, msg, stream_id, peer_probe(self.framed))
        try:
            receive = await self.services.host.submit(built.request)
        except Exception as e:
            code = getattr(e, "code", None)
            if code is None:
                raise
            raise ProtocolError(ErrorCode(code), e.message) from None
        self._streams[built.request_id] = stream_id
        assert self._tg is not None
        self._tg.start_soon(self._forward, built, receive)

    # -- out --------------------------------------------------------------------------------

    async def _forward(self, built: Any, receive: MemoryObjectReceiveStream[Any]) -> None:
        decoder = self.services.builder.decoder()
        stops = StopMatcher(built.stop)
        sent_ids = 0
        done = None
        async with receive:
            async for event in receive:
                if isinstance(event, StreamTokens):
                    if stops.stopped:
                        continue
                    # A stop id ends the stream; its text (an end-of-turn marker) is not the reply's.
                    shown = [i for i in event.ids if i not in built.request.stop_ids]
                    text, hit = stops.push(decoder.push(shown))
                    await self._send(_token_event(built.request_id, event.ids, text, event.logits_sha256))
                    sent_ids += len(event.ids)
                    if hit:
                        self.services.host.cancel_nowait(event.stream_id)
                else:
                    done = event
        self._streams.pop(built.request_id, None)
        if done is None:
            await self._send(ProtocolError(ErrorCode.INTERNAL, "the engine stopped before this stream finished",
                                     built.request_id).to_wire())
            return
        if not stops.stopped:
            tail = stops.push(decoder.flush())[0] + stops.flush()
            if tail:
                await self._send(_token_event(built.request_id, (), tail, None))
        await self._send(_done_event(built.request_id, done, stopped=stops.stopped, sent_ids=sent_ids))

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
                try:
                    await self.framed.send(frame)
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


def _token_event(request_id: int, ids: tuple[int, ...], text: str, digests: tuple[str, ...] | None) -> dict:
    event: dict[str, Any] = {"type": "token", "id": request_id, "ids": list(ids), "text": text}
    if digests is not None:
        event["logits_sha256"] = list(digests)
    return event


def _done_event(request_id: int, done: Any, *, stopped: bool, sent_ids: int) -> dict:
    usage = done.usage
    event: dict[str, Any] = {
        "type": "done",
        "id": request_id,
        "finish_reason": "stop" if stopped else done.finish_reason,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "prefilled_tokens": usage.prefilled_tokens,
            "completion_tokens": sent_ids if stopped else usage.completion_tokens,
            "ttft_s": usage.ttft_s,
            "total_s": usage.total_s,
            "cache": usage.cache,
        },
    }
    if done.note:
        event["note"] = done.note
    return event
