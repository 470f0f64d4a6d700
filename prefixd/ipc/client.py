"""Client library: `AsyncClient` multiplexes requests on one connection by id;
`SyncClient` offers the same calls, blocking, by running an AsyncClient in a portal thread.

    async with await AsyncClient.connect() as client:
        result = await client.generate(prompt="Hello", max_tokens=16).collect()
        async with client.generate(prompt="Hi") as stream:
            async for event in stream:  # TokenEvents, then the DoneEvent
                ...
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from prefixd.ipc.errors import DISCONNECTED, ClientError, ProtocolError
from prefixd.ipc.events import (
    DoneEvent,
    ErrorReply,
    Event,
    HelloReply,
    StatusReply,
    TextReply,
    TokenEvent,
    TokensReply,
    Usage,
    parse_event,
)
from prefixd.ipc.fields import request_id_of
from prefixd.ipc.framing import Limits
from prefixd.ipc.messages import (
    SUPPORTED_VERSIONS,
    Cancel,
    Detokenize,
    Generate,
    Hello,
    Sampling,
    Status,
    Tokenize,
)
from prefixd.ipc.paths import default_socket_path
from prefixd.ipc.transport import FramedStream


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """Everything one generate produced, collected."""

    id: int
    ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage
    note: str | None
    logits_sha256: tuple[str, ...] | None
    tool_calls: tuple[dict[str, Any], ...] | None = None  # v2: the calls the reply made
    logprobs: tuple[dict[str, Any], ...] | None = None  # v2: per id, when asked


class GenerateStream:
    """The events of one generate: TokenEvents, then one DoneEvent, then the end.

    The request is sent by `start()`, by entering `async with`, or on first iteration.
    Leaving `async with` before the DoneEvent cancels the generate. A server error for it
    raises ClientError from iteration.
    """

    def __init__(self, client: AsyncClient, request: Generate) -> None:
        self.client = client
        self.request = request
        self.done: DoneEvent | None = None
        self._events: MemoryObjectReceiveStream[Event] | None = None

    @property
    def id(self) -> int:
        return self.request.id

    async def start(self) -> GenerateStream:
        if self._events is None:
            await self.client._speak(self.request.min_version)
            self._events = await self.client._send_request(self.request)
        return self

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> TokenEvent | DoneEvent:
        await self.start()
        assert self._events is not None, "start() opened the event stream"
        if self.done is not None:
            raise StopAsyncIteration
        try:
            event = await self._events.receive()
        except anyio.EndOfStream:
            self._finish()
            reason = self.client._closed_reason
            raise reason or ClientError(DISCONNECTED, f"connection closed during generate {self.id}") from None
        if isinstance(event, ErrorReply):
            self._finish()
            raise ClientError(event.code, event.message)
        if isinstance(event, DoneEvent):
            self.done = event
            self._finish()
        return event  # type: ignore[return-value]

    def _finish(self) -> None:
        self.client._forget(self.id)
        if self._events is not None:
            self._events.close()

    async def cancel(self) -> None:
        """Ask the server to end this generate; its DoneEvent (cancelled) still follows."""
        if self.done is None and self._events is not None:
            await self.client.cancel(self.id)

    async def collect(self) -> GenerateResult:
        """Run to the end and gather ids, text, digests and the done event."""
        ids: list[int] = []
        texts: list[str] = []
        digests: list[str] = []
        logprobs: list[dict[str, Any]] = []
        async for event in self:
            if isinstance(event, TokenEvent):
                ids.extend(event.ids)
                texts.append(event.text)
                digests.extend(event.logits_sha256 or ())
                logprobs.extend(event.logprobs or ())
        done = self.done
        assert done is not None, "iteration ends only after the done event"
        return GenerateResult(
            self.id, tuple(ids), "".join(texts), done.finish_reason, done.usage, done.note,
            tuple(digests) if self.request.logits else None, done.tool_calls,
            tuple(logprobs) if self.request.logprobs is not None else None,
        )

    async def __aenter__(self) -> GenerateStream:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        if self.done is None and self.id in self.client._pending:
            with anyio.CancelScope(shield=True):
                try:
                    await self.client.cancel(self.id)
                except ClientError:
                    pass  # it finished or the connection ended meanwhile: nothing to cancel
        self._finish()


class AsyncClient:
    """One connection to the daemon. Use as `async with await AsyncClient.connect(path)`."""

    def __init__(self, framed: FramedStream) -> None:
        self.framed = framed
        self._ids = itertools.count(1)
        self._pending: dict[int, MemoryObjectSendStream[Event]] = {}
        self._task_group: TaskGroup | None = None
        self._closed_reason: ClientError | None = None
        self.version = 1  # the protocol version this connection speaks, until hello says otherwise

    @classmethod
    async def connect(cls, path: str | os.PathLike[str] | None = None, limits: Limits | None = None) -> AsyncClient:
        """Connect to `path` (default: `default_socket_path()`)."""
        return cls(await FramedStream.connect(path or default_socket_path(), limits=limits))

    async def __aenter__(self) -> AsyncClient:
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._read_events)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._task_group is not None, "__aenter__ started the reader"
        self._task_group.cancel_scope.cancel()
        try:
            return await self._task_group.__aexit__(*exc_info)
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()

    async def aclose(self) -> None:
        self._fail_pending(ClientError(DISCONNECTED, "client closed"))
        await self.framed.aclose()

    def next_id(self) -> int:
        return next(self._ids)

    async def _read_events(self) -> None:
        reason = ClientError(DISCONNECTED, "the daemon closed the connection")
        try:
            while True:
                event = await self._next_event()
                if event.id is None:  # an error about the connection itself
                    reason = ClientError(event.code, event.message)  # type: ignore[union-attr]
                    continue
                sender = self._pending.get(event.id)
                if sender is not None:
                    sender.send_nowait(event)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        except ProtocolError as exc:
            reason = ClientError(exc.code.value, f"bad frame from the daemon: {exc.message}")
        finally:
            self._fail_pending(reason)

    async def _next_event(self) -> Event:
        """The next event; one the client cannot read fails only the request it answers."""
        raw: dict[str, Any] | None = None
        try:
            raw = await self.framed.receive()
            return parse_event(raw)
        except ProtocolError as exc:
            if exc.fatal:
                raise
            request_id = exc.request_id if exc.request_id is not None else request_id_of(raw)
            return ErrorReply(request_id, exc.code.value, f"bad event from the daemon: {exc.message}")

    def _fail_pending(self, reason: ClientError) -> None:
        self._closed_reason = self._closed_reason or reason
        pending, self._pending = self._pending, {}
        for sender in pending.values():
            sender.close()

    def _forget(self, request_id: int) -> None:
        sender = self._pending.pop(request_id, None)
        if sender is not None:
            sender.close()

    async def _send_request(self, request: Any) -> MemoryObjectReceiveStream[Event]:
        if self._task_group is None:
            raise RuntimeError("use the client inside `async with`")
        if self._closed_reason is not None:
            raise self._closed_reason
        if request.id in self._pending:
            raise ValueError(f"request id {request.id} is in flight")
        # Unbounded: a consumer that reads one stream slowly must not stall the others.
        sender, receiver = anyio.create_memory_object_stream[Event](math.inf)
        self._pending[request.id] = sender
        try:
            await self.framed.send(request.to_wire())
        except BaseException:
            self._forget(request.id)
            raise
        return receiver

    async def _call(self, request: Any) -> Event:
        """Send a request that gets exactly one reply and return it."""
        receiver = await self._send_request(request)
        try:
            event = await receiver.receive()
        except anyio.EndOfStream:
            raise self._closed_reason or ClientError(DISCONNECTED, "connection closed") from None
        finally:
            self._forget(request.id)
            receiver.close()
        if isinstance(event, ErrorReply):
            raise ClientError(event.code, event.message)
        return event

    async def hello(self, versions: tuple[int, ...] = SUPPORTED_VERSIONS, client: str | None = None) -> HelloReply:
        reply = await self._call(Hello(self.next_id(), tuple(versions), client))
        assert isinstance(reply, HelloReply), f"hello answered by {reply.TYPE}"
        self.version = reply.version
        return reply

    async def _speak(self, version: int) -> None:
        """Negotiate at least `version` before a request that needs it (hello once)."""
        if self.version >= version:
            return
        reply = await self.hello()
        if reply.version < version:
            raise ClientError("unsupported_version", f"the daemon speaks protocol {reply.version}; "
                                                     f"this request needs {version}")

    def generate(self, *, sampling: Sampling | dict[str, Any] | None = None, **fields: Any) -> GenerateStream:
        """A GenerateStream for the fields of `Generate` (prompt | tokens | messages,
        max_tokens, stop, ...). `sampling` may be a Sampling or a map of its fields.
        Raises ClientError(bad_request) for fields the server would refuse, sending nothing."""
        try:
            if isinstance(sampling, dict):
                sampling = Sampling.from_wire(sampling)
            request = Generate(id=self.next_id(), sampling=sampling or Sampling(), **_tuples(fields))
            Generate.from_wire(request.to_wire())  # the server's own checks, run here first
        except ProtocolError as exc:
            raise ClientError(exc.code.value, exc.message) from None
        except TypeError as exc:  # an option Generate does not have
            raise ClientError("bad_request", f"generate: {exc}") from None
        return GenerateStream(self, request)

    async def cancel(self, target: int) -> None:
        """Cancel generate `target`. Raises ClientError(not_found) when it is not in flight."""
        await self._call(Cancel(self.next_id(), target))

    async def status(self) -> dict[str, Any]:
        reply = await self._call(Status(self.next_id()))
        assert isinstance(reply, StatusReply), f"status answered by {reply.TYPE}"
        return reply.info

    async def tokenize(
        self, text: str | None = None, messages: list[dict[str, Any]] | None = None, add_special: bool | None = None
    ) -> TokensReply:
        request = Tokenize(self.next_id(), text, None if messages is None else tuple(messages), add_special)
        return await self._call(request)  # type: ignore[return-value]

    async def detokenize(self, ids: list[int] | tuple[int, ...]) -> str:
        reply = await self._call(Detokenize(self.next_id(), tuple(ids)))
        assert isinstance(reply, TextReply), f"detokenize answered by {reply.TYPE}"
        return reply.text


def _tuples(fields: dict[str, Any]) -> dict[str, Any]:
    """Generate's sequence fields as tuples, so callers may pass lists."""
    sequences = ("tokens", "messages", "stop", "stop_ids", "chunk_starts", "cache_key", "images", "tools")
    return {k: tuple(v) if k in sequences and v is not None else v for k, v in fields.items()}


from prefixd.ipc.sync_client import SyncClient, SyncGenerateStream  # noqa: E402,F401  (same calls, blocking)
