"""The client library against a small fake server on a real Unix socket: multiplexed
concurrent generates, cancel, unary calls, errors, disconnects, and the sync client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import SocketStream, TaskGroup

from prefixd.ipc.client import AsyncClient, GenerateResult, SyncClient
from prefixd.ipc.errors import ClientError, ErrorCode, ProtocolError
from prefixd.ipc.messages import (
    Cancel,
    Detokenize,
    DoneEvent,
    ErrorReply,
    Generate,
    Hello,
    HelloReply,
    OkReply,
    Status,
    StatusReply,
    TextReply,
    TokenEvent,
    Tokenize,
    TokensReply,
    Usage,
    parse_request,
)
from prefixd.ipc.transport import FramedStream


def token_ids(request_id: int, n: int) -> list[int]:
    return [request_id * 1000 + k for k in range(n)]


@dataclass
class FakeServer:
    """Answers v1 requests. A generate emits one token per step and yields between steps,
    so concurrent generates interleave; with `hold=True` it waits for a cancel."""

    path: Path
    received: list[Any] = field(default_factory=list)
    cancelled: dict[int, anyio.Event] = field(default_factory=dict)
    close_after_first_token: bool = False

    async def handle(self, stream: SocketStream) -> None:
        framed = FramedStream(stream)  # type: ignore[arg-type]
        async with framed, anyio.create_task_group() as tg:
            try:
                while True:
                    try:
                        request = parse_request(await framed.receive())
                    except ProtocolError as exc:
                        await framed.send(exc.to_wire())
                        continue
                    self.received.append(request)
                    await self.answer(request, framed, tg)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                tg.cancel_scope.cancel()

    async def answer(self, request: Any, framed: FramedStream, tg: TaskGroup) -> None:
        if isinstance(request, Hello):
            if 1 not in request.versions:
                await framed.send(ErrorReply(request.id, "unsupported_version", "v1 only").to_wire())
            else:
                await framed.send(HelloReply(request.id, 1, "fake", {"name": "m"}, {"max_depth": 8}).to_wire())
        elif isinstance(request, Generate) and request.prompt == "conn-error":
            await framed.send(ErrorReply(None, "bad_frame", "your last frame was garbage").to_wire())
            await framed.aclose()
        elif isinstance(request, Generate) and request.prompt == "bad-event":
            await framed.send({"type": "token", "id": request.id, "ids": "not ids", "text": ""})
        elif isinstance(request, Generate):
            self.cancelled[request.id] = anyio.Event()
            tg.start_soon(self.generate, request, framed)
        elif isinstance(request, Cancel):
            # Look the target up before the first await: its generate may end (and forget it)
            # while the reply is being sent.
            stop = self.cancelled.get(request.target)
            if stop is None:
                await framed.send(ErrorReply(request.id, "not_found", f"no generate {request.target}").to_wire())
            else:
                stop.set()
                await framed.send(OkReply(request.id).to_wire())
        elif isinstance(request, Status):
            await framed.send(StatusReply(request.id, {"lanes_busy": len(self.cancelled)}).to_wire())
        elif isinstance(request, Tokenize):
            await framed.send(TokensReply(request.id, tuple((request.text or "").encode())).to_wire())
        elif isinstance(request, Detokenize):
            await framed.send(TextReply(request.id, bytes(request.ids).decode()).to_wire())

    async def generate(self, request: Generate, framed: FramedStream) -> None:
        stop = self.cancelled[request.id]
        ids = token_ids(request.id, request.max_tokens)
        sent = 0
        while sent < len(ids) and not stop.is_set():
            await framed.send(TokenEvent(request.id, (ids[sent],), chr(ord("a") + sent % 26)).to_wire())
            sent += 1
            if self.close_after_first_token:
                await framed.aclose()
                return
            await anyio.sleep(0)
        while request.max_tokens > 10_000 and not stop.is_set():
            await stop.wait()  # a "long" generate runs until cancelled
        reason = "cancelled" if stop.is_set() else "length"
        usage = Usage(prompt_tokens=len(request.tokens or ()), completion_tokens=sent, cache="off")
        await framed.send(DoneEvent(request.id, reason, usage).to_wire())
        del self.cancelled[request.id]


@asynccontextmanager
async def serving(path: Path) -> AsyncIterator[FakeServer]:
    """A FakeServer listening at `path` for the body of the `async with`."""
    fake = FakeServer(path)
    async with await anyio.create_unix_listener(path) as listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, fake.handle)
        yield fake
        tg.cancel_scope.cancel()


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "prefixd.sock"


async def test_concurrent_generates_on_one_connection_each_get_their_own_events(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        results: dict[int, GenerateResult] = {}
        async with await AsyncClient.connect(server.path) as client:

            async def run(n: int) -> None:
                result = await client.generate(prompt="p", max_tokens=n).collect()
                results[result.id] = result

            async with anyio.create_task_group() as tg:
                for n in (5, 8, 3, 6):
                    tg.start_soon(run, n)
        assert sorted(results) == [1, 2, 3, 4]
        by_len = {len(r.ids): r for r in results.values()}
        for n, result in by_len.items():
            assert result.ids == tuple(token_ids(result.id, n))
            assert result.text == "abcdefgh"[:n]
            assert (result.finish_reason, result.usage.completion_tokens) == ("length", n)


async def test_iterating_a_generate_yields_tokens_then_done(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            events = [event async for event in client.generate(tokens=[1, 2, 3], max_tokens=3)]
        assert [type(e) for e in events] == [TokenEvent, TokenEvent, TokenEvent, DoneEvent]
        assert [e.ids for e in events[:3]] == [(1000,), (1001,), (1002,)]
        assert events[3].usage.prompt_tokens == 3


async def test_cancel_ends_the_target_with_done_cancelled(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            stream = await client.generate(prompt="long", max_tokens=100_000).start()
            first = await stream.__anext__()
            assert isinstance(first, TokenEvent)
            other = await client.generate(prompt="short", max_tokens=2).collect()  # the connection still serves
            await client.cancel(stream.id)
            rest = [event async for event in stream]
        assert other.ids == tuple(token_ids(other.id, 2))
        assert isinstance(rest[-1], DoneEvent) and rest[-1].finish_reason == "cancelled"
        assert Cancel(3, stream.id) in server.received  # ids: 1 and 2 generates, 3 the cancel


async def test_leaving_async_with_early_cancels_the_generate(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            async with client.generate(prompt="long", max_tokens=100_000) as stream:
                async for event in stream:
                    assert isinstance(event, TokenEvent)
                    break
            assert stream.done is None
            await client.status()  # answered after the cancel: the server reads in order
        assert any(isinstance(r, Cancel) and r.target == stream.id for r in server.received)


async def test_cancel_of_an_unknown_id_raises_not_found(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            with pytest.raises(ClientError) as info:
                await client.cancel(999)
        assert info.value.code == ErrorCode.NOT_FOUND.value


async def test_an_unreadable_event_fails_only_its_request(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            with pytest.raises(ClientError) as info:
                await client.generate(prompt="bad-event", max_tokens=1).collect()
            result = await client.generate(prompt="fine", max_tokens=2).collect()
    assert (info.value.code, info.value.message) == (
        "bad_request", "bad event from the daemon: ids: must be an array, got string",
    )
    assert result.ids == tuple(token_ids(result.id, 2))


async def test_a_connection_error_fails_pending_requests_with_its_code(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            with pytest.raises(ClientError) as info:
                await client.generate(prompt="conn-error", max_tokens=1).collect()
    assert (info.value.code, info.value.message) == ("bad_frame", "your last frame was garbage")


async def test_unary_calls(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            hello = await client.hello(client="tests")
            assert (hello.version, hello.server, hello.model) == (1, "fake", {"name": "m"})
            assert await client.status() == {"lanes_busy": 0}
            assert (await client.tokenize("hi")).ids == (104, 105)
            assert await client.detokenize([104, 105]) == "hi"
            with pytest.raises(ClientError) as info:
                await client.hello(versions=(3,))
        assert info.value.code == "unsupported_version"
        assert server.received[0] == Hello(1, (1, 2), "tests")


async def test_long_token_prompts_travel_as_memfds(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        tokens = list(range(50_000))
        async with await AsyncClient.connect(server.path) as client:
            result = await client.generate(tokens=tokens, max_tokens=1).collect()
        assert result.usage.prompt_tokens == 50_000
        assert server.received[0].tokens == tuple(tokens)


async def test_bad_request_comes_back_as_client_error(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            # Built by hand: the client's own Generate would refuse max_tokens=0 locally.
            receiver = await client._send_request(_Raw({"type": "generate", "id": 77, "prompt": "x", "max_tokens": 0}))
            with receiver:
                reply = await receiver.receive()
        assert reply == ErrorReply(77, "bad_request", "max_tokens: 0 outside [1, 2147483647]")


@dataclass(frozen=True)
class _Raw:
    wire: dict[str, Any]

    @property
    def id(self) -> int:
        return self.wire["id"]

    def to_wire(self) -> dict[str, Any]:
        return self.wire


async def test_server_closing_mid_generate_raises_disconnected(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        server.close_after_first_token = True
        async with await AsyncClient.connect(server.path) as client:
            stream = client.generate(prompt="x", max_tokens=5)
            with pytest.raises(ClientError) as info:
                async for _ in stream:
                    pass
            with pytest.raises(ClientError):
                await client.status()
        assert info.value.code == "disconnected"


async def test_client_refuses_a_bad_generate_before_sending(sock_path: Path) -> None:
    async with serving(sock_path) as server:
        async with await AsyncClient.connect(server.path) as client:
            with pytest.raises(ClientError) as info:
                client.generate(prompt="x", max_tokens=0)
            assert await client.status() == {"lanes_busy": 0}
        assert [type(r) for r in server.received] == [Status]
    assert (info.value.code, info.value.message) == ("bad_request", "max_tokens: 0 outside [1, 2147483647]")


def test_sync_client_makes_the_same_calls(tmp_path: Path) -> None:
    async def serve(fake: FakeServer, ready: anyio.Event, stop: anyio.Event) -> None:
        async with await anyio.create_unix_listener(fake.path) as listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, fake.handle)
            ready.set()
            await stop.wait()
            tg.cancel_scope.cancel()

    from anyio.from_thread import start_blocking_portal

    fake = FakeServer(tmp_path / "s.sock")
    with start_blocking_portal() as portal:
        ready, stop = portal.call(lambda: (anyio.Event(), anyio.Event()))  # type: ignore[arg-type,return-value]
        future = portal.start_task_soon(serve, fake, ready, stop)
        portal.call(ready.wait)
        try:
            with SyncClient(fake.path) as client:
                assert client.status() == {"lanes_busy": 0}
                events = list(client.generate(prompt="x", max_tokens=2))
                assert [type(e) for e in events] == [TokenEvent, TokenEvent, DoneEvent]
                result = client.generate(prompt="y", max_tokens=3).collect()
                assert result.ids == tuple(token_ids(result.id, 3)) and result.text == "abc"
                with client.generate(prompt="z", max_tokens=100_000) as stream:
                    first = next(iter(stream))
                    assert isinstance(first, TokenEvent)
                    client.cancel(stream.id)
                assert client.detokenize([104, 105]) == "hi"
                with pytest.raises(ClientError):
                    client.cancel(12345)
        finally:
            portal.call(stop.set)
            future.result()
